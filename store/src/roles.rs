//! Least-privilege group roles for the processes that share the event store's database: what
//! `waybill roles create` sets up. Login users are made members of them (README, "Security").
//!
//! - `waybill_app` — the command side: appends events, outbox rows and idempotency keys, reads events.
//! - `waybill_relay` — reads and settles the outbox, keeps its journal, purges, ends stalled claims.
//!   It cannot read or change `events`.
//! - `waybill_projection` — may create and own its own schemas in the database, and read `events`
//!   (a projection that starts or rebuilds catches up from it: history lives in the store); no
//!   access to `outbox` or anything else of the event store, and no write to `events`.
//! - `waybill_console` — the console (`waybill-console`): reads events, the outbox and its journal;
//!   updates only the outbox columns a dead row's replay changes. The projections' bookkeeping tables
//!   it reads are granted to it by each projection when it creates its schema (the schema's owner is
//!   the projection's login, so only it can grant them; `projections::schema`).

use sqlx::{Acquire, PgPool};

/// The group roles, in the order they are created.
pub const ROLES: [&str; 4] = [
    "waybill_app",
    "waybill_relay",
    "waybill_projection",
    CONSOLE_ROLE,
];

/// The console's role; each projection grants it the reading of its bookkeeping tables when the role
/// exists (`projections::schema`, which names it too: the read side does not link the store).
pub const CONSOLE_ROLE: &str = "waybill_console";

/// Whether `error` says the role exists already: `duplicate_object`, or `unique_violation` when a
/// concurrent `CREATE ROLE` committed first.
fn created_elsewhere(error: &sqlx::Error) -> bool {
    error
        .as_database_error()
        .and_then(|e| e.code())
        .is_some_and(|code| code == "42710" || code == "23505")
}

/// Creates the group roles when missing and (re)grants exactly their privileges on the database of
/// `pool`. Idempotent. Returns one line per statement that ran, for the operator.
pub async fn create_roles(pool: &PgPool) -> sqlx::Result<Vec<String>> {
    let mut done = Vec::new();
    let mut tx = pool.begin().await?;
    for role in ROLES {
        let exists: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = $1)")
                .bind(role)
                .fetch_one(&mut *tx)
                .await?;
        if !exists {
            // Role names are our constants, not input: safe to splice.
            let sql = format!("CREATE ROLE {role} NOLOGIN");
            // Roles belong to the cluster, not to this database: another database's migration (or
            // another process) may create the same role between the check and this statement. Its
            // role is as good as ours, so under a savepoint a duplicate is taken as done.
            let mut savepoint = (&mut *tx).begin().await?;
            match sqlx::query(sqlx::AssertSqlSafe(sql.clone()))
                .execute(&mut *savepoint)
                .await
            {
                Ok(_) => {
                    savepoint.commit().await?;
                    done.push(sql);
                }
                Err(error) if created_elsewhere(&error) => savepoint.rollback().await?,
                Err(error) => return Err(error),
            }
        }
    }
    let database: String = sqlx::query_scalar("SELECT current_database()")
        .fetch_one(&mut *tx)
        .await?;
    let quoted = format!("\"{}\"", database.replace('"', "\"\""));
    let grants = [
        format!("GRANT CONNECT ON DATABASE {quoted} TO waybill_app, waybill_relay, waybill_projection, waybill_console"),
        format!("GRANT CREATE ON DATABASE {quoted} TO waybill_projection"),
        "REVOKE ALL ON events, command_idempotency FROM waybill_app, waybill_relay, waybill_projection, waybill_console".to_owned(),
        "GRANT USAGE ON SCHEMA public TO waybill_app, waybill_relay, waybill_projection, waybill_console".to_owned(),
        "GRANT SELECT, INSERT ON events TO waybill_app".to_owned(),
        "GRANT SELECT ON events TO waybill_projection".to_owned(),
        "GRANT SELECT, INSERT ON command_idempotency TO waybill_app".to_owned(),
        "GRANT EXECUTE ON FUNCTION waybill_end_stale_claims(interval) TO waybill_relay".to_owned(),
        "GRANT SELECT ON events TO waybill_console".to_owned(),
    ];
    // The outbox's own privileges come from its owner, revoke first (`outbox::privileges`).
    for grant in grants.into_iter().chain(crate::outbox::privileges()) {
        sqlx::query(sqlx::AssertSqlSafe(grant.clone()))
            .execute(&mut *tx)
            .await?;
        done.push(grant);
    }
    tx.commit().await?;
    Ok(done)
}
