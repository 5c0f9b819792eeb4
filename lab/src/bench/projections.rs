//! Each projection's apply rate: the projection's runner (the code its binary runs) consumes a stream
//! pre-filled with order lifecycles — placed, paid, then shipped (two in three) or cancelled, 200 SKUs,
//! 1,000 customers — published as the relay publishes them (subject and headers), in batches of its
//! default size, from a reset state to the last event; then inventory on the same events in a stream
//! the server splits into partitions (`scaling`).

use std::time::Instant;

use async_nats::jetstream;
use domain::{EventEnvelope, EventMeta, OrderEvent, OrderId};
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use projections::{Inventory, Points, Projection, Runner, RunnerConfig, Search};
use serde::Serialize;
use testkit::stats::median;
use uuid::Uuid;

use super::scaling::{self, ScalingFigures};
use super::{Profile, Progress};
use crate::demo::services::Services;

const STREAM: &str = "BENCH_PROJECTIONS";
const PREFIX: &str = "bench.projections";
/// The stream split by the server, for the scaling figures.
const SPLIT_STREAM: &str = "BENCH_SPLIT";
const SPLIT_PREFIX: &str = "bench.split";
const DATABASE: &str = "waybill_bench_projections";

/// Events applied per second, per projection (medians over the rounds).
#[derive(Debug, Clone, Serialize)]
pub(super) struct ProjectionFigures {
    pub inventory: f64,
    pub points: f64,
    pub search: f64,
    /// Events in the stream.
    pub events: usize,
    /// Every round's rate, per projection.
    pub runs: serde_json::Value,
    /// Inventory on a stream split by the server: 1, 2 and 4 instances, and a dead one's takeover.
    pub scaling: ScalingFigures,
}

/// Fills the stream once and measures the three projections.
pub(super) async fn measure(
    services: &Services,
    profile: &Profile,
    progress: &Progress,
) -> anyhow::Result<ProjectionFigures> {
    let url = services.database_url(DATABASE);
    ops::database::ensure_database(&url).await?;
    let js = super::fresh_stream(&services.nats_url, STREAM, PREFIX).await?;
    let events = profile.projection_events;
    fill_stream(&js, PREFIX, events).await?;
    let wiring = (url.as_str(), services.nats_url.as_str(), profile.rounds);
    let inventory = rounds(Inventory, wiring, events, progress).await?;
    let points = rounds(Points, wiring, events, progress).await?;
    let search = rounds(Search, wiring, events, progress).await?;
    js.delete_stream(STREAM).await?;

    let js = super::fresh_split_stream(
        &services.nats_url,
        SPLIT_STREAM,
        SPLIT_PREFIX,
        scaling::PARTITIONS,
    )
    .await?;
    fill_stream(&js, SPLIT_PREFIX, events).await?;
    let split = scaling::Wiring {
        url: &url,
        nats_url: &services.nats_url,
        stream: SPLIT_STREAM,
        prefix: SPLIT_PREFIX,
        rounds: profile.rounds,
    };
    let scaling = scaling::measure(&split, events, progress).await?;
    js.delete_stream(SPLIT_STREAM).await?;
    Ok(ProjectionFigures {
        inventory: median(inventory.clone()),
        points: median(points.clone()),
        search: median(search.clone()),
        events,
        runs: serde_json::json!({"inventory": inventory, "points": points, "search": search}),
        scaling,
    })
}

/// The rate of each round: from a reset projection to its last applied event.
async fn rounds<P: Projection + Clone>(
    projection: P,
    (url, nats_url, rounds): (&str, &str, usize),
    events: usize,
    progress: &Progress,
) -> anyhow::Result<Vec<f64>> {
    let mut rates = Vec::new();
    for round in 1..=rounds {
        let config = RunnerConfig {
            stream: STREAM.into(),
            subject_prefix: PREFIX.into(),
            ..RunnerConfig::default()
        };
        let runner = Runner::connect(projection.clone(), url, nats_url, config).await?;
        runner.reset().await?;
        let started = Instant::now();
        let (applied, last_applied) = apply_all(&runner).await?;
        anyhow::ensure!(
            usize::try_from(applied).is_ok_and(|applied| applied == events),
            "{} applied {applied} of {events} events",
            P::NAME,
        );
        let rate = applied as f64 / (last_applied - started).as_secs_f64().max(1e-6);
        progress.say(&format!(
            "{} round {round}/{rounds}: {rate:.0} events/s",
            P::NAME
        ));
        rates.push(rate);
    }
    Ok(rates)
}

/// Runs `runner` until nothing more can be applied: the events it applied, and when it applied the
/// last one (the clock of a rate stops there, not when `--once` notices it is idle).
pub(super) async fn apply_all<P: Projection>(runner: &Runner<P>) -> anyhow::Result<(u64, Instant)> {
    let mut last_applied = Instant::now();
    let mut seen = 0;
    let tally = runner
        .run(
            std::future::pending(),
            true,
            |tally: &projections::Tally| {
                if tally.applied > seen {
                    seen = tally.applied;
                    last_applied = Instant::now();
                }
            },
        )
        .await?;
    Ok((tally.applied, last_applied))
}

/// Publishes `events` events under `prefix`: orders placed, paid, then shipped (two in three) or
/// cancelled.
async fn fill_stream(js: &jetstream::Context, prefix: &str, events: usize) -> anyhow::Result<()> {
    let mut envelopes: Vec<EventEnvelope> = Vec::with_capacity(events);
    for i in 0..events.div_ceil(3) {
        let order = OrderId::from_uuid(Uuid::now_v7());
        let placed = domain::Order::new(order)
            .decide(&testkit::place(
                &format!("customer-{}", i % 1000),
                &[&format!("SKU-{}:{}:{}", i % 200, 1 + i % 3, 100 + i % 900)],
            ))?
            .remove(0);
        let OrderEvent::Placed(p) = &placed else {
            anyhow::bail!("placing an order did not give order.placed")
        };
        let paid = OrderEvent::Paid(domain::OrderPaid::from_command(&domain::PayOrder {
            amount_cents: domain::Cents::new(p.total_cents)?,
            payment_ref: None,
        }));
        let last = if i % 3 == 2 {
            OrderEvent::Cancelled(domain::OrderCancelled::from_command(&domain::CancelOrder {
                reason: domain::Note::parse("bench")?,
            }))
        } else {
            OrderEvent::Shipped(domain::OrderShipped::from_command(&domain::ShipOrder {
                carrier: domain::Note::parse("DHL")?,
                tracking_number: domain::Note::parse("T")?,
            }))
        };
        for (version, event) in (1_i64..).zip([placed, paid, last].iter()) {
            if envelopes.len() < events {
                envelopes.push(EventEnvelope::wrap(event, order, version, meta()));
            }
        }
    }
    let mut acks = FuturesUnordered::new();
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
