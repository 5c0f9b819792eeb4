//! Projection apply rate: events/s per projection from a stream pre-filled with `--events` events,
//! batched (one transaction per batch) beside one transaction per event, in the same run.
//!
//! Run: `cargo bench -p projections --bench apply -- [--events 100000] [--rounds 3] [--per-event-seconds 10]`
//!
//! Orders are placed, paid, then shipped or cancelled (3 events each). Uses `DATABASE_URL`'s server
//! (database `waybill_bench_projections`) and `NATS_URL` (stream `BENCH_PROJECTIONS`, refilled each run).

use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use async_nats::jetstream;
use clap::Parser;
use domain::{EventEnvelope, EventMeta, OrderEvent, OrderId};
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use ops::stats::median;
use projections::{Inventory, Points, Projection, Runner, RunnerConfig, Search};
use relay::StreamSettings;
use serde_json::json;
use uuid::Uuid;

const STREAM: &str = "BENCH_PROJECTIONS";
const PREFIX: &str = "benchproj.events";

#[derive(Debug, Parser)]
struct Args {
    /// Events in the stream.
    #[arg(long, default_value_t = 100_000)]
    events: usize,
    /// Rounds per (projection, mode); medians are reported.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// The one-transaction-per-event mode is slow: it runs this long instead of to the end.
    #[arg(long, default_value_t = 10.0)]
    per_event_seconds: f64,
    /// Messages per batch in the batched mode.
    #[arg(long, default_value_t = 500)]
    batch_size: usize,
    /// Which projections to measure.
    #[arg(long, value_delimiter = ',', default_value = "inventory,points,search")]
    projections: Vec<String>,
    /// Print one JSON document at the end.
    #[arg(long)]
    json: bool,
    /// Accepted for `cargo bench` compatibility.
    #[arg(long, hide = true)]
    bench: bool,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let base = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://127.0.0.1:5432/waybill".into());
    let url = store::with_database(&base, "waybill_bench_projections");
    let nats_url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let js = jetstream::new(async_nats::connect(&nats_url).await?);
    let _ = js.delete_stream(STREAM).await;
    let settings = StreamSettings {
        name: STREAM.into(),
        subject_prefix: PREFIX.into(),
        ..StreamSettings::default()
    };
    relay::ensure_stream(&js, &settings, true).await?;
    let started = Instant::now();
    fill_stream(&js, args.events).await?;
    eprintln!(
        "stream filled with {} events in {:.1?}",
        args.events,
        started.elapsed()
    );

    let mut results = Vec::new();
    let wanted = |name: &str| args.projections.iter().any(|p| p == name);
    if wanted(Inventory::NAME) {
        results.push(measure(Inventory, &args, &url, &nats_url).await?);
    }
    if wanted(Points::NAME) {
        results.push(measure(Points, &args, &url, &nats_url).await?);
    }
    if wanted(Search::NAME) {
        results.push(measure(Search, &args, &url, &nats_url).await?);
    }
    js.delete_stream(STREAM).await?;

    if args.json {
        println!(
            "{}",
            json!({"events": args.events, "rounds": args.rounds, "results": results})
        );
    } else {
        println!(
            "apply rate from a stream of {} events (medians of {} rounds):",
            args.events, args.rounds
        );
        println!(
            "{:<10} {:>16} {:>20} {:>8}",
            "projection", "batched ev/s", "one tx per event/s", "ratio"
        );
        for r in &results {
            println!(
                "{:<10} {:>16.0} {:>20.0} {:>8.1}",
                r["projection"].as_str().unwrap_or_default(),
                r["batched_events_per_s"].as_f64().unwrap_or_default(),
                r["per_event_events_per_s"].as_f64().unwrap_or_default(),
                r["ratio"].as_f64().unwrap_or_default()
            );
        }
    }
    Ok(())
}

/// Batched and per-event rates of one projection, alternating the modes round by round.
async fn measure<P: Projection + Clone>(
    projection: P,
    args: &Args,
    url: &str,
    nats_url: &str,
) -> anyhow::Result<serde_json::Value> {
    let mut batched = Vec::new();
    let mut per_event = Vec::new();
    for round in 1..=args.rounds {
        for batch_size in [args.batch_size, 1] {
            let config = RunnerConfig {
                stream: STREAM.into(),
                subject_prefix: PREFIX.into(),
                batch_size,
                ..RunnerConfig::default()
            };
            let runner = Runner::connect(projection.clone(), url, nats_url, config).await?;
            runner.reset().await?;
            let started = Instant::now();
            // The clock stops at the last applied event, not when `--once` notices it is idle.
            let mut last_applied = started;
            let mut seen = 0;
            let mut note = |tally: &projections::Tally| {
                if tally.applied > seen {
                    seen = tally.applied;
                    last_applied = Instant::now();
                }
            };
            let tally = if batch_size == 1 {
                let stop = tokio::time::sleep(Duration::from_secs_f64(args.per_event_seconds));
                runner.run(stop, false, &mut note).await?
            } else {
                runner.run(std::future::pending(), true, &mut note).await?
            };
            let rate = tally.applied as f64 / (last_applied - started).as_secs_f64().max(1e-6);
            eprintln!(
                "round {round}: {} with batches of {batch_size}: {rate:.0} events/s ({} applied)",
                P::NAME,
                tally.applied
            );
            if batch_size == 1 {
                per_event.push(rate);
            } else {
                anyhow::ensure!(
                    tally.applied as usize == args.events,
                    "applied {} of {}",
                    tally.applied,
                    args.events
                );
                batched.push(rate);
            }
        }
    }
    let ratios: Vec<f64> = batched.iter().zip(&per_event).map(|(b, p)| b / p).collect();
    Ok(json!({
        "projection": P::NAME,
        "batched_events_per_s": median(batched.clone()),
        "per_event_events_per_s": median(per_event.clone()),
        "ratio": median(ratios),
        "runs": {"batched": batched, "per_event": per_event},
    }))
}

/// Publishes `events` events: orders placed, paid, then shipped (two in three) or cancelled.
async fn fill_stream(js: &jetstream::Context, events: usize) -> anyhow::Result<()> {
    let mut acks = FuturesUnordered::new();
    let orders = events.div_ceil(3);
    let mut published = 0;
    'orders: for i in 0..orders {
        let order = OrderId::from_uuid(Uuid::now_v7());
        let placed = domain::Order::new(order)
            .decide(&testkit::place(
                &format!("customer-{}", i % 1000),
                &[&format!("SKU-{}:{}:{}", i % 200, 1 + i % 3, 100 + i % 900)],
            ))?
            .remove(0);
        let OrderEvent::Placed(p) = &placed else {
            anyhow::bail!("not placed")
        };
        let paid = OrderEvent::Paid(domain::OrderPaid {
            amount_cents: domain::Cents::new(p.total_cents)?,
            payment_ref: None,
        });
        let last = if i % 3 == 2 {
            OrderEvent::Cancelled(domain::OrderCancelled {
                reason: domain::Note::parse("bench")?,
            })
        } else {
            OrderEvent::Shipped(domain::OrderShipped {
                carrier: domain::Note::parse("DHL")?,
                tracking_number: domain::Note::parse("T")?,
            })
        };
        for (version, event) in [placed, paid, last].iter().enumerate() {
            if published == events {
                break 'orders;
            }
            let meta = EventMeta {
                event_id: Uuid::now_v7(),
                occurred_at: chrono::Utc::now(),
                correlation_id: None,
                causation_id: None,
            };
            let envelope = EventEnvelope::wrap(event, order, version as i64 + 1, meta);
            let mut headers = HeaderMap::new();
            headers.insert("Nats-Msg-Id", envelope.event_id.to_string().as_str());
            let subject = domain::wire::subject(PREFIX, &envelope).map_err(anyhow::Error::msg)?;
            acks.push(
                js.publish_with_headers(subject, headers, envelope.to_json().into())
                    .await?
                    .into_future(),
            );
            published += 1;
            while acks.len() > 2000 {
                if let Some(ack) = acks.next().await {
                    ack?;
                }
            }
        }
    }
    while let Some(ack) = acks.next().await {
        ack?;
    }
    Ok(())
}
