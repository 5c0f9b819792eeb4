//! `waybill demo --rollout` end to end over the real binaries, with its database and stream named by
//! flags (so it cannot collide with another run): it must exit 0, and what it tells must be true of
//! what it leaves behind — v2 and v3 `order.placed` events in the store, in the stream it was given,
//! and in each projection every v3 order parked once by the old reader and redriven after the upgrade.

use std::time::Duration;

#[tokio::test]
async fn the_rollout_story_parks_v3_in_old_readers_and_redrive_settles_it() {
    testkit::build_workspace_binaries(env!("CARGO_MANIFEST_DIR"));

    let nats = testkit::NatsServer::start().expect("nats-server");
    let url = std::env::var("DATABASE_URL").expect("DATABASE_URL");
    let suffix = uuid::Uuid::now_v7().simple().to_string();
    let database = format!("waybill_rollout_test_{suffix}");
    let stream = format!("ROLLOUT_TEST_{suffix}");
    let prefix = format!("rollout.test.{suffix}");
    let run = tokio::process::Command::new(env!("CARGO_BIN_EXE_waybill-lab"))
        .args(["demo", "--rollout", "--database-name", &database])
        .args(["--stream", &stream, "--subject-prefix", &prefix])
        .args(["--nats-url", &nats.url()])
        .env("DATABASE_URL", &url)
        .kill_on_drop(true)
        .output();
    // A hang is what the bound catches; the story takes seconds.
    let output = tokio::time::timeout(Duration::from_secs(300), run)
        .await
        .expect("the rollout finishes on its own")
        .expect("waybill-lab runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);

    let pool = ops::database::connect(
        &ops::database::with_database(&url, &database),
        "waybill-test",
        2,
    )
    .await
    .expect("the rollout's database");
    let versions: Vec<(i32, i64)> = sqlx::query_as(
        "SELECT event_version, count(*) FROM events WHERE event_type = 'order.placed'
         GROUP BY event_version ORDER BY event_version",
    )
    .fetch_all(&pool)
    .await
    .expect("events");
    let mut redriven = Vec::new();
    for name in ["inventory", "points", "search"] {
        let counts: (i64, i64, i64) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT (SELECT count(*) FROM \"{name}\".parked),
                    (SELECT count(*) FROM \"{name}\".parked WHERE redriven_at IS NOT NULL),
                    (SELECT count(*) FROM \"{name}\".held)"
        )))
        .fetch_one(&pool)
        .await
        .expect("parked and held");
        redriven.push((name, counts));
    }
    let events: i64 = sqlx::query_scalar("SELECT count(*) FROM events")
        .fetch_one(&pool)
        .await
        .expect("count");
    pool.close().await;
    let js = async_nats::jetstream::new(async_nats::connect(nats.url()).await.expect("nats"));
    let info = js
        .get_stream(&stream)
        .await
        .expect("the stream it was given")
        .info()
        .await
        .expect("info")
        .clone();
    let admin = ops::database::connect(&ops::database::with_database(&url, "postgres"), "t", 1)
        .await
        .expect("admin");
    let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS \"{database}\" WITH (FORCE)"
    )))
    .execute(&admin)
    .await;

    assert!(
        output.status.success(),
        "the rollout failed:\n{stdout}\n{stderr}"
    );
    assert!(
        stdout.contains("all three projections agree with the event store"),
        "{stdout}"
    );
    assert_eq!(
        versions,
        [(2, 8), (3, 8)],
        "v2 from the old writer, v3 after"
    );
    for (name, (parked, done, held)) in redriven {
        assert_eq!(
            (parked, done, held),
            (8, 8, 0),
            "{name}: every v3 order parked by the old reader and redriven"
        );
    }
    assert_eq!(
        Ok(info.state.messages),
        u64::try_from(events),
        "every event in the stream it was named"
    );
    assert!(
        info.config.subjects.iter().any(|s| s.starts_with(&prefix)),
        "{:?}",
        info.config.subjects
    );
}
