//! What processes cost while a measurement runs: peak resident memory and CPU seconds, sampled from
//! `/proc/<pid>/stat` every 50 ms (one read per process for both). Processes that come and go (PostgreSQL backends, relays that exit) keep their
//! last reading, so work done just before an exit still counts.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde::Serialize;
use sqlx::PgPool;
use testkit::stats::process_reading;
use tokio::task::JoinHandle;

/// What one process (or group of processes) used during a measurement.
#[derive(Debug, Clone, Default, Serialize)]
pub(super) struct Usage {
    /// Highest resident memory of one process of the group, KiB.
    pub peak_rss_kib: u64,
    /// CPU seconds (user + system) spent during the measurement by the whole group.
    pub cpu_seconds: f64,
}

/// Who to watch, by name.
#[derive(Debug, Clone)]
pub(super) enum Watched {
    /// These process ids.
    Pids(Vec<u32>),
    /// The PostgreSQL backends whose `application_name` starts with this (looked up every 500 ms).
    Sessions(String),
    /// The PostgreSQL backends connected to this database (looked up every 500 ms).
    Database(String),
    /// The WAL senders whose `application_name` starts with this: the logical decoding part of
    /// [`Watched::Sessions`].
    WalSenders(String),
}

/// A running sampler; [`Sampler::finish`] stops it and returns the usage per name.
pub(super) struct Sampler {
    running: Arc<AtomicBool>,
    task: JoinHandle<HashMap<String, Usage>>,
}

impl Sampler {
    /// Starts sampling `watched`; `pool` looks up PostgreSQL sessions.
    pub(super) fn start(pool: PgPool, watched: Vec<(String, Watched)>) -> Self {
        let running = Arc::new(AtomicBool::new(true));
        let task = tokio::spawn({
            let running = running.clone();
            async move {
                // Per name: the pids seen, each one's first and last CPU reading.
                let mut seen: HashMap<String, HashMap<u32, (f64, f64)>> = HashMap::new();
                let mut peaks: HashMap<String, u64> = HashMap::new();
                let mut lookups: HashMap<String, Vec<u32>> = HashMap::new();
                let mut tick = 0u32;
                while running.load(Ordering::Relaxed) {
                    for (name, watched) in &watched {
                        let pids = match watched {
                            Watched::Pids(pids) => pids.clone(),
                            Watched::Sessions(_)
                            | Watched::Database(_)
                            | Watched::WalSenders(_) => {
                                // Every tick for the first second (a short run's sessions connect after the
                                // sampler starts), then every 500 ms.
                                if tick < 20
                                    || tick.is_multiple_of(10)
                                    || !lookups.contains_key(name)
                                {
                                    lookups.insert(name.clone(), backends(&pool, watched).await);
                                }
                                lookups[name].clone()
                            }
                        };
                        for pid in pids {
                            let Some(reading) = process_reading(pid) else {
                                continue;
                            };
                            let cpu = reading.cpu_seconds;
                            let readings = seen.entry(name.clone()).or_default();
                            readings
                                .entry(pid)
                                // A backend first seen mid-run already worked for this run since it
                                // connected, but a reused one may have worked for an earlier one: count
                                // from the first reading.
                                .and_modify(|r| r.1 = cpu)
                                .or_insert((cpu, cpu));
                            let peak = peaks.entry(name.clone()).or_default();
                            *peak = (*peak).max(reading.resident_kib);
                        }
                    }
                    tick += 1;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                watched
                    .iter()
                    .map(|(name, _)| {
                        let cpu = seen
                            .get(name)
                            .map(|r| r.values().map(|(first, last)| last - first).sum())
                            .unwrap_or_default();
                        let usage = Usage {
                            peak_rss_kib: peaks.get(name).copied().unwrap_or_default(),
                            cpu_seconds: cpu,
                        };
                        (name.clone(), usage)
                    })
                    .collect()
            }
        });
        Self { running, task }
    }

    /// Stops sampling; the usage per name.
    pub(super) async fn finish(self) -> HashMap<String, Usage> {
        self.running.store(false, Ordering::Relaxed);
        self.task.await.unwrap_or_default()
    }
}

async fn backends(pool: &PgPool, watched: &Watched) -> Vec<u32> {
    let query = match watched {
        Watched::Sessions(prefix) => sqlx::query_scalar::<_, i32>(
            "SELECT pid FROM pg_stat_activity WHERE starts_with(application_name, $1)",
        )
        .bind(prefix.clone()),
        Watched::WalSenders(prefix) => sqlx::query_scalar::<_, i32>(
            "SELECT pid FROM pg_stat_activity
             WHERE starts_with(application_name, $1) AND backend_type = 'walsender'",
        )
        .bind(prefix.clone()),
        Watched::Database(name) => {
            sqlx::query_scalar::<_, i32>("SELECT pid FROM pg_stat_activity WHERE datname = $1")
                .bind(name.clone())
        }
        Watched::Pids(_) => return Vec::new(),
    };
    query
        .fetch_all(pool)
        .await
        .unwrap_or_default()
        .into_iter()
        // PostgreSQL's backend pids are positive.
        .filter_map(|pid| u32::try_from(pid).ok())
        .collect()
}

/// The nats-server processes serving `nats_url`'s port (every nats-server when none names it, as
/// one started with the default port does not).
pub(super) fn nats_pids(nats_url: &str) -> Vec<u32> {
    let port = nats_url
        .rsplit(':')
        .next()
        .map(|p| p.trim_end_matches('/'))
        .unwrap_or("4222");
    let all = testkit::stats::pids_named("nats-server");
    let serving: Vec<u32> = all
        .iter()
        .copied()
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|cmdline| {
                cmdline.split(|b| *b == 0).any(|arg| {
                    arg == port.as_bytes() || arg.ends_with(format!(":{port}").as_bytes())
                })
            })
        })
        .collect();
    if serving.is_empty() { all } else { serving }
}
