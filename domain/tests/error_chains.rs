//! Printed error chains say each thing once: an error's message says what failed, its `source()` says
//! why, and no message repeats its source.

use chrono::Utc;
use domain::{
    CURRENT_VERSIONS, CancelOrder, DecodeError, EventEnvelope, EventMeta, Note, OrderCancelled,
    OrderEvent, OrderId, PayOrder, PayloadError, ShipOrder, Upcasters,
};
use serde_json::json;
use uuid::Uuid;

use testkit::assert_said_once;

fn serde_error() -> serde_json::Error {
    serde_json::from_str::<serde_json::Value>("{not json").expect_err("garbage does not parse")
}

fn corrupt_envelope() -> EventEnvelope {
    let event = OrderEvent::Cancelled(OrderCancelled::from_command(&CancelOrder {
        reason: Note::parse("changed my mind").expect("note"),
    }));
    let meta = EventMeta {
        event_id: Uuid::now_v7(),
        occurred_at: Utc::now(),
        correlation_id: None,
        causation_id: None,
    };
    let mut envelope = EventEnvelope::wrap(&event, OrderId::from_uuid(Uuid::now_v7()), 1, meta);
    envelope.payload = json!({"nonsense": true});
    envelope
}

#[test]
fn a_body_that_is_not_an_envelope_says_so_once() {
    let why = serde_error().to_string();
    let error = EventEnvelope::from_json(b"{not json").expect_err("garbage");
    assert!(matches!(error, DecodeError::Envelope(_)), "{error:?}");
    let printed = assert_said_once(&error);
    assert_eq!(printed, format!("not an event envelope: {why}"));

    let error = DecodeError::from(serde_error());
    assert_said_once(&error);
}

#[test]
fn a_payload_off_its_schema_names_the_type_and_says_why_once() {
    let error = OrderEvent::from_payload(OrderEvent::PAID, json!({"nonsense": true}))
        .expect_err("not a payment");
    assert!(matches!(error, PayloadError::Shape { .. }), "{error:?}");
    let printed = assert_said_once(&error);
    assert!(
        printed.starts_with("order.paid payload does not match its schema: "),
        "{printed}"
    );
    assert!(printed.contains("nonsense"), "the why is kept: {printed}");
}

#[test]
fn a_corrupt_envelope_payload_decodes_to_a_chain_that_says_each_thing_once() {
    let error = corrupt_envelope()
        .decode(&Upcasters::orders())
        .expect_err("corrupt payload");
    assert!(matches!(error, DecodeError::Payload(_)), "{error:?}");
    let printed = assert_said_once(&error);
    assert!(
        printed.starts_with("order.cancelled payload does not match its schema: "),
        "{printed}"
    );
    assert!(printed.contains("nonsense"), "the why is kept: {printed}");
}

#[test]
fn every_event_type_writes_its_current_version() {
    let note = || Note::parse("n").expect("note");
    let events = [
        OrderEvent::Cancelled(OrderCancelled::from_command(&CancelOrder {
            reason: note(),
        })),
        OrderEvent::Shipped(domain::OrderShipped::from_command(&ShipOrder {
            carrier: note(),
            tracking_number: note(),
        })),
        OrderEvent::Paid(domain::OrderPaid::from_command(&PayOrder {
            amount_cents: domain::Cents::new(1).expect("cents"),
            payment_ref: None,
        })),
    ];
    for event in &events {
        let listed = CURRENT_VERSIONS
            .iter()
            .find(|(t, _)| *t == event.event_type())
            .map(|(_, v)| *v);
        assert_eq!(
            Some(event.event_version()),
            listed,
            "{}",
            event.event_type()
        );
        assert!(event.to_payload().is_object(), "{}", event.event_type());
    }
    assert!(
        CURRENT_VERSIONS
            .iter()
            .any(|(t, _)| *t == OrderEvent::PLACED)
    );
}

#[test]
fn an_envelope_serializes_to_a_body_that_reads_back() {
    let envelope = corrupt_envelope();
    let body = envelope.to_json_string();
    assert!(!body.is_empty());
    assert_eq!(
        EventEnvelope::from_json(body.as_bytes()).expect("reads back"),
        envelope
    );
}
