//! The event catalog: the JSON Schema of every `(event_type, event_version)` payload that can exist.
//!
//! A published version's schema never changes: the committed copies under `domain/schemas/` are
//! compared with these by a test, so changing a shape forces a new version (with its upcaster and
//! fixture) instead. The names and layout of those files, and the list of released versions, are
//! defined here once for the test, the catalog's readers and the maintainer's tools (`xtask`).

use std::collections::BTreeSet;

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

/// Why the catalog has no schema for what was asked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LookupError {
    /// The event type is not in the catalog.
    #[error("unknown event type {event_type:?}; the catalog has {}", known.join(", "))]
    UnknownType {
        /// What was asked for.
        event_type: String,
        /// Every type the catalog has, in its order.
        known: Vec<String>,
    },
    /// The type is known, the version is not.
    #[error(
        "{event_type} has no version {version} in the catalog; its versions are {}",
        known.iter().map(i32::to_string).collect::<Vec<_>>().join(", ")
    )]
    UnknownVersion {
        /// The event type.
        event_type: String,
        /// The version asked for.
        version: i32,
        /// The versions the catalog has of it.
        known: Vec<i32>,
    },
}

/// The catalog's schema of `event_type` at `version`, by default the type's current version (of
/// whichever aggregate it belongs to).
pub fn find_schema(event_type: &str, version: Option<i32>) -> Result<PayloadSchema, LookupError> {
    let all = payload_schemas();
    let known: Vec<i32> = all
        .iter()
        .filter(|s| s.event_type == event_type)
        .map(|s| s.event_version)
        .collect();
    let version = version.or_else(|| crate::aggregate::current_version_of(event_type));
    let (Some(version), false) = (version, known.is_empty()) else {
        let mut types: Vec<String> = Vec::new();
        for entry in &all {
            if !types.iter().any(|t| t == entry.event_type) {
                types.push(entry.event_type.to_owned());
            }
        }
        return Err(LookupError::UnknownType {
            event_type: event_type.to_owned(),
            known: types,
        });
    };
    all.into_iter()
        .find(|s| s.event_type == event_type && s.event_version == version)
        .ok_or_else(|| LookupError::UnknownVersion {
            event_type: event_type.to_owned(),
            version,
            known,
        })
}

/// The file, in the schemas folder, that lists the released (published) versions: their schema may
/// never change again.
pub const RELEASED_FILE: &str = "released.json";

/// The committed file name of a payload schema: `<type>.v<N>.schema.json`.
pub fn schema_file_name(event_type: &str, version: i32) -> String {
    format!("{event_type}.v{version}.schema.json")
}

/// The golden fixture's file name: `<type>.v<N>.json`.
pub fn fixture_file_name(event_type: &str, version: i32) -> String {
    format!("{event_type}.v{version}.json")
}

/// A schema exactly as it is committed under `domain/schemas/`: pretty JSON (two-space indent, keys
/// in order, as serde_json writes them) and a final newline.
pub fn committed_text(schema: &Value) -> String {
    let mut text = serde_json::to_string_pretty(schema)
        .expect("a serde_json::Value always serialises (its keys are strings)");
    text.push('\n');
    text
}

/// Why a `released.json` could not be read as a list of released versions.
#[derive(Debug, thiserror::Error)]
pub enum ReleasedError {
    /// The text is not JSON.
    #[error("not JSON")]
    Json(#[source] serde_json::Error),
    /// JSON, but not the expected document.
    #[error("expected {{\"released\": {{\"<type>\": [<version>, …]}}}}")]
    Shape,
    /// A type's versions are not a list.
    #[error("the versions of {0} are not a list")]
    NotAList(String),
    /// A version that is not a whole number in `i32`'s range.
    #[error("{event_type}: {found} is not a version number")]
    NotAVersion {
        /// The type it is listed under.
        event_type: String,
        /// What stands there.
        found: Value,
    },
}

/// Reads `released.json`: `{"released": {"<type>": [<version>, …], …}}` (other top-level keys, such
/// as `$comment`, are ignored).
pub fn parse_released(text: &str) -> Result<BTreeSet<(String, i32)>, ReleasedError> {
    let document: Value = serde_json::from_str(text).map_err(ReleasedError::Json)?;
    let types = document["released"]
        .as_object()
        .ok_or(ReleasedError::Shape)?;
    let mut found = BTreeSet::new();
    for (event_type, versions) in types {
        let versions = versions
            .as_array()
            .ok_or_else(|| ReleasedError::NotAList(event_type.clone()))?;
        for version in versions {
            let number = version
                .as_i64()
                .and_then(|v| i32::try_from(v).ok())
                .ok_or_else(|| ReleasedError::NotAVersion {
                    event_type: event_type.clone(),
                    found: version.clone(),
                })?;
            found.insert((event_type.clone(), number));
        }
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_schema_is_found_by_type_and_version_of_any_aggregate() {
        let placed = find_schema("order.placed", Some(2)).expect("order.placed v2");
        assert_eq!(placed.schema["title"], "order.placed v2");
        let current = crate::aggregate::current_version_of("customer.renamed").expect("known");
        let renamed = find_schema("customer.renamed", None).expect("its current version");
        assert_eq!(renamed.event_version, current);
        let error = find_schema("order.teleported", Some(1)).expect_err("unknown type");
        assert!(
            matches!(&error, LookupError::UnknownType { known, .. } if known.iter().any(|t| t == "customer.renamed")),
            "{error}"
        );
        assert!(error.to_string().starts_with(
            "unknown event type \"order.teleported\"; the catalog has order.placed, "
        ));
        assert!(matches!(
            find_schema("order.teleported", None),
            Err(LookupError::UnknownType { .. })
        ));
        assert_eq!(
            find_schema("order.paid", Some(99))
                .expect_err("unknown version")
                .to_string(),
            "order.paid has no version 99 in the catalog; its versions are 1"
        );
    }

    #[test]
    fn released_json_is_read_and_checked() {
        let found = parse_released(
            r#"{"$comment": "x", "released": {"order.placed": [1, 2], "order.paid": [1]}}"#,
        )
        .expect("parses");
        assert_eq!(
            found,
            BTreeSet::from([
                ("order.paid".to_owned(), 1),
                ("order.placed".to_owned(), 1),
                ("order.placed".to_owned(), 2),
            ])
        );
        for (bad, says) in [
            ("[", "not JSON"),
            (r#"{"order.placed": [1]}"#, "expected {\"released\""),
            (
                r#"{"released": {"order.placed": 1}}"#,
                "order.placed are not a list",
            ),
            (
                r#"{"released": {"order.placed": ["1"]}}"#,
                "\"1\" is not a version",
            ),
            (
                r#"{"released": {"order.placed": [3000000000]}}"#,
                "is not a version",
            ),
        ] {
            let error = parse_released(bad).expect_err(bad).to_string();
            assert!(error.contains(says), "{bad}: {error}");
        }
    }

    #[test]
    fn a_committed_schema_is_pretty_json_with_one_final_newline() {
        let text = committed_text(&json!({"b": 1, "a": [true]}));
        assert_eq!(text, "{\n  \"a\": [\n    true\n  ],\n  \"b\": 1\n}\n");
        assert_eq!(
            schema_file_name("order.paid", 2),
            "order.paid.v2.schema.json"
        );
        assert_eq!(fixture_file_name("order.paid", 2), "order.paid.v2.json");
    }
}
