//! Totals over a run or a drain, and the progress line that reports them while the relay runs.

use std::time::{Duration, Instant};

use serde::Serialize;

use crate::step::StepReport;

/// Totals over a run.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct RunSummary {
    /// Steps that claimed something.
    pub steps: u64,
    /// Rows claimed.
    pub claimed: u64,
    /// Rows acknowledged by JetStream.
    pub published: u64,
    /// Of those, duplicates.
    pub duplicates: u64,
    /// Failed publishes scheduled for retry.
    pub failed: u64,
    /// Rows that went dead.
    pub dead: u64,
    /// Rows marked sent.
    pub marked_sent: u64,
    /// Republished outside the dedupe window.
    pub republished_outside_window: u64,
    /// Rows the broker's fence showed were in the stream already (marked sent, not stored again).
    pub fenced: u64,
    /// Rows whose fence found the stream disagreeing with the store (not marked sent; retried with
    /// backoff).
    pub divergences: u64,
    /// Other relays' stalled claim transactions this relay ended.
    pub stale_claims_ended: u64,
    /// Steps that failed (claim or settle).
    pub step_errors: u64,
}

impl RunSummary {
    pub(super) fn merge(&mut self, other: &RunSummary) {
        self.steps += other.steps;
        self.claimed += other.claimed;
        self.published += other.published;
        self.duplicates += other.duplicates;
        self.failed += other.failed;
        self.dead += other.dead;
        self.marked_sent += other.marked_sent;
        self.republished_outside_window += other.republished_outside_window;
        self.fenced += other.fenced;
        self.divergences += other.divergences;
        self.stale_claims_ended += other.stale_claims_ended;
        self.step_errors += other.step_errors;
    }

    pub(super) fn add(&mut self, r: &StepReport) {
        self.steps += u64::from(r.claimed > 0);
        self.claimed += r.claimed as u64;
        self.published += r.published as u64;
        self.duplicates += r.duplicates as u64;
        self.failed += r.failed as u64;
        self.dead += r.dead as u64;
        self.marked_sent += r.marked_sent as u64;
        self.republished_outside_window += r.republished_outside_window as u64;
        self.fenced += r.fenced as u64;
        self.divergences += r.divergences as u64;
        self.stale_claims_ended += r.stale_claims_ended as u64;
    }
}

/// An info line every 10 s while the relay is moving rows: totals and the recent rate.
pub(super) struct Progress {
    last: Instant,
    published_at_last: u64,
}

impl Progress {
    pub(super) fn new() -> Self {
        Self {
            last: Instant::now(),
            published_at_last: 0,
        }
    }

    pub(super) fn tick(&mut self, summary: &RunSummary) {
        let elapsed = self.last.elapsed();
        if elapsed < Duration::from_secs(10) || summary.published == self.published_at_last {
            return;
        }
        let rate = (summary.published - self.published_at_last) as f64 / elapsed.as_secs_f64();
        tracing::info!(
            published = summary.published,
            duplicates = summary.duplicates,
            failed = summary.failed,
            dead = summary.dead,
            rate_per_s = rate.round(),
            "relaying"
        );
        self.last = Instant::now();
        self.published_at_last = summary.published;
    }
}
