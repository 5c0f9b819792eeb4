//! The projections' metrics, labelled by projection. Counters move per batch; the lag gauges are
//! refreshed from the consumer's info every few seconds.

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
        "waybill_projection_gaps_total",
        "Deliveries ahead of the next version: sent back to wait for their predecessor."
    );
    describe_counter!(
        "waybill_projection_parked_total",
        "Poison messages parked (undecodable, unknown type, version too new)."
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
    counter!("waybill_projection_gaps_total", "projection" => projection).increment(tally.gaps);
    counter!("waybill_projection_parked_total", "projection" => projection).increment(tally.parked);
    histogram!("waybill_projection_batch_seconds", "projection" => projection)
        .record(elapsed.as_secs_f64());
}

/// Publishes the lag.
pub fn record_lag(projection: &'static str, pending: u64, ack_pending: u64) {
    gauge!("waybill_projection_lag_messages", "projection" => projection)
        .set((pending + ack_pending) as f64);
}
