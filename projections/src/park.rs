//! Parking: poison is stored with its reason, and whatever is stored is storable — a hostile message
//! must never fail the transaction that parks it, or it would stop the projection. Then the operator's
//! side: list, discard (recorded with who, when and why), and redrive with the reason each message
//! failed again.

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::{Value, json};
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use crate::apply::{ApplyError, OnPoison, decide_and_apply};
use crate::decode::{Decoded, Poison, RawMessage};
use crate::plan::Verdict;
use crate::projection::Projection;
use crate::runner::Runner;

/// Bodies are kept up to this size; beyond it, the first this-many bytes with the size and SHA-256
/// (a 900 KB body parked whole by three projections was 2.7 MB of nothing useful).
pub const BODY_KEPT: i64 = 64 * 1024;

/// Parking a message failed: the transaction that tried fails with it, and the broker redelivers.
#[derive(Debug, thiserror::Error)]
#[error("parking a message")]
pub struct ParkError(#[from] sqlx::Error);

/// Why an operator's look at the parked messages, a discard or a redrive failed.
#[derive(Debug, thiserror::Error)]
pub enum ParkedError {
    #[error("listing parked messages")]
    List(#[source] sqlx::Error),
    #[error("counting parked messages")]
    Count(#[source] sqlx::Error),
    /// The operator's discard was refused; nothing changed (exit code 2).
    #[error("discarding parked message {id}")]
    DiscardRefused {
        /// The parked message.
        id: i64,
        #[source]
        source: ops::Refused,
    },
    /// The discard's update or recording failed.
    #[error("discarding parked message {id}")]
    Discard {
        /// The parked message.
        id: i64,
        #[source]
        source: sqlx::Error,
    },
    #[error("reading parked messages")]
    Read(#[source] sqlx::Error),
    /// The redrive was done but could not be recorded in the operator log.
    #[error("recording the redrive in the operator log")]
    Record(#[source] sqlx::Error),
    /// The redrive's own transaction failed around the message: starting it, taking the
    /// projection's turn, or recording the outcome.
    #[error("redriving parked message {id}")]
    Redrive {
        /// The parked message.
        id: i64,
        #[source]
        source: sqlx::Error,
    },
    /// A redriven message could not be applied for a reason other than itself (the database).
    #[error("re-applying parked message {id}")]
    Reapply {
        /// The parked message.
        id: i64,
        #[source]
        source: ApplyError,
    },
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

/// Writes an operator's action to `operator_log`.
pub(crate) async fn record_action(
    tx: &mut PgConnection,
    actor: &str,
    action: &str,
    target: &str,
    reason: &str,
    detail: &Value,
) -> sqlx::Result<()> {
    sqlx::query(
        "INSERT INTO operator_log (actor, action, target, reason, detail) VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(storable(actor))
    .bind(action)
    .bind(storable(target))
    .bind(storable(reason))
    .bind(detail)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// What a redrive did with one parked message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Redriven {
    /// The parked message.
    pub id: i64,
    /// `applied`, `duplicate`, `held` (its predecessor is still missing) or `parked` (still).
    pub outcome: Verdict,
    /// Why it is still parked, or what it waits for.
    pub reason: Option<String>,
}

/// Who redrives, why (for the operator log), and how many messages at most (`None`: all).
#[derive(Debug, Clone, Copy)]
pub struct RedriveRequest<'a> {
    pub actor: &'a str,
    pub reason: &'a str,
    pub limit: Option<i64>,
}

/// A parked row read back for redrive.
#[derive(Debug, sqlx::FromRow)]
struct ParkedMessage {
    id: i64,
    stream_sequence: Option<i64>,
    subject: String,
    headers: Vec<u8>,
    body: Vec<u8>,
    body_size: i64,
}

impl<P: Projection> Runner<P> {
    /// Marks a parked message as dealt with, on purpose: it will not be redriven. Recorded with who,
    /// when and why. Held events waiting behind it stay held: `held release` skips the version.
    pub async fn discard(&self, id: i64, actor: &str, reason: &str) -> Result<Value, ParkedError> {
        let refused = |message: &str| ParkedError::DiscardRefused {
            id,
            source: ops::Refused::new(message),
        };
        let failed = |source| ParkedError::Discard { id, source };
        if reason.trim().is_empty() {
            return Err(refused("a discard needs a --reason"));
        }
        let mut tx = self.pool.begin().await.map_err(failed)?;
        self.lock(&mut tx).await.map_err(failed)?;
        let row: Option<(Option<Uuid>, Option<i64>)> = sqlx::query_as(
            "UPDATE parked SET discarded_at = now(), discarded_by = $2, discard_reason = $3
             WHERE id = $1 AND discarded_at IS NULL AND redriven_at IS NULL
             RETURNING aggregate_id, aggregate_version",
        )
        .bind(id)
        .bind(storable(actor))
        .bind(storable(reason))
        .fetch_optional(&mut *tx)
        .await
        .map_err(failed)?;
        let Some((aggregate_id, aggregate_version)) = row else {
            return Err(refused(
                "it does not exist, or was already redriven or discarded",
            ));
        };
        let held_behind: i64 = match aggregate_id {
            Some(aggregate) => {
                sqlx::query_scalar("SELECT count(*) FROM held WHERE aggregate_id = $1")
                    .bind(aggregate)
                    .fetch_one(&mut *tx)
                    .await
                    .map_err(failed)?
            }
            None => 0,
        };
        let detail = json!({"aggregate_id": aggregate_id, "aggregate_version": aggregate_version,
                            "held_behind": held_behind});
        record_action(
            &mut tx,
            actor,
            "parked discard",
            &id.to_string(),
            reason,
            &detail,
        )
        .await
        .map_err(failed)?;
        tx.commit().await.map_err(failed)?;
        tracing::info!(
            projection = P::NAME,
            id,
            actor,
            reason,
            held_behind,
            "parked message discarded"
        );
        Ok(json!({"discarded": id, "by": actor, "reason": reason,
                  "aggregate_id": aggregate_id, "aggregate_version": aggregate_version,
                  "held_behind": held_behind}))
    }

    /// Re-applies open parked messages (after an upgrade taught the code their shape), oldest first
    /// and at most `request.limit` of them, each like a delivery with the trust checks, in its own
    /// transaction; returns what happened to each and why the ones still parked failed again. A
    /// message whose predecessor is still missing moves to the held table. A message discarded by
    /// another operator meanwhile is left alone. The redrive is recorded in the operator log with who
    /// and why.
    pub async fn redrive(
        &self,
        request: &RedriveRequest<'_>,
    ) -> Result<Vec<Redriven>, ParkedError> {
        let parked: Vec<ParkedMessage> = sqlx::query_as(
            "SELECT id, stream_sequence, subject, headers, body, body_size FROM parked
             WHERE redriven_at IS NULL AND discarded_at IS NULL ORDER BY id LIMIT $1",
        )
        .bind(request.limit)
        .fetch_all(&self.pool)
        .await
        .map_err(ParkedError::Read)?;
        let mut report = Vec::with_capacity(parked.len());
        for row in parked {
            let id = row.id;
            let failed = |source| ParkedError::Redrive { id, source };
            let mut tx = self.pool.begin().await.map_err(failed)?;
            self.lock(&mut tx).await.map_err(failed)?;
            // Read while nothing else can act: a discard (or another redrive) since the list was
            // read wins.
            let still_open: bool = sqlx::query_scalar(
                "SELECT EXISTS (SELECT 1 FROM parked
                                WHERE id = $1 AND redriven_at IS NULL AND discarded_at IS NULL)",
            )
            .bind(id)
            .fetch_one(&mut *tx)
            .await
            .map_err(failed)?;
            if !still_open {
                tracing::info!(
                    projection = P::NAME,
                    id,
                    "parked message dealt with meanwhile; not redriven"
                );
                continue;
            }
            let (outcome, reason) = if row.body_size
                > i64::try_from(row.body.len()).unwrap_or(i64::MAX)
            {
                (
                    Verdict::Parked,
                    Some(format!(
                        "only the first {} of its {} bytes were kept when it was parked",
                        row.body.len(),
                        row.body_size
                    )),
                )
            } else {
                let headers: Value = serde_json::from_slice(&row.headers).unwrap_or(Value::Null);
                let message = RawMessage {
                    stream_sequence: u64::try_from(row.stream_sequence.unwrap_or(0)).unwrap_or(0),
                    subject: row.subject.clone(),
                    headers: RawMessage::headers_from_json(&headers),
                    body: bytes::Bytes::from(row.body),
                };
                decide_and_apply(
                    &mut tx,
                    &*self.projection,
                    &self.upcasters,
                    std::slice::from_ref(&message),
                    None,
                    OnPoison::Report,
                )
                .await
                .map_err(|source| ParkedError::Reapply { id, source })?
                .remove(0)
            };
            let note = match (outcome, &reason) {
                (Verdict::Parked, Some(reason)) => format!("still parked: {reason}"),
                (Verdict::Held, _) => "held: its predecessor is not applied yet".to_owned(),
                (verdict, _) => format!("{verdict:?}").to_lowercase(),
            };
            let resolved = outcome != Verdict::Parked;
            sqlx::query(
                "UPDATE parked SET redrive_note = $2, redriven_at = CASE WHEN $3 THEN now() END WHERE id = $1",
            )
            .bind(row.id)
            .bind(storable(&note))
            .bind(resolved)
            .execute(&mut *tx)
            .await
            .map_err(failed)?;
            tx.commit().await.map_err(failed)?;
            tracing::info!(projection = P::NAME, id = row.id, ?outcome, note = %note, "redrove a parked message");
            report.push(Redriven {
                id: row.id,
                outcome,
                reason: match outcome {
                    Verdict::Held => Some(note),
                    _ => reason,
                },
            });
        }
        if !report.is_empty() {
            let count = |verdict| report.iter().filter(|r| r.outcome == verdict).count();
            let detail = json!({"messages": report.len(), "applied": count(Verdict::Applied),
                                "held": count(Verdict::Held), "still_parked": count(Verdict::Parked)});
            let failed = |source| ParkedError::Record(source);
            let mut tx = self.pool.begin().await.map_err(failed)?;
            record_action(
                &mut tx,
                request.actor,
                "redrive",
                "parked",
                request.reason,
                &detail,
            )
            .await
            .map_err(failed)?;
            tx.commit().await.map_err(failed)?;
        }
        Ok(report)
    }
}
