//! The whole pipeline on this machine: the order service, the relay and the three shipped projections
//! as separate processes (the demo's fleet without the registry's example read models, logging
//! warnings only), orders placed over HTTP at a steady
//! offered rate. Latency runs from the event's commit in the store to its checkpoint in the last of the
//! three projections, both read from PostgreSQL's clock: `events.recorded_at` is the command's
//! transaction time (its commit follows within a millisecond), `checkpoints.updated_at` is written
//! just before the projection's batch commits.
//!
//! A step is *sustained* when at least 99.5 % of the commands it offered were accepted (and at that
//! rate), none failed, every event was applied everywhere within a second of the step's end, and its
//! p99 is at most 100 ms. The pipeline's figure is the highest rate such that every step up to it is
//! sustained: a step that fails below a passing one caps the figure there. Every measurement runs
//! once per round; the figures are the rounds' medians, judged on those, and each round is kept.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;
use serde_json::json;
use sqlx::PgPool;
use testkit::stats::{busy_cores, machine_cpu_ticks, machine_cpus, median};

use super::server_marks::ServerMark;
use super::usage::{Sampler, Usage, Watched, nats_pids};
use super::{Profile, Progress};
use crate::demo::fleet::{Fleet, Wiring};
use crate::demo::services::Services;
use crate::http::{self, Http, Orders};

const DATABASE: &str = "waybill_bench_pipeline";
const STREAM: &str = "BENCH_PIPELINE";
const PREFIX: &str = "bench.pipeline";
/// Commands in flight at once at most; beyond it the generator skips ticks (and the step falls short).
const MAX_IN_FLIGHT: usize = 1_024;
/// How long to wait for a step's events to be applied everywhere after it.
const DRAIN_LIMIT: Duration = Duration::from_secs(60);
/// A sustained step: this share of the offered commands accepted at least…
const ACCEPTED_AT_LEAST: f64 = 0.995;
/// …every event applied everywhere within this long of the load's end…
const DRAINED_WITHIN: Duration = Duration::from_secs(1);
/// …and a p99 from commit to applied everywhere of at most this, ms.
const P99_AT_MOST_MS: f64 = 100.0;

/// One step at a steady offered rate.
#[derive(Debug, Clone, Serialize)]
pub(super) struct LoadStep {
    /// Events (commands) per second offered.
    pub offered: u64,
    /// Commands accepted per second.
    pub achieved: f64,
    /// Commands the step offered (its rate times its seconds).
    pub commands: u64,
    /// Of those, accepted (201).
    pub accepted: u64,
    /// `accepted / commands`; a command skipped because too many were pending counts as not accepted.
    pub accepted_ratio: f64,
    /// Commands refused or failed (anything but 201).
    pub failed: u64,
    /// Of those, how many by HTTP status, `timeout`, `refused` or `broken`.
    pub failures: BTreeMap<String, u64>,
    /// From commit to applied in all three projections, ms.
    pub p50_ms: f64,
    pub p95_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    /// Of that, from commit to the relay marking the event sent (published and acknowledged), ms:
    /// the rest is the projections' share.
    pub relayed_p50_ms: f64,
    pub relayed_p99_ms: f64,
    /// Events measured.
    pub samples: i64,
    /// Events committed but not yet applied everywhere when the step's load ended.
    pub backlog_at_end: i64,
    /// From the end of the load (its last command sent) to the last event applied everywhere, s.
    pub drain_seconds: f64,
    /// Every event was applied everywhere within a minute of the load's end (when not, the
    /// percentiles cover only the events that were, and the sweep stops).
    pub drained: bool,
    /// At least 99.5 % accepted, none failed, drained within a second, p99 at most 100 ms.
    pub sustained: bool,
    /// WAL the server wrote from the step's start until its events were applied everywhere, per
    /// accepted command (one event each), bytes: the whole pipeline's — the command, the relay and
    /// the three projections — which is what `max_wal_size` is sized from (docs/production.md).
    pub wal_bytes_per_event: f64,
    /// Whether a checkpoint ended during the step (its closing `fsync`s stall every writer for a
    /// moment); in a median step, whether one ended in any round. `None`: the server did not say.
    pub checkpoint_ended: Option<bool>,
    /// The machine's cores busy over the same window as the WAL, of the CPUs `/proc/stat` counts:
    /// every process on the machine, the load generator and the step's own polling for its backlog
    /// included (the window ends at the poll that found it drained, up to 100 ms late); steal time
    /// left out. Near the core count, every round trip of the pipeline waits for a core and the
    /// latency is queueing, whatever the code's timers. `None`: `/proc/stat` could not be read.
    pub busy_cores: Option<f64>,
    /// The same CPU time per accepted command, µs: what one event costs the whole machine from the
    /// order's request to its last checkpoint (when the step did not drain, its unapplied events'
    /// share too). The same code costs more on a host whose wake-ups are slower
    /// (docs/benchmarks.md).
    pub machine_cpu_us_per_event: Option<f64>,
    /// Each round's step, when this one is their median (every number the rounds' median).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub rounds: Vec<LoadStep>,
}

impl LoadStep {
    /// Whether this step meets the definition of sustained (module docs), from its own figures.
    fn meets_sustained(&self) -> bool {
        self.drained
            && self.failed == 0
            && self.accepted_ratio >= ACCEPTED_AT_LEAST
            && self.achieved >= ACCEPTED_AT_LEAST * self.offered as f64
            && self.drain_seconds <= DRAINED_WITHIN.as_secs_f64()
            && self.p99_ms <= P99_AT_MOST_MS
    }

    /// The rounds' median step (each figure the median of the rounds' values; a failure reason the
    /// median of its counts), judged on those medians; `None` for no rounds.
    fn median_of(rounds: Vec<LoadStep>) -> Option<LoadStep> {
        let first = rounds.first()?;
        let of = |f: fn(&LoadStep) -> f64| median(rounds.iter().map(f).collect());
        let whole = |f: fn(&LoadStep) -> u64| middle(rounds.iter().map(f).collect());
        let signed = |f: fn(&LoadStep) -> i64| middle(rounds.iter().map(f).collect());
        let reasons: std::collections::BTreeSet<&String> =
            rounds.iter().flat_map(|r| r.failures.keys()).collect();
        let failures: BTreeMap<String, u64> = reasons
            .into_iter()
            .map(|reason| {
                let counts = rounds
                    .iter()
                    .map(|r| r.failures.get(reason).copied().unwrap_or(0))
                    .collect();
                (reason.clone(), middle(counts))
            })
            .filter(|(_, n)| *n > 0)
            .collect();
        let mut step = LoadStep {
            offered: first.offered,
            achieved: of(|r| r.achieved),
            commands: whole(|r| r.commands),
            accepted: whole(|r| r.accepted),
            accepted_ratio: of(|r| r.accepted_ratio),
            failed: whole(|r| r.failed),
            failures,
            p50_ms: of(|r| r.p50_ms),
            p95_ms: of(|r| r.p95_ms),
            p99_ms: of(|r| r.p99_ms),
            max_ms: of(|r| r.max_ms),
            relayed_p50_ms: of(|r| r.relayed_p50_ms),
            relayed_p99_ms: of(|r| r.relayed_p99_ms),
            samples: signed(|r| r.samples),
            backlog_at_end: signed(|r| r.backlog_at_end),
            drain_seconds: of(|r| r.drain_seconds),
            // A majority of rounds drained.
            drained: rounds.iter().filter(|r| r.drained).count() * 2 > rounds.len(),
            sustained: false,
            wal_bytes_per_event: of(|r| r.wal_bytes_per_event),
            checkpoint_ended: rounds
                .iter()
                .map(|r| r.checkpoint_ended)
                .collect::<Option<Vec<bool>>>()
                .map(|ended| ended.contains(&true)),
            busy_cores: median_known(rounds.iter().map(|r| r.busy_cores)),
            machine_cpu_us_per_event: median_known(
                rounds.iter().map(|r| r.machine_cpu_us_per_event),
            ),
            rounds: Vec::new(),
        };
        step.sustained = step.meets_sustained();
        if rounds.len() > 1 {
            step.rounds = rounds;
        }
        Some(step)
    }
}

/// The pipeline's figures.
#[derive(Debug, Clone, Serialize)]
pub(super) struct PipelineFigures {
    /// The end-to-end measurement at the profile's steady rate (the rounds' median).
    pub e2e: LoadStep,
    /// The sweep, by rising offered rate (each step the rounds' median).
    pub sweep: Vec<LoadStep>,
    /// The highest offered rate such that every sweep step up to it is sustained (0: not the first).
    pub events_per_s: u64,
    /// Peak resident memory and CPU seconds per process over the whole pipeline measurement.
    pub processes: BTreeMap<String, Usage>,
}

/// Starts the fleet on a fresh database and stream, measures the steady rate and the sweep.
pub(super) async fn measure(
    services: &Services,
    profile: &Profile,
    progress: &Progress,
) -> anyhow::Result<PipelineFigures> {
    let wiring = Wiring {
        database_url: services.database_url(DATABASE),
        nats_url: services.nats_url.clone(),
        stream: STREAM.into(),
        subject_prefix: PREFIX.into(),
        log_filter: "warn,sqlx=error,async_nats=error",
        // The shipped pipeline: the registry's example read models are the kit's examples, not
        // part of it (each one adds its own statements per batch; docs/benchmarks.md).
        read_models: false,
    };
    crate::demo::fresh_database(services, DATABASE, &wiring.database_url)
        .await?
        .close()
        .await;
    // The bench's own statements (the backlog polled while a step drains, the latency join) are
    // estimated above PostgreSQL's JIT threshold on a step's events, and compiling them took CPU
    // from the pipeline under measurement on every poll (`perf`: LLVM in these sessions only).
    let pool = ops::database::connect_with(
        &wiring.database_url,
        "waybill-bench",
        4,
        &[("jit", "off".to_owned())],
    )
    .await?;
    let js = super::fresh_stream(&wiring.nats_url, STREAM, PREFIX).await?;
    let mut fleet = Fleet::start(true, wiring).await?;
    fleet.start_relay().await?;
    let mut watched: Vec<(String, Watched)> = fleet
        .pids()
        .into_iter()
        .map(|(name, pid)| (name, Watched::Pids(vec![pid])))
        .collect();
    watched.push(("postgres".into(), Watched::Database(DATABASE.into())));
    watched.push((
        "nats-server".into(),
        Watched::Pids(nats_pids(&services.nats_url)),
    ));
    // This process: the load it offers, the sampling and the measuring statements' client side. On
    // a small machine it competes with the pipeline for the same cores, so its cost is shown too.
    watched.push((
        "load generator".into(),
        Watched::Pids(vec![std::process::id()]),
    ));
    let sampler = Sampler::start(pool.clone(), watched);
    let load = Load {
        orders: Orders::new(&fleet.api, Http::with_timeout(Duration::from_secs(30))),
        pool: pool.clone(),
    };
    let outcome = async {
        // A short warm-up: connection pools fill, the first statements are planned.
        load.step(200, Duration::from_secs(2)).await?;
        let (mut e2e, mut sweep) = (Vec::new(), vec![Vec::new(); profile.sweep_rates.len()]);
        for round in 1..=profile.rounds {
            let step = load
                .step(profile.e2e_rate, Duration::from_secs(profile.e2e_seconds))
                .await?;
            progress.say(&describe(&format!("round {round}: steady"), &step));
            e2e.push(step);
            for (&rate, steps) in profile.sweep_rates.iter().zip(&mut sweep) {
                let step = load
                    .step(rate, Duration::from_secs(profile.sweep_seconds))
                    .await?;
                progress.say(&describe(&format!("round {round}: sweep"), &step));
                let drained = step.drained;
                steps.push(step);
                if !drained {
                    progress.say(
                        "the pipeline did not catch up within a minute; this round's sweep stops here",
                    );
                    break;
                }
            }
        }
        anyhow::Ok((e2e, sweep))
    }
    .await;
    let processes: BTreeMap<String, Usage> = sampler.finish().await.into_iter().collect();
    let logs = fleet.stop().await;
    let (e2e, sweep) = outcome.with_context(|| match &logs {
        Some(logs) => format!(
            "the pipeline measurement failed; logs in {}",
            logs.display()
        ),
        None => "the pipeline measurement failed".to_owned(),
    })?;
    let e2e = LoadStep::median_of(e2e).context("no round measured the steady rate")?;
    let sweep: Vec<LoadStep> = sweep.into_iter().filter_map(LoadStep::median_of).collect();
    let events_per_s = highest_sustained(&sweep);
    let _ = js.delete_stream(STREAM).await;
    pool.close().await;
    Ok(PipelineFigures {
        e2e,
        sweep,
        events_per_s,
        processes,
    })
}

/// The median of values every round measured; `None` when any round could not.
fn median_known(values: impl Iterator<Item = Option<f64>>) -> Option<f64> {
    values.collect::<Option<Vec<f64>>>().map(median)
}

/// The median of whole numbers (the upper one of an even count, as [`median`] takes); the default for
/// none.
fn middle<T: Ord + Copy + Default>(mut values: Vec<T>) -> T {
    values.sort_unstable();
    values.get(values.len() / 2).copied().unwrap_or_default()
}

/// The highest offered rate such that every step up to it is sustained; 0 when the first is not.
fn highest_sustained(sweep: &[LoadStep]) -> u64 {
    sweep
        .iter()
        .take_while(|step| step.sustained)
        .map(|step| step.offered)
        .last()
        .unwrap_or_default()
}

fn describe(what: &str, step: &LoadStep) -> String {
    format!(
        "{what} {} events/s offered: {:.0} accepted/s ({:.1} %), {} failed {:?}; commit to applied everywhere \
         p50 {} ms, p95 {} ms, p99 {} ms (relayed p50 {} ms, p99 {} ms); {} waiting at the end, drained in {:.1} s; WAL {:.1} KB per event{}{}",
        step.offered,
        step.achieved,
        step.accepted_ratio * 100.0,
        step.failed,
        step.failures,
        step.p50_ms,
        step.p95_ms,
        step.p99_ms,
        step.relayed_p50_ms,
        step.relayed_p99_ms,
        step.backlog_at_end,
        step.drain_seconds,
        step.wal_bytes_per_event / 1000.0,
        if step.checkpoint_ended == Some(true) {
            ", a checkpoint ended during it"
        } else {
            ""
        },
        if step.sustained {
            ""
        } else {
            " — not sustained"
        }
    )
}

/// The load generator and the measurements it needs.
struct Load {
    orders: Orders,
    pool: PgPool,
}

impl Load {
    /// Offers `rate` commands per second for `duration` (each places an order: one event), then
    /// measures.
    async fn step(&self, rate: u64, duration: Duration) -> anyhow::Result<LoadStep> {
        // The step's events are those after the log's current end (found through the primary key, not a
        // scan of every earlier step's events).
        let started_at: i64 = sqlx::query_scalar("SELECT coalesce(max(position), 0) FROM events")
            .fetch_one(&self.pool)
            .await?;
        let mark = ServerMark::take(&self.pool).await?;
        let (ticks_at_start, window_started) = (machine_cpu_ticks(), Instant::now());
        let accepted = Arc::new(AtomicU64::new(0));
        let failed = Arc::new(std::sync::Mutex::new(BTreeMap::<String, u64>::new()));
        let in_flight = Arc::new(tokio::sync::Semaphore::new(MAX_IN_FLIGHT));
        let mut ticker = tokio::time::interval(Duration::from_secs_f64(1.0 / rate as f64));
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
        let started = Instant::now();
        let total = rate * duration.as_secs();
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..total {
            ticker.tick().await;
            // Open loop: a command is sent on its tick whether or not earlier ones have answered —
            // unless too many are pending, which only happens when the system cannot keep up.
            let Ok(permit) = in_flight.clone().try_acquire_owned() else {
                continue;
            };
            let orders = self.orders.clone();
            let (accepted, failed) = (accepted.clone(), failed.clone());
            tasks.spawn(async move {
                let line = http::line(
                    &format!("SKU-{}", i % 200),
                    i64::try_from(1 + i % 3).expect("at most 3"),
                    i64::try_from(100 + i % 900).expect("below 1,000"),
                );
                let body = http::place(&format!("bench-{}", i % 1000), json!([line]));
                let outcome = match orders.post("/orders", &body, None).await {
                    Ok(answer) if answer.status == reqwest::StatusCode::CREATED => None,
                    Ok(answer) => Some(answer.status.as_u16().to_string()),
                    Err(error) if error.is_timeout() => Some("timeout".to_owned()),
                    Err(error) if error.is_connect() => Some("refused".to_owned()),
                    Err(_) => Some("broken".to_owned()),
                };
                drop(permit);
                match outcome {
                    None => {
                        accepted.fetch_add(1, Ordering::Relaxed);
                    }
                    Some(reason) => {
                        *failed
                            .lock()
                            .expect("no panics while counting")
                            .entry(reason)
                            .or_default() += 1;
                    }
                }
            });
            while tasks.try_join_next().is_some() {}
        }
        let offered_for = started.elapsed();
        let load_ended = Instant::now();
        let backlog_at_end = self.backlog(started_at).await?;
        while tasks.join_next().await.is_some() {}
        let mut drained = true;
        while self.backlog(started_at).await? > 0 {
            if load_ended.elapsed() >= DRAIN_LIMIT {
                drained = false;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let drain_seconds = load_ended.elapsed().as_secs_f64();
        let server = mark.until_now(&self.pool).await?;
        let busy = busy_cores(ticks_at_start, machine_cpu_ticks(), machine_cpus());
        let window = window_started.elapsed().as_secs_f64();
        let latency = self.latency(started_at).await?;
        let accepted = accepted.load(Ordering::Relaxed);
        let achieved = accepted as f64 / offered_for.as_secs_f64();
        let failures = std::mem::take(&mut *failed.lock().expect("no panics while counting"));
        let failed = failures.values().sum();
        let mut step = LoadStep {
            offered: rate,
            achieved,
            commands: total,
            accepted,
            accepted_ratio: accepted as f64 / total.max(1) as f64,
            failed,
            failures,
            p50_ms: latency.p50,
            p95_ms: latency.p95,
            p99_ms: latency.p99,
            max_ms: latency.max,
            relayed_p50_ms: latency.relayed_p50,
            relayed_p99_ms: latency.relayed_p99,
            samples: latency.samples,
            backlog_at_end,
            drain_seconds,
            drained,
            sustained: false,
            wal_bytes_per_event: server.wal_bytes as f64 / accepted.max(1) as f64,
            checkpoint_ended: server.checkpoint_ended,
            busy_cores: busy,
            machine_cpu_us_per_event: busy
                .map(|cores| cores * window * 1e6 / accepted.max(1) as f64),
            rounds: Vec::new(),
        };
        step.sustained = step.meets_sustained();
        Ok(step)
    }

    /// Events after position `since` that some projection has not applied yet.
    async fn backlog(&self, since: i64) -> anyhow::Result<i64> {
        Ok(sqlx::query_scalar(
            "SELECT count(*) FROM events e
             WHERE e.position > $1
               AND NOT (EXISTS (SELECT 1 FROM inventory.checkpoints c
                                WHERE c.aggregate_id = e.aggregate_id AND c.version >= e.aggregate_version)
                    AND EXISTS (SELECT 1 FROM points.checkpoints c
                                WHERE c.aggregate_id = e.aggregate_id AND c.version >= e.aggregate_version)
                    AND EXISTS (SELECT 1 FROM search.checkpoints c
                                WHERE c.aggregate_id = e.aggregate_id AND c.version >= e.aggregate_version))",
        )
        .bind(since)
        .fetch_one(&self.pool)
        .await?)
    }

    /// From commit to the last projection's checkpoint, and to the relay's mark, over the events
    /// after position `since` (every one of them is a version 1: its checkpoint is its own).
    async fn latency(&self, since: i64) -> anyhow::Result<Latency> {
        #[derive(sqlx::FromRow)]
        struct Row {
            total: Option<Vec<f64>>,
            max: Option<f64>,
            samples: i64,
        }
        let row: Row = sqlx::query_as(
            "WITH applied AS (
                SELECT (extract(epoch FROM greatest(i.updated_at, p.updated_at, s.updated_at) - e.recorded_at)
                       * 1000)::float8 AS ms
                FROM events e
                JOIN inventory.checkpoints i ON i.aggregate_id = e.aggregate_id
                JOIN points.checkpoints p ON p.aggregate_id = e.aggregate_id
                JOIN search.checkpoints s ON s.aggregate_id = e.aggregate_id
                WHERE e.position > $1)
             SELECT percentile_cont(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP (ORDER BY ms) AS total,
                    max(ms)::float8 AS max, count(*) AS samples
             FROM applied",
        )
        .bind(since)
        .fetch_one(&self.pool)
        .await?;
        // The relay's part is the outbox's to read: over the same events, once every projection has
        // applied them (the step waits for that); when it gave up waiting, over every sent one.
        let relayed =
            store::outbox::fixtures::relayed_ms_percentiles(&self.pool, since, &[0.5, 0.99])
                .await?;
        let tenth = |ms: f64| (ms * 10.0).round() / 10.0;
        let total = row.total.unwrap_or_default();
        let at = |values: &[f64], i: usize| tenth(values.get(i).copied().unwrap_or_default());
        Ok(Latency {
            p50: at(&total, 0),
            p95: at(&total, 1),
            p99: at(&total, 2),
            max: tenth(row.max.unwrap_or_default()),
            relayed_p50: at(&relayed, 0),
            relayed_p99: at(&relayed, 1),
            samples: row.samples,
        })
    }
}

/// One step's latency figures, ms.
struct Latency {
    p50: f64,
    p95: f64,
    p99: f64,
    max: f64,
    relayed_p50: f64,
    relayed_p99: f64,
    samples: i64,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A step at `offered` events/s that accepted `accepted_ratio` of its commands with this p99.
    fn step(offered: u64, accepted_ratio: f64, p99_ms: f64) -> LoadStep {
        let commands = offered * 6;
        let accepted = if accepted_ratio >= 1.0 {
            commands
        } else {
            commands - commands / 20
        };
        let mut step = LoadStep {
            offered,
            achieved: offered as f64 * accepted_ratio,
            commands,
            accepted,
            accepted_ratio,
            failed: 0,
            failures: BTreeMap::new(),
            p50_ms: p99_ms / 4.0,
            p95_ms: p99_ms / 2.0,
            p99_ms,
            max_ms: p99_ms * 2.0,
            relayed_p50_ms: 1.0,
            relayed_p99_ms: 2.0,
            samples: i64::try_from(commands).expect("small"),
            backlog_at_end: 0,
            drain_seconds: 0.2,
            drained: true,
            sustained: false,
            wal_bytes_per_event: 5_000.0,
            checkpoint_ended: Some(false),
            busy_cores: Some(1.0),
            machine_cpu_us_per_event: Some(1_000.0),
            rounds: Vec::new(),
        };
        step.sustained = step.meets_sustained();
        step
    }

    #[test]
    fn a_step_is_sustained_only_with_nearly_every_command_accepted_and_a_bounded_p99() {
        assert!(step(1_000, 1.0, 30.0).sustained);
        assert!(step(1_000, 0.996, 100.0).sustained);
        // The run the issue quotes: 3,817 of 4,000 per second accepted, p99 407 ms.
        assert!(!step(4_000, 3_817.0 / 4_000.0, 20.0).sustained);
        assert!(!step(4_000, 1.0, 407.0).sustained);
        let mut failed = step(1_000, 1.0, 10.0);
        failed.failed = 1;
        assert!(!failed.meets_sustained());
        let mut slow_drain = step(1_000, 1.0, 10.0);
        slow_drain.drain_seconds = 1.5;
        assert!(!slow_drain.meets_sustained());
    }

    #[test]
    fn the_pipeline_figure_stops_at_the_first_step_not_sustained() {
        let sweep = [
            step(2_000, 1.0, 40.0),
            step(2_500, 1.0, 60.0),
            step(3_000, 1.0, 138.0),
            step(4_000, 1.0, 90.0),
        ];
        assert_eq!(highest_sustained(&sweep), 2_500);
        assert_eq!(highest_sustained(&sweep[2..]), 0);
        assert_eq!(highest_sustained(&[]), 0);
    }

    #[test]
    fn the_median_step_is_judged_on_the_rounds_medians_and_keeps_each_round() {
        let median = LoadStep::median_of(vec![
            step(1_000, 1.0, 20.0),
            step(1_000, 1.0, 120.0),
            step(1_000, 1.0, 25.0),
        ])
        .expect("three rounds");
        assert!((median.p99_ms - 25.0).abs() < 1e-9);
        assert!(median.sustained);
        assert_eq!(median.rounds.len(), 3);
        let slow = LoadStep::median_of(vec![
            step(1_000, 1.0, 120.0),
            step(1_000, 1.0, 20.0),
            step(1_000, 1.0, 130.0),
        ])
        .expect("three rounds");
        assert!(!slow.sustained);
        assert!(LoadStep::median_of(Vec::new()).is_none());
    }

    #[test]
    fn a_median_step_says_a_checkpoint_ended_when_one_did_in_any_round() {
        let mut disturbed = step(1_000, 1.0, 60.0);
        disturbed.checkpoint_ended = Some(true);
        disturbed.wal_bytes_per_event = 9_000.0;
        let rounds = vec![step(1_000, 1.0, 20.0), disturbed, step(1_000, 1.0, 25.0)];
        let median = LoadStep::median_of(rounds.clone()).expect("three rounds");
        assert_eq!(median.checkpoint_ended, Some(true));
        assert!((median.wal_bytes_per_event - 5_000.0).abs() < 1e-9);
        let mut unknown = rounds;
        unknown[0].checkpoint_ended = None;
        assert_eq!(
            LoadStep::median_of(unknown)
                .expect("three rounds")
                .checkpoint_ended,
            None,
            "a round the server said nothing of leaves the median unknown"
        );
        let quiet = LoadStep::median_of(vec![step(1_000, 1.0, 20.0), step(1_000, 1.0, 21.0)]);
        assert_eq!(quiet.expect("two rounds").checkpoint_ended, Some(false));
    }

    #[test]
    fn a_median_step_takes_the_rounds_median_busy_cores_unless_a_round_could_not_read_them() {
        let busy = |cores: f64, us: f64| {
            let mut step = step(1_000, 1.0, 20.0);
            step.busy_cores = Some(cores);
            step.machine_cpu_us_per_event = Some(us);
            step
        };
        let rounds = vec![busy(1.9, 1_800.0), busy(1.2, 1_100.0), busy(1.5, 1_400.0)];
        let median = LoadStep::median_of(rounds.clone()).expect("three rounds");
        assert_eq!(median.busy_cores, Some(1.5));
        assert_eq!(median.machine_cpu_us_per_event, Some(1_400.0));
        // A round that could not read `/proc/stat` has neither figure.
        let mut blind = rounds;
        blind[2].busy_cores = None;
        blind[2].machine_cpu_us_per_event = None;
        let median = LoadStep::median_of(blind).expect("three rounds");
        assert_eq!(median.busy_cores, None, "no median of two out of three");
        assert_eq!(median.machine_cpu_us_per_event, None);
    }
}
