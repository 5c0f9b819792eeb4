//! The console under its least-privilege role, over the real binaries: `waybill-console` run as a
//! login that is a member of `waybill_console` only — beside projections run as a login of
//! `waybill_projection`, which own their schemas — reads every page, and writes only the outbox
//! columns a replay changes, only with the operator token. A login of another role is refused at
//! start with what to do.

mod common;

use common::Console;
use serde_json::Value;
use sqlx::PgPool;
use store::EventStore;
use testkit::Login;
use testkit::login::denied;

const STREAM: &str = "CONSOLE_ROLE_EVENTS";
const PREFIX: &str = "console.role.events";
const TOKEN: &str = "console-role-operator-token";

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn the_console_works_as_a_member_of_waybill_console_only(pool: PgPool) {
    store::roles::create_roles(&pool).await.expect("roles");
    let nats = testkit::NatsServer::start().expect("nats-server");
    let url = testkit::database_url(&pool).await;
    let store = EventStore::new(pool.clone());
    let order = testkit::place_order(&store, "alice", &["MUG:1:100"]).await;
    testkit::pay_order(&store, order).await;
    let dead = testkit::place_order(&store, "bob", &["TEA:2:300"]).await;
    // Kept connected: the console counts the relays' sessions in pg_stat_activity.
    let _relay = testkit::relay_everything(&url, &nats.url(), STREAM, PREFIX).await;
    sqlx::query(
        "UPDATE outbox SET status = 'dead', dead_at = now(), dead_reason = 'test' WHERE aggregate_id = $1",
    )
    .bind(dead.as_uuid())
    .execute(&pool)
    .await
    .expect("a dead row");
    // The projections as the README runs them: a login of waybill_projection, owning its schemas.
    let reader = Login::create(&pool, "waybill_projection").await;
    common::project_all(&reader.url, &nats.url(), (STREAM, PREFIX)).await;

    let login = Login::create(&pool, "waybill_console").await;
    let console = Console::start_as(
        &login.url,
        &[
            "--nats-url",
            &nats.url(),
            "--stream",
            STREAM,
            "--subject-prefix",
            PREFIX,
            "--operator-token",
            TOKEN,
        ],
    )
    .await;
    let id = order.as_uuid();
    assert_eq!(console.status("/console").await, 200);
    assert_eq!(console.status(&format!("/console/orders/{id}")).await, 200);
    assert_eq!(console.status("/console/outbox/dead").await, 200);
    for name in ["inventory", "points", "search"] {
        for list in ["parked", "held"] {
            let page = console
                .client
                .get(format!(
                    "{}/console/projections/{name}/{list}",
                    console.base
                ))
                .send()
                .await
                .expect("answers");
            assert_eq!(page.status(), 200);
            let page = page.text().await.expect("text");
            assert!(
                !page.contains("could not be read"),
                "{name} {list}:\n{page}"
            );
        }
    }

    // Each read model's document is readable through this role (each model's schema grants the
    // console the reading of its tables), and is the model's fold of the event store.
    for model in projections::registry::MODELS {
        let path = format!("/console/api/projections/{}/document", model.name());
        let answer = console.json(&path).await;
        assert_eq!(answer["error"], Value::Null, "{}: {answer:#}", model.name());
        let expected = model.expected(&url).await.expect("the model's fold");
        assert_eq!(answer["document"], expected, "{}: {answer:#}", model.name());
    }

    // Every part of the overview was read, none refused.
    let overview = console.json("/console/api/overview").await;
    let snapshot = &overview["snapshot"];
    assert_eq!(snapshot["events"]["stored"], 3, "{snapshot:#}");
    assert_eq!(snapshot["events"]["error"], Value::Null, "{snapshot:#}");
    assert_eq!(snapshot["outbox_error"], Value::Null, "{snapshot:#}");
    assert_eq!(snapshot["outbox"]["dead"], 1, "{snapshot:#}");
    assert_eq!(snapshot["relay"]["connected"], 1, "{snapshot:#}");
    for projection in snapshot["projections"].as_array().expect("projections") {
        assert_eq!(projection["found"], true, "{projection:#}");
        assert_eq!(projection["error"], Value::Null, "{projection:#}");
        assert_eq!(projection["applied"], 3, "{projection:#}");
    }
    let timeline = console.json(&format!("/console/api/orders/{id}")).await;
    assert!(timeline["fold_error"].is_null(), "{timeline:#}");
    for event in timeline["events"].as_array().expect("events") {
        for marks in event["projections"].as_array().expect("marks") {
            assert_eq!(marks[1], "applied", "{event:#}");
        }
    }

    // The replay needs the token, and then writes through this role.
    assert_eq!(console.replay_with_the_token_only(TOKEN).await, 1);
    assert_eq!(sessions(&pool, &login.name).await, (true, true));
    drop(console);

    // Without the token the console opens no session that could write.
    let reader_only = Console::start_as(&login.url, &["--nats-url", "nats://127.0.0.1:1"]).await;
    assert_eq!(reader_only.status("/console/outbox/dead").await, 200);
    testkit::wait_until(
        std::time::Duration::from_secs(10),
        "the first console's sessions gone",
        || async { sessions(&pool, &login.name).await == (true, false) },
    )
    .await;
    drop(reader_only);

    // Exactly that: no other write, on the event store or the projections.
    let as_console = &login.pool;
    for sql in [
        "UPDATE events SET payload = '{}'",
        "DELETE FROM events",
        "INSERT INTO outbox (event_id) VALUES (gen_random_uuid())",
        "UPDATE outbox SET body = '{}'",
        "UPDATE outbox SET stream_seq = 1",
        "DELETE FROM outbox",
        "DELETE FROM outbox_inflight",
        "SELECT count(*) FROM command_idempotency",
        "DELETE FROM inventory.checkpoints",
        "UPDATE inventory.parked SET discarded_at = now()",
        "SELECT count(*) FROM inventory.stock",
        "DELETE FROM revenue.revenue",
        "DELETE FROM customers.aggregate_state",
    ] {
        assert!(denied(as_console, sql).await, "the console may: {sql}");
    }
    login.drop(&pool).await;
    reader.drop(&pool).await;
}

/// Whether `user` has console sessions that read (`waybill-console`) and that write
/// (`waybill-console-actions`).
async fn sessions(pool: &PgPool, user: &str) -> (bool, bool) {
    sqlx::query_as(
        "SELECT bool_or(application_name = 'waybill-console') IS TRUE,
                bool_or(application_name = 'waybill-console-actions') IS TRUE
         FROM pg_stat_activity WHERE usename = $1",
    )
    .bind(user)
    .fetch_one(pool)
    .await
    .expect("pg_stat_activity")
}

/// The order service's role (the README's old advice for the console) cannot read the outbox: the
/// console refuses to start with it, and says what to do.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_login_without_the_consoles_role_is_told_what_to_grant(pool: PgPool) {
    store::roles::create_roles(&pool).await.expect("roles");
    let app = Login::create(&pool, "waybill_app").await;
    let run = tokio::process::Command::new(env!("CARGO_BIN_EXE_waybill-console"))
        .args(["run", "--listen", "127.0.0.1:0"])
        .env("DATABASE_URL", &app.url)
        .env("RUST_LOG", "warn")
        .kill_on_drop(true)
        .output();
    let run = tokio::time::timeout(std::time::Duration::from_secs(30), run)
        .await
        .expect("it stops at once instead of serving")
        .expect("runs");
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("may not read outbox") && stderr.contains("waybill_console"),
        "{stderr}"
    );
    app.drop(&pool).await;
}
