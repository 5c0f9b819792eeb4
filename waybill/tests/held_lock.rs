//! One order locked by another database session while clients keep sending commands for it, over a
//! real `waybill serve`: the other orders keep their latency and their rate, the locked order's
//! callers are told it is locked (503 with `Retry-After`) within the lock timeout, and nothing is
//! written twice.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use reqwest::{Client, StatusCode};
use serde_json::{Value, json};
use sqlx::PgPool;

mod common;

use common::Service;

/// Clients placing and paying new orders, one request at a time each.
const UNRELATED_CLIENTS: usize = 4;
/// Clients paying the locked order over and over.
const LOCKED_CLIENTS: usize = 2;
/// `waybill serve`'s `lock_timeout`: how long a statement waits for another transaction's lock.
const LOCK_TIMEOUT: Duration = Duration::from_secs(2);

/// What the unrelated clients saw in one phase.
#[derive(Debug, Default)]
struct Phase {
    latencies_ms: Vec<u64>,
    placed: i64,
    paid: i64,
    failures: Vec<String>,
    elapsed: Duration,
}

impl Phase {
    fn rate(&self) -> f64 {
        self.latencies_ms.len() as f64 / self.elapsed.as_secs_f64()
    }

    fn quantile(&self, q: f64) -> u64 {
        let mut sorted = self.latencies_ms.clone();
        sorted.sort_unstable();
        testkit::stats::quantile(&sorted, q)
    }

    fn summary(&self) -> String {
        format!(
            "{} requests in {:.1} s ({:.0}/s), p50 {} ms, p99 {} ms, max {} ms",
            self.latencies_ms.len(),
            self.elapsed.as_secs_f64(),
            self.rate(),
            self.quantile(0.5),
            self.quantile(0.99),
            self.quantile(1.0)
        )
    }
}

fn line() -> Value {
    json!([{"sku": "MUG", "quantity": 1, "unit_price_cents": 900}])
}

/// Places and pays new orders from [`UNRELATED_CLIENTS`] clients for `length`.
async fn unrelated_orders(client: &Client, base: &str, length: Duration) -> Phase {
    let started = Instant::now();
    let until = started + length;
    let clients = (0..UNRELATED_CLIENTS).map(|_| {
        let (client, base) = (client.clone(), base.to_owned());
        tokio::spawn(async move {
            let mut phase = Phase::default();
            while Instant::now() < until {
                let sent = Instant::now();
                let placed = client
                    .post(format!("{base}/orders"))
                    .json(&json!({"customer_id": "bob", "currency": "EUR", "lines": line()}))
                    .send()
                    .await
                    .expect("place");
                phase
                    .latencies_ms
                    .push(u64::try_from(sent.elapsed().as_millis()).expect("in range"));
                if placed.status() != StatusCode::CREATED {
                    phase.failures.push(format!("place: {}", placed.status()));
                    continue;
                }
                phase.placed += 1;
                let body: Value = placed.json().await.expect("json");
                let id = body["order_id"].as_str().expect("order_id").to_owned();
                let sent = Instant::now();
                let paid = client
                    .post(format!("{base}/orders/{id}/pay"))
                    .json(&json!({"amount_cents": 900}))
                    .send()
                    .await
                    .expect("pay");
                phase
                    .latencies_ms
                    .push(u64::try_from(sent.elapsed().as_millis()).expect("in range"));
                if paid.status() == StatusCode::OK {
                    phase.paid += 1;
                } else {
                    phase.failures.push(format!("pay: {}", paid.status()));
                }
            }
            phase
        })
    });
    let mut all = Phase::default();
    for client in futures::future::join_all(clients).await {
        let phase = client.expect("client");
        all.latencies_ms.extend(phase.latencies_ms);
        all.failures.extend(phase.failures);
        all.placed += phase.placed;
        all.paid += phase.paid;
    }
    all.elapsed = started.elapsed();
    all
}

/// One answer a client paying the locked order got.
#[derive(Debug)]
struct LockedAnswer {
    status: StatusCode,
    retry_after: Option<String>,
    content_type: Option<String>,
    detail: String,
    elapsed: Duration,
}

/// Pays `order` over and over from [`LOCKED_CLIENTS`] clients until `stop`.
fn pay_locked_order(
    client: &Client,
    base: &str,
    order: &str,
    stop: &Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<Vec<LockedAnswer>>> {
    (0..LOCKED_CLIENTS)
        .map(|_| {
            let (client, url, stop) = (
                client.clone(),
                format!("{base}/orders/{order}/pay"),
                stop.clone(),
            );
            tokio::spawn(async move {
                let mut answers = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    let sent = Instant::now();
                    let response = client
                        .post(&url)
                        .json(&json!({"amount_cents": 900}))
                        .send()
                        .await
                        .expect("pay the locked order");
                    let header = |name: &str| {
                        response
                            .headers()
                            .get(name)
                            .and_then(|v| v.to_str().ok())
                            .map(str::to_owned)
                    };
                    let (status, retry_after, content_type) = (
                        response.status(),
                        header("retry-after"),
                        header("content-type"),
                    );
                    let body: Value = response.json().await.unwrap_or_default();
                    answers.push(LockedAnswer {
                        status,
                        retry_after,
                        content_type,
                        detail: body["detail"].as_str().unwrap_or("").to_owned(),
                        elapsed: sent.elapsed(),
                    });
                }
                answers
            })
        })
        .collect()
}

/// The value of the series `name` (with its labels, as printed) in a Prometheus scrape.
fn metric(scraped: &str, name: &str) -> Option<f64> {
    scraped
        .lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|value| value.trim().parse().ok())
}

async fn count(pool: &PgPool, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql)
        .fetch_one(pool)
        .await
        .expect("count")
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_lock_on_one_order_delays_only_that_orders_commands(pool: PgPool) {
    let s = Service::start_with(&pool, &[]).await;
    let client = Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("client");
    let placed = client
        .post(format!("{}/orders", s.base))
        .json(&json!({"customer_id": "alice", "currency": "EUR", "lines": line()}))
        .send()
        .await
        .expect("place");
    assert_eq!(placed.status(), StatusCode::CREATED);
    let body: Value = placed.json().await.expect("json");
    let locked = body["order_id"].as_str().expect("order_id").to_owned();

    let warm_up = unrelated_orders(&client, &s.base, Duration::from_secs(1)).await;
    let baseline = unrelated_orders(&client, &s.base, Duration::from_secs(4)).await;
    eprintln!("baseline: {}", baseline.summary());

    // Another session writes the locked order's next version and neither commits nor rolls back: a
    // writer frozen mid-transaction, as another instance of the service would be.
    let mut other = pool.begin().await.expect("begin");
    sqlx::query(
        "INSERT INTO events (event_id, event_type, event_version, aggregate_type, aggregate_id,
                             aggregate_version, occurred_at, payload)
         VALUES (gen_random_uuid(), 'order.paid', 1, 'order', $1::uuid, 2, now(), '{}')",
    )
    .bind(&locked)
    .execute(&mut *other)
    .await
    .expect("the other session's uncommitted row");
    let stop = Arc::new(AtomicBool::new(false));
    let payers = pay_locked_order(&client, &s.base, &locked, &stop);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let during = unrelated_orders(&client, &s.base, Duration::from_secs(6)).await;
    eprintln!("one order locked: {}", during.summary());
    stop.store(true, Ordering::Relaxed);
    let mut answers = Vec::new();
    for payer in payers {
        answers.extend(payer.await.expect("payer"));
    }
    other.rollback().await.expect("rollback");
    // The baseline again once the lock is gone: the machine is shared and its speed drifts, so the
    // throughput is compared with the mean of the phases before and after.
    let after = unrelated_orders(&client, &s.base, Duration::from_secs(3)).await;
    eprintln!("baseline after: {}", after.summary());
    let baseline_rate = (baseline.rate() + after.rate()) / 2.0;

    assert!(
        baseline.failures.is_empty() && during.failures.is_empty() && after.failures.is_empty(),
        "unrelated orders failed: {:?} {:?} {:?}",
        baseline.failures,
        during.failures,
        after.failures
    );
    assert!(
        during.quantile(0.99) < 250,
        "unrelated orders while one is locked: {} (baseline: {})",
        during.summary(),
        baseline.summary()
    );
    assert!(
        during.rate() >= 0.5 * baseline_rate,
        "unrelated orders while one is locked: {} (baseline before: {}, after: {})",
        during.summary(),
        baseline.summary(),
        after.summary()
    );

    assert!(
        answers.len() >= LOCKED_CLIENTS,
        "every payer got an answer: {answers:?}"
    );
    for answer in &answers {
        assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE, "{answer:?}");
        assert!(answer.retry_after.is_some(), "{answer:?}");
        assert_eq!(
            answer.content_type.as_deref(),
            Some("application/problem+json"),
            "{answer:?}"
        );
        assert!(answer.detail.contains("locked"), "{answer:?}");
        assert!(
            answer.elapsed <= LOCK_TIMEOUT + Duration::from_secs(1),
            "answered within the lock timeout: {answer:?}"
        );
    }
    eprintln!(
        "locked order: {} answers, slowest {:?}",
        answers.len(),
        answers.iter().map(|a| a.elapsed).max()
    );

    // Every refusal counted, and the group that met the lock said so.
    let scraped = client
        .get(format!("{}/metrics", s.metrics))
        .send()
        .await
        .expect("scrape")
        .text()
        .await
        .expect("text");
    assert_eq!(
        metric(&scraped, "waybill_appends_locked_total"),
        Some(answers.len() as f64),
        "{scraped}"
    );
    assert!(
        metric(
            &scraped,
            "waybill_group_commit_groups_total{outcome=\"lock_wait\"}"
        )
        .is_some_and(|groups| groups >= 1.0),
        "{scraped}"
    );

    // The lock gone, the order is paid at once.
    let paid = client
        .post(format!("{}/orders/{locked}/pay", s.base))
        .json(&json!({"amount_cents": 900}))
        .send()
        .await
        .expect("pay");
    assert_eq!(paid.status(), StatusCode::OK);

    // Nothing written twice: every order placed once and paid once, one outbox row per event.
    let placed = 1 + warm_up.placed + baseline.placed + during.placed + after.placed;
    let paid = 1 + warm_up.paid + baseline.paid + during.paid + after.paid;
    assert_eq!(
        count(&pool, "SELECT count(*) FROM events").await,
        placed + paid
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM outbox").await,
        placed + paid
    );
    assert_eq!(
        count(&pool, "SELECT count(DISTINCT aggregate_id) FROM events").await,
        placed
    );
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM (SELECT aggregate_id FROM events GROUP BY aggregate_id
                                   HAVING count(*) <> 2) AS odd"
        )
        .await,
        0,
        "every order was placed and paid exactly once"
    );
}
