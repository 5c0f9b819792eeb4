//! The `waybill` binary against a real PostgreSQL: output contracts, exit codes, and that every refused
//! command names its problem and leaves the tables exactly as they were.

use serde_json::{Value, json};
use sqlx::PgPool;
use testkit::Run;
use uuid::Uuid;

async fn waybill(url: &str, args: &[&str]) -> Run {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_waybill"))
        .args(args)
        .env("DATABASE_URL", url)
        .env("RUST_LOG", "warn")
        .output()
        .await
        .expect("waybill runs");
    Run::from(output)
}

async fn place(url: &str, lines: &[&str]) -> String {
    let mut args = vec![
        "place",
        "--customer",
        "alice",
        "--currency",
        "EUR",
        "--json",
    ];
    for line in lines {
        args.extend(["--line", line]);
    }
    let run = waybill(url, &args).await;
    assert_eq!(run.code, 0, "{}{}", run.stdout, run.stderr);
    run.json()["order_id"]
        .as_str()
        .expect("order_id")
        .to_owned()
}

/// Everything in the tables, to compare before and after a refused command.
async fn snapshot(pool: &PgPool) -> Value {
    sqlx::query_scalar(
        "SELECT json_build_object(
            'events', (SELECT coalesce(json_agg(e ORDER BY position), '[]') FROM events e),
            'outbox', (SELECT coalesce(json_agg(o ORDER BY id), '[]') FROM outbox o),
            'keys', (SELECT coalesce(json_agg(k ORDER BY idempotency_key), '[]') FROM command_idempotency k))",
    )
    .fetch_one(pool)
    .await
    .expect("snapshot")
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn place_prints_the_contracted_json(pool: PgPool) {
    let url = testkit::database_url(&pool).await;
    let run = waybill(
        &url,
        &[
            "place",
            "--customer",
            "alice",
            "--currency",
            "EUR",
            "--line",
            "MUG:2:1250",
            "--json",
        ],
    )
    .await;
    assert_eq!(run.code, 0, "{}", run.stderr);
    let out = run.json();
    for field in ["order_id", "aggregate_version", "event_id"] {
        assert!(out.get(field).is_some(), "missing {field}: {out}");
    }
    assert_eq!(out["aggregate_version"], 1);
    let event_id: Uuid = serde_json::from_value(out["event_id"].clone()).expect("uuid");
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox WHERE event_id = $1")
        .bind(event_id)
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(stored, 1);
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_full_lifecycle_shows_the_folded_order(pool: PgPool) {
    let url = testkit::database_url(&pool).await;
    let id = place(&url, &["MUG-BLUE:2:1250", "TEA:1:500"]).await;
    assert_eq!(
        waybill(
            &url,
            &["pay", &id, "--amount", "3000", "--payment-ref", "psp-1"]
        )
        .await
        .code,
        0
    );
    assert_eq!(
        waybill(
            &url,
            &["ship", &id, "--carrier", "DHL", "--tracking", "JD1"]
        )
        .await
        .code,
        0
    );

    let shown = waybill(&url, &["show", &id, "--json"]).await;
    assert_eq!(shown.code, 0, "{}", shown.stderr);
    let order = shown.json();
    assert_eq!(order["status"], "shipped");
    assert_eq!(order["version"], 3);
    assert_eq!(order["total_cents"], 3000);
    assert_eq!(
        order["lines"],
        json!([
            {"sku": "MUG-BLUE", "quantity": 2, "unit_price_cents": 1250},
            {"sku": "TEA", "quantity": 1, "unit_price_cents": 500}
        ])
    );
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn every_refused_command_exits_2_names_the_problem_and_changes_nothing(pool: PgPool) {
    let url = testkit::database_url(&pool).await;
    let placed = place(&url, &["MUG:2:1250"]).await;
    let paid = place(&url, &["MUG:1:700"]).await;
    assert_eq!(
        waybill(&url, &["pay", &paid, "--amount", "700"]).await.code,
        0
    );
    let shipped = place(&url, &["MUG:1:900"]).await;
    assert_eq!(
        waybill(&url, &["pay", &shipped, "--amount", "900"])
            .await
            .code,
        0
    );
    assert_eq!(
        waybill(
            &url,
            &["ship", &shipped, "--carrier", "DHL", "--tracking", "T1"]
        )
        .await
        .code,
        0
    );
    let unknown = Uuid::now_v7().to_string();

    let place_base = ["place", "--customer", "bob", "--currency", "EUR"];
    let with = |extra: &[&'static str]| -> Vec<String> {
        place_base
            .iter()
            .chain(extra)
            .map(|s| s.to_string())
            .collect()
    };
    let cases: Vec<(&str, Vec<String>, &str)> = vec![
        ("empty order", with(&[]), "at least one line"),
        ("zero quantity", with(&["--line", "MUG:0:100"]), "quantity"),
        (
            "negative quantity",
            with(&["--line", "MUG:-2:100"]),
            "quantity",
        ),
        ("zero price", with(&["--line", "MUG:1:0"]), "positive"),
        (
            "negative price",
            with(&["--line", "MUG:1:-100"]),
            "positive",
        ),
        ("malformed sku", with(&["--line", "mug blue:1:100"]), "sku"),
        (
            "malformed line",
            with(&["--line", "MUG-1-100"]),
            "SKU:QUANTITY:UNIT_PRICE_CENTS",
        ),
        (
            "duplicate sku",
            with(&["--line", "MUG:1:1", "--line", "MUG:2:1"]),
            "more than one line",
        ),
        (
            "unpayable total",
            with(&["--line", "GOLD:2:1000000000000"]),
            "order total",
        ),
        (
            "not an ISO 4217 currency",
            vec![
                "place".into(),
                "--customer".into(),
                "bob".into(),
                "--currency".into(),
                "ZZZ".into(),
                "--line".into(),
                "MUG:1:1".into(),
            ],
            "ISO 4217",
        ),
        (
            "bad currency",
            vec![
                "place".into(),
                "--customer".into(),
                "bob".into(),
                "--currency".into(),
                "euro".into(),
                "--line".into(),
                "MUG:1:1".into(),
            ],
            "currency",
        ),
        (
            "wrong amount",
            vec!["pay".into(), placed.clone(), "--amount".into(), "1".into()],
            "does not match",
        ),
        (
            "negative amount",
            vec![
                "pay".into(),
                placed.clone(),
                "--amount".into(),
                "-2500".into(),
            ],
            "positive",
        ),
        (
            "paying twice",
            vec!["pay".into(), paid.clone(), "--amount".into(), "700".into()],
            "already paid",
        ),
        (
            "cancelling a shipped order",
            vec!["cancel".into(), shipped.clone()],
            "it is shipped",
        ),
        (
            "shipping an unpaid order",
            vec![
                "ship".into(),
                placed.clone(),
                "--carrier".into(),
                "DHL".into(),
                "--tracking".into(),
                "T".into(),
            ],
            "it is placed",
        ),
        (
            "shipping without a carrier",
            vec![
                "ship".into(),
                paid.clone(),
                "--carrier".into(),
                " ".into(),
                "--tracking".into(),
                "T".into(),
            ],
            "carrier",
        ),
        (
            "paying an unknown order",
            vec!["pay".into(), unknown.clone(), "--amount".into(), "1".into()],
            "not found",
        ),
        (
            "cancelling an unknown order",
            vec!["cancel".into(), unknown.clone()],
            "not found",
        ),
        (
            "showing an unknown order",
            vec!["show".into(), unknown.clone()],
            "not found",
        ),
        (
            "a malformed order id",
            vec![
                "pay".into(),
                "order-42".into(),
                "--amount".into(),
                "1".into(),
            ],
            "UUID",
        ),
        (
            "a stale expected version",
            vec![
                "pay".into(),
                placed.clone(),
                "--amount".into(),
                "2500".into(),
                "--expected-version".into(),
                "0".into(),
            ],
            "version",
        ),
    ];

    let before = snapshot(&pool).await;
    for (name, args, needle) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let run = waybill(&url, &args).await;
        assert_eq!(run.code, 2, "{name}: {}{}", run.stdout, run.stderr);
        assert!(
            run.stderr.contains(needle),
            "{name}: message {:?} should name {needle:?}",
            run.stderr
        );
        assert_eq!(snapshot(&pool).await, before, "{name} changed the tables");
    }
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn refusals_are_json_on_stdout_with_json(pool: PgPool) {
    let url = testkit::database_url(&pool).await;
    let run = waybill(&url, &["show", &Uuid::now_v7().to_string(), "--json"]).await;
    assert_eq!(run.code, 2);
    let out = run.json();
    assert_eq!(out["error"]["kind"], "refused");
    assert!(
        out["error"]["message"]
            .as_str()
            .expect("message")
            .contains("not found")
    );
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn an_idempotency_key_makes_place_safe_to_retry(pool: PgPool) {
    let url = testkit::database_url(&pool).await;
    let args = [
        "place",
        "--customer",
        "alice",
        "--currency",
        "EUR",
        "--line",
        "MUG:1:100",
        "--idempotency-key",
        "cart-7",
        "--json",
    ];
    let first = waybill(&url, &args).await.json();
    let retry = waybill(&url, &args).await.json();
    assert_eq!(first["order_id"], retry["order_id"]);
    assert_eq!(first["event_id"], retry["event_id"]);
    assert_eq!(retry["replayed"], true);
    let events: i64 = sqlx::query_scalar("SELECT count(*) FROM events")
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(events, 1);

    let mut different = args.to_vec();
    different[7] = "MUG:2:100";
    let reused = waybill(&url, &different).await;
    assert_eq!(reused.code, 2, "{}", reused.stdout);
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_legacy_v1_row_written_straight_into_events_shows_as_an_order(pool: PgPool) {
    let url = testkit::database_url(&pool).await;
    let id = Uuid::now_v7();
    sqlx::query(
        "INSERT INTO events (event_id, event_type, event_version, aggregate_type, aggregate_id,
                             aggregate_version, occurred_at, payload)
         VALUES ($1, 'order.placed', 1, 'order', $2, 1, now(), '{\"order_no\": \"A-1001\", \"amount_cents\": 4200}')",
    )
    .bind(Uuid::now_v7())
    .bind(id)
    .execute(&pool)
    .await
    .expect("legacy row");

    let shown = waybill(&url, &["show", &id.to_string(), "--json"]).await;
    assert_eq!(shown.code, 0, "{}", shown.stderr);
    let order = shown.json();
    assert_eq!(order["status"], "placed");
    assert_eq!(order["total_cents"], 4200);
    assert_eq!(order["customer_id"], "legacy");
    assert_eq!(order["version"], 1);
}

#[sqlx::test(migrations = false)]
async fn an_unmigrated_database_gets_a_hint(pool: PgPool) {
    let url = testkit::database_url(&pool).await;
    let run = waybill(&url, &["show", &Uuid::now_v7().to_string()]).await;
    assert_eq!(run.code, 1);
    assert!(run.stderr.contains("waybill migrate"), "{}", run.stderr);
}

#[tokio::test]
async fn migrate_creates_a_missing_database_and_is_idempotent() {
    let base = std::env::var("DATABASE_URL").expect("DATABASE_URL");
    let name = format!("waybill_migrate_{}", Uuid::now_v7().simple());
    let url = ops::database::with_database(&base, &name);

    let first = waybill(&url, &["migrate", "--json"]).await;
    assert_eq!(first.code, 0, "{}", first.stderr);
    assert_eq!(first.json()["created"], true);
    assert_eq!(
        first.json()["applied"].as_array().map(Vec::len),
        Some(store::MIGRATOR.iter().count())
    );
    let again = waybill(&url, &["migrate", "--json"]).await.json();
    assert_eq!(again["created"], false);
    assert_eq!(again["applied"], json!([]));

    let admin = ops::database::connect(&base, "waybill-test", 1)
        .await
        .expect("connect");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE \"{name}\" WITH (FORCE)"
    )))
    .execute(&admin)
    .await
    .expect("drop");
}

#[tokio::test]
async fn migrate_refuses_a_database_that_is_not_utf8_and_changes_nothing() {
    let base = std::env::var("DATABASE_URL").expect("DATABASE_URL");
    let name = format!("waybill_latin1_{}", Uuid::now_v7().simple());
    let admin = ops::database::connect(&base, "waybill-test", 1)
        .await
        .expect("connect");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE DATABASE \"{name}\" ENCODING 'LATIN1' TEMPLATE template0 LC_COLLATE 'C' LC_CTYPE 'C'"
    )))
    .execute(&admin)
    .await
    .expect("a LATIN1 database");
    let url = ops::database::with_database(&base, &name);
    let refused = waybill(&url, &["migrate"]).await;
    assert_eq!(refused.code, 2, "{}", refused.stderr);
    assert!(
        refused.stderr.contains("encoded LATIN1"),
        "{}",
        refused.stderr
    );
    let database = ops::database::connect(&url, "waybill-test", 1)
        .await
        .expect("connect");
    let tables: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'")
            .fetch_one(&database)
            .await
            .expect("tables");
    assert_eq!(tables, 0, "nothing migrated");
    database.close().await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE \"{name}\" WITH (FORCE)"
    )))
    .execute(&admin)
    .await
    .expect("drop");
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn outbox_status_counts_what_commands_wrote(pool: PgPool) {
    let url = testkit::database_url(&pool).await;
    let id = place(&url, &["MUG:1:100"]).await;
    assert_eq!(
        waybill(&url, &["pay", &id, "--amount", "100"]).await.code,
        0
    );
    let status = waybill(&url, &["outbox", "status", "--json"]).await.json();
    assert_eq!(status["pending"], 2, "{status}");
    assert_eq!(status["dead"], 0);
    let refused = waybill(&url, &["outbox", "dead", "replay", "42"]).await;
    assert_eq!(refused.code, 2, "{}", refused.stderr);
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_corrupt_stored_event_fails_show_naming_the_event_and_saying_each_cause_once(
    pool: PgPool,
) {
    let url = testkit::database_url(&pool).await;
    let id = place(&url, &["MUG:1:700"]).await;
    let order_id: Uuid = id.parse().expect("order id");

    // `events` refuses UPDATE through a trigger; as the database's owner, lift it for one statement.
    let mut tx = pool.begin().await.expect("begin");
    sqlx::query("ALTER TABLE events DISABLE TRIGGER ALL")
        .execute(&mut *tx)
        .await
        .expect("disable the triggers");
    let updated =
        sqlx::query("UPDATE events SET payload = '{\"nonsense\": true}' WHERE aggregate_id = $1")
            .bind(order_id)
            .execute(&mut *tx)
            .await
            .expect("corrupt the payload")
            .rows_affected();
    assert_eq!(updated, 1);
    sqlx::query("ALTER TABLE events ENABLE TRIGGER ALL")
        .execute(&mut *tx)
        .await
        .expect("enable the triggers");
    tx.commit().await.expect("commit");
    let event_id: Uuid = sqlx::query_scalar("SELECT event_id FROM events WHERE aggregate_id = $1")
        .bind(order_id)
        .fetch_one(&pool)
        .await
        .expect("the corrupted event");

    let shown = waybill(&url, &["show", &id]).await;
    assert_ne!(shown.code, 0, "{}{}", shown.stdout, shown.stderr);
    assert_eq!(shown.stdout, "", "no order is printed");
    let message = shown
        .stderr
        .lines()
        .find_map(|line| line.strip_prefix("error: "))
        .unwrap_or_else(|| panic!("no error line: {}", shown.stderr));
    for named in [
        &event_id.to_string(),
        &id,
        "cannot be decoded",
        "order.placed payload does not match its schema",
        "nonsense",
    ] {
        assert!(message.contains(named), "{named:?} not in {message:?}");
    }
    testkit::assert_no_clause_repeats(message);
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn customers_are_registered_renamed_and_shown_and_refusals_change_nothing(pool: PgPool) {
    let url = testkit::database_url(&pool).await;
    let registered = waybill(
        &url,
        &[
            "customer",
            "register",
            "--customer",
            "alice",
            "--name",
            "Alice",
            "--json",
        ],
    )
    .await
    .ok()
    .json();
    assert_eq!(registered["aggregate_version"], 1);
    assert_eq!(registered["customer_id"], "alice");
    let before = snapshot(&pool).await;
    for refused in [
        vec![
            "customer",
            "register",
            "--customer",
            "alice",
            "--name",
            "Again",
        ],
        vec!["customer", "register", "--customer", "a b", "--name", "x"],
        vec!["customer", "register", "--customer", "bob", "--name", "  "],
        vec!["customer", "rename", "--customer", "nobody", "--name", "N"],
        vec![
            "customer",
            "rename",
            "--customer",
            "alice",
            "--name",
            "Alice",
        ],
        vec!["customer", "show", "--customer", "nobody"],
    ] {
        let run = waybill(&url, &refused).await;
        assert_eq!(run.code, 2, "{refused:?}: {}{}", run.stdout, run.stderr);
        assert!(!run.stderr.trim().is_empty(), "{refused:?} says why");
    }
    assert_eq!(snapshot(&pool).await, before, "refusals wrote nothing");
    waybill(
        &url,
        &["customer", "rename", "--customer", "alice", "--name", "Al"],
    )
    .await
    .ok();
    let shown = waybill(&url, &["customer", "show", "--customer", "alice", "--json"])
        .await
        .ok()
        .json();
    assert_eq!(
        (shown["version"].clone(), shown["name"].clone()),
        (json!(2), json!("Al"))
    );
}
