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

/// Default subject prefix: subjects are `waybill.events.<event type tokens>.<aggregate id>`.
pub const DEFAULT_SUBJECT_PREFIX: &str = "waybill.events";
/// Default JetStream stream name.
pub const DEFAULT_STREAM: &str = "WAYBILL_EVENTS";

/// The subject for `envelope`: the prefix, the event type's tokens, then the aggregate id as its own
/// token — e.g. `waybill.events.order.placed.0190…`. Consumers can filter by type or by aggregate.
pub fn subject(prefix: &str, envelope: &EventEnvelope) -> Result<String, String> {
    subject_for(prefix, &envelope.event_type, envelope.aggregate_id)
}

/// [`subject`] from the routing facts alone.
pub fn subject_for(
    prefix: &str,
    event_type: &str,
    aggregate_id: uuid::Uuid,
) -> Result<String, String> {
    check_subject_tokens(prefix, "subject prefix")?;
    check_subject_tokens(event_type, "event type")?;
    Ok(format!("{prefix}.{event_type}.{aggregate_id}"))
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
    fn the_type_and_the_aggregate_are_separate_tokens() {
        let subject = subject("waybill.events", &envelope("order.placed")).expect("valid");
        assert_eq!(
            subject,
            "waybill.events.order.placed.00000000-0000-0000-0000-000000000007"
        );
    }

    #[test]
    fn wildcards_and_blanks_are_refused() {
        for bad in ["order.*", "order..placed", "order placed", "", "order.>"] {
            assert!(subject("p", &envelope(bad)).is_err(), "{bad:?}");
        }
        assert!(subject("bad prefix", &envelope("order.placed")).is_err());
    }
}
