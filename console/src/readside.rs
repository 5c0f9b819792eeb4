//! What the console reads from the projections' schemas (every projection of
//! `projections::registry`: `inventory`, `points`, `search` and the read models of
//! `projections/src/models/`): their checkpoints, held and parked tables, by schema-qualified SQL —
//! their documented tables (DESIGN.md, "Storage contract") and nothing else; of the projections crate
//! the console uses the registry alone (and a read model's own reading of its document,
//! `crate::models`). A projection may keep its schema in another database; then its schema is absent
//! here and the console says so instead of failing.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{AssertSqlSafe, PgPool, Row};
use uuid::Uuid;

/// The projections, by schema (= consumer) name: the built-in ones, then every read model of the
/// registry, so a model file added to `projections/src/models/` is listed with no edit here.
pub(crate) fn names() -> &'static [&'static str] {
    &projections::registry::NAMES
}

/// One of [`names`], or `None`: only these names are ever spliced into SQL.
pub(crate) fn known(name: &str) -> Option<&'static str> {
    names().iter().copied().find(|p| *p == name)
}

/// A projection's state as its tables tell it. The counts are `None` when the schema is absent or
/// could not be read, so a failed read shows as unknown rather than as an idle projection.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct ProjectionState {
    pub name: &'static str,
    /// Whether its schema exists in this database.
    pub found: bool,
    /// Why it could not be read, when it could not.
    pub error: Option<String>,
    /// Orders it has a checkpoint for.
    pub orders: Option<i64>,
    /// Events applied: the sum of the checkpoints' versions (an operator's `held release` that
    /// skipped a missing version counts it too).
    pub applied: Option<i64>,
    /// When a checkpoint last moved.
    pub last_applied_at: Option<DateTime<Utc>>,
    /// Events waiting for a predecessor.
    pub held: Option<i64>,
    /// Orders with held events.
    pub held_orders: Option<i64>,
    /// Parked messages neither redriven nor discarded.
    pub parked: Option<i64>,
}

impl ProjectionState {
    fn empty(name: &'static str) -> Self {
        Self {
            name,
            found: false,
            error: None,
            orders: None,
            applied: None,
            last_applied_at: None,
            held: None,
            held_orders: None,
            parked: None,
        }
    }
}

/// Whether `schema` (one of [`names`]) exists with its checkpoints table.
async fn exists(pool: &PgPool, schema: &'static str) -> sqlx::Result<bool> {
    sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
        .bind(format!("\"{schema}\".checkpoints"))
        .fetch_one(pool)
        .await
}

/// Reads one projection's state; never fails (the error is part of the state).
pub(crate) async fn state(pool: &PgPool, name: &'static str) -> ProjectionState {
    let mut state = ProjectionState::empty(name);
    match read_state(pool, name, &mut state).await {
        Ok(()) => {}
        Err(error) => {
            tracing::warn!(projection = name, %error, "console cannot read a projection's tables");
            state.error = Some(error.to_string());
        }
    }
    state
}

async fn read_state(
    pool: &PgPool,
    name: &'static str,
    state: &mut ProjectionState,
) -> sqlx::Result<()> {
    if !exists(pool, name).await? {
        return Ok(());
    }
    state.found = true;
    // Read whole before anything is stored: a row that fails half-way leaves every count unknown.
    let row = sqlx::query(AssertSqlSafe(format!(
        "SELECT (SELECT count(*) FROM \"{name}\".checkpoints) AS orders,
                (SELECT coalesce(sum(version), 0)::int8 FROM \"{name}\".checkpoints) AS applied,
                (SELECT max(updated_at) FROM \"{name}\".checkpoints) AS last_applied_at,
                (SELECT count(*) FROM \"{name}\".held) AS held,
                (SELECT count(DISTINCT aggregate_id) FROM \"{name}\".held) AS held_orders,
                (SELECT count(*) FROM \"{name}\".parked
                  WHERE redriven_at IS NULL AND discarded_at IS NULL) AS parked"
    )))
    .fetch_one(pool)
    .await?;
    let orders = row.try_get("orders")?;
    let applied = row.try_get("applied")?;
    let last_applied_at = row.try_get("last_applied_at")?;
    let held = row.try_get("held")?;
    let held_orders = row.try_get("held_orders")?;
    let parked = row.try_get("parked")?;
    state.orders = Some(orders);
    state.applied = Some(applied);
    state.last_applied_at = last_applied_at;
    state.held = Some(held);
    state.held_orders = Some(held_orders);
    state.parked = Some(parked);
    Ok(())
}

/// What one projection knows of one order.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct OrderMarks {
    pub name: &'static str,
    /// Whether its schema exists in this database.
    pub found: bool,
    /// Why it could not be read.
    pub error: Option<String>,
    /// The order's checkpoint: every version up to it is applied (None: nothing applied yet).
    pub checkpoint: Option<i64>,
    /// Versions held, waiting for a predecessor.
    pub held: Vec<i64>,
    /// Open parked messages of this order: (parked id, version if known, reason).
    pub parked: Vec<(i64, Option<i64>, String)>,
    /// Parked messages an operator discarded: (parked id, version if known, who, why).
    pub discarded: Vec<(i64, Option<i64>, String, String)>,
    /// Versions an operator's `held release` skipped: (first, last, who, why); first > last when
    /// the release skipped nothing.
    pub skipped: Vec<(i64, i64, String, String)>,
}

impl OrderMarks {
    /// What this projection says of `version`: applied, held, parked or not (yet) applied.
    pub(crate) fn verdict(&self, version: i64) -> (&'static str, String) {
        if !self.found {
            return ("not found", "its schema is not in this database".to_owned());
        }
        if let Some(error) = &self.error {
            return ("unknown", error.clone());
        }
        // Before "applied": a skipped version is below the checkpoint but was never applied.
        if let Some((_, _, by, why)) = self
            .skipped
            .iter()
            .find(|(first, last, _, _)| (*first..=*last).contains(&version))
        {
            return (
                "skipped",
                format!("never applied: skipped by {by}'s held release ({why})"),
            );
        }
        if self.checkpoint.is_some_and(|c| version <= c) {
            return ("applied", "applied (at or below its checkpoint)".to_owned());
        }
        if let Some((id, _, reason)) = self.parked.iter().find(|p| p.1 == Some(version)) {
            return ("parked", format!("parked as #{id}: {reason}"));
        }
        if self.held.contains(&version) {
            return ("held", "held, waiting for an earlier version".to_owned());
        }
        if let Some((id, _, by, why)) = self.discarded.iter().find(|d| d.1 == Some(version)) {
            return (
                "discarded",
                format!(
                    "parked as #{id}, discarded by {by} ({why}); later versions wait until a held \
                     release skips it"
                ),
            );
        }
        ("pending", "not applied yet".to_owned())
    }
}

/// Reads what `name` knows of `order`; never fails.
pub(crate) async fn order_marks(pool: &PgPool, name: &'static str, order: Uuid) -> OrderMarks {
    let mut marks = OrderMarks {
        name,
        found: false,
        error: None,
        checkpoint: None,
        held: Vec::new(),
        parked: Vec::new(),
        discarded: Vec::new(),
        skipped: Vec::new(),
    };
    if let Err(error) = read_marks(pool, name, order, &mut marks).await {
        marks.error = Some(error.to_string());
    }
    marks
}

/// A parked message of one order, open or discarded.
#[derive(sqlx::FromRow)]
struct OrderParkedRow {
    id: i64,
    aggregate_version: Option<i64>,
    reason: String,
    discarded_by: Option<String>,
    discard_reason: Option<String>,
    discarded: bool,
}

async fn read_marks(
    pool: &PgPool,
    name: &'static str,
    order: Uuid,
    marks: &mut OrderMarks,
) -> sqlx::Result<()> {
    if !exists(pool, name).await? {
        return Ok(());
    }
    marks.found = true;
    marks.checkpoint = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT version FROM \"{name}\".checkpoints WHERE aggregate_id = $1"
    )))
    .bind(order)
    .fetch_optional(pool)
    .await?;
    marks.held = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT version FROM \"{name}\".held WHERE aggregate_id = $1 ORDER BY version"
    )))
    .bind(order)
    .fetch_all(pool)
    .await?;
    // Open and discarded parked messages in one read, told apart here.
    let parked: Vec<OrderParkedRow> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT id, aggregate_version, reason, discarded_by, discard_reason,
                discarded_at IS NOT NULL AS discarded
         FROM \"{name}\".parked WHERE aggregate_id = $1 AND redriven_at IS NULL ORDER BY id"
    )))
    .bind(order)
    .fetch_all(pool)
    .await?;
    for row in parked {
        if row.discarded {
            marks.discarded.push((
                row.id,
                row.aggregate_version,
                row.discarded_by.unwrap_or_default(),
                row.discard_reason.unwrap_or_default(),
            ));
        } else {
            marks
                .parked
                .push((row.id, row.aggregate_version, row.reason));
        }
    }
    // The release records the versions it skipped in its detail: [first, last].
    marks.skipped = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT (detail->'skipped_versions'->>0)::int8, (detail->'skipped_versions'->>1)::int8,
                actor, reason
         FROM \"{name}\".operator_log
         WHERE action = 'held release' AND target = $1
           AND jsonb_typeof(detail->'skipped_versions'->0) = 'number'
           AND jsonb_typeof(detail->'skipped_versions'->1) = 'number'
         ORDER BY id"
    )))
    .bind(order.to_string())
    .fetch_all(pool)
    .await?;
    Ok(())
}

/// An open parked message, as the list shows it.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub(crate) struct ParkedRow {
    /// Its id in the parked table.
    pub id: i64,
    /// Where it sat in the stream.
    pub stream_sequence: Option<i64>,
    pub subject: String,
    /// Why it was parked.
    pub reason: String,
    /// The event, the order and the version it claims: `None` when the body could not be decoded
    /// far enough to tell.
    pub event_id: Option<Uuid>,
    pub aggregate_id: Option<Uuid>,
    pub aggregate_version: Option<i64>,
    pub parked_at: DateTime<Utc>,
    /// Size of the whole body.
    pub body_size: i64,
    /// The first 2 KiB of the body (the parked table keeps up to 64 KiB).
    pub body: Vec<u8>,
}

/// Open parked messages of `name`, newest first; `Ok(None)` when its schema is absent.
pub(crate) async fn parked(
    pool: &PgPool,
    name: &'static str,
    limit: i64,
) -> sqlx::Result<Option<Vec<ParkedRow>>> {
    if !exists(pool, name).await? {
        return Ok(None);
    }
    sqlx::query_as(AssertSqlSafe(format!(
        "SELECT id, stream_sequence, subject, reason, event_id, aggregate_id, aggregate_version,
                parked_at, body_size, substring(body FROM 1 FOR 2048) AS body
         FROM \"{name}\".parked
         WHERE redriven_at IS NULL AND discarded_at IS NULL
         ORDER BY id DESC LIMIT $1"
    )))
    .bind(limit)
    .fetch_all(pool)
    .await
    .map(Some)
}

/// A held event, with what it waits for.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub(crate) struct HeldRow {
    pub aggregate_id: Uuid,
    /// The held version (above the checkpoint + 1, else it would have been applied).
    pub version: i64,
    pub event_id: Uuid,
    pub held_at: DateTime<Utc>,
    /// The version the order's checkpoint waits for.
    pub waiting_for: i64,
    /// An open parked message at that version, if that is what holds it back.
    pub behind_parked: Option<i64>,
}

/// Held events of `name` by order and version; `Ok(None)` when its schema is absent.
pub(crate) async fn held(
    pool: &PgPool,
    name: &'static str,
    limit: i64,
) -> sqlx::Result<Option<Vec<HeldRow>>> {
    if !exists(pool, name).await? {
        return Ok(None);
    }
    sqlx::query_as(AssertSqlSafe(format!(
        "SELECT h.aggregate_id, h.version, h.event_id, h.held_at,
                coalesce(c.version, 0) + 1 AS waiting_for,
                (SELECT p.id FROM \"{name}\".parked p
                  WHERE p.aggregate_id = h.aggregate_id AND p.aggregate_version = coalesce(c.version, 0) + 1
                    AND p.redriven_at IS NULL AND p.discarded_at IS NULL
                  ORDER BY p.id LIMIT 1) AS behind_parked
         FROM \"{name}\".held h
         LEFT JOIN \"{name}\".checkpoints c ON c.aggregate_id = h.aggregate_id
         ORDER BY h.aggregate_id, h.version LIMIT $1"
    )))
    .bind(limit)
    .fetch_all(pool)
    .await
    .map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skipped_and_discarded_versions_are_not_called_applied_or_pending() {
        let marks = OrderMarks {
            name: "inventory",
            found: true,
            error: None,
            checkpoint: Some(3),
            held: vec![6],
            parked: vec![(7, Some(5), "bad total".into())],
            discarded: vec![
                (4, Some(2), "ana".into(), "forged".into()),
                (8, Some(4), "ana".into(), "forged too".into()),
            ],
            skipped: vec![(2, 2, "ana".into(), "payment was forged".into())],
        };
        let states: Vec<&str> = (1..=7).map(|v| marks.verdict(v).0).collect();
        assert_eq!(
            states,
            [
                "applied",
                "skipped",
                "applied",
                "discarded",
                "parked",
                "held",
                "pending"
            ]
        );
        assert!(marks.verdict(2).1.contains("ana's held release"));
        let unread = OrderMarks {
            found: false,
            ..marks
        };
        assert_eq!(unread.verdict(1).0, "not found");
    }
}
