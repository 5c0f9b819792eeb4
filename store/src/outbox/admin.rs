//! What operators and observers read and change in the outbox: counts by status, the signs of
//! trouble, one event's row, dead rows (list and replay), purging old sent rows, what vacuum sees,
//! pruning the journal — and the store side of `waybill outbox verify` and the console's reads.
//!
//! The unsent rows are read through the partial indexes (due rows, dead rows, diverged rows), never by
//! walking the sent history: each statement here says how.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;
use uuid::Uuid;

use super::{Divergence, Status};

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
    pub fn by_status(&self) -> Vec<(Status, i64)> {
        let mut counts = vec![
            (Status::Pending, self.pending),
            (Status::Failed, self.failed),
            (Status::Dead, self.dead),
        ];
        counts.extend(self.sent.map(|sent| (Status::Sent, sent)));
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
    /// The row's `id`.
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
    pub status: Status,
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
    pub status: Status,
    /// What the fence found.
    pub divergence: Divergence,
}

#[derive(sqlx::FromRow)]
struct DivergedRecord {
    event_id: Uuid,
    aggregate_type: String,
    aggregate_id: Uuid,
    aggregate_version: i64,
    status: Status,
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
    any_head_due_by(pool, within.as_secs_f64()).await
}

/// Whether some aggregate head has been due for longer than `age`: a row a relay could claim that
/// nobody has delivered for that long. Rows waiting behind a dead or backing-off predecessor are
/// not heads and do not count. A relay reading the WAL asks this of what its slot does not carry.
pub async fn any_head_due_for_longer_than(pool: &PgPool, age: Duration) -> sqlx::Result<bool> {
    any_head_due_by(pool, -age.as_secs_f64()).await
}

/// [`any_head_due_within`] with the horizon `offset` seconds from now (negative: in the past).
async fn any_head_due_by(pool: &PgPool, offset: f64) -> sqlx::Result<bool> {
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
    .bind(offset)
    .fetch_one(pool)
    .await
}

/// One dead row, as `dead list` shows it.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct DeadRow {
    /// The row's `id`.
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
    /// The row with this `id`.
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
    /// `pg_stat_user_tables.n_dead_tup` of the outbox (statistics: updated within seconds, not exact).
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

/// One event of the store with its delivery state, as `verify` compares it with the stream.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct DeliveredEvent {
    /// Its aggregate's type.
    pub aggregate_type: String,
    /// Its aggregate.
    pub aggregate_id: Uuid,
    /// Its version.
    pub aggregate_version: i64,
    /// The event.
    pub event_id: Uuid,
    /// When the store recorded it.
    pub recorded_at: DateTime<Utc>,
    /// Its row's status; `None` when the row was purged after it was sent.
    pub status: Option<Status>,
    /// The stream sequence its row records.
    pub stream_seq: Option<i64>,
}

/// The store's events with their rows, in aggregate and version order: of `aggregates` (all when
/// empty), and only of aggregates with an event recorded at or after `since`, when given.
pub async fn delivered_events(
    pool: &PgPool,
    aggregates: &[Uuid],
    since: Option<DateTime<Utc>>,
) -> sqlx::Result<Vec<DeliveredEvent>> {
    sqlx::query_as(
        "SELECT e.aggregate_type, e.aggregate_id, e.aggregate_version, e.event_id, e.recorded_at,
                o.status, o.stream_seq
         FROM events e
         LEFT JOIN outbox o ON o.aggregate_id = e.aggregate_id
                           AND o.aggregate_version = e.aggregate_version
                           AND o.event_id = e.event_id
         WHERE (cardinality($1::uuid[]) = 0 OR e.aggregate_id = ANY($1))
           AND ($2::timestamptz IS NULL
                OR e.aggregate_id IN (SELECT aggregate_id FROM events WHERE recorded_at >= $2))
         ORDER BY e.aggregate_id, e.aggregate_version",
    )
    .bind(aggregates)
    .bind(since)
    .fetch_all(pool)
    .await
}

/// One event of an aggregate as the console's timeline shows it, with its row if it has one.
#[derive(Debug, Clone, PartialEq)]
pub struct TimelineRow {
    /// Insertion number in `events`.
    pub position: i64,
    /// The event.
    pub event_id: Uuid,
    /// Its type.
    pub event_type: String,
    /// The payload version it was stored with.
    pub event_version: i32,
    /// Its place in the aggregate's history.
    pub aggregate_version: i64,
    /// When it was decided.
    pub occurred_at: DateTime<Utc>,
    /// When the database recorded it.
    pub recorded_at: DateTime<Utc>,
    /// The payload as stored (`payload::text`: JSONB normalizes key order and spacing).
    pub stored_payload: String,
    /// The payload.
    pub payload: serde_json::Value,
    /// Its row (`None`: purged after it was sent, or never written).
    pub row: Option<TimelineDelivery>,
}

/// What the timeline shows of a row.
#[derive(Debug, Clone, PartialEq)]
pub struct TimelineDelivery {
    /// Where it is in its life.
    pub status: Status,
    /// Publish attempts.
    pub attempts: i32,
    /// The relay's record of the stream sequence.
    pub stream_seq: Option<i64>,
    /// When it was sent.
    pub sent_at: Option<DateTime<Utc>>,
    /// Why it died, else the last publish error.
    pub error: Option<String>,
}

#[derive(sqlx::FromRow)]
struct TimelineRecord {
    position: i64,
    event_id: Uuid,
    event_type: String,
    event_version: i32,
    aggregate_version: i64,
    occurred_at: DateTime<Utc>,
    recorded_at: DateTime<Utc>,
    stored_payload: String,
    payload: serde_json::Value,
    status: Option<Status>,
    attempts: Option<i32>,
    stream_seq: Option<i64>,
    sent_at: Option<DateTime<Utc>>,
    error: Option<String>,
    has_outbox: bool,
}

/// The first `limit` events of `aggregate`, oldest first, each with its row.
pub async fn timeline(
    pool: &PgPool,
    aggregate: Uuid,
    limit: i64,
) -> sqlx::Result<Vec<TimelineRow>> {
    // The outbox is joined on (aggregate_id, aggregate_version), its unique index: `event_id` has
    // none there, and joining on it would scan the whole outbox for every order looked at.
    let records: Vec<TimelineRecord> = sqlx::query_as(
        "SELECT e.position, e.event_id, e.event_type, e.event_version, e.aggregate_version,
                e.occurred_at, e.recorded_at, e.payload::text AS stored_payload, e.payload,
                o.status, o.attempts, o.stream_seq, o.sent_at, coalesce(o.dead_reason, o.last_error) AS error,
                o.id IS NOT NULL AS has_outbox
         FROM events e LEFT JOIN outbox o
              ON o.aggregate_id = e.aggregate_id AND o.aggregate_version = e.aggregate_version
         WHERE e.aggregate_id = $1 ORDER BY e.aggregate_version LIMIT $2",
    )
    .bind(aggregate)
    .bind(limit)
    .fetch_all(pool)
    .await?;
    records
        .into_iter()
        .map(|r| {
            let row = if r.has_outbox {
                let missing = |column: &str| sqlx::Error::ColumnDecode {
                    index: column.to_owned(),
                    source: "NULL in a row that exists".into(),
                };
                Some(TimelineDelivery {
                    status: r.status.ok_or_else(|| missing("status"))?,
                    attempts: r.attempts.ok_or_else(|| missing("attempts"))?,
                    stream_seq: r.stream_seq,
                    sent_at: r.sent_at,
                    error: r.error,
                })
            } else {
                None
            };
            Ok(TimelineRow {
                position: r.position,
                event_id: r.event_id,
                event_type: r.event_type,
                event_version: r.event_version,
                aggregate_version: r.aggregate_version,
                occurred_at: r.occurred_at,
                recorded_at: r.recorded_at,
                stored_payload: r.stored_payload,
                payload: r.payload,
                row,
            })
        })
        .collect()
}

/// When the newest sent row was sent, among the last 1,000 rows written: the newest rows are the last
/// sent, and a bounded look (by the primary key) never walks history.
pub async fn last_sent_at(pool: &PgPool) -> sqlx::Result<Option<DateTime<Utc>>> {
    sqlx::query_scalar(
        "SELECT max(sent_at) FROM (SELECT sent_at FROM outbox ORDER BY id DESC LIMIT 1000) newest",
    )
    .fetch_one(pool)
    .await
}
