//! `waybill-lab load` against a real PostgreSQL: the lifecycles it plays are the events it wrote.

use sqlx::PgPool;

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn load_plays_lifecycles_and_summarises_them(pool: PgPool) {
    let url = testkit::database_url(&pool).await;
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_waybill-lab"))
        .args(["load", "--orders", "20", "--concurrency", "4", "--json"])
        .env("DATABASE_URL", &url)
        .env("RUST_LOG", "warn")
        .output()
        .await
        .expect("waybill-lab load runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let summary: serde_json::Value = serde_json::from_str(&stdout).expect("one JSON summary");
    assert_eq!(summary["placed"], 20);
    assert_eq!(summary["errors"], 0);
    let events: i64 = sqlx::query_scalar("SELECT count(*) FROM events")
        .fetch_one(&pool)
        .await
        .expect("count");
    let commands = summary["commands"].as_i64().expect("commands")
        - summary["refused_as_expected"].as_i64().expect("refused");
    assert_eq!(
        events, commands,
        "one event per accepted command, none for the refused ones"
    );
}
