//! The held table, seen from outside: which events wait, since when and for what (a version that never
//! came, or one that is parked), how many and how old, and the operator's way out — `held release`,
//! which skips the missing versions of one order deliberately and applies what waited behind them.

use anyhow::Context;
use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::{Value, json};
use sqlx::PgPool;
use uuid::Uuid;

use crate::park::record_action;
use crate::projection::Projection;
use crate::runner::{OnPoison, Runner, decide_and_apply};

/// One held event as listed.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct Held {
    /// Its order.
    pub aggregate_id: Uuid,
    /// Its version.
    pub version: i64,
    /// Its event id.
    pub event_id: Uuid,
    /// Since when it waits.
    pub since: DateTime<Utc>,
    /// The version that must be applied first (the order's checkpoint + 1).
    pub waiting_for: i64,
    /// The parked message holding that version, if one is parked.
    pub behind_parked: Option<i64>,
    /// The event id of that parked message.
    pub behind_parked_event: Option<Uuid>,
    /// In words: `waiting for version N` or `behind parked event X (parked id P)`.
    #[sqlx(skip)]
    pub reason: String,
}

/// How much is held and for how long, for the metrics and `run --once`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, sqlx::FromRow)]
pub struct HeldStats {
    /// Held events.
    pub count: i64,
    /// Orders with held events.
    pub aggregates: i64,
    /// Age of the oldest, in seconds (0 when none).
    pub oldest_seconds: f64,
}

/// Held events in (aggregate, version) order, after `after` when continuing a listing.
pub async fn list(
    pool: &PgPool,
    limit: i64,
    after: Option<(Uuid, i64)>,
) -> anyhow::Result<Vec<Held>> {
    let rows: Vec<Held> = sqlx::query_as(
        "SELECT h.aggregate_id, h.version, h.event_id, h.held_at AS since,
                coalesce(c.version, 0) + 1 AS waiting_for,
                p.id AS behind_parked, p.event_id AS behind_parked_event
         FROM held h
         LEFT JOIN checkpoints c ON c.aggregate_id = h.aggregate_id
         LEFT JOIN LATERAL (
             SELECT id, event_id FROM parked
             WHERE aggregate_id = h.aggregate_id AND aggregate_version = coalesce(c.version, 0) + 1
               AND redriven_at IS NULL AND discarded_at IS NULL
             ORDER BY id LIMIT 1
         ) p ON true
         WHERE $2::uuid IS NULL OR (h.aggregate_id, h.version) > ($2, $3)
         ORDER BY h.aggregate_id, h.version LIMIT $1",
    )
    .bind(limit.clamp(1, 10_000))
    .bind(after.map(|(id, _)| id))
    .bind(after.map_or(0, |(_, v)| v))
    .fetch_all(pool)
    .await
    .context("listing held events")?;
    Ok(rows
        .into_iter()
        .map(|mut held| {
            held.reason = match (held.behind_parked, held.behind_parked_event) {
                (Some(id), Some(event)) => {
                    format!("behind parked event {event} (parked id {id})")
                }
                (Some(id), None) => format!("behind parked message {id}"),
                _ => format!("waiting for version {}", held.waiting_for),
            };
            held
        })
        .collect())
}

/// Count, orders and oldest age of the held events.
pub async fn stats(pool: &PgPool) -> anyhow::Result<HeldStats> {
    sqlx::query_as(
        "SELECT count(*) AS count, count(DISTINCT aggregate_id) AS aggregates,
                coalesce(extract(epoch FROM now() - min(held_at))::float8, 0) AS oldest_seconds
         FROM held",
    )
    .fetch_one(pool)
    .await
    .context("measuring the held table")
}

impl<P: Projection> Runner<P> {
    /// Skips the missing versions of `aggregate_id` deliberately: its checkpoint moves to just below
    /// its lowest held version, and every held event that then follows is applied, in one transaction.
    /// Recorded with who, when and why.
    pub async fn release(
        &self,
        aggregate_id: Uuid,
        actor: &str,
        reason: &str,
    ) -> anyhow::Result<Value> {
        if reason.trim().is_empty() {
            return Err(ops::Refused("a release needs a --reason".into()).into());
        }
        let mut tx = self.pool.begin().await?;
        self.lock(&mut tx).await?;
        let lowest: Option<i64> =
            sqlx::query_scalar("SELECT min(version) FROM held WHERE aggregate_id = $1")
                .bind(aggregate_id)
                .fetch_one(&mut *tx)
                .await
                .context("reading held events")?;
        let Some(lowest) = lowest else {
            return Err(ops::Refused(format!("nothing is held for order {aggregate_id}")).into());
        };
        let checkpoint: i64 = sqlx::query_scalar(
            "SELECT coalesce(max(version), 0) FROM checkpoints WHERE aggregate_id = $1",
        )
        .bind(aggregate_id)
        .fetch_one(&mut *tx)
        .await?;
        let skipped_to = (lowest - 1).max(checkpoint);
        decide_and_apply(
            &mut tx,
            &*self.projection,
            &self.upcasters,
            &[],
            Some((aggregate_id, skipped_to)),
            OnPoison::Park,
        )
        .await?;
        let version: i64 =
            sqlx::query_scalar("SELECT version FROM checkpoints WHERE aggregate_id = $1")
                .bind(aggregate_id)
                .fetch_one(&mut *tx)
                .await?;
        let still_held: i64 =
            sqlx::query_scalar("SELECT count(*) FROM held WHERE aggregate_id = $1")
                .bind(aggregate_id)
                .fetch_one(&mut *tx)
                .await?;
        let detail = json!({
            "skipped_versions": [checkpoint + 1, skipped_to],
            "applied_through": version,
            "still_held": still_held,
        });
        record_action(
            &mut tx,
            actor,
            "held release",
            &aggregate_id.to_string(),
            reason,
            &detail,
        )
        .await?;
        tx.commit().await?;
        tracing::info!(projection = P::NAME, %aggregate_id, actor, reason, skipped_from = checkpoint + 1,
                       skipped_to, applied_through = version, still_held, "held order released");
        Ok(json!({
            "aggregate_id": aggregate_id,
            "by": actor,
            "reason": reason,
            "skipped_from": checkpoint + 1,
            "skipped_to": skipped_to,
            "applied_through": version,
            "still_held": still_held,
        }))
    }
}
