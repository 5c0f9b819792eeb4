//! Claiming: one statement locks a batch of aggregate heads and their following versions with
//! `FOR UPDATE SKIP LOCKED`, inside the short transaction that will also settle them.
//!
//! A row is a head when every earlier version of its aggregate is sent. Row locks, not a `processing`
//! status, mark the claim: PostgreSQL releases them when the relay's session ends, however it ends.

use bytes::Bytes;
use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgPool, Postgres, Transaction};
use uuid::Uuid;

/// One claimed outbox row: what to publish and where.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct ClaimedRow {
    /// `outbox.id`.
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
    /// The order.
    pub aggregate_id: Uuid,
    /// The order key within the aggregate.
    pub aggregate_version: i64,
    /// The message body, published verbatim (shared, not copied, by the publish).
    #[sqlx(try_from = "String")]
    pub body: Bytes,
    /// For a head: the stream sequence of the aggregate's previous version — 0 for version 1, `None`
    /// when that row was purged or its sequence is unknown (the stream is asked then). For a
    /// follower: `None`; its predecessor's PubAck supplies it. Signed as `outbox.stream_seq` stores it;
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

/// Locks up to `batch_size` due heads and up to `max_rows` rows in all, oldest due first.
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
    lane: Option<(u32, u32)>,
) -> sqlx::Result<Vec<ClaimedRow>> {
    sqlx::query_as(
        "WITH heads AS (
            SELECT o.id, o.attempts, o.created_at, o.traceparent, o.event_id, o.event_type,
                   o.event_version, o.aggregate_type, o.aggregate_id, o.aggregate_version, o.body,
                   CASE WHEN o.aggregate_version = 1 THEN 0 ELSE p.stream_seq END AS previous_sequence,
                   o.ctid::text AS tid
            FROM outbox o
            LEFT JOIN outbox p
                   ON p.aggregate_id = o.aggregate_id AND p.aggregate_version = o.aggregate_version - 1
            WHERE o.status IN ('pending', 'failed')
              AND o.next_run_at <= now()
              AND (p.id IS NULL OR p.status = 'sent')
              AND ($3::int4 IS NULL
                   OR (get_byte(uuid_send(o.aggregate_id), 14) * 256
                       + get_byte(uuid_send(o.aggregate_id), 15)) % $3 = $4)
            ORDER BY o.next_run_at, o.id
            LIMIT $1
            FOR UPDATE OF o SKIP LOCKED
        ),
        share AS (
            SELECT greatest(($2 - count(*)) / greatest(count(*), 1), 0) AS per_head FROM heads
        ),
        followers AS (
            SELECT f.*
            FROM heads h
            CROSS JOIN LATERAL (
                SELECT f.id, f.attempts, f.created_at, f.traceparent, f.event_id, f.event_type,
                       f.event_version, f.aggregate_type, f.aggregate_id, f.aggregate_version, f.body,
                       NULL::int8 AS previous_sequence, f.ctid::text AS tid
                FROM outbox f
                WHERE f.aggregate_id = h.aggregate_id
                  AND f.aggregate_version > h.aggregate_version
                  AND f.status NOT IN ('sent', 'dead')
                ORDER BY f.aggregate_version
                LIMIT (SELECT per_head FROM share)
                FOR UPDATE OF f SKIP LOCKED
            ) f
        )
        SELECT * FROM heads
        UNION ALL
        SELECT * FROM followers
        ORDER BY aggregate_id, aggregate_version",
    )
    .bind(batch_size)
    .bind(max_rows)
    .bind(lane.map(|(_, lanes)| lanes as i32))
    .bind(lane.map(|(lane, _)| lane as i32))
    .fetch_all(tx)
    .await
}

/// Groups claimed rows (ordered by aggregate, then version) into per-aggregate runs of consecutive
/// versions, head first. Returns the runs and how many rows were left out.
///
/// A run stops at the first gap: a version we could not lock (someone else holds it) must not be
/// overtaken by a later one. Rows after a gap are left out of this step and stay pending.
pub fn into_runs(rows: Vec<ClaimedRow>) -> (Vec<Vec<ClaimedRow>>, usize) {
    let mut runs: Vec<Vec<ClaimedRow>> = Vec::new();
    let mut closed = false;
    let mut left_out = 0;
    for row in rows {
        match runs.last_mut() {
            Some(run) if run[0].aggregate_id == row.aggregate_id => {
                let next = run.last().map_or(0, |r| r.aggregate_version) + 1;
                if !closed && row.aggregate_version == next {
                    run.push(row);
                } else {
                    closed = true;
                    left_out += 1;
                }
            }
            _ => {
                closed = false;
                runs.push(vec![row]);
            }
        }
    }
    (runs, left_out)
}

/// The outbox ids in `runs`.
pub fn row_ids(runs: &[Vec<ClaimedRow>]) -> Vec<i64> {
    runs.iter().flatten().map(|r| r.id).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(aggregate: u128, version: i64) -> ClaimedRow {
        ClaimedRow {
            id: version,
            attempts: 0,
            created_at: Utc::now(),
            traceparent: None,
            event_id: Uuid::now_v7(),
            event_type: "order.paid".into(),
            event_version: 1,
            aggregate_type: "order".into(),
            aggregate_id: Uuid::from_u128(aggregate),
            aggregate_version: version,
            body: Bytes::from_static(b"{}"),
            previous_sequence: None,
            tid: String::new(),
        }
    }

    #[test]
    fn rows_group_into_runs_per_aggregate() {
        let (runs, left_out) =
            into_runs(vec![row(1, 1), row(1, 2), row(1, 3), row(2, 5), row(2, 6)]);
        let shape: Vec<Vec<i64>> = runs
            .iter()
            .map(|r| r.iter().map(|x| x.aggregate_version).collect())
            .collect();
        assert_eq!(shape, vec![vec![1, 2, 3], vec![5, 6]]);
        assert_eq!(left_out, 0);
    }

    #[test]
    fn a_gap_ends_the_run_and_later_versions_wait() {
        let (runs, left_out) = into_runs(vec![row(1, 1), row(1, 3), row(1, 4), row(2, 1)]);
        let shape: Vec<Vec<i64>> = runs
            .iter()
            .map(|r| r.iter().map(|x| x.aggregate_version).collect())
            .collect();
        assert_eq!(shape, vec![vec![1], vec![1]]);
        assert_eq!(
            left_out, 2,
            "versions 3 and 4 must not overtake the missing 2"
        );
    }
}
