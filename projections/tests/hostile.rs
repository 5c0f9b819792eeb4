//! Issue 9's findings, tried as an attacker and as an operator would, against a real PostgreSQL and a
//! real nats-server: poison PostgreSQL cannot store, gaps that would fill the ack-pending window,
//! `--once` and `rebuild` with gaps open, messages that disagree with themselves, the operator's tools,
//! and the read APIs.

mod common;

use std::time::Duration;

use async_nats::HeaderMap;
use common::*;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use projections::{FailPoint, Inventory, Points, Projection, RunnerConfig, Search, search};
use serde_json::{Value, json};
use sqlx::PgPool;
use uuid::Uuid;

/// Finding 1: a NUL byte in a header value and a time PostgreSQL cannot hold used to fail the whole
/// batch forever. Now each is parked alone, storably, and everything around them applies.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn poison_postgresql_cannot_store_is_parked_alone(pool: PgPool) {
    let h = Harness::new(&pool).await;
    let order = new_order();
    h.publish(&envelope(order, 1, &placed("alice", &["MUG:1:100"])))
        .await;
    // Garbage with a NUL in a header value.
    let mut headers = HeaderMap::new();
    headers.insert("Nats-Msg-Id", "garbage");
    headers.insert("X-Nul", "a\u{0}b");
    h.publish_with_headers(
        &format!("{PREFIX}.order.{}", Uuid::now_v7()),
        headers,
        b"\x00 garbage".to_vec(),
    )
    .await;
    // A payment dated 5001 BC: chrono reads it, TIMESTAMPTZ cannot hold it.
    let mut ancient = envelope(order, 2, &paid(100));
    ancient.occurred_at = "-5000-01-01T00:00:00Z".parse().expect("chrono accepts it");
    h.publish(&ancient).await;
    // A payload field named NUL: the reason quotes it.
    let mut nul_field = envelope(new_order(), 1, &placed("carol", &["TEA:1:500"]));
    nul_field.payload["\u{0}"] = json!(1);
    h.publish(&nul_field).await;
    // 900 KB of body.
    let big = vec![b'x'; 900_000];
    h.publish_raw(
        &format!("{PREFIX}.order.{}", Uuid::now_v7()),
        big.clone(),
        "big",
    )
    .await;
    h.publish(&envelope(new_order(), 1, &placed("bob", &["TEA:1:500"])))
        .await;

    let runner = h.runner(Inventory, h.config()).await;
    let run = runner.run(std::future::pending(), true, |_| {});
    let tally = tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("--once ends")
        .expect("run");
    assert_eq!((tally.applied, tally.parked), (2, 4), "{tally:?}");
    assert_eq!(stock_of(&pool, "MUG").await, Some((1, 0, 0)));
    assert_eq!(
        stock_of(&pool, "TEA").await,
        Some((1, 0, 0)),
        "bob's order applied"
    );
    assert_eq!(
        runner.lag().await.expect("lag"),
        (0, 0),
        "nothing left on the broker"
    );

    let parked = projections::park::list(runner.pool(), 10, None, false)
        .await
        .expect("list");
    let by_order: Vec<&str> = parked.iter().rev().map(|p| p.reason.as_str()).collect();
    assert!(by_order[0].contains("undecodable body"), "{by_order:?}");
    assert!(
        by_order[1].contains("outside the range PostgreSQL can store"),
        "{by_order:?}"
    );
    assert!(by_order[2].contains("unknown field"), "{by_order:?}");
    let garbage = parked.last().expect("garbage parked");
    assert_eq!(
        garbage.headers["X-Nul"], "a\u{0}b",
        "the NUL header is kept exactly"
    );
    let big_row = &parked[0];
    assert_eq!(big_row.body_size, 900_000);
    let kept: (i32, Vec<u8>) = sqlx::query_as(
        "SELECT octet_length(body), body_sha256 FROM inventory.parked WHERE id = $1",
    )
    .bind(big_row.id)
    .fetch_one(&pool)
    .await
    .expect("row");
    assert_eq!(kept.0, 64 * 1024, "only the first 64 KiB are kept");
    let whole: Vec<u8> = sqlx::query_scalar("SELECT sha256($1)")
        .bind(&big)
        .fetch_one(&pool)
        .await
        .expect("hash");
    assert_eq!(kept.1, whole, "with the whole body's hash");
}

/// Publishes `count` `order.paid` version 2 events for orders whose version 1 never comes.
async fn publish_orphans(h: &Harness, count: usize) {
    let mut acks = FuturesUnordered::new();
    for _ in 0..count {
        let event = envelope(new_order(), 2, &paid(100));
        acks.push(
            h.jetstream
                .publish_with_headers(
                    subject(&event),
                    projections::decode::relay_headers(&event),
                    event.to_json().into(),
                )
                .await
                .expect("publish")
                .into_future(),
        );
        while acks.len() > 1000 {
            acks.next().await.expect("ack").expect("puback");
        }
    }
    while let Some(ack) = acks.next().await {
        ack.expect("puback");
    }
}

/// Finding 2: 10,050 gaps used to fill `max_ack_pending` (10,000), so a valid event was never
/// delivered. Now gaps are acked and held in the database; the valid event is applied.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn gaps_are_held_in_the_database_not_on_the_broker(pool: PgPool) {
    let h = Harness::new(&pool).await;
    publish_orphans(&h, 10_050).await;
    let valid = new_order();
    h.publish(&envelope(valid, 1, &placed("dave", &["PEN:3:100"])))
        .await;
    let runner = h.runner(Points, h.config()).await;
    let run = runner.run(std::future::pending(), true, |_| {});
    let tally = tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("--once ends")
        .expect("run");
    assert_eq!((tally.applied, tally.held), (1, 10_050), "{tally:?}");
    assert_eq!(
        runner.lag().await.expect("lag"),
        (0, 0),
        "nothing waits on the broker"
    );
    let stats = projections::held::stats(runner.pool())
        .await
        .expect("stats");
    assert_eq!((stats.count, stats.aggregates), (10_050, 10_050));
    let listed = projections::held::list(runner.pool(), 3, None)
        .await
        .expect("list");
    assert_eq!(listed.len(), 3);
    assert_eq!(listed[0].reason, "waiting for version 1", "{listed:?}");
    // The next page starts after the last one listed.
    let after = (listed[2].aggregate_id, listed[2].version);
    let next = projections::held::list(runner.pool(), 1, Some(after))
        .await
        .expect("list");
    assert!(next[0].aggregate_id > listed[2].aggregate_id);
}

/// How long `run --once` or `rebuild` may take before the test calls it a hang: several times what
/// they take on a loaded machine, since what is tested is that they end, not how fast.
const ENDS_WITHIN: Duration = Duration::from_secs(180);

/// Finding 3: `run --once` and `rebuild` used to run forever while a gap was open, and `rebuild`
/// dropped the state first. Now both end; a rebuild that fails leaves the old state to readers.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn run_once_and_rebuild_end_with_gaps_open_and_rebuild_is_blue_green(pool: PgPool) {
    let h = Harness::new(&pool).await;
    let order = new_order();
    h.publish(&envelope(order, 1, &placed("erin", &["CUP:2:300"])))
        .await;
    h.publish(&envelope(order, 3, &shipped())).await;
    h.publish(&envelope(new_order(), 2, &paid(100))).await;

    // Ending at all is the fix (it used to run forever); how soon is the machine's business, so the
    // bound only stops a hang, and dropping the future kills the process.
    let (code, out) = tokio::time::timeout(
        ENDS_WITHIN,
        run_json(&h, INVENTORY, &["--json", "run", "--once"]),
    )
    .await
    .expect("run --once ends with gaps open");
    assert_eq!(code, 0, "{out}");
    assert_eq!(out["tally"]["applied"], 1, "{out}");
    assert_eq!(out["held"]["count"], 2, "what is held is printed: {out}");
    assert_eq!(
        out["held"]["first"].as_array().map(Vec::len),
        Some(2),
        "{out}"
    );
    assert_eq!(stock_of(&pool, "CUP").await, Some((2, 0, 0)));

    // A rebuild that fails after building leaves readers the old state, whole.
    let failing = RunnerConfig {
        fail_point: FailPoint::FailBeforeSwap,
        ..h.config()
    };
    let error = h
        .runner(Inventory, failing)
        .await
        .rebuild(|_| {})
        .await
        .expect_err("the fail point stops it");
    assert!(error.to_string().contains("before the swap"), "{error:#}");
    assert_eq!(
        stock_of(&pool, "CUP").await,
        Some((2, 0, 0)),
        "old state untouched"
    );

    // More events arrive; the rebuild ends with the gaps still open and swaps in a complete state.
    h.publish(&envelope(order, 2, &paid(600))).await;
    let (code, out) =
        tokio::time::timeout(ENDS_WITHIN, run_json(&h, INVENTORY, &["--json", "rebuild"]))
            .await
            .expect("rebuild ends with gaps open");
    assert_eq!(code, 0, "{out}");
    assert_eq!(
        out["held"]["count"], 1,
        "the orphan payment is still held: {out}"
    );
    assert_eq!(
        stock_of(&pool, "CUP").await,
        Some((0, 2, 0)),
        "version 3 applied behind 2"
    );

    // The live consumer continues after what the rebuild consumed: nothing is applied twice.
    let later = new_order();
    h.publish(&envelope(later, 1, &placed("erin", &["CUP:1:300"])))
        .await;
    let (code, out) = run_json(&h, INVENTORY, &["--json", "run", "--once"]).await;
    assert_eq!(code, 0, "{out}");
    assert_eq!(
        out["tally"]["messages"], 1,
        "only the new event is delivered: {out}"
    );
    assert_eq!(stock_of(&pool, "CUP").await, Some((1, 2, 0)));
    let leftovers: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM information_schema.schemata WHERE schema_name = 'inventory_next'",
    )
    .fetch_one(&pool)
    .await
    .expect("schemata");
    assert_eq!(leftovers, 0);
}

/// Finding 4: anything well-formed used to be applied. Now a message must agree with itself and with
/// the domain's bounds; one that does not is parked with the reason, and a forged payment no longer
/// makes the genuine one a duplicate.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn messages_that_disagree_with_themselves_are_parked(pool: PgPool) {
    let h = Harness::new(&pool).await;

    // Nats-Msg-Id is not the event id.
    let wrong_id = envelope(new_order(), 1, &placed("mallory", &["GEM:1:100"]));
    let mut headers = projections::decode::relay_headers(&wrong_id);
    headers.insert("Nats-Msg-Id", Uuid::now_v7().to_string().as_str());
    h.publish_with_headers(&subject(&wrong_id), headers, wrong_id.to_json())
        .await;
    // The subject names another order.
    let wrong_subject = envelope(new_order(), 1, &placed("mallory", &["GEM:1:100"]));
    h.publish_with_headers(
        &format!("{PREFIX}.order.{}", Uuid::now_v7()),
        projections::decode::relay_headers(&wrong_subject),
        wrong_subject.to_json(),
    )
    .await;
    // The type header says paid, the body placed.
    let wrong_type = envelope(new_order(), 1, &placed("mallory", &["GEM:1:100"]));
    let mut headers = projections::decode::relay_headers(&wrong_type);
    headers.insert("Waybill-Event-Type", "order.paid");
    h.publish_with_headers(&subject(&wrong_type), headers, wrong_type.to_json())
        .await;
    // A negative total.
    let mut negative = envelope(new_order(), 1, &placed("mallory", &["GEM:1:100"]));
    negative.payload["total_cents"] = json!(-100);
    h.publish(&negative).await;
    // A genuine order, a forged payment of 10^12 cents for it, then the genuine payment.
    let genuine = new_order();
    h.publish(&envelope(genuine, 1, &placed("alice", &["MUG:2:1250"])))
        .await;
    h.publish(&envelope(genuine, 2, &paid(1_000_000_000_000)))
        .await;
    h.publish(&envelope(genuine, 2, &paid(2500))).await;

    for projection in ["inventory", "points", "search"] {
        let tally = match projection {
            "inventory" => h.consume(Inventory).await,
            "points" => h.consume(Points).await,
            _ => h.consume(Search).await,
        };
        assert_eq!(
            (tally.applied, tally.parked),
            (2, 5),
            "{projection}: {tally:?}"
        );
        let reasons: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT reason FROM {projection}.parked ORDER BY stream_sequence"
        )))
        .fetch_all(&pool)
        .await
        .expect("reasons");
        for (reason, expected) in reasons.iter().zip([
            "is not the event id",
            "names aggregate",
            "header Waybill-Event-Type",
            "total_cents -100",
            "for an order whose total is 2500 cents",
        ]) {
            assert!(reason.contains(expected), "{projection}: {reason}");
        }
    }
    assert_eq!(
        balance_of(&pool, "alice").await,
        Some(25),
        "the genuine payment counted"
    );
    assert_eq!(balance_of(&pool, "mallory").await, None);
    let search_pool = projections::schema::connect(&h.url, Search::NAME, Search::TABLES)
        .await
        .expect("pool");
    let found = search::query(&search_pool, "mallory", 10, 0)
        .await
        .expect("query");
    assert!(
        found.is_empty(),
        "mismatched orders are not indexed: {found:?}"
    );
}

/// Finding 5: operators could neither see held orders nor act. Now `held list` says what each waits
/// for, `parked discard` and `held release` act and are recorded with who and why, and `redrive`
/// says why a message failed again.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn operators_see_why_events_wait_and_act_on_them(pool: PgPool) {
    let h = Harness::new(&pool).await;
    let order = new_order();
    h.publish(&envelope(order, 1, &placed("frank", &["HAT:1:700"])))
        .await;
    let forged = envelope(order, 2, &paid(999));
    h.publish(&forged).await;
    h.publish(&envelope(order, 3, &shipped())).await;
    let (code, _) = run_json(&h, INVENTORY, &["--json", "run", "--once"]).await;
    assert_eq!(code, 0);

    let (code, held) = run_json(&h, INVENTORY, &["--json", "held", "list"]).await;
    assert_eq!(code, 0, "{held}");
    assert_eq!(held[0]["version"], 3, "{held}");
    let reason = held[0]["reason"].as_str().unwrap_or_default();
    assert!(
        reason.starts_with(&format!("behind parked event {}", forged.event_id)),
        "{reason}"
    );

    let (code, parked) = run_json(&h, INVENTORY, &["--json", "parked", "list"]).await;
    assert_eq!(code, 0, "{parked}");
    let id = parked[0]["id"].as_i64().expect("id");
    let (code, redriven) = run_json(&h, INVENTORY, &["--json", "redrive"]).await;
    assert_eq!(code, 0, "{redriven}");
    assert_eq!(redriven["redriven"][0]["outcome"], "parked", "{redriven}");
    assert!(
        redriven["redriven"][0]["reason"]
            .as_str()
            .unwrap_or_default()
            .contains("total is 700"),
        "{redriven}"
    );

    let (code, refused) = run_json(
        &h,
        INVENTORY,
        &["--json", "parked", "discard", "999999", "--reason", "typo"],
    )
    .await;
    assert_eq!(code, 2, "an unknown id is refused: {refused}");
    let (code, discarded) = run_json(
        &h,
        INVENTORY,
        &[
            "--json",
            "parked",
            "discard",
            &id.to_string(),
            "--reason",
            "forged payment",
        ],
    )
    .await;
    assert_eq!(code, 0, "{discarded}");
    assert_eq!(discarded["held_behind"], 1, "{discarded}");

    let (code, released) = run_json(
        &h,
        INVENTORY,
        &[
            "--json",
            "held",
            "release",
            &order.as_uuid().to_string(),
            "--reason",
            "payment was forged",
        ],
    )
    .await;
    assert_eq!(code, 0, "{released}");
    assert_eq!(
        (
            released["skipped_from"].as_i64(),
            released["skipped_to"].as_i64(),
            released["applied_through"].as_i64()
        ),
        (Some(2), Some(2), Some(3)),
        "{released}"
    );
    assert_eq!(
        stock_of(&pool, "HAT").await,
        Some((0, 1, 0)),
        "the shipment was applied"
    );

    let log: Vec<(String, String, String)> =
        sqlx::query_as("SELECT actor, action, reason FROM inventory.operator_log ORDER BY id")
            .fetch_all(&pool)
            .await
            .expect("log");
    assert_eq!(
        log,
        vec![
            (
                "test-operator".into(),
                "redrive".into(),
                "redrive from the command line".into()
            ),
            (
                "test-operator".into(),
                "parked discard".into(),
                "forged payment".into()
            ),
            (
                "test-operator".into(),
                "held release".into(),
                "payment was forged".into()
            ),
        ]
    );
    let (code, _) = run_json(
        &h,
        INVENTORY,
        &[
            "--json",
            "held",
            "release",
            &order.as_uuid().to_string(),
            "--reason",
            "again",
        ],
    )
    .await;
    assert_eq!(code, 2, "nothing left to release");
}

/// The operator API of `run --listen` does what `redrive`, `parked discard` and `held release` do, for
/// the console's buttons: absent without an operator token (403), refused without the token (401),
/// recorded with who and why, and refusing what the command line refuses (409, 400).
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn the_operator_api_acts_only_with_its_token(pool: PgPool) {
    const TOKEN: &str = "operator-token-for-the-test";
    let h = Harness::new(&pool).await;
    let order = new_order();
    h.publish(&envelope(order, 1, &placed("hana", &["CAP:1:700"])))
        .await;
    h.publish(&envelope(order, 2, &paid(999))).await;
    h.publish(&envelope(order, 3, &shipped())).await;

    let start = |token: Option<&str>| {
        let listen = format!("127.0.0.1:{}", testkit::free_port().expect("port"));
        let mut command = binary(&h, INVENTORY, &["run", "--listen", &listen]);
        command.env_remove("WAYBILL_OPERATOR_TOKEN");
        if let Some(token) = token {
            command.env("WAYBILL_OPERATOR_TOKEN", token);
        }
        (command.spawn().expect("starts"), format!("http://{listen}"))
    };
    let client = reqwest::Client::new();
    let post = |url: String, token: Option<&str>, body: Option<Value>| {
        let mut request = client.post(url);
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        if let Some(body) = body {
            request = request.json(&body);
        }
        async move {
            let response = request.send().await.expect("answers");
            let status = response.status().as_u16();
            (
                status,
                response.json::<Value>().await.unwrap_or(Value::Null),
            )
        }
    };

    let (mut child, api) = start(None);
    wait_for(&format!("{api}/stock")).await;
    let (status, body) = post(format!("{api}/operator/redrive"), Some(TOKEN), None).await;
    assert_eq!(status, 403, "no token configured, no operator API: {body}");
    child.kill().await.expect("stops");

    let (mut child, api) = start(Some(TOKEN));
    wait_for(&format!("{api}/stock")).await;
    testkit::wait_until(
        Duration::from_secs(60),
        "the forged payment parked",
        || async {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM inventory.parked")
                .fetch_one(&pool)
                .await
                .is_ok_and(|n| n == 1)
        },
    )
    .await;
    let id: i64 = sqlx::query_scalar("SELECT id FROM inventory.parked")
        .fetch_one(&pool)
        .await
        .expect("parked id");
    for token in [None, Some("operator-token-for-the-tesT")] {
        let (status, body) = post(format!("{api}/operator/redrive"), token, None).await;
        assert_eq!(status, 401, "{token:?}: {body}");
    }
    let get = reqwest::get(format!("{api}/operator/redrive"))
        .await
        .expect("answers");
    assert_eq!(get.status().as_u16(), 405);

    let decision = |reason: &str| Some(json!({"by": "ops-http", "reason": reason}));
    let (status, body) = post(format!("{api}/operator/redrive"), Some(TOKEN), None).await;
    assert_eq!(status, 400, "a redrive says who and why: {body}");
    let (status, body) = post(
        format!("{api}/operator/redrive?limit=0"),
        Some(TOKEN),
        decision("x"),
    )
    .await;
    assert_eq!(status, 400, "{body}");
    let (status, redriven) = post(
        format!("{api}/operator/redrive?limit=10"),
        Some(TOKEN),
        decision("after the upgrade"),
    )
    .await;
    assert_eq!(status, 200, "{redriven}");
    assert_eq!(redriven["redriven"][0]["id"], id, "{redriven}");
    assert_eq!(redriven["redriven"][0]["outcome"], "parked", "{redriven}");
    assert_eq!(redriven["open"], 1, "it failed again, so it is still open");
    let (status, body) = post(
        format!("{api}/operator/parked/999999/discard"),
        Some(TOKEN),
        decision("typo"),
    )
    .await;
    assert_eq!(status, 409, "an unknown id is refused: {body}");
    let (status, body) = post(
        format!("{api}/operator/parked/{id}/discard"),
        Some(TOKEN),
        decision(" "),
    )
    .await;
    assert_eq!(status, 400, "a discard needs a reason: {body}");
    let (status, body) = post(
        format!("{api}/operator/parked/{id}/discard"),
        Some(TOKEN),
        Some(json!({"by": "ops-http"})),
    )
    .await;
    assert_eq!(status, 400, "{body}");
    let (status, discarded) = post(
        format!("{api}/operator/parked/{id}/discard"),
        Some(TOKEN),
        decision("forged payment"),
    )
    .await;
    assert_eq!(status, 200, "{discarded}");
    assert_eq!(discarded["held_behind"], 1, "{discarded}");

    let (status, body) = post(
        format!("{api}/operator/held/not-a-uuid/release"),
        Some(TOKEN),
        decision("x"),
    )
    .await;
    assert_eq!(status, 400, "{body}");
    let order_id = order.as_uuid();
    let (status, released) = post(
        format!("{api}/operator/held/{order_id}/release"),
        Some(TOKEN),
        decision("payment was forged"),
    )
    .await;
    assert_eq!(status, 200, "{released}");
    assert_eq!(released["applied_through"], 3, "{released}");
    let (status, body) = post(
        format!("{api}/operator/held/{order_id}/release"),
        Some(TOKEN),
        decision("again"),
    )
    .await;
    assert_eq!(status, 409, "nothing left to release: {body}");
    assert_eq!(stock_of(&pool, "CAP").await, Some((0, 1, 0)), "shipped");

    let log: Vec<(String, String)> =
        sqlx::query_as("SELECT actor, action FROM inventory.operator_log ORDER BY id")
            .fetch_all(&pool)
            .await
            .expect("log");
    assert_eq!(
        log,
        vec![
            ("ops-http".into(), "redrive".into()),
            ("ops-http".into(), "parked discard".into()),
            ("ops-http".into(), "held release".into()),
        ]
    );
    // The console reads the skipped versions from here (waybill's console::readside).
    let skipped: Value = sqlx::query_scalar(
        "SELECT detail->'skipped_versions' FROM inventory.operator_log WHERE action = 'held release'",
    )
    .fetch_one(&pool)
    .await
    .expect("detail");
    assert_eq!(skipped, json!([2, 2]));
    child.kill().await.expect("stops");
}

/// Waits for `url` to answer; a bound of a minute only catches a server that never starts, since a
/// loaded machine can take seconds to start a process and connect it to PostgreSQL and NATS.
async fn wait_for(url: &str) {
    testkit::wait_until(Duration::from_secs(60), url, || async {
        reqwest::get(url).await.is_ok()
    })
    .await;
}

/// Finding 6: the read APIs answer bad input with 400 problems, page every list, and live on their
/// own address, apart from the metrics.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn read_apis_refuse_bad_input_page_and_stand_apart_from_metrics(pool: PgPool) {
    let h = Harness::new(&pool).await;
    for sku in ["AAA", "BBB", "CCC"] {
        h.publish(&envelope(
            new_order(),
            1,
            &placed("gina", &[&format!("{sku}:1:100")]),
        ))
        .await;
    }
    let (read_port, metrics_port) = (
        testkit::free_port().expect("port"),
        testkit::free_port().expect("port"),
    );
    let read_listen = format!("127.0.0.1:{read_port}");
    let metrics_listen = format!("127.0.0.1:{metrics_port}");
    let mut child = binary(
        &h,
        INVENTORY,
        &[
            "run",
            "--listen",
            &read_listen,
            "--metrics-listen",
            &metrics_listen,
        ],
    )
    .spawn()
    .expect("starts");
    let read = format!("http://{read_listen}");
    let metrics = format!("http://{metrics_listen}");
    wait_for(&format!("{read}/stock")).await;
    wait_for(&format!("{metrics}/health")).await;
    // As long as `wait_for`, and a stock never applied fails here rather than in the checks below.
    testkit::wait_until(
        Duration::from_secs(60),
        "the run to apply the CCC order",
        || async { stock_of(&pool, "CCC").await.is_some() },
    )
    .await;

    let get = |url: String| async move {
        let response = reqwest::get(&url).await.expect("answers");
        let status = response.status().as_u16();
        let content_type = response
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        let body: Value = response.json().await.unwrap_or(Value::Null);
        (status, content_type, body)
    };
    for path in [
        "/stock/MU%00G",
        "/stock?cursor=%00",
        "/stock?limit=0",
        "/stock?limit=x",
    ] {
        let (status, content_type, body) = get(format!("{read}{path}")).await;
        assert_eq!(status, 400, "{path}: {body}");
        assert_eq!(content_type, "application/problem+json", "{path}");
        assert_eq!(body["status"], 400, "{path}: {body}");
        assert!(
            body["detail"].as_str().is_some_and(|d| !d.is_empty()),
            "{path}: {body}"
        );
    }
    let (status, content_type, body) = get(format!("{read}/stock/NOPE")).await;
    assert_eq!(
        (status, content_type.as_str()),
        (404, "application/problem+json"),
        "{body}"
    );

    let (status, _, first) = get(format!("{read}/stock?limit=2")).await;
    assert_eq!(status, 200);
    assert_eq!(first["items"].as_array().map(Vec::len), Some(2), "{first}");
    let cursor = first["next_cursor"].as_str().expect("a next page");
    let (_, _, second) = get(format!("{read}/stock?limit=2&cursor={cursor}")).await;
    assert_eq!(second["items"][0]["sku"], "CCC", "{second}");
    assert_eq!(second["next_cursor"], Value::Null, "{second}");

    // Apart: no customer data on the metrics address, no metrics on the read address.
    let (status, _, _) = get(format!("{metrics}/stock")).await;
    assert_eq!(status, 404);
    let (status, _, _) = get(format!("{read}/metrics")).await;
    assert_eq!(status, 404);
    let scrape = reqwest::get(format!("{metrics}/metrics"))
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    assert!(
        scrape.contains("waybill_projection_applied_total"),
        "{scrape}"
    );
    child.kill().await.expect("stops");
}

/// A projection schema laid out by the previous version (parked headers as `jsonb`, no held table) is
/// refused with the way out named, and `rebuild` replaces it.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_schema_of_an_older_layout_is_refused_until_rebuilt(pool: PgPool) {
    let h = Harness::new(&pool).await;
    sqlx::raw_sql(
        "CREATE SCHEMA inventory;
         CREATE TABLE inventory.checkpoints (aggregate_id UUID PRIMARY KEY, version BIGINT NOT NULL,
                                             event_id UUID NOT NULL, updated_at TIMESTAMPTZ);
         CREATE TABLE inventory.parked (id BIGINT, subject TEXT, headers JSONB, body BYTEA, reason TEXT);",
    )
    .execute(&pool)
    .await
    .expect("old layout");
    h.publish(&envelope(new_order(), 1, &placed("ivan", &["OLD:1:100"])))
        .await;
    let (code, out) = run_json(&h, INVENTORY, &["--json", "run", "--once"]).await;
    assert_eq!(code, 1, "{out}");
    let message = out["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("older waybill") && message.contains("rebuild"),
        "{out}"
    );
    let (code, out) = run_json(&h, INVENTORY, &["--json", "rebuild"]).await;
    assert_eq!(code, 0, "{out}");
    assert_eq!(stock_of(&pool, "OLD").await, Some((1, 0, 0)));
}

/// A database failure behind a read API is a 503 problem (logged), not an empty body.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_failing_database_is_a_503_problem(pool: PgPool) {
    let h = Harness::new(&pool).await;
    let runner = h.runner(Points, h.config()).await;
    let bound = ops::serve(
        "127.0.0.1:0".parse().expect("address"),
        projections::points::routes(runner.pool().clone()),
        std::future::pending(),
    )
    .await
    .expect("serves");
    sqlx::query("DROP TABLE points.balances")
        .execute(&pool)
        .await
        .expect("drop");
    let response = reqwest::get(format!("http://{bound}/customers"))
        .await
        .expect("answers");
    assert_eq!(response.status().as_u16(), 503);
    assert_eq!(
        response
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok()),
        Some("application/problem+json")
    );
    let body: Value = response.json().await.expect("json");
    assert_eq!(body["status"], 503, "{body}");
    assert!(
        body["detail"]
            .as_str()
            .is_some_and(|d| d.contains("reading balances")),
        "{body}"
    );
}

/// A `run` process keeps consuming through a rebuild's swap: afterwards it applies new events to the
/// rebuilt state, and nothing is counted twice.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_live_run_continues_on_the_rebuilt_state(pool: PgPool) {
    let h = Harness::new(&pool).await;
    h.publish(&envelope(new_order(), 1, &placed("judy", &["KEY:2:100"])))
        .await;
    let mut live = binary(&h, INVENTORY, &["run"]).spawn().expect("starts");
    let wait_for_stock = |sku: &'static str, want: (i64, i64, i64)| {
        let pool = pool.clone();
        async move {
            // A minute: only a run that stopped applying reaches it, not a slow one.
            let what = format!("{sku} to reach {want:?}");
            testkit::wait_until(Duration::from_secs(60), &what, || async {
                stock_of(&pool, sku).await == Some(want)
            })
            .await;
        }
    };
    wait_for_stock("KEY", (2, 0, 0)).await;

    let (code, out) = run_json(&h, INVENTORY, &["--json", "rebuild"]).await;
    assert_eq!(code, 0, "{out}");
    assert_eq!(
        stock_of(&pool, "KEY").await,
        Some((2, 0, 0)),
        "rebuilt, not doubled"
    );

    h.publish(&envelope(new_order(), 1, &placed("judy", &["KEY:1:100"])))
        .await;
    wait_for_stock("KEY", (3, 0, 0)).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        stock_of(&pool, "KEY").await,
        Some((3, 0, 0)),
        "nothing applied twice"
    );
    assert!(
        live.try_wait().expect("status").is_none(),
        "the live run is still running"
    );
    live.kill().await.expect("stops");
}

/// The search index's pending list made the largest stalls of the pipeline benchmark: the insert that
/// found it full merged all of it inside its own batch (~150 ms). Documents now go into the index at
/// once — also in an index created before, which starting the projection switches over.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn the_search_index_takes_each_document_at_once(pool: PgPool) {
    let url = testkit::database_url(&pool).await;
    let options = || async {
        sqlx::query_scalar::<_, Option<Vec<String>>>(
            "SELECT reloptions FROM pg_class WHERE oid = 'search.orders_document'::regclass",
        )
        .fetch_one(&pool)
        .await
        .expect("the index")
        .unwrap_or_default()
    };
    projections::schema::connect(&url, Search::NAME, Search::TABLES)
        .await
        .expect("schema");
    assert_eq!(options().await, ["fastupdate=off"], "a new index");
    // As an older version left it.
    sqlx::query("ALTER INDEX search.orders_document RESET (fastupdate)")
        .execute(&pool)
        .await
        .expect("reset");
    assert!(options().await.is_empty());
    projections::schema::connect(&url, Search::NAME, Search::TABLES)
        .await
        .expect("schema again");
    assert_eq!(options().await, ["fastupdate=off"], "an index made before");
}
