//! `cargo xtask new-version|write-schema|bench-table` as a maintainer runs them: the real binary on a copy of
//! the domain crate, the files it writes, its checklist and its exit codes.

mod common;

use common::{copy_domain, workspace, xtask_in};
use domain::aggregate::current_version_of;
use domain::catalog::{payload_schemas, schema_file_name};
use serde_json::Value;

#[test]
fn new_version_scaffolds_the_next_version_once() {
    let root = tempfile::tempdir().expect("temp dir");
    let domain = copy_domain(root.path());
    // Run from deep inside the copy: the domain folder is found by walking up.
    let deep = root.path().join("waybill/src");
    std::fs::create_dir_all(&deep).expect("mkdir");
    let current = current_version_of("order.paid").expect("order.paid");
    let next = current + 1;

    let run = xtask_in(&deep, &["new-version", "order.paid"]).ok();
    let schema_file = domain.join(format!("schemas/order.paid.v{next}.schema.json"));
    let fixture_file = domain.join(format!("fixtures/order.paid.v{next}.json"));
    for expected in [
        format!("created {}", schema_file.display()),
        format!("created {}", fixture_file.display()),
        "OrderPaid (domain/src/event.rs:".to_owned(),
        "OrderPaid::from_command (domain/src/event.rs:".to_owned(),
        "CURRENT_VERSIONS (domain/src/event.rs:".to_owned(),
        "beside the aggregate's other steps (domain/src/upcast.rs:".to_owned(),
        "Order::upcasters() (domain/src/order.rs:".to_owned(),
        format!(
            ".with_named_step(OrderEvent::PAID, {current}, \"domain::upcast::order_paid_v{current}_to_v{next}\""
        ),
        format!("beside v{current}'s (domain/src/catalog.rs:"),
        "cargo xtask write-schema order.paid".to_owned(),
        format!("domain/fixtures/order.paid.v{next}.json"),
        "PayOrder (domain/src/order.rs:".to_owned(),
        "domain/schemas/released.json".to_owned(),
        xtask::checklist::CHECK.to_owned(),
        "docs/guides/new-event-version.md".to_owned(),
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
    let dir = domain.to_str().expect("UTF-8 path");
    let again = xtask_in(root.path(), &["new-version", "order.paid", "--dir", dir]);
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
    let run = xtask_in(lost.path(), &["new-version", "order.paid"]);
    assert_eq!(run.code, 2, "{}{}", run.stdout, run.stderr);
    assert!(run.stderr.contains("pass --dir"), "{}", run.stderr);
}

#[test]
fn a_customer_event_is_scaffolded_with_the_customer_module_in_its_checklist() {
    let root = tempfile::tempdir().expect("temp dir");
    let domain = copy_domain(root.path());
    let run = xtask_in(root.path(), &["new-version", "customer.renamed", "--json"]).ok();
    let answer = run.json();
    let next = current_version_of("customer.renamed").expect("known") + 1;
    assert_eq!(answer["event_type"], "customer.renamed");
    assert_eq!(answer["to"], next);
    assert!(
        domain
            .join(format!("fixtures/customer.renamed.v{next}.json"))
            .is_file()
    );
    let steps: Vec<&str> = answer["steps"]
        .as_array()
        .expect("steps")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let all = steps.join("\n");
    for expected in [
        "CustomerRenamed (domain/src/customer.rs:",
        "CustomerRenamed::from_command (domain/src/customer.rs:",
        "Customer::upcasters() (domain/src/customer.rs:",
        "CustomerEvent::RENAMED",
        "CURRENT_VERSIONS (domain/src/customer.rs:",
        "(domain/src/customer.rs:",
        "RenameCustomer (domain/src/customer.rs:",
    ] {
        assert!(all.contains(expected), "{expected:?} is missing:\n{all}");
    }
    for order_only in [
        "domain/src/event.rs",
        "domain/src/catalog.rs",
        "Order::upcasters",
    ] {
        assert!(!all.contains(order_only), "{order_only:?} in:\n{all}");
    }
}

#[test]
fn write_schema_reproduces_every_committed_file_byte_for_byte() {
    let root = tempfile::tempdir().expect("temp dir");
    let domain = copy_domain(root.path());
    let dir = domain.to_str().expect("UTF-8 path");
    for entry in payload_schemas() {
        let (event_type, version) = (entry.event_type, entry.event_version);
        let name = schema_file_name(event_type, version);
        std::fs::remove_file(domain.join("schemas").join(&name)).expect("committed");
        let run = xtask_in(
            root.path(),
            &[
                "write-schema",
                event_type,
                "--version",
                &version.to_string(),
                "--dir",
                dir,
            ],
        )
        .ok();
        let written = domain.join("schemas").join(&name);
        assert_eq!(run.stdout.trim_end(), written.display().to_string());
        let committed =
            std::fs::read(workspace().join("domain/schemas").join(&name)).expect("committed");
        assert!(
            std::fs::read(&written).expect("written") == committed,
            "{name}: write-schema differs from the committed file"
        );
    }
    // --json says where it wrote; without --version, the current one.
    let run = xtask_in(root.path(), &["write-schema", "order.paid", "--json"]).ok();
    let answer = run.json();
    assert_eq!(answer["event_type"], "order.paid");
    assert_eq!(
        answer["version"],
        current_version_of("order.paid").expect("known")
    );
    assert!(
        answer["path"]
            .as_str()
            .is_some_and(|p| p.ends_with(".schema.json"))
    );
}

#[test]
fn write_schema_never_changes_a_released_schema_but_regenerates_an_unreleased_one() {
    let root = tempfile::tempdir().expect("temp dir");
    let domain = copy_domain(root.path());
    let schemas = domain.join("schemas");
    let file = schemas.join("order.paid.v1.schema.json");
    let tampered = std::fs::read_to_string(&file)
        .expect("committed")
        .replace("\"maxLength\": 200", "\"maxLength\": 100");
    std::fs::write(&file, &tampered).expect("write");
    let args = ["write-schema", "order.paid", "--version", "1"];

    // Released (released.json lists order.paid 1): the file differs from the code, and writing
    // must not make them agree by rewriting what was published.
    let run = xtask_in(root.path(), &args);
    assert_eq!(run.code, 2, "{}{}", run.stdout, run.stderr);
    for expected in [
        "order.paid v1 is released",
        "released.json",
        "order.paid.v1.schema.json",
        "publish a new version instead: cargo xtask new-version order.paid",
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
    xtask_in(root.path(), &args).ok();
    assert_eq!(
        std::fs::read(&file).expect("rewritten"),
        std::fs::read(workspace().join("domain/schemas/order.paid.v1.schema.json"))
            .expect("committed")
    );

    // A broken list is a failure of the repository, not of the input: exit 1.
    std::fs::write(schemas.join("released.json"), "[").expect("write");
    let run = xtask_in(root.path(), &args);
    assert_eq!(run.code, 1, "{}{}", run.stdout, run.stderr);
    assert!(
        run.stderr
            .contains("is not a list of released versions: not JSON"),
        "{}",
        run.stderr
    );
}

#[test]
fn unknown_types_and_versions_are_refused_with_exit_2() {
    let root = tempfile::tempdir().expect("temp dir");
    let domain = copy_domain(root.path());
    for (args, expected) in [
        (
            vec!["new-version", "order.teleported"],
            "unknown event type \"order.teleported\"; the catalog has order.placed",
        ),
        (
            vec!["write-schema", "order.teleported"],
            "unknown event type \"order.teleported\"",
        ),
        (
            vec!["write-schema", "order.paid", "--version", "99"],
            "order.paid has no version 99 in the catalog; its versions are 1",
        ),
    ] {
        let run = xtask_in(root.path(), &args);
        assert_eq!(run.code, 2, "{args:?}: {}{}", run.stdout, run.stderr);
        assert!(run.stdout.is_empty(), "{args:?}: {}", run.stdout);
        assert!(
            run.stderr.starts_with("error: ") && run.stderr.contains(expected),
            "{args:?}: {}",
            run.stderr
        );
    }
    let run = xtask_in(root.path(), &["new-version", "order.teleported", "--json"]);
    assert_eq!(run.code, 2);
    assert_eq!(run.json()["error"]["kind"], "refused");
    // Nothing was written.
    let fixtures = std::fs::read_dir(domain.join("fixtures"))
        .expect("readable")
        .count();
    assert_eq!(
        fixtures,
        std::fs::read_dir(workspace().join("domain/fixtures"))
            .expect("readable")
            .count()
    );
}

/// The README's benchmark table is the published run's, figure for figure: committing a new
/// `docs/bench.json` without `cargo xtask bench-table` (or editing the table by hand) fails here.
#[test]
fn the_readmes_benchmark_table_is_rendered_from_the_published_run() {
    let root = workspace();
    let run = xtask_in(&root, &["bench-table", "--check", "--json"]);
    assert_eq!(run.code, 0, "{}{}", run.stdout, run.stderr);
    assert_eq!(run.json()["written"], false);

    // A table that differs is refused, and the tool puts the run's back.
    let copy = tempfile::tempdir().expect("temp dir");
    let readme = copy.path().join("README.md");
    let original = std::fs::read_to_string(root.join("README.md")).expect("README.md");
    let start = original
        .find(xtask::bench_table::START)
        .expect("the README has the table's markers");
    let mut edited = original.clone();
    edited.insert_str(
        start + xtask::bench_table::START.len(),
        "\n| edited by hand |",
    );
    std::fs::write(&readme, &edited).expect("write");
    let bench = root.join("docs/bench.json");
    let paths = [
        "--bench",
        bench.to_str().expect("utf-8"),
        "--readme",
        readme.to_str().expect("utf-8"),
    ];
    let refused = xtask_in(&root, &[&["bench-table", "--check"][..], &paths].concat());
    assert_eq!(refused.code, 2, "{}{}", refused.stdout, refused.stderr);
    assert!(
        refused.stderr.contains("stale benchmark table"),
        "{}",
        refused.stderr
    );
    xtask_in(&root, &[&["bench-table"][..], &paths].concat()).ok();
    assert_eq!(std::fs::read_to_string(&readme).expect("read"), original);
}
