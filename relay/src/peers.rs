//! Relays that share an outbox split its aggregates between them, as one relay's lanes do.
//!
//! Each running relay holds a numbered slot: a PostgreSQL session advisory lock on a connection of its
//! own, so a relay that dies or loses that connection gives its slot up at once, with nothing to expire.
//! A second lock on the same connection announces how many lanes it runs. Every relay reads the
//! holders five times a second and takes its [`Seat`]: lane `k` of a relay whose slot comes after
//! relays with `offset` lanes in all claims the aggregates whose hash is `offset + k` modulo the lanes
//! of every relay. Two one-lane relays then never walk past each other's locked heads.
//!
//! The split is a preference, never a promise of ownership: ordering comes from row locks and the head
//! rule, whatever a lane claims. So a seat may be stale for a moment after a relay joins or leaves,
//! and a relay that is frozen (not dead: its slot stays held) only slows its share down, because
//! [`Relay::run`](crate::Relay::run) lanes claim without the split after an empty claim and at least
//! once a second, and a drain claims without it before it ends.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use ops::error_chain;
use sqlx::{PgConnection, PgPool};

/// The advisory-lock key (`classid`) of the slots: one lock per running relay, on `(SLOTS, slot)`.
const SLOTS: i32 = 0x5742_5253; // "WBRS"
/// The key announcing a slot's lanes: `(LANES, slot * LANE_LIMIT + lanes)`.
const LANES: i32 = 0x5742_524c; // "WBRL"
/// Lanes a slot can announce (a relay with more claims as if it had this many among its peers).
const LANE_LIMIT: u32 = 1024;
/// Relays that can hold a slot at once; a relay that finds none claims as if it were alone.
const MAX_SLOTS: i32 = 64;
/// How often the holders are read again.
pub const REFRESH: Duration = Duration::from_millis(200);

/// Where a relay's lanes sit among the lanes of every relay sharing the outbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seat {
    /// Lanes of the relays whose slot comes before this relay's.
    pub offset: u32,
    /// Lanes of every relay holding a slot, this one included.
    pub total: u32,
    /// Relays holding a slot, this one included.
    pub relays: u32,
}

impl Seat {
    /// A relay alone with its `lanes`.
    pub fn alone(lanes: u32) -> Self {
        Self {
            offset: 0,
            total: lanes.max(1),
            relays: 1,
        }
    }

    /// Computes the seat of `slot` from every holder's `(slot, lanes)`; `None` when `slot` is not
    /// among them.
    pub fn among(holders: &[(i32, u32)], slot: i32) -> Option<Self> {
        let mut holders = holders.to_vec();
        holders.sort_unstable();
        holders.dedup_by_key(|(slot, _)| *slot);
        holders.iter().any(|(s, _)| *s == slot).then(|| Self {
            offset: holders
                .iter()
                .filter(|(s, _)| *s < slot)
                .map(|(_, lanes)| lanes.max(&1))
                .sum(),
            total: holders.iter().map(|(_, lanes)| lanes.max(&1)).sum(),
            relays: u32::try_from(holders.len()).unwrap_or(u32::MAX),
        })
    }

    /// The share `(k, n)` of lane `lane` (claim aggregates whose hash modulo `n` is `k`), or `None`
    /// when one lane has every aggregate.
    pub fn share(&self, lane: u32) -> Option<(u32, u32)> {
        (self.total > 1).then_some((self.offset + lane, self.total))
    }
}

/// This relay's membership among the relays sharing the outbox: holds its slot while it lives and
/// keeps its [`Seat`] current. Dropping it gives the slot up.
#[derive(Debug)]
pub struct Peers {
    seat: Arc<Mutex<Option<Seat>>>,
    /// Holds the slot's connection and refreshes the seat; `None` for [`Peers::none`].
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Peers {
    /// Takes a slot for a relay running `lanes` lanes, over a connection of its own opened with
    /// `pool`'s options, and reads the holders once before returning (so a drain starts split). Never
    /// fails: without a slot the relay claims as if it were alone, and keeps trying.
    pub async fn join(pool: &PgPool, lanes: u32) -> Self {
        let lanes = lanes.clamp(1, LANE_LIMIT - 1);
        let options = (*pool.connect_options()).clone();
        // A pool of one, for its connect hook (TCP_NODELAY); the connection is detached from it, so
        // that dropping it closes the session and with it the slot.
        let opener = ops::database::pool_options(1).connect_lazy_with(options);
        let seat = Arc::new(Mutex::new(None));
        let mut member = Member {
            opener,
            lanes,
            held: None,
            warned: false,
            last: None,
        };
        let first = member.refresh().await;
        *seat.lock().unwrap_or_else(PoisonError::into_inner) = first;
        let task = tokio::spawn({
            let seat = seat.clone();
            async move {
                loop {
                    tokio::time::sleep(REFRESH).await;
                    let now = member.refresh().await;
                    *seat.lock().unwrap_or_else(PoisonError::into_inner) = now;
                }
            }
        });
        Self {
            seat,
            task: Some(task),
        }
    }

    /// No slot and no seat: the relay claims as if it were alone and tells the others nothing. For a
    /// relay reading the WAL, whose occasional polling pass must not make the polling relays split
    /// their shares again before and after it.
    pub fn none() -> Self {
        Self {
            seat: Arc::new(Mutex::new(None)),
            task: None,
        }
    }

    /// The current seat, or `None` while this relay holds no slot.
    pub fn seat(&self) -> Option<Seat> {
        *self.seat.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Drop for Peers {
    fn drop(&mut self) {
        // Dropping the task drops its connection: PostgreSQL ends the session and frees the slot.
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

/// The refreshing side: the slot's connection and what was last reported.
struct Member {
    opener: PgPool,
    lanes: u32,
    /// The connection holding the slot, and the slot.
    held: Option<(PgConnection, i32)>,
    warned: bool,
    last: Option<Seat>,
}

impl Member {
    async fn refresh(&mut self) -> Option<Seat> {
        let seat = match self.read().await {
            Ok(seat) => {
                self.warned = false;
                seat
            }
            Err(error) => {
                // The session is gone or failing: drop it (freeing the slot if it still held it) and
                // claim as if alone until a slot is held again.
                self.held = None;
                if !self.warned {
                    tracing::warn!(error = %error_chain(&error), "cannot hold a relay slot; claiming as if no other relay ran");
                    self.warned = true;
                }
                None
            }
        };
        if seat != self.last {
            match seat {
                Some(seat) => tracing::info!(
                    relays = seat.relays,
                    lanes_from = seat.offset,
                    lanes_to = seat.offset + self.lanes,
                    lanes_in_all = seat.total,
                    "relays sharing the outbox changed; this relay's lanes claim their share"
                ),
                None => {
                    tracing::info!("this relay holds no slot; its lanes claim as if it ran alone")
                }
            }
            crate::metrics::record_seat(seat.map_or(0, |s| s.relays), seat.map_or(0, |s| s.total));
            self.last = seat;
        }
        seat
    }

    async fn read(&mut self) -> sqlx::Result<Option<Seat>> {
        if self.held.is_none() {
            let mut connection = self.opener.acquire().await?.detach();
            let slot: Option<i32> = sqlx::query_scalar(
                "SELECT s FROM generate_series(0, $2 - 1) s WHERE pg_try_advisory_lock($1, s) LIMIT 1",
            )
            .bind(SLOTS)
            .bind(MAX_SLOTS)
            .fetch_optional(&mut connection)
            .await?;
            let Some(slot) = slot else {
                // Every slot is held: no seat, and no session kept open for nothing.
                if !self.warned {
                    tracing::warn!(
                        slots = MAX_SLOTS,
                        "every relay slot is held; claiming as if no other relay ran"
                    );
                    self.warned = true;
                }
                return Ok(None);
            };
            #[allow(
                clippy::cast_possible_wrap,
                reason = "slot < MAX_SLOTS and lanes < LANE_LIMIT (clamped in join): the key is below 2^16"
            )]
            sqlx::query("SELECT pg_advisory_lock($1, $2)")
                .bind(LANES)
                .bind(slot * LANE_LIMIT as i32 + self.lanes as i32)
                .execute(&mut connection)
                .await?;
            self.held = Some((connection, slot));
        }
        let Some((connection, slot)) = self.held.as_mut() else {
            return Ok(None);
        };
        let holders: Vec<(i64,)> = sqlx::query_as(
            "SELECT objid::int8 FROM pg_locks
             WHERE locktype = 'advisory' AND classid = $1::int8::oid AND objsubid = 2 AND granted
               AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        )
        .bind(i64::from(LANES))
        .fetch_all(&mut *connection)
        .await?;
        let holders: Vec<(i32, u32)> = holders
            .into_iter()
            // An oid (0..2^32) split as announced; a key out of range is no relay's announcement.
            .filter_map(|(key,)| {
                Some((
                    i32::try_from(key / i64::from(LANE_LIMIT)).ok()?,
                    u32::try_from(key % i64::from(LANE_LIMIT)).ok()?,
                ))
            })
            .collect();
        Ok(Seat::among(&holders, *slot))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seats_follow_the_slots_and_count_lanes() {
        let holders = [(3, 1), (0, 2), (5, 1)];
        assert_eq!(
            Seat::among(&holders, 0),
            Some(Seat {
                offset: 0,
                total: 4,
                relays: 3
            })
        );
        assert_eq!(Seat::among(&holders, 3).map(|s| s.offset), Some(2));
        assert_eq!(Seat::among(&holders, 5).map(|s| s.offset), Some(3));
        assert_eq!(Seat::among(&holders, 4), None);
    }

    #[test]
    fn every_lane_of_every_relay_gets_its_own_share() {
        let holders = [(0, 2), (1, 1), (7, 3)];
        let mut shares: Vec<(u32, u32)> = holders
            .iter()
            .flat_map(|&(slot, lanes)| {
                let seat = Seat::among(&holders, slot).expect("a holder");
                (0..lanes).map(move |lane| seat.share(lane).expect("split"))
            })
            .collect();
        shares.sort_unstable();
        assert_eq!(shares, (0..6).map(|k| (k, 6)).collect::<Vec<_>>());
    }

    #[test]
    fn one_lane_alone_claims_everything() {
        assert_eq!(Seat::alone(1).share(0), None);
        assert_eq!(Seat::among(&[(2, 1)], 2).and_then(|s| s.share(0)), None);
        assert_eq!(Seat::alone(2).share(1), Some((1, 2)));
    }
}
