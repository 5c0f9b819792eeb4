//! What one relay step did, counted: the figures the step returns, the run sums and the metrics
//! record.

use serde::Serialize;

use crate::config::RelayConfig;

/// What one step did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct StepReport {
    /// Rows claimed: locked, and within the claim's bytes (heads past them stay locked until the
    /// step ends, unclaimed).
    pub claimed: usize,
    /// Bytes of message bodies among them.
    pub claimed_bytes: usize,
    /// Aggregate heads among them.
    pub heads: usize,
    /// Rows JetStream acknowledged (including duplicates).
    pub published: usize,
    /// Of those, PubAcks with `duplicate = true`.
    pub duplicates: usize,
    /// Rows that failed and will be retried.
    pub failed: usize,
    /// Rows that failed for the last time.
    pub dead: usize,
    /// Rows not published because an earlier version of their aggregate failed.
    pub held_back: usize,
    /// Rows not published because the step ran out of time or the relay is stopping (still pending).
    pub not_attempted: usize,
    /// Rows marked sent.
    pub marked_sent: usize,
    /// Published again more than the dedupe window after a possibly successful earlier publish (the
    /// fence, not the dedupe window, kept each of these once in the stream).
    pub republished_outside_window: usize,
    /// Of `published`, rows the broker's fence refused because the stream already held them (a claim
    /// published twice, e.g. by a relay that stalled past the dedupe window): marked sent, not stored.
    pub fenced: usize,
    /// Rows whose fence found the stream disagreeing with the store: not marked sent, retried with
    /// backoff, kept on the row (its `divergence`).
    pub divergences: usize,
    /// Other relays' stalled claim transactions ended before this step claimed.
    pub stale_claims_ended: usize,
    /// The step stopped after publishing, as a crash would (fail point).
    pub simulated_crash: bool,
}

impl StepReport {
    /// True when the claim was as large as allowed: more rows are probably waiting.
    pub fn was_full(&self, config: &RelayConfig) -> bool {
        let count = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        count(self.heads) >= config.batch_size
            || count(self.claimed) >= config.max_rows
            || count(self.claimed_bytes) >= config.max_claim_bytes
    }
}
