//! Writing one aggregate's append by itself on a connection of the pool, with an answer that is
//! always the truth: a statement that gets no answer is settled by ending its backend and reading
//! its rows ([`Backend::end_and_read`]), never by guessing.

use sqlx::PgPool;
use uuid::Uuid;

use crate::backend::{Backend, SettleError};
use crate::outbox::Part;
use crate::outbox::insert_events;

/// Why an insert wrote nothing — or may have written.
#[derive(Debug)]
pub(crate) enum Unwritten {
    /// Nothing was written: the server refused the statement (a version taken, a lock waited on
    /// too long), or the statement failed before it could run, or it got no answer and its
    /// backend, once ended, had stored nothing.
    Error(sqlx::Error),
    /// Nothing was written: another transaction held the aggregate for the whole lock timeout
    /// while this append waited behind another one of the same aggregate.
    Locked,
    /// The statement got no answer and what it did could not be found out: it may have committed.
    Unknown(sqlx::Error),
}

impl Unwritten {
    /// True when another transaction's lock was waited on past the lock timeout.
    pub(crate) fn is_locked(&self) -> bool {
        match self {
            Self::Locked => true,
            Self::Error(error) => is_lock_timeout(error),
            Self::Unknown(_) => false,
        }
    }
}

/// True when `error` is PostgreSQL's `lock_not_available` (55P03): `lock_timeout` ran out while
/// the statement waited for a lock another transaction holds. Nothing was written.
pub(crate) fn is_lock_timeout(error: &sqlx::Error) -> bool {
    error
        .as_database_error()
        .and_then(|e| e.code())
        .is_some_and(|code| code == "55P03")
}

/// Writes `part` with its own statement on a connection of `pool` (waiting for locks as long as
/// the pool's sessions do); returns how many of its events were written: all, or none when the
/// aggregate was not at the expected version.
pub(crate) async fn write(
    pool: &PgPool,
    aggregate_id: Uuid,
    part: &Part<'_>,
) -> Result<u64, Unwritten> {
    let mut connection = pool.acquire().await.map_err(Unwritten::Error)?;
    let backend = Backend::of(&mut connection)
        .await
        .map_err(Unwritten::Error)?;
    match insert_events(&mut *connection, std::slice::from_ref(part)).await {
        Ok(written) => Ok(written.len() as u64),
        // The server answered: the statement (its own transaction) wrote nothing.
        Err(error @ sqlx::Error::Database(_)) => Err(Unwritten::Error(error)),
        Err(error) => {
            connection.close_on_drop();
            drop(connection);
            let event_ids: Vec<Uuid> = part.events.iter().map(|e| e.event_id).collect();
            match settle(pool, &backend, &event_ids, aggregate_id, &error).await {
                Some(stored) if !stored.is_empty() => Ok(stored.len() as u64),
                Some(_) => Err(Unwritten::Error(error)),
                None => Err(Unwritten::Unknown(error)),
            }
        }
    }
}

/// After a statement on `backend` got no answer (`error`): the aggregates of `event_ids` stored
/// once the backend is gone, or `None` when that cannot be found out.
pub(crate) async fn settle(
    pool: &PgPool,
    backend: &Backend,
    event_ids: &[Uuid],
    aggregate_id: Uuid,
    error: &sqlx::Error,
) -> Option<Vec<Uuid>> {
    match backend.end_and_read(pool, event_ids).await {
        Ok(stored) => {
            let outcome = if stored.is_empty() {
                "not_written"
            } else {
                "written"
            };
            tracing::warn!(%aggregate_id, pid = backend.pid(), %error, outcome, "a statement got no answer; its backend was ended and its rows read");
            metrics::counter!("waybill_appends_unanswered_total", "outcome" => outcome)
                .increment(1);
            Some(stored)
        }
        Err(check) => {
            tracing::error!(%aggregate_id, pid = backend.pid(), %error, check = %error_chain(&check), "a statement got no answer and what it wrote cannot be found out");
            metrics::counter!("waybill_appends_unanswered_total", "outcome" => "unknown")
                .increment(1);
            None
        }
    }
}

fn error_chain(error: &SettleError) -> String {
    let mut text = error.to_string();
    let mut cause = std::error::Error::source(error);
    while let Some(next) = cause {
        text.push_str(": ");
        text.push_str(&next.to_string());
        cause = next.source();
    }
    text
}

/// Registers the HELP text of the metrics every append path records.
pub(crate) fn describe_metrics() {
    metrics::describe_counter!(
        "waybill_appends_unanswered_total",
        "Append statements that got no answer (the connection broke): their backend was ended and their rows read, showing them written or not_written; unknown when even that failed (the caller is told the outcome is unknown)"
    );
    metrics::describe_counter!(
        "waybill_appends_locked_total",
        "Appends refused because another transaction held their aggregate past the lock timeout (HTTP 503 with Retry-After; nothing written)"
    );
}
