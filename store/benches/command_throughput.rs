//! Command-side throughput: orders placed per second through the event store at 1, 4 and 16 concurrent
//! writers, beside a plain two-row insert transaction (one `events` row, one `outbox` row) on the same
//! pool in the same run. The ratio between the two is the figure; absolute rates depend on the machine.
//!
//! Run: `cargo bench -p store --bench command_throughput -- [--seconds 3] [--rounds 5] [--json]`
//! (uses `DATABASE_URL`'s server, default `postgres://127.0.0.1:5432/waybill`, in a scratch database).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use domain::{Currency, CustomerId, OrderCommand, OrderId, OrderLine, PlaceOrder};
use serde_json::json;
use sqlx::PgPool;
use store::{CommandContext, EventStore};
use testkit::stats::{median, percentiles, resident_kib};
use uuid::Uuid;

#[derive(Debug, Parser)]
struct Args {
    /// Seconds per measurement.
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Rounds per (mode, concurrency); the median is reported.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Concurrency levels.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    writers: Vec<usize>,
    /// Print one JSON document instead of a table.
    #[arg(long)]
    json: bool,
    /// Accepted for `cargo bench` compatibility.
    #[arg(long, hide = true)]
    bench: bool,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Mode {
    Store,
    PlainInsert,
}

struct Sample {
    per_second: f64,
    latencies_us: Vec<u64>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let base = std::env::var("DATABASE_URL").unwrap_or_else(|_| ops::DEFAULT_DATABASE_URL.into());
    let url = ops::database::with_database(&base, "waybill_bench_commands");
    ops::database::ensure_database(&url).await?;
    let max_writers = args.writers.iter().copied().max().unwrap_or(1) as u32;
    let pool = ops::database::connect(&url, "waybill-bench", max_writers + 2).await?;
    store::migrate(&pool).await?;

    let mut report = Vec::new();
    for &writers in &args.writers {
        let (mut store_runs, mut plain_runs) = (Vec::new(), Vec::new());
        for round in 0..args.rounds {
            // Alternate which mode goes first, so a drift in machine load does not favour one of them.
            let order = if round % 2 == 0 {
                [Mode::Store, Mode::PlainInsert]
            } else {
                [Mode::PlainInsert, Mode::Store]
            };
            for mode in order {
                let sample =
                    measure(&pool, mode, writers, Duration::from_secs_f64(args.seconds)).await?;
                match mode {
                    Mode::Store => store_runs.push(sample),
                    Mode::PlainInsert => plain_runs.push(sample),
                }
            }
            eprintln!("writers={writers} round {}/{} done", round + 1, args.rounds);
        }
        let ratios: Vec<f64> = store_runs
            .iter()
            .zip(&plain_runs)
            .map(|(s, p)| s.per_second / p.per_second)
            .collect();
        report.push(json!({
            "writers": writers,
            "store_orders_per_s": median(store_runs.iter().map(|s| s.per_second).collect()),
            "plain_tx_per_s": median(plain_runs.iter().map(|s| s.per_second).collect()),
            "ratio_median": median(ratios.clone()),
            "ratios": ratios,
            "store_latency_us": percentiles(store_runs.iter().flat_map(|s| s.latencies_us.iter().copied()).collect()),
            "plain_latency_us": percentiles(plain_runs.iter().flat_map(|s| s.latencies_us.iter().copied()).collect()),
        }));
    }
    let rss_kib = resident_kib(None);
    if args.json {
        println!(
            "{}",
            json!({"rounds": args.rounds, "seconds": args.seconds, "results": report, "rss_kib": rss_kib})
        );
    } else {
        println!(
            "{:>7} {:>14} {:>14} {:>7} {:>22} {:>22}",
            "writers",
            "store orders/s",
            "plain tx/s",
            "ratio",
            "store p50/p99 µs",
            "plain p50/p99 µs"
        );
        for row in &report {
            println!(
                "{:>7} {:>14.0} {:>14.0} {:>7.2} {:>22} {:>22}",
                row["writers"],
                row["store_orders_per_s"].as_f64().unwrap_or_default(),
                row["plain_tx_per_s"].as_f64().unwrap_or_default(),
                row["ratio_median"].as_f64().unwrap_or_default(),
                format!(
                    "{}/{}",
                    row["store_latency_us"]["p50"], row["store_latency_us"]["p99"]
                ),
                format!(
                    "{}/{}",
                    row["plain_latency_us"]["p50"], row["plain_latency_us"]["p99"]
                ),
            );
        }
        println!(
            "medians of {} rounds of {}s; benchmark process RSS {} KiB",
            args.rounds, args.seconds, rss_kib
        );
    }
    pool.close().await;
    Ok(())
}

async fn measure(
    pool: &PgPool,
    mode: Mode,
    writers: usize,
    duration: Duration,
) -> anyhow::Result<Sample> {
    let stop = Arc::new(AtomicBool::new(false));
    let store = EventStore::new(pool.clone());
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
                        Mode::PlainInsert => plain_insert(&pool).await?,
                    }
                    latencies.push(t.elapsed().as_micros() as u64);
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
async fn plain_insert(pool: &PgPool) -> anyhow::Result<()> {
    let (event_id, aggregate_id) = (Uuid::now_v7(), Uuid::now_v7());
    let payload = json!({"customer_id": "bench", "currency": "EUR", "lines": [
        {"sku": "MUG-BLUE", "quantity": 2, "unit_price_cents": 1250},
        {"sku": "TEA", "quantity": 1, "unit_price_cents": 500}], "total_cents": 3000});
    let body = json!({"event_id": event_id, "event_type": "order.placed", "event_version": 2,
        "aggregate_type": "order", "aggregate_id": aggregate_id, "aggregate_version": 1,
        "occurred_at": chrono::Utc::now(), "correlation_id": null, "causation_id": null, "payload": payload})
    .to_string();
    let mut tx = pool.begin().await?;
    sqlx::query(
        "INSERT INTO events (event_id, event_type, event_version, aggregate_type, aggregate_id,
                             aggregate_version, occurred_at, payload)
         VALUES ($1, 'order.placed', 2, 'order', $2, 1, now(), $3)",
    )
    .bind(event_id)
    .bind(aggregate_id)
    .bind(&payload)
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        "INSERT INTO outbox (event_id, event_type, event_version, aggregate_id, aggregate_version, body)
         VALUES ($1, 'order.placed', 2, $2, 1, $3)",
    )
    .bind(event_id)
    .bind(aggregate_id)
    .bind(&body)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(())
}
