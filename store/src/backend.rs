//! The server process behind a connection, and the truth about a statement that got no answer.
//!
//! When a connection breaks under a statement, the statement may still be running on its backend:
//! waiting for another transaction's lock, or in its commit. It can commit after the client has
//! given up on it, so reading its rows at once may find nothing for a write that commits a moment
//! later — the caller would be told "failed" and a plain retry would write the command twice. So the
//! backend is ended first, from another session, and the rows are read once it is gone: by then what
//! it wrote is committed and what it had not committed never will be.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgPool};
use tokio::time::Instant;
use uuid::Uuid;

/// How long an ended backend may take to go away before its outcome is called unknown. Ending
/// interrupts a lock wait at once; a commit in progress finishes first, in milliseconds.
const GONE_WITHIN: Duration = Duration::from_secs(10);

/// How often to look whether an ended backend has gone.
const LOOK_EVERY: Duration = Duration::from_millis(10);

/// One backend: its process id, and its start time so that a later backend reusing the id is
/// never taken for it (and never ended in its place).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Backend {
    pid: i32,
    started: DateTime<Utc>,
}

/// Why the truth about an unanswered statement could not be learnt.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SettleError {
    /// Ending the backend, or reading the rows afterwards, failed.
    #[error("cannot end backend {pid} and read what it wrote")]
    Database {
        /// The backend.
        pid: i32,
        /// What failed.
        #[source]
        source: sqlx::Error,
    },
    /// The backend was told to end and is still there.
    #[error("backend {pid} was told to end and is still running after {GONE_WITHIN:?}")]
    StillRunning {
        /// The backend.
        pid: i32,
    },
}

impl Backend {
    /// The backend serving `connection` (sqlx keeps the id it got at the handshake to itself).
    pub(crate) async fn of(connection: &mut PgConnection) -> sqlx::Result<Self> {
        let (pid, started) = sqlx::query_as(
            "SELECT pid, backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()",
        )
        .fetch_one(connection)
        .await?;
        Ok(Self { pid, started })
    }

    /// The process id, for logs.
    pub(crate) fn pid(&self) -> i32 {
        self.pid
    }

    /// Ends this backend from a session of `pool` (nothing to do if it has gone already), waits
    /// until it is gone, then returns the aggregate of each of `event_ids` that is stored: the
    /// truth, since nothing the backend had not committed can commit any more. Ending a backend of
    /// the same login role needs no privilege.
    pub(crate) async fn end_and_read(
        &self,
        pool: &PgPool,
        event_ids: &[Uuid],
    ) -> Result<Vec<Uuid>, SettleError> {
        let failed = |source| SettleError::Database {
            pid: self.pid,
            source,
        };
        sqlx::query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
             WHERE pid = $1 AND backend_start = $2",
        )
        .bind(self.pid)
        .bind(self.started)
        .execute(pool)
        .await
        .map_err(failed)?;
        let deadline = Instant::now() + GONE_WITHIN;
        loop {
            let running: bool = sqlx::query_scalar(
                "SELECT EXISTS (SELECT 1 FROM pg_stat_activity
                                WHERE pid = $1 AND backend_start = $2)",
            )
            .bind(self.pid)
            .bind(self.started)
            .fetch_one(pool)
            .await
            .map_err(failed)?;
            if !running {
                break;
            }
            if Instant::now() >= deadline {
                return Err(SettleError::StillRunning { pid: self.pid });
            }
            tokio::time::sleep(LOOK_EVERY).await;
        }
        sqlx::query_scalar("SELECT aggregate_id FROM events WHERE event_id = ANY($1)")
            .bind(event_ids)
            .fetch_all(pool)
            .await
            .map_err(failed)
    }
}
