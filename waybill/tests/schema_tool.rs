//! `waybill schema show|diff` as a user runs them: the real binary, its output and its exit codes.
//! No database and no NATS: the catalog is compiled into the binary. (The maintainer's tools that
//! write files, `cargo xtask new-version|write-schema`, are tested in `xtask/tests/`.)

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;
use testkit::Run;

fn waybill(args: &[&str]) -> Run {
    let output = Command::new(env!("CARGO_BIN_EXE_waybill"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("RUST_LOG", "warn")
        .output()
        .expect("waybill runs");
    Run::from(output)
}

fn domain_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../domain")
}

#[test]
fn show_prints_exactly_one_schema_that_compiles_and_fits_its_fixture() {
    let run = waybill(&["schema", "show", "order.placed", "--version", "2"]).ok();
    let schema = run.json();
    assert_eq!(
        schema["title"], "order.placed v2",
        "one schema, not the catalog"
    );
    assert_eq!(
        schema["$schema"],
        "https://json-schema.org/draft/2020-12/schema"
    );
    let validator = jsonschema::options()
        .with_draft(jsonschema::Draft::Draft202012)
        .build(&schema)
        .unwrap_or_else(|e| panic!("not a valid draft 2020-12 schema: {e}"));
    let fixture: Value = serde_json::from_slice(
        &std::fs::read(domain_dir().join("fixtures/order.placed.v2.json")).expect("fixture"),
    )
    .expect("JSON");
    let errors: Vec<String> = validator
        .iter_errors(&fixture["payload"])
        .map(|e| e.to_string())
        .collect();
    assert!(errors.is_empty(), "{errors:?}");
    assert!(
        !validator.is_valid(&serde_json::json!({"order_no": "A-1", "amount_cents": 5})),
        "a v1 payload is not a v2 payload"
    );

    // Without --version: the type's current version, of any aggregate.
    for event_type in ["order.placed", "customer.renamed"] {
        let current = domain::aggregate::current_version_of(event_type).expect("known");
        let run = waybill(&["schema", "show", event_type]).ok();
        assert_eq!(run.json()["title"], format!("{event_type} v{current}"));
    }
    // Exactly the committed file's bytes.
    let committed =
        std::fs::read_to_string(domain_dir().join("schemas/order.placed.v2.schema.json"))
            .expect("committed");
    let run = waybill(&["schema", "show", "order.placed", "--version", "2"]).ok();
    assert_eq!(run.stdout, committed);
}

#[test]
fn diff_lists_what_changed_between_two_versions() {
    let run = waybill(&["schema", "diff", "order.placed", "1", "2", "--json"]).ok();
    let answer = run.json();
    let keys: Vec<&String> = answer.as_object().expect("an object").keys().collect();
    assert_eq!(keys, ["changes", "event_type", "from", "to"]);
    assert_eq!(answer["event_type"], "order.placed");
    assert_eq!(
        (answer["from"].clone(), answer["to"].clone()),
        (1.into(), 2.into())
    );
    let changes = answer["changes"].as_array().expect("changes");
    assert!(!changes.is_empty());
    for change in changes {
        let keys: Vec<&String> = change.as_object().expect("an object").keys().collect();
        assert_eq!(keys, ["change", "detail", "from", "path", "to"], "{change}");
        assert!(
            ["added", "removed", "changed"].contains(&change["change"].as_str().unwrap_or("")),
            "{change}"
        );
    }
    let has = |path: &str, kind: &str| {
        changes
            .iter()
            .any(|c| c["path"] == path && c["change"] == kind)
    };
    assert!(has("order_no", "removed"), "{changes:#?}");
    assert!(has("amount_cents", "removed"), "{changes:#?}");
    assert!(has("customer_id", "added"), "{changes:#?}");
    assert!(has("lines", "added"), "{changes:#?}");

    let text = waybill(&["schema", "diff", "order.placed", "1", "2"])
        .ok()
        .stdout;
    assert!(text.starts_with("order.placed v1 → v2: "), "{text}");
    assert!(
        text.lines()
            .any(|l| l.starts_with("removed  order_no ") && l.contains("required field removed")),
        "{text}"
    );
    let same = waybill(&["schema", "diff", "order.paid", "1", "1"])
        .ok()
        .stdout;
    assert_eq!(same, "order.paid v1 → v1: no changes\n");
}

#[test]
fn unknown_types_and_versions_are_refused_with_exit_2() {
    for (args, expected) in [
        (
            vec!["schema", "show", "order.teleported"],
            "unknown event type \"order.teleported\"; the catalog has order.placed",
        ),
        (
            vec!["schema", "show", "order.paid", "--version", "99"],
            "order.paid has no version 99 in the catalog; its versions are 1",
        ),
        (
            vec!["schema", "diff", "order.placed", "1", "99"],
            "order.placed has no version 99",
        ),
        (
            vec!["schema", "diff", "order.teleported", "1", "2"],
            "unknown event type \"order.teleported\"",
        ),
        (
            vec!["schema", "new-version", "order.paid"],
            "unrecognized subcommand 'new-version'",
        ),
    ] {
        let run = waybill(&args);
        assert_eq!(run.code, 2, "{args:?}: {}{}", run.stdout, run.stderr);
        assert!(run.stdout.is_empty(), "{args:?}: {}", run.stdout);
        assert!(
            run.stderr.starts_with("error: ") && run.stderr.contains(expected),
            "{args:?}: {}",
            run.stderr
        );
    }
    let mut args = vec!["schema", "show", "order.paid", "--version", "99", "--json"];
    let run = waybill(&args);
    assert_eq!(run.code, 2);
    assert_eq!(run.json()["error"]["kind"], "refused");
    args.truncate(3);
    waybill(&args).ok();
}

#[test]
fn plain_schema_and_asyncapi_are_unchanged() {
    let all = waybill(&["schema"]).ok().json();
    assert_eq!(all["order.placed"]["2"]["title"], "order.placed v2");
    assert_eq!(all["order.paid"]["1"]["title"], "order.paid v1");
    let asyncapi = waybill(&["schema", "--asyncapi"]).ok().json();
    assert_eq!(asyncapi["asyncapi"], "2.6.0");
    // The flags belong to the whole catalog, not to a subcommand.
    let run = waybill(&["schema", "--asyncapi", "show", "order.paid"]);
    assert_eq!(run.code, 2, "{}{}", run.stdout, run.stderr);
}
