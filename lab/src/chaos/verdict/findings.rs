//! What the verdict writes: the findings every check adds to, and the violations that fail the run.

use std::collections::BTreeMap;

use serde::Serialize;

/// The findings; the run passes when `violations` is empty.
#[derive(Debug, Default, Serialize)]
pub(in crate::chaos) struct Verdict {
    /// Events in the event store.
    pub events: usize,
    /// Orders in the event store.
    pub orders: usize,
    /// Accepted commands whose event is not in the event store.
    pub lost_commands: usize,
    /// Stored events missing from the stream.
    pub missing_from_stream: usize,
    /// Extra copies of stored events in the stream.
    pub duplicates_in_stream: usize,
    /// Stream messages (not hostile) whose event the store does not hold, or that cannot be read.
    pub strangers_in_stream: usize,
    /// Orders whose versions do not appear in the stream in increasing order.
    pub out_of_order: usize,
    /// Hostile messages found in the stream.
    pub hostile_in_stream: usize,
    /// Outbox rows by status other than sent.
    pub outbox_unsent: BTreeMap<String, i64>,
    /// Per projection, entries that differ from the fold (SKUs, customers, orders).
    pub mismatches: BTreeMap<String, Vec<String>>,
    /// Parked messages per projection.
    pub parked: BTreeMap<String, usize>,
    /// Held events per projection.
    pub held: BTreeMap<String, usize>,
    /// Every reason the run fails.
    pub violations: Vec<String>,
}

impl Verdict {
    /// True when nothing was violated.
    pub(in crate::chaos) fn pass(&self) -> bool {
        self.violations.is_empty()
    }

    /// A process that exited without being killed is a violation: the system must ride out every
    /// fault without crashing (the harness restarted it, as a supervisor would, and counted it).
    pub(in crate::chaos) fn note_exits(
        &mut self,
        processes: &[crate::chaos::fleet::ProcessSummary],
    ) {
        for process in processes.iter().filter(|p| p.unexpected_exits > 0) {
            self.violations.push(format!(
                "{} exited on its own {} time(s); its log says why",
                process.name, process.unexpected_exits
            ));
        }
    }

    /// Accepted commands lost plus stored events missing from the stream.
    pub(in crate::chaos) fn lost(&self) -> usize {
        self.lost_commands + self.missing_from_stream
    }

    /// Entries differing between projections and the fold, all projections together.
    pub(in crate::chaos) fn projection_mismatches(&self) -> usize {
        self.mismatches.values().map(Vec::len).sum()
    }
}
