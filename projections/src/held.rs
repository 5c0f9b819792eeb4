//! The held table: events that arrived before their predecessor, put there and taken out again by
//! the runner's transaction; and seen from outside — which events wait, since when and for what (a
//! version that never came, or one that is parked), how many and how old. The operator's way out,
//! `held release`, is an operator action (`actions.rs`).

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use crate::decode::{Decoded, Poison, RawMessage};
use crate::park::{self, ParkRecord};

/// Why reading the held table failed.
#[derive(Debug, thiserror::Error)]
pub enum HeldError {
    #[error("listing held events")]
    List(#[source] sqlx::Error),
    #[error("measuring the held table")]
    Stats(#[source] sqlx::Error),
}

/// A held row taken out of the held table to be applied (or found stale).
#[derive(Debug, sqlx::FromRow)]
pub(crate) struct HeldRow {
    pub(crate) aggregate_id: Uuid,
    pub(crate) version: i64,
    pub(crate) event_id: Uuid,
    pub(crate) stream_sequence: Option<i64>,
    pub(crate) subject: String,
    pub(crate) headers: Vec<u8>,
    pub(crate) body: Vec<u8>,
}

impl HeldRow {
    /// The message as it was delivered.
    pub(crate) fn message(&self) -> RawMessage {
        RawMessage {
            stream_sequence: u64::try_from(self.stream_sequence.unwrap_or(0)).unwrap_or(0),
            subject: self.subject.clone(),
            headers: serde_json::from_slice(&self.headers)
                .ok()
                .and_then(|v| RawMessage::headers_from_json(&v)),
            body: bytes::Bytes::from(self.body.clone()),
        }
    }

    /// The row to park, refused for `reason`.
    pub(crate) fn refused(&self, reason: &str) -> ParkRecord {
        ParkRecord::new(
            &self.message(),
            Poison {
                reason: reason.to_owned(),
                event_id: Some(self.event_id),
                aggregate_id: Some(self.aggregate_id),
                aggregate_version: Some(self.version),
            },
        )
    }
}

/// Takes out of the held table every row of each `(aggregate, up to version)` in `wanted`: the one
/// now due and the stale ones below it.
pub(crate) async fn take(
    tx: &mut PgConnection,
    wanted: &[(Uuid, i64)],
) -> sqlx::Result<Vec<HeldRow>> {
    sqlx::query_as(
        "DELETE FROM held h USING UNNEST($1::uuid[], $2::int8[]) AS w(aggregate_id, upto)
         WHERE h.aggregate_id = w.aggregate_id AND h.version <= w.upto
         RETURNING h.aggregate_id, h.version, h.event_id, h.stream_sequence, h.subject, h.headers, h.body",
    )
    .bind(wanted.iter().map(|(id, _)| *id).collect::<Vec<_>>())
    .bind(wanted.iter().map(|(_, v)| *v).collect::<Vec<_>>())
    .fetch_all(&mut *tx)
    .await
}

/// Puts messages that wait for their predecessor in the held table; a version already held stays as
/// it is.
pub(crate) async fn hold(
    tx: &mut PgConnection,
    messages: &[(&RawMessage, &Decoded)],
) -> sqlx::Result<()> {
    if messages.is_empty() {
        return Ok(());
    }
    sqlx::query(
        "INSERT INTO held (aggregate_id, version, event_id, stream_sequence, subject, headers, body)
         SELECT * FROM UNNEST($1::uuid[], $2::int8[], $3::uuid[], $4::int8[], $5::text[], $6::bytea[], $7::bytea[])
         ON CONFLICT (aggregate_id, version) DO NOTHING",
    )
    .bind(messages.iter().map(|(_, d)| d.aggregate_id).collect::<Vec<_>>())
    .bind(messages.iter().map(|(_, d)| d.aggregate_version).collect::<Vec<_>>())
    .bind(messages.iter().map(|(_, d)| d.event_id).collect::<Vec<_>>())
    .bind(messages.iter().map(|(m, _)| park::sequence(m)).collect::<Vec<_>>())
    .bind(messages.iter().map(|(m, _)| park::storable(&m.subject)).collect::<Vec<_>>())
    .bind(messages.iter().map(|(m, _)| park::headers_bytes(m)).collect::<Vec<_>>())
    .bind(messages.iter().map(|(m, _)| m.body.to_vec()).collect::<Vec<_>>())
    .execute(&mut *tx)
    .await?;
    Ok(())
}

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
) -> Result<Vec<Held>, HeldError> {
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
    .map_err(HeldError::List)?;
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
pub async fn stats(pool: &PgPool) -> Result<HeldStats, HeldError> {
    sqlx::query_as(
        "SELECT count(*) AS count, count(DISTINCT aggregate_id) AS aggregates,
                coalesce(extract(epoch FROM now() - min(held_at))::float8, 0) AS oldest_seconds
         FROM held",
    )
    .fetch_one(pool)
    .await
    .map_err(HeldError::Stats)
}
