//! The one way in to the outbox's state outside its writer and the relay's step: counts by status,
//! the signs of trouble, one event's row, dead rows (list and replay), purging old sent rows, ending
//! stalled claims.
//!
//! The statements are the outbox's own (`store::outbox::admin`, which owns the table's columns and
//! status words); this module is where the operator commands, the gauges, the demo, the chaos harness
//! and the examples find them, beside what concerns relays only (ending stalled claims).

use std::time::Duration;

use sqlx::PgPool;

pub use store::outbox::Status as RowStatus;
pub use store::outbox::admin::{
    DeadRow, DivergedRow, OutboxRow, OutboxStatus, ReplayTarget, StatusCounts, VacuumState,
    any_head_due_within, counts, dead_rows, heads_due_within, prune_journal, purge_sent,
    replay_dead, row_of_event, status, vacuum_state,
};

/// Ends other relays' claim transactions older than `older_than` (see `waybill_end_stale_claims` in
/// the migrations); returns how many.
pub async fn end_stale_claims(pool: &PgPool, older_than: Duration) -> sqlx::Result<u64> {
    let ended: i32 =
        sqlx::query_scalar("SELECT waybill_end_stale_claims($1 * interval '1 second')")
            .bind(older_than.as_secs_f64())
            .fetch_one(pool)
            .await?;
    Ok(u64::try_from(ended).unwrap_or(0))
}
