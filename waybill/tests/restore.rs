//! After a restore: the database comes back from a backup that is behind its stream. Over the real
//! `waybill` binary: `outbox status` reports the divergence the relay found, `outbox verify` exits 1
//! and names the order (text and JSON), `outbox repair` prints its plan, `--apply` carries it out, and
//! the relay then makes the stream match the store.

use std::time::Duration;

use relay::{Backoff, Relay, RelayConfig, StreamSettings};
use sqlx::PgPool;
use store::EventStore;
use testkit::{NatsServer, Run};

const STREAM: &str = "RESTORE_EVENTS";
const PREFIX: &str = "restore.events";

async fn waybill(url: &str, nats: &str, args: &[&str]) -> Run {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_waybill"))
        .args(args)
        .env("DATABASE_URL", url)
        .env("NATS_URL", nats)
        .env("WAYBILL_STREAM", STREAM)
        .env("WAYBILL_SUBJECT_PREFIX", PREFIX)
        .env("RUST_LOG", "warn")
        .output()
        .await
        .expect("waybill runs");
    Run::from(output)
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn verify_and_repair_after_a_database_restored_behind_its_stream(pool: PgPool) {
    let nats = NatsServer::start().expect("nats-server");
    let url = testkit::database_url(&pool).await;
    let store = EventStore::new(pool.clone());
    let order = testkit::place_order(&store, "alice", &["MUG:1:100"]).await;
    testkit::pay_order(&store, order).await;
    testkit::ship_order(&store, order).await;
    let other = testkit::place_order(&store, "bob", &["TEA:1:100"]).await;
    let config = RelayConfig {
        relay_id: "relay-restore".into(),
        stream: StreamSettings {
            name: STREAM.into(),
            subject_prefix: PREFIX.into(),
            duplicate_window: Duration::from_secs(1),
        },
        backoff: Backoff::new(vec![Duration::from_millis(50)], 0.2),
        ..RelayConfig::default()
    };
    let relay = Relay::connect(&url, &nats.url(), config)
        .await
        .expect("relay");
    relay.provision(false).await.expect("stream");
    relay.drain().await.expect("drain");

    let agree = waybill(&url, &nats.url(), &["outbox", "verify"]).await.ok();
    assert!(agree.stdout.contains("agree"), "{}", agree.stdout);

    testkit::restore_behind(&pool, order.as_uuid(), 1).await;
    let new_v2 = testkit::cancel_order(&store, order).await;
    relay.drain().await.expect("drain");

    let status = waybill(&url, &nats.url(), &["outbox", "status", "--json"])
        .await
        .ok()
        .json();
    assert_eq!(status["diverged"], 1, "{status}");
    assert_eq!(status["divergences"][0]["event_id"], new_v2.to_string());
    assert_eq!(
        status["divergences"][0]["divergence"]["kind"],
        "other_event"
    );

    let text = waybill(&url, &nats.url(), &["outbox", "verify"]).await;
    assert_eq!(text.code, 1, "{}{}", text.stdout, text.stderr);
    assert!(text.stdout.contains(&order.to_string()), "{}", text.stdout);
    assert!(!text.stdout.contains(&other.to_string()), "{}", text.stdout);
    let json = waybill(&url, &nats.url(), &["outbox", "verify", "--json"]).await;
    assert_eq!(json.code, 1, "{}", json.stderr);
    let report = json.json();
    assert_eq!(report["ok"], false);
    assert_eq!(report["differing"][0]["aggregate_id"], order.to_string());
    assert_eq!(report["differing"][0]["differences"][0]["kind"], "diverged");

    let plan = waybill(
        &url,
        &nats.url(),
        &["outbox", "repair", "--aggregate", &order.to_string()],
    )
    .await
    .ok();
    assert!(plan.stdout.contains("would delete"), "{}", plan.stdout);
    let done = waybill(
        &url,
        &nats.url(),
        &[
            "outbox",
            "repair",
            "--aggregate",
            &order.to_string(),
            "--apply",
            "--json",
        ],
    )
    .await
    .ok()
    .json();
    assert_eq!(done["applied"], true, "{done}");
    assert_eq!(done["republish"], serde_json::json!([2]));

    relay.drain().await.expect("drain");
    let agree = waybill(&url, &nats.url(), &["outbox", "verify", "--json"])
        .await
        .ok()
        .json();
    assert_eq!(agree["ok"], true, "{agree}");

    let unknown = waybill(
        &url,
        &nats.url(),
        &[
            "outbox",
            "repair",
            "--aggregate",
            &uuid::Uuid::now_v7().to_string(),
        ],
    )
    .await;
    assert_eq!(
        unknown.code, 2,
        "an unknown aggregate is refused: {}",
        unknown.stderr
    );
}
