//! From a JetStream message to a decoded event, or to the reason it is poison.

use async_nats::HeaderMap;
use bytes::Bytes;
use chrono::{DateTime, Utc};
use domain::{EventEnvelope, OrderEvent, OrderId, Upcasters};
use serde_json::{Map, Value};
use uuid::Uuid;

/// An event ready to apply: upcast to the current shape and decoded.
#[derive(Debug, Clone, PartialEq)]
pub struct Decoded {
    /// The event id (idempotency key of ledgers).
    pub event_id: Uuid,
    /// The order.
    pub order_id: OrderId,
    /// Its position in the order's stream.
    pub aggregate_version: i64,
    /// When it happened.
    pub occurred_at: DateTime<Utc>,
    /// What happened, in the current shape.
    pub event: OrderEvent,
}

/// A message that cannot be applied by this code: kept whole, with why.
#[derive(Debug, Clone, PartialEq)]
pub struct Poison {
    /// Why it cannot be applied.
    pub reason: String,
    /// Whatever routing facts could be read (absent for garbage).
    pub event_id: Option<Uuid>,
    /// The aggregate, if known.
    pub aggregate_id: Option<Uuid>,
    /// The version, if known.
    pub aggregate_version: Option<i64>,
}

/// A raw message as received, detached from the broker.
#[derive(Debug, Clone, PartialEq)]
pub struct RawMessage {
    /// Stream sequence (the message's identity in the stream).
    pub stream_sequence: u64,
    /// Subject it was published to.
    pub subject: String,
    /// Headers.
    pub headers: Option<HeaderMap>,
    /// Body, verbatim.
    pub body: Bytes,
}

impl RawMessage {
    /// The headers as a JSON object (multi-valued headers become arrays), for the parked table. NUL
    /// characters are dropped: PostgreSQL's JSON cannot hold them.
    pub fn headers_json(&self) -> Value {
        let clean = |s: &str| s.replace('\0', "");
        let mut object = Map::new();
        if let Some(headers) = &self.headers {
            for (name, values) in headers.iter() {
                let values: Vec<Value> = values
                    .iter()
                    .map(|v| Value::String(clean(v.as_str())))
                    .collect();
                let value = if values.len() == 1 {
                    values[0].clone()
                } else {
                    Value::Array(values)
                };
                object.insert(clean(name.as_ref()), value);
            }
        }
        Value::Object(object)
    }

    /// Rebuilds a header map from what [`RawMessage::headers_json`] stored.
    pub fn headers_from_json(value: &Value) -> Option<HeaderMap> {
        let object = value.as_object()?;
        let mut headers = HeaderMap::new();
        for (name, value) in object {
            match value {
                Value::String(s) => headers.append(name.as_str(), s.as_str()),
                Value::Array(items) => {
                    for item in items.iter().filter_map(Value::as_str) {
                        headers.append(name.as_str(), item);
                    }
                }
                _ => {}
            }
        }
        Some(headers)
    }
}

/// Decodes a message body: parse the envelope, upcast, decode. Never panics.
pub fn decode(body: &[u8], upcasters: &Upcasters) -> Result<Decoded, Poison> {
    let envelope = EventEnvelope::from_json(body).map_err(|e| Poison {
        reason: format!("undecodable body: {e}"),
        event_id: None,
        aggregate_id: None,
        aggregate_version: None,
    })?;
    let event = envelope.decode(upcasters).map_err(|e| Poison {
        reason: e.to_string(),
        event_id: Some(envelope.event_id),
        aggregate_id: Some(envelope.aggregate_id),
        aggregate_version: Some(envelope.aggregate_version),
    })?;
    if envelope.aggregate_version < 1 {
        return Err(Poison {
            reason: format!(
                "aggregate version {} is not positive",
                envelope.aggregate_version
            ),
            event_id: Some(envelope.event_id),
            aggregate_id: Some(envelope.aggregate_id),
            aggregate_version: Some(envelope.aggregate_version),
        });
    }
    Ok(Decoded {
        event_id: envelope.event_id,
        order_id: OrderId::from_uuid(envelope.aggregate_id),
        aggregate_version: envelope.aggregate_version,
        occurred_at: envelope.occurred_at,
        event,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn envelope(event_type: &str, version: i32, payload: Value) -> Vec<u8> {
        serde_json::to_vec(&json!({
            "event_id": Uuid::nil(), "event_type": event_type, "event_version": version,
            "aggregate_type": "order", "aggregate_id": Uuid::from_u128(1), "aggregate_version": 1,
            "occurred_at": "2026-11-30T10:00:00Z", "correlation_id": null, "causation_id": null,
            "payload": payload,
        }))
        .expect("json")
    }

    #[test]
    fn garbage_is_poison_without_routing_facts() {
        let poison = decode(b"\x00\xffnot json", &Upcasters::orders()).expect_err("garbage");
        assert!(
            poison.reason.starts_with("undecodable body"),
            "{}",
            poison.reason
        );
        assert_eq!(poison.aggregate_id, None);
    }

    #[test]
    fn an_unknown_type_and_a_future_version_are_poison_with_their_aggregate() {
        let upcasters = Upcasters::orders();
        let unknown =
            decode(&envelope("order.teleported", 1, json!({})), &upcasters).expect_err("unknown");
        assert!(
            unknown.reason.contains("unknown event type"),
            "{}",
            unknown.reason
        );
        assert_eq!(unknown.aggregate_id, Some(Uuid::from_u128(1)));
        let future = decode(&envelope("order.paid", 9, json!({})), &upcasters).expect_err("future");
        assert!(
            future.reason.contains("newer than this code knows"),
            "{}",
            future.reason
        );
    }

    #[test]
    fn a_legacy_placed_event_is_upcast() {
        let body = envelope(
            "order.placed",
            1,
            json!({"order_no": "A-1", "amount_cents": 500}),
        );
        let decoded = decode(&body, &Upcasters::orders()).expect("decodes");
        let OrderEvent::Placed(placed) = decoded.event else {
            panic!("not placed")
        };
        assert_eq!(placed.total_cents, 500);
    }

    #[test]
    fn headers_survive_the_round_trip_through_json() {
        let mut headers = HeaderMap::new();
        headers.insert("Nats-Msg-Id", "abc");
        headers.append("X-Multi", "1");
        headers.append("X-Multi", "2");
        let raw = RawMessage {
            stream_sequence: 1,
            subject: "s".into(),
            headers: Some(headers),
            body: Bytes::new(),
        };
        let json = raw.headers_json();
        assert_eq!(json["Nats-Msg-Id"], "abc");
        assert_eq!(json["X-Multi"], json!(["1", "2"]));
        let back = RawMessage::headers_from_json(&json).expect("object");
        assert_eq!(back.get("Nats-Msg-Id").map(|v| v.as_str()), Some("abc"));
    }
}
