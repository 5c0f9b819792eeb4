//! Appending events: the `events` rows and their `outbox` rows are written by one statement, so they
//! commit together or not at all (the statement is the outbox's: `crate::outbox::insert_events`), and
//! the unique `(aggregate_id, aggregate_version)` is the optimistic-concurrency guard.

use domain::EventEnvelope;
use serde_json::Value;
use sqlx::{PgPool, Postgres, Transaction};
use uuid::Uuid;

use crate::alone::{self, Unwritten, is_lock_timeout};
use crate::group_commit::GroupCommit;
use crate::outbox::{Part, insert_events};

/// Extra facts recorded with an append.
#[derive(Debug, Clone, Default)]
pub struct AppendOptions {
    /// Record the result under this key in the same transaction (see [`crate::EventStore`]).
    pub idempotency: Option<(String, Value)>,
    /// W3C trace context to forward with the published messages.
    pub traceparent: Option<String>,
}

/// What an append wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppendResult {
    /// The aggregate's version after the append.
    pub aggregate_version: i64,
    /// The ids of the appended events, in order.
    pub event_ids: Vec<Uuid>,
}

/// Why an append wrote nothing.
#[derive(Debug, thiserror::Error)]
pub enum AppendError {
    /// Another writer got there first (or the caller's expected version is stale): nothing was written.
    #[error(
        "aggregate {aggregate_id} is at version {actual}, not the expected {expected}: it was changed concurrently"
    )]
    VersionConflict {
        /// The aggregate.
        aggregate_id: Uuid,
        /// The version the caller decided against.
        expected: i64,
        /// The version found in the store.
        actual: i64,
    },
    /// The idempotency key is already recorded: the caller should return the recorded result.
    #[error("idempotency key {0:?} is already recorded")]
    IdempotencyKeyTaken(String),
    /// An event id of the batch is already in the store.
    #[error("an event id of this batch already exists in the store")]
    DuplicateEventId,
    /// The batch is not a run of versions `expected + 1, expected + 2, ...` of one aggregate.
    #[error("invalid append: {0}")]
    InvalidBatch(&'static str),
    /// Another transaction holds the aggregate (it wrote the aggregate's next version and has not
    /// committed, or locked its rows) for longer than the lock timeout: nothing was written, and
    /// retrying once that transaction ends may succeed.
    #[error("aggregate {aggregate_id} is locked by another transaction: nothing was written")]
    Locked {
        /// The aggregate.
        aggregate_id: Uuid,
    },
    /// The connection broke under the statement and what it did could not be found out (the
    /// database could not be reached to end its session and read its rows): the events may or may
    /// not be stored. Read the aggregate before retrying.
    #[error(
        "the connection broke while writing to aggregate {aggregate_id} and whether the events were stored cannot be found out"
    )]
    OutcomeUnknown {
        /// The aggregate.
        aggregate_id: Uuid,
        /// How the connection broke.
        #[source]
        source: sqlx::Error,
    },
    /// The database failed; nothing was written.
    #[error("appending events failed")]
    Database(#[from] sqlx::Error),
}

/// Writes `events` (versions `expected_version + 1 ..`) and one outbox row per event, atomically.
///
/// With an idempotency key the key is recorded in the same transaction, so a retry either finds the key
/// (and the events) or finds neither.
pub async fn append(
    pool: &PgPool,
    aggregate_id: Uuid,
    expected_version: i64,
    events: &[EventEnvelope],
    options: &AppendOptions,
) -> Result<AppendResult, AppendError> {
    append_with(pool, None, aggregate_id, expected_version, events, options).await
}

/// [`append`], through `group` when it is given and the append has no idempotency key (the key's
/// record needs a transaction of its own, rolled back with the events when they are refused).
pub(crate) async fn append_with(
    pool: &PgPool,
    group: Option<&GroupCommit>,
    aggregate_id: Uuid,
    expected_version: i64,
    events: &[EventEnvelope],
    options: &AppendOptions,
) -> Result<AppendResult, AppendError> {
    check_batch(aggregate_id, expected_version, events)?;
    let traceparent = options.traceparent.as_deref();
    let part = Part::new(expected_version, events, traceparent);
    let written = match (&options.idempotency, group) {
        (None, Some(group)) => {
            group
                .insert(aggregate_id, expected_version, events, traceparent)
                .await
        }
        (None, None) => alone::write(pool, aggregate_id, &part).await,
        (Some((key, request)), _) => {
            with_key(pool, key, request, aggregate_id, expected_version, &part).await?
        }
    };
    match written {
        Ok(n) if n == events.len() as u64 => Ok(AppendResult {
            #[allow(
                clippy::cast_possible_wrap,
                reason = "check_batch saw the last event at expected_version + len: it fits"
            )]
            aggregate_version: expected_version + events.len() as i64,
            event_ids: events.iter().map(|e| e.event_id).collect(),
        }),
        // The guard found no event at `expected_version`: the caller is ahead of the store.
        Ok(_) => Err(conflict(pool, aggregate_id, expected_version).await),
        Err(Unwritten::Error(error)) => {
            Err(classify(pool, error, aggregate_id, expected_version).await)
        }
        Err(Unwritten::Locked) => Err(locked(aggregate_id)),
        Err(Unwritten::Unknown(source)) => Err(AppendError::OutcomeUnknown {
            aggregate_id,
            source,
        }),
    }
}

fn check_batch(
    aggregate_id: Uuid,
    expected_version: i64,
    events: &[EventEnvelope],
) -> Result<(), AppendError> {
    if events.is_empty() {
        return Err(AppendError::InvalidBatch("no events to append"));
    }
    if expected_version < 0 {
        return Err(AppendError::InvalidBatch("expected version is negative"));
    }
    for (offset, event) in events.iter().enumerate() {
        if event.aggregate_id != aggregate_id {
            return Err(AppendError::InvalidBatch(
                "events of more than one aggregate",
            ));
        }
        // Checked: a version past i64::MAX is a bad batch, not an overflow.
        let version = i64::try_from(offset)
            .ok()
            .and_then(|offset| expected_version.checked_add(offset)?.checked_add(1));
        if version != Some(event.aggregate_version) {
            return Err(AppendError::InvalidBatch(
                "event versions must continue from the expected version without gaps",
            ));
        }
    }
    Ok(())
}

/// Writes `part` in one transaction with the record of `key`, rolled back together when the
/// events are refused. The outer error: the key is taken, or recording it failed.
async fn with_key(
    pool: &PgPool,
    key: &str,
    request: &Value,
    aggregate_id: Uuid,
    expected_version: i64,
    part: &Part<'_>,
) -> Result<Result<u64, Unwritten>, AppendError> {
    let mut tx = pool.begin().await?;
    record_key(
        &mut tx,
        key,
        request,
        aggregate_id,
        expected_version,
        part.events,
    )
    .await?;
    let written = match insert_events(&mut *tx, std::slice::from_ref(part)).await {
        Ok(written) => written.len() as u64,
        // The transaction drops here and rolls back the key with everything else.
        Err(error) => return Ok(Err(Unwritten::Error(error))),
    };
    if written != part.events.len() as u64 {
        return Ok(Ok(written));
    }
    Ok(match tx.commit().await {
        Ok(()) => Ok(written),
        // The server answered the commit: it did not happen.
        Err(error @ sqlx::Error::Database(_)) => Err(Unwritten::Error(error)),
        // No answer to the commit: it may have happened. A retry with the same key finds out
        // (the key's record commits with the events, or neither does).
        Err(error) => Err(Unwritten::Unknown(error)),
    })
}

async fn record_key(
    tx: &mut Transaction<'_, Postgres>,
    key: &str,
    request: &Value,
    aggregate_id: Uuid,
    expected_version: i64,
    events: &[EventEnvelope],
) -> Result<(), AppendError> {
    #[allow(
        clippy::cast_possible_wrap,
        reason = "check_batch saw the last event at expected_version + len: it fits"
    )]
    let last_version = expected_version + events.len() as i64;
    // A concurrent request with the same key blocks here until the first commits, then finds the key
    // (or, past the session's `lock_timeout` — 2 s in `waybill serve` — fails and may be retried).
    let inserted = sqlx::query(
        "INSERT INTO command_idempotency
             (idempotency_key, request, aggregate_id, aggregate_version, event_ids)
         VALUES ($1, $2, $3, $4, $5)
         ON CONFLICT (idempotency_key) DO NOTHING",
    )
    .bind(key)
    .bind(request)
    .bind(aggregate_id)
    .bind(last_version)
    .bind(events.iter().map(|e| e.event_id).collect::<Vec<_>>())
    .execute(&mut **tx)
    .await?
    .rows_affected();
    if inserted == 0 {
        return Err(AppendError::IdempotencyKeyTaken(key.to_owned()));
    }
    Ok(())
}

/// Turns a database error into the named error it stands for.
async fn classify(
    pool: &PgPool,
    err: sqlx::Error,
    aggregate_id: Uuid,
    expected_version: i64,
) -> AppendError {
    let constraint = err
        .as_database_error()
        .and_then(|e| e.constraint())
        .map(str::to_owned);
    if is_lock_timeout(&err) {
        return locked(aggregate_id);
    }
    match constraint.as_deref() {
        Some("events_aggregate_version_key") => {
            conflict(pool, aggregate_id, expected_version).await
        }
        Some("events_event_id_key") => AppendError::DuplicateEventId,
        _ => AppendError::Database(err),
    }
}

fn locked(aggregate_id: Uuid) -> AppendError {
    metrics::counter!("waybill_appends_locked_total").increment(1);
    AppendError::Locked { aggregate_id }
}

async fn conflict(pool: &PgPool, aggregate_id: Uuid, expected: i64) -> AppendError {
    let actual = sqlx::query_scalar(
        "SELECT coalesce(max(aggregate_version), 0) FROM events WHERE aggregate_id = $1",
    )
    .bind(aggregate_id)
    .fetch_one(pool)
    .await;
    match actual {
        Ok(actual) => AppendError::VersionConflict {
            aggregate_id,
            expected,
            actual,
        },
        Err(e) => AppendError::Database(e),
    }
}
