//! The relay's metrics, by name. Counters and the latency histograms are recorded as work happens; the
//! outbox gauges are refreshed from the database by `run` every few seconds.

use std::time::Duration;

use metrics::{
    Unit, counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram,
};

use crate::admin::OutboxStatus;
use crate::step_report::StepReport;

/// Registers descriptions, so a scrape explains every series.
pub fn describe() {
    describe_gauge!(
        "waybill_relay_peers",
        "Relays holding a slot on this outbox, this one included (0: this relay holds none and claims every aggregate)."
    );
    describe_gauge!(
        "waybill_relay_standing_by",
        "1 while this polling relay stands by because a WAL relay reads the replication slot and keeps up (no aggregate's next row due for over 10 s); it claims nothing then. 0 otherwise."
    );
    describe_gauge!(
        "waybill_relay_lanes_in_all",
        "Lanes of every relay holding a slot: the aggregates are split this many ways."
    );
    describe_counter!(
        "waybill_relay_published_total",
        "Outbox rows published and acknowledged by JetStream."
    );
    describe_counter!(
        "waybill_relay_duplicate_acks_total",
        "PubAcks with duplicate=true: JetStream already held the event (counted as success)."
    );
    describe_counter!(
        "waybill_relay_retries_total",
        "Failed publishes that were scheduled for a retry."
    );
    describe_counter!(
        "waybill_relay_dead_total",
        "Rows that reached the attempt limit and are now dead."
    );
    describe_counter!(
        "waybill_relay_republished_outside_window_total",
        "Events published again more than the dedupe window after a publish that may have reached the stream; JetStream no longer knew their ids, and the fence kept each once (refused copies are in waybill_relay_fenced_total)."
    );
    describe_counter!(
        "waybill_relay_fenced_total",
        "Publishes the broker's fence refused because the stream already held the event or a later version of its aggregate (a claim published twice, e.g. by a relay that stalled past the dedupe window); marked sent, not stored again."
    );
    describe_counter!(
        "waybill_relay_divergences_total",
        "Publishes whose fence found the stream disagreeing with the store, by kind (other_event: the row's version is another event in the stream, e.g. a store restored behind its stream; missing: later versions are there but not this one; foreign: a message on the subject that is not the aggregate's; unsettled: the subject kept moving). Never marked sent; retried with backoff (see `waybill-relay status`, `waybill outbox verify`)."
    );
    describe_gauge!(
        "waybill_outbox_diverged",
        "Unsent outbox rows whose last publish found the stream disagreeing with the store; their aggregates wait. Alert on any."
    );
    describe_counter!(
        "waybill_relay_stale_claims_ended_total",
        "Claim transactions of stalled relays (older than the claim timeout) that this relay ended."
    );
    describe_counter!("waybill_relay_claimed_total", "Outbox rows claimed.");
    describe_counter!(
        "waybill_relay_lost_claims_total",
        "Steps whose settle failed because the claim was lost (session ended); they marked nothing."
    );
    describe_histogram!(
        "waybill_relay_publish_latency_seconds",
        Unit::Seconds,
        "From publish to PubAck."
    );
    describe_histogram!(
        "waybill_relay_commit_to_ack_seconds",
        Unit::Seconds,
        "From the event's commit to its PubAck."
    );
    describe_gauge!(
        "waybill_outbox_pending",
        "Outbox rows waiting for a first publish."
    );
    describe_gauge!("waybill_outbox_failed", "Outbox rows waiting for a retry.");
    describe_gauge!(
        "waybill_outbox_dead",
        "Outbox rows that gave up; see `waybill-relay dead list`."
    );
    describe_gauge!(
        "waybill_outbox_oldest_pending_age_seconds",
        "Age of the oldest unsent (pending or failed) row."
    );
    describe_gauge!(
        "waybill_outbox_aggregates_held_back",
        "Aggregates whose next event waits behind a failed or dead one."
    );
    describe_counter!(
        "waybill_outbox_purged_total",
        "Sent rows this relay deleted under the retention setting (--retention)."
    );
    describe_gauge!(
        "waybill_outbox_dead_tuples",
        "Dead tuples in the outbox table (pg_stat_user_tables.n_dead_tup): what vacuum has yet to reclaim."
    );
    describe_gauge!(
        "waybill_db_oldest_transaction_seconds",
        Unit::Seconds,
        "Age of the oldest transaction in this database that holds back vacuum (has a snapshot); dead outbox tuples newer than it cannot be reclaimed. Other roles' sessions are seen only with pg_read_all_stats (or as superuser)."
    );
    describe_gauge!(
        "waybill_relay_wal_lag_bytes",
        Unit::Bytes,
        "With --source wal: WAL written since the position the relay last confirmed to its slot."
    );
    describe_gauge!(
        "waybill_relay_wal_lag_seconds",
        Unit::Seconds,
        "With --source wal: from writing WAL to the relay confirming it, as PostgreSQL last measured it (pg_stat_replication.replay_lag; 0 while caught up and quiet); while no session reads the slot, the seconds since its confirmed position last moved, as this relay saw it."
    );
    describe_gauge!(
        "waybill_relay_wal_retained_bytes",
        Unit::Bytes,
        "With --source wal: WAL PostgreSQL keeps on disk for the slot. Alert long before the disk or max_slot_wal_keep_size."
    );
    describe_gauge!(
        "waybill_relay_wal_slot_active",
        "With --source wal: 1 while a session reads the slot (this relay or another), 0 while none does."
    );
    describe_counter!(
        "waybill_relay_wal_handovers_total",
        "With --source wal: aggregates handed to the relay's polling passes, by reason: unsent_predecessor (an earlier version is unsent in the outbox: dead, failing or replayed), fence_moved (the stream lost the version published before), diverged, failing (publishing failed twice with the broker there), unseen (a row's transaction not visible to its mark)."
    );
    describe_gauge!(
        "waybill_relay_wal_slot_safe_bytes",
        Unit::Bytes,
        "With --source wal: WAL that may still be written before the slot risks invalidation (-1: no max_slot_wal_keep_size)."
    );
}

/// The WAL relay's slot, as `pg_replication_slots` shows it: bytes and seconds behind, bytes
/// retained, whether a session reads it, and bytes left before it risks invalidation (`None`: no
/// limit).
pub fn record_slot(
    lag_bytes: i64,
    lag_seconds: Option<f64>,
    retained_bytes: i64,
    active: bool,
    safe_bytes: Option<i64>,
) {
    gauge!("waybill_relay_wal_lag_bytes").set(lag_bytes as f64);
    gauge!("waybill_relay_wal_lag_seconds").set(lag_seconds.unwrap_or(0.0));
    gauge!("waybill_relay_wal_retained_bytes").set(retained_bytes as f64);
    gauge!("waybill_relay_wal_slot_active").set(if active { 1.0 } else { 0.0 });
    gauge!("waybill_relay_wal_slot_safe_bytes").set(safe_bytes.unwrap_or(-1) as f64);
}

/// What one WAL batch did at the broker.
pub fn record_wal_publishes(published: u64, duplicates: u64, fenced: u64, failed: u64) {
    counter!("waybill_relay_published_total").increment(published);
    counter!("waybill_relay_duplicate_acks_total").increment(duplicates);
    counter!("waybill_relay_fenced_total").increment(fenced);
    counter!("waybill_relay_retries_total").increment(failed);
}

/// An aggregate the WAL relay handed to its polling passes, and why.
pub fn record_wal_handover(reason: &'static str) {
    counter!("waybill_relay_wal_handovers_total", "reason" => reason).increment(1);
}

/// Sent rows deleted by the retention sweep.
pub fn record_purged(rows: u64) {
    counter!("waybill_outbox_purged_total").increment(rows);
}

/// What vacuum sees of the outbox.
pub fn record_vacuum(vacuum: &crate::admin::VacuumState) {
    gauge!("waybill_outbox_dead_tuples").set(vacuum.dead_tuples as f64);
    gauge!("waybill_db_oldest_transaction_seconds").set(vacuum.oldest_transaction_seconds);
}

/// Counts what one step did at the broker (recorded before the settle: the broker did it whether or
/// not the marks can be written).
pub fn record_step(report: &StepReport) {
    counter!("waybill_relay_fenced_total").increment(report.fenced as u64);
    counter!("waybill_relay_claimed_total").increment(report.claimed as u64);
    counter!("waybill_relay_published_total").increment(report.published as u64);
    counter!("waybill_relay_duplicate_acks_total").increment(report.duplicates as u64);
    counter!("waybill_relay_retries_total").increment(report.failed as u64);
    counter!("waybill_relay_dead_total").increment(report.dead as u64);
    counter!("waybill_relay_republished_outside_window_total")
        .increment(report.republished_outside_window as u64);
}

/// A divergence the fence found (its row is not marked sent).
pub fn record_divergence(kind: crate::fence::DivergenceKind) {
    counter!("waybill_relay_divergences_total", "kind" => kind.as_str()).increment(1);
}

/// Records one PubAck's latencies.
pub fn record_ack(publish_latency: Duration, commit_to_ack: Duration) {
    histogram!("waybill_relay_publish_latency_seconds").record(publish_latency.as_secs_f64());
    histogram!("waybill_relay_commit_to_ack_seconds").record(commit_to_ack.as_secs_f64());
}

/// Other relays' stalled claims this relay ended.
pub fn record_stale_claims_ended(ended: u64) {
    counter!("waybill_relay_stale_claims_ended_total").increment(ended);
}

/// A step whose settle could not be written.
pub fn record_lost_claim() {
    counter!("waybill_relay_lost_claims_total").increment(1);
}

/// How many relays share the outbox and their lanes in all (both 0 while this relay holds no slot
/// and claims as if alone).
pub fn record_seat(relays: u32, lanes_in_all: u32) {
    gauge!("waybill_relay_peers").set(f64::from(relays));
    gauge!("waybill_relay_lanes_in_all").set(f64::from(lanes_in_all));
}

/// Publishes the outbox gauges.
pub fn record_status(status: &OutboxStatus) {
    gauge!("waybill_outbox_pending").set(status.pending as f64);
    gauge!("waybill_outbox_failed").set(status.failed as f64);
    gauge!("waybill_outbox_dead").set(status.dead as f64);
    gauge!("waybill_outbox_oldest_pending_age_seconds")
        .set(status.oldest_pending_age_seconds.unwrap_or(0.0));
    gauge!("waybill_outbox_aggregates_held_back").set(status.aggregates_held_back as f64);
    gauge!("waybill_outbox_diverged").set(status.diverged as f64);
}
