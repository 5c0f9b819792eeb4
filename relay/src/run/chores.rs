//! What a running relay does beside its lanes: the outbox gauges, pruning the publish journal, and
//! the retention sweep of sent rows.

use std::time::Duration;

use ops::error_chain;
use sqlx::PgPool;
use tokio::task::JoinHandle;

use crate::{RelayConfig, admin, metrics};

/// The chores of a running relay, whichever its source: the outbox gauges and, with `--retention`,
/// the sweep. Stopped when dropped.
pub(crate) struct Chores {
    tasks: Vec<JoinHandle<()>>,
}

impl Chores {
    pub(crate) fn start(pool: &PgPool, config: &RelayConfig) -> Self {
        let mut tasks = vec![tokio::spawn(refresh_gauges(pool.clone()))];
        if let Some(retention) = config.retention {
            tasks.push(tokio::spawn(sweep(
                pool.clone(),
                retention,
                config.retention_batch.max(1),
            )));
        }
        Self { tasks }
    }
}

impl Drop for Chores {
    fn drop(&mut self) {
        self.tasks.iter().for_each(JoinHandle::abort);
    }
}

/// Refreshes the outbox gauges every 5 s and prunes the journal every minute.
async fn refresh_gauges(pool: PgPool) {
    let mut ticks = 0u64;
    loop {
        match admin::status(&pool, false).await {
            Ok(status) => metrics::record_status(&status),
            Err(error) => {
                tracing::debug!(error = %error_chain(&error), "cannot read the outbox status")
            }
        }
        match admin::vacuum_state(&pool).await {
            Ok(vacuum) => metrics::record_vacuum(&vacuum),
            Err(error) => {
                tracing::debug!(error = %error_chain(&error), "cannot read the outbox's vacuum state")
            }
        }
        if ticks.is_multiple_of(12)
            && let Err(error) = admin::prune_journal(&pool).await
        {
            tracing::debug!(error = %error_chain(&error), "cannot prune the publish journal");
        }
        ticks += 1;
        tokio::time::sleep(Duration::from_secs(5)).await;
    }
}

/// How often the retention sweep looks for sent rows past the retention.
const SWEEP_EVERY: Duration = Duration::from_secs(10);

/// Deletes sent rows older than `retention`, `batch` per statement, every [`SWEEP_EVERY`]: the outbox
/// stays bounded by what is sent in `retention` plus what is unsent. Each batch is its own short
/// statement on rows no relay will touch again (sent, and `SKIP LOCKED`), so the sweep never waits for
/// a claim and several relays can sweep at once. The fence does not need a purged row: a relay reads
/// a purged predecessor's sequence from the stream.
async fn sweep(pool: PgPool, retention: Duration, batch: i64) {
    loop {
        // Counted batch by batch: a first sweep over a large backlog takes a while.
        let mut counted = 0;
        let purged = admin::purge_sent(&pool, retention, batch, |total| {
            metrics::record_purged(total - counted);
            counted = total;
        })
        .await;
        match purged {
            Ok(0) => {}
            Ok(deleted) => {
                tracing::info!(
                    deleted,
                    retention = %humantime::format_duration(retention),
                    "deleted sent outbox rows past the retention"
                );
            }
            Err(error) => {
                tracing::warn!(error = %error_chain(&error), "the retention sweep failed; retrying later")
            }
        }
        tokio::time::sleep(SWEEP_EVERY).await;
    }
}
