//! How an event travels on NATS: its subject and headers. Pure functions and names only, shared by the
//! relay that publishes and the projections that consume, so both sides agree by construction.

use crate::envelope::EventEnvelope;

/// JetStream's dedupe header; always the event id.
pub const MSG_ID: &str = "Nats-Msg-Id";
/// The event type, e.g. `order.placed`.
pub const EVENT_TYPE: &str = "Waybill-Event-Type";
/// The payload version.
pub const EVENT_VERSION: &str = "Waybill-Event-Version";
/// The aggregate type, e.g. `order`.
pub const AGGREGATE_TYPE: &str = "Waybill-Aggregate-Type";
/// The aggregate id.
pub const AGGREGATE_ID: &str = "Waybill-Aggregate-Id";
/// The aggregate version: the per-aggregate order key.
pub const AGGREGATE_VERSION: &str = "Waybill-Aggregate-Version";
/// W3C trace context, when the command carried one.
pub const TRACEPARENT: &str = "traceparent";
/// The body's media type.
pub const CONTENT_TYPE: &str = "Content-Type";

/// Default subject prefix: subjects are `waybill.events.<aggregate type>.<aggregate id>`.
pub const DEFAULT_SUBJECT_PREFIX: &str = "waybill.events";
/// Default JetStream stream name.
pub const DEFAULT_STREAM: &str = "WAYBILL_EVENTS";

/// The subject for `envelope`: the prefix, the aggregate type, then the aggregate id — e.g.
/// `waybill.events.order.0190…`. Every event of one aggregate goes on one subject, whatever its type
/// (which travels in [`EVENT_TYPE`]): that is what lets the relay fence an aggregate's publishes with
/// `Nats-Expected-Last-Subject-Sequence`, and what keeps its order in any consumer of the subject.
pub fn subject(prefix: &str, envelope: &EventEnvelope) -> Result<String, String> {
    subject_for(prefix, &envelope.aggregate_type, envelope.aggregate_id)
}

/// [`subject`] from the routing facts alone.
pub fn subject_for(
    prefix: &str,
    aggregate_type: &str,
    aggregate_id: uuid::Uuid,
) -> Result<String, String> {
    check_subject_tokens(prefix, "subject prefix")?;
    check_subject_tokens(aggregate_type, "aggregate type")?;
    if aggregate_type.contains('.') {
        return Err(format!(
            "aggregate type {aggregate_type:?} must be one subject token (no dots)"
        ));
    }
    Ok(format!("{prefix}.{aggregate_type}.{aggregate_id}"))
}

/// The aggregate id a subject names: its last token, when that is a UUID.
pub fn aggregate_id_of_subject(subject: &str) -> Option<uuid::Uuid> {
    subject
        .rsplit('.')
        .next()
        .and_then(|token| uuid::Uuid::parse_str(token).ok())
}

/// The filter matching every subject under `prefix`.
pub fn all_subjects(prefix: &str) -> String {
    format!("{prefix}.>")
}

/// A dotted name is usable in a subject if every token is non-empty and free of wildcards and spaces.
pub fn check_subject_tokens(dotted: &str, what: &str) -> Result<(), String> {
    let bad = dotted.is_empty()
        || dotted.split('.').any(|token| {
            token.is_empty()
                || token
                    .chars()
                    .any(|c| c.is_whitespace() || c == '*' || c == '>')
        });
    if bad {
        Err(format!(
            "{what} {dotted:?} is not a valid NATS subject (empty token, space or wildcard)"
        ))
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::EventEnvelope;
    use serde_json::json;
    use uuid::Uuid;

    fn envelope(event_type: &str) -> EventEnvelope {
        EventEnvelope {
            event_id: Uuid::nil(),
            event_type: event_type.into(),
            event_version: 1,
            aggregate_type: "order".into(),
            aggregate_id: Uuid::from_u128(7),
            aggregate_version: 1,
            occurred_at: chrono::DateTime::UNIX_EPOCH,
            correlation_id: None,
            causation_id: None,
            payload: json!({}),
        }
    }

    #[test]
    fn every_event_of_an_aggregate_goes_on_its_subject() {
        let placed = subject("waybill.events", &envelope("order.placed")).expect("valid");
        let paid = subject("waybill.events", &envelope("order.paid")).expect("valid");
        assert_eq!(
            placed,
            "waybill.events.order.00000000-0000-0000-0000-000000000007"
        );
        assert_eq!(
            placed, paid,
            "the type travels in a header, not the subject"
        );
        assert_eq!(aggregate_id_of_subject(&placed), Some(Uuid::from_u128(7)));
        assert_eq!(aggregate_id_of_subject("waybill.events.order.x"), None);
    }

    #[test]
    fn wildcards_and_blanks_are_refused() {
        for bad in [
            "order.*",
            "order..placed",
            "order placed",
            "",
            "order.>",
            "*",
            "a.b",
        ] {
            assert!(
                subject_for("p", bad, Uuid::from_u128(7)).is_err(),
                "{bad:?}"
            );
        }
        assert!(subject("bad prefix", &envelope("order.placed")).is_err());
    }
}
