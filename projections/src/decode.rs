//! From a JetStream message to a decoded event that can be trusted to be consistent, or to the reason
//! it is poison. Everything here is pure: no database, no broker.
//!
//! Trust means consistency, not authenticity: whoever may publish on the stream is decided by NATS
//! permissions. What is checked here is that the message agrees with itself (headers, subject and
//! body name the same event) and with the domain's own bounds, so a malformed or half-forged message
//! is parked with its reason instead of being applied.

use async_nats::HeaderMap;
use bytes::Bytes;
use chrono::{DateTime, NaiveDate, Utc};
use domain::{AnyEvent, CustomerEvent, EventEnvelope, OrderEvent, OrderId, Upcasters, wire};
use serde_json::{Map, Value};
use uuid::Uuid;

/// The events a projection takes: those of one aggregate type (`OrderEvent`, `CustomerEvent`), or of
/// any ([`AnyEvent`]). The runner hands a projection only the aggregate types it declares
/// ([`crate::Projection::AGGREGATES`]), each narrowed to its event type.
pub trait ProjectionEvent: Clone + std::fmt::Debug + PartialEq + Send + Sync + 'static {
    /// The event, if it is of this type.
    fn from_any(event: AnyEvent) -> Option<Self>;
}

impl ProjectionEvent for AnyEvent {
    fn from_any(event: AnyEvent) -> Option<Self> {
        Some(event)
    }
}

impl ProjectionEvent for OrderEvent {
    fn from_any(event: AnyEvent) -> Option<Self> {
        match event {
            AnyEvent::Order(event) => Some(event),
            AnyEvent::Customer(_) => None,
        }
    }
}

impl ProjectionEvent for CustomerEvent {
    fn from_any(event: AnyEvent) -> Option<Self> {
        match event {
            AnyEvent::Customer(event) => Some(event),
            AnyEvent::Order(_) => None,
        }
    }
}

/// An event ready to apply: upcast to the current shape and decoded.
#[derive(Debug, Clone, PartialEq)]
pub struct Decoded<E = AnyEvent> {
    /// The event id (idempotency key of ledgers).
    pub event_id: Uuid,
    /// Its aggregate's id.
    pub aggregate_id: Uuid,
    /// Its position in the aggregate's stream.
    pub aggregate_version: i64,
    /// When it happened (within PostgreSQL's `timestamptz` range: checked at decode).
    pub occurred_at: DateTime<Utc>,
    /// What happened, in the current shape.
    pub event: E,
}

impl<E> Decoded<E> {
    /// The aggregate's id as an order's (for projections of orders).
    pub fn order_id(&self) -> OrderId {
        OrderId::from_uuid(self.aggregate_id)
    }
}

impl Decoded {
    /// The event as `E`'s, if it is one (a projection sees only the types it reads).
    pub fn narrow<E: ProjectionEvent>(&self) -> Option<Decoded<E>> {
        Some(Decoded {
            event_id: self.event_id,
            aggregate_id: self.aggregate_id,
            aggregate_version: self.aggregate_version,
            occurred_at: self.occurred_at,
            event: E::from_any(self.event.clone())?,
        })
    }
}

/// A message that cannot be applied by this code, with why.
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

impl Poison {
    fn garbage(reason: String) -> Self {
        Self {
            reason,
            event_id: None,
            aggregate_id: None,
            aggregate_version: None,
        }
    }

    fn of(envelope: &EventEnvelope, reason: String) -> Self {
        Self {
            reason,
            event_id: Some(envelope.event_id),
            aggregate_id: Some(envelope.aggregate_id),
            aggregate_version: Some(envelope.aggregate_version),
        }
    }
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
    /// The headers as a JSON object (multi-valued headers become arrays). Serialized with
    /// `serde_json`, any character survives, NUL included (as `\u0000`): the parked table keeps these
    /// bytes in a `bytea` column, because PostgreSQL's JSON types refuse `\u0000`.
    pub fn headers_json(&self) -> Value {
        let mut object = Map::new();
        if let Some(headers) = &self.headers {
            for (name, values) in headers.iter() {
                let values: Vec<Value> = values
                    .iter()
                    .map(|v| Value::String(v.as_str().to_owned()))
                    .collect();
                let value = if values.len() == 1 {
                    values[0].clone()
                } else {
                    Value::Array(values)
                };
                object.insert(name.to_string(), value);
            }
        }
        Value::Object(object)
    }

    /// Rebuilds a header map from what [`RawMessage::headers_json`] stored.
    pub fn headers_from_json(value: &Value) -> Option<HeaderMap> {
        let object = value.as_object()?;
        let mut headers = HeaderMap::new();
        // async-nats panics on a name it cannot send; a stored row edited by hand must not crash.
        let sendable =
            |name: &str| !name.is_empty() && name.chars().all(|c| c.is_ascii_graphic() && c != ':');
        for (name, value) in object.iter().filter(|(name, _)| sendable(name)) {
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

    /// The single value of header `name`: `Err` when it is missing or repeated.
    fn header(&self, name: &str) -> Result<&str, String> {
        let values: Vec<&str> = match &self.headers {
            Some(headers) => headers.get_all(name).map(|v| v.as_str()).collect(),
            None => Vec::new(),
        };
        match values[..] {
            [value] => Ok(value),
            [] => Err(format!("header {name} is missing")),
            _ => Err(format!("header {name} appears {} times", values.len())),
        }
    }
}

/// The aggregate type a subject `<prefix>.<aggregate type>.<aggregate id>` names (with the partition
/// token before the type, `<prefix>.<K>.<type>.<id>`, in a stream the server splits), or `None` when
/// the subject has another shape (then the message is decoded, and parked if it is not an event).
pub fn subject_aggregate_type<'a>(prefix: &str, subject: &'a str) -> Option<&'a str> {
    wire::stored_subject_tokens(prefix, subject).map(|(aggregate_type, _)| aggregate_type)
}

/// Decodes a message received from the stream: the body (see [`decode`]), then the trust checks that
/// tie the message's headers and subject to its body.
pub fn decode_message(message: &RawMessage, upcasters: &Upcasters) -> Result<Decoded, Poison> {
    let (envelope, decoded) = decode_envelope(&message.body, upcasters)?;
    check_routing(message, &envelope).map_err(|reason| Poison::of(&envelope, reason))?;
    Ok(decoded)
}

/// Decodes a message body: parse the envelope, upcast, decode, check the domain's bounds. Never panics.
pub fn decode(body: &[u8], upcasters: &Upcasters) -> Result<Decoded, Poison> {
    decode_envelope(body, upcasters).map(|(_, decoded)| decoded)
}

fn decode_envelope(body: &[u8], upcasters: &Upcasters) -> Result<(EventEnvelope, Decoded), Poison> {
    let envelope = EventEnvelope::from_json(body)
        .map_err(|e| Poison::garbage(format!("undecodable body: {}", ops::error_chain(&e))))?;
    let event = envelope
        .decode_any(upcasters)
        .map_err(|e| Poison::of(&envelope, ops::error_chain(&e)))?;
    if envelope.aggregate_version < 1 {
        return Err(Poison::of(
            &envelope,
            format!(
                "aggregate version {} is not positive",
                envelope.aggregate_version
            ),
        ));
    }
    check_time(envelope.occurred_at).map_err(|reason| Poison::of(&envelope, reason))?;
    check_bounds(&event, envelope.aggregate_version)
        .map_err(|reason| Poison::of(&envelope, reason))?;
    let decoded = Decoded {
        event_id: envelope.event_id,
        aggregate_id: envelope.aggregate_id,
        aggregate_version: envelope.aggregate_version,
        occurred_at: envelope.occurred_at,
        event,
    };
    Ok((envelope, decoded))
}

/// PostgreSQL's `timestamptz` holds 4714-11-24 BC .. 294276-12-31 AD; chrono holds years -262143 ..
/// 262142. A time before PostgreSQL's first day would fail the whole batch's transaction, so it is
/// poison here; chrono cannot even represent a time after PostgreSQL's last day.
fn check_time(at: DateTime<Utc>) -> Result<(), String> {
    let first =
        NaiveDate::from_ymd_opt(-4713, 11, 24).expect("4714-11-24 BC is a valid proleptic date");
    if at.date_naive() < first {
        return Err(format!(
            "occurred_at {} is outside the range PostgreSQL can store (4714-11-24 BC to 294276-12-31 AD)",
            at.to_rfc3339()
        ));
    }
    Ok(())
}

/// The domain's own bounds, which a decoded payload does not enforce by its types alone.
fn check_bounds(event: &AnyEvent, version: i64) -> Result<(), String> {
    let event = match event {
        AnyEvent::Order(event) => event,
        AnyEvent::Customer(event) => {
            let is_registered = matches!(event, CustomerEvent::Registered(_));
            if is_registered != (version == 1) {
                return Err(format!(
                    "{} at aggregate version {version}: a customer's first event, and only its first, is customer.registered",
                    domain::DomainEvent::event_type(event)
                ));
            }
            return Ok(());
        }
    };
    let is_placed = matches!(event, OrderEvent::Placed(_));
    if is_placed != (version == 1) {
        return Err(format!(
            "{} at aggregate version {version}: an order's first event, and only its first, is order.placed",
            event.event_type()
        ));
    }
    if let OrderEvent::Placed(placed) = event {
        if !(0..=domain::Cents::MAX).contains(&placed.total_cents) {
            return Err(format!(
                "total_cents {} is outside 0..=10^12",
                placed.total_cents
            ));
        }
        // Orders upcast from the legacy v1 shape have no lines: their total is all there is.
        if !placed.lines.is_empty() {
            let sum = placed
                .lines
                .iter()
                .try_fold(0i64, |sum, line| sum.checked_add(line.subtotal_cents()?));
            if sum != Some(placed.total_cents) {
                return Err(format!(
                    "total_cents {} is not the sum of the lines ({})",
                    placed.total_cents,
                    sum.map_or_else(|| "overflows".to_owned(), |s| s.to_string())
                ));
            }
        }
    }
    Ok(())
}

/// The message must name the event its body holds: `Nats-Msg-Id` is the event id (else JetStream's
/// dedupe protects another event), the subject's last token is the aggregate id (consumers may filter
/// by subject), and the `Waybill-*` headers repeat the body's type, version and aggregate. The subject
/// is compared by its last token only, whatever tokens precede it.
fn check_routing(message: &RawMessage, envelope: &EventEnvelope) -> Result<(), String> {
    let msg_id = message.header(wire::MSG_ID)?;
    if msg_id != envelope.event_id.to_string() {
        return Err(format!(
            "header {} {msg_id:?} is not the event id {}",
            wire::MSG_ID,
            envelope.event_id
        ));
    }
    let mut tokens = message.subject.rsplit('.');
    let last_token = tokens.next().unwrap_or_default();
    if Uuid::parse_str(last_token).ok() != Some(envelope.aggregate_id) {
        return Err(format!(
            "subject {:?} names aggregate {last_token:?}, the body {}",
            message.subject, envelope.aggregate_id
        ));
    }
    // The aggregate type, too: the runner routes by it before decoding.
    let type_token = tokens.next().unwrap_or_default();
    if type_token != envelope.aggregate_type {
        return Err(format!(
            "subject {:?} names aggregate type {type_token:?}, the body {:?}",
            message.subject, envelope.aggregate_type
        ));
    }
    let expected = [
        (wire::EVENT_TYPE, envelope.event_type.clone()),
        (wire::EVENT_VERSION, envelope.event_version.to_string()),
        (wire::AGGREGATE_ID, envelope.aggregate_id.to_string()),
        (
            wire::AGGREGATE_VERSION,
            envelope.aggregate_version.to_string(),
        ),
    ];
    for (name, body_value) in expected {
        let header = message.header(name)?;
        if header != body_value {
            return Err(format!(
                "header {name} {header:?} disagrees with the body's {body_value:?}"
            ));
        }
    }
    Ok(())
}

/// The headers the relay sets for `envelope` (tests and benchmarks publish like the relay).
pub fn relay_headers(envelope: &EventEnvelope) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert(wire::MSG_ID, envelope.event_id.to_string().as_str());
    headers.insert(wire::EVENT_TYPE, envelope.event_type.as_str());
    headers.insert(
        wire::EVENT_VERSION,
        envelope.event_version.to_string().as_str(),
    );
    headers.insert(
        wire::AGGREGATE_ID,
        envelope.aggregate_id.to_string().as_str(),
    );
    headers.insert(
        wire::AGGREGATE_VERSION,
        envelope.aggregate_version.to_string().as_str(),
    );
    headers
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_subject_names_its_aggregate_type_only_in_the_contracted_shape() {
        let id = Uuid::from_u128(3);
        assert_eq!(
            subject_aggregate_type("waybill.events", &format!("waybill.events.customer.{id}")),
            Some("customer")
        );
        assert_eq!(
            subject_aggregate_type("waybill.events", &format!("waybill.events.1.customer.{id}")),
            Some("customer"),
            "the partition token of a stream the server splits"
        );
        for other in [
            "waybill.events.garbage".to_owned(),
            format!("waybill.events.a.b.{id}"),
            format!("waybill.eventsx.order.{id}"),
            format!("waybill.events..{id}"),
            format!("waybill.events.1.2.order.{id}"),
        ] {
            assert_eq!(
                subject_aggregate_type("waybill.events", &other),
                None,
                "{other}"
            );
        }
    }
    use serde_json::json;

    fn envelope_json(event_type: &str, version: i32, payload: Value) -> Value {
        json!({
            "event_id": Uuid::nil(), "event_type": event_type, "event_version": version,
            "aggregate_type": "order", "aggregate_id": Uuid::from_u128(1), "aggregate_version": 1,
            "occurred_at": "2026-11-30T10:00:00Z", "correlation_id": null, "causation_id": null,
            "payload": payload,
        })
    }

    fn envelope(event_type: &str, version: i32, payload: Value) -> Vec<u8> {
        serde_json::to_vec(&envelope_json(event_type, version, payload)).expect("json")
    }

    fn placed_payload(total: i64) -> Value {
        json!({"customer_id": "alice", "currency": "EUR", "total_cents": total,
               "lines": [{"sku": "MUG", "quantity": 2, "unit_price_cents": 1250}]})
    }

    fn message(body: &[u8]) -> RawMessage {
        let envelope = EventEnvelope::from_json(body).expect("envelope");
        RawMessage {
            stream_sequence: 1,
            subject: format!("p.order.{}", envelope.aggregate_id),
            headers: Some(relay_headers(&envelope)),
            body: Bytes::copy_from_slice(body),
        }
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
        let AnyEvent::Order(OrderEvent::Placed(placed)) = decoded.event else {
            panic!("not placed")
        };
        assert_eq!(placed.total_cents, 500);
    }

    #[test]
    fn times_postgresql_cannot_store_are_poison() {
        for (at, storable) in [
            ("-5000-01-01T00:00:00Z", false),
            ("-4713-11-23T23:59:59Z", false),
            ("-4713-11-24T00:00:00Z", true),
            ("9999-12-31T23:59:59Z", true),
        ] {
            let mut value = envelope_json("order.placed", 2, placed_payload(2500));
            value["occurred_at"] = json!(at);
            let result = decode(
                &serde_json::to_vec(&value).expect("json"),
                &Upcasters::orders(),
            );
            assert_eq!(result.is_ok(), storable, "{at}: {result:?}");
            if let Err(poison) = result {
                assert!(
                    poison.reason.contains("outside the range"),
                    "{}",
                    poison.reason
                );
                assert_eq!(poison.aggregate_id, Some(Uuid::from_u128(1)));
            }
        }
    }

    #[test]
    fn totals_outside_the_domain_bounds_are_poison() {
        let upcasters = Upcasters::orders();
        let good = decode(
            &envelope("order.placed", 2, placed_payload(2500)),
            &upcasters,
        );
        assert!(good.is_ok(), "{good:?}");
        let negative = decode(&envelope("order.placed", 2, placed_payload(-1)), &upcasters)
            .expect_err("negative");
        assert!(negative.reason.contains("outside"), "{}", negative.reason);
        let wrong_sum = decode(
            &envelope("order.placed", 2, placed_payload(2501)),
            &upcasters,
        )
        .expect_err("sum");
        assert!(
            wrong_sum.reason.contains("not the sum"),
            "{}",
            wrong_sum.reason
        );
        let legacy_negative = decode(
            &envelope(
                "order.placed",
                1,
                json!({"order_no": "A-1", "amount_cents": -5}),
            ),
            &upcasters,
        );
        assert!(legacy_negative.is_err(), "{legacy_negative:?}");
    }

    #[test]
    fn only_the_first_version_may_be_placed() {
        let mut value = envelope_json(
            "order.paid",
            1,
            json!({"amount_cents": 5, "payment_ref": null}),
        );
        let paid_first = decode(
            &serde_json::to_vec(&value).expect("json"),
            &Upcasters::orders(),
        )
        .expect_err("paid at version 1");
        assert!(
            paid_first.reason.contains("first event"),
            "{}",
            paid_first.reason
        );
        value = envelope_json("order.placed", 2, placed_payload(2500));
        value["aggregate_version"] = json!(3);
        assert!(
            decode(
                &serde_json::to_vec(&value).expect("json"),
                &Upcasters::orders()
            )
            .is_err()
        );
    }

    #[test]
    fn a_message_that_agrees_with_its_body_is_trusted() {
        let body = envelope("order.placed", 2, placed_payload(2500));
        assert!(decode_message(&message(&body), &Upcasters::orders()).is_ok());
    }

    #[test]
    fn a_chaos_header_is_trusted_neither_way() {
        let body = envelope("order.placed", 2, placed_payload(2500));
        let mut m = message(&body);
        if let Some(h) = m.headers.as_mut() {
            h.insert("Waybill-Chaos", "hostile");
        }
        assert!(
            decode_message(&m, &Upcasters::orders()).is_ok(),
            "consistent: applied"
        );
        m.subject = "p.order.placed".into();
        assert!(
            decode_message(&m, &Upcasters::orders()).is_err(),
            "inconsistent: parked"
        );
    }

    #[test]
    fn a_message_that_disagrees_with_its_body_is_poison() {
        let body = envelope("order.placed", 2, placed_payload(2500));
        let upcasters = Upcasters::orders();
        let other = Uuid::from_u128(2).to_string();
        type Tamper<'a> = Box<dyn Fn(&mut RawMessage) + 'a>;
        let cases: Vec<(&str, Tamper)> = vec![
            (
                "is not the event id",
                Box::new(|m| {
                    if let Some(h) = m.headers.as_mut() {
                        h.insert(wire::MSG_ID, "forged");
                    }
                }),
            ),
            (
                "names aggregate",
                Box::new(|m| m.subject = format!("p.order.{other}")),
            ),
            (
                "names aggregate",
                Box::new(|m| m.subject = "p.order.placed".into()),
            ),
            (
                "header Waybill-Event-Type",
                Box::new(|m| {
                    if let Some(h) = m.headers.as_mut() {
                        h.insert(wire::EVENT_TYPE, "order.paid");
                    }
                }),
            ),
            (
                "header Waybill-Event-Version",
                Box::new(|m| {
                    if let Some(h) = m.headers.as_mut() {
                        h.insert(wire::EVENT_VERSION, "1");
                    }
                }),
            ),
            (
                "header Waybill-Aggregate-Version",
                Box::new(|m| {
                    if let Some(h) = m.headers.as_mut() {
                        h.insert(wire::AGGREGATE_VERSION, "7");
                    }
                }),
            ),
            (
                "appears 2 times",
                Box::new(|m| {
                    if let Some(h) = m.headers.as_mut() {
                        h.append(wire::MSG_ID, "second");
                    }
                }),
            ),
            ("is missing", Box::new(|m| m.headers = None)),
        ];
        for (expected, tamper) in cases {
            let mut m = message(&body);
            tamper(&mut m);
            let poison = decode_message(&m, &upcasters).expect_err(expected);
            assert!(
                poison.reason.contains(expected),
                "{expected}: {}",
                poison.reason
            );
            assert_eq!(poison.aggregate_id, Some(Uuid::from_u128(1)));
        }
    }

    #[test]
    fn headers_survive_the_round_trip_through_json_nul_included() {
        let mut headers = HeaderMap::new();
        headers.insert("Nats-Msg-Id", "abc");
        headers.insert("X-Nul", "a\u{0}b");
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
        let bytes = serde_json::to_vec(&json).expect("serializes");
        let back: Value = serde_json::from_slice(&bytes).expect("parses");
        let back = RawMessage::headers_from_json(&back).expect("object");
        assert_eq!(back.get("X-Nul").map(|v| v.as_str()), Some("a\u{0}b"));
    }
}
