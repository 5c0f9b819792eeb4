//! The projections' metrics, labelled by projection. Counters move per batch; the lag, held and parked
//! gauges are refreshed from the consumer's info and the projection's tables every few seconds.

use std::time::Duration;

use metrics::{
    Unit, counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram,
};

use crate::runner::Tally;

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
