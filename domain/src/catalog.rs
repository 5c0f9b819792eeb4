//! The event catalog: the JSON Schema of every `(event_type, event_version)` payload that can exist.
//!
//! A published version's schema never changes: the committed copies under `domain/schemas/` are
//! compared with these by a test, so changing a shape forces a new version (with its upcaster and
//! fixture) instead.

use serde_json::{Value, json};

use crate::event::OrderEvent;
use crate::values::Channel;

/// One payload schema.
#[derive(Debug, Clone, PartialEq)]
pub struct PayloadSchema {
    /// The event type.
    pub event_type: &'static str,
    /// The payload version.
    pub event_version: i32,
    /// JSON Schema (draft 2020-12) of the payload.
    pub schema: Value,
}

/// A closed object schema (no other properties) with `required` fields.
pub(crate) fn object(title: &str, required: &[&str], properties: Value) -> Value {
    json!({
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": title,
        "type": "object",
        "additionalProperties": false,
        "required": required,
        "properties": properties,
    })
}

fn cents() -> Value {
    json!({"type": "integer", "minimum": 1, "maximum": 1_000_000_000_000_i64})
}

/// A customer handle, as orders and customers carry it.
pub(crate) fn customer_id() -> Value {
    json!({"type": "string", "pattern": "^[A-Za-z0-9._:-]{1,64}$"})
}

/// The fields `order.placed` has had since v2.
fn placed_fields() -> Value {
    json!({
        "customer_id": customer_id(),
        "currency": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "lines": {"type": "array", "maxItems": 500, "items": {
            "type": "object", "additionalProperties": false,
            "required": ["sku", "quantity", "unit_price_cents"],
            "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z0-9_-]{1,32}$"},
                "quantity": {"type": "integer", "minimum": 1, "maximum": 1_000_000},
                "unit_price_cents": cents(),
            }
        }},
        "total_cents": {"type": "integer", "minimum": 0},
    })
}

/// Every payload schema of every aggregate type, oldest version first within a type.
pub fn payload_schemas() -> Vec<PayloadSchema> {
    let mut schemas = order_schemas();
    schemas.extend(<crate::customer::Customer as crate::aggregate::Aggregate>::schemas());
    schemas
}

/// The order's payload schemas, oldest version first within a type.
pub(crate) fn order_schemas() -> Vec<PayloadSchema> {
    let text = |max: u32| json!({"type": "string", "maxLength": max});
    let cents = cents();
    vec![
        PayloadSchema {
            event_type: OrderEvent::PLACED,
            event_version: 1,
            schema: object(
                "order.placed v1 (legacy)",
                &["order_no", "amount_cents"],
                json!({
                    "order_no": {"type": "string"},
                    "amount_cents": {"type": "integer", "minimum": 0},
                }),
            ),
        },
        PayloadSchema {
            event_type: OrderEvent::PLACED,
            event_version: 2,
            schema: object(
                "order.placed v2",
                &["customer_id", "currency", "lines", "total_cents"],
                placed_fields(),
            ),
        },
        PayloadSchema {
            event_type: OrderEvent::PLACED,
            event_version: 3,
            schema: object(
                "order.placed v3",
                &["customer_id", "currency", "lines", "total_cents", "channel"],
                {
                    let mut fields = placed_fields();
                    fields["channel"] = json!({
                        "type": "string",
                        "enum": Channel::ALL.map(Channel::as_str),
                    });
                    fields
                },
            ),
        },
        PayloadSchema {
            event_type: OrderEvent::PAID,
            event_version: 1,
            schema: object(
                "order.paid v1",
                &["amount_cents", "payment_ref"],
                json!({
                    "amount_cents": cents,
                    "payment_ref": {"type": ["string", "null"], "maxLength": 200},
                }),
            ),
        },
        PayloadSchema {
            event_type: OrderEvent::CANCELLED,
            event_version: 1,
            schema: object(
                "order.cancelled v1",
                &["reason"],
                json!({"reason": text(200)}),
            ),
        },
        PayloadSchema {
            event_type: OrderEvent::SHIPPED,
            event_version: 1,
            schema: object(
                "order.shipped v1",
                &["carrier", "tracking_number"],
                json!({
                    "carrier": text(200),
                    "tracking_number": text(200),
                }),
            ),
        },
    ]
}

/// The schema of one `(event_type, event_version)`.
pub fn payload_schema(event_type: &str, event_version: i32) -> Option<Value> {
    payload_schemas()
        .into_iter()
        .find(|s| s.event_type == event_type && s.event_version == event_version)
        .map(|s| s.schema)
}
