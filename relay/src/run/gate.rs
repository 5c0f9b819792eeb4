//! A polling relay that stands by while a WAL relay reads the replication slot and keeps up: that
//! relay delivers what the slot carries as it commits, so claiming beside it would publish each
//! event twice — the copies absorbed by the dedupe window and the fence, the work paid for twice.
//!
//! Standing by is allowed only while it costs nothing: the gate looks, once before the first claim
//! and then every second, at who reads the slot **and** at whether any aggregate's next row (a
//! head: its predecessor sent) has been due for longer than [`crate::config::UNDELIVERED_AFTER`].
//! The lanes claim when nobody reads the slot (its reader died or stopped, the slot was dropped or
//! lost), when rows wait regardless (a WAL relay connected to the slot but cut off from NATS or
//! stuck; rows the slot never carries: a dead row replayed, a row rewound by `outbox repair`, a
//! retry the WAL relay's opening drain left behind), and when the gate cannot tell. A copy published
//! beside a WAL relay is deduplicated; an event nobody publishes is not.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use ops::error_chain;
use sqlx::PgPool;
use tokio::sync::Notify;
use tokio::task::JoinHandle;

/// How often the gate looks: how long the lanes may stay idle after the slot's reader went.
const LOOK_EVERY: Duration = Duration::from_secs(1);
/// How long a look may take before it counts as "cannot tell" (a connection gone half-open).
const LOOK_TIMEOUT: Duration = Duration::from_secs(5);

/// What a look found.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Seen {
    /// Nobody reads the slot (or it does not exist).
    Free,
    /// A session (this walsender process id) reads it and no row waits: stand by.
    Read(i32),
    /// A session reads it, but rows have been due for longer than
    /// [`crate::config::UNDELIVERED_AFTER`].
    ReadButBehind(i32),
    /// The look failed or timed out.
    Unknown(String),
}

/// Whether the lanes stand by now. Shared with the task that looks at the slot.
#[derive(Debug, Clone, Default)]
pub(super) struct SlotGate {
    standing_by: Arc<AtomicBool>,
    last: Arc<Mutex<Option<Seen>>>,
}

impl SlotGate {
    /// True while a session reads the slot and keeps up: claim nothing.
    pub(super) fn standing_by(&self) -> bool {
        self.standing_by.load(Ordering::Relaxed)
    }

    /// Looks at `slot` now, so that the first claim already knows, then every second in a task that
    /// wakes the lanes when they should claim again. Without a slot the gate stays open and nothing
    /// runs.
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
        let look = async {
            use store::outbox::{admin::any_head_due_for_longer_than, relaying::slot_reader};
            let reader = slot_reader(pool, slot).await?;
            let behind = match reader {
                Some(_) => {
                    any_head_due_for_longer_than(pool, crate::config::UNDELIVERED_AFTER).await?
                }
                None => false,
            };
            Ok::<_, sqlx::Error>((reader, behind))
        };
        let seen = match tokio::time::timeout(LOOK_TIMEOUT, look).await {
            Ok(Ok((None, _))) => Seen::Free,
            Ok(Ok((Some(pid), false))) => Seen::Read(pid),
            Ok(Ok((Some(pid), true))) => Seen::ReadButBehind(pid),
            Ok(Err(error)) => Seen::Unknown(error_chain(&error)),
            Err(_) => Seen::Unknown(format!("no answer within {LOOK_TIMEOUT:?}")),
        };
        let stand_by = matches!(seen, Seen::Read(_));
        let was = self.standing_by.swap(stand_by, Ordering::Relaxed);
        metrics::gauge!("waybill_relay_standing_by").set(f64::from(u8::from(stand_by)));
        if was && !stand_by {
            wakes.iter().for_each(|w| w.notify_one());
        }
        let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        if last.as_ref().map(std::mem::discriminant) == Some(std::mem::discriminant(&seen)) {
            return;
        }
        match &seen {
            // Said when a reader goes, not at the start of a relay that never had one.
            Seen::Free if last.is_none() => {
                tracing::debug!(slot, "nobody reads the WAL relay's slot; claiming");
            }
            Seen::Free => tracing::info!(slot, "nobody reads the WAL relay's slot; claiming"),
            Seen::Read(pid) => tracing::info!(
                slot,
                walsender_pid = pid,
                "a WAL relay reads the slot; standing by (this relay claims nothing while it keeps up)"
            ),
            Seen::ReadButBehind(pid) => tracing::warn!(
                slot,
                walsender_pid = pid,
                behind_after = ?crate::config::UNDELIVERED_AFTER,
                "a WAL relay reads the slot, but outbox rows have been due longer than it should take; claiming beside it"
            ),
            Seen::Unknown(error) => tracing::warn!(
                slot,
                error,
                "cannot look at the WAL relay's slot; claiming (a copy is deduplicated, a missed event is not)"
            ),
        }
        *last = Some(seen);
    }
}
