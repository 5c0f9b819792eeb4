//! Published payload schemas never change: each `(event_type, event_version)` schema in the code must
//! equal its committed copy under `domain/schemas/`, every version that can exist must have one, and
//! every golden fixture must fit its version's schema.

use std::collections::BTreeSet;
use std::path::PathBuf;

use domain::catalog::{payload_schema, payload_schemas};
use domain::{EventEnvelope, Upcasters};
use serde_json::Value;

fn dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(name)
}

fn committed(event_type: &str, version: i32) -> Option<Value> {
    let path = dir("schemas").join(format!("{event_type}.v{version}.schema.json"));
    let text = std::fs::read_to_string(path).ok()?;
    Some(serde_json::from_str(&text).expect("a committed schema is JSON"))
}

#[test]
fn every_published_schema_is_unchanged() {
    for entry in payload_schemas() {
        let Some(committed) = committed(entry.event_type, entry.event_version) else {
            panic!(
                "{} v{} has no committed schema: add domain/schemas/{}.v{}.schema.json (from `waybill schema`)",
                entry.event_type, entry.event_version, entry.event_type, entry.event_version
            );
        };
        assert_eq!(
            entry.schema, committed,
            "the schema of published {} v{} changed; publish a new version (with an upcaster and a fixture) instead",
            entry.event_type, entry.event_version
        );
    }
}

#[test]
fn every_version_that_can_exist_has_a_schema() {
    let expected: BTreeSet<(String, i32)> =
        Upcasters::orders().all_versions().into_iter().collect();
    let present: BTreeSet<(String, i32)> = payload_schemas()
        .into_iter()
        .map(|s| (s.event_type.to_owned(), s.event_version))
        .collect();
    assert_eq!(present, expected);
}

/// A structural check for the subset of JSON Schema the catalog uses: required keys, no extra keys, and
/// the JSON type of every property.
fn fits(value: &Value, schema: &Value) -> Result<(), String> {
    let types: Vec<&str> = match &schema["type"] {
        Value::String(t) => vec![t.as_str()],
        Value::Array(ts) => ts.iter().filter_map(Value::as_str).collect(),
        _ => vec![],
    };
    let actual = match value {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "integer",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    };
    if !types.is_empty() && !types.contains(&actual) {
        return Err(format!("{value} is {actual}, not {types:?}"));
    }
    if let (Value::Object(fields), Some(properties)) = (value, schema["properties"].as_object()) {
        for key in schema["required"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
        {
            if !fields.contains_key(key) {
                return Err(format!("missing {key}"));
            }
        }
        for (key, field) in fields {
            let property = properties
                .get(key)
                .ok_or_else(|| format!("unexpected field {key}"))?;
            fits(field, property).map_err(|e| format!("{key}: {e}"))?;
        }
    }
    if let (Value::Array(items), Some(item_schema)) = (value, schema.get("items")) {
        for item in items {
            fits(item, item_schema)?;
        }
    }
    Ok(())
}

#[test]
fn every_fixture_fits_its_schema() {
    for entry in std::fs::read_dir(dir("fixtures")).expect("fixtures") {
        let path = entry.expect("entry").path();
        let envelope =
            EventEnvelope::from_json(&std::fs::read(&path).expect("read")).expect("envelope");
        let schema =
            payload_schema(&envelope.event_type, envelope.event_version).expect("a schema");
        fits(&envelope.payload, &schema).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    }
}
