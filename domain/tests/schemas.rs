//! Published payload schemas never change: each `(event_type, event_version)` schema in the code must
//! equal its committed copy under `domain/schemas/` — a released version's (listed in
//! `domain/schemas/released.json`) for ever, an unreleased one's until it is regenerated — every
//! version that can exist must have one, and every golden fixture — and every older fixture once
//! upcast to its type's current version — must be valid against its committed schema, every keyword
//! enforced (types, required and extra fields, patterns, bounds, lengths, item counts, enums, formats)
//! by the `jsonschema` crate.

use std::collections::BTreeSet;
use std::path::PathBuf;

use domain::catalog::RELEASED_FILE as RELEASED_FILE_NAME;
use domain::catalog::{committed_text, parse_released, payload_schemas, schema_file_name};
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
    format!("domain/schemas/{}", schema_file_name(event_type, version))
}

fn committed(event_type: &str, version: i32) -> Option<Value> {
    let path = dir("schemas").join(schema_file_name(event_type, version));
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

/// Where released versions are listed, as messages name it.
const RELEASED_FILE: &str = "domain/schemas/released.json";

/// Every released `(event_type, event_version)`: its schema may never change again.
fn released() -> BTreeSet<(String, i32)> {
    let path = dir("schemas").join(RELEASED_FILE_NAME);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{RELEASED_FILE} cannot be read: {e}"));
    parse_released(&text).unwrap_or_else(|e| panic!("{RELEASED_FILE}: {e}"))
}

/// The command that writes a version's committed file from the catalog.
fn write_command(event_type: &str, version: i32) -> String {
    format!("cargo xtask write-schema {event_type} --version {version}")
}

/// `old` and `new` line by line, as a reader wants it: `-` only in `old`, `+` only in `new`, two
/// lines of context around each change and `…` for the unchanged lines between (a longest common
/// subsequence of lines; schemas are a few dozen lines).
fn line_diff(old: &str, new: &str) -> String {
    const CONTEXT: usize = 2;
    let (a, b): (Vec<&str>, Vec<&str>) = (old.lines().collect(), new.lines().collect());
    let (n, m) = (a.len(), b.len());
    let mut common = vec![vec![0_usize; m + 1]; n + 1];
    for i in (0..n).rev() {
        for j in (0..m).rev() {
            common[i][j] = if a[i] == b[j] {
                common[i + 1][j + 1] + 1
            } else {
                common[i + 1][j].max(common[i][j + 1])
            };
        }
    }
    let mut lines: Vec<(char, &str)> = Vec::new();
    let (mut i, mut j) = (0, 0);
    while i < n || j < m {
        if i < n && j < m && a[i] == b[j] {
            lines.push((' ', a[i]));
            (i, j) = (i + 1, j + 1);
        } else if i < n && (j == m || common[i + 1][j] >= common[i][j + 1]) {
            lines.push(('-', a[i]));
            i += 1;
        } else {
            lines.push(('+', b[j]));
            j += 1;
        }
    }
    let near_a_change = |k: usize| {
        lines[k.saturating_sub(CONTEXT)..(k + CONTEXT + 1).min(lines.len())]
            .iter()
            .any(|(mark, _)| *mark != ' ')
    };
    let mut out = String::new();
    let mut skipping = false;
    for (k, (mark, line)) in lines.iter().enumerate() {
        if near_a_change(k) {
            out.push_str(&format!("  {mark} {line}\n"));
            skipping = false;
        } else if !skipping {
            out.push_str("    …\n");
            skipping = true;
        }
    }
    out
}

/// Checks the catalog's schema `code` of `event_type` v`version` against its committed file
/// (`None`: there is none); the error says what to do, which depends on whether it is `released`.
fn check_committed(
    event_type: &str,
    version: i32,
    code: &Value,
    committed: Option<&Value>,
    released: bool,
) -> Result<(), String> {
    let file = schema_file(event_type, version);
    let Some(committed) = committed else {
        return Err(format!(
            "{event_type} v{version} has no committed schema: add {file}, written from the catalog by: {}",
            write_command(event_type, version)
        ));
    };
    if committed == code {
        return Ok(());
    }
    let diff = format!(
        "  --- {file} (committed)\n  +++ the catalog (the code)\n{}",
        line_diff(&committed_text(committed), &committed_text(code))
    );
    Err(if released {
        format!(
            "{file} differs from {event_type} v{version}'s schema in the catalog, and v{version} is \
             released ({RELEASED_FILE}):\n{diff}\
             A released schema may never change: undo the change to the catalog and publish a new \
             version instead (cargo xtask new-version {event_type}, then its checklist)."
        )
    } else {
        format!(
            "{file} differs from {event_type} v{version}'s schema in the catalog:\n{diff}\
             v{version} is not released (not in {RELEASED_FILE}), so it may still change; if the code is \
             right, regenerate it: {}",
            write_command(event_type, version)
        )
    })
}

#[test]
fn every_schema_equals_its_committed_file() {
    let released = released();
    // All failures at once: a new version's file and a changed old one are often found together.
    let failures: Vec<String> = payload_schemas()
        .into_iter()
        .filter_map(|entry| {
            let (event_type, version) = (entry.event_type, entry.event_version);
            check_committed(
                event_type,
                version,
                &entry.schema,
                committed(event_type, version).as_ref(),
                released.contains(&(event_type.to_owned(), version)),
            )
            .err()
        })
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn every_committed_schema_is_written_as_the_tools_write_it() {
    // So that `cargo xtask write-schema` reproduces a committed file byte for byte, and a
    // regenerated file's diff in review shows only what changed.
    let mut failures = Vec::new();
    for (event_type, version, path) in committed_files() {
        let text = std::fs::read_to_string(&path).expect("readable");
        let schema: Value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("{} is not JSON: {e}", schema_file(&event_type, version)));
        if text != committed_text(&schema) {
            failures.push(format!(
                "{} is not laid out as `cargo xtask write-schema` writes it (pretty JSON, keys in \
                 order, a final newline):\n{}rewrite it: {}",
                schema_file(&event_type, version),
                line_diff(&text, &committed_text(&schema)),
                write_command(&event_type, version)
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// Every `<type>.v<N>.schema.json` under `domain/schemas/`, as `(type, version, path)`; a file there
/// that is neither such a schema nor `released.json` fails the test.
fn committed_files() -> Vec<(String, i32, PathBuf)> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir("schemas")).expect("domain/schemas/ exists") {
        let path = entry.expect("readable entry").path();
        let name = path
            .file_name()
            .expect("file name")
            .to_string_lossy()
            .into_owned();
        if name == "released.json" {
            continue;
        }
        let parsed = name
            .strip_suffix(".schema.json")
            .and_then(|stem| stem.rsplit_once(".v"))
            .and_then(|(event_type, v)| Some((event_type.to_owned(), v.parse::<i32>().ok()?)));
        let Some((event_type, version)) = parsed else {
            panic!(
                "domain/schemas/{name} is not named <type>.v<N>.schema.json (nor released.json)"
            );
        };
        found.push((event_type, version, path));
    }
    found.sort();
    found
}

#[test]
fn every_version_that_can_exist_has_a_schema() {
    let expected: BTreeSet<(String, i32)> = Upcasters::all().all_versions().into_iter().collect();
    let in_catalog: BTreeSet<(String, i32)> = payload_schemas()
        .into_iter()
        .map(|s| (s.event_type.to_owned(), s.event_version))
        .collect();
    let mut problems = Vec::new();
    for (event_type, version) in expected.difference(&in_catalog) {
        problems.push(format!(
            "missing: {event_type} v{version} can exist (its aggregate's CURRENT_VERSIONS) but the \
             catalog has no schema for it; add it there, then {} ({})",
            schema_file(event_type, *version),
            write_command(event_type, *version)
        ));
    }
    for (event_type, version) in in_catalog.difference(&expected) {
        problems.push(format!(
            "extra: {event_type} v{version} is in the catalog but no such version can exist (its \
             aggregate's CURRENT_VERSIONS and upcasters): finish that version or remove its schema"
        ));
    }
    for (event_type, version, _) in committed_files() {
        if !expected.contains(&(event_type.clone(), version)) {
            problems.push(format!(
                "extra: {} is committed, but {event_type} v{version} cannot exist (its aggregate's \
                 CURRENT_VERSIONS): finish that version or remove the file",
                schema_file(&event_type, version)
            ));
        }
    }
    assert!(
        problems.is_empty(),
        "the catalog's versions and the versions that can exist differ:\n  {}",
        problems.join("\n  ")
    );
}

#[test]
fn every_released_version_is_in_the_catalog() {
    let in_catalog: BTreeSet<(String, i32)> = payload_schemas()
        .into_iter()
        .map(|s| (s.event_type.to_owned(), s.event_version))
        .collect();
    let unknown: Vec<String> = released()
        .into_iter()
        .filter(|key| !in_catalog.contains(key))
        .map(|(event_type, version)| {
            format!(
                "{event_type} v{version} (no schema in the catalog, no {})",
                schema_file(&event_type, version)
            )
        })
        .collect();
    assert!(
        unknown.is_empty(),
        "{RELEASED_FILE} lists versions the catalog does not have — a released version cannot be \
         taken back, so add it, or correct the list if it was never published:\n  {}",
        unknown.join("\n  ")
    );
}

#[test]
fn a_changed_released_schema_is_refused_with_a_readable_diff() {
    let code = json!({"title": "x v1", "type": "object", "properties": {"a": {"type": "string", "maxLength": 10}}});
    let committed = json!({"title": "x v1", "type": "object", "properties": {"a": {"type": "string", "maxLength": 20}}});
    let report = check_committed("order.x", 1, &code, Some(&committed), true)
        .expect_err("the schemas differ");
    for expected in [
        "domain/schemas/order.x.v1.schema.json",
        "is released",
        "  -       \"maxLength\": 20,\n  +       \"maxLength\": 10,\n",
        "publish a new version",
    ] {
        assert!(
            report.contains(expected),
            "{expected:?} is missing from:\n{report}"
        );
    }
    assert!(!report.contains("regenerate"), "{report}");
    assert_eq!(
        check_committed("order.x", 1, &code, Some(&code), true),
        Ok(())
    );
}

#[test]
fn a_changed_unreleased_schema_is_to_be_regenerated() {
    let code = json!({"title": "x v2", "type": "object"});
    let committed = json!({"title": "x v2", "type": "array"});
    let report = check_committed("order.x", 2, &code, Some(&committed), false)
        .expect_err("the schemas differ");
    for expected in [
        "domain/schemas/order.x.v2.schema.json",
        "  -   \"type\": \"array\"\n  +   \"type\": \"object\"\n",
        "regenerate it: cargo xtask write-schema order.x --version 2",
    ] {
        assert!(
            report.contains(expected),
            "{expected:?} is missing from:\n{report}"
        );
    }
    assert!(!report.contains("publish a new version"), "{report}");
    let missing = check_committed("order.x", 2, &code, None, false).expect_err("no file");
    assert!(
        missing.contains("add domain/schemas/order.x.v2.schema.json")
            && missing.contains("cargo xtask write-schema order.x --version 2"),
        "{missing}"
    );
}

#[test]
fn the_line_diff_keeps_context_and_skips_the_rest() {
    let old = "a\nb\nc\nd\ne\nf\ng\nh\n";
    let new = "a\nb\nc\nd\nE\nf\ng\nh\n";
    assert_eq!(
        line_diff(old, new),
        "    …\n    c\n    d\n  - e\n  + E\n    f\n    g\n    …\n"
    );
    assert_eq!(line_diff("x\n", "x\ny\n"), "    x\n  + y\n");
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
    let upcasters = Upcasters::all();
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
