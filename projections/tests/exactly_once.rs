//! The projections against a real PostgreSQL and a real nats-server: exactly once in effect, in
//! per-aggregate order, poison parked, legacy events upcast, crash between commit and ack, rebuild.

mod common;

use std::time::Duration;

use common::*;
use domain::OrderEvent;
use projections::{
    Inventory, Points, Projection, RunnerConfig, Search, Verdict, inventory, search,
};
use relay::StreamSettings;
use serde_json::{Value, json};
use sqlx::PgPool;
use uuid::Uuid;

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn the_projections_follow_the_order_lifecycle(pool: PgPool) {
    let h = Harness::new(&pool).await;
    let (a, b, c) = (new_order(), new_order(), new_order());
    for (order, events) in [
        (
            a,
            vec![placed("alice", &["MUG:2:1250"]), paid(2500), shipped()],
        ),
        (
            b,
            vec![
                placed("alice", &["MUG:1:1250", "TEA:3:500"]),
                paid(2750),
                cancelled(),
            ],
        ),
        (c, vec![placed("bob", &["TEA:1:500"])]),
    ] {
        for (i, event) in events.iter().enumerate() {
            h.publish(&envelope(
                order,
                i64::try_from(i).expect("a small count") + 1,
                event,
            ))
            .await;
        }
    }
    for tally in [
        h.consume(Inventory).await,
        h.consume(Points).await,
        h.consume(Search).await,
    ] {
        assert_eq!(
            (tally.applied, tally.duplicates, tally.held, tally.parked),
            (7, 0, 0, 0),
            "{tally:?}"
        );
    }
    assert_eq!(
        stock_of(&pool, "MUG").await,
        Some((0, 2, 1)),
        "2 shipped, 1 released"
    );
    assert_eq!(
        stock_of(&pool, "TEA").await,
        Some((1, 0, 3)),
        "bob's tea reserved, alice's released"
    );
    assert_eq!(
        balance_of(&pool, "alice").await,
        Some(25),
        "25 earned, 27 earned and taken back"
    );
    let search_pool = projections::schema::connect(&h.url, Search::NAME, Search::TABLES)
        .await
        .expect("pool");
    let found = search::query(&search_pool, "alice cancelled", 10, 0)
        .await
        .expect("query");
    assert_eq!(
        found.iter().map(|d| d.order_id).collect::<Vec<_>>(),
        vec![b.as_uuid()]
    );
    assert_eq!(found[0].skus, vec!["MUG", "TEA"]);
    let tea = search::query(&search_pool, "tea", 10, 0)
        .await
        .expect("query");
    assert_eq!(tea.len(), 2);
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn the_same_event_delivered_twice_changes_the_projection_once(pool: PgPool) {
    // JetStream forgets a message id after its dedupe window: a copy published later is stored again.
    let h = Harness::with_duplicate_window(&pool, Duration::from_millis(300)).await;
    let order = new_order();
    let first = envelope(order, 1, &placed("alice", &["MUG:2:1250"]));
    let second = envelope(order, 2, &paid(2500));
    for _copy in 0..3 {
        for event in [&first, &second] {
            h.publish(event).await;
        }
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
    for tally in [h.consume(Inventory).await, h.consume(Points).await] {
        assert_eq!((tally.applied, tally.duplicates), (2, 4), "{tally:?}");
    }
    assert_eq!(stock_of(&pool, "MUG").await, Some((2, 0, 0)));
    assert_eq!(balance_of(&pool, "alice").await, Some(25));
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn version_2_before_version_1_ends_with_both_applied_in_order(pool: PgPool) {
    let h = Harness::new(&pool).await;
    let order = new_order();
    h.publish(&envelope(order, 2, &paid(2500))).await;
    h.publish(&envelope(order, 1, &placed("alice", &["MUG:2:1250"])))
        .await;
    // One message per batch, so version 2 really arrives alone, first.
    let config = RunnerConfig {
        batch_size: 1,
        ..h.config()
    };
    let tally = h
        .runner(Points, config)
        .await
        .run(std::future::pending(), true, |_| {})
        .await
        .expect("run");
    assert_eq!(
        tally.held, 1,
        "version 2 waited in the held table: {tally:?}"
    );
    assert_eq!(
        tally.applied, 1,
        "version 1 was delivered, version 2 applied behind it: {tally:?}"
    );
    assert_eq!(
        balance_of(&pool, "alice").await,
        Some(25),
        "the payment counted once its order was known"
    );
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_crash_between_commit_and_ack_changes_nothing_on_redelivery(pool: PgPool) {
    let h = Harness::new(&pool).await;
    let order = new_order();
    for (i, event) in [placed("alice", &["MUG:2:1250"]), paid(2500), shipped()]
        .iter()
        .enumerate()
    {
        h.publish(&envelope(
            order,
            i64::try_from(i).expect("a small count") + 1,
            event,
        ))
        .await;
    }
    // The crash needs the faulty twin (`waybill-projection-faulty inventory`); the restart is the
    // projection as installed.
    let inventory_binary = |extra: &[&str]| {
        let faulty = !extra.is_empty();
        let mut command = tokio::process::Command::new(if faulty { FAULTY } else { INVENTORY });
        if faulty {
            command.arg("inventory");
        }
        command
            .args([
                "--database-url",
                &h.url,
                "--nats-url",
                &h.nats.url(),
                "--stream",
                STREAM,
                "--subject-prefix",
                PREFIX,
            ])
            .args(["--ack-wait", "1s", "--json", "run", "--once"])
            .args(extra)
            .env("RUST_LOG", "warn");
        command
    };
    let crashed = inventory_binary(&["--crash-after-commit"])
        .output()
        .await
        .expect("runs");
    assert!(
        !crashed.status.success(),
        "the fail point aborts after the commit"
    );
    // The first batch committed, whatever had arrived when it was collected (batches take what is
    // there, no timer): `placed` alone, or more.
    let committed: i64 =
        sqlx::query_scalar("SELECT version FROM inventory.checkpoints WHERE aggregate_id = $1")
            .bind(order.as_uuid())
            .fetch_one(&pool)
            .await
            .expect("the first batch was committed before the crash");
    let expected = if committed == 3 { (0, 2, 0) } else { (2, 0, 0) };
    assert_eq!(
        stock_of(&pool, "MUG").await,
        Some(expected),
        "batch of {committed}"
    );

    // The broker never got the acks: after the ack wait it redelivers everything.
    let restarted = inventory_binary(&[]).output().await.expect("runs");
    assert!(
        restarted.status.success(),
        "{}",
        String::from_utf8_lossy(&restarted.stderr)
    );
    let out: Value = serde_json::from_slice(&restarted.stdout).expect("json");
    // The committed events come back as duplicates; the rest are applied, once.
    assert_eq!(out["tally"]["applied"], 3 - committed, "{out}");
    assert_eq!(out["tally"]["duplicates"], committed, "{out}");
    assert_eq!(
        stock_of(&pool, "MUG").await,
        Some((0, 2, 0)),
        "redelivery changed nothing"
    );
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn poison_is_parked_and_the_events_around_it_are_applied(pool: PgPool) {
    let h = Harness::new(&pool).await;
    let good = new_order();
    h.publish(&envelope(good, 1, &placed("alice", &["MUG:1:1250"])))
        .await;
    h.publish_raw(
        &format!("{PREFIX}.order.{}", Uuid::now_v7()),
        b"\x00\x01 not json at all".to_vec(),
        "garbage",
    )
    .await;
    // Published by a newer relay: the headers agree with the bodies this code cannot read.
    let mut unknown = envelope(new_order(), 1, &placed("bob", &["TEA:1:1"]));
    unknown.event_type = "order.teleported".into();
    h.publish(&unknown).await;
    let mut future = envelope(new_order(), 1, &placed("carol", &["TEA:1:1"]));
    future.event_version = 7;
    h.publish(&future).await;
    h.publish(&envelope(good, 2, &paid(1250))).await;

    let runner = h.runner(Inventory, h.config()).await;
    let tally = runner
        .run(std::future::pending(), true, |_| {})
        .await
        .expect("run");
    assert_eq!((tally.applied, tally.parked), (2, 3), "{tally:?}");
    assert_eq!(stock_of(&pool, "MUG").await, Some((1, 0, 0)));
    assert_eq!(
        stock_of(&pool, "TEA").await,
        None,
        "nothing of the poison was applied"
    );
    assert_eq!(
        runner.lag().await.expect("lag"),
        (0, 0),
        "poison was terminated, not left to redeliver"
    );

    let parked: Vec<(String, Vec<u8>, Value)> = sqlx::query_as(
        "SELECT reason, body, convert_from(headers, 'UTF8')::json FROM inventory.parked ORDER BY stream_sequence",
    )
    .fetch_all(&pool)
    .await
    .expect("parked");
    assert_eq!(parked.len(), 3);
    assert!(parked[0].0.contains("undecodable body"), "{}", parked[0].0);
    assert_eq!(parked[0].1, b"\x00\x01 not json at all", "raw bytes kept");
    assert_eq!(parked[0].2["Nats-Msg-Id"], "garbage", "headers kept");
    assert!(
        parked[1].0.contains("unknown event type"),
        "{}",
        parked[1].0
    );
    assert!(
        parked[2].0.contains("newer than this code knows"),
        "{}",
        parked[2].0
    );

    // Redrive cannot help yet: this code still does not know them, and says so for each.
    let report = runner.redrive(&REDRIVE).await.expect("redrive");
    assert_eq!(report.len(), 3);
    assert!(
        report.iter().all(|r| r.outcome == Verdict::Parked),
        "{report:?}"
    );
    assert!(
        report[1]
            .reason
            .as_deref()
            .unwrap_or_default()
            .contains("unknown event type"),
        "{report:?}"
    );
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn redrive_applies_a_parked_message_the_code_now_understands(pool: PgPool) {
    let h = Harness::new(&pool).await;
    let order = new_order();
    let runner = h.runner(Points, h.config()).await;
    h.publish(&envelope(order, 1, &placed("alice", &["MUG:1:1250"])))
        .await;
    runner
        .run(std::future::pending(), true, |_| {})
        .await
        .expect("run");
    // As if an older build had parked this payment (say, before it knew order.paid).
    let payment = envelope(order, 2, &paid(1250));
    let headers = serde_json::to_vec(
        &projections::RawMessage {
            stream_sequence: 2,
            subject: subject(&payment),
            headers: Some(projections::decode::relay_headers(&payment)),
            body: payment.to_json().into(),
        }
        .headers_json(),
    )
    .expect("json");
    sqlx::query(
        "INSERT INTO points.parked (subject, headers, body, body_size, body_sha256, reason)
         VALUES ($1, $2, $3, octet_length($3), sha256($3), 'unknown event type')",
    )
    .bind(subject(&payment))
    .bind(headers)
    .bind(payment.to_json())
    .execute(&pool)
    .await
    .expect("parked row");
    let report = runner.redrive(&REDRIVE).await.expect("redrive");
    assert_eq!(report.len(), 1);
    assert_eq!(report[0].outcome, Verdict::Applied, "{report:?}");
    assert_eq!(balance_of(&pool, "alice").await, Some(12));
    assert!(
        runner.redrive(&REDRIVE).await.expect("again").is_empty(),
        "nothing left to redrive"
    );
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_legacy_order_placed_v1_is_upcast_by_all_three(pool: PgPool) {
    let h = Harness::new(&pool).await;
    let order = new_order();
    let mut legacy = envelope(order, 1, &placed("x", &["MUG:1:1"]));
    legacy.event_version = 1;
    legacy.payload = json!({"order_no": "A-1001", "amount_cents": 4200});
    h.publish(&legacy).await;
    h.publish(&envelope(order, 2, &paid(4200))).await;
    for tally in [
        h.consume(Inventory).await,
        h.consume(Points).await,
        h.consume(Search).await,
    ] {
        assert_eq!((tally.applied, tally.parked), (2, 0), "{tally:?}");
    }
    let inventory_pool = projections::schema::connect(&h.url, Inventory::NAME, Inventory::TABLES)
        .await
        .expect("pool");
    assert!(
        inventory::stock(&inventory_pool, None)
            .await
            .expect("stock")
            .is_empty(),
        "a v1 order has no lines to reserve"
    );
    assert_eq!(
        balance_of(&pool, domain::upcast::LEGACY_CUSTOMER).await,
        Some(42)
    );
    let search_pool = projections::schema::connect(&h.url, Search::NAME, Search::TABLES)
        .await
        .expect("pool");
    let found = search::query(&search_pool, "legacy paid", 10, 0)
        .await
        .expect("query");
    assert_eq!(found.len(), 1);
    assert_eq!(
        (found[0].total_cents, found[0].currency.as_str()),
        (4200, "XXX")
    );
}

/// Everything a projection holds, to compare states.
async fn snapshot(pool: &PgPool, schema: &str) -> Value {
    let sql = match schema {
        "inventory" => "SELECT json_build_object('stock', (SELECT json_agg(s ORDER BY sku) FROM (SELECT sku, reserved, shipped, released FROM inventory.stock) s),
                                                 'checkpoints', (SELECT json_agg(c ORDER BY aggregate_id) FROM (SELECT aggregate_id, version FROM inventory.checkpoints) c))",
        "points" => "SELECT json_build_object('balances', (SELECT json_agg(b ORDER BY customer_id) FROM (SELECT customer_id, balance FROM points.balances) b),
                                              'ledger', (SELECT json_agg(l ORDER BY event_id) FROM points.ledger l))",
        _ => "SELECT json_build_object('orders', (SELECT json_agg(o ORDER BY order_id) FROM (SELECT order_id, customer_id, skus, status, total_cents FROM search.orders) o))",
    };
    sqlx::query_scalar(sql)
        .fetch_one(pool)
        .await
        .expect("snapshot")
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn rebuild_reproduces_the_state_of_incremental_consumption(pool: PgPool) {
    let h = Harness::new(&pool).await;
    // Real orders through the command side and the relay.
    let store = store::EventStore::new(pool.clone());
    for i in 0..30 {
        let order = testkit::place_order(
            &store,
            &format!("customer-{}", i % 4),
            &[&format!("SKU-{}:{}:{}", i % 5, 1 + i % 3, 100 + i)],
        )
        .await;
        if i % 3 != 0 {
            testkit::pay_order(&store, order).await;
        }
        let follow_up = match i % 6 {
            1 => Some(shipped()),
            2 | 3 => Some(cancelled()),
            _ => None,
        };
        if let Some(event) = follow_up {
            let command = match event {
                OrderEvent::Shipped(s) => domain::OrderCommand::Ship(domain::ShipOrder {
                    carrier: s.carrier,
                    tracking_number: s.tracking_number,
                }),
                _ => domain::OrderCommand::Cancel(domain::CancelOrder {
                    reason: domain::Note::parse("test").expect("note"),
                }),
            };
            let _ = store
                .execute(order, &command, &store::CommandContext::default())
                .await;
        }
    }
    let relay_config = relay::RelayConfig {
        stream: StreamSettings {
            name: STREAM.into(),
            subject_prefix: PREFIX.into(),
            ..Default::default()
        },
        ..relay::RelayConfig::default()
    };
    let relay = relay::Relay::connect(&h.url, &h.nats.url(), relay_config)
        .await
        .expect("relay");
    relay.drain().await.expect("drain");

    h.consume(Inventory).await;
    h.consume(Points).await;
    h.consume(Search).await;
    let before = [
        snapshot(&pool, "inventory").await,
        snapshot(&pool, "points").await,
        snapshot(&pool, "search").await,
    ];

    let rebuilt = [
        h.runner(Inventory, h.config())
            .await
            .rebuild(|_| {})
            .await
            .expect("rebuild"),
        h.runner(Points, h.config())
            .await
            .rebuild(|_| {})
            .await
            .expect("rebuild"),
        h.runner(Search, h.config())
            .await
            .rebuild(|_| {})
            .await
            .expect("rebuild"),
    ];
    for tally in &rebuilt {
        assert!(tally.applied > 60, "replayed from the start: {tally:?}");
    }
    let after = [
        snapshot(&pool, "inventory").await,
        snapshot(&pool, "points").await,
        snapshot(&pool, "search").await,
    ];
    assert_eq!(before, after);
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn run_once_ends_even_when_a_gap_never_closes(pool: PgPool) {
    let h = Harness::new(&pool).await;
    // Version 2 of an order whose version 1 never reaches the stream.
    h.publish(&envelope(new_order(), 2, &paid(2500))).await;
    let good = new_order();
    h.publish(&envelope(good, 1, &placed("bob", &["TEA:1:500"])))
        .await;
    let runner = h.runner(Inventory, h.config()).await;
    let run = runner.run(std::future::pending(), true, |_| {});
    let tally = tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("--once must end")
        .expect("run");
    assert_eq!((tally.applied, tally.held), (1, 1), "{tally:?}");
    assert_eq!(stock_of(&pool, "TEA").await, Some((1, 0, 0)));
}

/// A test's redrive: every open message, recorded as the test's.
const REDRIVE: projections::RedriveRequest<'static> = projections::RedriveRequest {
    actor: "test",
    reason: "test",
    limit: None,
};

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_batch_waits_for_an_operators_turn(pool: PgPool) {
    let h = Harness::new(&pool).await;
    let runner = h.runner(Inventory, h.config()).await;
    // An operator's action (redrive, release, a rebuild's swap) holds the projection's whole turn.
    let mut operator = runner.pool().begin().await.expect("begin");
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('waybill.projection.inventory'))")
        .execute(&mut *operator)
        .await
        .expect("the operator's turn");
    let batch = async {
        let verdicts = runner.apply_batch(&[]).await;
        (verdicts, std::time::Instant::now())
    };
    let operator_done = async {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let released = std::time::Instant::now();
        operator.commit().await.expect("commit");
        released
    };
    let ((verdicts, finished), released) = tokio::time::timeout(Duration::from_secs(10), async {
        tokio::join!(batch, operator_done)
    })
    .await
    .expect("the batch runs once the turn is free");
    assert!(
        finished >= released,
        "a batch must not run while an operator holds the turn"
    );
    let verdicts = verdicts.expect("an empty batch applies");
    assert!(verdicts.is_empty());
}
