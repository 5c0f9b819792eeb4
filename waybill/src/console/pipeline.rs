//! The pipeline at one moment (a [`Snapshot`]: the event store, the outbox, the relays, the stream and
//! each projection) and the last minutes of them (a [`History`] of samples), from which rates and the
//! charts' series are derived. Rates are differences between samples, so they are true for every
//! process writing or reading the pipeline, not only this one.

use std::collections::{BTreeMap, VecDeque};

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;

use super::readside::{self, PROJECTIONS, ProjectionState};
use super::relays::{self, MetricsUrl, RelayMetricsView};
use super::stream::{ConsumerView, StreamSource, StreamView};

/// Samples kept: ten minutes at one sample every two seconds.
pub const HISTORY_LEN: usize = 300;

/// Rates are measured over (about) this many seconds, so one slow sample does not make them jump.
const RATE_WINDOW_S: f64 = 10.0;

/// The event store.
#[derive(Debug, Clone, Default, Serialize)]
pub struct EventsView {
    /// Rows in `events`.
    pub stored: i64,
    /// When the newest was recorded.
    pub last_recorded_at: Option<DateTime<Utc>>,
    /// Why they could not be counted.
    pub error: Option<String>,
}

/// What the database knows of the relays.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RelayView {
    /// Relay sessions connected to this database (`application_name` `waybill-relay …`).
    pub connected: Option<i64>,
    /// When a row was last marked sent (from the outbox's newest rows).
    pub last_sent_at: Option<DateTime<Utc>>,
    /// The relays' own counters, scraped from their /metrics (`--relay-metrics`).
    pub metrics: RelayMetricsView,
}

/// One projection: its tables, its consumer, and how far behind it is.
#[derive(Debug, Clone, Serialize)]
pub struct ProjectionView {
    /// What its tables say.
    #[serde(flatten)]
    pub state: ProjectionState,
    /// Its durable consumer, when NATS answered.
    pub consumer: Option<ConsumerView>,
    /// Messages of the stream it has not settled (undelivered + unacknowledged), when known.
    pub behind_stream: Option<u64>,
    /// Events stored but not applied by it (stored − applied).
    pub behind_store: i64,
}

/// Rates over the last seconds, when two samples exist.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Rates {
    /// Events appended per second (every accepted command appends one).
    pub events_per_s: Option<f64>,
    /// Messages stored in the stream per second (the relays' publishes, copies excluded).
    pub published_per_s: Option<f64>,
    /// Events applied per second, per projection.
    pub applied_per_s: BTreeMap<&'static str, f64>,
}

/// The pipeline at one moment.
#[derive(Debug, Clone, Serialize)]
pub struct Snapshot {
    /// When it was read.
    pub taken_at: DateTime<Utc>,
    /// The event store.
    pub events: EventsView,
    /// The outbox, as `waybill outbox status` reports it.
    pub outbox: Option<relay::admin::OutboxStatus>,
    /// Why the outbox could not be read.
    pub outbox_error: Option<String>,
    /// The relays.
    pub relay: RelayView,
    /// The stream.
    pub stream: StreamView,
    /// The projections, in [`PROJECTIONS`] order.
    pub projections: Vec<ProjectionView>,
    /// Rates from the history (filled in by [`History::push`]).
    pub rates: Rates,
}

impl Snapshot {
    /// Reads everything, and scrapes the relays' metrics at `relays`; parts that cannot be read say
    /// why.
    pub async fn take(pool: &PgPool, stream: &StreamSource, relays: &[MetricsUrl]) -> Self {
        // Scraped while the database and the stream are read: a relay that does not answer costs
        // the sample its timeout at most, not its timeout on top of the rest.
        let (scraped, mut snapshot) =
            tokio::join!(relays::scrape_all(relays), Self::read(pool, stream));
        snapshot.relay.metrics = scraped;
        snapshot
    }

    async fn read(pool: &PgPool, stream: &StreamSource) -> Self {
        let events = read_events(pool).await;
        let (outbox, outbox_error) = match relay::admin::status(pool, false).await {
            Ok(status) => (Some(status), None),
            Err(error) => {
                tracing::warn!(%error, "console cannot read the outbox");
                (None, Some(error.to_string()))
            }
        };
        let relay = read_relay(pool).await;
        let stream = stream.view(&PROJECTIONS).await;
        let mut projections = Vec::with_capacity(PROJECTIONS.len());
        for name in PROJECTIONS {
            let state = readside::state(pool, name).await;
            let consumer = stream.consumers.iter().find(|c| c.name == name).cloned();
            let behind_stream = consumer.as_ref().filter(|c| c.found).map(ConsumerView::lag);
            projections.push(ProjectionView {
                behind_store: (events.stored - state.applied).max(0),
                state,
                consumer,
                behind_stream,
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

async fn read_events(pool: &PgPool) -> EventsView {
    // An exact count: the console promises the number of stored events, and it is only sampled
    // while someone watches (see `Console::watched`).
    let read = sqlx::query_as::<_, (i64, Option<DateTime<Utc>>)>(
        "SELECT count(*), (SELECT recorded_at FROM events ORDER BY position DESC LIMIT 1) FROM events",
    )
    .fetch_one(pool)
    .await;
    match read {
        Ok((stored, last_recorded_at)) => EventsView {
            stored,
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

async fn read_relay(pool: &PgPool) -> RelayView {
    let connected = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity
         WHERE datname = current_database() AND application_name LIKE 'waybill-relay %'",
    )
    .fetch_one(pool)
    .await
    .ok();
    // The newest rows are the last sent; a bounded look (by the primary key) never walks history.
    let last_sent_at = sqlx::query_scalar(
        "SELECT max(sent_at) FROM (SELECT sent_at FROM outbox ORDER BY id DESC LIMIT 1000) newest",
    )
    .fetch_one(pool)
    .await
    .ok()
    .flatten();
    RelayView {
        connected,
        last_sent_at,
        metrics: RelayMetricsView::default(),
    }
}

/// One sample of the history: the counters the charts and rates are derived from.
#[derive(Debug, Clone, Serialize)]
pub struct Sample {
    /// Milliseconds since the Unix epoch.
    pub t: i64,
    /// Events stored.
    pub events: i64,
    /// The stream's last sequence, when NATS answered.
    pub stream_last: Option<u64>,
    /// Outbox rows not yet sent (pending + failed + dead).
    pub unsent: Option<i64>,
    /// Per projection (in [`PROJECTIONS`] order): events applied, when its tables were read.
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
                .map(|p| p.state.found.then_some(p.state.applied))
                .collect(),
            lag: snapshot
                .projections
                .iter()
                .map(|p| {
                    p.behind_stream
                        .map(|l| l as i64)
                        .or(p.state.found.then_some(p.behind_store))
                })
                .collect(),
        }
    }
}

/// The last minutes of samples, oldest first.
#[derive(Debug, Default)]
pub struct History {
    samples: VecDeque<Sample>,
    latest: Option<Snapshot>,
}

/// The charts' data: per series, `[t_ms, value]` points.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Series {
    /// Throughput: events appended, messages stored in the stream, events applied per projection.
    pub throughput: BTreeMap<String, Vec<(i64, f64)>>,
    /// Backlog: outbox rows unsent, and each projection's lag.
    pub backlog: BTreeMap<String, Vec<(i64, f64)>>,
}

impl History {
    /// Records `snapshot`, fills in its rates, and keeps it as the latest.
    pub fn push(&mut self, mut snapshot: Snapshot) -> Snapshot {
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
            snapshot.rates.events_per_s = Some(rate(sample.events, base.events));
            snapshot.rates.published_per_s = sample
                .stream_last
                .zip(base.stream_last)
                .map(|(now, then)| rate(now as i64, then as i64));
            for (i, name) in PROJECTIONS.iter().enumerate() {
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

    /// The latest snapshot, if any.
    pub fn latest(&self) -> Option<&Snapshot> {
        self.latest.as_ref()
    }

    /// The charts' series over the kept samples.
    pub fn series(&self) -> Series {
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
            put("events", (now.events - then.events) as f64);
            if let (Some(a), Some(b)) = (now.stream_last, then.stream_last) {
                // A recreated stream starts again from 1: no negative throughput.
                put("stream", a.saturating_sub(b) as f64);
            }
            for (i, name) in PROJECTIONS.iter().enumerate() {
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
            for (i, name) in PROJECTIONS.iter().enumerate() {
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
