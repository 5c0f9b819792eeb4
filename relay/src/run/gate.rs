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
//!
//! Overdue rows alone do not tell a stuck WAL relay from a busy one: a bulk import's rows are due
//! from their transaction's start, so an import open longer than the threshold looks overdue the
//! moment it commits, while the WAL relay decodes it, then publishes and marks it part by part. So
//! rows that wait are left to the slot's reader for [`OVERDUE_GRACE`], and then while another relay
//! has marked rows within [`DELIVERING_WITHIN`], for at most [`LEAVE_OVERDUE_AT_MOST`] in a row: a
//! reader that delivers nothing, or only some aggregates for longer than that, gets the lanes
//! beside it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use ops::error_chain;
use sqlx::PgPool;
use tokio::sync::Notify;
use tokio::task::JoinHandle;

/// How often the gate looks: how long the lanes may stay idle after the slot's reader went.
const LOOK_EVERY: Duration = Duration::from_secs(1);
/// How long a look may take before it counts as "cannot tell" (a connection gone half-open).
const LOOK_TIMEOUT: Duration = Duration::from_secs(5);
/// How long overdue rows are left to the slot's reader before its marks are asked for: between a
/// large transaction's commit and the first mark of its rows the server decodes it (and the WAL
/// relay's own polling pass for rows the slot never carries comes within 5 s). A reader stuck for
/// good is claimed beside this much later than the rows became overdue.
const OVERDUE_GRACE: Duration = Duration::from_secs(5);
/// Marks by another relay this recent say the slot's reader is delivering. A WAL relay marks each
/// batch as it is published; a large transaction's parts of 4 MiB of bodies take well under a second
/// each here.
const DELIVERING_WITHIN: Duration = Duration::from_secs(3);
/// How long in a row overdue rows are left to a slot's reader that is delivering: a 144 MB import is
/// delivered in about 10 s here, and the WAL relay's own polling pass, which it puts off while it
/// delivers, comes within 30 s. Past this the lanes claim beside it (the copies are deduplicated).
const LEAVE_OVERDUE_AT_MOST: Duration = Duration::from_secs(60);

/// What a look found.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Seen {
    /// Nobody reads the slot (or it does not exist).
    Free,
    /// A session (this walsender process id) reads it and no row waits: stand by.
    Read(i32),
    /// A session reads it and rows have been due for longer than
    /// [`crate::config::UNDELIVERED_AFTER`], but only for [`OVERDUE_GRACE`] yet, or another relay
    /// is marking rows sent: a large transaction being delivered. Stand by, for at most
    /// [`LEAVE_OVERDUE_AT_MOST`] in a row.
    ReadAndDelivering(i32),
    /// A session reads it, but rows have been due for longer than
    /// [`crate::config::UNDELIVERED_AFTER`], and nobody else marked a row lately (or rows have
    /// waited for longer than [`LEAVE_OVERDUE_AT_MOST`]).
    ReadButBehind(i32),
    /// The look failed or timed out.
    Unknown(String),
}

/// Whether the lanes stand by now. Shared with the task that looks at the slot.
#[derive(Debug, Clone, Default)]
pub(super) struct SlotGate {
    standing_by: Arc<AtomicBool>,
    last: Arc<Mutex<Option<Seen>>>,
    /// Since when every look has found rows overdue beside the slot's reader.
    overdue_since: Arc<Mutex<Option<Instant>>>,
}

impl SlotGate {
    /// True while a session reads the slot and keeps up: claim nothing.
    pub(super) fn standing_by(&self) -> bool {
        self.standing_by.load(Ordering::Relaxed)
    }

    /// Looks at `slot` now, so that the first claim already knows, then every second in a task that
    /// wakes the lanes when they should claim again. `relay_id` is this relay's: its own marks are
    /// no evidence that the slot's reader delivers. Without a slot the gate stays open and nothing
    /// runs.
    pub(super) async fn watch(
        pool: PgPool,
        slot: Option<String>,
        relay_id: String,
        wakes: Vec<Arc<Notify>>,
    ) -> (Self, Option<JoinHandle<()>>) {
        let gate = Self::default();
        let Some(slot) = slot else {
            return (gate, None);
        };
        gate.look(&pool, &slot, &relay_id, &wakes).await;
        let task = tokio::spawn({
            let gate = gate.clone();
            async move {
                loop {
                    tokio::time::sleep(LOOK_EVERY).await;
                    gate.look(&pool, &slot, &relay_id, &wakes).await;
                }
            }
        });
        (gate, Some(task))
    }

    async fn look(&self, pool: &PgPool, slot: &str, relay_id: &str, wakes: &[Arc<Notify>]) {
        let overdue_for = self
            .overdue_since
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .map_or(Duration::ZERO, |since| since.elapsed());
        let look = async {
            use store::outbox::admin::any_head_due_for_longer_than;
            use store::outbox::relaying::{marked_by_another_within, slot_reader};
            let Some(pid) = slot_reader(pool, slot).await? else {
                return Ok(Seen::Free);
            };
            if !any_head_due_for_longer_than(pool, crate::config::UNDELIVERED_AFTER).await? {
                return Ok(Seen::Read(pid));
            }
            let delivering = overdue_for < OVERDUE_GRACE
                || (overdue_for < LEAVE_OVERDUE_AT_MOST
                    && marked_by_another_within(pool, relay_id, DELIVERING_WITHIN).await?);
            Ok::<_, sqlx::Error>(if delivering {
                Seen::ReadAndDelivering(pid)
            } else {
                Seen::ReadButBehind(pid)
            })
        };
        let seen = match tokio::time::timeout(LOOK_TIMEOUT, look).await {
            Ok(Ok(seen)) => seen,
            Ok(Err(error)) => Seen::Unknown(error_chain(&error)),
            Err(_) => Seen::Unknown(format!("no answer within {LOOK_TIMEOUT:?}")),
        };
        {
            let mut since = self
                .overdue_since
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            match seen {
                Seen::ReadAndDelivering(_) | Seen::ReadButBehind(_) => {
                    since.get_or_insert_with(Instant::now);
                }
                Seen::Free | Seen::Read(_) => *since = None,
                Seen::Unknown(_) => {}
            }
        }
        let stand_by = matches!(seen, Seen::Read(_) | Seen::ReadAndDelivering(_));
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
            Seen::ReadAndDelivering(pid) => tracing::info!(
                slot,
                walsender_pid = pid,
                at_most = ?LEAVE_OVERDUE_AT_MOST,
                "outbox rows look overdue, but a WAL relay reads the slot and is given time to deliver them (a large transaction); standing by while it marks rows"
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
