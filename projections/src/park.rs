//! Parking: poison is stored with its reason, and whatever is stored is storable — a hostile message
//! must never fail the transaction that parks it, or it would stop the projection. And the table seen
//! from outside: listed and counted. Discard and redrive are operator actions (`actions.rs`).

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use crate::decode::{Decoded, Poison, RawMessage};

/// Bodies are kept up to this size; beyond it, the first this-many bytes with the size and SHA-256
/// (a 900 KB body parked whole by three projections was 2.7 MB of nothing useful).
pub const BODY_KEPT: i64 = 64 * 1024;

/// Parking a message failed: the transaction that tried fails with it, and the broker redelivers.
#[derive(Debug, thiserror::Error)]
#[error("parking a message")]
pub struct ParkError(#[from] sqlx::Error);

/// Why an operator's look at the parked messages failed.
#[derive(Debug, thiserror::Error)]
pub enum ParkedError {
    #[error("listing parked messages")]
    List(#[source] sqlx::Error),
    #[error("counting parked messages")]
    Count(#[source] sqlx::Error),
}

/// A message about to be parked.
#[derive(Debug, Clone)]
pub(crate) struct ParkRecord {
    stream_sequence: Option<i64>,
    subject: String,
    headers: Vec<u8>,
    body: Vec<u8>,
    poison: Poison,
}

impl ParkRecord {
    pub(crate) fn new(message: &RawMessage, poison: Poison) -> Self {
        Self {
            stream_sequence: sequence(message),
            subject: storable(&message.subject),
            headers: headers_bytes(message),
            body: message.body.to_vec(),
            poison,
        }
    }
}

/// A decodable message the plan refused for `reason` (it contradicts its order).
pub(crate) fn refused(message: &RawMessage, decoded: Option<&Decoded>, reason: &str) -> ParkRecord {
    ParkRecord::new(
        message,
        Poison {
            reason: reason.to_owned(),
            event_id: decoded.map(|d| d.event_id),
            aggregate_id: decoded.map(|d| d.aggregate_id),
            aggregate_version: decoded.map(|d| d.aggregate_version),
        },
    )
}

/// The stream sequence as stored: `None` for a message that has none (0: not from the stream).
pub(crate) fn sequence(message: &RawMessage) -> Option<i64> {
    i64::try_from(message.stream_sequence)
        .ok()
        .filter(|s| *s > 0)
}

/// Text PostgreSQL can store: NUL (which `text` refuses) is written as the six characters `\u0000`.
pub(crate) fn storable(text: &str) -> String {
    if text.contains('\0') {
        text.replace('\0', "\\u0000")
    } else {
        text.to_owned()
    }
}

/// The headers as JSON bytes, exact whatever they hold (see [`RawMessage::headers_json`]).
pub(crate) fn headers_bytes(message: &RawMessage) -> Vec<u8> {
    serde_json::to_vec(&message.headers_json()).expect("a JSON object of strings always serializes")
}

/// Parks one message. The body is cut to [`BODY_KEPT`] bytes by PostgreSQL, which also measures and
/// hashes the whole body.
pub(crate) async fn park(conn: &mut PgConnection, record: &ParkRecord) -> Result<(), ParkError> {
    tracing::warn!(
        stream_sequence = record.stream_sequence,
        subject = %record.subject,
        event_id = ?record.poison.event_id,
        aggregate_id = ?record.poison.aggregate_id,
        aggregate_version = record.poison.aggregate_version,
        reason = %storable(&record.poison.reason),
        "parking a message that cannot be applied"
    );
    sqlx::query(
        "INSERT INTO parked (stream_sequence, subject, headers, body, body_size, body_sha256, reason,
                             event_id, aggregate_id, aggregate_version)
         VALUES ($1, $2, $3, substring($4 from 1 for $9), octet_length($4), sha256($4), $5, $6, $7, $8)",
    )
    .bind(record.stream_sequence)
    .bind(&record.subject)
    .bind(&record.headers)
    .bind(&record.body)
    .bind(storable(&record.poison.reason))
    .bind(record.poison.event_id)
    .bind(record.poison.aggregate_id)
    .bind(record.poison.aggregate_version)
    .bind(i32::try_from(BODY_KEPT).expect("64 KiB fits"))
    .execute(&mut *conn)
    .await
    .map_err(ParkError)?;
    Ok(())
}

/// One parked message as listed.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct Parked {
    /// Its id in this projection's `parked` table.
    pub id: i64,
    /// Where it was in the stream.
    pub stream_sequence: Option<i64>,
    /// Its subject (NUL written as `\u0000`).
    pub subject: String,
    /// Why it was parked.
    pub reason: String,
    /// The event id, when the body named one.
    pub event_id: Option<Uuid>,
    /// The aggregate, when known.
    pub aggregate_id: Option<Uuid>,
    /// The version, when known.
    pub aggregate_version: Option<i64>,
    /// When.
    pub parked_at: DateTime<Utc>,
    /// When a redrive applied it (or held it).
    pub redriven_at: Option<DateTime<Utc>>,
    /// What the last redrive found.
    pub redrive_note: Option<String>,
    /// When an operator discarded it.
    pub discarded_at: Option<DateTime<Utc>>,
    /// Who discarded it.
    pub discarded_by: Option<String>,
    /// Why.
    pub discard_reason: Option<String>,
    /// The whole body's size in bytes.
    pub body_size: i64,
    /// The whole body's SHA-256, hex.
    pub body_sha256: String,
    /// The kept body (at most 64 KiB), as text where it is UTF-8, else with `\x` escapes.
    pub body: String,
    /// The headers (NUL and all: they are exact JSON, which `jsonb` could not hold).
    #[sqlx(skip)]
    pub headers: Value,
    /// The headers as stored.
    #[serde(skip)]
    #[sqlx(rename = "headers")]
    headers_json: Vec<u8>,
}

/// Parked messages, newest first: open ones (neither redriven nor discarded), or `all`. `before`
/// continues a listing after the last id seen.
pub async fn list(
    pool: &PgPool,
    limit: i64,
    before: Option<i64>,
    all: bool,
) -> Result<Vec<Parked>, ParkedError> {
    sqlx::query_as(
        "SELECT id, stream_sequence, subject, reason, event_id, aggregate_id, aggregate_version, parked_at,
                redriven_at, redrive_note, discarded_at, discarded_by, discard_reason, body_size,
                encode(body_sha256, 'hex') AS body_sha256, encode(body, 'escape') AS body,
                headers
         FROM parked
         WHERE ($2 OR (redriven_at IS NULL AND discarded_at IS NULL)) AND ($3::int8 IS NULL OR id < $3)
         ORDER BY id DESC LIMIT $1",
    )
    .bind(limit.clamp(1, 10_000))
    .bind(all)
    .bind(before)
    .fetch_all(pool)
    .await
    .map_err(ParkedError::List)
    .map(|rows: Vec<Parked>| {
        rows.into_iter()
            .map(|mut p| {
                p.headers = serde_json::from_slice(&p.headers_json).unwrap_or(Value::Null);
                p
            })
            .collect()
    })
}

/// Counts of open parked messages.
pub async fn open_count(pool: &PgPool) -> Result<i64, ParkedError> {
    sqlx::query_scalar(
        "SELECT count(*) FROM parked WHERE redriven_at IS NULL AND discarded_at IS NULL",
    )
    .fetch_one(pool)
    .await
    .map_err(ParkedError::Count)
}
