//! `waybill-relay wal check` against real servers: a private PostgreSQL made for logical decoding
//! (testkit's) passes, and what is missing — the privilege, the publication, the setting — is named
//! with exit 1; a slot's lag is reported; nothing is changed by the check.

use serde_json::Value;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use testkit::PostgresServer;

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

async fn wal_check(url: &str, extra: &[&str]) -> Run {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_waybill-relay"))
        .args(["wal", "check", "--json"])
        .args(extra)
        .args(["--database-url", url])
        .env("RUST_LOG", "warn")
        .output()
        .await
        .expect("waybill-relay runs");
    Run {
        code: output.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

fn findings(run: &Run) -> Value {
    serde_json::from_str(&run.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}{}", run.stdout, run.stderr))
}

fn verdict<'a>(findings: &'a Value, check: &str) -> (&'a str, &'a str) {
    let finding = findings["findings"]
        .as_array()
        .expect("findings")
        .iter()
        .find(|f| f["check"] == check)
        .unwrap_or_else(|| panic!("no finding {check}: {findings}"));
    (
        finding["verdict"].as_str().expect("verdict"),
        finding["detail"].as_str().expect("detail"),
    )
}

async fn migrated(server: &PostgresServer) -> (String, PgPool) {
    let url = server.url("shop");
    ops::database::ensure_database(&url)
        .await
        .expect("database");
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect(&url)
        .await
        .expect("connects");
    store::MIGRATOR.run(&pool).await.expect("migrated");
    (url, pool)
}

#[tokio::test]
async fn a_server_made_for_logical_decoding_passes_and_a_slot_reports_its_lag() {
    let server = PostgresServer::start().expect("private PostgreSQL");
    let (url, pool) = migrated(&server).await;

    let run = wal_check(&url, &[]).await;
    assert_eq!(run.code, 0, "{}{}", run.stdout, run.stderr);
    let found = findings(&run);
    assert_eq!(found["ready"], true);
    assert_eq!(verdict(&found, "wal_level").0, "ok");
    assert_eq!(verdict(&found, "publication").0, "ok");
    assert_eq!(verdict(&found, "replication privilege").0, "ok");
    let (connection, detail) = verdict(&found, "replication connection");
    assert_eq!(connection, "ok", "{detail}");
    assert!(detail.contains("database shop"), "{detail}");
    // No limit on what a slot may keep: works, but said.
    assert_eq!(verdict(&found, "max_slot_wal_keep_size").0, "warn");
    let slots: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_replication_slots")
        .fetch_one(&pool)
        .await
        .expect("slots");
    assert_eq!(slots, 0, "the check creates nothing");

    // A slot nobody reads falls behind as WAL is written, and says so.
    sqlx::query("SELECT pg_create_logical_replication_slot('waybill_outbox', 'pgoutput')")
        .execute(&pool)
        .await
        .expect("slot");
    sqlx::query(
        "CREATE TABLE filler AS SELECT g, repeat('x', 500) AS pad FROM generate_series(1, 5000) g",
    )
    .execute(&pool)
    .await
    .expect("WAL written");
    let found = findings(&wal_check(&url, &[]).await);
    let (slot, detail) = verdict(&found, "slot");
    assert_eq!(slot, "ok", "{detail}");
    assert!(detail.contains("no reader"), "{detail}");
    assert!(!detail.contains(" 0.0 MB behind"), "{detail}");
    // `status` shows the slot and its lag too, for scripts and for people.
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_waybill-relay"))
        .args(["status", "--json", "--database-url", &url])
        .output()
        .await
        .expect("status runs");
    let status: Value = serde_json::from_slice(&output.stdout).expect("JSON");
    assert_eq!(status["wal_slots"][0]["name"], "waybill_outbox", "{status}");
    assert_eq!(status["wal_slots"][0]["active"], false);
    assert!(
        status["wal_slots"][0]["lag_bytes"].as_i64() > Some(100_000),
        "{status}"
    );
    assert_eq!(
        status["pending"], 0,
        "the outbox's own fields stay where they were"
    );

    // Another plugin's slot under the name is not ours to read.
    sqlx::query("SELECT pg_create_logical_replication_slot('decoding', 'test_decoding')")
        .execute(&pool)
        .await
        .expect("slot");
    let run = wal_check(&url, &["--slot", "decoding"]).await;
    assert_eq!(run.code, 1);
    assert_eq!(verdict(&findings(&run), "slot").0, "missing");
}

#[tokio::test]
async fn what_is_missing_is_named_and_exits_1() {
    let server = PostgresServer::start().expect("private PostgreSQL");
    let (url, pool) = migrated(&server).await;
    sqlx::query("CREATE ROLE plain LOGIN")
        .execute(&pool)
        .await
        .expect("role");
    sqlx::query("DROP PUBLICATION waybill_outbox")
        .execute(&pool)
        .await
        .expect("dropped");
    let plain = url.replacen("postgres@", "plain@", 1);
    assert_ne!(plain, url, "the URL names its user: {url}");

    let run = wal_check(&plain, &[]).await;
    assert_eq!(run.code, 1, "{}{}", run.stdout, run.stderr);
    let found = findings(&run);
    assert_eq!(found["ready"], false);
    let (privilege, detail) = verdict(&found, "replication privilege");
    assert_eq!(privilege, "missing");
    assert!(detail.contains("ALTER ROLE plain REPLICATION"), "{detail}");
    let (publication, detail) = verdict(&found, "publication");
    assert_eq!(publication, "missing");
    assert!(
        detail.contains("CREATE PUBLICATION waybill_outbox"),
        "{detail}"
    );
    assert_eq!(verdict(&found, "replication connection").0, "missing");
    // Amazon RDS and Aurora grant the privilege through this role's membership instead.
    for statement in [
        "CREATE ROLE rds_replication",
        "GRANT rds_replication TO plain",
    ] {
        sqlx::query(statement)
            .execute(&pool)
            .await
            .expect(statement);
    }
    let found = findings(&wal_check(&plain, &[]).await);
    assert_eq!(verdict(&found, "replication privilege").0, "ok");
    sqlx::query("DROP ROLE rds_replication")
        .execute(&pool)
        .await
        .expect("dropped");

    // Names that would need quoting are refused before anything is read, and so is one that
    // PostgreSQL makes a slot of but `START_REPLICATION` cannot read.
    let run = wal_check(&url, &["--slot", "Bad-Slot"]).await;
    assert_eq!(run.code, 2, "{}", run.stderr);
    let run = wal_check(&url, &["--slot", "1abc"]).await;
    assert_eq!(run.code, 2, "{}", run.stderr);

    // `run --source wal` refuses at once what the check finds missing, rather than retrying a
    // session that cannot work, and makes no slot.
    let started = std::time::Instant::now();
    let (code, stderr) = run_wal(&plain, &[]).await;
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("ALTER ROLE plain REPLICATION"), "{stderr}");
    assert!(
        stderr.contains("CREATE PUBLICATION waybill_outbox"),
        "{stderr}"
    );
    assert!(started.elapsed() < std::time::Duration::from_secs(20));
    let slots: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_replication_slots")
        .fetch_one(&pool)
        .await
        .expect("slots");
    assert_eq!(slots, 0);
}

/// `waybill-relay run --source wal` against `url` (NATS nowhere: a refusal comes before it is
/// needed); its exit code and standard error.
async fn run_wal(url: &str, extra: &[&str]) -> (i32, String) {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_waybill-relay"))
        .args(["run", "--source", "wal"])
        .args(extra)
        .args(["--database-url", url, "--nats-url", "nats://127.0.0.1:1"])
        .env("RUST_LOG", "warn")
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(std::time::Duration::from_secs(60), output)
        .await
        .expect("it ends by itself")
        .expect("waybill-relay runs");
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// Slot names are shared by the whole server: another database's slot of the default name is not
/// this database's to stand by for or read, and a publication that narrows the outbox's rows or
/// columns would keep events from the relay.
#[tokio::test]
async fn another_databases_slot_and_a_narrowed_publication_are_named() {
    let server = PostgresServer::start().expect("private PostgreSQL");
    let (url, pool) = migrated(&server).await;
    let other = server.url("other");
    ops::database::ensure_database(&other)
        .await
        .expect("database");
    let other_pool = PgPoolOptions::new()
        .max_connections(2)
        .connect(&other)
        .await
        .expect("connects");
    store::MIGRATOR.run(&other_pool).await.expect("migrated");
    sqlx::query("SELECT pg_create_logical_replication_slot('waybill_outbox', 'pgoutput')")
        .execute(&other_pool)
        .await
        .expect("the other database's slot");

    let run = wal_check(&url, &[]).await;
    assert_eq!(run.code, 1, "{}{}", run.stdout, run.stderr);
    let found = findings(&run);
    let (slot, detail) = verdict(&found, "slot");
    assert_eq!(slot, "missing", "{detail}");
    assert!(detail.contains("not a slot of this database"), "{detail}");
    let (code, stderr) = run_wal(&url, &[]).await;
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("not a slot of this database"), "{stderr}");
    // A slot of its own is fine.
    let run = wal_check(&url, &["--slot", "shop_outbox"]).await;
    assert_eq!(run.code, 0, "{}{}", run.stdout, run.stderr);

    for (narrowing, expected) in [
        (
            "ALTER PUBLICATION waybill_outbox SET TABLE outbox (id, event_id, aggregate_id)",
            "leaves out the outbox's columns",
        ),
        (
            "ALTER PUBLICATION waybill_outbox SET TABLE outbox WHERE (aggregate_version > 1)",
            "filters the outbox's rows",
        ),
    ] {
        sqlx::query(narrowing)
            .execute(&pool)
            .await
            .expect("narrowed");
        let run = wal_check(&url, &["--slot", "shop_outbox"]).await;
        assert_eq!(run.code, 1, "{}{}", run.stdout, run.stderr);
        let found = findings(&run);
        let (publication, detail) = verdict(&found, "publication");
        assert_eq!(publication, "missing", "{detail}");
        assert!(detail.contains(expected), "{detail}");
        assert!(
            detail.contains("ALTER PUBLICATION waybill_outbox SET TABLE outbox"),
            "{detail}"
        );
    }
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_server_without_logical_decoding_is_told_how_to_enable_it(pool: PgPool) {
    let wal_level: String = sqlx::query_scalar("SHOW wal_level")
        .fetch_one(&pool)
        .await
        .expect("wal_level");
    let url = testkit::database_url(&pool).await;
    let found = findings(&wal_check(&url, &[]).await);
    let (verdict, detail) = verdict(&found, "wal_level");
    if wal_level == "logical" {
        assert_eq!(verdict, "ok");
    } else {
        assert_eq!(verdict, "missing");
        assert!(detail.contains("wal_level = logical"), "{detail}");
        assert_eq!(found["ready"], false);
        // …and a WAL relay started there says so and ends, rather than retrying forever.
        let (code, stderr) = run_wal(&url, &[]).await;
        assert_eq!(code, 1, "{stderr}");
        assert!(stderr.contains("wal_level = logical"), "{stderr}");
    }
}

#[tokio::test]
async fn run_with_the_wal_source_refuses_what_it_cannot_do_before_connecting() {
    let refused = |args: &'static [&'static str], url: &'static str| async move {
        let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_waybill-relay"))
            .args(["run", "--source", "wal"])
            .args(args)
            // Nothing listens there: a refusal must come before any connection is tried.
            .args(["--database-url", url, "--nats-url", "nats://127.0.0.1:1"])
            .env("RUST_LOG", "warn")
            .output()
            .await
            .expect("waybill-relay runs");
        (
            output.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&output.stderr).into_owned(),
        )
    };
    let (code, stderr) = refused(&["--once"], "postgres://u@127.0.0.1:1/db").await;
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("--once"), "{stderr}");
    let (code, stderr) = refused(&["--ignore-slot"], "postgres://u@127.0.0.1:1/db").await;
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("--ignore-slot is for polling relays"),
        "{stderr}"
    );
    let (code, stderr) = refused(&["--slot", "no such; slot"], "postgres://u@127.0.0.1:1/db").await;
    assert_eq!(code, 2, "{stderr}");
    let (code, stderr) = refused(
        &[],
        "postgres://u:secret@127.0.0.1:1/db?sslmode=verify-full&sslcert=/c.pem",
    )
    .await;
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("sslcert and sslkey go together"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("secret"),
        "the password is not printed: {stderr}"
    );
}

/// A slot nobody reads is reported before `max_slot_wal_keep_size` lets PostgreSQL invalidate it,
/// not only once it is past it: the check warns (exit 0) with the WAL left.
#[tokio::test]
async fn a_slot_near_max_slot_wal_keep_size_is_warned_about_before_it_is_lost() {
    let server = PostgresServer::start().expect("private PostgreSQL");
    let (url, pool) = migrated(&server).await;
    for statement in [
        "ALTER SYSTEM SET max_slot_wal_keep_size = '100MB'",
        "SELECT pg_reload_conf()",
    ] {
        sqlx::query(statement)
            .execute(&pool)
            .await
            .expect("configured");
    }
    sqlx::query("SELECT pg_create_logical_replication_slot('waybill_outbox', 'pgoutput')")
        .execute(&pool)
        .await
        .expect("slot");
    let fresh = findings(&wal_check(&url, &[]).await);
    let (slot, detail) = verdict(&fresh, "slot");
    assert_eq!(slot, "ok", "a fresh slot has all of it left: {detail}");
    // About 80 MB of WAL while nobody reads the slot: five segments, each ended by a switch.
    sqlx::query("CREATE TABLE filler (g int)")
        .execute(&pool)
        .await
        .expect("table");
    for _ in 0..5 {
        sqlx::query("INSERT INTO filler SELECT generate_series(1, 10)")
            .execute(&pool)
            .await
            .expect("WAL written");
        sqlx::query("SELECT pg_switch_wal()")
            .execute(&pool)
            .await
            .expect("segment switched");
    }
    let run = wal_check(&url, &[]).await;
    assert_eq!(run.code, 0, "a warning, not a failure: {}", run.stdout);
    let found = findings(&run);
    let (slot, detail) = verdict(&found, "slot");
    assert_eq!(slot, "warn", "{detail}");
    assert!(
        detail.contains("of WAL left before max_slot_wal_keep_size"),
        "{detail}"
    );
    let wal_status: String = sqlx::query_scalar(
        "SELECT wal_status FROM pg_replication_slots WHERE slot_name = 'waybill_outbox'",
    )
    .fetch_one(&pool)
    .await
    .expect("slot state");
    assert_eq!(
        wal_status, "reserved",
        "warned before PostgreSQL gave up on it"
    );
}
