//! `redrive`: parked messages re-applied, each like a delivery, after an upgrade taught the code
//! their shape.

use serde::Serialize;
use serde_json::{Value, json};

use super::record_action;
use crate::apply::{ApplyError, OnPoison, decide_and_apply};
use crate::decode::RawMessage;
use crate::park::storable;
use crate::plan::Verdict;
use crate::projection::Projection;
use crate::runner::Runner;

/// Why a redrive failed. Messages redriven before the failure stay redriven.
#[derive(Debug, thiserror::Error)]
pub enum RedriveError {
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
    /// Re-applies open parked messages (after an upgrade taught the code their shape), oldest first
    /// and at most `request.limit` of them, each like a delivery with the trust checks, in its own
    /// transaction; returns what happened to each and why the ones still parked failed again. A
    /// message whose predecessor is still missing moves to the held table. A message discarded by
    /// another operator meanwhile is left alone. The redrive is recorded in the operator log with who
    /// and why.
    pub async fn redrive(
        &self,
        request: &RedriveRequest<'_>,
    ) -> Result<Vec<Redriven>, RedriveError> {
        let parked: Vec<ParkedMessage> = sqlx::query_as(
            "SELECT id, stream_sequence, subject, headers, body, body_size FROM parked
             WHERE redriven_at IS NULL AND discarded_at IS NULL ORDER BY id LIMIT $1",
        )
        .bind(request.limit)
        .fetch_all(&self.pool)
        .await
        .map_err(RedriveError::Read)?;
        let mut report = Vec::with_capacity(parked.len());
        for row in parked {
            let id = row.id;
            let failed = |source| RedriveError::Redrive { id, source };
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
                .map_err(|source| RedriveError::Reapply { id, source })?
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
            let failed = |source| RedriveError::Record(source);
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
