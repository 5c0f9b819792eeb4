//! The one owner of the outbox: the tables `outbox` (one delivery row per event) and `outbox_inflight`
//! (the relays' journal of publishes not yet settled) — their names, their columns, their status words
//! (as [`Status`]), the divergence kept on a row ([`Divergence`]), the privileges each role has on them,
//! and every statement anyone runs against them outside the migrations and the tests.
//!
//! - this file: the table's vocabulary, the append's statement (an event and its row, in one), the
//!   grants, and the fixtures the lab and the test kit need ([`fixtures`]);
//! - [`relaying`]: a relay step's statements — claim, journal, settle — and a repair's;
//! - [`admin`]: what operators and observers read and change — counts, status, dead rows, purging,
//!   the store side of `verify`, the console's reads.
//!
//! Why one owner: the claim's locking, the partial indexes' predicates and the status words must agree
//! everywhere, and a column renamed in a migration must break here only. Tests keep their own SQL on
//! purpose (they check this code, not through it), and so does the chaos verdict (an independent
//! oracle); `store/tests/outbox_owner.rs` fails naming any other file that spells outbox SQL.

pub mod admin;
pub mod relaying;

use std::fmt;

use domain::EventEnvelope;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// The delivery table: one row per event to publish.
pub const TABLE: &str = "outbox";

/// The relays' journal of publishes that may have reached the broker unsettled.
pub const JOURNAL_TABLE: &str = "outbox_inflight";

/// Every column of [`TABLE`], in the table's order (later migrations added the last two).
pub const COLUMNS: [&str; 21] = [
    "id",
    "event_id",
    "event_type",
    "event_version",
    "aggregate_id",
    "aggregate_version",
    "body",
    "status",
    "attempts",
    "next_run_at",
    "last_error",
    "created_at",
    "sent_at",
    "dead_at",
    "dead_reason",
    "claimed_by",
    "claimed_at",
    "stream_seq",
    "traceparent",
    "aggregate_type",
    "divergence",
];

/// Every column of [`JOURNAL_TABLE`].
pub const JOURNAL_COLUMNS: [&str; 4] = ["claim_id", "relay", "started_at", "outbox_ids"];

/// Where a row is in its life (the `status` column; its check constraint allows exactly these).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, sqlx::Type,
)]
#[serde(rename_all = "lowercase")]
#[sqlx(type_name = "text", rename_all = "lowercase")]
pub enum Status {
    /// Waiting for its first publish.
    Pending,
    /// Its last publish failed; retried after a backoff.
    Failed,
    /// Out of attempts; it and the later versions of its aggregate wait for `dead replay`.
    Dead,
    /// In the stream.
    Sent,
}

impl Status {
    /// Every status, in life order.
    pub const ALL: [Self; 4] = [Self::Pending, Self::Failed, Self::Dead, Self::Sent];

    /// The word the table stores.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Failed => "failed",
            Self::Dead => "dead",
            Self::Sent => "sent",
        }
    }

    /// Not in the stream yet (dead rows included).
    pub fn is_unsent(self) -> bool {
        self != Self::Sent
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Status {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|status| status.as_str() == text)
            .ok_or_else(|| {
                format!("{text:?} is not an outbox status (pending, failed, dead, sent)")
            })
    }
}

/// How the stream disagrees with the store about one outbox row (the relay's fence finds it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DivergenceKind {
    /// The stream holds this aggregate version as another event: the store was restored behind its
    /// stream and wrote a new version, or someone published a forged event.
    OtherEvent,
    /// Later versions are in the stream but this one is not (lost, deleted, or aged out).
    Missing,
    /// A message on the aggregate's subject that is not one of its events (garbage, another
    /// aggregate's message).
    Foreign,
    /// The subject kept changing while the relay read it.
    Unsettled,
}

impl DivergenceKind {
    /// The name used in metrics, logs and JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::OtherEvent => "other_event",
            Self::Missing => "missing",
            Self::Foreign => "foreign",
            Self::Unsettled => "unsettled",
        }
    }
}

/// A disagreement between the store and the stream, as kept on the row (the `divergence` column,
/// JSON: `{kind, stream_sequence, stream_msg_id, detail}`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Divergence {
    /// What kind.
    pub kind: DivergenceKind,
    /// The stream message the relay found in the row's place, if any.
    pub stream_sequence: Option<u64>,
    /// That message's `Nats-Msg-Id` (for an event: its event id), if any.
    pub stream_msg_id: Option<String>,
    /// A sentence for the operator.
    pub detail: String,
}

impl fmt::Display for Divergence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind.as_str(), self.detail)
    }
}

/// Inserts the events of every part and, in the same statement, their outbox rows. Returns the
/// aggregate of every event written: a part is written whole, or not at all when its aggregate is not
/// at its expected version. The parts must be of different aggregates (one unique-key violation fails
/// them all).
///
/// The events are written here, not in `append`, because the statement is one: the event and its
/// row commit together or not at all (DESIGN.md, "One write").
pub(crate) async fn insert_events(
    db: impl sqlx::PgExecutor<'_>,
    parts: &[Part<'_>],
) -> sqlx::Result<Vec<Uuid>> {
    // One statement, one round trip, however many aggregates: PostgreSQL's fixed cost per statement
    // and commit is several times the cost of a row (DESIGN.md, platform facts), so group commit puts
    // many commands' events in one. A data-modifying CTE writes the events and their outbox rows (with
    // the message body the relay will publish). The guard refuses a part whose expected version does
    // not exist yet (which would leave a gap); the unique (aggregate_id, aggregate_version) refuses
    // one that is already taken.
    let rows = || {
        parts
            .iter()
            .flat_map(|p| p.events.iter().map(move |e| (p, e)))
    };
    sqlx::query_scalar(
        "WITH input AS (
            SELECT * FROM UNNEST($1::uuid[], $2::text[], $3::int4[], $4::text[], $5::uuid[],
                                 $6::int8[], $7::timestamptz[], $8::uuid[], $9::uuid[], $10::jsonb[],
                                 $11::text[], $12::int8[], $13::text[])
                AS t(event_id, event_type, event_version, aggregate_type, aggregate_id,
                     aggregate_version, occurred_at, correlation_id, causation_id, payload, body,
                     expected_version, traceparent)
            WHERE t.expected_version = 0
               OR EXISTS (SELECT 1 FROM events e
                          WHERE e.aggregate_id = t.aggregate_id
                            AND e.aggregate_version = t.expected_version)
        ),
        new_events AS (
            INSERT INTO events (event_id, event_type, event_version, aggregate_type, aggregate_id,
                                aggregate_version, occurred_at, correlation_id, causation_id, payload)
            SELECT event_id, event_type, event_version, aggregate_type, aggregate_id,
                   aggregate_version, occurred_at, correlation_id, causation_id, payload
            FROM input
            RETURNING event_id, aggregate_id
        ),
        new_outbox AS (
            INSERT INTO outbox (event_id, event_type, event_version, aggregate_type, aggregate_id,
                                aggregate_version, body, traceparent)
            SELECT i.event_id, i.event_type, i.event_version, i.aggregate_type, i.aggregate_id,
                   i.aggregate_version, i.body, i.traceparent
            FROM input i JOIN new_events USING (event_id)
        )
        -- Read back from `events`, not `outbox`: the command side may insert outbox rows but not
        -- read them (least privilege, `waybill roles`). Every event written has its outbox row:
        -- the CTE above runs to completion, and the statement fails whole if it cannot.
        SELECT aggregate_id FROM new_events",
    )
    .bind(rows().map(|(_, e)| e.event_id).collect::<Vec<_>>())
    .bind(rows().map(|(_, e)| e.event_type.as_str()).collect::<Vec<_>>())
    .bind(rows().map(|(_, e)| e.event_version).collect::<Vec<_>>())
    .bind(rows().map(|(_, e)| e.aggregate_type.as_str()).collect::<Vec<_>>())
    .bind(rows().map(|(_, e)| e.aggregate_id).collect::<Vec<_>>())
    .bind(rows().map(|(_, e)| e.aggregate_version).collect::<Vec<_>>())
    .bind(rows().map(|(_, e)| e.occurred_at).collect::<Vec<_>>())
    .bind(rows().map(|(_, e)| e.correlation_id).collect::<Vec<_>>())
    .bind(rows().map(|(_, e)| e.causation_id).collect::<Vec<_>>())
    .bind(rows().map(|(_, e)| &e.payload).collect::<Vec<_>>())
    .bind(rows().map(|(_, e)| e.to_json_string()).collect::<Vec<_>>())
    .bind(rows().map(|(p, _)| p.expected_version).collect::<Vec<_>>())
    .bind(rows().map(|(p, _)| p.traceparent).collect::<Vec<_>>())
    .fetch_all(db)
    .await
}

/// The columns a dead row's replay sets ([`admin::replay_dead`]): all the console may change.
const REPLAY_COLUMNS: &str = "status, attempts, next_run_at, dead_at, dead_reason";

/// The roles' privileges on the outbox tables, for `waybill roles create` ([`crate::roles`]): first
/// every earlier grant taken back (a table-level revoke takes the column grants with it), then exactly
/// what each role needs. The command side only inserts rows (it never reads them back); the relay reads,
/// settles and purges rows and keeps its journal; the console reads both and may change only what a
/// replay changes; projections get nothing.
pub(crate) fn privileges() -> [String; 6] {
    [
        "REVOKE ALL ON outbox, outbox_inflight FROM waybill_app, waybill_relay, waybill_projection, waybill_console".to_owned(),
        "GRANT INSERT ON outbox TO waybill_app".to_owned(),
        "GRANT SELECT, UPDATE, DELETE ON outbox TO waybill_relay".to_owned(),
        "GRANT SELECT, INSERT, UPDATE, DELETE ON outbox_inflight TO waybill_relay".to_owned(),
        "GRANT SELECT ON outbox, outbox_inflight TO waybill_console".to_owned(),
        format!("GRANT UPDATE ({REPLAY_COLUMNS}) ON outbox TO waybill_console"),
    ]
}

/// What the lab (the load bench, the chaos harness) and the test kit do to the outbox beyond what the
/// system does: seeding rows in bulk, clearing them, reading bodies to model hostile messages on,
/// forgetting rows as a restore from an old backup would. Never called by a running service.
pub mod fixtures {
    use std::collections::BTreeMap;

    use sqlx::{PgConnection, PgPool};
    use uuid::Uuid;

    use super::Status;

    /// Empties both outbox tables (the bench's empty-table runs; `events` keeps its rows).
    pub async fn truncate(pool: &PgPool) -> sqlx::Result<()> {
        sqlx::query("TRUNCATE outbox, outbox_inflight")
            .execute(pool)
            .await
            .map(drop)
    }

    /// Vacuums and analyzes the outbox, as autovacuum would between bursts.
    pub async fn vacuum_analyze(pool: &PgPool) -> sqlx::Result<()> {
        sqlx::query("VACUUM ANALYZE outbox")
            .execute(pool)
            .await
            .map(drop)
    }

    /// Refreshes the outbox's planner statistics (an empty table's would mislead the claim).
    pub async fn analyze(pool: &PgPool) -> sqlx::Result<()> {
        sqlx::query("ANALYZE outbox").execute(pool).await.map(drop)
    }

    /// Rows seeded as history: sent, with no stream sequence (rows a relay sent always have one).
    pub async fn history_rows(pool: &PgPool) -> sqlx::Result<i64> {
        sqlx::query_scalar(
            "SELECT count(*) FROM outbox WHERE status = 'sent' AND stream_seq IS NULL",
        )
        .fetch_one(pool)
        .await
    }

    /// Deletes every row but the seeded history, and the whole journal.
    pub async fn clear_all_but_history(pool: &PgPool) -> sqlx::Result<()> {
        sqlx::query("DELETE FROM outbox WHERE status <> 'sent' OR stream_seq IS NOT NULL")
            .execute(pool)
            .await?;
        sqlx::query("DELETE FROM outbox_inflight")
            .execute(pool)
            .await
            .map(drop)
    }

    /// Rows a relay marked sent (they have a stream sequence), and the seconds from the first of their
    /// claims to the last of their marks (`None` when there is none).
    pub async fn relayed(pool: &PgPool) -> sqlx::Result<(i64, Option<f64>)> {
        sqlx::query_as(
            "SELECT count(*), extract(epoch FROM max(sent_at) - min(claimed_at))::float8
             FROM outbox WHERE stream_seq IS NOT NULL",
        )
        .fetch_one(pool)
        .await
    }

    /// The insert of seeded rows for the events of a CTE named `ev` (`status` bound as `$3`); the
    /// caller writes the CTE (it fills `events` too) and the body expression (`body`).
    pub fn seed_insert(body: &str) -> String {
        format!(
            "INSERT INTO outbox (event_id, event_type, event_version, aggregate_id, aggregate_version,
                                 body, status, sent_at)
             SELECT event_id, event_type, event_version, aggregate_id, aggregate_version, {body}, $3,
                    CASE WHEN $3 = 'sent' THEN now() END
             FROM ev ORDER BY position"
        )
    }

    /// Writes an outbox row for an event a plain transaction just inserted (the bench's baseline of
    /// a write with no domain logic).
    pub async fn insert_plain(
        tx: &mut PgConnection,
        event_id: Uuid,
        event_type: &str,
        event_version: i32,
        aggregate_id: Uuid,
        aggregate_version: i64,
        body: &str,
    ) -> sqlx::Result<()> {
        sqlx::query(
            "INSERT INTO outbox (event_id, event_type, event_version, aggregate_id, aggregate_version, body)
             VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(event_id)
        .bind(event_type)
        .bind(event_version)
        .bind(aggregate_id)
        .bind(aggregate_version)
        .bind(body)
        .execute(tx)
        .await
        .map(drop)
    }

    /// Rows sent, and the time of the last mark (epoch seconds; `None` when none is sent).
    pub async fn sent_so_far(pool: &PgPool) -> sqlx::Result<(i64, Option<f64>)> {
        sqlx::query_as(
            "SELECT count(*), extract(epoch FROM max(sent_at))::float8 FROM outbox
             WHERE status = 'sent'",
        )
        .fetch_one(pool)
        .await
    }

    /// The median and 99th percentile, in milliseconds, from each sent row's transaction start
    /// (`created_at`) to its mark.
    pub async fn sent_ms_p50_p99(pool: &PgPool) -> sqlx::Result<(Option<f64>, Option<f64>)> {
        sqlx::query_as(
            "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY ms),
                    percentile_cont(0.99) WITHIN GROUP (ORDER BY ms)
             FROM (SELECT extract(epoch FROM sent_at - created_at) * 1000 AS ms FROM outbox
                   WHERE status = 'sent') s",
        )
        .fetch_one(pool)
        .await
    }

    /// Each row's event id and transaction start (`created_at`, epoch microseconds): what the bench
    /// compares with the time the stream stored the event.
    pub async fn created_at_by_event(pool: &PgPool) -> sqlx::Result<Vec<(Uuid, i64)>> {
        sqlx::query_as(
            "SELECT event_id, (extract(epoch FROM created_at) * 1000000)::int8 FROM outbox",
        )
        .fetch_all(pool)
        .await
    }

    /// Percentiles (0–1) of the time, in milliseconds, from an event's commit to its row's mark, over
    /// the events after log position `since` whose rows are sent.
    pub async fn relayed_ms_percentiles(
        pool: &PgPool,
        since: i64,
        percentiles: &[f64],
    ) -> sqlx::Result<Vec<f64>> {
        let values: Option<Vec<f64>> = sqlx::query_scalar(
            "SELECT percentile_cont($2::float8[]) WITHIN GROUP (
                        ORDER BY (extract(epoch FROM o.sent_at - e.recorded_at) * 1000)::float8)
             FROM events e LEFT JOIN outbox o ON o.event_id = e.event_id
             WHERE e.position > $1",
        )
        .bind(since)
        .bind(percentiles)
        .fetch_one(pool)
        .await?;
        Ok(values.unwrap_or_default())
    }

    /// The body of the newest row of `event_type`, if any.
    pub async fn newest_body(pool: &PgPool, event_type: &str) -> sqlx::Result<Option<String>> {
        sqlx::query_scalar("SELECT body FROM outbox WHERE event_type = $1 ORDER BY id DESC LIMIT 1")
            .bind(event_type)
            .fetch_optional(pool)
            .await
    }

    /// The first event's body of the newest aggregate whose last event (one of `last_types`) was sent
    /// more than `older_than_seconds` ago: a real message, old enough to have left the dedupe window.
    pub async fn first_body_of_finished(
        pool: &PgPool,
        last_types: &[&str],
        older_than_seconds: f64,
    ) -> sqlx::Result<Option<String>> {
        sqlx::query_scalar(
            "SELECT first.body FROM outbox last
             JOIN outbox first ON first.aggregate_id = last.aggregate_id AND first.aggregate_version = 1
             WHERE last.status = 'sent' AND last.sent_at < now() - $2 * interval '1 second'
               AND last.event_type = ANY($1)
             ORDER BY last.id DESC LIMIT 1",
        )
        .bind(last_types)
        .bind(older_than_seconds)
        .fetch_optional(pool)
        .await
    }

    /// Deletes the aggregate's rows after version `keep` (with their events, a restore from an older
    /// backup; the caller deletes those in the same transaction).
    pub async fn forget_after(
        tx: &mut PgConnection,
        aggregate: Uuid,
        keep: i64,
    ) -> sqlx::Result<u64> {
        Ok(
            sqlx::query("DELETE FROM outbox WHERE aggregate_id = $1 AND aggregate_version > $2")
                .bind(aggregate)
                .bind(keep)
                .execute(tx)
                .await?
                .rows_affected(),
        )
    }

    /// Rows by status, every status the table holds.
    pub async fn counts_by_status(pool: &PgPool) -> sqlx::Result<BTreeMap<Status, i64>> {
        let rows: Vec<(Status, i64)> =
            sqlx::query_as("SELECT status, count(*) FROM outbox GROUP BY status")
                .fetch_all(pool)
                .await?;
        Ok(rows.into_iter().collect())
    }
}

/// One aggregate's checked run of events, with what the statement writes beside them.
pub(crate) struct Part<'a> {
    /// The version the run continues from; 0 for a new aggregate.
    pub expected_version: i64,
    pub events: &'a [EventEnvelope],
    pub traceparent: Option<&'a str>,
}

impl<'a> Part<'a> {
    pub(crate) fn new(
        expected_version: i64,
        events: &'a [EventEnvelope],
        traceparent: Option<&'a str>,
    ) -> Self {
        Self {
            expected_version,
            events,
            traceparent,
        }
    }
}
