//! History lives in the event store (guarantee 12), with the real binaries: after the stream's first
//! messages are purged, `rebuild` and a first `run` end equal to a fold of the event store (or, when
//! the events table cannot be read, refuse and change nothing); an interrupted rebuild's handover is
//! completed by the next `run`; an existing consumer with settings that lose events is fixed or
//! refused; a rebuild keeps the operators' discards.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use async_nats::jetstream::consumer::{DeliverPolicy, pull};
use common::*;
use relay::StreamSettings;
use sqlx::PgPool;
use uuid::Uuid;

type Stock = BTreeMap<String, (i64, i64, i64)>;

/// `count` orders through the command side, numbered from `from`: order i reserves i mugs and one
/// tea; every second one is paid, every fifth cancelled.
async fn seed(store: &store::EventStore, from: usize, count: usize) {
    for i in from..from + count {
        let order = testkit::place_order(
            store,
            &format!("customer-{}", i % 3),
            &[&format!("MUG:{}:100", i + 1), "TEA:1:50"],
        )
        .await;
        if i % 2 == 0 {
            testkit::pay_order(store, order).await;
        }
        if i % 5 == 4 {
            let cancel = domain::OrderCommand::Cancel(domain::CancelOrder {
                reason: domain::Note::parse("changed my mind").expect("note"),
            });
            store
                .execute(order, &cancel, &store::CommandContext::default())
                .await
                .expect("cancel");
        }
    }
}

/// Relays every outbox row into the harness's stream.
async fn drain(h: &Harness) {
    let config = relay::RelayConfig {
        stream: StreamSettings {
            name: STREAM.into(),
            subject_prefix: PREFIX.into(),
            ..Default::default()
        },
        ..relay::RelayConfig::default()
    };
    relay::Relay::connect(&h.url, &h.nats.url(), config)
        .await
        .expect("relay")
        .drain()
        .await
        .expect("drain");
}

/// The event store's truth, folded with the domain's own fold: stock per SKU and points per customer.
async fn store_fold(pool: &PgPool) -> (Stock, BTreeMap<String, i64>) {
    let store = store::EventStore::new(pool.clone());
    let ids: Vec<Uuid> = sqlx::query_scalar("SELECT DISTINCT aggregate_id FROM events")
        .fetch_all(pool)
        .await
        .expect("orders");
    let mut stock = Stock::new();
    let mut points = BTreeMap::new();
    for id in ids {
        let order = store
            .load(domain::OrderId::from_uuid(id))
            .await
            .expect("load");
        for line in &order.lines {
            let counters = stock.entry(line.sku.to_string()).or_default();
            let quantity = i64::from(line.quantity.get());
            match order.status {
                domain::OrderStatus::Placed | domain::OrderStatus::Paid => counters.0 += quantity,
                domain::OrderStatus::Shipped => counters.1 += quantity,
                domain::OrderStatus::Cancelled => counters.2 += quantity,
                domain::OrderStatus::New => {}
            }
        }
        if order.paid_cents > 0 {
            let earned = match order.status {
                domain::OrderStatus::Paid | domain::OrderStatus::Shipped => order.paid_cents / 100,
                _ => 0,
            };
            *points
                .entry(order.customer_id.expect("placed").to_string())
                .or_default() += earned;
        }
    }
    (stock, points)
}

async fn stock(url: &str) -> Stock {
    let pool = projections::schema::connect(
        url,
        "inventory",
        <projections::Inventory as projections::Projection>::TABLES,
    )
    .await
    .expect("inventory pool");
    projections::inventory::stock(&pool, None)
        .await
        .expect("stock")
        .into_iter()
        .map(|s| (s.sku, (s.reserved, s.shipped, s.released)))
        .collect()
}

async fn balances(url: &str) -> BTreeMap<String, i64> {
    let pool = projections::schema::connect(
        url,
        "points",
        <projections::Points as projections::Projection>::TABLES,
    )
    .await
    .expect("points pool");
    projections::points::accounts(&pool, None)
        .await
        .expect("accounts")
        .into_iter()
        .map(|a| (a.customer_id, a.balance))
        .collect()
}

/// Removes the stream's messages below `sequence`, as a retention limit or an operator's purge does.
/// Removes the stream's messages below `sequence` the way its retention does (a message limit,
/// lifted again afterwards), and returns how many went. Not with a purge: nats-server 2.10 and later
/// move every consumer past what a purge removed, as if delivered — an operator's explicit "forget
/// these" — while retention leaves the consumers where they were, which is the loss to detect.
async fn purge_below(h: &Harness, sequence: u64) -> u64 {
    let mut stream = h.jetstream.get_stream(STREAM).await.expect("stream");
    let info = stream.info().await.expect("info").clone();
    let keep = info.state.last_sequence.saturating_sub(sequence) + 1;
    let before = info.state.messages;
    let mut config = info.config.clone();
    config.max_messages = i64::try_from(keep).expect("a small count");
    h.jetstream.update_stream(&config).await.expect("limit");
    config.max_messages = info.config.max_messages;
    h.jetstream.update_stream(&config).await.expect("unlimit");
    let after = stream.info().await.expect("info").state.messages;
    before - after
}

async fn first_sequence(h: &Harness) -> u64 {
    let mut stream = h.jetstream.get_stream(STREAM).await.expect("stream");
    stream.info().await.expect("info").state.first_sequence
}

async fn consumer_config(h: &Harness, name: &str) -> pull::Config {
    let stream = h.jetstream.get_stream(STREAM).await.expect("stream");
    let info = stream.consumer_info(name).await.expect("consumer info");
    pull::Config {
        durable_name: info.config.durable_name,
        description: info.config.description,
        deliver_policy: info.config.deliver_policy,
        ack_policy: info.config.ack_policy,
        ack_wait: info.config.ack_wait,
        max_deliver: info.config.max_deliver,
        filter_subject: info.config.filter_subject,
        inactive_threshold: info.config.inactive_threshold,
        ..Default::default()
    }
}

/// A projection binary as [`binary`] runs it, but on database `url` (another login).
fn binary_on(h: &Harness, url: &str, path: &str, args: &[&str]) -> tokio::process::Command {
    let mut command = tokio::process::Command::new(path);
    command
        .args(["--database-url", url, "--nats-url", &h.nats.url()])
        .args([
            "--stream",
            STREAM,
            "--subject-prefix",
            PREFIX,
            "--ack-wait",
            "2s",
        ])
        .args(args)
        .env("RUST_LOG", "warn")
        .env("WAYBILL_OPERATOR", "test-operator")
        .kill_on_drop(true);
    command
}

async fn run_json_on(
    h: &Harness,
    url: &str,
    path: &str,
    args: &[&str],
) -> (i32, serde_json::Value) {
    let output = binary_on(h, url, path, args).output().await.expect("runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let json = serde_json::from_str(stdout.trim()).unwrap_or_else(|e| {
        panic!(
            "{path} {args:?}: stdout is not JSON ({e}): {stdout}\nstderr: {}",
            String::from_utf8_lossy(&output.stderr)
        )
    });
    (output.status.code().unwrap_or(-1), json)
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_rebuild_after_the_streams_first_messages_are_purged_equals_the_event_store(
    pool: PgPool,
) {
    let h = Harness::new(&pool).await;
    let store = store::EventStore::new(pool.clone());
    seed(&store, 0, 10).await;
    drain(&h).await;
    let (code, out) = run_json(&h, INVENTORY, &["--json", "run", "--once"]).await;
    assert_eq!(code, 0, "{out}");
    let (expected, _) = store_fold(&pool).await;
    assert_eq!(
        stock(&h.url).await,
        expected,
        "the first run equals the store"
    );

    // The first half of the stream goes (a retention limit, a purge); more orders come after it.
    assert!(purge_below(&h, 11).await >= 10);
    seed(&store, 10, 3).await;
    drain(&h).await;

    let (code, out) = run_json(&h, INVENTORY, &["--json", "rebuild"]).await;
    assert_eq!(code, 0, "{out}");
    let (expected, _) = store_fold(&pool).await;
    assert_eq!(
        stock(&h.url).await,
        expected,
        "the rebuilt state equals the store's, not what is left of the stream"
    );
    let events: i64 = sqlx::query_scalar("SELECT count(*) FROM events")
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(
        out["tally"]["from_store"], events,
        "every event came from the store: {out}"
    );

    // The live consumer continues right behind the rebuilt state: new events arrive once.
    seed(&store, 13, 2).await;
    drain(&h).await;
    let (code, out) = run_json(&h, INVENTORY, &["--json", "run", "--once"]).await;
    assert_eq!(code, 0, "{out}");
    assert_eq!(out["tally"]["duplicates"], 0, "{out}");
    let (expected, _) = store_fold(&pool).await;
    assert_eq!(stock(&h.url).await, expected);
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_projection_started_for_the_first_time_after_the_first_messages_are_gone_equals_the_store(
    pool: PgPool,
) {
    let h = Harness::new(&pool).await;
    let store = store::EventStore::new(pool.clone());
    seed(&store, 0, 12).await;
    drain(&h).await;
    purge_below(&h, 15).await;
    assert_eq!(first_sequence(&h).await, 15);
    // Committed but not yet relayed when the projection starts: the store has them, the stream not.
    seed(&store, 12, 2).await;

    // Points in two partitions, one process each; inventory in one.
    let partition = |k: &'static str| {
        let h = &h;
        async move {
            run_json(
                h,
                POINTS,
                &[
                    "--json",
                    "--partitions",
                    "2",
                    "--partition",
                    k,
                    "run",
                    "--once",
                ],
            )
            .await
        }
    };
    let (p0, p1) = tokio::join!(partition("0"), partition("1"));
    for (code, out) in [p0, p1] {
        assert_eq!(code, 0, "{out}");
        assert!(out["tally"]["from_store"].as_u64() > Some(0), "{out}");
    }
    let (code, out) = run_json(&h, INVENTORY, &["--json", "run", "--once"]).await;
    assert_eq!(code, 0, "{out}");
    let (expected_stock, expected_points) = store_fold(&pool).await;
    assert_eq!(stock(&h.url).await, expected_stock);
    assert_eq!(balances(&h.url).await, expected_points);

    // What the store held beyond the stream arrives later as duplicates, and nothing is missing.
    drain(&h).await;
    let (code, out) = run_json(&h, INVENTORY, &["--json", "run", "--once"]).await;
    assert_eq!(code, 0, "{out}");
    assert!(out["tally"]["duplicates"].as_u64() > Some(0), "{out}");
    assert_eq!(out["tally"]["applied"], 0, "{out}");
    assert_eq!(out["held"]["count"], 0, "{out}");
    assert_eq!(stock(&h.url).await, expected_stock);
}

/// A login of the test server that may create its own schemas but not read `events`: a projection
/// whose role predates the grant.
async fn login_without_history(pool: &PgPool) -> (String, String) {
    let name = format!("wb_test_{}", Uuid::now_v7().simple());
    let database: String = sqlx::query_scalar("SELECT current_database()")
        .fetch_one(pool)
        .await
        .expect("db");
    for sql in [
        format!("CREATE ROLE {name} LOGIN"),
        format!("GRANT CREATE ON DATABASE \"{database}\" TO {name}"),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .execute(pool)
            .await
            .expect("role");
    }
    let url = testkit::database_url(pool).await;
    let (rest, database) = url.rsplit_once('/').expect("url with database");
    let host = rest
        .rsplit_once('@')
        .map_or(rest.trim_start_matches("postgres://"), |(_, h)| h);
    (name.clone(), format!("postgres://{name}@{host}/{database}"))
}

async fn drop_login(pool: &PgPool, name: &str) {
    let database: String = sqlx::query_scalar("SELECT current_database()")
        .fetch_one(pool)
        .await
        .expect("db");
    for sql in [
        format!("REVOKE ALL ON DATABASE \"{database}\" FROM {name}"),
        format!("DROP OWNED BY {name}"),
        format!("DROP ROLE {name}"),
    ] {
        let _ = sqlx::query(sqlx::AssertSqlSafe(sql)).execute(pool).await;
    }
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn without_the_events_table_a_purged_stream_is_refused_and_nothing_changes(pool: PgPool) {
    let h = Harness::new(&pool).await;
    let store = store::EventStore::new(pool.clone());
    let (login, url) = login_without_history(&pool).await;
    seed(&store, 0, 8).await;
    drain(&h).await;
    // The whole stream is there: without the store, it is the history.
    let (code, out) = run_json_on(&h, &url, INVENTORY, &["--json", "run", "--once"]).await;
    assert_eq!(code, 0, "{out}");
    let (expected, _) = store_fold(&pool).await;
    assert_eq!(stock(&h.url).await, expected);
    let live_consumer = consumer_config(&h, "inventory").await;

    purge_below(&h, 5).await;
    let (code, out) = run_json_on(&h, &url, INVENTORY, &["--json", "rebuild"]).await;
    assert_eq!(code, 1, "refused: {out}");
    let message = out["error"]["message"].as_str().unwrap_or_default();
    eprintln!("refused: {message}");
    for needle in [
        "cannot read the event store's events table",
        "permission denied",
        "first messages are gone (it starts at sequence 5)",
        "Nothing was changed",
    ] {
        assert!(message.contains(needle), "{needle:?} in {message}");
    }
    assert_eq!(stock(&h.url).await, expected, "the live state is unchanged");
    assert_eq!(consumer_config(&h, "inventory").await, live_consumer);

    // A first start has nothing whole to start from either: refused, and no consumer is made.
    let (code, out) = run_json_on(&h, &url, POINTS, &["--json", "run", "--once"]).await;
    assert_eq!(code, 1, "{out}");
    let stream = h.jetstream.get_stream(STREAM).await.expect("stream");
    assert!(stream.consumer_info("points").await.is_err(), "no consumer");

    // Nor can a consumer the stream left behind go on: what it missed is only in the store.
    seed(&store, 8, 2).await;
    drain(&h).await;
    let mut stream = h.jetstream.get_stream(STREAM).await.expect("stream");
    let last = stream.info().await.expect("info").state.last_sequence;
    purge_below(&h, last).await;
    let (code, out) = run_json_on(&h, &url, INVENTORY, &["--json", "run", "--once"]).await;
    assert_eq!(code, 1, "{out}");
    let message = out["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("before they were settled"), "{message}");
    assert_eq!(stock(&h.url).await, expected, "still the state it had");

    // With the grant (`waybill roles create` gives it), the same rebuild catches up from the store.
    let grant = format!("GRANT SELECT ON events TO {login}");
    sqlx::query(sqlx::AssertSqlSafe(grant))
        .execute(&pool)
        .await
        .expect("grant");
    seed(&store, 10, 1).await;
    drain(&h).await;
    let (code, out) = run_json_on(&h, &url, INVENTORY, &["--json", "rebuild"]).await;
    assert_eq!(code, 0, "{out}");
    let (expected, _) = store_fold(&pool).await;
    assert_eq!(stock(&h.url).await, expected);
    drop_login(&pool, &login).await;
}

/// Review finding (a): a rebuild killed after moving the first live consumer used to leave it moved
/// while PostgreSQL rolled the swap back. Now the swap commits first, with the move recorded, and the
/// next `run` completes it.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_rebuild_killed_while_moving_the_consumers_is_completed_by_the_next_run(pool: PgPool) {
    let h = Harness::new(&pool).await;
    let store = store::EventStore::new(pool.clone());
    let two = ["--json", "--partitions", "2"];
    seed(&store, 0, 6).await;
    drain(&h).await;
    let (code, out) = run_json(&h, INVENTORY, &[&two[..], &["run", "--once"]].concat()).await;
    assert_eq!(code, 0, "{out}");
    // Events the live state has not applied yet, in both partitions.
    seed(&store, 6, 10).await;
    drain(&h).await;

    let killed = faulty(
        &h,
        "inventory",
        &[
            "--partitions",
            "2",
            "rebuild",
            "--crash-after-first-consumer-moved",
        ],
    )
    .output()
    .await
    .expect("runs");
    assert_ne!(killed.status.code(), Some(0), "the fail point aborts it");

    let (code, out) = run_json(&h, INVENTORY, &[&two[..], &["run", "--once"]].concat()).await;
    assert_eq!(code, 0, "{out}");
    let (expected, _) = store_fold(&pool).await;
    assert_eq!(
        stock(&h.url).await,
        expected,
        "no event between the old state and the rebuilt one is missing"
    );
    assert_eq!(out["held"]["count"], 0, "nothing piles up in held: {out}");
    let moved: Vec<(String, bool)> =
        sqlx::query_as("SELECT consumer, moved_at IS NOT NULL FROM inventory.handover ORDER BY 1")
            .fetch_all(&pool)
            .await
            .expect("the handover was committed with the swap");
    assert_eq!(
        moved,
        [
            ("inventory-p0of2".to_owned(), true),
            ("inventory-p1of2".to_owned(), true)
        ],
        "the run completed the move"
    );

    // And the consumers are right behind the state: what comes next is applied once.
    seed(&store, 16, 4).await;
    drain(&h).await;
    let (code, out) = run_json(&h, INVENTORY, &[&two[..], &["run", "--once"]].concat()).await;
    assert_eq!(code, 0, "{out}");
    assert_eq!(out["tally"]["duplicates"], 0, "{out}");
    let (expected, _) = store_fold(&pool).await;
    assert_eq!(stock(&h.url).await, expected);
}

/// A `run` that is running when a rebuild dies between its swap and the handover moves the
/// consumers itself, within seconds, without a restart (nothing deleted its consumers to wake it).
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_running_projection_completes_a_handover_it_finds(pool: PgPool) {
    let h = Harness::new(&pool).await;
    let store = store::EventStore::new(pool.clone());
    seed(&store, 0, 4).await;
    drain(&h).await;
    let mut live = binary(&h, INVENTORY, &["--partitions", "2", "run"])
        .spawn()
        .expect("run");
    let (expected, _) = store_fold(&pool).await;
    testkit::wait_until(Duration::from_secs(20), "the live run applies", || async {
        stock(&h.url).await == expected
    })
    .await;

    let killed = faulty(
        &h,
        "inventory",
        &["--partitions", "2", "rebuild", "--crash-after-swap"],
    )
    .output()
    .await
    .expect("runs");
    assert_ne!(killed.status.code(), Some(0));
    testkit::wait_until(
        Duration::from_secs(30),
        "the live run moves both",
        || async {
            let pending: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM inventory.handover WHERE moved_at IS NULL",
            )
            .fetch_one(&pool)
            .await
            .expect("handover");
            pending == 0
        },
    )
    .await;
    seed(&store, 4, 6).await;
    drain(&h).await;
    let (expected, _) = store_fold(&pool).await;
    testkit::wait_until(
        Duration::from_secs(30),
        "new events reach the state",
        || async { stock(&h.url).await == expected },
    )
    .await;
    live.kill().await.expect("stops");
}

/// Review finding (b): a consumer created beforehand was accepted when only its filter and ack
/// policy matched. One that would drop NAKed messages (max_deliver), forget the projection (an
/// inactivity threshold) or redeliver on another clock is changed, saying so; one that skips
/// history (its deliver policy) is refused with every difference named.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn an_existing_consumer_that_would_lose_events_is_changed_or_refused(pool: PgPool) {
    let h = Harness::new(&pool).await;
    let store = store::EventStore::new(pool.clone());
    seed(&store, 0, 3).await;
    drain(&h).await;
    let stream = h.jetstream.get_stream(STREAM).await.expect("stream");
    let by_hand = |name: &str, deliver_policy| pull::Config {
        durable_name: Some(name.to_owned()),
        deliver_policy,
        ack_policy: async_nats::jetstream::consumer::AckPolicy::Explicit,
        filter_subject: format!("{PREFIX}.>"),
        max_deliver: 2,
        ack_wait: Duration::from_secs(9),
        inactive_threshold: Duration::from_secs(3600),
        max_ack_pending: 10_000,
        ..Default::default()
    };
    stream
        .create_consumer(by_hand("inventory", DeliverPolicy::All))
        .await
        .expect("made by hand");
    stream
        .create_consumer(by_hand("points", DeliverPolicy::New))
        .await
        .expect("made by hand");

    let output = binary(&h, INVENTORY, &["--json", "run", "--once"])
        .output()
        .await
        .expect("runs");
    assert_eq!(output.status.code(), Some(0));
    let changed = consumer_config(&h, "inventory").await;
    assert!(changed.max_deliver <= 0, "{changed:?}");
    assert_eq!(changed.ack_wait, Duration::from_secs(2));
    assert_eq!(changed.inactive_threshold, Duration::ZERO);
    let logged = String::from_utf8_lossy(&output.stderr);
    for needle in [
        "max_deliver is 2, needs no limit",
        "ack_wait is 9s, needs 2s",
        "inactive_threshold is 1h",
    ] {
        assert!(logged.contains(needle), "{needle:?} in {logged}");
    }
    let (expected, _) = store_fold(&pool).await;
    assert_eq!(stock(&h.url).await, expected);

    let before = consumer_config(&h, "points").await;
    let (code, out) = run_json(&h, POINTS, &["--json", "run", "--once"]).await;
    assert_eq!(code, 1, "{out}");
    let message = out["error"]["message"].as_str().unwrap_or_default();
    for needle in [
        "consumer points exists with settings the projection cannot use",
        "deliver_policy is New",
        "max_deliver is 2",
        "ack_wait is 9s",
        "inactive_threshold is 1h",
    ] {
        assert!(message.contains(needle), "{needle:?} in {message}");
    }
    assert_eq!(
        consumer_config(&h, "points").await,
        before,
        "left as it was"
    );
}

/// Review finding (c): `rebuild` parked again what an operator had discarded. The discard is kept:
/// the event the store holds is parked again discarded, by the same operator for the same reason,
/// and the operator log survives the swap.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_rebuild_keeps_an_operators_discard(pool: PgPool) {
    let h = Harness::new(&pool).await;
    let store = store::EventStore::new(pool.clone());
    seed(&store, 0, 3).await;
    // A payment that is not the order's total, written past the domain: the projections park it.
    let order = testkit::place_order(&store, "mallory", &["MUG:1:100"]).await;
    let envelope = envelope(order, 2, &paid(99));
    store::append(&pool, order.as_uuid(), 1, &[envelope], &Default::default())
        .await
        .expect("append");
    drain(&h).await;
    let (code, out) = run_json(&h, INVENTORY, &["--json", "run", "--once"]).await;
    assert_eq!(code, 0, "{out}");
    assert_eq!(out["parked"]["count"], 1, "{out}");
    let id = out["parked"]["first"][0]["id"].to_string();
    let (code, out) = run_json(
        &h,
        INVENTORY,
        &[
            "--json",
            "parked",
            "discard",
            &id,
            "--reason",
            "a test payment",
        ],
    )
    .await;
    assert_eq!(code, 0, "{out}");

    for _ in 0..2 {
        let (code, out) = run_json(&h, INVENTORY, &["--json", "rebuild"]).await;
        assert_eq!(code, 0, "{out}");
        assert_eq!(out["parked"]["count"], 0, "the discard holds: {out}");
    }
    let (code, all) = run_json(&h, INVENTORY, &["--json", "parked", "list", "--all"]).await;
    assert_eq!(code, 0, "{all}");
    let all = all.as_array().expect("array");
    assert_eq!(all.len(), 1, "{all:?}");
    assert_eq!(all[0]["discarded_by"], "test-operator");
    assert_eq!(all[0]["discard_reason"], "a test payment");
    let logged: Vec<String> = sqlx::query_scalar("SELECT action FROM inventory.operator_log")
        .fetch_all(&pool)
        .await
        .expect("log");
    assert_eq!(logged, ["parked discard"]);
}

/// A discarded message the stream alone carries (no event behind it) is known by its stream
/// sequence and bytes: a rebuild from the stream parks it again discarded.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_rebuild_from_the_stream_keeps_the_discard_of_a_foreign_message(pool: PgPool) {
    let h = Harness::new(&pool).await;
    h.publish(&envelope(new_order(), 1, &placed("ann", &["MUG:1:100"])))
        .await;
    h.publish_raw(
        &format!("{PREFIX}.order.garbage"),
        b"not json".to_vec(),
        "junk-1",
    )
    .await;
    let (code, out) = run_json(&h, INVENTORY, &["--json", "run", "--once"]).await;
    assert_eq!(code, 0, "{out}");
    let id = out["parked"]["first"][0]["id"].to_string();
    let (code, out) = run_json(
        &h,
        INVENTORY,
        &["--json", "parked", "discard", &id, "--reason", "junk"],
    )
    .await;
    assert_eq!(code, 0, "{out}");
    let (code, out) = run_json(&h, INVENTORY, &["--json", "rebuild"]).await;
    assert_eq!(code, 0, "{out}");
    assert_eq!(out["parked"]["count"], 0, "{out}");
    assert_eq!(out["tally"]["parked"], 1, "parked again, discarded: {out}");
}

/// A projection down while the stream removed messages it had not consumed (a retention limit
/// shorter than the outage) finds its consumer behind the stream's first message at the next start,
/// catches up from the store and moves the consumer behind it.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_consumer_the_stream_left_behind_catches_up_from_the_store(pool: PgPool) {
    let h = Harness::new(&pool).await;
    let store = store::EventStore::new(pool.clone());
    seed(&store, 0, 4).await;
    drain(&h).await;
    let (code, out) = run_json(&h, INVENTORY, &["--json", "run", "--once"]).await;
    assert_eq!(code, 0, "{out}");
    // Down meanwhile: events arrive and age out before it is back.
    seed(&store, 4, 6).await;
    drain(&h).await;
    let mut stream = h.jetstream.get_stream(STREAM).await.expect("stream");
    let last = stream.info().await.expect("info").state.last_sequence;
    purge_below(&h, last - 2).await;

    let (code, out) = run_json(&h, INVENTORY, &["--json", "run", "--once"]).await;
    assert_eq!(code, 0, "{out}");
    let (expected, _) = store_fold(&pool).await;
    assert_eq!(
        stock(&h.url).await,
        expected,
        "nothing the stream lost is missing"
    );
    assert_eq!(out["held"]["count"], 0, "{out}");
    assert!(out["tally"]["from_store"].as_u64() > Some(0), "{out}");
    let consumer = consumer_config(&h, "inventory").await;
    assert_eq!(
        consumer.deliver_policy,
        DeliverPolicy::ByStartSequence {
            start_sequence: last + 1
        },
        "moved behind the catch-up"
    );
}
