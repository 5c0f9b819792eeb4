//! The projections' metrics, labelled by projection. Counters move per batch; the lag, held and parked
//! gauges are refreshed from the consumer's info and the projection's tables every few seconds. With
//! several partitions, the per-partition series add a `partition` label (`<K>of<P>`); the series
//! without it stay the instance's totals, as with one partition.

use std::time::Duration;

use metrics::{
    Unit, counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram,
};

use crate::tally::Tally;

/// Registers descriptions, so a scrape explains every series.
pub fn describe() {
    describe_counter!(
        "waybill_projection_applied_total",
        "Events applied (the checkpoint moved)."
    );
    describe_counter!(
        "waybill_projection_duplicates_total",
        "Deliveries at or below the checkpoint: acknowledged, not applied."
    );
    describe_counter!(
        "waybill_projection_held_total",
        "Deliveries ahead of the next version: acknowledged and kept in the held table until their predecessor is applied."
    );
    describe_counter!(
        "waybill_projection_parked_total",
        "Messages parked: undecodable, unknown type, version too new, failed trust check, or failing to apply."
    );
    describe_gauge!(
        "waybill_projection_held_events",
        "Events in the held table, waiting for a predecessor."
    );
    describe_gauge!(
        "waybill_projection_held_oldest_seconds",
        Unit::Seconds,
        "How long the oldest held event has waited (0 when none)."
    );
    describe_gauge!(
        "waybill_projection_parked_open",
        "Parked messages neither redriven nor discarded."
    );
    describe_histogram!(
        "waybill_projection_batch_seconds",
        Unit::Seconds,
        "Time to apply and settle one batch."
    );
    describe_gauge!(
        "waybill_projection_lag_messages",
        "Messages in the stream not yet delivered to the projection, plus delivered but unacknowledged ones."
    );
    describe_gauge!(
        "waybill_projection_partition_lag_messages",
        "Per owned partition: messages not yet delivered to the partition's consumer, plus delivered but unacknowledged ones."
    );
    describe_gauge!(
        "waybill_projection_partition_owned",
        "1 for each partition this instance applies (label partition=\"<K>of<P>\")."
    );
    describe_counter!(
        "waybill_projection_partition_skipped_total",
        "Messages of other partitions, read by this partition's consumer and acknowledged without being applied."
    );
    describe_counter!(
        "waybill_projection_other_types_total",
        "Messages of aggregate types the projection does not read, acknowledged without being decoded (never parked, never held)."
    );
    describe_counter!(
        "waybill_projection_retried_total",
        "Deliveries the database failed on (connection lost, serialization failure, timeout, no resources, missing privilege): left unacknowledged and delivered again after a growing delay, never parked."
    );
    describe_counter!(
        "waybill_projection_batch_conflicts_total",
        "Batches rolled back by a deadlock or serialization failure with another partition's batch, and run again."
    );
    describe_counter!(
        "waybill_projection_catch_ups_total",
        "Catch-ups from the event store's events table (label reason=\"missing_consumer\": a first start or a rebuild; \"behind_stream\": the stream removed messages a consumer had not settled)."
    );
    describe_counter!(
        "waybill_projection_catch_up_events_total",
        "Events read from the event store's events table by catch-ups."
    );
    describe_gauge!(
        "waybill_projection_catch_up_remaining_events",
        "Events a running catch-up has still to read, about (positions left; 0 when none runs)."
    );
}

/// Counts a catch-up from the event store as it starts.
pub fn record_catch_up_started(projection: &'static str, reason: &'static str) {
    counter!("waybill_projection_catch_ups_total", "projection" => projection, "reason" => reason)
        .increment(1);
}

/// Counts a page of a catch-up: `read` events read, about `remaining` left.
pub fn record_catch_up(projection: &'static str, read: u64, remaining: u64) {
    counter!("waybill_projection_catch_up_events_total", "projection" => projection)
        .increment(read);
    gauge!("waybill_projection_catch_up_remaining_events", "projection" => projection)
        .set(remaining as f64);
}

/// Names the partitions this instance applies.
pub fn record_owned(projection: &'static str, partitions: &crate::partition::Partitions) {
    for &k in partitions.owned() {
        gauge!("waybill_projection_partition_owned", "projection" => projection, "partition" => partitions.label(k))
            .set(1.0);
    }
}

/// Says whether this instance applies `partition` now (with shared partitions, as its lease comes
/// and goes).
pub fn record_partition_owned(projection: &'static str, partition: String, owned: bool) {
    gauge!("waybill_projection_partition_owned", "projection" => projection, "partition" => partition)
        .set(if owned { 1.0 } else { 0.0 });
}

/// Counts a partition's batch: what it skipped (other partitions' messages).
pub fn record_skipped(projection: &'static str, partition: String, skipped: u64) {
    counter!("waybill_projection_partition_skipped_total", "projection" => projection, "partition" => partition)
        .increment(skipped);
}

/// Counts messages of aggregate types the projection does not read, acknowledged unread.
pub fn record_other_types(projection: &'static str, messages: u64) {
    counter!("waybill_projection_other_types_total", "projection" => projection)
        .increment(messages);
}

/// Counts deliveries left to the broker because the database failed on them.
pub fn record_retried(projection: &'static str, messages: u64) {
    counter!("waybill_projection_retried_total", "projection" => projection).increment(messages);
}

/// Counts a batch run again after a conflict.
pub fn record_conflict(projection: &'static str) {
    counter!("waybill_projection_batch_conflicts_total", "projection" => projection).increment(1);
}

/// Publishes one partition's lag.
pub fn record_partition_lag(
    projection: &'static str,
    partition: String,
    pending: u64,
    ack_pending: u64,
) {
    gauge!("waybill_projection_partition_lag_messages", "projection" => projection, "partition" => partition)
        .set((pending + ack_pending) as f64);
}

/// Counts one batch.
pub fn record_batch(projection: &'static str, tally: &Tally, elapsed: Duration) {
    counter!("waybill_projection_applied_total", "projection" => projection)
        .increment(tally.applied);
    counter!("waybill_projection_duplicates_total", "projection" => projection)
        .increment(tally.duplicates);
    counter!("waybill_projection_held_total", "projection" => projection).increment(tally.held);
    counter!("waybill_projection_parked_total", "projection" => projection).increment(tally.parked);
    histogram!("waybill_projection_batch_seconds", "projection" => projection)
        .record(elapsed.as_secs_f64());
}

/// Publishes the lag.
pub fn record_lag(projection: &'static str, pending: u64, ack_pending: u64) {
    gauge!("waybill_projection_lag_messages", "projection" => projection)
        .set((pending + ack_pending) as f64);
}

/// Publishes the held table's size and age and the open parked count.
pub fn record_backlog(projection: &'static str, held: &crate::held::HeldStats, parked_open: i64) {
    gauge!("waybill_projection_held_events", "projection" => projection).set(held.count as f64);
    gauge!("waybill_projection_held_oldest_seconds", "projection" => projection)
        .set(held.oldest_seconds);
    gauge!("waybill_projection_parked_open", "projection" => projection).set(parked_open as f64);
}
