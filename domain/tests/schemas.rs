//! Published payload schemas never change: each `(event_type, event_version)` schema in the code must
//! equal its committed copy under `domain/schemas/`, every version that can exist must have one, and
//! every golden fixture — and every older fixture once upcast to its type's current version — must be
//! valid against its committed schema, every keyword enforced (types, required and extra fields,
//! patterns, bounds, lengths, item counts, enums, formats) by the `jsonschema` crate.

use std::collections::BTreeSet;
use std::path::PathBuf;

use domain::catalog::payload_schemas;
use domain::{EventEnvelope, Upcasters};
use serde_json::{Value, json};

mod common;
use common::fixtures;

/// The only draft the catalog writes; the validator is pinned to it rather than guessing.
const DRAFT_2020_12: &str = "https://json-schema.org/draft/2020-12/schema";

fn dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(name)
}

/// The committed schema's path relative to the workspace, as error messages name it.
fn schema_file(event_type: &str, version: i32) -> String {
    format!("domain/schemas/{event_type}.v{version}.schema.json")
}

fn committed(event_type: &str, version: i32) -> Option<Value> {
    let path = dir("schemas").join(format!("{event_type}.v{version}.schema.json"));
    let text = std::fs::read_to_string(path).ok()?;
    Some(serde_json::from_str(&text).expect("a committed schema is JSON"))
}

fn fixture(name: &str) -> EventEnvelope {
    fixtures()
        .into_iter()
        .find_map(|(n, e)| (n == name).then_some(e))
        .unwrap_or_else(|| panic!("no fixture domain/fixtures/{name}"))
}

/// One way an instance breaks its schema.
#[derive(Debug)]
struct Violation {
    /// JSON Pointer into the payload ("" is the payload itself).
    instance_path: String,
    /// JSON Pointer into the schema, ending in the keyword that failed (e.g. `/properties/currency/pattern`).
    schema_path: String,
    message: String,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let at = if self.instance_path.is_empty() {
            "(the payload)"
        } else {
            &self.instance_path
        };
        write!(f, "at {at}: {} (schema {})", self.message, self.schema_path)
    }
}

/// Every violation of `payload` against the committed schema of `event_type` v`version`.
fn violations(payload: &Value, event_type: &str, version: i32) -> Vec<Violation> {
    let file = schema_file(event_type, version);
    let schema = committed(event_type, version).unwrap_or_else(|| panic!("{file} is missing"));
    assert_eq!(
        schema["$schema"], DRAFT_2020_12,
        "{file} must declare the draft the validator is pinned to"
    );
    // Building also checks the schema against the draft's meta-schema. Formats are asserted (2020-12
    // only annotates them by default) and an unknown one is an error, so a typo cannot disable a check.
    let validator = jsonschema::options()
        .with_draft(jsonschema::Draft::Draft202012)
        .should_validate_formats(true)
        .should_ignore_unknown_formats(false)
        .build(&schema)
        .unwrap_or_else(|e| panic!("{file} is not a valid draft 2020-12 schema: {e}"));
    validator
        .iter_errors(payload)
        .map(|error| Violation {
            instance_path: error.instance_path().as_str().to_owned(),
            schema_path: error.schema_path().as_str().to_owned(),
            message: error.to_string(),
        })
        .collect()
}

/// Validates `payload` (described by `what`, naming the fixture) against the committed schema; the
/// error names the fixture, the schema file and each violation with its instance path.
fn validate(what: &str, payload: &Value, event_type: &str, version: i32) -> Result<(), String> {
    let found = violations(payload, event_type, version);
    if found.is_empty() {
        return Ok(());
    }
    let mut report = format!(
        "{what} does not fit {}: {} violation(s)",
        schema_file(event_type, version),
        found.len()
    );
    for violation in &found {
        report.push_str(&format!("\n  {violation}"));
    }
    Err(report)
}

#[test]
fn every_published_schema_is_unchanged() {
    for entry in payload_schemas() {
        let Some(committed) = committed(entry.event_type, entry.event_version) else {
            panic!(
                "{} v{} has no committed schema: add {} (from `waybill schema`)",
                entry.event_type,
                entry.event_version,
                schema_file(entry.event_type, entry.event_version)
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

#[test]
fn every_fixture_fits_its_schema() {
    // All failures at once: one broken fixture should not hide the next.
    let failures: Vec<String> = fixtures()
        .into_iter()
        .filter_map(|(name, envelope)| {
            validate(
                &format!("domain/fixtures/{name}"),
                &envelope.payload,
                &envelope.event_type,
                envelope.event_version,
            )
            .err()
        })
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn every_older_fixture_upcast_to_current_fits_the_current_schema() {
    // An upcaster's output is what consumers decode: it must obey the same published contract as a
    // payload written today (e.g. the legacy currency must still match the currency pattern).
    let upcasters = Upcasters::orders();
    let mut upcast = 0;
    let mut failures = Vec::new();
    for (name, envelope) in fixtures() {
        let current = upcasters
            .current_version(&envelope.event_type)
            .unwrap_or_else(|| panic!("{name}: unknown event type {}", envelope.event_type));
        if envelope.event_version == current {
            continue;
        }
        let payload = upcasters
            .upcast(
                &envelope.event_type,
                envelope.event_version,
                envelope.payload.clone(),
            )
            .unwrap_or_else(|e| panic!("domain/fixtures/{name}: {e}"));
        upcast += 1;
        let what = format!(
            "domain/fixtures/{name} upcast from v{} to v{current}",
            envelope.event_version
        );
        if let Err(report) = validate(&what, &payload, &envelope.event_type, current) {
            failures.push(report);
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // The catalog has older versions (order.placed v1); a loop that upcast nothing proved nothing.
    assert!(upcast > 0, "no fixture of an older version was upcast");
}

/// A fixture's payload with one change, the instance path that change breaks, and the keyword (the last
/// segment of the schema path) that must catch it.
struct Mutation {
    fixture: &'static str,
    change: fn(&mut Value),
    instance_path: &'static str,
    keyword: &'static str,
}

/// Each of these fits the types, the required fields and the field names — all the old hand-written
/// `fits` checked — and breaks exactly one keyword it ignored.
fn mutations() -> Vec<Mutation> {
    vec![
        Mutation {
            fixture: "order.placed.v2.json",
            change: |p| p["currency"] = json!("eur"),
            instance_path: "/currency",
            keyword: "pattern",
        },
        Mutation {
            fixture: "order.placed.v2.json",
            change: |p| p["customer_id"] = json!("alice smith"),
            instance_path: "/customer_id",
            keyword: "pattern",
        },
        Mutation {
            fixture: "order.placed.v2.json",
            change: |p| p["lines"][1]["sku"] = json!("tea-green"),
            instance_path: "/lines/1/sku",
            keyword: "pattern",
        },
        Mutation {
            fixture: "order.placed.v2.json",
            change: |p| p["lines"][0]["quantity"] = json!(0),
            instance_path: "/lines/0/quantity",
            keyword: "minimum",
        },
        Mutation {
            fixture: "order.placed.v2.json",
            change: |p| p["lines"][0]["unit_price_cents"] = json!(1_000_000_000_001_i64),
            instance_path: "/lines/0/unit_price_cents",
            keyword: "maximum",
        },
        Mutation {
            fixture: "order.placed.v2.json",
            change: |p| p["total_cents"] = json!(-1),
            instance_path: "/total_cents",
            keyword: "minimum",
        },
        Mutation {
            fixture: "order.placed.v2.json",
            change: |p| {
                let line = p["lines"][0].clone();
                p["lines"] = Value::Array(vec![line; 501]);
            },
            instance_path: "/lines",
            keyword: "maxItems",
        },
        Mutation {
            fixture: "order.paid.v1.json",
            change: |p| p["amount_cents"] = json!(0),
            instance_path: "/amount_cents",
            keyword: "minimum",
        },
        Mutation {
            fixture: "order.paid.v1.json",
            change: |p| p["payment_ref"] = Value::String("x".repeat(201)),
            instance_path: "/payment_ref",
            keyword: "maxLength",
        },
        Mutation {
            fixture: "order.cancelled.v1.json",
            change: |p| p["reason"] = Value::String("x".repeat(201)),
            instance_path: "/reason",
            keyword: "maxLength",
        },
        Mutation {
            fixture: "order.shipped.v1.json",
            change: |p| p["tracking_number"] = Value::String("x".repeat(201)),
            instance_path: "/tracking_number",
            keyword: "maxLength",
        },
        Mutation {
            fixture: "order.placed.v1.json",
            change: |p| p["amount_cents"] = json!(-5),
            instance_path: "/amount_cents",
            keyword: "minimum",
        },
    ]
}

#[test]
fn the_validator_catches_what_the_old_structural_check_missed() {
    for mutation in mutations() {
        let envelope = fixture(mutation.fixture);
        let (event_type, version) = (envelope.event_type.as_str(), envelope.event_version);
        // The untouched fixture passes, so whatever fails below is the mutation's doing.
        assert!(
            violations(&envelope.payload, event_type, version).is_empty(),
            "{} should fit before it is mutated",
            mutation.fixture
        );
        let mut payload = envelope.payload.clone();
        (mutation.change)(&mut payload);
        let found = violations(&payload, event_type, version);
        assert!(
            found
                .iter()
                .any(|v| v.instance_path == mutation.instance_path
                    && v.schema_path.rsplit('/').next() == Some(mutation.keyword)),
            "{} with {} broken: expected a `{}` violation at {}, found {found:?}",
            mutation.fixture,
            mutation.instance_path,
            mutation.keyword,
            mutation.instance_path
        );
    }
}

#[test]
fn a_failure_names_the_fixture_the_schema_file_and_each_violation_with_its_path() {
    let envelope = fixture("order.placed.v2.json");
    let mut payload = envelope.payload.clone();
    payload["currency"] = json!("euro");
    payload["lines"][0]["quantity"] = json!(0);
    let report = validate(
        "domain/fixtures/order.placed.v2.json",
        &payload,
        &envelope.event_type,
        envelope.event_version,
    )
    .expect_err("two keywords are broken");
    for expected in [
        "domain/fixtures/order.placed.v2.json",
        "domain/schemas/order.placed.v2.schema.json",
        "2 violation(s)",
        "at /currency: ",
        "at /lines/0/quantity: ",
    ] {
        assert!(
            report.contains(expected),
            "{expected:?} is missing from:\n{report}"
        );
    }
}
