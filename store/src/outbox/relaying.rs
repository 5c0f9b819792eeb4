//! A relay step's statements, inside the claim's transaction: claim a batch of aggregate heads and
//! their following versions (`FOR UPDATE SKIP LOCKED`), journal it before publishing, settle it — and
//! a repair's rewind of one aggregate.
//!
//! A row is a head when every earlier version of its aggregate is sent. Row locks, not a `processing`
//! status, mark the claim: PostgreSQL releases them when the relay's session ends, however it ends.
//!
//! Settling marks rows sent, failed (with backoff) or dead, holds back the versions behind a failure,
//! and closes the step's journal record — one statement. Its times are `clock_timestamp()`, not
//! `now()`: `now()` is when the claim's transaction began, up to a step's length earlier, and retry
//! delays must count from the failure. The transaction still holds the claim's row locks, so the
//! marks are fenced: a relay whose session was ended (by a crash, a timeout or `pg_terminate_backend`)
//! cannot mark anything, and rows it lost are already someone else's.

use std::collections::HashMap;
use std::num::TryFromIntError;
use std::time::Duration;

use bytes::Bytes;
use chrono::{DateTime, Utc};
use domain::EventEnvelope;
use sqlx::{PgConnection, PgPool, Postgres, Transaction};
use uuid::Uuid;

use super::{Divergence, Status};

/// One claimed outbox row: what to publish and where.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct ClaimedRow {
    /// The row's `id`.
    pub id: i64,
    /// Publish attempts so far.
    pub attempts: i32,
    /// When the row (and its event) was committed.
    pub created_at: DateTime<Utc>,
    /// Trace context to forward.
    pub traceparent: Option<String>,
    /// The event's id: the `Nats-Msg-Id`.
    pub event_id: Uuid,
    /// E.g. `order.placed`.
    pub event_type: String,
    /// The payload version.
    pub event_version: i32,
    /// E.g. `order`: with the id, the subject.
    pub aggregate_type: String,
    /// The aggregate's id.
    pub aggregate_id: Uuid,
    /// The event's place in its aggregate's history: the per-aggregate order key.
    pub aggregate_version: i64,
    /// The message body, published verbatim (shared, not copied, by the publish).
    #[sqlx(try_from = "String")]
    pub body: Bytes,
    /// For a head: the stream sequence of the aggregate's previous version — 0 for version 1, `None`
    /// when that row was purged or its sequence is unknown (the stream is asked then). For a
    /// follower: `None`; its predecessor's PubAck supplies it. Signed as the `stream_seq` column stores it;
    /// the publish turns it into JetStream's unsigned sequence.
    pub previous_sequence: Option<i64>,
    /// Where the locked row version sits (`ctid`, as text): the settle finds it there without a
    /// primary-key lookup. Stable while the claim holds the row lock (nothing can update or move it).
    pub tid: String,
}

/// Opens a claim transaction with the claim's plan pinned (see [`claim`]). The settings travel with
/// `BEGIN` in one simple query: a round trip less per step than setting them after it.
pub async fn begin(pool: &PgPool) -> sqlx::Result<Transaction<'static, Postgres>> {
    pool.begin_with(
        "BEGIN; SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off;
         SET LOCAL enable_hashjoin = off; SET LOCAL enable_mergejoin = off;
         SET LOCAL enable_sort = off",
    )
    .await
}

/// Locks up to `batch_size` due heads and up to `max_rows` rows in all, oldest due first, and returns
/// as many of them as fit in `max_bytes` of bodies (at least one).
///
/// Heads: unsent (`pending`/`failed`), due, and the previous version is sent (a `dead` one holds its
/// aggregate back). Checking only version − 1 is enough — versions are sent in order, so if it is sent
/// so are all before it — and it is one equality probe into `outbox_aggregate_version_idx`, which also
/// yields that version's stream sequence: the fence of the head's publish. ("Any earlier unsent version"
/// walked every unsent row of the aggregate: 380 ms for a claim of 1000 with 1000 unsent rows.) A purged
/// predecessor was sent; its sequence is then unknown and the publish asks the stream.
///
/// Followers: the unsent later versions of each claimed head's aggregate, whatever their `next_run_at`
/// — they are published only after their predecessor's PubAck, which gives their fence. Each head gets
/// an equal share of the rows left after the heads, read by one short range scan of
/// `outbox_aggregate_version_idx` per head that stops at its share. One sort over every head's unsent
/// versions, cut at `max_rows`, read all of them (a step over 1,000 orders with 100 unsent versions each
/// read ~99k rows to keep 3,000) and gave the first few orders in UUID order chains of 100 sequential
/// PubAcks while the others got one row: hot aggregates drained at half the rate of spread ones. With
/// equal shares every chain is short and every wave of publishes carries one message per head. The
/// status test is written `NOT IN ('sent', 'dead')` (the same rows, by the column's check) so that the
/// planner cannot use the partial `outbox_due_idx` for this per-aggregate scan.
///
/// Both parts return their columns directly: no second lookup.
///
/// Bodies: the rows returned are cut at `max_bytes` of bodies (`octet_length`, which a TOASTed body
/// answers without being read), counted wave by wave — every head oldest first, then every head's
/// first follower, and so on — so the cut keeps each aggregate's versions a prefix and shares the
/// budget as the rows are shared. The row that crosses the budget is kept: a claim always returns
/// something, however large one body is. Counted in rows alone, a claim of the default 4,000 rows of
/// 256 KB bodies would hold a gigabyte in the relay. Heads past the budget are still locked (locking
/// and counting cannot be one step: `FOR UPDATE` takes no window function), so until the step ends
/// other relays skip them as they skip any claimed row; their followers are not read at all. The
/// counting runs only when the rows exceed the budget: a sum decides, and the counting branch sits
/// behind a one-time filter that PostgreSQL does not execute otherwise. Counting every claim cost a
/// claim of 2,000 rows of 362 bytes about 5 ms (16–17 ms before, 21 ms after, pgbench with the
/// relay's generic plans, three runs each) and the relay about 10 µs of CPU per event in `waybill
/// bench`; with the sums alone, under 1 ms (medians of six runs: 20.1 against 19.2 ms), and the
/// bench's figures within the spread of the relay before (docs/decisions/relay-claims.md).
///
/// The plan is pinned for the claim's transaction, which [`begin`] opens (`SET LOCAL`): walk
/// `outbox_due_idx` in order and probe each candidate's predecessor, stopping at `batch_size`
/// heads. When the statistics say most rows are unsent — a small outbox, or one analyzed during a
/// burst — the planner otherwise hash-joined the whole table with itself and sorted it to keep
/// 1,000 rows: 0.96 s per claim of a 100k-row outbox with no history (44 ms pinned), which made an
/// empty outbox drain slower than one with 1M sent rows. Every statement of a claim is index-driven; nothing in it wants those plans.
///
/// With `lane = Some((k, n))` only aggregates of lane `k` of `n` are claimed — the last two bytes of
/// the aggregate id, modulo `n` (random bits in every UUID v4 or v7). A relay's lanes then never
/// compete for the same heads: without it, when there were fewer due aggregates than a claim takes
/// (hot aggregates), the first lane locked every head and the others found nothing, and otherwise
/// each lane walked past the rows the others had locked.
pub async fn claim(
    tx: &mut PgConnection,
    batch_size: i64,
    max_rows: i64,
    max_bytes: i64,
    lane: Option<(u32, u32)>,
) -> sqlx::Result<Vec<ClaimedRow>> {
    // PostgreSQL's int; a lane count past i32::MAX is refused before anything is claimed.
    let lane = lane
        .map(|(lane, lanes)| {
            Ok::<_, TryFromIntError>((i32::try_from(lane)?, i32::try_from(lanes)?))
        })
        .transpose()
        .map_err(|e| sqlx::Error::Encode(Box::new(e)))?;
    sqlx::query_as(
        "WITH heads AS (
            SELECT o.id, o.attempts, o.created_at, o.traceparent, o.event_id, o.event_type,
                   o.event_version, o.aggregate_type, o.aggregate_id, o.aggregate_version, o.body,
                   CASE WHEN o.aggregate_version = 1 THEN 0 ELSE p.stream_seq END AS previous_sequence,
                   o.ctid::text AS tid, o.next_run_at AS due, octet_length(o.body) AS size
            FROM outbox o
            LEFT JOIN outbox p
                   ON p.aggregate_id = o.aggregate_id AND p.aggregate_version = o.aggregate_version - 1
            WHERE o.status IN ('pending', 'failed')
              AND o.next_run_at <= now()
              AND (p.id IS NULL OR p.status = 'sent')
              AND ($4::int4 IS NULL
                   OR (get_byte(uuid_send(o.aggregate_id), 14) * 256
                       + get_byte(uuid_send(o.aggregate_id), 15)) % $4 = $5)
            ORDER BY o.next_run_at, o.id
            LIMIT $1
            FOR UPDATE OF o SKIP LOCKED
        ),
        heads_bytes AS (
            SELECT coalesce(sum(size), 0) AS total FROM heads
        ),
        kept AS NOT MATERIALIZED (
            SELECT * FROM heads WHERE (SELECT total FROM heads_bytes) <= $3
            UNION ALL
            SELECT id, attempts, created_at, traceparent, event_id, event_type, event_version,
                   aggregate_type, aggregate_id, aggregate_version, body, previous_sequence, tid,
                   due, size
            FROM (
                SELECT h.*, sum(h.size) OVER (ORDER BY h.due, h.id ROWS UNBOUNDED PRECEDING)
                            - h.size AS before
                FROM heads h
            ) counted
            WHERE before < $3 AND (SELECT total FROM heads_bytes) > $3
        ),
        share AS (
            SELECT greatest(($2 - count(*)) / greatest(count(*), 1), 0) AS per_head FROM kept
        ),
        followers AS (
            SELECT f.*, k.due, octet_length(f.body) AS size, k.id AS head,
                   f.aggregate_version - k.aggregate_version AS wave
            FROM kept k
            CROSS JOIN LATERAL (
                SELECT f.id, f.attempts, f.created_at, f.traceparent, f.event_id, f.event_type,
                       f.event_version, f.aggregate_type, f.aggregate_id, f.aggregate_version, f.body,
                       NULL::int8 AS previous_sequence, f.ctid::text AS tid
                FROM outbox f
                WHERE f.aggregate_id = k.aggregate_id
                  AND f.aggregate_version > k.aggregate_version
                  AND f.status NOT IN ('sent', 'dead')
                ORDER BY f.aggregate_version
                LIMIT (SELECT per_head FROM share)
                FOR UPDATE OF f SKIP LOCKED
            ) f
        ),
        chains AS NOT MATERIALIZED (
            SELECT *, id AS head, 0::int8 AS wave FROM kept
            UNION ALL
            SELECT * FROM followers
        ),
        all_bytes AS (
            SELECT coalesce(sum(size), 0) AS total FROM chains
        )
        SELECT id, attempts, created_at, traceparent, event_id, event_type, event_version,
               aggregate_type, aggregate_id, aggregate_version, body, previous_sequence, tid
        FROM chains
        WHERE (SELECT total FROM all_bytes) <= $3
        UNION ALL
        SELECT id, attempts, created_at, traceparent, event_id, event_type, event_version,
               aggregate_type, aggregate_id, aggregate_version, body, previous_sequence, tid
        FROM (
            SELECT c.*, sum(c.size) OVER (ORDER BY c.wave, c.due, c.head ROWS UNBOUNDED PRECEDING)
                        - c.size AS before
            FROM chains c
        ) counted
        WHERE before < $3 AND (SELECT total FROM all_bytes) > $3
        ORDER BY aggregate_id, aggregate_version",
    )
    .bind(batch_size)
    .bind(max_rows)
    .bind(max_bytes.max(1))
    .bind(lane.map(|(_, lanes)| lanes))
    .bind(lane.map(|(lane, _)| lane))
    .fetch_all(tx)
    .await
}

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
    /// Its locked version's `ctid` ([`ClaimedRow::tid`]).
    pub tid: String,
    /// Its stream sequence (unknown for some fenced rows).
    pub sequence: Option<i64>,
}

/// A row whose publish failed, as the settle statement marks it.
#[derive(Debug)]
pub struct FailedRow {
    /// The outbox row.
    pub id: i64,
    /// [`Status::Failed`] (retried later) or [`Status::Dead`] (out of attempts).
    pub status: Status,
    /// When to retry, from now.
    pub retry_in_seconds: f64,
    /// Why it failed, kept in `last_error`.
    pub error: String,
    /// The divergence the fence found, kept as JSON in the `divergence` column (`None` clears it).
    pub divergence: Option<Divergence>,
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
            status: if dead { Status::Dead } else { Status::Failed },
            retry_in_seconds: delay.as_secs_f64(),
            error,
            divergence: divergence.cloned(),
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
    .bind(settlement.failed.iter().map(|f| f.status.as_str()).collect::<Vec<_>>())
    .bind(settlement.failed.iter().map(|f| f.retry_in_seconds).collect::<Vec<_>>())
    .bind(settlement.failed.iter().map(|f| f.error.as_str()).collect::<Vec<_>>())
    .bind(settlement.held.iter().map(|h| h.0).collect::<Vec<_>>())
    .bind(settlement.held.iter().map(|h| h.1).collect::<Vec<_>>())
    .bind(relay_id)
    .bind(claimed_at)
    .bind(claim_id)
    .bind(&settlement.ambiguous)
    .bind(settlement.sent.iter().map(|s| s.tid.as_str()).collect::<Vec<_>>())
    .bind(
        settlement
            .failed
            .iter()
            .map(|f| f.divergence.as_ref().and_then(|d| serde_json::to_string(d).ok()))
            .collect::<Vec<_>>(),
    )
    .fetch_one(tx)
    .await
}

/// Withdraws a journal record whose step published nothing (a record left behind only makes a later
/// republish be checked against the window, so callers may ignore a failure).
pub async fn forget_journal(pool: &PgPool, claim_id: Uuid) -> sqlx::Result<()> {
    sqlx::query("DELETE FROM outbox_inflight WHERE claim_id = $1")
        .bind(claim_id)
        .execute(pool)
        .await
        .map(drop)
}

/// Records the batch as possibly published (committed before any publish) and returns, for the rows
/// an unsettled step may already have published more than `window` ago, when that step started.
///
/// Only records older than the dedupe window are searched: a younger one's publishes are still
/// deduplicated by JetStream, and skipping them keeps the array comparison off the hot path (live
/// steps' records are always younger). The cutoff is a subquery so that PostgreSQL compares it first:
/// written inline it costs more than `&&`, which was then run on every live record of the other relays
/// — batch × batch id comparisons per step, up to a tenth of PostgreSQL's CPU in a two-relay drain.
///
/// The record must survive a PostgreSQL crash, so it is committed with a WAL flush: `pool`'s sessions
/// have `synchronous_commit = on` (the relay's others commit asynchronously). One statement in its
/// own implicit transaction, so one round trip (`BEGIN`, `SET LOCAL synchronous_commit`, the insert
/// and `COMMIT` were four, in every step, while the claim's row locks waited).
pub async fn journal(
    pool: &PgPool,
    claim_id: Uuid,
    relay_id: &str,
    outbox_ids: &[i64],
    window: std::time::Duration,
) -> sqlx::Result<HashMap<i64, DateTime<Utc>>> {
    let rows: Vec<EarlierPublish> = sqlx::query_as(JOURNAL)
        .bind(claim_id)
        .bind(relay_id)
        .bind(outbox_ids)
        .bind(window.as_secs_f64())
        .fetch_all(pool)
        .await?;
    Ok(rows
        .into_iter()
        .map(|row| (row.outbox_id, row.started_at))
        .collect())
}

/// The statement of [`journal`].
const JOURNAL: &str = "WITH recorded AS (
        INSERT INTO outbox_inflight (claim_id, relay, outbox_ids) VALUES ($1, $2, $3)
    )
    SELECT r.id AS outbox_id, min(j.started_at) AS started_at
    FROM outbox_inflight j CROSS JOIN LATERAL unnest(j.outbox_ids) AS r(id)
    WHERE j.started_at < (SELECT now() - $4 * interval '1 second')
      AND j.outbox_ids && $3 AND r.id = ANY($3)
    GROUP BY r.id";

/// A row of this batch that an unsettled step, started longer ago than the dedupe window, may have
/// published.
#[derive(sqlx::FromRow)]
struct EarlierPublish {
    outbox_id: i64,
    /// When the earliest such step started.
    started_at: DateTime<Utc>,
}

/// Locks every row of `aggregate` for a repair (a relay holding some of them finishes its step first).
pub async fn lock_aggregate(tx: &mut PgConnection, aggregate: Uuid) -> sqlx::Result<()> {
    sqlx::query("SELECT id FROM outbox WHERE aggregate_id = $1 FOR UPDATE")
        .bind(aggregate)
        .fetch_all(tx)
        .await
        .map(drop)
}

/// Writes `envelope`'s row again, as the append writes it, unless its aggregate version has one (it
/// was purged after it was sent). Returns whether it wrote one.
pub async fn restore_row(tx: &mut PgConnection, envelope: &EventEnvelope) -> sqlx::Result<bool> {
    let written = sqlx::query(
        "INSERT INTO outbox (event_id, event_type, event_version, aggregate_type, aggregate_id,
                             aggregate_version, body)
         SELECT $1, $2, $3, $4, $5, $6, $7
         WHERE NOT EXISTS (SELECT 1 FROM outbox WHERE aggregate_id = $5 AND aggregate_version = $6)",
    )
    .bind(envelope.event_id)
    .bind(&envelope.event_type)
    .bind(envelope.event_version)
    .bind(&envelope.aggregate_type)
    .bind(envelope.aggregate_id)
    .bind(envelope.aggregate_version)
    .bind(envelope.to_json_string())
    .execute(tx)
    .await?
    .rows_affected();
    Ok(written > 0)
}

/// Sets the aggregate's rows after version `agreeing` pending again, as never published, saying why in
/// `last_error`. Returns how many.
pub async fn rewind_after(
    tx: &mut PgConnection,
    aggregate: Uuid,
    agreeing: i64,
) -> sqlx::Result<u64> {
    Ok(sqlx::query(
        "UPDATE outbox
         SET status = 'pending', attempts = 0, next_run_at = now(), stream_seq = NULL, sent_at = NULL,
             divergence = NULL, dead_at = NULL, dead_reason = NULL,
             last_error = 'repaired: the stream''s messages after version ' || $2 || ' were deleted'
         WHERE aggregate_id = $1 AND aggregate_version > $2",
    )
    .bind(aggregate)
    .bind(agreeing)
    .execute(tx)
    .await?
    .rows_affected())
}

/// What [`mark_delivered`] did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct MarkedDelivered {
    /// Rows marked sent.
    pub marked: u64,
    /// Rows the statement could not see, left unmarked: their transaction's commit is in the WAL
    /// (which is how the WAL relay read them) but not yet visible to other sessions. PostgreSQL
    /// flushes a commit record, which a walsender may decode at once, before it ends the transaction
    /// for everyone else (and, under synchronous replication, only once a standby has confirmed it).
    pub unseen: Vec<i64>,
}

/// Marks rows a relay reading the WAL delivered (`ids[i]` stored at stream sequence `seqs[i]`) as
/// sent: one statement for a whole batch, by primary key, outside any claim — the WAL relay locks
/// nothing before publishing. A row already sent is left as it is (a polling relay got there first).
/// So is a row someone acted on since it was written, which `last_error` says: a polling relay's
/// failed publish, or a repair that deleted its message from the stream and set it pending again
/// between this relay's publish and this mark — marked sent, it would claim a message the stream no
/// longer holds. Polling settles such a row against the stream (a duplicate of a deleted message is a
/// divergence, retried until the dedupe window has passed). A row another relay has claimed is
/// waited for, then judged the same way. Returns
/// the rows marked, and those not visible yet (see [`MarkedDelivered::unseen`]), which the caller
/// must mark again: the statement's one snapshot decides both, so a row is in exactly one of "marked
/// or already sent" and "unseen".
pub async fn mark_delivered(
    pool: &PgPool,
    relay_id: &str,
    ids: &[i64],
    seqs: &[i64],
) -> sqlx::Result<MarkedDelivered> {
    let (marked, unseen): (i64, Vec<i64>) = sqlx::query_as(
        "WITH delivered AS (SELECT * FROM UNNEST($1::int8[], $2::int8[]) AS u(id, seq)),
         marked AS (
             UPDATE outbox o
             SET status = 'sent', sent_at = clock_timestamp(), stream_seq = u.seq,
                 attempts = o.attempts + 1, last_error = NULL, divergence = NULL, claimed_by = $3,
                 claimed_at = clock_timestamp()
             FROM delivered u
             WHERE o.id = u.id AND o.status <> 'sent' AND o.last_error IS NULL
             RETURNING o.id
         )
         SELECT (SELECT count(*) FROM marked),
                ARRAY(SELECT u.id FROM delivered u
                      WHERE NOT EXISTS (SELECT 1 FROM outbox o WHERE o.id = u.id))",
    )
    .bind(ids)
    .bind(seqs)
    .bind(relay_id)
    .fetch_one(pool)
    .await?;
    Ok(MarkedDelivered {
        marked: u64::try_from(marked).unwrap_or_default(),
        unseen,
    })
}

/// Whether the relay reading a replication slot through the walsender `walsender_pid` marked a row
/// sent within the last `within`: evidence that it is delivering, however overdue its rows look —
/// the rows of a bulk import are due from their transaction's start, so they look overdue the moment
/// it commits, while that relay publishes and marks them part by part. The walsender's
/// `application_name` is `application_prefix` and the relay's id, which its marks write as
/// `claimed_by`; PostgreSQL keeps 63 bytes of a name, so the id is compared as far as it was kept.
///
/// Uses retention's index on `sent_at`. The window is written into the statement, not bound: the
/// relay's sessions plan generically (`plan_cache_mode`), and a window bound as a parameter is estimated to match a
/// third of the table — the plan was a sequential scan, 334 ms over a million sent rows, against an
/// index scan under a millisecond with the window in the text (`now()` is folded for the estimate).
pub async fn marked_by_slot_reader_within(
    pool: &PgPool,
    walsender_pid: i32,
    application_prefix: &str,
    within: Duration,
) -> sqlx::Result<bool> {
    let statement = format!(
        "WITH reader AS (SELECT application_name AS name FROM pg_stat_activity WHERE pid = $1)
         SELECT EXISTS (
            SELECT 1 FROM outbox o, reader r
            WHERE o.status = 'sent' AND o.sent_at > now() - interval '{} milliseconds'
              AND left($2 || o.claimed_by, 63) = r.name
         )",
        within.as_millis()
    );
    // A number formatted by this function, nothing a caller wrote.
    sqlx::query_scalar(sqlx::AssertSqlSafe(statement))
        .bind(walsender_pid)
        .bind(application_prefix)
        .fetch_one(pool)
        .await
}

/// The process id of the session reading the logical replication slot `slot` of this database, if
/// one does.
pub async fn slot_reader(pool: &PgPool, slot: &str) -> sqlx::Result<Option<i32>> {
    Ok(sqlx::query_scalar(
        "SELECT active_pid FROM pg_replication_slots
         WHERE slot_name = $1 AND database = current_database()",
    )
    .bind(slot)
    .fetch_optional(pool)
    .await?
    .flatten())
}

/// Of `aggregates`, those with a row not yet sent, each with the status of its first such row
/// (`pending`, `failed` or `dead`: one behind a dead row waits for an operator).
pub async fn first_unsent(pool: &PgPool, aggregates: &[Uuid]) -> sqlx::Result<Vec<(Uuid, String)>> {
    sqlx::query_as(
        "SELECT DISTINCT ON (aggregate_id) aggregate_id, status FROM outbox
         WHERE aggregate_id = ANY($1) AND status <> 'sent'
         ORDER BY aggregate_id, aggregate_version",
    )
    .bind(aggregates)
    .fetch_all(pool)
    .await
}

/// Of the outbox rows `ids`, those marked sent: a WAL relay's slot replays rows that its session's
/// opening drain (or another relay) has delivered since, and publishing them again would only be
/// answered as a duplicate, or refused by the fence once the dedupe window has passed.
pub async fn sent_among(pool: &PgPool, ids: &[i64]) -> sqlx::Result<Vec<i64>> {
    sqlx::query_scalar("SELECT id FROM outbox WHERE id = ANY($1) AND status = 'sent'")
        .bind(ids)
        .fetch_all(pool)
        .await
}

/// Of `heads` (an aggregate and the version about to be published), the aggregates whose previous
/// version is in the outbox and not sent: dead, failing, or made due again by an update. Publishing
/// the head would put it on the stream before its predecessor (the claim's own rule, for a reader
/// of rows that did not come through a claim: the WAL relay). A predecessor the outbox no longer
/// holds (deleted by retention, which takes sent rows only) does not hold a head back.
pub async fn unsent_predecessors(pool: &PgPool, heads: &[(Uuid, i64)]) -> sqlx::Result<Vec<Uuid>> {
    let (aggregates, versions): (Vec<Uuid>, Vec<i64>) = heads.iter().copied().unzip();
    sqlx::query_scalar(
        "SELECT o.aggregate_id
         FROM unnest($1::uuid[], $2::bigint[]) AS head(aggregate_id, aggregate_version)
         JOIN outbox o ON o.aggregate_id = head.aggregate_id
                      AND o.aggregate_version = head.aggregate_version - 1
         WHERE o.status <> 'sent'",
    )
    .bind(aggregates)
    .bind(versions)
    .fetch_all(pool)
    .await
}

#[cfg(test)]
mod tests {
    use sqlx::PgPool;
    use uuid::Uuid;

    use super::JOURNAL;

    /// Every step searches the journal while the other lanes' and relays' records of their live steps
    /// (young, each with a batch of ids) are in it: their age must be tested before their ids.
    #[sqlx::test(migrator = "crate::MIGRATOR")]
    async fn the_journal_tests_a_records_age_before_its_ids(pool: PgPool) {
        let plan: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "EXPLAIN (VERBOSE, COSTS OFF) {JOURNAL}"
        )))
        .bind(Uuid::now_v7())
        .bind("test")
        .bind(vec![1_i64, 2, 3])
        .bind(120.0_f64)
        .fetch_all(&pool)
        .await
        .expect("explain the journal");
        let filter = plan
            .iter()
            .skip_while(|line| !line.contains("Scan on public.outbox_inflight j"))
            .find(|line| line.contains("Filter:"))
            .unwrap_or_else(|| panic!("no filter on the journal's records in {plan:#?}"));
        let (age, ids) = (filter.find("started_at"), filter.find("&&"));
        assert!(
            matches!((age, ids), (Some(age), Some(ids)) if age < ids),
            "the records' ids are compared before their age: {filter}"
        );
    }
}
