//! The console's PostgreSQL sessions: a small pool for reading, whose sessions cannot write
//! (`default_transaction_read_only`), and — only when the console has an operator token — one session
//! for the writes of its actions (a dead row's replay). The console's login role is a member of
//! `waybill_console` (`store::roles`), which may read what the pages show and update what a replay
//! changes; the read-only sessions keep every page from writing even by mistake.

use std::time::Duration;

use sqlx::PgPool;

/// Each statement of the console ends within this: on a slow database, samples fail (and say so)
/// instead of piling up behind one another on the pool's few connections.
const STATEMENT_TIMEOUT: Duration = Duration::from_secs(5);

/// Why the console's database cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum DatabaseError {
    /// PostgreSQL could not be reached or refused the login.
    #[error("connecting to PostgreSQL")]
    Connect(#[source] sqlx::Error),
    /// The event store's tables are missing.
    #[error("the database has no {table} table: run `waybill migrate` first")]
    NotMigrated { table: &'static str },
    /// The login may not read what the console shows.
    #[error(
        "this login may not read {table}: make it a member of waybill_console (`waybill roles create`, \
         then GRANT waybill_console TO <login>)"
    )]
    NotPermitted {
        table: &'static str,
        #[source]
        source: sqlx::Error,
    },
    /// Reading failed otherwise.
    #[error("reading {table}")]
    Read {
        table: &'static str,
        #[source]
        source: sqlx::Error,
    },
}

/// The console's connections.
#[derive(Debug, Clone)]
pub struct Database {
    pub(crate) reads: PgPool,
    pub(crate) writes: Option<PgPool>,
}

impl Database {
    /// Connects to `url`; with `actions`, also the session the operator actions write through.
    /// Checks that the event store's tables exist and are readable by this login.
    pub async fn connect(url: &str, actions: bool) -> Result<Self, DatabaseError> {
        let timeout = format!("{}ms", STATEMENT_TIMEOUT.as_millis());
        // Its own small pool: a console left open never takes another service's connections.
        let reads = ops::database::connect_with(
            url,
            "waybill-console",
            4,
            &[
                ("statement_timeout", timeout.clone()),
                ("default_transaction_read_only", "on".to_owned()),
            ],
        )
        .await
        .map_err(DatabaseError::Connect)?;
        for table in ["events", store::outbox::TABLE, store::outbox::JOURNAL_TABLE] {
            check_readable(&reads, table).await?;
        }
        let writes = if actions {
            let pool = ops::database::connect_with(
                url,
                "waybill-console-actions",
                1,
                &[("statement_timeout", timeout)],
            )
            .await
            .map_err(DatabaseError::Connect)?;
            Some(pool)
        } else {
            None
        };
        Ok(Self { reads, writes })
    }
}

async fn check_readable(pool: &PgPool, table: &'static str) -> Result<(), DatabaseError> {
    // Table names are this module's constants, not input.
    let probe = format!("SELECT 1 FROM {table} LIMIT 1");
    match sqlx::query(sqlx::AssertSqlSafe(probe)).execute(pool).await {
        Ok(_) => Ok(()),
        Err(error) if ops::database::is_undefined_table(&error) => {
            Err(DatabaseError::NotMigrated { table })
        }
        Err(source) if ops::database::has_sqlstate(&source, "42501") => {
            Err(DatabaseError::NotPermitted { table, source })
        }
        Err(source) => Err(DatabaseError::Read { table, source }),
    }
}
