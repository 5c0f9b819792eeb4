//! The relay's two sources side by side, on one PostgreSQL with logical decoding (the configured one
//! when its `wal_level` is `logical`, else a private one started for this part): draining a backlog
//! (events/s, and CPU per event — the relay, its PostgreSQL sessions including the WAL sender that
//! decodes for it, and nats-server) and commit → PubAck latency at a steady 1,000 events/s.
//!
//! A polling relay's backlog is a pre-filled outbox (`run --once`). A WAL relay's is a slot it has
//! not read yet: the relay streams, is frozen (SIGSTOP) while the rows are written, and resumed; its
//! rate counts from the resume to the last row marked sent. Its CPU counts from before the rows were
//! written: the WAL sender decodes them as they are written (its share is reported on its own).
//!
//! Latency is measured for both sources the same way, from the event's transaction (`created_at`;
//! each steady event is a one-row transaction) to the time the stream stored it (the message's
//! timestamp, set by nats-server just before its PubAck), and also to the row's mark.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use rustix::process::Signal;
use serde::Serialize;
use sqlx::PgPool;
use store::outbox::fixtures;
use testkit::PostgresServer;
use testkit::stats::{median, quantile};
use tokio::process::Child;

use super::relay::{CpuPerEvent, Table, seed};
use super::usage::{Sampler, Watched, nats_pids};
use super::{Profile, Progress};
use crate::demo::services::Services;
use crate::process::{self, Launch, binary};

const STREAM: &str = "BENCH_LAB_SOURCES";
const PREFIX: &str = "bench.lab.sources";
const DATABASE: &str = "waybill_bench_sources";
/// Rows per transaction when a backlog is written.
const CHUNK: i64 = 1_000;
/// The steady rate of the latency measurement, events/s.
const STEADY_RATE: u64 = 1_000;

/// One source's figures (medians of the rounds).
#[derive(Debug, Clone, Default, Serialize)]
pub(super) struct SourceFigures {
    /// Draining a backlog, events/s.
    pub events_per_s: f64,
    /// CPU per relayed event while draining.
    pub cpu_us: CpuPerEvent,
    /// Of `cpu_us.postgres`, the WAL sender's decoding (0 for polling).
    pub walsender_us: f64,
    /// From commit to stored in the stream (PubAck) at 1,000 events/s, ms.
    pub ack_p50_ms: f64,
    pub ack_p99_ms: f64,
    /// From commit to the row marked sent, ms.
    pub mark_p50_ms: f64,
    pub mark_p99_ms: f64,
    /// Every round's figures.
    pub runs: SourceRuns,
}

/// Every round's figures of one source.
#[derive(Debug, Clone, Default, Serialize)]
pub(super) struct SourceRuns {
    pub events_per_s: Vec<f64>,
    pub cpu_us_total: Vec<f64>,
    pub ack_p50_ms: Vec<f64>,
    pub ack_p99_ms: Vec<f64>,
    pub mark_p99_ms: Vec<f64>,
}

/// Both sources, measured on the same server in the same run.
#[derive(Debug, Clone, Serialize)]
pub(super) struct SourcesFigures {
    pub poll: SourceFigures,
    pub wal: SourceFigures,
    /// Events per backlog.
    pub events: i64,
    /// Seconds of the steady load.
    pub steady_seconds: u64,
    /// Which PostgreSQL: the configured one, or a private one (no fsync, synchronous commit).
    pub server: String,
}

pub(super) async fn measure(
    services: &Services,
    profile: &Profile,
    progress: &Progress,
) -> anyhow::Result<SourcesFigures> {
    let configured = services.database_url(DATABASE);
    ops::database::ensure_database(&configured).await?;
    let probe = ops::database::connect(&configured, "waybill-bench", 1).await?;
    let wal_level: String = sqlx::query_scalar("SHOW wal_level")
        .fetch_one(&probe)
        .await?;
    probe.close().await;
    // Kept alive for the part: a private server stops when dropped.
    let mut private = None;
    let (url, server) = if wal_level == "logical" {
        (configured, "the configured PostgreSQL".to_owned())
    } else {
        progress.say(&format!(
            "sources: the configured PostgreSQL has wal_level = {wal_level}; both sources are \
             measured on a private one (wal_level = logical, synchronous commit, no fsync)"
        ));
        let started = PostgresServer::start_with(true)?;
        let url = started.url(DATABASE);
        private = Some(started);
        (
            url,
            "a private PostgreSQL (wal_level = logical, synchronous commit, no fsync)".to_owned(),
        )
    };
    ops::database::ensure_database(&url).await?;
    let pool = ops::database::connect(&url, "waybill-bench", 4).await?;
    store::MIGRATOR.run(&pool).await?;
    let js = super::fresh_stream(&services.nats_url, STREAM, PREFIX).await?;
    let bench = Bench {
        pool: &pool,
        url: &url,
        nats_url: &services.nats_url,
        js: &js,
    };
    let events = profile.relay_events;
    let steady = Duration::from_secs(profile.e2e_seconds.min(10));
    let (mut poll, mut wal) = (Vec::new(), Vec::new());
    for round in 1..=profile.rounds {
        let polled = bench.round(Source::Poll, events, steady).await?;
        let streamed = bench.round(Source::Wal, events, steady).await?;
        progress.say(&format!(
            "sources round {round}/{}: poll {:.0} events/s, {:.1} µs/event, commit to PubAck p50 \
             {:.1} / p99 {:.1} ms; wal {:.0} events/s, {:.1} µs/event (WAL sender {:.1}), p50 \
             {:.1} / p99 {:.1} ms",
            profile.rounds,
            polled.rate,
            polled.cpu.total,
            polled.ack.0,
            polled.ack.1,
            streamed.rate,
            streamed.cpu.total,
            streamed.walsender,
            streamed.ack.0,
            streamed.ack.1
        ));
        poll.push(polled);
        wal.push(streamed);
    }
    let _ = sqlx::query(
        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots
         WHERE slot_name = 'waybill_outbox' AND NOT active",
    )
    .execute(&pool)
    .await;
    fixtures::truncate(&pool).await?;
    let _ = js.get_stream(STREAM).await?.purge().await;
    pool.close().await;
    drop(private);
    Ok(SourcesFigures {
        poll: figures(&poll),
        wal: figures(&wal),
        events,
        steady_seconds: steady.as_secs(),
        server,
    })
}

fn figures(rounds: &[Round]) -> SourceFigures {
    let of = |f: fn(&Round) -> f64| rounds.iter().map(f).collect::<Vec<_>>();
    let runs = SourceRuns {
        events_per_s: of(|r| r.rate),
        cpu_us_total: of(|r| r.cpu.total),
        ack_p50_ms: of(|r| r.ack.0),
        ack_p99_ms: of(|r| r.ack.1),
        mark_p99_ms: of(|r| r.mark.1),
    };
    SourceFigures {
        events_per_s: median(runs.events_per_s.clone()),
        cpu_us: CpuPerEvent {
            total: median(runs.cpu_us_total.clone()),
            relay: median(of(|r| r.cpu.relay)),
            postgres: median(of(|r| r.cpu.postgres)),
            nats: median(of(|r| r.cpu.nats)),
        },
        walsender_us: median(of(|r| r.walsender)),
        ack_p50_ms: median(runs.ack_p50_ms.clone()),
        ack_p99_ms: median(runs.ack_p99_ms.clone()),
        mark_p50_ms: median(of(|r| r.mark.0)),
        mark_p99_ms: median(runs.mark_p99_ms.clone()),
        runs,
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    Poll,
    Wal,
}

/// One source's round.
struct Round {
    rate: f64,
    cpu: CpuPerEvent,
    /// CPU µs per event of the WAL sender (part of `cpu.postgres`).
    walsender: f64,
    /// Commit to PubAck, p50 and p99 ms.
    ack: (f64, f64),
    /// Commit to mark, p50 and p99 ms.
    mark: (f64, f64),
}

struct Bench<'a> {
    pool: &'a PgPool,
    url: &'a str,
    nats_url: &'a str,
    js: &'a async_nats::jetstream::Context,
}

impl Bench<'_> {
    /// Empties the outbox and the stream, and drops the slot a WAL relay left (it would replay rows
    /// that are gone).
    async fn clear(&self) -> anyhow::Result<()> {
        sqlx::query(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots
             WHERE slot_name = 'waybill_outbox' AND NOT active",
        )
        .execute(self.pool)
        .await?;
        fixtures::truncate(self.pool).await?;
        fixtures::vacuum_analyze(self.pool).await?;
        self.js.get_stream(STREAM).await?.purge().await?;
        Ok(())
    }

    /// A relay of `source`, `once` (poll only) or running until stopped.
    fn relay(
        &self,
        source: Source,
        name: &str,
        once: bool,
        logs: &std::path::Path,
    ) -> anyhow::Result<Child> {
        let relay = binary("waybill-relay")?;
        let mut args: Vec<String> = [
            "run",
            "--no-provision",
            "--retention",
            "off",
            "--database-url",
            self.url,
            "--nats-url",
            self.nats_url,
            "--stream",
            STREAM,
            "--subject-prefix",
            PREFIX,
            "--relay-id",
            name,
        ]
        .map(str::to_owned)
        .to_vec();
        if once {
            args.push("--once".to_owned());
        }
        if source == Source::Wal {
            args.extend(["--source".to_owned(), "wal".to_owned()]);
        }
        Launch {
            program: &relay,
            args: &args,
            env: &[(
                "RUST_LOG".to_owned(),
                std::env::var("XX_RUST_LOG").unwrap_or("warn".to_owned()),
            )],
            clear_env: false,
            unset: &[],
            name,
        }
        .spawn(logs)
    }

    /// Waits until a WAL relay reads its slot.
    async fn streaming(
        &self,
        child: &mut Child,
        logs: &std::path::Path,
        name: &str,
    ) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let active: Option<bool> = sqlx::query_scalar(
                "SELECT active FROM pg_replication_slots WHERE slot_name = 'waybill_outbox'",
            )
            .fetch_optional(self.pool)
            .await?;
            if active == Some(true) {
                return Ok(());
            }
            if let Some(status) = child.try_wait()? {
                anyhow::bail!(
                    "the WAL relay exited with {status}{}",
                    process::log_tail(logs, name)
                );
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "the WAL relay did not start streaming within a minute{}",
                process::log_tail(logs, name)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn round(&self, source: Source, events: i64, steady: Duration) -> anyhow::Result<Round> {
        let logs = tempfile::Builder::new()
            .prefix("waybill-bench-sources-")
            .tempdir()?;
        let name = match source {
            Source::Poll => "bench-poll",
            Source::Wal => "bench-wal",
        };
        self.clear().await?;
        let nats = nats_pids(self.nats_url);
        let watch = |relay: &Child| {
            Sampler::start(
                self.pool.clone(),
                vec![
                    (
                        "relay".into(),
                        Watched::Pids(relay.id().into_iter().collect()),
                    ),
                    (
                        "postgres".into(),
                        Watched::Sessions(format!("waybill-relay {name}")),
                    ),
                    ("nats".into(), Watched::Pids(nats.clone())),
                    (
                        "walsender".into(),
                        Watched::WalSenders(format!("waybill-relay {name}")),
                    ),
                ],
            )
        };
        // The backlog.
        let (rate, usage) = match source {
            Source::Poll => {
                write_backlog(self.pool, events).await?;
                fixtures::analyze(self.pool).await?;
                let mut relay = self.relay(source, name, true, logs.path())?;
                let sampler = watch(&relay);
                let status = relay.wait().await?;
                anyhow::ensure!(
                    status.success(),
                    "waybill-relay exited with {status}{}",
                    process::log_tail(logs.path(), name)
                );
                let usage = sampler.finish().await;
                let (sent, seconds) = fixtures::relayed(self.pool).await?;
                anyhow::ensure!(sent == events, "only {sent} of {events} rows were sent");
                let seconds = seconds.ok_or_else(|| anyhow::anyhow!("no row was sent"))?;
                (events as f64 / seconds.max(0.001), usage)
            }
            Source::Wal => {
                let mut relay = self.relay(source, name, false, logs.path())?;
                self.streaming(&mut relay, logs.path(), name).await?;
                // The slot's session is up: the sampler finds the WAL sender by its name.
                let sampler = watch(&relay);
                tokio::time::sleep(Duration::from_millis(600)).await;
                process::signal(&relay, Signal::STOP);
                let written = write_backlog(self.pool, events).await;
                let resumed_at: f64 =
                    sqlx::query_scalar("SELECT extract(epoch FROM clock_timestamp())::float8")
                        .fetch_one(self.pool)
                        .await?;
                process::signal(&relay, Signal::CONT);
                written?;
                let last = self
                    .wait_sent(events, &mut relay, logs.path(), name)
                    .await?;
                let usage = sampler.finish().await;
                process::stop_all([(name, &mut relay)], Duration::from_secs(10)).await;
                (events as f64 / (last - resumed_at).max(0.001), usage)
            }
        };
        let per_event =
            |part: &str| usage.get(part).map_or(0.0, |u| u.cpu_seconds) * 1e6 / events as f64;
        let (relay_us, postgres_us, nats_us) =
            (per_event("relay"), per_event("postgres"), per_event("nats"));
        let walsender = per_event("walsender");
        let cpu = CpuPerEvent {
            total: relay_us + postgres_us + nats_us,
            relay: relay_us,
            postgres: postgres_us,
            nats: nats_us,
        };

        // Commit to PubAck at a steady rate, with the relay running as in production.
        self.clear().await?;
        let mut relay = self.relay(source, name, false, logs.path())?;
        if source == Source::Wal {
            self.streaming(&mut relay, logs.path(), name).await?;
        }
        let (ack, mark) = self.steady(steady, &mut relay, logs.path(), name).await?;
        if std::env::var_os("XX_LOG").is_some() {
            eprintln!(
                "{}",
                std::fs::read_to_string(process::log_path(logs.path(), name)).unwrap_or_default()
            );
        }
        process::stop_all([(name, &mut relay)], Duration::from_secs(10)).await;
        Ok(Round {
            rate,
            cpu,
            walsender,
            ack,
            mark,
        })
    }

    /// Waits until `events` rows are sent; the time of the last mark (epoch seconds).
    async fn wait_sent(
        &self,
        events: i64,
        relay: &mut Child,
        logs: &std::path::Path,
        name: &str,
    ) -> anyhow::Result<f64> {
        let deadline = Instant::now() + Duration::from_secs(300);
        loop {
            let (sent, last) = fixtures::sent_so_far(self.pool).await?;
            if sent >= events {
                return last.ok_or_else(|| anyhow::anyhow!("sent rows without a time"));
            }
            if let Some(status) = relay.try_wait()? {
                anyhow::bail!(
                    "waybill-relay exited with {status}{}",
                    process::log_tail(logs, name)
                );
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "only {sent} of {events} rows sent after 5 minutes{}",
                process::log_tail(logs, name)
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Writes one event per transaction at [`STEADY_RATE`] for `duration`, each followed by the
    /// notification writers send (as the order service does, at most one per 5 ms), waits until all
    /// are sent, and returns the p50 and p99 (ms) of commit to PubAck and of commit to mark.
    async fn steady(
        &self,
        duration: Duration,
        relay: &mut Child,
        logs: &std::path::Path,
        name: &str,
    ) -> anyhow::Result<((f64, f64), (f64, f64))> {
        let notifier = store::OutboxNotifier::spawn(self.pool.clone(), Duration::from_millis(5));
        let total = STEADY_RATE * duration.as_secs();
        let mut ticker = tokio::time::interval(Duration::from_secs_f64(1.0 / STEADY_RATE as f64));
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
        let mut writes = tokio::task::JoinSet::new();
        for _ in 0..total {
            ticker.tick().await;
            let (pool, notifier) = (self.pool.clone(), notifier.clone());
            writes.spawn(async move {
                seed(&pool, 1, 1, Table::Outbox, "pending").await?;
                notifier.poke();
                anyhow::Ok(())
            });
            while let Some(done) = writes.try_join_next() {
                done??;
            }
        }
        while let Some(done) = writes.join_next().await {
            done??;
        }
        let events = i64::try_from(total)?;
        self.wait_sent(events, relay, logs, name).await?;
        let (p50, p99) = fixtures::sent_ms_p50_p99(self.pool).await?;
        let tenth = |ms: Option<f64>| (ms.unwrap_or_default() * 10.0).round() / 10.0;
        let mark = (tenth(p50), tenth(p99));
        let mut acks = self.commit_to_stored_us().await?;
        anyhow::ensure!(
            u64::try_from(acks.len())? == total,
            "{} of {total} events found in the stream",
            acks.len()
        );
        acks.sort_unstable();
        let at = |q: f64| tenth(Some(quantile(&acks, q) as f64 / 1000.0));
        Ok(((at(0.5), at(0.99)), mark))
    }

    /// For every message in the stream, µs from its event's transaction start to the time the stream
    /// stored it (read through an ephemeral consumer that acknowledges nothing).
    async fn commit_to_stored_us(&self) -> anyhow::Result<Vec<u64>> {
        let created: HashMap<String, i64> = fixtures::created_at_by_event(self.pool)
            .await?
            .into_iter()
            .map(|(event_id, at)| (event_id.to_string(), at))
            .collect();
        let mut us = Vec::new();
        crate::stream_read::each_message(self.js, STREAM, |message, info| {
            let id = message.headers.as_ref().and_then(|h| h.get("Nats-Msg-Id"));
            if let Some(&at) = id.and_then(|id| created.get(id.as_str())) {
                let stored = info.published.unix_timestamp_nanos() / 1_000;
                // Both clocks are this machine's; a negative gap (clock granularity) counts as 0.
                us.push(u64::try_from(stored - i128::from(at)).unwrap_or(0));
            }
        })
        .await?;
        Ok(us)
    }
}

/// `events` pending rows in transactions of [`CHUNK`], in aggregates of three versions.
async fn write_backlog(pool: &PgPool, events: i64) -> anyhow::Result<()> {
    let mut written = 0;
    while written < events {
        let chunk = CHUNK.min(events - written);
        seed(pool, chunk, 3, Table::Outbox, "pending").await?;
        written += chunk;
    }
    Ok(())
}
