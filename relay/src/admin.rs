//! The one way in to the outbox's state outside its writer: counts by status, the signs of trouble,
//! one event's row, dead rows (list and replay), purging old sent rows, ending stalled claims.
//!
//! The store inserts rows, in the transaction of their events; a relay step claims and settles them
//! (`crate::claim`, `crate::settle`). Everyone else — the operator commands, the gauges, the demo, the
//! chaos harness, the examples — reads and changes the outbox through this module, so its columns and
//! its status words are spelled in one place. Tests keep their own SQL on purpose: they check this
//! code, not through it.

use std::fmt;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;
use uuid::Uuid;

use crate::fence::Divergence;

/// Where a row is in its life (`outbox.status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, sqlx::Type)]
#[serde(rename_all = "lowercase")]
#[sqlx(type_name = "text", rename_all = "lowercase")]
pub enum RowStatus {
    /// Waiting for its first publish.
    Pending,
    /// Its last publish failed; retried after a backoff.
    Failed,
    /// Out of attempts; it and the later versions of its aggregate wait for `dead replay`.
    Dead,
    /// In the stream.
    Sent,
}

impl RowStatus {
    /// The word the table stores.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Failed => "failed",
            Self::Dead => "dead",
            Self::Sent => "sent",
        }
    }
}

impl fmt::Display for RowStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Rows per status.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct StatusCounts {
    /// Waiting for their first publish.
    pub pending: i64,
    /// Waiting for a retry.
    pub failed: i64,
    /// Gave up.
    pub dead: i64,
    /// Delivered; `None` unless asked for (counting them walks the whole sent history).
    pub sent: Option<i64>,
}

impl StatusCounts {
    /// Rows a live relay still works on: pending and failed (dead rows wait for an operator).
    pub fn in_progress(&self) -> i64 {
        self.pending + self.failed
    }

    /// Rows not in the stream yet, dead ones included.
    pub fn unsent(&self) -> i64 {
        self.pending + self.failed + self.dead
    }

    /// Each status with its count, in life order; `sent` only when it was counted.
    pub fn by_status(&self) -> Vec<(RowStatus, i64)> {
        let mut counts = vec![
            (RowStatus::Pending, self.pending),
            (RowStatus::Failed, self.failed),
            (RowStatus::Dead, self.dead),
        ];
        counts.extend(self.sent.map(|sent| (RowStatus::Sent, sent)));
        counts
    }
}

/// Counts rows by status. `with_sent` also counts sent rows (a full scan on a large table); without it
/// only the unsent rows' partial indexes are read, cheap enough to poll.
pub async fn counts(pool: &PgPool, with_sent: bool) -> sqlx::Result<StatusCounts> {
    let sql = if with_sent {
        "SELECT count(*) FILTER (WHERE status = 'pending') AS pending,
                count(*) FILTER (WHERE status = 'failed') AS failed,
                count(*) FILTER (WHERE status = 'dead') AS dead,
                count(*) FILTER (WHERE status = 'sent') AS sent
         FROM outbox"
    } else {
        // Spelled as the two partial indexes' predicates (due rows, dead rows), as in `status`.
        "SELECT count(*) FILTER (WHERE status = 'pending') AS pending,
                count(*) FILTER (WHERE status = 'failed') AS failed,
                count(*) FILTER (WHERE status = 'dead') AS dead,
                NULL::int8 AS sent
         FROM outbox WHERE status IN ('pending', 'failed') OR status = 'dead'"
    };
    sqlx::query_as(sql).fetch_one(pool).await
}

/// One event's outbox row, as the relays left it (the body left out).
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct OutboxRow {
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
    /// Where it is in its life.
    pub status: RowStatus,
    /// Publishes attempted.
    pub attempts: i32,
    /// Why the last publish failed (cleared when it is sent).
    pub last_error: Option<String>,
    /// When the event committed.
    pub created_at: DateTime<Utc>,
    /// When it was marked sent.
    pub sent_at: Option<DateTime<Utc>>,
    /// The relay whose claim last settled it.
    pub claimed_by: Option<String>,
    /// When that claim began.
    pub claimed_at: Option<DateTime<Utc>>,
    /// The stream sequence of its message, from the PubAck (or the fence's reading of the stream).
    pub stream_seq: Option<i64>,
}

/// The outbox row of `event_id`; `None` when no such event was written (or its row was purged).
pub async fn row_of_event(pool: &PgPool, event_id: Uuid) -> sqlx::Result<Option<OutboxRow>> {
    sqlx::query_as(
        "SELECT id, event_id, event_type, aggregate_id, aggregate_version, status, attempts,
                last_error, created_at, sent_at, claimed_by, claimed_at, stream_seq
         FROM outbox WHERE event_id = $1",
    )
    .bind(event_id)
    .fetch_optional(pool)
    .await
}

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
    /// Unsent rows whose last publish found the stream disagreeing with the store (a store restored
    /// behind its stream, a foreign message on the subject). Never marked sent; retried with backoff.
    pub diverged: i64,
    /// The first of them (at most 20), each naming its aggregate and both event ids.
    pub divergences: Vec<DivergedRow>,
}

/// An unsent row held up by a divergence between the store and the stream.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DivergedRow {
    /// The store's event.
    pub event_id: Uuid,
    /// Its aggregate type.
    pub aggregate_type: String,
    /// Its aggregate.
    pub aggregate_id: Uuid,
    /// Its version.
    pub aggregate_version: i64,
    /// `failed` (retried) or `dead`.
    pub status: RowStatus,
    /// What the fence found.
    pub divergence: Divergence,
}

#[derive(sqlx::FromRow)]
struct DivergedRecord {
    event_id: Uuid,
    aggregate_type: String,
    aggregate_id: Uuid,
    aggregate_version: i64,
    status: RowStatus,
    divergence: sqlx::types::Json<Divergence>,
}

/// The one-row summary behind [`OutboxStatus`].
#[derive(sqlx::FromRow)]
struct Summary {
    pending: i64,
    failed: i64,
    dead: i64,
    oldest_pending_age_seconds: Option<f64>,
    held_back: i64,
    unsettled: i64,
}

/// Reads the status. `with_sent` also counts sent rows (a full scan on a large table).
pub async fn status(pool: &PgPool, with_sent: bool) -> sqlx::Result<OutboxStatus> {
    // The unsent rows are read through the partial indexes, never by walking the table: statistics
    // taken during a burst (100k unsent of 1.1M) made the planner choose a sequential scan of the whole
    // outbox — 1–2.5 s after every `run --once`, every 5 s in the gauges — that then found nothing.
    // `SET LOCAL` keeps the setting to this read-only transaction.
    let mut tx = pool.begin().await?;
    sqlx::query("SET LOCAL enable_seqscan = off")
        .execute(&mut *tx)
        .await?;
    let summary: Summary = sqlx::query_as(
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
    .fetch_one(&mut *tx)
    .await?;
    let diverged: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox WHERE divergence IS NOT NULL AND status <> 'sent'",
    )
    .fetch_one(&mut *tx)
    .await?;
    let divergences: Vec<DivergedRecord> = sqlx::query_as(
        "SELECT event_id, aggregate_type, aggregate_id, aggregate_version, status, divergence
         FROM outbox WHERE divergence IS NOT NULL AND status <> 'sent'
         ORDER BY id LIMIT 20",
    )
    .fetch_all(&mut *tx)
    .await?;
    tx.commit().await?;
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
        pending: summary.pending,
        failed: summary.failed,
        dead: summary.dead,
        sent,
        oldest_pending_age_seconds: summary.oldest_pending_age_seconds,
        aggregates_held_back: summary.held_back,
        unsettled_publishes: summary.unsettled,
        diverged,
        divergences: divergences
            .into_iter()
            .map(|r| DivergedRow {
                event_id: r.event_id,
                aggregate_type: r.aggregate_type,
                aggregate_id: r.aggregate_id,
                aggregate_version: r.aggregate_version,
                status: r.status,
                divergence: r.divergence.0,
            })
            .collect(),
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

/// Whether any aggregate head is due now or within `within`, locked or not: [`heads_due_within`]
/// stopped at the first one. `run --once` asks this each time its lanes find nothing to claim; the
/// count walked every due row, and behind another relay's claim on hot aggregates every one of them
/// (seconds with 100k unsent rows).
///
/// A scalar subquery ordered as `outbox_due_idx` is, so the planner walks that index: with statistics
/// taken during a burst it otherwise chose a sequential scan of the whole outbox, expecting a head
/// soon — 0.9 s (68k pages read) with 1M sent rows, at the end of every drain, when there is none;
/// 0.04 ms this way. (Not `EXISTS`: the planner drops an `EXISTS` subquery's `ORDER BY` and `LIMIT`.)
pub async fn any_head_due_within(pool: &PgPool, within: Duration) -> sqlx::Result<bool> {
    sqlx::query_scalar(
        "SELECT (
            SELECT true FROM outbox o
            LEFT JOIN outbox p
                   ON p.aggregate_id = o.aggregate_id AND p.aggregate_version = o.aggregate_version - 1
            WHERE o.status IN ('pending', 'failed')
              AND o.next_run_at <= now() + $1 * interval '1 second'
              AND (p.id IS NULL OR p.status = 'sent')
            ORDER BY o.next_run_at, o.id
            LIMIT 1
        ) IS NOT NULL",
    )
    .bind(within.as_secs_f64())
    .fetch_one(pool)
    .await
}

/// One dead row, as `dead list` shows it.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
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
    sqlx::query_as(
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
    .await
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
                ORDER BY sent_at LIMIT $2
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

/// What vacuum sees of the outbox: its dead tuples, and the oldest transaction in the database that
/// holds a snapshot (dead tuples newer than it cannot be reclaimed, whatever vacuum does).
#[derive(Debug, Clone, Default, PartialEq, Serialize, sqlx::FromRow)]
pub struct VacuumState {
    /// `pg_stat_user_tables.n_dead_tup` of `outbox` (statistics: updated within seconds, not exact).
    pub dead_tuples: i64,
    /// Live tuples, likewise.
    pub live_tuples: i64,
    /// Age in seconds of the oldest transaction with a snapshot (0 when there is none).
    pub oldest_transaction_seconds: f64,
}

/// Reads [`VacuumState`].
pub async fn vacuum_state(pool: &PgPool) -> sqlx::Result<VacuumState> {
    sqlx::query_as(
        "SELECT coalesce((SELECT n_dead_tup FROM pg_stat_user_tables WHERE relid = 'outbox'::regclass), 0) AS dead_tuples,
                coalesce((SELECT n_live_tup FROM pg_stat_user_tables WHERE relid = 'outbox'::regclass), 0) AS live_tuples,
                coalesce((SELECT extract(epoch FROM now() - min(xact_start))::float8 FROM pg_stat_activity
                          WHERE backend_xmin IS NOT NULL AND datname = current_database()
                            AND pid <> pg_backend_pid()), 0) AS oldest_transaction_seconds",
    )
    .fetch_one(pool)
    .await
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

#[cfg(test)]
mod tests {
    use super::*;

    use store::{CommandContext, EventStore};

    /// Places an order through the store (its event and outbox row in one transaction); returns the
    /// event id.
    async fn placed(store: &EventStore) -> Uuid {
        let order = domain::OrderId::from_uuid(Uuid::now_v7());
        let command = testkit::place("alice", &["MUG-BLUE:1:1250"]);
        let outcome = store
            .execute(order, &command, &CommandContext::default())
            .await
            .expect("place");
        outcome.event_ids[0]
    }

    /// Settles a row by hand, as a relay step would have.
    async fn settle(pool: &PgPool, event_id: Uuid, status: &str) {
        sqlx::query(
            "UPDATE outbox SET status = $2, claimed_by = 'relay-t', claimed_at = now(),
                 stream_seq = CASE WHEN $2 = 'sent' THEN 7 END
             WHERE event_id = $1",
        )
        .bind(event_id)
        .bind(status)
        .execute(pool)
        .await
        .expect("settle");
    }

    // The demo, the chaos verdict and the examples read the outbox only through this module: the
    // table is read here with SQL of its own to check it.
    #[sqlx::test(migrator = "store::MIGRATOR")]
    async fn counts_and_an_event_row_say_what_the_table_holds(pool: PgPool) {
        let store = EventStore::new(pool.clone());
        let pending = placed(&store).await;
        let (sent, failed, dead) = (
            placed(&store).await,
            placed(&store).await,
            placed(&store).await,
        );
        settle(&pool, sent, "sent").await;
        settle(&pool, failed, "failed").await;
        settle(&pool, dead, "dead").await;

        let by_sql: Vec<(String, i64)> =
            sqlx::query_as("SELECT status, count(*) FROM outbox GROUP BY status ORDER BY status")
                .fetch_all(&pool)
                .await
                .expect("count");
        let mut counted: Vec<(String, i64)> = counts(&pool, true)
            .await
            .expect("counts")
            .by_status()
            .into_iter()
            .map(|(status, n)| (status.to_string(), n))
            .collect();
        counted.sort();
        assert_eq!(counted, by_sql);

        let unsent = counts(&pool, false).await.expect("counts");
        assert_eq!(
            unsent,
            StatusCounts {
                pending: 1,
                failed: 1,
                dead: 1,
                sent: None
            }
        );
        assert_eq!((unsent.in_progress(), unsent.unsent()), (2, 3));

        let row = row_of_event(&pool, sent)
            .await
            .expect("row")
            .expect("the sent event has a row");
        assert_eq!(
            (
                row.event_id,
                row.status,
                row.claimed_by.as_deref(),
                row.stream_seq
            ),
            (sent, RowStatus::Sent, Some("relay-t"), Some(7))
        );
        let row = row_of_event(&pool, pending).await.expect("row");
        assert_eq!(row.map(|r| r.status), Some(RowStatus::Pending));
        assert_eq!(
            row_of_event(&pool, Uuid::now_v7()).await.expect("row"),
            None
        );
    }
}
