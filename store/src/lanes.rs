//! Aggregates written alone, outside group commit's groups: each in a lane of its own, one append
//! at a time, in a task the group writer never waits for.
//!
//! An append goes to its aggregate's lane when its group's statement was refused (a version taken
//! by another process, a lock waited on past the group's short wait), when a second append of its
//! aggregate came in the same group, or when its aggregate already has a lane. A lane's lone write
//! waits for another transaction's lock as long as the pool's sessions do (`lock_timeout`); every
//! other aggregate meanwhile goes on in the groups. When that wait runs out, the appends that queued
//! behind it are told at once that the aggregate is locked (they would only wait for the same lock),
//! and the aggregate stays out of the groups for [`LOCKED_MEMORY`], so that a client retrying a
//! locked order does not hold up the next group for its short wait again and again.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use sqlx::PgPool;
use uuid::Uuid;

use crate::alone::{self, Unwritten};
use crate::pending::Pending;

/// How long an aggregate whose lone write ran out of lock timeout stays out of the groups. Wrongly
/// remembering costs little (its next appends are written alone, not grouped); forgetting too soon
/// costs the next group a short lock wait.
const LOCKED_MEMORY: Duration = Duration::from_secs(5);

/// Beyond this many lanes, idle ones whose memory has run out are forgotten when a lane opens.
const SWEEP_ABOVE: usize = 1024;

/// The lanes of every aggregate being written alone.
#[derive(Debug)]
pub(crate) struct Lanes {
    pool: PgPool,
    lanes: Mutex<HashMap<Uuid, Lane>>,
}

#[derive(Debug, Default)]
struct Lane {
    queue: VecDeque<Pending>,
    /// A task is writing this lane's appends.
    writing: bool,
    /// The last lone write gave up on another transaction's lock: keep the aggregate out of the
    /// groups until then.
    locked_until: Option<Instant>,
}

impl Lane {
    fn remembered(&self, now: Instant) -> bool {
        self.writing || self.locked_until.is_some_and(|until| until > now)
    }
}

impl Lanes {
    pub(crate) fn new(pool: PgPool) -> Arc<Self> {
        Arc::new(Self {
            pool,
            lanes: Mutex::new(HashMap::new()),
        })
    }

    /// Queues `pending` in its aggregate's lane if the aggregate has one; otherwise hands it back
    /// for a group.
    pub(crate) fn divert(self: &Arc<Self>, pending: Pending) -> Option<Pending> {
        let now = Instant::now();
        let mut lanes = self.lock();
        match lanes.get(&pending.aggregate_id) {
            Some(lane) if lane.remembered(now) => {
                self.queue(&mut lanes, pending);
                None
            }
            Some(_) => {
                lanes.remove(&pending.aggregate_id);
                gauge(&lanes);
                Some(pending)
            }
            None => Some(pending),
        }
    }

    /// Queues `pending` in its aggregate's lane, opening one if needed.
    pub(crate) fn push(self: &Arc<Self>, pending: Pending) {
        let mut lanes = self.lock();
        self.queue(&mut lanes, pending);
    }

    fn queue(self: &Arc<Self>, lanes: &mut HashMap<Uuid, Lane>, pending: Pending) {
        let aggregate_id = pending.aggregate_id;
        if lanes.len() >= SWEEP_ABOVE && !lanes.contains_key(&aggregate_id) {
            let now = Instant::now();
            lanes.retain(|_, lane| lane.remembered(now));
        }
        let lane = lanes.entry(aggregate_id).or_default();
        lane.queue.push_back(pending);
        if !lane.writing {
            lane.writing = true;
            tokio::spawn(self.clone().write(aggregate_id));
        }
        gauge(lanes);
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<Uuid, Lane>> {
        // The map is consistent after every statement that changes it: a panic elsewhere while it
        // was held leaves nothing half done.
        self.lanes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The lane's task: writes its appends one at a time until none is left.
    async fn write(self: Arc<Self>, aggregate_id: Uuid) {
        while let Some(pending) = self.next(aggregate_id) {
            if pending.done.is_closed() {
                continue;
            }
            let written = alone::write(&self.pool, aggregate_id, &pending.part()).await;
            let locked = matches!(&written, Err(unwritten) if unwritten.is_locked());
            let _ = pending.done.send(written);
            let behind = self.settle(aggregate_id, locked);
            if !behind.is_empty() {
                tracing::info!(%aggregate_id, appends = behind.len(), "aggregate locked by another transaction; appends queued behind its lone write refused");
                metrics::counter!("waybill_group_commit_locked_behind_total")
                    .increment(behind.len() as u64);
            }
            for pending in behind {
                let _ = pending.done.send(Err(Unwritten::Locked));
            }
        }
    }

    /// The lane's next append, or `None` (and the lane closed, or only remembered) when its queue
    /// is empty.
    fn next(&self, aggregate_id: Uuid) -> Option<Pending> {
        let mut lanes = self.lock();
        let lane = lanes.get_mut(&aggregate_id)?;
        if let Some(pending) = lane.queue.pop_front() {
            return Some(pending);
        }
        lane.writing = false;
        if !lane.remembered(Instant::now()) {
            lanes.remove(&aggregate_id);
        }
        gauge(&lanes);
        None
    }

    /// Notes how the lane's last write ended; when it gave up on a lock, takes the appends that
    /// queued behind it.
    fn settle(&self, aggregate_id: Uuid, locked: bool) -> Vec<Pending> {
        let mut lanes = self.lock();
        let Some(lane) = lanes.get_mut(&aggregate_id) else {
            return Vec::new();
        };
        if locked {
            lane.locked_until = Some(Instant::now() + LOCKED_MEMORY);
            lane.queue.drain(..).collect()
        } else {
            lane.locked_until = None;
            Vec::new()
        }
    }
}

fn gauge(lanes: &HashMap<Uuid, Lane>) {
    metrics::gauge!("waybill_group_commit_alone_aggregates").set(lanes.len() as f64);
}

pub(crate) fn describe_metrics() {
    metrics::describe_gauge!(
        "waybill_group_commit_alone_aggregates",
        "Aggregates whose appends are written alone, outside the groups: their group was refused, or their aggregate is locked by another transaction (remembered for 5 s after a lone write gave up on the lock)"
    );
    metrics::describe_counter!(
        "waybill_group_commit_locked_behind_total",
        "Appends refused at once because they queued behind a lone write of their aggregate that gave up on another transaction's lock"
    );
}
