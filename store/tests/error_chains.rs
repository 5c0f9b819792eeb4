//! Printed error chains say each thing once: the store's errors say what failed, their `source()` says
//! why, and no message repeats its source. No database needed.

use std::error::Error;

use chrono::Utc;
use domain::{
    CancelOrder, EventEnvelope, EventMeta, Note, OrderCancelled, OrderEvent, OrderId, Upcasters,
};
use serde_json::json;
use store::{AppendError, CommandError, LoadError};
use uuid::Uuid;

use testkit::assert_said_once;

/// A real database-side failure whose own message quotes nothing (sqlx's `Io`, `Database` and `Decode`
/// variants repeat their source in their message themselves; that is sqlx's, not ours).
fn sqlx_error() -> sqlx::Error {
    sqlx::Error::Protocol("unexpected message from the server".to_owned())
}

/// A real decode failure: a stored payload that is not an `order.cancelled`.
fn undecodable() -> LoadError {
    let event = OrderEvent::Cancelled(OrderCancelled::from_command(&CancelOrder {
        reason: Note::parse("changed my mind").expect("note"),
    }));
    let meta = EventMeta {
        event_id: Uuid::now_v7(),
        occurred_at: Utc::now(),
        correlation_id: None,
        causation_id: None,
    };
    let mut envelope = EventEnvelope::wrap(&event, OrderId::from_uuid(Uuid::now_v7()), 2, meta);
    envelope.payload = json!({"nonsense": true});
    let source = envelope
        .decode(&Upcasters::orders())
        .expect_err("corrupt payload");
    LoadError::Undecodable {
        event_id: envelope.event_id,
        aggregate_id: envelope.aggregate_id,
        aggregate_version: envelope.aggregate_version,
        source,
    }
}

#[test]
fn an_undecodable_event_names_the_event_and_order_and_says_why_once() {
    let error = undecodable();
    let LoadError::Undecodable {
        event_id,
        aggregate_id,
        ..
    } = &error
    else {
        unreachable!()
    };
    let printed = assert_said_once(&error);
    assert!(
        printed.starts_with(&format!(
            "event {event_id} (version 2 of {aggregate_id}) cannot be decoded: \
             order.cancelled payload does not match its schema: "
        )),
        "{printed}"
    );
    assert!(printed.contains("nonsense"), "the why is kept: {printed}");

    // Through a command, the load error is passed on as it is.
    let printed = assert_said_once(&CommandError::<domain::OrderError>::from(undecodable()));
    assert!(printed.contains("cannot be decoded"), "{printed}");
}

#[test]
fn database_failures_say_what_failed_and_leave_the_why_to_the_source() {
    let why = sqlx_error().to_string();

    let printed = assert_said_once(&LoadError::from(sqlx_error()));
    assert_eq!(printed, format!("reading events failed: {why}"));

    let printed = assert_said_once(&AppendError::from(sqlx_error()));
    assert_eq!(printed, format!("appending events failed: {why}"));

    let printed = assert_said_once(&CommandError::<domain::OrderError>::from(sqlx_error()));
    assert_eq!(printed, format!("database error: {why}"));

    let printed = assert_said_once(&CommandError::<domain::OrderError>::Load(LoadError::from(
        sqlx_error(),
    )));
    assert_eq!(printed, format!("reading events failed: {why}"));

    let printed = assert_said_once(&CommandError::<domain::OrderError>::Append(
        AppendError::from(sqlx_error()),
    ));
    assert_eq!(printed, format!("appending events failed: {why}"));
}

#[test]
fn a_database_failure_with_a_cause_keeps_the_cause_in_the_chain() {
    // The root cause is reached through `source()`, not through our message.
    let io = std::io::Error::other("disk on fire");
    let error = LoadError::from(sqlx::Error::Io(io));
    assert_eq!(error.to_string(), "reading events failed");
    let mut root: &dyn Error = &error;
    while let Some(cause) = root.source() {
        root = cause;
    }
    assert_eq!(root.to_string(), "disk on fire");
}
