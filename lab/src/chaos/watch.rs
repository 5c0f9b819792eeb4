//! Watching the run: a clock every part shares, a sampler of the backlog (outbox rows not yet sent plus
//! the largest projection lag) and of resident memory that also supervises the processes, and the
//! final drain.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use sqlx::PgPool;

use super::fleet::Fleet;
use super::servers::Servers;
use crate::process::peak_rss_kib;

/// Seconds since the run began, shared by the load, the faults and the sampler.
#[derive(Debug, Clone)]
pub(super) struct Clock(Arc<Instant>);

impl Clock {
    /// Starts now.
    pub(super) fn new() -> Self {
        Self(Arc::new(Instant::now()))
    }

    /// Time since the start.
    pub(super) fn elapsed(&self) -> Duration {
        self.0.elapsed()
    }

    /// Seconds since the start.
    pub(super) fn seconds(&self) -> f64 {
        self.elapsed().as_secs_f64()
    }
}

/// One backlog reading.
#[derive(Debug, Clone, Copy)]
pub(super) struct Sample {
    /// Seconds since the start.
    pub at: f64,
    /// Unsent outbox rows plus the largest projection lag; `None` when PostgreSQL or NATS did not
    /// answer (counted as "not back to normal").
    pub backlog: Option<u64>,
}

/// What the sampler saw.
#[derive(Debug, Default)]
pub(super) struct Samples {
    /// Every reading, in time order.
    pub backlog: Vec<Sample>,
    /// nats-server's peak resident memory, KiB.
    pub nats_peak_rss_kib: u64,
}

/// The sampler task.
#[derive(Debug)]
pub(super) struct Watcher {
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<Samples>,
}

impl Watcher {
    /// Samples every 250 ms until stopped.
    pub(super) fn spawn(
        clock: Clock,
        pool: PgPool,
        jetstream: jetstream::Context,
        fleet: Arc<Fleet>,
        servers: Servers,
    ) -> Self {
        let (stop, mut stopped) = tokio::sync::watch::channel(false);
        let task = tokio::spawn(async move {
            let mut samples = Samples::default();
            let mut ticker = tokio::time::interval(Duration::from_millis(250));
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = ticker.tick() => {}
                    _ = stopped.wait_for(|s| *s) => break,
                }
                fleet.supervise().await;
                for pid in servers.nats_pids() {
                    samples.nats_peak_rss_kib = samples.nats_peak_rss_kib.max(peak_rss_kib(pid));
                }
                let backlog = backlog(&pool, &jetstream, &fleet.consumers())
                    .await
                    .map(|b| b.total());
                // Stamped when the reading is complete: a slow query must not date it early.
                let at = clock.seconds();
                samples.backlog.push(Sample { at, backlog });
            }
            samples
        });
        Self { stop, task }
    }

    /// Stops sampling and returns the readings.
    pub(super) async fn stop(self) -> Samples {
        let _ = self.stop.send(true);
        self.task.await.unwrap_or_default()
    }
}

/// Work not done yet.
#[derive(Debug, Clone, Default)]
pub(super) struct Backlog {
    /// Outbox rows pending or failed (dead rows are not work in progress; the verdict counts them).
    pub unsent: u64,
    /// Per projection consumer (one per partition), messages undelivered plus delivered but
    /// unacknowledged.
    pub lags: Vec<(String, u64)>,
}

impl Backlog {
    fn total(&self) -> u64 {
        self.unsent + self.lags.iter().map(|(_, lag)| *lag).max().unwrap_or(0)
    }

    fn is_empty(&self) -> bool {
        self.total() == 0
    }
}

/// Reads the backlog of the outbox and of `consumers` (by projection), giving up after two seconds
/// (a server may be down).
pub(super) async fn backlog(
    pool: &PgPool,
    jetstream: &jetstream::Context,
    consumers: &[(&'static str, String)],
) -> Option<Backlog> {
    let read = async {
        let unsent = relay::admin::counts(pool, false).await.ok()?.in_progress();
        let stream = jetstream.get_stream(super::STREAM).await.ok()?;
        let mut lags = Vec::new();
        for (_, name) in consumers {
            let mut consumer: jetstream::consumer::PullConsumer =
                stream.get_consumer(name).await.ok()?;
            let info = consumer.info().await.ok()?;
            lags.push((name.clone(), info.num_pending + info.num_ack_pending as u64));
        }
        Some(Backlog {
            // A count of rows: never negative.
            unsent: u64::try_from(unsent).unwrap_or(0),
            lags,
        })
    };
    tokio::time::timeout(Duration::from_secs(2), read)
        .await
        .ok()
        .flatten()
}

/// How the drain ended.
#[derive(Debug, Clone)]
pub(super) struct Drained {
    /// Seconds it took (or waited, when incomplete).
    pub seconds: f64,
    /// True when nothing was left to send or apply.
    pub complete: bool,
    /// The last backlog seen, when incomplete.
    pub remaining: Option<Backlog>,
}

/// Waits until no outbox row is left to send and every projection has applied everything (three
/// readings in a row), supervising the processes meanwhile; gives up after `timeout`.
pub(super) async fn drain(
    pool: &PgPool,
    jetstream: &jetstream::Context,
    fleet: &Fleet,
    timeout: Duration,
) -> Drained {
    let started = Instant::now();
    let mut quiet = 0;
    let mut last = None;
    while started.elapsed() < timeout {
        fleet.supervise().await;
        let reading = backlog(pool, jetstream, &fleet.consumers()).await;
        if reading.as_ref().is_some_and(Backlog::is_empty) {
            quiet += 1;
            if quiet >= 3 {
                return Drained {
                    seconds: started.elapsed().as_secs_f64(),
                    complete: true,
                    remaining: None,
                };
            }
        } else {
            quiet = 0;
        }
        last = reading.or(last);
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Drained {
        seconds: started.elapsed().as_secs_f64(),
        complete: false,
        remaining: last,
    }
}
