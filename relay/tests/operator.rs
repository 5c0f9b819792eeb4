//! The operator commands of `waybill-relay` against a real PostgreSQL: JSON output, refusals, and a
//! purge that never touches unsent rows.

mod common;

use common::seed;
use serde_json::Value;
use sqlx::PgPool;

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

async fn relay_cli(url: &str, args: &[&str]) -> Run {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_waybill-relay"))
        .args(args)
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

fn json(run: &Run) -> Value {
    assert_eq!(run.code, 0, "{}{}", run.stdout, run.stderr);
    serde_json::from_str(&run.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {}", run.stdout))
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn status_dead_list_and_replay_speak_json(pool: PgPool) {
    let url = testkit::database_url(&pool).await;
    seed(&pool, 3, 2).await;
    // One head dead, its follower waiting; one aggregate sent; one pending.
    sqlx::query(
        "UPDATE outbox SET status = 'dead', attempts = 12, dead_at = now(), dead_reason = 'max payload exceeded'
         WHERE aggregate_version = 1 AND aggregate_id = (SELECT aggregate_id FROM outbox ORDER BY aggregate_id LIMIT 1)",
    )
    .execute(&pool)
    .await
    .expect("dead row");
    sqlx::query(
        "UPDATE outbox SET status = 'sent', sent_at = now() - interval '2 days'
         WHERE aggregate_id = (SELECT aggregate_id FROM outbox ORDER BY aggregate_id DESC LIMIT 1)",
    )
    .execute(&pool)
    .await
    .expect("sent rows");

    let status = json(&relay_cli(&url, &["status", "--with-sent", "--json"]).await);
    assert_eq!(status["dead"], 1);
    assert_eq!(status["pending"], 3);
    assert_eq!(status["sent"], 2);
    assert_eq!(status["aggregates_held_back"], 1);
    assert!(status["oldest_pending_age_seconds"].as_f64().is_some());

    let dead = json(&relay_cli(&url, &["dead", "list", "--json"]).await);
    assert_eq!(dead.as_array().map(Vec::len), Some(1));
    assert_eq!(dead[0]["dead_reason"], "max payload exceeded");
    assert_eq!(dead[0]["waiting_behind"], 1);

    let unknown = relay_cli(&url, &["dead", "replay", "999999"]).await;
    assert_eq!(
        unknown.code, 2,
        "replaying a row that is not dead is refused: {}",
        unknown.stderr
    );
    assert!(
        unknown.stderr.contains("not a dead outbox row"),
        "{}",
        unknown.stderr
    );
    let garbage = relay_cli(&url, &["dead", "replay", "not-an-id"]).await;
    assert_eq!(garbage.code, 2);

    let event_id = dead[0]["event_id"].as_str().expect("event id").to_owned();
    let replayed = json(&relay_cli(&url, &["dead", "replay", &event_id, "--json"]).await);
    assert_eq!(replayed["replayed"], 1);
    let (status, attempts): (String, i32) =
        sqlx::query_as("SELECT status, attempts FROM outbox WHERE event_id = $1::uuid")
            .bind(&event_id)
            .fetch_one(&pool)
            .await
            .expect("row");
    assert_eq!((status.as_str(), attempts), ("pending", 0));
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn purge_deletes_only_sent_rows_older_than_asked(pool: PgPool) {
    let url = testkit::database_url(&pool).await;
    seed(&pool, 10, 2).await; // 20 rows
    sqlx::query("UPDATE outbox SET status = 'sent', sent_at = now() - interval '10 days' WHERE aggregate_version = 1")
        .execute(&pool)
        .await
        .expect("old sent");
    sqlx::query(
        "UPDATE outbox SET status = 'sent', sent_at = now() - interval '1 hour'
         WHERE aggregate_version = 2 AND aggregate_id IN (SELECT DISTINCT aggregate_id FROM outbox ORDER BY 1 LIMIT 4)",
    )
    .execute(&pool)
    .await
    .expect("recent sent");
    sqlx::query("UPDATE outbox SET status = 'dead', dead_at = now() - interval '30 days' WHERE status = 'pending' AND aggregate_id IN (SELECT DISTINCT aggregate_id FROM outbox ORDER BY 1 DESC LIMIT 2)")
        .execute(&pool)
        .await
        .expect("old dead");

    let purged = json(
        &relay_cli(
            &url,
            &["purge", "--sent-older-than", "7d", "--batch", "3", "--json"],
        )
        .await,
    );
    assert_eq!(purged["deleted"], 10);
    let counts = testkit::outbox_counts(&pool).await;
    assert_eq!(
        counts.get("sent"),
        Some(&4),
        "recent sent rows stay: {counts:?}"
    );
    assert_eq!(
        counts.get("dead"),
        Some(&2),
        "unsent rows are never purged: {counts:?}"
    );
    assert_eq!(counts.get("pending"), Some(&4), "{counts:?}");

    let bad = relay_cli(&url, &["purge", "--sent-older-than", "soon"]).await;
    assert_eq!(bad.code, 2, "a malformed duration is refused");
}
