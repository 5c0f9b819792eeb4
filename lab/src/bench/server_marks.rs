//! What the database server did during a drain: the WAL it wrote and whether a checkpoint ended.
//!
//! A checkpoint's closing `fsync`s stall every writer on the server for a moment; on a machine whose
//! `max_wal_size` is the default, one ends inside a drain at random, and a rate measured across it
//! reads low (docs/benchmarks.md, "A fourth machine"). The report marks such drains rather than
//! hiding or dropping them.

use anyhow::Context;
use sqlx::PgPool;

/// The server's WAL insert position and last completed checkpoint at one moment.
#[derive(Debug, Clone)]
pub(super) struct ServerMark {
    wal_lsn: String,
    /// `pg_control_checkpoint()`'s `checkpoint_lsn`, written when a checkpoint ends; `None` when
    /// this role may not read it.
    checkpoint_lsn: Option<String>,
}

/// What the server did between two marks.
#[derive(Debug, Clone, Copy)]
pub(super) struct ServerActivity {
    /// WAL written, bytes (by everything on the server).
    pub wal_bytes: u64,
    /// A checkpoint ended in between; `None` when the server did not say.
    pub checkpoint_ended: Option<bool>,
}

impl ServerMark {
    pub(super) async fn take(pool: &PgPool) -> anyhow::Result<Self> {
        let wal_lsn = sqlx::query_scalar("SELECT pg_current_wal_insert_lsn()::text")
            .fetch_one(pool)
            .await
            .context("reading the server's WAL position")?;
        Ok(Self {
            wal_lsn,
            checkpoint_lsn: last_checkpoint(pool).await,
        })
    }

    /// What the server did from this mark until now.
    pub(super) async fn until_now(&self, pool: &PgPool) -> anyhow::Result<ServerActivity> {
        let wal_bytes: i64 = sqlx::query_scalar(
            "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), $1::pg_lsn)::int8",
        )
        .bind(&self.wal_lsn)
        .fetch_one(pool)
        .await
        .context("reading the server's WAL position")?;
        let checkpoint_ended = match (&self.checkpoint_lsn, last_checkpoint(pool).await) {
            (Some(then), Some(now)) => Some(*then != now),
            _ => None,
        };
        Ok(ServerActivity {
            // The insert position only moves forward.
            wal_bytes: u64::try_from(wal_bytes).context("the WAL position went back")?,
            checkpoint_ended,
        })
    }
}

async fn last_checkpoint(pool: &PgPool) -> Option<String> {
    sqlx::query_scalar("SELECT checkpoint_lsn::text FROM pg_control_checkpoint()")
        .fetch_one(pool)
        .await
        .ok()
}
