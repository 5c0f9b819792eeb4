//! `waybill outbox repair --aggregate ID`: makes one aggregate's subject in the stream hold exactly the
//! store's events again, with the store as the truth — the recovery after a database restored behind
//! its stream (README, "After a restore").
//!
//! The subject's messages are read in stream order; the longest prefix that is the store's versions
//! 1..j, each once and under its own message id, is kept. Every message after it is deleted from the
//! stream, and the store's versions after j are set pending again (re-created from `events` where
//! their outbox rows were purged), so the relay publishes them — fenced on version j as always. The
//! read models saw the deleted messages: rebuild each projection afterwards (it reads the store).
//!
//! Deleting a message does not make JetStream forget its id: a version republished inside the dedupe
//! window is answered "duplicate" at the deleted sequence, which the relay reports as a divergence and
//! retries with backoff until the window has passed.

use async_nats::jetstream::{self, ErrorCode, stream::DeleteMessageErrorKind};
use domain::wire;
use serde::Serialize;
use sqlx::PgPool;
use uuid::Uuid;

use store::outbox::relaying;

use crate::fence::{self, SubjectMessage};

/// What a repair does (or did) to one aggregate.
#[derive(Debug, Clone, Serialize)]
pub struct RepairPlan {
    /// The aggregate's type.
    pub aggregate_type: String,
    /// The aggregate.
    pub aggregate_id: Uuid,
    /// The store's versions that the stream holds correctly, 1..=this (0: none).
    pub agreeing_versions: i64,
    /// Stream messages after that prefix, to delete: (sequence, message id).
    pub delete: Vec<DeletedMessage>,
    /// The store's versions to publish again.
    pub republish: Vec<i64>,
    /// Whether it was carried out.
    pub applied: bool,
}

/// A stream message the repair deletes.
#[derive(Debug, Clone, Serialize)]
pub struct DeletedMessage {
    /// Its stream sequence.
    pub stream_sequence: u64,
    /// Its `Nats-Msg-Id`.
    pub msg_id: Option<String>,
    /// The version it claims, if readable.
    pub aggregate_version: Option<i64>,
}

/// Why a repair could not be planned or carried out.
#[derive(Debug, thiserror::Error)]
pub enum RepairError {
    /// The store knows no such aggregate.
    #[error("the event store holds no events of aggregate {0}")]
    Unknown(Uuid),
    /// The database failed.
    #[error("reading or updating the store")]
    Store(#[from] sqlx::Error),
    /// The stream failed.
    #[error("{0}")]
    Stream(String),
}

/// Reads the store and the aggregate's subject and works out what to delete and republish.
pub async fn plan(
    pool: &PgPool,
    stream: &jetstream::stream::Stream,
    subject_prefix: &str,
    aggregate_id: Uuid,
) -> Result<RepairPlan, RepairError> {
    let events: Vec<(String, i64, Uuid)> = sqlx::query_as(
        "SELECT aggregate_type, aggregate_version, event_id FROM events
         WHERE aggregate_id = $1 ORDER BY aggregate_version",
    )
    .bind(aggregate_id)
    .fetch_all(pool)
    .await?;
    let Some((aggregate_type, _, _)) = events.first().cloned() else {
        return Err(RepairError::Unknown(aggregate_id));
    };
    let partitions = ops::stream_partitions(&stream.cached_info().config, subject_prefix);
    let subject = wire::stored_subject(subject_prefix, &aggregate_type, aggregate_id, partitions)
        .map_err(RepairError::Stream)?;
    let messages: Vec<SubjectMessage> = fence::read_subject(stream, &subject)
        .await
        .map_err(RepairError::Stream)?
        .into_iter()
        .map(|read| read.message)
        .collect();
    let agreeing = messages
        .iter()
        .zip(&events)
        .take_while(|(message, (_, version, event_id))| {
            message.msg_id.as_deref() == Some(event_id.to_string().as_str())
                && message.aggregate == Some((aggregate_id, *version))
        })
        .count();
    let agreeing_versions = i64::try_from(agreeing).unwrap_or(i64::MAX);
    Ok(RepairPlan {
        aggregate_type,
        aggregate_id,
        agreeing_versions,
        delete: messages[agreeing..]
            .iter()
            .map(|m| DeletedMessage {
                stream_sequence: m.sequence,
                msg_id: m.msg_id.clone(),
                aggregate_version: m.aggregate.map(|(_, v)| v),
            })
            .collect(),
        republish: events
            .iter()
            .map(|(_, version, _)| *version)
            .filter(|version| *version > agreeing_versions)
            .collect(),
        applied: false,
    })
}

/// Carries out `plan`: the aggregate's outbox rows are locked (a relay holding them finishes first),
/// the messages deleted, the rows set pending (re-created where purged), in one transaction.
pub async fn apply(
    pool: &PgPool,
    stream: &jetstream::stream::Stream,
    mut plan: RepairPlan,
) -> Result<RepairPlan, RepairError> {
    let mut tx = pool.begin().await?;
    relaying::lock_aggregate(&mut tx, plan.aggregate_id).await?;
    for message in &plan.delete {
        match stream.delete_message(message.stream_sequence).await {
            Ok(_) => {}
            // Gone already (a repair run twice, or retention): nothing to delete.
            Err(error)
                if matches!(
                    error.kind(),
                    DeleteMessageErrorKind::JetStream(ref e)
                        if e.error_code() == ErrorCode::NO_MESSAGE_FOUND
                ) => {}
            Err(error) => {
                return Err(RepairError::Stream(format!(
                    "deleting stream sequence {}: {}",
                    message.stream_sequence,
                    ops::error_chain(&error)
                )));
            }
        }
    }
    // Rows purged after they were sent are written again from the events, as the append writes them.
    let envelopes = store::load_envelopes(&mut *tx, plan.aggregate_id).await?;
    for envelope in envelopes
        .iter()
        .filter(|e| e.aggregate_version > plan.agreeing_versions)
    {
        relaying::restore_row(&mut tx, envelope).await?;
    }
    relaying::rewind_after(&mut tx, plan.aggregate_id, plan.agreeing_versions).await?;
    tx.commit().await?;
    let _ = store::notify_now(pool).await;
    tracing::warn!(
        aggregate_type = %plan.aggregate_type,
        aggregate_id = %plan.aggregate_id,
        agreeing_versions = plan.agreeing_versions,
        deleted = plan.delete.len(),
        republish = plan.republish.len(),
        "repaired: the stream's messages after the agreeing versions were deleted; the store's later versions will be published again"
    );
    plan.applied = true;
    Ok(plan)
}
