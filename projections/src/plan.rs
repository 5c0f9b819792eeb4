//! A batch's plan, pure: the checkpoint verdict ([`crate::checkpoint::decide`]) run over every event
//! on offer (from the batch just delivered and from the held table), in version order per aggregate —
//! which are applied and in which order, which are duplicates, which are held for a missing
//! predecessor, and which are refused. No I/O: the runner feeds it and carries out the outcome.
//!
//! Held events are looked up by the runner only for aggregates whose checkpoint moved: [`Plan::wanted`]
//! names them, [`Plan::offer_held`] takes what the held table had, until nothing more moves.

use std::collections::btree_map::Entry;
use std::collections::{BTreeMap, HashMap};

use serde::Serialize;
use uuid::Uuid;

use crate::checkpoint::{Checkpoint, Decision, Facts, decide};

/// The deliberately broken mode: redeliveries are applied again. It exists only in `fault-injection`
/// builds, switched on by `waybill-projection-faulty NAME run --ignore-checkpoint`, so that the chaos
/// harness can prove it catches a projection that ignores its checkpoint. Process-wide because it stands for a broken build,
/// not for a setting a caller could choose per batch.
#[cfg(feature = "fault-injection")]
static IGNORE_CHECKPOINT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The environment variable, and its value, without which `--ignore-checkpoint` refuses to run (in
/// every build: the chaos harness sets it for the faulty twin it starts).
pub const BREAK_CHECKPOINT_VAR: &str = "WAYBILL_BREAK_CHECKPOINT";
/// See [`BREAK_CHECKPOINT_VAR`].
pub const BREAK_CHECKPOINT_CONSENT: &str = "apply-redeliveries-again";

/// Breaks this process's checkpoint check on purpose (see [`IGNORE_CHECKPOINT`]).
#[cfg(feature = "fault-injection")]
pub fn ignore_checkpoint() {
    IGNORE_CHECKPOINT.store(true, std::sync::atomic::Ordering::Relaxed);
}

fn checkpoint_ignored() -> bool {
    #[cfg(feature = "fault-injection")]
    return IGNORE_CHECKPOINT.load(std::sync::atomic::Ordering::Relaxed);
    #[cfg(not(feature = "fault-injection"))]
    false
}

/// What the runner decided for one message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// Applied; the checkpoint moved.
    Applied,
    /// Already applied (at or below the checkpoint), or a second copy of a held version: acked, not
    /// applied.
    Duplicate,
    /// A later version than the next one: acked and kept in the held table until its predecessor is
    /// applied (or an operator releases the order).
    Held,
    /// Cannot be applied by this code: stored in `parked`, terminated on the broker.
    Parked,
}

/// Where an event on offer came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Slot {
    /// The batch's message at this index.
    Batch(usize),
    /// The held table's row at this index of what the runner offered.
    Held(usize),
}

/// What the plan needs to know about an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Offer {
    /// Where it came from.
    pub slot: Slot,
    /// Its aggregate.
    pub aggregate_id: Uuid,
    /// Its version.
    pub version: i64,
    /// The facts checked against the aggregate's checkpoint.
    pub facts: Facts,
}

/// The decisions, for the runner to carry out in one transaction.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Outcome {
    /// To apply, in this order (per aggregate in version order).
    pub apply: Vec<Slot>,
    /// The checkpoints that moved, to write with the data.
    pub checkpoints: BTreeMap<Uuid, Checkpoint>,
    /// Batch messages to keep in the held table.
    pub hold: Vec<usize>,
    /// Events that contradict their order: park with the reason (a held one leaves the held table).
    pub refuse: Vec<(Slot, String)>,
    /// One verdict per batch message (refused ones are `Parked`).
    pub verdicts: Vec<Verdict>,
}

/// The verdict under construction.
#[derive(Debug)]
pub struct Plan {
    checkpoints: HashMap<Uuid, Checkpoint>,
    /// Offers ahead of their checkpoint, by (aggregate, version).
    waiting: BTreeMap<(Uuid, i64), Offer>,
    /// Aggregates whose checkpoint moved since [`Plan::wanted`] last asked.
    moved: Vec<Uuid>,
    outcome: Outcome,
}

impl Plan {
    /// A plan over `messages` batch messages, with the checkpoints known for their aggregates (absent
    /// ones start at 0).
    pub fn new(messages: usize, checkpoints: HashMap<Uuid, Checkpoint>) -> Self {
        Self {
            checkpoints,
            waiting: BTreeMap::new(),
            moved: Vec::new(),
            outcome: Outcome {
                verdicts: vec![Verdict::Parked; messages],
                ..Outcome::default()
            },
        }
    }

    /// Sets an aggregate's checkpoint by an operator's decision (skipping versions deliberately): its
    /// held events are wanted next.
    pub fn force(&mut self, aggregate_id: Uuid, version: i64) {
        let checkpoint = self.checkpoints.entry(aggregate_id).or_default();
        checkpoint.version = version;
        self.outcome.checkpoints.insert(aggregate_id, *checkpoint);
        self.moved.push(aggregate_id);
    }

    /// Offers the batch's decodable messages.
    pub fn offer_batch(&mut self, mut offers: Vec<Offer>) {
        offers.sort_by_key(|o| (o.aggregate_id, o.version, o.slot));
        for offer in offers {
            self.consider(offer);
        }
    }

    /// The aggregates whose checkpoint moved since the last call, each with the highest version the
    /// held table may hold for it that is now due or stale (checkpoint + 1).
    pub fn wanted(&mut self) -> Vec<(Uuid, i64)> {
        self.moved.sort();
        self.moved.dedup();
        self.moved
            .drain(..)
            .map(|id| (id, self.checkpoints.get(&id).map_or(0, |c| c.version) + 1))
            .collect()
    }

    /// Offers what the held table had for [`Plan::wanted`]. Rows at or below the checkpoint are stale
    /// (their version was applied from a later delivery): the runner deletes them either way.
    pub fn offer_held(&mut self, mut offers: Vec<Offer>) {
        offers.sort_by_key(|o| (o.aggregate_id, o.version, o.slot));
        for offer in offers {
            let current = self.checkpoint(offer.aggregate_id).version;
            if offer.version == current + 1 {
                self.consider(offer);
            }
        }
    }

    /// The decisions.
    pub fn finish(mut self) -> Outcome {
        for ((_, _), offer) in std::mem::take(&mut self.waiting) {
            if let Slot::Batch(index) = offer.slot {
                self.outcome.hold.push(index);
                self.outcome.verdicts[index] = Verdict::Held;
            }
        }
        self.outcome.hold.sort_unstable();
        self.outcome
    }

    fn checkpoint(&mut self, aggregate_id: Uuid) -> Checkpoint {
        *self.checkpoints.entry(aggregate_id).or_default()
    }

    fn verdict(&mut self, slot: Slot, verdict: Verdict) {
        if let Slot::Batch(index) = slot {
            self.outcome.verdicts[index] = verdict;
        }
    }

    fn consider(&mut self, offer: Offer) {
        let current = self.checkpoint(offer.aggregate_id);
        match decide(&current, offer.version, &offer.facts) {
            Decision::Duplicate if checkpoint_ignored() => {
                // The deliberately broken mode: a redelivery is applied again.
                self.outcome.apply.push(offer.slot);
                self.verdict(offer.slot, Verdict::Applied);
            }
            Decision::Duplicate => self.verdict(offer.slot, Verdict::Duplicate),
            Decision::Hold => match self.waiting.entry((offer.aggregate_id, offer.version)) {
                // A second copy of a version already waiting: the first one stays.
                Entry::Occupied(_) => self.verdict(offer.slot, Verdict::Duplicate),
                Entry::Vacant(slot) => {
                    slot.insert(offer);
                }
            },
            Decision::Refuse(reason) => {
                self.outcome.refuse.push((offer.slot, reason));
                self.verdict(offer.slot, Verdict::Parked);
            }
            Decision::Apply => self.apply(offer, current),
        }
    }

    /// `offer` is exactly the next version and consistent with its order: apply it, then consider
    /// whatever waits right behind it.
    fn apply(&mut self, offer: Offer, current: Checkpoint) {
        let moved = current.after(offer.version, &offer.facts);
        self.checkpoints.insert(offer.aggregate_id, moved);
        self.outcome.checkpoints.insert(offer.aggregate_id, moved);
        self.outcome.apply.push(offer.slot);
        self.verdict(offer.slot, Verdict::Applied);
        self.moved.push(offer.aggregate_id);
        if let Some(behind) = self
            .waiting
            .remove(&(offer.aggregate_id, offer.version + 1))
        {
            self.consider(behind);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: Uuid = Uuid::from_u128(1);
    const B: Uuid = Uuid::from_u128(2);

    fn offer(slot: Slot, aggregate_id: Uuid, version: i64) -> Offer {
        Offer {
            slot,
            aggregate_id,
            version,
            facts: Facts::Other,
        }
    }

    fn at(version: i64) -> Checkpoint {
        Checkpoint {
            version,
            total_cents: None,
        }
    }

    #[test]
    fn next_versions_apply_older_ones_are_duplicates() {
        let mut plan = Plan::new(3, HashMap::from([(A, at(2))]));
        plan.offer_batch(vec![
            offer(Slot::Batch(0), A, 2),
            offer(Slot::Batch(1), A, 3),
            offer(Slot::Batch(2), B, 1),
        ]);
        assert_eq!(plan.wanted(), vec![(A, 4), (B, 2)]);
        let outcome = plan.finish();
        assert_eq!(
            outcome.verdicts,
            vec![Verdict::Duplicate, Verdict::Applied, Verdict::Applied]
        );
        assert_eq!(outcome.checkpoints[&A].version, 3);
        assert_eq!(outcome.checkpoints[&B].version, 1);
    }

    #[test]
    fn a_version_ahead_of_its_predecessor_in_the_same_batch_follows_it() {
        let mut plan = Plan::new(2, HashMap::new());
        plan.offer_batch(vec![
            offer(Slot::Batch(0), A, 2),
            offer(Slot::Batch(1), A, 1),
        ]);
        let outcome = plan.finish();
        assert_eq!(outcome.apply, vec![Slot::Batch(1), Slot::Batch(0)]);
        assert_eq!(outcome.verdicts, vec![Verdict::Applied, Verdict::Applied]);
    }

    #[test]
    fn a_gap_is_held_and_a_second_copy_of_it_is_a_duplicate() {
        let mut plan = Plan::new(3, HashMap::new());
        plan.offer_batch(vec![
            offer(Slot::Batch(0), A, 3),
            offer(Slot::Batch(1), A, 3),
            offer(Slot::Batch(2), B, 2),
        ]);
        assert!(plan.wanted().is_empty(), "nothing moved: no held lookup");
        let outcome = plan.finish();
        assert_eq!(outcome.hold, vec![0, 2]);
        assert_eq!(
            outcome.verdicts,
            vec![Verdict::Held, Verdict::Duplicate, Verdict::Held]
        );
        assert!(outcome.apply.is_empty() && outcome.checkpoints.is_empty());
    }

    #[test]
    fn held_events_apply_behind_their_predecessor_and_unblock_the_batch() {
        // Checkpoint 1; held has 3; the batch brings 2 and 4.
        let mut plan = Plan::new(2, HashMap::from([(A, at(1))]));
        plan.offer_batch(vec![
            offer(Slot::Batch(0), A, 4),
            offer(Slot::Batch(1), A, 2),
        ]);
        assert_eq!(plan.wanted(), vec![(A, 3)]);
        plan.offer_held(vec![offer(Slot::Held(0), A, 3)]);
        assert_eq!(plan.wanted(), vec![(A, 5)]);
        plan.offer_held(vec![]);
        assert!(plan.wanted().is_empty());
        let outcome = plan.finish();
        assert_eq!(
            outcome.apply,
            vec![Slot::Batch(1), Slot::Held(0), Slot::Batch(0)]
        );
        assert_eq!(outcome.checkpoints[&A].version, 4);
        assert!(outcome.hold.is_empty());
    }

    #[test]
    fn stale_held_rows_are_not_applied_again() {
        let mut plan = Plan::new(1, HashMap::from([(A, at(1))]));
        plan.offer_batch(vec![offer(Slot::Batch(0), A, 2)]);
        assert_eq!(plan.wanted(), vec![(A, 3)]);
        plan.offer_held(vec![offer(Slot::Held(0), A, 2)]);
        let outcome = plan.finish();
        assert_eq!(outcome.apply, vec![Slot::Batch(0)]);
    }

    #[test]
    fn a_payment_that_is_not_the_total_is_refused_and_what_follows_is_held() {
        let placed = Offer {
            facts: Facts::Placed { total_cents: 2500 },
            ..offer(Slot::Batch(0), A, 1)
        };
        let forged = Offer {
            facts: Facts::Paid {
                amount_cents: 1_000_000_000_000,
            },
            ..offer(Slot::Batch(1), A, 2)
        };
        let shipped = offer(Slot::Batch(2), A, 3);
        let mut plan = Plan::new(3, HashMap::new());
        plan.offer_batch(vec![placed, forged, shipped]);
        let outcome = plan.finish();
        assert_eq!(
            outcome.verdicts,
            vec![Verdict::Applied, Verdict::Parked, Verdict::Held]
        );
        assert!(
            outcome.refuse[0].1.contains("total is 2500"),
            "{:?}",
            outcome.refuse
        );
        assert_eq!(outcome.checkpoints[&A].total_cents, Some(2500));

        // The genuine payment is then the next version, and applies.
        let mut plan = Plan::new(1, outcome.checkpoints.clone().into_iter().collect());
        plan.offer_batch(vec![Offer {
            facts: Facts::Paid { amount_cents: 2500 },
            ..offer(Slot::Batch(0), A, 2)
        }]);
        assert_eq!(plan.finish().verdicts, vec![Verdict::Applied]);
    }

    #[test]
    fn an_operator_release_moves_the_checkpoint_past_the_missing_version() {
        let mut plan = Plan::new(0, HashMap::from([(A, at(1))]));
        plan.force(A, 4);
        assert_eq!(plan.wanted(), vec![(A, 5)]);
        plan.offer_held(vec![offer(Slot::Held(0), A, 5)]);
        assert_eq!(plan.wanted(), vec![(A, 6)]);
        let outcome = plan.finish();
        assert_eq!(outcome.apply, vec![Slot::Held(0)]);
        assert_eq!(outcome.checkpoints[&A].version, 5);
    }
}
