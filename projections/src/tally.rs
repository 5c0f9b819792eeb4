//! What a batch, a catch-up or a run did, counted by verdict: the figures every summary, progress
//! line and metric reports.

use serde::Serialize;

use crate::plan::Verdict;

/// Counts over a batch or a run.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Tally {
    /// Messages seen.
    pub messages: u64,
    /// Applied straight from the delivery.
    pub applied: u64,
    /// Duplicates absorbed.
    pub duplicates: u64,
    /// Kept in the held table for a missing predecessor.
    pub held: u64,
    /// Poison parked.
    pub parked: u64,
    /// Other partitions' messages, acked without being applied (not among `messages`; only with
    /// several partitions, and only then in the JSON).
    #[serde(skip_serializing_if = "is_zero")]
    pub skipped: u64,
    /// Messages of aggregate types the projection does not read, acked unread (not among
    /// `messages`; only in the JSON when there were some).
    #[serde(skip_serializing_if = "is_zero")]
    pub other_types: u64,
    /// Of `messages`, the events read from the event store's `events` table by a catch-up rather
    /// than delivered by the stream (only in the JSON when there were some).
    #[serde(skip_serializing_if = "is_zero")]
    pub from_store: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl Tally {
    pub(crate) fn count(&mut self, verdicts: &[Verdict]) {
        for verdict in verdicts {
            self.messages += 1;
            match verdict {
                Verdict::Applied => self.applied += 1,
                Verdict::Duplicate => self.duplicates += 1,
                Verdict::Held => self.held += 1,
                Verdict::Parked => self.parked += 1,
            }
        }
    }

    pub(crate) fn merge(&mut self, other: &Tally) {
        self.messages += other.messages;
        self.applied += other.applied;
        self.duplicates += other.duplicates;
        self.held += other.held;
        self.parked += other.parked;
        self.skipped += other.skipped;
        self.other_types += other.other_types;
        self.from_store += other.from_store;
    }
}
