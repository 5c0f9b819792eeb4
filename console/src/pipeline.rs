//! The pipeline at one moment (a [`Snapshot`]: the event store, the outbox, the relays, the stream and
//! each projection) and the last minutes of them (a [`History`] of samples), from which rates and the
//! charts' series are derived. Rates are differences between samples, so they are true for every
//! process writing or reading the pipeline, not only this one.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;
use tokio::sync::Mutex;

use crate::readside::{self, ProjectionState};
use crate::relays::{self, RelayMetricsView};
use crate::stream::{ConsumerView, PartitionView, StreamSource, StreamView};
use crate::upstream::Endpoint;

/// Samples kept: ten minutes at one sample every two seconds.
pub(crate) const HISTORY_LEN: usize = 300;

/// Rates are measured over (about) this many seconds, so one slow sample does not make them jump.
const RATE_WINDOW_S: f64 = 10.0;

/// How the console's overview sees `events`.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct EventsView {
    /// Rows in `events`; `None` when they could not be counted (never a misleading 0).
    pub stored: Option<i64>,
    /// The same rows by aggregate type (`order`, `customer`, …): a projection is behind the store by
    /// the events of the types it reads only.
    pub by_type: BTreeMap<String, i64>,
    /// When the newest was recorded.
    pub last_recorded_at: Option<DateTime<Utc>>,
    /// Why they could not be counted.
    pub error: Option<String>,
}

/// What the database knows of the relays.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct RelayView {
    /// Relays connected to this database: distinct `application_name`s `waybill-relay <id>`, since
    /// each relay opens a pool of several sessions under one name.
    pub connected: Option<i64>,
    /// When a row was last marked sent (from the outbox's newest rows).
    pub last_sent_at: Option<DateTime<Utc>>,
    /// The relays' own counters, scraped from their /metrics (`--relay-metrics`).
    pub metrics: RelayMetricsView,
    /// This database's logical replication slots (a WAL relay's, `run --source wal`): reader, lag
    /// in bytes and seconds, WAL retained, whether it risks invalidation. Empty when there are none
    /// or the server cannot say.
    pub wal_slots: Vec<relay::wal::slot::SlotState>,
}

/// One projection: its tables, its consumer, and how far behind it is.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct ProjectionView {
    /// What its tables say.
    #[serde(flatten)]
    pub state: ProjectionState,
    /// Its durable consumer, when NATS answered.
    pub consumer: Option<ConsumerView>,
    /// Its partitions' consumers and who holds each (empty when it is not partitioned).
    pub partitions: Vec<PartitionView>,
    /// Messages of the stream it has not settled (undelivered + unacknowledged), when known.
    pub behind_stream: Option<u64>,
    /// Events of the aggregate types it reads stored but not applied by it (stored − applied), when
    /// both could be read.
    pub behind_store: Option<i64>,
    /// The aggregate types it reads.
    pub reads: &'static [&'static str],
    /// For a read model of `projections/src/models/`, what it answers (its document is at
    /// `/console/projections/<name>/document`); `None` for a built-in projection.
    pub about: Option<&'static str>,
}

/// Rates over the last seconds, when two samples exist.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct Rates {
    /// Events appended per second (every accepted command appends one).
    pub events_per_s: Option<f64>,
    /// Messages stored in the stream per second (the relays' publishes, copies excluded).
    pub published_per_s: Option<f64>,
    /// Events applied per second, per projection.
    pub applied_per_s: BTreeMap<&'static str, f64>,
}

/// The pipeline at one moment; each part that could not be read carries why instead of zeros.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Snapshot {
    pub taken_at: DateTime<Utc>,
    pub events: EventsView,
    /// The outbox, as `waybill outbox status` reports it.
    pub outbox: Option<relay::admin::OutboxStatus>,
    pub outbox_error: Option<String>,
    pub relay: RelayView,
    pub stream: StreamView,
    /// In [`readside::names`] order.
    pub projections: Vec<ProjectionView>,
    /// Rates from the history (filled in by [`History::push`]).
    pub rates: Rates,
}

impl Snapshot {
    /// Reads everything, and scrapes the relays' metrics at `relays`; parts that cannot be read say
    /// why.
    pub(crate) async fn take(
        pool: &PgPool,
        counter: &EventCounter,
        stream: &StreamSource,
        relays: &[Endpoint],
    ) -> Self {
        // Scraped while the database and the stream are read: a relay that does not answer costs
        // the sample its timeout at most, not its timeout on top of the rest.
        let (scraped, mut snapshot) = tokio::join!(
            relays::scrape_all(relays),
            Self::read(pool, counter, stream)
        );
        snapshot.relay.metrics = scraped;
        snapshot
    }

    async fn read(pool: &PgPool, counter: &EventCounter, stream: &StreamSource) -> Self {
        let events = counter.read(pool).await;
        let (outbox, outbox_error) = match relay::admin::status(pool, false).await {
            Ok(status) => (Some(status), None),
            Err(error) => {
                tracing::warn!(%error, "console cannot read the outbox");
                (None, Some(error.to_string()))
            }
        };
        let relay = read_relay(pool).await;
        let names = readside::names();
        let stream = stream.view(names).await;
        let mut projections = Vec::with_capacity(names.len());
        for &name in names {
            let state = readside::state(pool, name).await;
            let consumer = stream.consumers.iter().find(|c| c.name == name).cloned();
            let partitions = stream.partitions.get(name).cloned().unwrap_or_default();
            // A partitioned projection is behind by what its partitions' consumers have not settled.
            let behind_stream = consumer
                .as_ref()
                .filter(|c| c.found)
                .map(ConsumerView::lag)
                .or_else(|| {
                    (!partitions.is_empty())
                        .then(|| partitions.iter().map(|p| p.consumer.lag()).sum())
                });
            let reads = projections::registry::aggregates(name).unwrap_or_default();
            let of_its_types = events.stored.map(|_| {
                reads
                    .iter()
                    .map(|t| events.by_type.get(*t).copied().unwrap_or(0))
                    .sum::<i64>()
            });
            projections.push(ProjectionView {
                behind_store: of_its_types
                    .zip(state.applied)
                    .map(|(stored, applied)| (stored - applied).max(0)),
                state,
                consumer,
                partitions,
                behind_stream,
                reads,
                about: projections::registry::model(name).map(|model| model.about()),
            });
        }
        Self {
            taken_at: Utc::now(),
            events,
            outbox,
            outbox_error,
            relay,
            stream,
            projections,
            rates: Rates::default(),
        }
    }
}

/// A row may commit after rows with higher positions (identity values are taken before commit), so
/// positions are only trusted as a boundary once this old: no append transaction runs this long.
const SETTLE_AFTER: Duration = Duration::from_secs(60);

/// Counts `events` incrementally. Events are append-only (a trigger forbids deletes), so the rows up
/// to a settled position never change: each sample counts only the rows above it, which by the
/// primary key is a short range scan instead of a full count of an ever-growing table.
#[derive(Debug, Default)]
pub(crate) struct EventCounter {
    state: Mutex<CounterState>,
}

#[derive(Debug, Default)]
struct CounterState {
    /// Rows with `position <= settled_position`, counted once and final, by aggregate type.
    settled_position: i64,
    settled_counts: BTreeMap<String, i64>,
    /// The highest position seen by an earlier sample, and when: it becomes the settled boundary
    /// once [`SETTLE_AFTER`] has passed, so late commits below it are still counted.
    candidate: Option<(Instant, i64)>,
}

impl EventCounter {
    async fn read(&self, pool: &PgPool) -> EventsView {
        let mut state = self.state.lock().await;
        match Self::count(pool, &mut state).await {
            Ok((by_type, last_recorded_at)) => EventsView {
                stored: Some(by_type.values().sum()),
                by_type,
                last_recorded_at,
                error: None,
            },
            Err(error) => {
                tracing::warn!(%error, "console cannot count events");
                EventsView {
                    error: Some(error.to_string()),
                    ..EventsView::default()
                }
            }
        }
    }

    async fn count(
        pool: &PgPool,
        state: &mut CounterState,
    ) -> sqlx::Result<(BTreeMap<String, i64>, Option<DateTime<Utc>>)> {
        if let Some((seen_at, position)) = state.candidate
            && seen_at.elapsed() >= SETTLE_AFTER
        {
            let settled: Vec<(String, i64)> = sqlx::query_as(
                "SELECT aggregate_type, count(*) FROM events
                 WHERE position > $1 AND position <= $2 GROUP BY aggregate_type",
            )
            .bind(state.settled_position)
            .bind(position)
            .fetch_all(pool)
            .await?;
            for (aggregate_type, count) in settled {
                *state.settled_counts.entry(aggregate_type).or_default() += count;
            }
            state.settled_position = position;
            state.candidate = None;
        }
        let above: Vec<(String, i64, i64)> = sqlx::query_as(
            "SELECT aggregate_type, count(*), max(position) FROM events
             WHERE position > $1 GROUP BY aggregate_type",
        )
        .bind(state.settled_position)
        .fetch_all(pool)
        .await?;
        let last_recorded_at: Option<DateTime<Utc>> =
            sqlx::query_scalar("SELECT recorded_at FROM events ORDER BY position DESC LIMIT 1")
                .fetch_optional(pool)
                .await?;
        let newest = above.iter().map(|(_, _, position)| *position).max();
        if state.candidate.is_none()
            && let Some(newest) = newest
        {
            state.candidate = Some((Instant::now(), newest));
        }
        let mut counts = state.settled_counts.clone();
        for (aggregate_type, count, _) in above {
            *counts.entry(aggregate_type).or_default() += count;
        }
        Ok((counts, last_recorded_at))
    }
}

async fn read_relay(pool: &PgPool) -> RelayView {
    // Distinct names: a relay's pool holds several sessions, all named after its relay id.
    let connected = sqlx::query_scalar(
        "SELECT count(DISTINCT application_name) FROM pg_stat_activity
         WHERE datname = current_database() AND application_name LIKE 'waybill-relay %'",
    )
    .fetch_one(pool)
    .await
    .ok();
    let last_sent_at = store::outbox::admin::last_sent_at(pool)
        .await
        .ok()
        .flatten();
    let wal_slots = relay::wal::slot::database_slots(pool)
        .await
        .unwrap_or_default();
    RelayView {
        connected,
        last_sent_at,
        metrics: RelayMetricsView::default(),
        wal_slots,
    }
}

/// One sample of the history: the counters the charts and rates are derived from.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Sample {
    /// Milliseconds since the Unix epoch.
    pub t: i64,
    /// Events stored, when they could be counted.
    pub events: Option<i64>,
    /// The stream's last sequence, when NATS answered.
    pub stream_last: Option<u64>,
    /// Outbox rows not yet sent (pending + failed + dead).
    pub unsent: Option<i64>,
    /// Per projection (in [`readside::names`] order): events applied, when its tables were read.
    pub applied: Vec<Option<i64>>,
    /// Per projection: how far behind (the stream when known, else the store).
    pub lag: Vec<Option<i64>>,
}

impl Sample {
    fn of(snapshot: &Snapshot) -> Self {
        Self {
            t: snapshot.taken_at.timestamp_millis(),
            events: snapshot.events.stored,
            stream_last: snapshot
                .stream
                .available
                .then_some(snapshot.stream.last_sequence),
            unsent: snapshot
                .outbox
                .as_ref()
                .map(|o| o.pending + o.failed + o.dead),
            applied: snapshot
                .projections
                .iter()
                .map(|p| p.state.applied)
                .collect(),
            lag: snapshot
                .projections
                .iter()
                .map(|p| {
                    p.behind_stream
                        .map(|l| i64::try_from(l).unwrap_or(i64::MAX))
                        .or(p.behind_store)
                })
                .collect(),
        }
    }
}

/// The last minutes of samples, oldest first.
#[derive(Debug, Default)]
pub(crate) struct History {
    samples: VecDeque<Sample>,
    latest: Option<Snapshot>,
}

/// The charts' data: per series, `[t_ms, value]` points.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct Series {
    /// Throughput: events appended, messages stored in the stream, events applied per projection.
    pub throughput: BTreeMap<String, Vec<(i64, f64)>>,
    /// Backlog: outbox rows unsent, and each projection's lag.
    pub backlog: BTreeMap<String, Vec<(i64, f64)>>,
}

impl History {
    /// Records `snapshot`, fills in its rates (from counters read in both samples only), and keeps
    /// it as the latest.
    pub(crate) fn push(&mut self, mut snapshot: Snapshot) -> Snapshot {
        let sample = Sample::of(&snapshot);
        // The oldest sample inside the rate window, or else the previous one.
        let base = self
            .samples
            .iter()
            .find(|s| (sample.t - s.t) as f64 / 1000.0 <= RATE_WINDOW_S)
            .or(self.samples.back())
            .filter(|s| s.t < sample.t)
            .cloned();
        if let Some(base) = base {
            let seconds = (sample.t - base.t) as f64 / 1000.0;
            let rate = |now: i64, then: i64| ((now - then).max(0)) as f64 / seconds;
            snapshot.rates.events_per_s = sample
                .events
                .zip(base.events)
                .map(|(now, then)| rate(now, then));
            snapshot.rates.published_per_s =
                sample.stream_last.zip(base.stream_last).map(|(now, then)| {
                    // Stream sequences stay far below 2^63; saturating keeps a hostile one harmless.
                    rate(
                        i64::try_from(now).unwrap_or(i64::MAX),
                        i64::try_from(then).unwrap_or(i64::MAX),
                    )
                });
            for (i, name) in readside::names().iter().enumerate() {
                if let (Some(Some(now)), Some(Some(then))) =
                    (sample.applied.get(i), base.applied.get(i))
                {
                    snapshot.rates.applied_per_s.insert(name, rate(*now, *then));
                }
            }
        }
        if self.samples.len() == HISTORY_LEN {
            self.samples.pop_front();
        }
        self.samples.push_back(sample);
        self.latest = Some(snapshot.clone());
        snapshot
    }

    pub(crate) fn latest(&self) -> Option<&Snapshot> {
        self.latest.as_ref()
    }

    /// The charts' series over the kept samples.
    pub(crate) fn series(&self) -> Series {
        let mut series = Series::default();
        let pairs = self.samples.iter().zip(self.samples.iter().skip(1));
        for (then, now) in pairs {
            let seconds = (now.t - then.t) as f64 / 1000.0;
            if seconds <= 0.0 {
                continue;
            }
            let mut put = |name: &str, value: f64| {
                series
                    .throughput
                    .entry(name.to_owned())
                    .or_default()
                    .push((now.t, value.max(0.0) / seconds));
            };
            if let (Some(a), Some(b)) = (now.events, then.events) {
                put("events", (a - b) as f64);
            }
            if let (Some(a), Some(b)) = (now.stream_last, then.stream_last) {
                // A recreated stream starts again from 1: no negative throughput.
                put("stream", a.saturating_sub(b) as f64);
            }
            for (i, name) in readside::names().iter().enumerate() {
                if let (Some(Some(a)), Some(Some(b))) = (now.applied.get(i), then.applied.get(i)) {
                    put(name, (a - b) as f64);
                }
            }
        }
        for sample in &self.samples {
            if let Some(unsent) = sample.unsent {
                series
                    .backlog
                    .entry("outbox".to_owned())
                    .or_default()
                    .push((sample.t, unsent as f64));
            }
            for (i, name) in readside::names().iter().enumerate() {
                if let Some(Some(lag)) = sample.lag.get(i) {
                    series
                        .backlog
                        .entry((*name).to_owned())
                        .or_default()
                        .push((sample.t, *lag as f64));
                }
            }
        }
        series
    }
}
