//! Projection apply rate: events/s per projection from a stream pre-filled with `--events` events,
//! batched (one transaction per batch) beside one transaction per event, in the same run; then the
//! rate of the same real events from a second stream where `--gaps` unfillable gaps (`order.paid`
//! version 2 of orders whose version 1 never comes) are spread among them.
//!
//! Run: `cargo bench -p projections --bench apply -- [--events 100000] [--gaps 10050] [--rounds 3] [--per-event-seconds 10]`
//!
//! Orders are placed, paid, then shipped or cancelled (3 events each), published as the relay does
//! (subject and headers). Uses `DATABASE_URL`'s server (database `waybill_bench_projections`) and
//! `NATS_URL` (streams `BENCH_PROJECTIONS` and `BENCH_PROJECTIONS_GAPS`, refilled each run).

use std::time::{Duration, Instant};

use async_nats::jetstream;
use clap::Parser;
use domain::{EventEnvelope, EventMeta, OrderEvent, OrderId};
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use projections::{Inventory, Points, Projection, Runner, RunnerConfig, Search};
use relay::StreamSettings;
use serde_json::json;
use testkit::stats::median;
use uuid::Uuid;

const STREAM: &str = "BENCH_PROJECTIONS";
const PREFIX: &str = "benchproj.events";
const GAPS_STREAM: &str = "BENCH_PROJECTIONS_GAPS";
const GAPS_PREFIX: &str = "benchprojgaps.events";

#[derive(Debug, Parser)]
struct Args {
    /// Events in the stream.
    #[arg(long, default_value_t = 100_000)]
    events: usize,
    /// Unfillable gaps spread among the same events in the second stream (0: skip that measurement).
    #[arg(long, default_value_t = 10_050)]
    gaps: usize,
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
    let base = std::env::var("DATABASE_URL").unwrap_or_else(|_| ops::DEFAULT_DATABASE_URL.into());
    let url = ops::database::with_database(&base, "waybill_bench_projections");
    let nats_url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let js = jetstream::new(async_nats::connect(&nats_url).await?);
    for (stream, prefix, gaps) in [(STREAM, PREFIX, 0), (GAPS_STREAM, GAPS_PREFIX, args.gaps)] {
        if stream == GAPS_STREAM && args.gaps == 0 {
            continue;
        }
        let _ = js.delete_stream(stream).await;
        let settings = StreamSettings {
            name: stream.into(),
            subject_prefix: prefix.into(),
            ..StreamSettings::default()
        };
        relay::ensure_stream(&js, &settings, true).await?;
        let started = Instant::now();
        fill_stream(&js, prefix, args.events, gaps).await?;
        eprintln!(
            "stream {stream} filled with {} events and {gaps} gaps in {:.1?}",
            args.events,
            started.elapsed()
        );
    }

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
    if args.gaps > 0 {
        js.delete_stream(GAPS_STREAM).await?;
    }

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
            "{:<10} {:>16} {:>20} {:>8} {:>22} {:>12}",
            "projection",
            "batched ev/s",
            "one tx per event/s",
            "ratio",
            format!("with {} gaps ev/s", args.gaps),
            "gaps/batched"
        );
        for r in &results {
            println!(
                "{:<10} {:>16.0} {:>20.0} {:>8.1} {:>22.0} {:>12.2}",
                r["projection"].as_str().unwrap_or_default(),
                r["batched_events_per_s"].as_f64().unwrap_or_default(),
                r["per_event_events_per_s"].as_f64().unwrap_or_default(),
                r["ratio"].as_f64().unwrap_or_default(),
                r["with_gaps_events_per_s"].as_f64().unwrap_or_default(),
                r["with_gaps_over_batched"].as_f64().unwrap_or_default()
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
    let mut with_gaps = Vec::new();
    let modes: &[(&str, &str, usize)] = if args.gaps > 0 {
        &[
            (STREAM, PREFIX, 0),
            (STREAM, PREFIX, 1),
            (GAPS_STREAM, GAPS_PREFIX, 0),
        ]
    } else {
        &[(STREAM, PREFIX, 0), (STREAM, PREFIX, 1)]
    };
    for round in 1..=args.rounds {
        for &(stream, prefix, one_per_tx) in modes {
            let batch_size = if one_per_tx == 1 { 1 } else { args.batch_size };
            let config = RunnerConfig {
                stream: stream.into(),
                subject_prefix: prefix.into(),
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
                "round {round}: {} from {stream} with batches of {batch_size}: {rate:.0} events/s ({} applied, {} held)",
                P::NAME,
                tally.applied,
                tally.held
            );
            if batch_size == 1 {
                per_event.push(rate);
                continue;
            }
            anyhow::ensure!(
                tally.applied as usize == args.events,
                "applied {} of {}",
                tally.applied,
                args.events
            );
            if stream == GAPS_STREAM {
                anyhow::ensure!(
                    tally.held as usize == args.gaps,
                    "held {} of {} gaps",
                    tally.held,
                    args.gaps
                );
                with_gaps.push(rate);
            } else {
                batched.push(rate);
            }
        }
    }
    let ratios: Vec<f64> = batched.iter().zip(&per_event).map(|(b, p)| b / p).collect();
    let gap_ratios: Vec<f64> = with_gaps.iter().zip(&batched).map(|(g, b)| g / b).collect();
    Ok(json!({
        "projection": P::NAME,
        "batched_events_per_s": median(batched.clone()),
        "per_event_events_per_s": median(per_event.clone()),
        "ratio": median(ratios),
        "with_gaps_events_per_s": if with_gaps.is_empty() { 0.0 } else { median(with_gaps.clone()) },
        "with_gaps_over_batched": if gap_ratios.is_empty() { 0.0 } else { median(gap_ratios) },
        "runs": {"batched": batched, "per_event": per_event, "with_gaps": with_gaps},
    }))
}

/// Publishes `events` events under `prefix`: orders placed, paid, then shipped (two in three) or
/// cancelled; and `gaps` orphan `order.paid` version 2 events spread evenly among them.
async fn fill_stream(
    js: &jetstream::Context,
    prefix: &str,
    events: usize,
    gaps: usize,
) -> anyhow::Result<()> {
    let mut acks = FuturesUnordered::new();
    let orders = events.div_ceil(3);
    let gap_every = events.checked_div(gaps).map_or(usize::MAX, |n| n.max(1));
    let mut published = 0;
    let mut gaps_published = 0;
    let mut envelopes: Vec<EventEnvelope> = Vec::with_capacity(events + gaps);
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
        for (version, event) in [placed, paid.clone(), last].iter().enumerate() {
            if published == events {
                break 'orders;
            }
            envelopes.push(EventEnvelope::wrap(
                event,
                order,
                version as i64 + 1,
                meta(),
            ));
            published += 1;
            if published % gap_every == 0 && gaps_published < gaps {
                let orphan = OrderId::from_uuid(Uuid::now_v7());
                envelopes.push(EventEnvelope::wrap(&paid, orphan, 2, meta()));
                gaps_published += 1;
            }
        }
    }
    while gaps_published < gaps {
        let paid = OrderEvent::Paid(domain::OrderPaid {
            amount_cents: domain::Cents::new(100)?,
            payment_ref: None,
        });
        envelopes.push(EventEnvelope::wrap(
            &paid,
            OrderId::from_uuid(Uuid::now_v7()),
            2,
            meta(),
        ));
        gaps_published += 1;
    }
    for envelope in envelopes {
        let subject = domain::wire::subject(prefix, &envelope).map_err(anyhow::Error::msg)?;
        acks.push(
            js.publish_with_headers(
                subject,
                projections::decode::relay_headers(&envelope),
                envelope.to_json().into(),
            )
            .await?
            .into_future(),
        );
        while acks.len() > 2000 {
            if let Some(ack) = acks.next().await {
                ack?;
            }
        }
    }
    while let Some(ack) = acks.next().await {
        ack?;
    }
    Ok(())
}

fn meta() -> EventMeta {
    EventMeta {
        event_id: Uuid::now_v7(),
        occurred_at: chrono::Utc::now(),
        correlation_id: None,
        causation_id: None,
    }
}
