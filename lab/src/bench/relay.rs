//! The relay: real `waybill-relay run --once` processes draining a pre-filled outbox while a million sent
//! rows sit beside the backlog — one relay with one lane, two such relays (what another instance adds),
//! one relay in its default (best) configuration, the same on hot aggregates (100 versions each) and on
//! an empty table — and the seed article's algorithm on an identical table as the baseline. CPU per
//! relayed event is split between the relay processes, their PostgreSQL sessions and nats-server.

use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use async_nats::jetstream;
use serde::Serialize;
use sqlx::PgPool;
use store::outbox::fixtures;
use testkit::stats::median;
use uuid::Uuid;

use super::server_marks::ServerMark;
use super::usage::{Sampler, Watched, nats_pids};
use super::{Profile, Progress};
use crate::demo::services::Services;
use crate::process::{self, Launch, binary};

const STREAM: &str = "BENCH_LAB_RELAY";
const PREFIX: &str = "bench.lab.relay";
/// The database with the sent-row history, and the one without.
const DATABASE: &str = "waybill_bench_lab_relay";
const EMPTY_DATABASE: &str = "waybill_bench_lab_relay_empty";
/// Events kept in a bench database before it is built again (about 3 GB).
const MAX_EVENTS: f64 = 6_000_000.0;

/// CPU microseconds per relayed event, by component.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub(super) struct CpuPerEvent {
    /// All three.
    pub total: f64,
    /// The relay processes.
    pub relay: f64,
    /// Their PostgreSQL sessions.
    pub postgres: f64,
    /// nats-server.
    pub nats: f64,
}

/// The relay's figures (events/s are medians over the rounds). A drain's rate is its events over
/// the time from the first claim to the last row marked sent, both read from the rows (the relay's
/// clock at the claim, PostgreSQL's at the mark: one machine): a relay runs for days, and its
/// process's start (connections, its seat among the relays) and end are not draining. `wall` has
/// the same drains timed from the processes' start to their exit.
#[derive(Debug, Clone, Serialize)]
pub(super) struct RelayFigures {
    /// One relay, one lane, with the history present.
    pub one: f64,
    /// Two relays, one lane each, with the history present.
    pub two: f64,
    /// Three relays, one lane each: not a target, it shows whether a third adds anything, i.e.
    /// whether two already reach what this machine's cores allow.
    pub three: f64,
    /// One relay in its default configuration, with the history present.
    pub best: f64,
    /// The same on aggregates of `hot_versions` versions.
    pub hot: f64,
    /// The same on a table without history.
    pub best_empty_table: f64,
    /// The seed article's algorithm.
    pub baseline: f64,
    /// CPU per event of `best` (medians per component).
    pub cpu_us: CpuPerEvent,
    /// CPU per event of `one`.
    pub cpu_us_one_lane: CpuPerEvent,
    /// Peak resident memory of the relay during `best`, KiB.
    pub best_peak_rss_kib: u64,
    /// Every round's rate per mode.
    pub runs: Runs,
    /// Medians of `one`, `two` and `best` timed from the processes' start to their exit, events/s.
    pub wall: PerMode,
    /// Cores kept busy (by everything on the machine) during the one-, two- and three-relay drains,
    /// medians: how close each comes to the machine's ceiling.
    pub busy_cores: Busy,
    /// WAL the server wrote per relayed event during the one-, two-relay and best drains, bytes
    /// (medians): the relay's share of an event's WAL (the command and the projections write the
    /// rest; docs/production.md sizes `max_wal_size` from the whole pipeline's).
    pub wal_bytes_per_event: PerMode,
    /// Events per drain, sent rows present, versions per hot aggregate.
    pub events: i64,
    /// Sent rows present during the drains (except `best_empty_table`).
    pub history: i64,
    /// Versions per aggregate in `hot`.
    pub hot_versions: i64,
}

/// Every round's rate per mode.
#[derive(Debug, Clone, Default, Serialize)]
pub(super) struct Runs {
    pub one: Vec<f64>,
    pub two: Vec<f64>,
    pub three: Vec<f64>,
    pub best: Vec<f64>,
    pub hot: Vec<f64>,
    pub best_empty_table: Vec<f64>,
    pub baseline: Vec<f64>,
    /// CPU µs per event of the best drain (relay + PostgreSQL + nats-server), each round.
    pub cpu_us_total: Vec<f64>,
    /// Cores busy during the one-, two- and three-relay drains, each round.
    pub busy_cores_one: Vec<f64>,
    pub busy_cores_two: Vec<f64>,
    pub busy_cores_three: Vec<f64>,
    /// Whether a checkpoint ended during each round's one-, two-, three-relay and best drain, from
    /// the processes' start to their exit (`null`: the server did not say). A drain that a
    /// checkpoint's closing `fsync`s fell into reads low, so this says which rounds' rates to
    /// trust less.
    pub checkpoint_one: Vec<Option<bool>>,
    pub checkpoint_two: Vec<Option<bool>>,
    pub checkpoint_three: Vec<Option<bool>>,
    pub checkpoint_best: Vec<Option<bool>>,
}

/// Cores busy on the whole machine while relays drained, from the processes' start to their exit
/// (medians).
#[derive(Debug, Clone, Default, Serialize)]
pub(super) struct Busy {
    pub one: f64,
    pub two: f64,
    pub three: f64,
}

/// One figure (a median) for each of the one-relay, two-relay and best drains.
#[derive(Debug, Clone, Default, Serialize)]
pub(super) struct PerMode {
    pub one: f64,
    pub two: f64,
    pub best: f64,
}

/// How a drain is run.
#[derive(Debug, Clone, Copy)]
struct Drain {
    instances: usize,
    /// `None`: the relay's default.
    lanes: Option<usize>,
}

/// One drain's outcome.
struct Drained {
    /// From the first claim to the last mark.
    rate: f64,
    /// From the processes' start to their exit.
    wall_rate: f64,
    cpu: CpuPerEvent,
    peak_rss_kib: u64,
    /// Cores busy on the whole machine from the processes' start to their exit.
    busy_cores: f64,
    /// WAL the server wrote per event, from the processes' start to their exit.
    wal_bytes_per_event: f64,
    /// A checkpoint ended during the drain (`None`: the server did not say).
    checkpoint: Option<bool>,
}

/// Runs every relay measurement.
pub(super) async fn measure(
    services: &Services,
    profile: &Profile,
    progress: &Progress,
) -> anyhow::Result<RelayFigures> {
    let url = services.database_url(DATABASE);
    let empty_url = services.database_url(EMPTY_DATABASE);
    let pool = prepare(services, DATABASE).await?;
    let empty_pool = prepare(services, EMPTY_DATABASE).await?;
    let js = super::fresh_stream(&services.nats_url, STREAM, PREFIX).await?;
    prepare_history(&pool, profile.history, progress).await?;
    fixtures::truncate(&empty_pool).await?;

    let one_lane = Drain {
        instances: 1,
        lanes: Some(1),
    };
    let two_one_lane = Drain {
        instances: 2,
        lanes: Some(1),
    };
    let three_one_lane = Drain {
        instances: 3,
        lanes: Some(1),
    };
    let best = Drain {
        instances: 1,
        lanes: None,
    };
    let events = profile.relay_events;
    let mut runs = Runs::default();
    let mut wall = Runs::default();
    let (mut cpu_best, mut cpu_one, mut rss) = (Vec::new(), Vec::new(), Vec::new());
    let mut wal_per_event = Runs::default();
    for round in 1..=profile.rounds {
        let fixture = Fixture {
            pool: &pool,
            url: &url,
            js: &js,
            nats_url: &services.nats_url,
        };
        let drained = fixture.drain(one_lane, events, 3).await?;
        runs.one.push(drained.rate);
        runs.busy_cores_one.push(drained.busy_cores);
        runs.checkpoint_one.push(drained.checkpoint);
        wal_per_event.one.push(drained.wal_bytes_per_event);
        wall.one.push(drained.wall_rate);
        cpu_one.push(drained.cpu);
        let drained = fixture.drain(two_one_lane, events, 3).await?;
        runs.two.push(drained.rate);
        runs.busy_cores_two.push(drained.busy_cores);
        runs.checkpoint_two.push(drained.checkpoint);
        wal_per_event.two.push(drained.wal_bytes_per_event);
        wall.two.push(drained.wall_rate);
        let drained = fixture.drain(three_one_lane, events, 3).await?;
        runs.three.push(drained.rate);
        runs.busy_cores_three.push(drained.busy_cores);
        runs.checkpoint_three.push(drained.checkpoint);
        let drained = fixture.drain(best, events, 3).await?;
        runs.best.push(drained.rate);
        runs.checkpoint_best.push(drained.checkpoint);
        wal_per_event.best.push(drained.wal_bytes_per_event);
        wall.best.push(drained.wall_rate);
        runs.cpu_us_total.push(drained.cpu.total);
        cpu_best.push(drained.cpu);
        rss.push(drained.peak_rss_kib as f64);
        runs.hot.push(
            fixture
                .drain(best, events, profile.hot_versions)
                .await?
                .rate,
        );
        let empty = Fixture {
            pool: &empty_pool,
            url: &empty_url,
            ..fixture
        };
        runs.best_empty_table
            .push(empty.drain(best, events, 3).await?.rate);
        runs.baseline.push(
            fixture
                .baseline(events, Duration::from_secs_f64(profile.baseline_seconds))
                .await?,
        );
        progress.say(&format!(
            "relay round {round}/{}: one {:.0}, two {:.0}, three {:.0}, best {:.0}, hot {:.0}, best \
             on an empty table {:.0}, baseline {:.0} events/s",
            profile.rounds,
            runs.one[round - 1],
            runs.two[round - 1],
            runs.three[round - 1],
            runs.best[round - 1],
            runs.hot[round - 1],
            runs.best_empty_table[round - 1],
            runs.baseline[round - 1],
        ));
    }
    Fixture {
        pool: &pool,
        url: &url,
        js: &js,
        nats_url: &services.nats_url,
    }
    .clear()
    .await?;
    fixtures::truncate(&empty_pool).await?;
    let _ = js.get_stream(STREAM).await?.purge().await;
    Ok(RelayFigures {
        one: median(runs.one.clone()),
        two: median(runs.two.clone()),
        three: median(runs.three.clone()),
        best: median(runs.best.clone()),
        hot: median(runs.hot.clone()),
        best_empty_table: median(runs.best_empty_table.clone()),
        baseline: median(runs.baseline.clone()),
        cpu_us: median_cpu(&cpu_best),
        cpu_us_one_lane: median_cpu(&cpu_one),
        #[allow(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            reason = "the median of peak RSS figures (KiB, from u64s): non-negative and in range"
        )]
        best_peak_rss_kib: median(rss) as u64,
        busy_cores: Busy {
            one: median(runs.busy_cores_one.clone()),
            two: median(runs.busy_cores_two.clone()),
            three: median(runs.busy_cores_three.clone()),
        },
        runs,
        wal_bytes_per_event: PerMode {
            one: median(wal_per_event.one),
            two: median(wal_per_event.two),
            best: median(wal_per_event.best),
        },
        wall: PerMode {
            one: median(wall.one),
            two: median(wall.two),
            best: median(wall.best),
        },
        events,
        history: profile.history,
        hot_versions: profile.hot_versions,
    })
}

fn median_cpu(samples: &[CpuPerEvent]) -> CpuPerEvent {
    let of = |f: fn(&CpuPerEvent) -> f64| median(samples.iter().map(f).collect());
    CpuPerEvent {
        total: of(|c| c.total),
        relay: of(|c| c.relay),
        postgres: of(|c| c.postgres),
        nats: of(|c| c.nats),
    }
}

/// Connects to (and creates, and migrates) a bench database. Events are immutable, so the rows every
/// drain adds stay: past `MAX_EVENTS` the database is dropped and built again.
async fn prepare(services: &Services, name: &str) -> anyhow::Result<PgPool> {
    let url = services.database_url(name);
    ops::database::ensure_database(&url).await?;
    let mut pool = ops::database::connect(&url, "waybill-bench", 8).await?;
    store::migrate(&pool).await?;
    let events: f64 =
        sqlx::query_scalar("SELECT reltuples::float8 FROM pg_class WHERE relname = 'events'")
            .fetch_one(&pool)
            .await?;
    if events > MAX_EVENTS {
        pool.close().await;
        pool = crate::demo::fresh_database(services, name, &url).await?;
    }
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS baseline_outbox (
            id BIGSERIAL PRIMARY KEY,
            event_id UUID NOT NULL,
            aggregate_id UUID NOT NULL,
            topic TEXT NOT NULL,
            payload JSONB NOT NULL,
            status TEXT NOT NULL CHECK (status IN ('pending', 'processing', 'sent', 'failed')),
            attempts INTEGER NOT NULL DEFAULT 0,
            next_run_at TIMESTAMPTZ NOT NULL DEFAULT now(),
            locked_by TEXT, locked_at TIMESTAMPTZ, last_error TEXT,
            created_at TIMESTAMPTZ NOT NULL DEFAULT now(), sent_at TIMESTAMPTZ)",
    )
    .execute(&pool)
    .await?;
    sqlx::query("CREATE INDEX IF NOT EXISTS baseline_outbox_ready_idx ON baseline_outbox (status, next_run_at, id)")
        .execute(&pool)
        .await?;
    Ok(pool)
}

/// Makes sure `history` sent rows sit in both outbox tables (created once, reused by later runs).
async fn prepare_history(pool: &PgPool, history: i64, progress: &Progress) -> anyhow::Result<()> {
    for table in [Table::Outbox, Table::Baseline] {
        let sent: i64 = match table {
            Table::Outbox => fixtures::history_rows(pool).await?,
            Table::Baseline => sqlx::query_scalar(
                "SELECT count(*) FROM baseline_outbox WHERE status = 'sent' AND sent_at IS NULL",
            )
            .fetch_one(pool)
            .await?,
        };
        let missing = history - sent;
        if missing > 0 {
            progress.say(&format!(
                "adding {missing} sent rows of history to {} (once; later runs reuse them)",
                table.name()
            ));
            for chunk_start in (0..missing).step_by(100_000) {
                seed(pool, (missing - chunk_start).min(100_000), 3, table, "sent").await?;
            }
        }
    }
    vacuum_analyze_both(pool).await
}

/// The two outbox tables: the project's and the baseline's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Table {
    Outbox,
    Baseline,
}

impl Table {
    fn name(self) -> &'static str {
        match self {
            Self::Outbox => store::outbox::TABLE,
            Self::Baseline => "baseline_outbox",
        }
    }
}

/// Vacuums and analyzes both outbox tables, as autovacuum would between bursts.
async fn vacuum_analyze_both(pool: &PgPool) -> anyhow::Result<()> {
    fixtures::vacuum_analyze(pool).await?;
    sqlx::query("VACUUM ANALYZE baseline_outbox")
        .execute(pool)
        .await?;
    Ok(())
}

/// The envelope of an `ev` row, as JSON text.
const BODY: &str = "jsonb_build_object('event_id', event_id, 'event_type', event_type, 'event_version', event_version,
    'aggregate_type', 'order', 'aggregate_id', aggregate_id, 'aggregate_version', aggregate_version,
    'occurred_at', occurred_at, 'correlation_id', null, 'causation_id', null, 'payload', payload)::text";

/// Inserts `events` events in aggregates of `versions` versions, interleaved (every version 1, then
/// every version 2, …), into `events` and into `table` with `status`. History rows (`sent`) get no
/// stream sequence (in `outbox`) or sent time (in `baseline_outbox`), which tells them apart from rows
/// a drain sent.
pub(super) async fn seed(
    pool: &PgPool,
    events: i64,
    versions: i64,
    table: Table,
    status: &str,
) -> anyhow::Result<()> {
    let aggregates = (events + versions - 1) / versions;
    let rows = "WITH aggs AS (SELECT a, gen_random_uuid() AS aggregate_id FROM generate_series(1, $1::int) a),
        rows AS (
            SELECT gen_random_uuid() AS event_id, aggregate_id, v AS aggregate_version,
                   (ARRAY['order.placed', 'order.paid', 'order.shipped'])[least(v, 3)] AS event_type,
                   (ARRAY[3, 1, 1])[least(v, 3)] AS event_version,
                   (ARRAY['{\"customer_id\": \"bench\", \"currency\": \"EUR\", \"channel\": \"web\", \"lines\": [{\"sku\": \"MUG\", \"quantity\": 1, \"unit_price_cents\": 100}], \"total_cents\": 100}',
                          '{\"amount_cents\": 100, \"payment_ref\": null}',
                          '{\"carrier\": \"DHL\", \"tracking_number\": \"T\"}'])[least(v, 3)]::jsonb AS payload
            FROM generate_series(1, $4::int) v, aggs ORDER BY v, a LIMIT $2),
        ev AS (INSERT INTO events (event_id, event_type, event_version, aggregate_type, aggregate_id,
                                   aggregate_version, occurred_at, payload)
               SELECT event_id, event_type, event_version, 'order', aggregate_id, aggregate_version, now(), payload
               FROM rows RETURNING *)";
    let sql = match table {
        Table::Outbox => format!("{rows} {}", fixtures::seed_insert(BODY)),
        Table::Baseline => format!(
            "{rows} INSERT INTO baseline_outbox (event_id, aggregate_id, topic, payload, status)
             SELECT event_id, aggregate_id, event_type, {BODY}::jsonb, $3 FROM ev ORDER BY position"
        ),
    };
    sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(aggregates)
        .bind(events)
        .bind(status)
        .bind(versions)
        .execute(pool)
        .await?;
    Ok(())
}

/// One database and the stream, ready for drains.
#[derive(Clone, Copy)]
struct Fixture<'a> {
    pool: &'a PgPool,
    url: &'a str,
    js: &'a jetstream::Context,
    nats_url: &'a str,
}

impl Fixture<'_> {
    /// Removes what earlier drains left (everything but the history), vacuums as autovacuum would
    /// between bursts, and empties the stream.
    async fn clear(&self) -> anyhow::Result<()> {
        fixtures::clear_all_but_history(self.pool).await?;
        sqlx::query("DELETE FROM baseline_outbox WHERE status <> 'sent' OR sent_at IS NOT NULL")
            .execute(self.pool)
            .await?;
        vacuum_analyze_both(self.pool).await?;
        self.js.get_stream(STREAM).await?.purge().await?;
        Ok(())
    }

    /// Seeds `events` pending rows in aggregates of `versions`, then drains them with `how`.
    async fn drain(&self, how: Drain, events: i64, versions: i64) -> anyhow::Result<Drained> {
        self.clear().await?;
        seed(self.pool, events, versions, Table::Outbox, "pending").await?;
        // Planned for what the table holds now (an empty table's statistics would mislead the claim).
        fixtures::analyze(self.pool).await?;
        let nats = nats_pids(self.nats_url);
        let relay = binary("waybill-relay")?;
        let mark = ServerMark::take(self.pool).await?;
        let started = Instant::now();
        let ticks_at_start = testkit::stats::machine_cpu_ticks();
        let logs = tempfile::Builder::new()
            .prefix("waybill-bench-relays-")
            .tempdir()?;
        let mut children = Vec::new();
        for i in 0..how.instances {
            let name = format!("bench-{i}");
            let mut args: Vec<String> = [
                "run",
                "--once",
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
                &name,
            ]
            .map(str::to_owned)
            .to_vec();
            if let Some(lanes) = how.lanes {
                args.extend(["--lanes".to_owned(), lanes.to_string()]);
            }
            let launch = Launch {
                program: &relay,
                args: &args,
                env: &[("RUST_LOG".to_owned(), "warn".to_owned())],
                clear_env: false,
                unset: &[],
                name: &name,
            };
            children.push((name.clone(), launch.spawn(logs.path())?));
        }
        let relay_pids: Vec<u32> = children.iter().filter_map(|(_, c)| c.id()).collect();
        let sampler = Sampler::start(
            self.pool.clone(),
            vec![
                ("relay".into(), Watched::Pids(relay_pids)),
                (
                    "postgres".into(),
                    Watched::Sessions("waybill-relay bench-".into()),
                ),
                ("nats".into(), Watched::Pids(nats)),
            ],
        );
        for (name, mut child) in children {
            let status = child.wait().await?;
            anyhow::ensure!(
                status.success(),
                "waybill-relay {name} exited with {status}{}",
                process::log_tail(logs.path(), &name)
            );
        }
        let elapsed = started.elapsed().as_secs_f64();
        let server = mark.until_now(self.pool).await?;
        let busy_cores = testkit::stats::busy_cores(
            ticks_at_start,
            testkit::stats::machine_cpu_ticks(),
            testkit::stats::machine_cpus(),
        )
        .unwrap_or(0.0);
        let usage = sampler.finish().await;
        let (sent, drain_seconds) = fixtures::relayed(self.pool).await?;
        anyhow::ensure!(sent == events, "only {sent} of {events} rows were sent");
        let drain_seconds =
            drain_seconds.ok_or_else(|| anyhow::anyhow!("no sent row has a claim time"))?;
        let per_event =
            |name: &str| usage.get(name).map_or(0.0, |u| u.cpu_seconds) * 1e6 / events as f64;
        let (relay, postgres, nats) =
            (per_event("relay"), per_event("postgres"), per_event("nats"));
        Ok(Drained {
            // A floor against a clock step: the window cannot be shorter than a millisecond.
            rate: events as f64 / drain_seconds.max(0.001),
            wall_rate: events as f64 / elapsed,
            cpu: CpuPerEvent {
                total: relay + postgres + nats,
                relay,
                postgres,
                nats,
            },
            peak_rss_kib: usage.get("relay").map_or(0, |u| u.peak_rss_kib),
            busy_cores,
            wal_bytes_per_event: server.wal_bytes as f64 / events as f64,
            checkpoint: server.checkpoint_ended,
        })
    }

    /// The seed article's relay, transcribed: claim 10 rows (one UPDATE each to `processing`), publish
    /// one at a time awaiting each PubAck, one UPDATE per mark-sent. Runs for `duration` on `events`
    /// fresh rows; returns events/s.
    async fn baseline(&self, events: i64, duration: Duration) -> anyhow::Result<f64> {
        self.clear().await?;
        seed(self.pool, events, 3, Table::Baseline, "pending").await?;
        sqlx::query("ANALYZE baseline_outbox")
            .execute(self.pool)
            .await?;
        let started = Instant::now();
        let mut relayed = 0u64;
        while started.elapsed() < duration {
            let mut tx = self.pool.begin().await?;
            let rows: Vec<BaselineRow> = sqlx::query_as(
                "SELECT id, topic, payload::text AS payload, event_id FROM baseline_outbox
                 WHERE status IN ('pending', 'failed') AND next_run_at <= now()
                 ORDER BY id LIMIT 10 FOR UPDATE SKIP LOCKED",
            )
            .fetch_all(&mut *tx)
            .await?;
            if rows.is_empty() {
                break;
            }
            for row in &rows {
                sqlx::query("UPDATE baseline_outbox SET status = 'processing', attempts = attempts + 1, locked_by = 'baseline', locked_at = now() WHERE id = $1")
                    .bind(row.id)
                    .execute(&mut *tx)
                    .await?;
            }
            tx.commit().await?;
            for row in rows {
                let mut headers = HeaderMap::new();
                headers.insert("Nats-Msg-Id", row.event_id.to_string().as_str());
                self.js
                    .publish_with_headers(
                        format!("{PREFIX}.{}.baseline", row.topic),
                        headers,
                        row.payload.into(),
                    )
                    .await?
                    .await?;
                sqlx::query("UPDATE baseline_outbox SET status = 'sent', sent_at = now(), locked_by = NULL, locked_at = NULL WHERE id = $1")
                    .bind(row.id)
                    .execute(self.pool)
                    .await?;
                relayed += 1;
            }
        }
        Ok(relayed as f64 / started.elapsed().as_secs_f64())
    }
}

/// A row the baseline relay claimed.
#[derive(sqlx::FromRow)]
struct BaselineRow {
    id: i64,
    topic: String,
    payload: String,
    event_id: Uuid,
}
