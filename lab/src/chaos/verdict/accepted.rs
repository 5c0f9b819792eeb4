//! Every command the load saw accepted has its event in the event store.

use std::collections::HashMap;

use uuid::Uuid;

use super::evidence::{Evidence, StoredEvent};
use super::findings::Verdict;

/// Counts the accepted commands whose event the store does not hold (`stored`: by event id).
pub(super) fn check_accepted(
    verdict: &mut Verdict,
    evidence: &Evidence<'_>,
    stored: &HashMap<Uuid, &StoredEvent>,
) {
    let lost: Vec<_> = evidence
        .played
        .accepted
        .iter()
        .filter(|a| !stored.contains_key(&a.event_id))
        .collect();
    verdict.lost_commands = lost.len();
    if let Some(first) = lost.first() {
        verdict.violations.push(format!(
            "{} accepted command(s) have no event in the store, e.g. {} of order {} (event {})",
            lost.len(),
            first.command,
            first.order_id,
            first.event_id
        ));
    }
}
