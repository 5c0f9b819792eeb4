//! `waybill schema show|diff|new-version` as a user runs them: the real binary, its output, the files
//! it writes and its exit codes. No database and no NATS: the catalog is compiled into the binary.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;
use testkit::Run;

fn waybill_in(dir: &Path, args: &[&str]) -> Run {
    let output = Command::new(env!("CARGO_BIN_EXE_waybill"))
        .args(args)
        .current_dir(dir)
        .env("RUST_LOG", "warn")
        .output()
        .expect("waybill runs");
    Run::from(output)
}

fn waybill(args: &[&str]) -> Run {
    waybill_in(Path::new(env!("CARGO_MANIFEST_DIR")), args)
}

fn domain_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../domain")
}

/// A copy of the workspace's `domain/schemas/` and `domain/fixtures/` under `root/domain/`.
fn copy_domain(root: &Path) -> PathBuf {
    let domain = root.join("domain");
    for sub in ["schemas", "fixtures"] {
        std::fs::create_dir_all(domain.join(sub)).expect("mkdir");
        for entry in std::fs::read_dir(domain_dir().join(sub)).expect("readable") {
            let path = entry.expect("entry").path();
            if path.is_file() {
                std::fs::copy(
                    &path,
                    domain.join(sub).join(path.file_name().expect("name")),
                )
                .expect("copy");
            }
        }
    }
    domain
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

    // Without --version: the type's current version.
    let current = domain::event::current_version("order.placed").expect("order.placed");
    let run = waybill(&["schema", "show", "order.placed"]).ok();
    assert_eq!(run.json()["title"], format!("order.placed v{current}"));
}

#[test]
fn show_write_reproduces_the_committed_files_byte_for_byte() {
    let out = tempfile::tempdir().expect("temp dir");
    let dir = out.path().to_str().expect("UTF-8 path");
    // The versions published before the tools existed: their files were written by hand from
    // `waybill schema`, and --write must give exactly the same bytes.
    for (event_type, version) in [
        ("order.placed", 1),
        ("order.placed", 2),
        ("order.paid", 1),
        ("order.cancelled", 1),
        ("order.shipped", 1),
    ] {
        let name = format!("{event_type}.v{version}.schema.json");
        let run = waybill(&[
            "schema",
            "show",
            event_type,
            "--version",
            &version.to_string(),
            "--write",
            dir,
        ])
        .ok();
        let written = out.path().join(&name);
        assert_eq!(run.stdout.trim_end(), written.display().to_string());
        let committed = std::fs::read(domain_dir().join("schemas").join(&name)).expect("committed");
        let written = std::fs::read(&written).expect("written");
        assert!(
            written == committed,
            "{name}: --write gave\n{}\nthe committed file is\n{}",
            String::from_utf8_lossy(&written),
            String::from_utf8_lossy(&committed)
        );
    }
    // --json says where it wrote.
    let run = waybill(&["schema", "show", "order.paid", "--write", dir, "--json"]).ok();
    let answer = run.json();
    assert_eq!(answer["event_type"], "order.paid");
    assert_eq!(answer["version"], 1);
    assert!(
        answer["path"]
            .as_str()
            .is_some_and(|p| p.ends_with("order.paid.v1.schema.json"))
    );
}

#[test]
fn show_write_never_changes_a_released_schema_but_regenerates_an_unreleased_one() {
    let root = tempfile::tempdir().expect("temp dir");
    let schemas = copy_domain(root.path()).join("schemas");
    let file = schemas.join("order.paid.v1.schema.json");
    let tampered = std::fs::read_to_string(&file)
        .expect("committed")
        .replace("\"maxLength\": 200", "\"maxLength\": 100");
    std::fs::write(&file, &tampered).expect("write");
    let dir = schemas.to_str().expect("UTF-8 path");

    // Released (released.json lists order.paid 1): the file differs from the code, and --write must
    // not make them agree by rewriting what was published.
    let run = waybill(&[
        "schema",
        "show",
        "order.paid",
        "--version",
        "1",
        "--write",
        dir,
    ]);
    assert_eq!(run.code, 2, "{}{}", run.stdout, run.stderr);
    for expected in [
        "order.paid v1 is released",
        "released.json",
        "order.paid.v1.schema.json",
        "publish a new version",
    ] {
        assert!(
            run.stderr.contains(expected),
            "{expected:?}: {}",
            run.stderr
        );
    }
    assert_eq!(std::fs::read_to_string(&file).expect("kept"), tampered);

    // The same file, not released: regenerated.
    std::fs::write(
        schemas.join("released.json"),
        r#"{"released": {"order.placed": [1, 2]}}"#,
    )
    .expect("write");
    waybill(&[
        "schema",
        "show",
        "order.paid",
        "--version",
        "1",
        "--write",
        dir,
    ])
    .ok();
    assert_eq!(
        std::fs::read(&file).expect("rewritten"),
        std::fs::read(domain_dir().join("schemas/order.paid.v1.schema.json")).expect("committed")
    );
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
fn new_version_scaffolds_the_next_version_once() {
    let root = tempfile::tempdir().expect("temp dir");
    let domain = copy_domain(root.path());
    // Run from deep inside the copy: the domain folder is found by walking up.
    let deep = root.path().join("waybill/src");
    std::fs::create_dir_all(&deep).expect("mkdir");
    let current = domain::event::current_version("order.paid").expect("order.paid");
    let next = current + 1;

    let run = waybill_in(&deep, &["schema", "new-version", "order.paid"]).ok();
    let schema_file = domain.join(format!("schemas/order.paid.v{next}.schema.json"));
    let fixture_file = domain.join(format!("fixtures/order.paid.v{next}.json"));
    for expected in [
        format!("created {}", schema_file.display()),
        format!("created {}", fixture_file.display()),
        "domain/src/event.rs".to_owned(),
        "OrderPaid".to_owned(),
        "CURRENT_VERSIONS".to_owned(),
        "domain/src/upcast.rs".to_owned(),
        "Upcasters::orders()".to_owned(),
        "domain/src/catalog.rs".to_owned(),
        format!("waybill schema show order.paid --version {next} --write domain/schemas"),
        "domain/schemas/released.json".to_owned(),
        "domain/src/order.rs".to_owned(),
        "waybill/src/cli.rs".to_owned(),
        "waybill/src/http.rs".to_owned(),
        "waybill/src/openapi.rs".to_owned(),
    ] {
        assert!(
            run.stdout.contains(&expected),
            "{expected:?} is missing:\n{}",
            run.stdout
        );
    }

    // The schema: the current one, retitled, in the committed format.
    let written = std::fs::read_to_string(&schema_file).expect("schema written");
    let mut schema: Value = serde_json::from_str(&written).expect("JSON");
    assert_eq!(schema["title"], format!("order.paid v{next}"));
    assert!(written.ends_with("}\n"));
    let current_file = domain.join(format!("schemas/order.paid.v{current}.schema.json"));
    let mut expected: Value =
        serde_json::from_slice(&std::fs::read(&current_file).expect("current schema"))
            .expect("JSON");
    schema["title"] = Value::Null;
    expected["title"] = Value::Null;
    assert_eq!(schema, expected, "only the title differs");

    // The fixture: the current one with event_version bumped, layout kept.
    let old = std::fs::read_to_string(domain.join(format!("fixtures/order.paid.v{current}.json")))
        .expect("current fixture");
    let new = std::fs::read_to_string(&fixture_file).expect("fixture written");
    assert_eq!(
        new,
        old.replace(
            &format!("\"event_version\": {current}"),
            &format!("\"event_version\": {next}")
        )
    );

    // Never twice: refused (exit 2), and both files are left as they are.
    let again = waybill(&[
        "schema",
        "new-version",
        "order.paid",
        "--dir",
        domain.to_str().expect("UTF-8 path"),
    ]);
    assert_eq!(again.code, 2, "{}{}", again.stdout, again.stderr);
    assert!(again.stderr.contains("already exist"), "{}", again.stderr);
    assert!(
        again.stderr.contains(&schema_file.display().to_string()),
        "{}",
        again.stderr
    );
    assert_eq!(
        std::fs::read_to_string(&schema_file).expect("kept"),
        written
    );
    assert_eq!(std::fs::read_to_string(&fixture_file).expect("kept"), new);

    // Nowhere near a domain folder, and no --dir: refused with the way out.
    let lost = tempfile::tempdir().expect("temp dir");
    let run = waybill_in(lost.path(), &["schema", "new-version", "order.paid"]);
    assert_eq!(run.code, 2, "{}{}", run.stdout, run.stderr);
    assert!(run.stderr.contains("pass --dir"), "{}", run.stderr);
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
            vec!["schema", "new-version", "order.teleported"],
            "unknown event type \"order.teleported\"",
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
