//! Projections partitioned by order across instances, against a real PostgreSQL and nats-server:
//! instances owning different partitions apply every event exactly once and in order, with the same
//! result as one instance; an order's events all go to one partition; partitions updating the same
//! SKU and customer at once neither deadlock nor lose updates; inconsistent flags are refused.

mod common;

use std::collections::BTreeMap;

use common::*;
use domain::{OrderEvent, OrderId};
use projections::{Inventory, Partitions, Points, Projection, RunnerConfig, Search, Tally};
use sqlx::PgPool;
use uuid::Uuid;

/// An order of the workload: its events, and what it leaves behind.
struct Order {
    id: OrderId,
    events: Vec<OrderEvent>,
}

/// `count` orders over the same few SKUs and customers (lines in varying order), each placed and
/// paid, then shipped, cancelled or left open by turns.
fn workload(count: usize) -> Vec<Order> {
    let lines: [&[&str]; 4] = [
        &["MUG:2:1250", "TEA:1:500"],
        &["TEA:3:500", "MUG:1:1250"],
        &["CUP:1:700", "MUG:1:1250", "TEA:2:500"],
        &["TEA:1:500", "CUP:2:700"],
    ];
    (0..count)
        .map(|i| {
            let lines = lines[i % lines.len()];
            let customer = ["alice", "bob"][i % 2];
            let place = placed(customer, lines);
            let OrderEvent::Placed(placed_event) = &place else {
                unreachable!()
            };
            let total = placed_event.total_cents;
            let mut events = vec![place, paid(total)];
            match i % 3 {
                0 => events.push(shipped()),
                1 => events.push(cancelled()),
                _ => {}
            }
            Order {
                id: new_order(),
                events,
            }
        })
        .collect()
}

/// Per SKU: (reserved, shipped, released).
type Stock = BTreeMap<String, (i64, i64, i64)>;

/// Per SKU (reserved, shipped, released) and per customer the balance, folded from the workload
/// independently of the projections' code.
fn expected(orders: &[Order]) -> (Stock, BTreeMap<String, i64>) {
    let mut stock = Stock::new();
    let mut balances: BTreeMap<String, i64> = BTreeMap::new();
    for order in orders {
        let OrderEvent::Placed(placed) = &order.events[0] else {
            unreachable!()
        };
        let customer = placed.customer_id.to_string();
        let points = placed.total_cents / projections::points::CENTS_PER_POINT;
        *balances.entry(customer.clone()).or_default() += points;
        for line in &placed.lines {
            let entry = stock.entry(line.sku.to_string()).or_default();
            let quantity = i64::from(line.quantity.get());
            match order.events.get(2) {
                Some(OrderEvent::Shipped(_)) => entry.1 += quantity,
                Some(OrderEvent::Cancelled(_)) => entry.2 += quantity,
                _ => entry.0 += quantity,
            }
        }
        if let Some(OrderEvent::Cancelled(_)) = order.events.get(2) {
            *balances.entry(customer).or_default() -= points;
        }
    }
    (stock, balances)
}

/// Publishes every order's events interleaved: all first versions, then all second ones, and so on.
async fn publish(h: &Harness, orders: &[Order]) -> usize {
    let mut published = 0;
    for version in 0..3 {
        for order in orders {
            if let Some(event) = order.events.get(version) {
                h.publish(&envelope(
                    order.id,
                    i64::try_from(version).expect("a small count") + 1,
                    event,
                ))
                .await;
                published += 1;
            }
        }
    }
    published
}

fn partitioned(h: &Harness, count: u32, owned: &[u32], batch_size: usize) -> RunnerConfig {
    RunnerConfig {
        partitions: Partitions::new(count, owned).expect("layout"),
        batch_size,
        ..h.config()
    }
}

/// Runs one instance per partition of `P` side by side, each until it has caught up.
async fn run_partitions<P: Projection + Copy>(
    h: &Harness,
    projection: P,
    count: u32,
    batch_size: usize,
) -> Vec<Tally> {
    let mut runners = Vec::new();
    for partition in 0..count {
        runners.push(
            h.runner(projection, partitioned(h, count, &[partition], batch_size))
                .await,
        );
    }
    let runs = runners
        .iter()
        .map(|runner| runner.run(std::future::pending(), true, |_| {}));
    futures::future::join_all(runs)
        .await
        .into_iter()
        .map(|tally| tally.expect("run"))
        .collect()
}

async fn checkpoints(pool: &PgPool, schema: &str) -> BTreeMap<Uuid, i64> {
    let rows: Vec<(Uuid, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT aggregate_id, version FROM {schema}.checkpoints"
    )))
    .fetch_all(pool)
    .await
    .expect("checkpoints");
    rows.into_iter().collect()
}

async fn stock(pool: &PgPool) -> Stock {
    let rows: Vec<(String, i64, i64, i64)> =
        sqlx::query_as("SELECT sku, reserved, shipped, released FROM inventory.stock")
            .fetch_all(pool)
            .await
            .expect("stock");
    rows.into_iter()
        .map(|(sku, r, s, x)| (sku, (r, s, x)))
        .collect()
}

async fn balances(pool: &PgPool) -> BTreeMap<String, i64> {
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT customer_id, balance FROM points.balances")
            .fetch_all(pool)
            .await
            .expect("balances");
    rows.into_iter()
        .filter(|(_, balance)| *balance != 0)
        .collect()
}

async fn count(pool: &PgPool, table: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {table}")))
        .fetch_one(pool)
        .await
        .expect("count")
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn two_instances_with_different_partitions_apply_everything_once_in_order(pool: PgPool) {
    let h = Harness::new(&pool).await;
    let orders = workload(120);
    let published = publish(&h, &orders).await as u64;
    let (want_stock, want_balances) = expected(&orders);

    for tallies in [
        run_partitions(&h, Inventory, 2, 16).await,
        run_partitions(&h, Points, 2, 16).await,
        run_partitions(&h, Search, 2, 16).await,
    ] {
        let applied: u64 = tallies.iter().map(|t| t.applied).sum();
        assert_eq!(applied, published, "each event applied once: {tallies:?}");
        for tally in &tallies {
            assert_eq!(
                (tally.duplicates, tally.held, tally.parked),
                (0, 0, 0),
                "{tally:?}"
            );
            assert_eq!(
                tally.messages + tally.skipped,
                published,
                "each partition's consumer reads the whole stream: {tally:?}"
            );
            assert!(tally.applied > 0, "both partitions have work: {tallies:?}");
        }
    }
    assert_eq!(stock(&pool).await, want_stock, "as one instance folds it");
    assert_eq!(balances(&pool).await, want_balances);
    let last_versions: BTreeMap<Uuid, i64> = orders
        .iter()
        .map(|o| {
            (
                o.id.as_uuid(),
                i64::try_from(o.events.len()).expect("a small count"),
            )
        })
        .collect();
    for schema in [Inventory::NAME, Points::NAME, Search::NAME] {
        assert_eq!(
            checkpoints(&pool, schema).await,
            last_versions,
            "{schema}: every order through its last version, none skipped"
        );
        assert_eq!(count(&pool, &format!("{schema}.held")).await, 0);
        assert_eq!(count(&pool, &format!("{schema}.parked")).await, 0);
    }

    // One instance owning both partitions, from scratch, ends in the same state.
    let single = h.runner(Inventory, h.config()).await;
    single.reset().await.expect("reset");
    let tally = single
        .run(std::future::pending(), true, |_| {})
        .await
        .expect("run");
    assert_eq!(tally.applied, published);
    assert_eq!(stock(&pool).await, want_stock, "one instance, same result");

    // And again through the partition consumers, which stand at the end: nothing to apply.
    let again = run_partitions(&h, Inventory, 2, 16).await;
    assert!(
        again.iter().all(|t| t.messages + t.skipped == 0),
        "{again:?}"
    );
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn split_by_the_server_each_event_is_delivered_once_in_all(pool: PgPool) {
    let h = Harness::split(&pool, 2).await;
    let orders = workload(120);
    let published = publish(&h, &orders).await as u64;
    let (want_stock, want_balances) = expected(&orders);

    for tallies in [
        run_partitions(&h, Inventory, 2, 16).await,
        run_partitions(&h, Points, 2, 16).await,
    ] {
        let messages: u64 = tallies.iter().map(|t| t.messages).sum();
        let applied: u64 = tallies.iter().map(|t| t.applied).sum();
        assert_eq!(
            (messages, applied),
            (published, published),
            "each event delivered once in all and applied once: {tallies:?}"
        );
        for tally in &tallies {
            assert_eq!(tally.skipped, 0, "nothing of another partition: {tally:?}");
            assert!(tally.applied > 0, "both partitions have work: {tallies:?}");
        }
    }
    assert_eq!(stock(&pool).await, want_stock, "as one instance folds it");
    assert_eq!(balances(&pool).await, want_balances);

    // The broker's own view: each partition's consumer filters on its partition, and the two were
    // delivered the stream once between them.
    let mut stream = h.jetstream.get_stream(STREAM).await.expect("stream");
    let stored = stream.info().await.expect("info").state.messages;
    assert_eq!(stored, published);
    for projection in [Inventory::NAME, Points::NAME] {
        let mut delivered = 0;
        for partition in 0..2 {
            let name = format!("{projection}-s{partition}of2");
            let info = stream
                .consumer_info(&name)
                .await
                .expect("the partition's consumer");
            assert_eq!(
                info.config.filter_subject,
                format!("{PREFIX}.{partition}.>"),
                "{name}"
            );
            assert_eq!((info.num_pending, info.num_ack_pending), (0, 0), "{name}");
            delivered += info.delivered.consumer_sequence;
        }
        assert_eq!(delivered, published, "{projection}: one delivery per event");
        let whole_stream = stream.consumer_info(format!("{projection}-p0of2")).await;
        assert!(
            whole_stream.is_err(),
            "no consumer of the whole stream was made"
        );
    }
    // Another P on the same stream (a partition count being changed) is split by the instances, over
    // the whole stream: every event is there, and nothing is applied twice.
    let resized = run_partitions(&h, Inventory, 3, 16).await;
    let messages: u64 = resized.iter().map(|t| t.messages).sum();
    let applied: u64 = resized.iter().map(|t| t.applied).sum();
    assert_eq!((messages, applied), (published, 0), "{resized:?}");
    assert!(resized.iter().all(|t| t.skipped > 0), "{resized:?}");
    stream
        .consumer_info("inventory-p0of3")
        .await
        .expect("split by the instance");
    assert_eq!(stock(&pool).await, want_stock);

    // Every order's events went to the partition its subject names, which is the runner's own.
    let layout = Partitions::new(2, &[]).expect("layout").split_by_server();
    let mut messages = testkit::stream_events(&h.jetstream, STREAM).await;
    assert_eq!(messages.len() as u64, published);
    for message in messages.drain(..) {
        let id = message.envelope.aggregate_id;
        assert_eq!(
            message.subject,
            format!("{PREFIX}.{}.order.{id}", layout.of_aggregate(id))
        );
    }
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn an_orders_events_all_go_to_one_partition(pool: PgPool) {
    let h = Harness::new(&pool).await;
    let orders = workload(40);
    let published = publish(&h, &orders).await as u64;
    let layout = Partitions::new(2, &[]).expect("layout");
    let in_zero: Vec<&Order> = orders
        .iter()
        .filter(|o| layout.of_aggregate(o.id.as_uuid()) == 0)
        .collect();
    assert!(
        !in_zero.is_empty() && in_zero.len() < orders.len(),
        "both partitions hold orders"
    );
    let events_in_zero: u64 = in_zero.iter().map(|o| o.events.len() as u64).sum();

    // Partition 0 alone: exactly its orders' events, each applied; the others acked and skipped.
    let tally = h
        .runner(Points, partitioned(&h, 2, &[0], 7))
        .await
        .run(std::future::pending(), true, |_| {})
        .await
        .expect("run");
    assert_eq!(tally.applied, events_in_zero, "{tally:?}");
    assert_eq!(tally.skipped, published - events_in_zero, "{tally:?}");
    let known = checkpoints(&pool, Points::NAME).await;
    let want: BTreeMap<Uuid, i64> = in_zero
        .iter()
        .map(|o| {
            (
                o.id.as_uuid(),
                i64::try_from(o.events.len()).expect("a small count"),
            )
        })
        .collect();
    assert_eq!(known, want, "partition 0 touched its own orders only");

    // Partition 1 then applies the rest; nothing is left for anyone.
    let tally = h
        .runner(Points, partitioned(&h, 2, &[1], 7))
        .await
        .run(std::future::pending(), true, |_| {})
        .await
        .expect("run");
    assert_eq!(tally.applied, published - events_in_zero, "{tally:?}");
    assert_eq!(checkpoints(&pool, Points::NAME).await.len(), orders.len());
    assert_eq!(balances(&pool).await, expected(&orders).1);
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn partitions_updating_the_same_sku_and_customer_at_once_neither_deadlock_nor_lose_updates(
    pool: PgPool,
) {
    let h = Harness::new(&pool).await;
    // Every order touches the same SKUs (in varying line order) and one of two customers; small
    // batches make the four partitions' transactions overlap all the time.
    let orders = workload(400);
    let published = publish(&h, &orders).await as u64;
    let (want_stock, want_balances) = expected(&orders);
    let (inventory, points) = tokio::time::timeout(std::time::Duration::from_secs(120), async {
        tokio::join!(
            run_partitions(&h, Inventory, 4, 5),
            run_partitions(&h, Points, 4, 5)
        )
    })
    .await
    .expect("no partition waits forever");
    for tallies in [inventory, points] {
        let applied: u64 = tallies.iter().map(|t| t.applied).sum();
        assert_eq!(applied, published, "{tallies:?}");
        assert!(
            tallies.iter().all(|t| t.parked == 0 && t.duplicates == 0),
            "a conflict is retried, never parked: {tallies:?}"
        );
    }
    assert_eq!(stock(&pool).await, want_stock, "no update lost");
    assert_eq!(balances(&pool).await, want_balances, "no update lost");
    let cancelled = orders
        .iter()
        .filter(|o| matches!(o.events.get(2), Some(OrderEvent::Cancelled(_))))
        .count();
    assert_eq!(
        count(&pool, "points.ledger").await,
        i64::try_from(orders.len() + cancelled).expect("a small count"),
        "one ledger row per payment and per cancelled payment"
    );
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_partition_outside_the_count_is_refused_with_exit_2(pool: PgPool) {
    let h = Harness::new(&pool).await;
    let output = binary(
        &h,
        INVENTORY,
        &["--partitions", "2", "--partition", "2", "run", "--once"],
    )
    .output()
    .await
    .expect("runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("--partition 2 does not exist with --partitions 2"),
        "{stderr}"
    );
    let output = binary(&h, POINTS, &["run", "--once", "--json"])
        .env("WAYBILL_PARTITIONS", "0")
        .output()
        .await
        .expect("runs");
    assert_eq!(output.status.code(), Some(2));
    let out: serde_json::Value = serde_json::from_slice(&output.stdout).expect("json");
    assert_eq!(out["error"]["kind"], "refused", "{out}");

    // Consistent flags through the environment: partition 1 of 2 consumes under its own name.
    let (code, out) = run_json(&h, SEARCH, &["--json", "run", "--once"]).await;
    assert_eq!(code, 0, "{out}");
    let mut command = binary(&h, SEARCH, &["--json", "run", "--once"]);
    command
        .env("WAYBILL_PARTITIONS", "2")
        .env("WAYBILL_PARTITION", "1");
    let output = command.output().await.expect("runs");
    assert_eq!(output.status.code(), Some(0));
    let out: serde_json::Value = serde_json::from_slice(&output.stdout).expect("json");
    assert_eq!(out["partitions"]["owned"], serde_json::json!([1]), "{out}");
    let names: Vec<String> = {
        use futures::TryStreamExt;
        h.jetstream
            .get_stream(STREAM)
            .await
            .expect("stream")
            .consumer_names()
            .try_collect()
            .await
            .expect("names")
    };
    assert!(names.contains(&"search-p1of2".to_owned()), "{names:?}");
    assert!(names.contains(&"search".to_owned()), "{names:?}");
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn instances_of_different_partition_counts_at_once_still_apply_each_event_once(pool: PgPool) {
    // A layout change done carelessly: the old single instance still runs while two partitions of
    // the new layout start. Their locks differ, so the checkpoint fence must keep each event once.
    let h = Harness::new(&pool).await;
    let orders = workload(300);
    let published = publish(&h, &orders).await as u64;
    let (want_stock, _) = expected(&orders);
    let single = h
        .runner(
            Inventory,
            RunnerConfig {
                batch_size: 5,
                ..h.config()
            },
        )
        .await;
    let (tally, partitioned) = tokio::join!(
        single.run(std::future::pending(), true, |_| {}),
        run_partitions(&h, Inventory, 2, 5)
    );
    let tally = tally.expect("run");
    let applied = tally.applied + partitioned.iter().map(|t| t.applied).sum::<u64>();
    assert_eq!(applied, published, "{tally:?} {partitioned:?}");
    assert_eq!(stock(&pool).await, want_stock, "nothing applied twice");
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_rebuild_moves_every_partitions_consumer_behind_the_rebuilt_state(pool: PgPool) {
    let h = Harness::new(&pool).await;
    let orders = workload(30);
    let published = publish(&h, &orders).await as u64;
    run_partitions(&h, Points, 2, 8).await;
    // An instance owning partition 0 only rebuilds: the new state holds both partitions' orders.
    let tally = h
        .runner(Points, partitioned(&h, 2, &[0], 8))
        .await
        .rebuild(|_| {})
        .await
        .expect("rebuild");
    assert_eq!(tally.applied, published, "{tally:?}");
    assert_eq!(balances(&pool).await, expected(&orders).1);
    // Both partitions' consumers continue after the rebuild: only new events reach them.
    let more = workload(6);
    let added = publish(&h, &more).await as u64;
    let tallies = run_partitions(&h, Points, 2, 8).await;
    for tally in &tallies {
        assert_eq!(tally.messages + tally.skipped, added, "{tallies:?}");
    }
    assert_eq!(tallies.iter().map(|t| t.applied).sum::<u64>(), added);
    assert_eq!(
        checkpoints(&pool, Points::NAME).await.len(),
        orders.len() + more.len()
    );
}
