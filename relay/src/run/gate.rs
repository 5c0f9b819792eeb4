//! A polling relay that stands by while a WAL relay reads the replication slot: that relay
//! delivers every outbox row as it commits, so claiming beside it would publish each event twice —
//! the copies absorbed by the dedupe window and the fence, the work paid for twice. The slot is
//! looked at once before the first claim and then every second; once nobody reads it (its reader
//! died or stopped, the slot was dropped or lost), the lanes are woken and claim from the outbox's
//! own state, so polling is the WAL relay's standby as much as another WAL relay is.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use ops::error_chain;
use sqlx::PgPool;
use tokio::sync::Notify;
use tokio::task::JoinHandle;

/// How often the slot is looked at: how long the lanes may stay idle after its reader went.
const LOOK_EVERY: Duration = Duration::from_secs(1);

/// Whether the lanes stand by now. Shared with the task that looks at the slot.
#[derive(Debug, Clone, Default)]
pub(super) struct SlotGate {
    standing_by: Arc<AtomicBool>,
}

impl SlotGate {
    /// True while a session reads the slot: claim nothing.
    pub(super) fn standing_by(&self) -> bool {
        self.standing_by.load(Ordering::Relaxed)
    }

    /// Looks at `slot` now, so that the first claim already knows, then every second in a task that
    /// wakes the lanes when its reader goes. Without a slot the gate stays open and nothing runs.
    pub(super) async fn watch(
        pool: PgPool,
        slot: Option<String>,
        wakes: Vec<Arc<Notify>>,
    ) -> (Self, Option<JoinHandle<()>>) {
        let gate = Self::default();
        let Some(slot) = slot else {
            return (gate, None);
        };
        gate.look(&pool, &slot, &wakes).await;
        let task = tokio::spawn({
            let gate = gate.clone();
            async move {
                loop {
                    tokio::time::sleep(LOOK_EVERY).await;
                    gate.look(&pool, &slot, &wakes).await;
                }
            }
        });
        (gate, Some(task))
    }

    async fn look(&self, pool: &PgPool, slot: &str, wakes: &[Arc<Notify>]) {
        let reader = match reader(pool, slot).await {
            Ok(reader) => reader,
            // Unknown: claim. A copy published beside a WAL relay is deduplicated; an event nobody
            // publishes is not.
            Err(error) => {
                tracing::debug!(slot, error = %error_chain(&error), "cannot look at the WAL relay's slot; claiming");
                None
            }
        };
        let was = self.standing_by.swap(reader.is_some(), Ordering::Relaxed);
        metrics::gauge!("waybill_relay_standing_by").set(f64::from(u8::from(reader.is_some())));
        match (was, reader) {
            (false, Some(pid)) => tracing::info!(
                slot,
                walsender_pid = pid,
                "a WAL relay reads the slot; standing by (this relay claims nothing while it does)"
            ),
            (true, None) => {
                tracing::info!(slot, "nobody reads the WAL relay's slot any more; claiming");
                wakes.iter().for_each(|w| w.notify_one());
            }
            _ => {}
        }
    }
}

/// The process id of the session reading `slot` in this database, if one does.
async fn reader(pool: &PgPool, slot: &str) -> sqlx::Result<Option<i32>> {
    Ok(sqlx::query_scalar(
        "SELECT active_pid FROM pg_replication_slots
         WHERE slot_name = $1 AND database = current_database()",
    )
    .bind(slot)
    .fetch_optional(pool)
    .await?
    .flatten())
}
