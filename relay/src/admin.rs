//! Operator commands over the outbox: status, dead rows (list and replay), and purging old sent rows.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{PgPool, Row};
use uuid::Uuid;

/// Counts by status and the signs of trouble.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct OutboxStatus {
    /// Rows waiting for their first publish.
    pub pending: i64,
    /// Rows waiting for a retry.
    pub failed: i64,
    /// Rows that gave up.
    pub dead: i64,
    /// Rows delivered (only counted when asked: it walks the whole table).
    pub sent: Option<i64>,
    /// Age of the oldest pending or failed row, in seconds.
    pub oldest_pending_age_seconds: Option<f64>,
    /// Aggregates whose head row is failed or dead: their later events wait behind it.
    pub aggregates_held_back: i64,
    /// Journal records of steps that published but never settled (crashed relays, unknown outcomes).
    pub unsettled_publishes: i64,
    /// Unsent rows whose last publish met a fence conflict: something on the aggregate's subject that
    /// the relay cannot account for. Each names its aggregate; they are retried with backoff.
    pub fence_conflicts: Vec<FenceConflict>,
}

/// An unsent row held up by a fence conflict.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FenceConflict {
    /// The event.
    pub event_id: Uuid,
    /// Its aggregate.
    pub aggregate_id: Uuid,
    /// Its version.
    pub aggregate_version: i64,
    /// `failed` (retried) or `dead`.
    pub status: String,
    /// The conflict, with the stream sequences involved.
    pub last_error: String,
}

/// Reads the status. `with_sent` also counts sent rows (a full scan on a large table).
pub async fn status(pool: &PgPool, with_sent: bool) -> sqlx::Result<OutboxStatus> {
    let row = sqlx::query(
        "SELECT count(*) FILTER (WHERE status = 'pending') AS pending,
                count(*) FILTER (WHERE status = 'failed') AS failed,
                count(*) FILTER (WHERE status = 'dead') AS dead,
                extract(epoch FROM now() - min(created_at) FILTER (WHERE status IN ('pending', 'failed')))::float8
                    AS oldest_pending_age_seconds,
                count(DISTINCT aggregate_id) FILTER (WHERE status IN ('failed', 'dead')) AS held_back,
                (SELECT count(*) FROM outbox_inflight WHERE started_at < now() - interval '1 minute')
                    AS unsettled
         FROM outbox WHERE status IN ('pending', 'failed') OR status = 'dead'",
        // Spelled as the two partial indexes' predicates (due rows, dead rows), so the planner reads
        // only those and never walks the sent history.
    )
    .fetch_one(pool)
    .await?;
    let conflicts = sqlx::query(
        "SELECT event_id, aggregate_id, aggregate_version, status, last_error FROM outbox
         WHERE (status IN ('pending', 'failed') OR status = 'dead') AND last_error LIKE 'fence conflict%'
         ORDER BY id LIMIT 20",
    )
    .fetch_all(pool)
    .await?;
    let sent = if with_sent {
        Some(
            sqlx::query_scalar("SELECT count(*) FROM outbox WHERE status = 'sent'")
                .fetch_one(pool)
                .await?,
        )
    } else {
        None
    };
    Ok(OutboxStatus {
        pending: row.try_get("pending")?,
        failed: row.try_get("failed")?,
        dead: row.try_get("dead")?,
        sent,
        oldest_pending_age_seconds: row.try_get("oldest_pending_age_seconds")?,
        aggregates_held_back: row.try_get("held_back")?,
        unsettled_publishes: row.try_get("unsettled")?,
        fence_conflicts: conflicts
            .iter()
            .map(|r| {
                Ok(FenceConflict {
                    event_id: r.try_get("event_id")?,
                    aggregate_id: r.try_get("aggregate_id")?,
                    aggregate_version: r.try_get("aggregate_version")?,
                    status: r.try_get("status")?,
                    last_error: r.try_get("last_error")?,
                })
            })
            .collect::<sqlx::Result<_>>()?,
    })
}

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

/// Aggregate heads due now or within `within`, locked or not: what a relay could send soon if no
/// claim held them.
pub async fn heads_due_within(pool: &PgPool, within: Duration) -> sqlx::Result<i64> {
    sqlx::query_scalar(
        "SELECT count(*) FROM outbox o
         LEFT JOIN outbox p
                ON p.aggregate_id = o.aggregate_id AND p.aggregate_version = o.aggregate_version - 1
         WHERE o.status IN ('pending', 'failed')
           AND o.next_run_at <= now() + $1 * interval '1 second'
           AND (p.id IS NULL OR p.status = 'sent')",
    )
    .bind(within.as_secs_f64())
    .fetch_one(pool)
    .await
}

/// One dead row, as `dead list` shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeadRow {
    /// `outbox.id`.
    pub id: i64,
    /// The event.
    pub event_id: Uuid,
    /// Its type.
    pub event_type: String,
    /// Its aggregate.
    pub aggregate_id: Uuid,
    /// Its version.
    pub aggregate_version: i64,
    /// Attempts made.
    pub attempts: i32,
    /// When it gave up.
    pub dead_at: Option<DateTime<Utc>>,
    /// Why.
    pub dead_reason: Option<String>,
    /// Later events of the same aggregate waiting behind it.
    pub waiting_behind: i64,
}

/// Lists dead rows, oldest first.
pub async fn dead_rows(pool: &PgPool, limit: i64) -> sqlx::Result<Vec<DeadRow>> {
    let rows = sqlx::query(
        "SELECT o.id, o.event_id, o.event_type, o.aggregate_id, o.aggregate_version, o.attempts,
                o.dead_at, o.dead_reason,
                (SELECT count(*) FROM outbox f
                 WHERE f.aggregate_id = o.aggregate_id AND f.aggregate_version > o.aggregate_version
                   AND f.status <> 'sent') AS waiting_behind
         FROM outbox o WHERE o.status = 'dead'
         ORDER BY o.dead_at, o.id
         LIMIT $1",
    )
    .bind(limit)
    .fetch_all(pool)
    .await?;
    rows.iter()
        .map(|r| {
            Ok(DeadRow {
                id: r.try_get("id")?,
                event_id: r.try_get("event_id")?,
                event_type: r.try_get("event_type")?,
                aggregate_id: r.try_get("aggregate_id")?,
                aggregate_version: r.try_get("aggregate_version")?,
                attempts: r.try_get("attempts")?,
                dead_at: r.try_get("dead_at")?,
                dead_reason: r.try_get("dead_reason")?,
                waiting_behind: r.try_get("waiting_behind")?,
            })
        })
        .collect()
}

/// Which dead rows to replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplayTarget {
    /// Every dead row.
    All,
    /// The row with this `outbox.id`.
    OutboxId(i64),
    /// The row of this event.
    EventId(Uuid),
}

impl ReplayTarget {
    /// Parses an outbox id (a number) or an event id (a UUID).
    pub fn parse(text: &str) -> Result<Self, String> {
        if let Ok(id) = text.parse::<i64>() {
            return Ok(Self::OutboxId(id));
        }
        Uuid::parse_str(text).map(Self::EventId).map_err(|_| {
            format!("{text:?} is neither an outbox id (a number) nor an event id (a UUID)")
        })
    }
}

/// Puts dead rows back to `pending` with their attempts reset, and releases the versions waiting behind
/// them. Returns how many rows were replayed (0 when the target is not dead).
pub async fn replay_dead(pool: &PgPool, target: &ReplayTarget) -> sqlx::Result<u64> {
    let (all, outbox_id, event_id) = match target {
        ReplayTarget::All => (true, None, None),
        ReplayTarget::OutboxId(id) => (false, Some(*id), None),
        ReplayTarget::EventId(id) => (false, None, Some(*id)),
    };
    let mut tx = pool.begin().await?;
    let aggregates: Vec<Uuid> = sqlx::query_scalar(
        "UPDATE outbox
         SET status = 'pending', attempts = 0, next_run_at = now(), dead_at = NULL, dead_reason = NULL
         WHERE status = 'dead' AND ($1 OR id = $2 OR event_id = $3)
         RETURNING aggregate_id",
    )
    .bind(all)
    .bind(outbox_id)
    .bind(event_id)
    .fetch_all(&mut *tx)
    .await?;
    sqlx::query(
        "UPDATE outbox SET next_run_at = now()
         WHERE aggregate_id = ANY($1) AND status IN ('pending', 'failed') AND next_run_at > now()",
    )
    .bind(&aggregates)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(aggregates.len() as u64)
}

/// Deletes sent rows older than `older_than`, `batch` at a time, calling `progress` after each batch
/// with the running total. Unsent rows are never touched. Returns the total deleted.
pub async fn purge_sent(
    pool: &PgPool,
    older_than: Duration,
    batch: i64,
    mut progress: impl FnMut(u64),
) -> sqlx::Result<u64> {
    let mut total = 0;
    loop {
        let deleted = sqlx::query(
            "DELETE FROM outbox WHERE id IN (
                SELECT id FROM outbox
                WHERE status = 'sent' AND sent_at < now() - $1 * interval '1 second'
                ORDER BY id LIMIT $2
                FOR UPDATE SKIP LOCKED)",
        )
        .bind(older_than.as_secs_f64())
        .bind(batch)
        .execute(pool)
        .await?
        .rows_affected();
        total += deleted;
        if deleted == 0 {
            return Ok(total);
        }
        progress(total);
    }
}

/// Forgets journal records whose rows are all sent (or purged): nothing they name can be published again.
pub async fn prune_journal(pool: &PgPool) -> sqlx::Result<u64> {
    Ok(sqlx::query(
        "DELETE FROM outbox_inflight j
         WHERE j.started_at < now() - interval '1 minute'
           AND NOT EXISTS (SELECT 1 FROM outbox o WHERE o.id = ANY(j.outbox_ids) AND o.status <> 'sent')",
    )
    .execute(pool)
    .await?
    .rows_affected())
}
