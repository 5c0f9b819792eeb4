//! The command side: orders placed per second through the event store at 1, 4 and 16 concurrent
//! writers — with group commit, as `waybill serve` writes — beside a plain two-row transaction (one `events` row, one `outbox` row) on the same pool,
//! alternating which goes first round by round so that a drift in machine load favours neither. The
//! ratio is the figure; absolute rates depend on the machine.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use domain::{Currency, CustomerId, OrderCommand, OrderId, OrderLine, PlaceOrder};
use serde::Serialize;
use serde_json::json;
use sqlx::PgPool;
use store::{CommandContext, EventStore, GroupCommit};
use testkit::stats::{median, percentiles};
use uuid::Uuid;

use super::{Profile, Progress};
use crate::demo::services::Services;

const DATABASE: &str = "waybill_bench_commands";

/// Concurrency levels measured.
pub(super) const WRITERS: [usize; 3] = [1, 4, 16];

/// The figures at one concurrency level.
#[derive(Debug, Clone, Serialize)]
pub(super) struct WriterFigures {
    /// Median of the per-round ratios, store ÷ plain transaction.
    pub ratio: f64,
    /// Orders per second through the store (median).
    pub store_per_s: f64,
    /// Plain two-row transactions per second (median).
    pub plain_per_s: f64,
    /// Each round's ratio.
    pub ratios: Vec<f64>,
    /// Latency of one store command over all rounds, µs.
    pub store_p50_us: u64,
    /// Its 99th percentile, µs.
    pub store_p99_us: u64,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Mode {
    Store,
    PlainTransaction,
}

/// One measurement: throughput and every command's latency.
struct Sample {
    per_second: f64,
    latencies_us: Vec<u64>,
}

/// Measures every concurrency level, in a fresh database `waybill_bench_commands`.
pub(super) async fn measure(
    services: &Services,
    profile: &Profile,
    progress: &Progress,
) -> anyhow::Result<Vec<(usize, WriterFigures)>> {
    // A fresh database each run: events are immutable, so an old one only grows.
    let url = services.database_url(DATABASE);
    crate::demo::fresh_database(services, DATABASE, &url)
        .await?
        .close()
        .await;
    let pool =
        ops::database::connect(&url, "waybill-bench", u32::try_from(WRITERS[2])? + 2).await?;
    let duration = Duration::from_secs_f64(profile.writer_seconds);
    let mut figures = Vec::new();
    for writers in WRITERS {
        let (mut store_runs, mut plain_runs) = (Vec::new(), Vec::new());
        for round in 0..profile.rounds {
            let order = if round % 2 == 0 {
                [Mode::Store, Mode::PlainTransaction]
            } else {
                [Mode::PlainTransaction, Mode::Store]
            };
            for mode in order {
                let sample = run_writers(&pool, mode, writers, duration).await?;
                match mode {
                    Mode::Store => store_runs.push(sample),
                    Mode::PlainTransaction => plain_runs.push(sample),
                }
            }
        }
        let ratios: Vec<f64> = store_runs
            .iter()
            .zip(&plain_runs)
            .map(|(s, p)| s.per_second / p.per_second)
            .collect();
        let latencies = percentiles(
            store_runs
                .iter()
                .flat_map(|s| s.latencies_us.iter().copied())
                .collect(),
        );
        let row = WriterFigures {
            ratio: median(ratios.clone()),
            store_per_s: median(store_runs.iter().map(|s| s.per_second).collect()),
            plain_per_s: median(plain_runs.iter().map(|s| s.per_second).collect()),
            ratios,
            store_p50_us: latencies.p50,
            store_p99_us: latencies.p99,
        };
        progress.say(&format!(
            "writers {writers}: store {:.0} orders/s, plain transaction {:.0}/s, ratio {:.2}",
            row.store_per_s, row.plain_per_s, row.ratio
        ));
        figures.push((writers, row));
    }
    pool.close().await;
    Ok(figures)
}

async fn run_writers(
    pool: &PgPool,
    mode: Mode,
    writers: usize,
    duration: Duration,
) -> anyhow::Result<Sample> {
    let stop = Arc::new(AtomicBool::new(false));
    let store = EventStore::new(pool.clone()).with_group_commit(GroupCommit::spawn(
        pool.clone(),
        GroupCommit::DEFAULT_WRITERS.into(),
    ));
    let command = OrderCommand::Place(PlaceOrder {
        customer_id: CustomerId::parse("bench")?,
        currency: Currency::parse("EUR")?,
        channel: domain::Channel::Web,
        lines: vec![
            OrderLine::parse("MUG-BLUE:2:1250")?,
            OrderLine::parse("TEA:1:500")?,
        ],
    });
    let started = Instant::now();
    let tasks: Vec<_> = (0..writers)
        .map(|_| {
            let (stop, store, command, pool) =
                (stop.clone(), store.clone(), command.clone(), pool.clone());
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    let t = Instant::now();
                    match mode {
                        Mode::Store => {
                            let id = OrderId::from_uuid(Uuid::now_v7());
                            store
                                .execute(id, &command, &CommandContext::default())
                                .await?;
                        }
                        Mode::PlainTransaction => plain_transaction(&pool).await?,
                    }
                    latencies.push(u64::try_from(t.elapsed().as_micros()).unwrap_or(u64::MAX));
                }
                anyhow::Ok(latencies)
            })
        })
        .collect();
    tokio::time::sleep(duration).await;
    stop.store(true, Ordering::Relaxed);
    let mut latencies_us = Vec::new();
    for task in tasks {
        latencies_us.extend(task.await??);
    }
    let elapsed = started.elapsed().as_secs_f64();
    Ok(Sample {
        per_second: latencies_us.len() as f64 / elapsed,
        latencies_us,
    })
}

/// The baseline: the same two rows (the event, and its outbox row with the same body), written by a
/// plain transaction with no domain logic or checks.
async fn plain_transaction(pool: &PgPool) -> anyhow::Result<()> {
    let (event_id, aggregate_id) = (Uuid::now_v7(), Uuid::now_v7());
    let payload = json!({"customer_id": "bench", "currency": "EUR", "channel": "web", "lines": [
        {"sku": "MUG-BLUE", "quantity": 2, "unit_price_cents": 1250},
        {"sku": "TEA", "quantity": 1, "unit_price_cents": 500}], "total_cents": 3000});
    let body = json!({"event_id": event_id, "event_type": "order.placed", "event_version": 3,
        "aggregate_type": "order", "aggregate_id": aggregate_id, "aggregate_version": 1,
        "occurred_at": chrono::Utc::now(), "correlation_id": null, "causation_id": null, "payload": payload})
    .to_string();
    let mut tx = pool.begin().await?;
    sqlx::query(
        "INSERT INTO events (event_id, event_type, event_version, aggregate_type, aggregate_id,
                             aggregate_version, occurred_at, payload)
         VALUES ($1, 'order.placed', 3, 'order', $2, 1, now(), $3)",
    )
    .bind(event_id)
    .bind(aggregate_id)
    .bind(&payload)
    .execute(&mut *tx)
    .await?;
    store::outbox::fixtures::insert_plain(
        &mut tx,
        event_id,
        "order.placed",
        3,
        aggregate_id,
        1,
        &body,
    )
    .await?;
    tx.commit().await?;
    Ok(())
}
