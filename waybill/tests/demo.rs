//! `waybill demo` end to end, on the server of `DATABASE_URL` and a private nats-server: it must finish
//! on its own, show every step, and exit 0 because the projections agree with the event store.

use std::time::{Duration, Instant};

#[tokio::test]
async fn the_demo_runs_green_and_its_projections_agree_with_the_event_store() {
    let nats = ops::NatsServer::start().expect("nats-server");
    let database = format!("waybill_demo_test_{}", uuid::Uuid::now_v7().simple());
    let started = Instant::now();
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_waybill"))
        .args([
            "demo",
            "--orders",
            "24",
            "--database-name",
            &database,
            "--nats-url",
            &nats.url(),
        ])
        .env(
            "DATABASE_URL",
            std::env::var("DATABASE_URL").expect("DATABASE_URL"),
        )
        .output()
        .await
        .expect("waybill demo runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "the demo took {:?}",
        started.elapsed()
    );
    for needle in [
        "crash window",
        "duplicate=true",
        "legacy order.placed v1",
        "another Nats-Msg-Id",
        "settled",
        "all three projections agree with the event store",
    ] {
        assert!(stdout.contains(needle), "missing {needle:?} in:\n{stdout}");
    }
    assert!(!stdout.contains("DIFFERS"), "{stdout}");

    let admin = store::connect(
        &std::env::var("DATABASE_URL").expect("url"),
        "waybill-test",
        1,
    )
    .await
    .expect("connect");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS \"{database}\" WITH (FORCE)"
    )))
    .execute(&admin)
    .await
    .expect("drop");
}
