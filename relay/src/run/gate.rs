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
//! rows that wait are left to the slot's reader for [`OVERDUE_GRACE`], and then while that reader
//! (its walsender's `application_name` names the relay) has marked rows within
//! [`DELIVERING_WITHIN`], for at most [`LEAVE_OVERDUE_AT_MOST`] in a row: a reader that marks
//! nothing gets the lanes beside it [`OVERDUE_GRACE`] after its rows became overdue, one that
//! marks only some aggregates' rows [`LEAVE_OVERDUE_AT_MOST`] after.

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
/// Marks by the slot's reader this recent say it is delivering. A WAL relay marks each batch as it
/// is published; a large transaction's parts of 4 MiB of bodies take well under a second each here.
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
    /// [`crate::config::UNDELIVERED_AFTER`], but for less than [`OVERDUE_GRACE`] of looks yet:
    /// stand by.
    ReadJustOverdue(i32),
    /// A session reads it, rows have been overdue for longer than the grace, and the reader is
    /// marking rows sent: a large transaction being delivered. Stand by, for at most
    /// [`LEAVE_OVERDUE_AT_MOST`] in a row.
    ReadOverdueButMarking(i32),
    /// A session reads it, but rows have been overdue past the grace and the reader marked no row
    /// lately, or for longer than [`LEAVE_OVERDUE_AT_MOST`]: claim beside it.
    ReadButBehind(i32),
    /// The look failed or timed out.
    Unknown(String),
}

/// Whether the lanes stand by now. Shared with the task that looks at the slot.
#[derive(Debug, Clone, Default)]
pub(super) struct SlotGate {
    standing_by: Arc<AtomicBool>,
    last: Arc<Mutex<Option<Seen>>>,
    overdue: Arc<Mutex<OverdueClock>>,
}

/// Since when every look has found rows overdue beside the slot's reader.
#[derive(Debug, Default)]
struct OverdueClock {
    since: Option<Instant>,
}

impl OverdueClock {
    fn overdue_for(&self, now: Instant) -> Duration {
        self.since.map_or(Duration::ZERO, |since| now - since)
    }

    /// Starts at the first look that finds rows overdue, stops at one that finds none (or nobody
    /// reading the slot); a look that could not tell changes nothing.
    fn note(&mut self, seen: &Seen, now: Instant) {
        match seen {
            Seen::ReadJustOverdue(_) | Seen::ReadOverdueButMarking(_) | Seen::ReadButBehind(_) => {
                self.since.get_or_insert(now);
            }
            Seen::Free | Seen::Read(_) => self.since = None,
            Seen::Unknown(_) => {}
        }
    }
}

/// Whether the reader's marks are worth asking for, rows having been overdue for `overdue_for`:
/// only past the grace and within the bound do they decide anything.
fn marks_matter(overdue_for: Duration) -> bool {
    (OVERDUE_GRACE..LEAVE_OVERDUE_AT_MOST).contains(&overdue_for)
}

/// What a look that found the slot read by `pid` and rows overdue for `overdue_for` makes of it,
/// `marking` saying whether the reader marked a row lately (asked only where [`marks_matter`]).
fn overdue(pid: i32, overdue_for: Duration, marking: bool) -> Seen {
    if overdue_for < OVERDUE_GRACE {
        Seen::ReadJustOverdue(pid)
    } else if marking && overdue_for < LEAVE_OVERDUE_AT_MOST {
        Seen::ReadOverdueButMarking(pid)
    } else {
        Seen::ReadButBehind(pid)
    }
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
        let overdue_for = self
            .overdue
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .overdue_for(Instant::now());
        let look = async {
            use store::outbox::admin::any_head_due_for_longer_than;
            use store::outbox::relaying::{marked_by_slot_reader_within, slot_reader};
            let Some(pid) = slot_reader(pool, slot).await? else {
                return Ok(Seen::Free);
            };
            if !any_head_due_for_longer_than(pool, crate::config::UNDELIVERED_AFTER).await? {
                return Ok(Seen::Read(pid));
            }
            let marking = marks_matter(overdue_for)
                && marked_by_slot_reader_within(
                    pool,
                    pid,
                    crate::config::APPLICATION_PREFIX,
                    DELIVERING_WITHIN,
                )
                .await?;
            Ok::<_, sqlx::Error>(overdue(pid, overdue_for, marking))
        };
        let seen = match tokio::time::timeout(LOOK_TIMEOUT, look).await {
            Ok(Ok(seen)) => seen,
            Ok(Err(error)) => Seen::Unknown(error_chain(&error)),
            Err(_) => Seen::Unknown(format!("no answer within {LOOK_TIMEOUT:?}")),
        };
        self.overdue
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .note(&seen, Instant::now());
        let stand_by = matches!(
            seen,
            Seen::Read(_) | Seen::ReadJustOverdue(_) | Seen::ReadOverdueButMarking(_)
        );
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
            Seen::ReadJustOverdue(pid) => tracing::debug!(
                slot,
                walsender_pid = pid,
                grace = ?OVERDUE_GRACE,
                "outbox rows look overdue; the WAL relay reading the slot gets a grace to deliver them (a large transaction just committed?)"
            ),
            Seen::ReadOverdueButMarking(pid) => tracing::info!(
                slot,
                walsender_pid = pid,
                at_most = ?LEAVE_OVERDUE_AT_MOST,
                "outbox rows have been overdue past the grace, but the WAL relay reading the slot marks rows as it delivers them (a large transaction); standing by"
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overdue_rows_are_left_to_the_reader_for_the_grace_then_while_it_marks_then_claimed() {
        let second = Duration::from_secs(1);
        // Within the grace: standing by, marks or not (they are not even asked for).
        assert!(!marks_matter(Duration::ZERO));
        assert_eq!(overdue(7, Duration::ZERO, false), Seen::ReadJustOverdue(7));
        assert_eq!(
            overdue(7, OVERDUE_GRACE - second, false),
            Seen::ReadJustOverdue(7)
        );
        // Past it: the reader's marks decide.
        assert!(marks_matter(OVERDUE_GRACE));
        assert_eq!(
            overdue(7, OVERDUE_GRACE, true),
            Seen::ReadOverdueButMarking(7)
        );
        assert_eq!(overdue(7, OVERDUE_GRACE, false), Seen::ReadButBehind(7));
        // Past the bound: claimed beside a reader that still marks (some aggregates only).
        assert!(!marks_matter(LEAVE_OVERDUE_AT_MOST));
        assert_eq!(
            overdue(7, LEAVE_OVERDUE_AT_MOST, true),
            Seen::ReadButBehind(7)
        );
    }

    #[test]
    fn the_overdue_clock_runs_from_the_first_overdue_look_until_one_finds_none() {
        let start = Instant::now();
        let at = |secs| start + Duration::from_secs(secs);
        let mut clock = OverdueClock::default();
        assert_eq!(clock.overdue_for(at(3)), Duration::ZERO);
        clock.note(&Seen::ReadJustOverdue(7), at(1));
        clock.note(&Seen::ReadOverdueButMarking(7), at(6));
        // A look that could not tell neither stops nor restarts it.
        clock.note(&Seen::Unknown("timeout".into()), at(7));
        assert_eq!(clock.overdue_for(at(9)), Duration::from_secs(8));
        clock.note(&Seen::Read(7), at(10));
        assert_eq!(clock.overdue_for(at(11)), Duration::ZERO);
        clock.note(&Seen::ReadButBehind(7), at(12));
        clock.note(&Seen::Free, at(13));
        assert_eq!(clock.overdue_for(at(14)), Duration::ZERO);
    }
}
