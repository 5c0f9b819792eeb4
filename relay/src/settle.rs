//! Settling a step: mark rows sent, failed (with backoff) or dead, hold back the versions behind a
//! failure, and close the step's journal record — one statement, inside the claim's transaction.
//!
//! Times are `clock_timestamp()`, not `now()`: `now()` is when the claim's transaction began, up to a
//! step's length earlier, and retry delays must count from the failure.
//!
//! The transaction still holds the claim's row locks, so the marks are fenced: a relay whose session was
//! ended (by a crash, a timeout or `pg_terminate_backend`) cannot mark anything, and rows it lost are
//! already someone else's.

use std::time::Duration;

use sqlx::PgConnection;
use uuid::Uuid;

use crate::fence::Divergence;

/// The marks of one step, column by column (ready for `UNNEST`).
#[derive(Debug, Default)]
pub struct Settlement {
    /// Rows JetStream acknowledged.
    pub sent: Vec<SentRow>,
    /// Rows whose publish failed.
    pub failed: Vec<FailedRow>,
    /// Later versions behind a failed row: id and the delay of the row they wait for (`None`: its head
    /// is dead, they wait until it is replayed).
    pub held: Vec<(i64, Option<f64>)>,
    /// Rows whose publish outcome is unknown: they stay in the journal.
    pub ambiguous: Vec<i64>,
}

/// A row JetStream acknowledged, as the settle statement marks it.
#[derive(Debug)]
pub struct SentRow {
    /// The outbox row.
    pub id: i64,
    /// Its locked version's `ctid` ([`crate::claim::ClaimedRow::tid`]).
    pub tid: String,
    /// Its stream sequence (unknown for some fenced rows).
    pub sequence: Option<i64>,
}

/// A row whose publish failed, as the settle statement marks it.
#[derive(Debug)]
pub struct FailedRow {
    /// The outbox row.
    pub id: i64,
    /// `failed` (retried later) or `dead` (out of attempts).
    pub status: &'static str,
    /// When to retry, from now.
    pub retry_in_seconds: f64,
    /// Why it failed, kept in `last_error`.
    pub error: String,
    /// The divergence the fence found, kept as JSON in `outbox.divergence` (`None` clears it).
    pub divergence: Option<String>,
}

/// What the settle statement changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, sqlx::FromRow)]
pub struct Settled {
    /// Rows marked sent.
    pub sent: i64,
    /// Rows marked failed or dead.
    pub failed: i64,
    /// Rows held back.
    pub held: i64,
}

impl Settlement {
    /// Records a failure, deciding between `failed` and `dead`.
    pub fn fail(
        &mut self,
        id: i64,
        failures: i32,
        max_attempts: i32,
        delay: Duration,
        error: String,
        divergence: Option<&Divergence>,
    ) -> bool {
        let dead = failures >= max_attempts;
        self.failed.push(FailedRow {
            id,
            status: if dead { "dead" } else { "failed" },
            retry_in_seconds: delay.as_secs_f64(),
            error,
            divergence: divergence.and_then(|d| serde_json::to_string(d).ok()),
        });
        dead
    }
}

/// Writes `settlement` in the claim's transaction.
///
/// Sent rows — nearly all of them — are found by their locked version's `ctid` (a TID scan) rather
/// than by `id` through the primary key; `id` is still compared, so a mismatch marks nothing and the
/// row is published again (JetStream dedupes) instead of marking another row.
pub async fn settle(
    tx: &mut PgConnection,
    settlement: &Settlement,
    relay_id: &str,
    claimed_at: chrono::DateTime<chrono::Utc>,
    claim_id: Uuid,
) -> sqlx::Result<Settled> {
    sqlx::query_as(
        "WITH sent AS (
            UPDATE outbox o
            SET status = 'sent', sent_at = clock_timestamp(), stream_seq = u.seq, attempts = o.attempts + 1,
                last_error = NULL, divergence = NULL, claimed_by = $9, claimed_at = $10
            FROM UNNEST($1::int8[], $2::int8[], $13::text[]) AS u(id, seq, tid)
            WHERE o.ctid = u.tid::tid AND o.id = u.id
            RETURNING 1
        ),
        failed AS (
            UPDATE outbox o
            SET status = u.status, attempts = o.attempts + 1,
                next_run_at = clock_timestamp() + u.delay * interval '1 second',
                last_error = u.error,
                dead_at = CASE WHEN u.status = 'dead' THEN clock_timestamp() END,
                dead_reason = CASE WHEN u.status = 'dead' THEN u.error END,
                divergence = u.divergence::jsonb,
                claimed_by = $9, claimed_at = $10
            FROM UNNEST($3::int8[], $4::text[], $5::float8[], $6::text[], $14::text[])
                 AS u(id, status, delay, error, divergence)
            WHERE o.id = u.id
            RETURNING 1
        ),
        held AS (
            UPDATE outbox o
            SET next_run_at = CASE WHEN u.delay IS NULL THEN 'infinity'::timestamptz
                                   ELSE clock_timestamp() + u.delay * interval '1 second' END
            FROM UNNEST($7::int8[], $8::float8[]) AS u(id, delay)
            WHERE o.id = u.id
            RETURNING 1
        ),
        journal_closed AS (
            DELETE FROM outbox_inflight WHERE claim_id = $11 AND cardinality($12::int8[]) = 0
        ),
        journal_kept AS (
            UPDATE outbox_inflight SET outbox_ids = $12 WHERE claim_id = $11 AND cardinality($12::int8[]) > 0
        )
        SELECT (SELECT count(*) FROM sent) AS sent,
               (SELECT count(*) FROM failed) AS failed,
               (SELECT count(*) FROM held) AS held",
    )
    .bind(settlement.sent.iter().map(|s| s.id).collect::<Vec<_>>())
    .bind(settlement.sent.iter().map(|s| s.sequence).collect::<Vec<_>>())
    .bind(settlement.failed.iter().map(|f| f.id).collect::<Vec<_>>())
    .bind(settlement.failed.iter().map(|f| f.status).collect::<Vec<_>>())
    .bind(settlement.failed.iter().map(|f| f.retry_in_seconds).collect::<Vec<_>>())
    .bind(settlement.failed.iter().map(|f| f.error.as_str()).collect::<Vec<_>>())
    .bind(settlement.held.iter().map(|h| h.0).collect::<Vec<_>>())
    .bind(settlement.held.iter().map(|h| h.1).collect::<Vec<_>>())
    .bind(relay_id)
    .bind(claimed_at)
    .bind(claim_id)
    .bind(&settlement.ambiguous)
    .bind(settlement.sent.iter().map(|s| s.tid.as_str()).collect::<Vec<_>>())
    .bind(settlement.failed.iter().map(|f| f.divergence.as_deref()).collect::<Vec<_>>())
    .fetch_one(tx)
    .await
}
