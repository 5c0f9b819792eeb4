//! A two-phase rollout of `order.placed` v3 over the real binaries: `waybill serve --write-version
//! order.placed=2` stores v2 (and refuses what v2 cannot carry), plain `waybill serve` stores v3; a
//! projection rehearsing an old reader (`--max-version order.placed=2`) parks the v3 order and applies
//! the v2 one, and `redrive` without the flag applies it, leaving the inventory equal to a fold of the
//! event store. An order holding an event newer than the service answers 503 upgrade-required.

mod common;

use std::collections::BTreeMap;

use common::Service;
use serde_json::{Value, json};
use sqlx::PgPool;
use uuid::Uuid;

const STREAM: &str = "ROLLOUT_EVENTS";
const PREFIX: &str = "rollout.events";

async fn place(service: &Service, customer: &str, channel: &str, sku: &str) -> (u16, Value) {
    let response = service
        .client
        .post(format!("{}/orders", service.base))
        .json(&json!({
            "customer_id": customer,
            "currency": "EUR",
            "lines": [{"sku": sku, "quantity": 2, "unit_price_cents": 300}],
            "channel": channel,
        }))
        .send()
        .await
        .expect("answers");
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

async fn stored_version(pool: &PgPool, order: &str) -> i32 {
    sqlx::query_scalar(
        "SELECT event_version FROM events WHERE aggregate_id = $1::uuid AND event_type = 'order.placed'",
    )
    .bind(order)
    .fetch_one(pool)
    .await
    .expect("the placed event")
}

/// Units reserved per SKU by placed orders, from the event store's payloads (every stored version
/// carries its lines the same way): the inventory must say the same.
async fn reserved_by_fold(pool: &PgPool) -> BTreeMap<String, i64> {
    let payloads: Vec<Value> =
        sqlx::query_scalar("SELECT payload FROM events WHERE event_type = 'order.placed'")
            .fetch_all(pool)
            .await
            .expect("events");
    let mut reserved = BTreeMap::new();
    for payload in payloads {
        for line in payload["lines"].as_array().into_iter().flatten() {
            let sku = line["sku"].as_str().expect("sku").to_owned();
            *reserved.entry(sku).or_default() += line["quantity"].as_i64().expect("quantity");
        }
    }
    reserved
}

async fn reserved_by_inventory(pool: &PgPool) -> BTreeMap<String, i64> {
    sqlx::query_as::<_, (String, i64)>("SELECT sku, reserved FROM inventory.stock ORDER BY sku")
        .fetch_all(pool)
        .await
        .expect("stock")
        .into_iter()
        .collect()
}

async fn inventory(url: &str, nats: &str, args: &[&str]) -> std::process::Output {
    tokio::process::Command::new(common::workspace_binary("waybill-inventory"))
        .args(["--database-url", url, "--nats-url", nats])
        .args(["--stream", STREAM, "--subject-prefix", PREFIX])
        .args(args)
        .env("RUST_LOG", "warn")
        .env_remove("WAYBILL_MAX_VERSIONS")
        .output()
        .await
        .expect("waybill-inventory runs")
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn readers_first_then_writers(pool: PgPool) {
    let nats = testkit::NatsServer::start().expect("nats-server");
    let url = testkit::database_url(&pool).await;

    // Expand: writers still write v2.
    let old_writer = Service::start_with(&pool, &["--write-version", "order.placed=2"]).await;
    let (status, v2_order) = place(&old_writer, "vera", "web", "CUP").await;
    assert_eq!(status, 201, "{v2_order}");
    let v2_id = v2_order["order_id"].as_str().expect("id").to_owned();
    assert_eq!(stored_version(&pool, &v2_id).await, 2);
    let (status, refused) = place(&old_writer, "vera", "store", "CUP").await;
    assert_eq!(status, 422, "v2 cannot carry a store order: {refused}");
    assert!(
        refused["detail"]
            .as_str()
            .is_some_and(|d| d.contains("v2") && d.contains("store")),
        "{refused}"
    );
    drop(old_writer);

    // Then writers switch to v3.
    let new_writer = Service::start_with(&pool, &[]).await;
    let (status, v3_order) = place(&new_writer, "walt", "store", "BOWL").await;
    assert_eq!(status, 201, "{v3_order}");
    let v3_id = v3_order["order_id"].as_str().expect("id").to_owned();
    // Plain serve writes the current version (v3 when this was written; a v4 keeps this test true).
    let current = domain::event::current_version("order.placed").expect("a known type");
    assert_eq!(stored_version(&pool, &v3_id).await, current);
    assert_eq!(v3_order["channel"], "store");
    let read_back: Value = new_writer
        .client
        .get(format!("{}/orders/{v2_id}", new_writer.base))
        .send()
        .await
        .expect("answers")
        .json()
        .await
        .expect("json");
    assert_eq!(read_back["channel"], "web", "a v2 order reads as web");

    testkit::relay_everything(&url, &nats.url(), STREAM, PREFIX).await;

    // A reader rehearsing the old binary parks the v3 order and applies the v2 one.
    let old_reader = inventory(
        &url,
        &nats.url(),
        &["run", "--once", "--max-version", "order.placed=2"],
    )
    .await;
    assert!(
        old_reader.status.success(),
        "{}",
        String::from_utf8_lossy(&old_reader.stderr)
    );
    let parked: Vec<(Option<Uuid>, String)> =
        sqlx::query_as("SELECT aggregate_id, reason FROM inventory.parked")
            .fetch_all(&pool)
            .await
            .expect("parked");
    assert_eq!(parked.len(), 1, "{parked:?}");
    assert_eq!(parked[0].0.map(|id| id.to_string()), Some(v3_id.clone()));
    assert!(
        parked[0]
            .1
            .contains(&format!("order.placed v{current} is newer")),
        "parked as an old binary would: {parked:?}"
    );
    assert_eq!(
        reserved_by_inventory(&pool).await,
        BTreeMap::from([("CUP".to_owned(), 2)])
    );

    // Readers upgraded: redrive applies it.
    let redrive = inventory(&url, &nats.url(), &["--json", "redrive"]).await;
    assert!(
        redrive.status.success(),
        "{}",
        String::from_utf8_lossy(&redrive.stderr)
    );
    let report: Value = serde_json::from_slice(&redrive.stdout).expect("json");
    assert_eq!(report["redriven"][0]["outcome"], "applied", "{report}");
    assert_eq!(
        reserved_by_inventory(&pool).await,
        reserved_by_fold(&pool).await
    );
    assert_eq!(reserved_by_fold(&pool).await.len(), 2);

    // A version this service does not know yet: 503, upgrade.
    let future = Uuid::now_v7();
    let mut envelope = testkit::legacy_placed(future);
    envelope.event_version = 9;
    envelope.payload = json!({"from": "the future"});
    store::append(
        &pool,
        future,
        0,
        &[envelope],
        &store::AppendOptions::default(),
    )
    .await
    .expect("a row from a newer writer");
    for request in [
        new_writer
            .client
            .get(format!("{}/orders/{future}", new_writer.base)),
        new_writer
            .client
            .post(format!("{}/orders/{future}/cancel", new_writer.base))
            .json(&json!({"reason": "x"})),
    ] {
        let response = request.send().await.expect("answers");
        assert_eq!(response.status().as_u16(), 503);
        let problem: Value = response.json().await.expect("json");
        assert_eq!(problem["type"], "urn:waybill:problem:upgrade-required");
        assert!(
            problem["detail"]
                .as_str()
                .is_some_and(|d| d.contains("v9") && d.contains("upgrade")),
            "{problem}"
        );
    }
}

/// The command line writes the same way: `place --write-version order.placed=2` stores v2 and
/// refuses a channel v2 cannot carry with exit code 2; `--max-version` refuses nonsense up front.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn the_command_line_writes_older_versions_on_request(pool: PgPool) {
    let url = testkit::database_url(&pool).await;
    let place = |extra: &[&str]| {
        let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_waybill"));
        command
            .args(["--json", "--database-url", &url, "place", "--customer", "x"])
            .args(["--currency", "EUR", "--line", "MUG:1:100"])
            .args(extra)
            .env_remove("WAYBILL_WRITE_VERSIONS");
        command.output()
    };
    let written = place(&["--write-version", "order.placed=2"])
        .await
        .expect("runs");
    assert!(
        written.status.success(),
        "{}",
        String::from_utf8_lossy(&written.stderr)
    );
    let order: Value = serde_json::from_slice(&written.stdout).expect("json");
    let id = order["order_id"].as_str().expect("id");
    assert_eq!(stored_version(&pool, id).await, 2);

    let refused = place(&["--write-version", "order.placed=2", "--channel", "phone"])
        .await
        .expect("runs");
    assert_eq!(refused.status.code(), Some(2));
    // With --json the refusal is printed as JSON on standard output.
    let printed: Value = serde_json::from_slice(&refused.stdout).expect("json");
    let message = printed["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("phone") && message.contains("v2"),
        "{printed}"
    );

    let current = domain::event::current_version("order.placed").expect("a known type");
    let too_new = format!("order.placed={}", current + 1);
    for bad in ["order.placed=1", too_new.as_str(), "order.unknown=1"] {
        let refused = place(&["--write-version", bad]).await.expect("runs");
        assert_eq!(refused.status.code(), Some(2), "{bad}");
    }
    let events: i64 = sqlx::query_scalar("SELECT count(*) FROM events")
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(events, 1, "nothing refused was written");
}
