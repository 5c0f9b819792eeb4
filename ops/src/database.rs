//! PostgreSQL connections every side shares: URL handling, pools named in `pg_stat_activity`, creating
//! a missing database, and recognising errors by SQLSTATE. The write side (`store`) and the read side
//! (`projections`) both use it, so neither has to link the other.

use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, ConnectOptions, Connection, PgPool};

/// Parses `url`, filling in the user name the way `psql` would when the URL names none.
///
/// sqlx falls back to a name it cannot always find (it says `anonymous` when `$USER` is unset, as in
/// some CI shells), so the fallback is explicit here: `PGUSER`, then `USER`, then `LOGNAME`, then
/// `postgres`, the conventional superuser.
pub fn connect_options(url: &str) -> sqlx::Result<PgConnectOptions> {
    let options: PgConnectOptions = url.parse().map_err(|error| unreadable_url(url, error))?;
    let authority = url
        .split_once("://")
        .and_then(|(_, rest)| rest.split(['/', '?']).next())
        .unwrap_or("");
    let user_in_authority = authority
        .split_once('@')
        .is_some_and(|(user, _)| !user.is_empty() && !user.starts_with(':'));
    if user_in_authority || url.contains("user=") {
        return Ok(options);
    }
    let user = ["PGUSER", "USER", "LOGNAME"]
        .iter()
        .find_map(|var| std::env::var(var).ok().filter(|v| !v.is_empty()))
        .unwrap_or_else(|| "postgres".to_owned());
    Ok(options.username(&user))
}

/// A URL the parser refused, said with what is likely wrong (the parser only says "invalid port
/// number" when a password's unencoded `#` ended the host early). Never quotes the URL.
fn unreadable_url(url: &str, error: sqlx::Error) -> sqlx::Error {
    let sqlx::Error::Configuration(cause) = &error else {
        return error;
    };
    let hint = match url.split_once("://") {
        None => {
            "it must be a URL, postgres://user@host:port/database (key/value connection strings \
             are not read)"
        }
        Some((_, rest)) if rest.contains('@') => {
            "a user name or password holding #, / or ? must have them percent-encoded (%23, %2F, \
             %3F)"
        }
        Some(_) => return error,
    };
    sqlx::Error::Configuration(format!("the database URL cannot be read ({cause}): {hint}").into())
}

/// `url` with its database name replaced by `database`: the same server, user and options.
pub fn with_database(url: &str, database: &str) -> String {
    let (address, options) = url
        .split_once('?')
        .map_or((url, None), |(a, o)| (a, Some(o)));
    let server = match address.split_once("://") {
        Some((scheme, rest)) => match rest.split_once('/') {
            Some((authority, _)) => format!("{scheme}://{authority}"),
            None => address.to_owned(),
        },
        None => address.to_owned(),
    };
    match options {
        Some(options) => format!("{server}/{database}?{options}"),
        None => format!("{server}/{database}"),
    }
}

/// Opens a pool on `url`, naming the connections after `application` in `pg_stat_activity`.
pub async fn connect(url: &str, application: &str, max_connections: u32) -> sqlx::Result<PgPool> {
    connect_with(url, application, max_connections, &[]).await
}

/// Like [`connect`], with session settings for every connection (e.g. the relay's
/// `idle_in_transaction_session_timeout`).
pub async fn connect_with(
    url: &str,
    application: &str,
    max_connections: u32,
    settings: &[(&str, String)],
) -> sqlx::Result<PgPool> {
    let mut options = connect_options(url)?
        .application_name(application)
        // A slow statement is worth a log line with its text; every statement would be noise.
        .log_slow_statements(tracing::log::LevelFilter::Warn, Duration::from_secs(1))
        .log_statements(tracing::log::LevelFilter::Trace);
    if !settings.is_empty() {
        options = options.options(settings.iter().map(|(k, v)| (*k, v.as_str())));
    }
    pool_options(max_connections).connect_with(options).await
}

/// Pool options every waybill pool starts from: at most `max_connections`, a 10 s wait for one,
/// and Nagle's algorithm off on each new connection (see `nodelay`).
pub fn pool_options(max_connections: u32) -> PgPoolOptions {
    PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(Duration::from_secs(10))
        .after_connect(|connection, _| Box::pin(crate::nodelay::disable_nagle(connection)))
}

/// Creates the database named in `url` when it does not exist; returns whether it created it.
pub async fn ensure_database(url: &str) -> sqlx::Result<bool> {
    let options = connect_options(url)?;
    let Some(name) = options.get_database().map(str::to_owned) else {
        return Err(sqlx::Error::Configuration(
            "the database URL names no database".into(),
        ));
    };
    // Connect to the maintenance database to look for (and create) the target.
    let mut conn = options.clone().database("postgres").connect().await?;
    let exists: bool =
        sqlx::query_scalar("SELECT exists(SELECT 1 FROM pg_database WHERE datname = $1)")
            .bind(&name)
            .fetch_one(&mut conn)
            .await?;
    if exists {
        return Ok(false);
    }
    let create = format!("CREATE DATABASE \"{}\"", name.replace('"', "\"\""));
    let created = sqlx::query(AssertSqlSafe(create)).execute(&mut conn).await;
    conn.close().await?;
    match created {
        Ok(_) => Ok(true),
        // Another process created it between our check and our CREATE: that is what we wanted.
        Err(e) if has_sqlstate(&e, "42P04") => Ok(false),
        Err(e) => Err(e),
    }
}

/// True when `err` says a table does not exist: the schema was never migrated.
pub fn is_undefined_table(err: &sqlx::Error) -> bool {
    has_sqlstate(err, "42P01")
}

/// True when `err` says the database failed rather than refused what the statement held, so the same
/// statement can succeed later: the connection was lost or refused (SQLSTATE class 08, and the
/// client's own I/O, TLS, protocol and pool errors), the transaction lost to another one (40:
/// serialization failure, deadlock), the server ran out of resources (53: disk, memory, connections),
/// an operator or a timeout stopped it (57: statement timeout, administrator shutdown, crash
/// recovery, cannot connect now), a system error (58: I/O), or a lock was not free in time (55P03).
pub fn is_transient(err: &sqlx::Error) -> bool {
    match err {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|code| {
            code == "55P03" || ["08", "40", "53", "57", "58"].contains(&code.get(..2).unwrap_or(""))
        }),
        _ => false,
    }
}

/// True when `err` is a database error with SQLSTATE `code`.
pub fn has_sqlstate(err: &sqlx::Error, code: &str) -> bool {
    err.as_database_error()
        .and_then(|e| e.code())
        .is_some_and(|c| c == code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn another_database_on_the_same_server() {
        assert_eq!(
            with_database("postgres://u@h:5432/a", "b"),
            "postgres://u@h:5432/b"
        );
        assert_eq!(
            with_database("postgres://h/a?sslmode=disable", "b"),
            "postgres://h/b?sslmode=disable"
        );
        assert_eq!(
            with_database("postgres://h:5432", "b"),
            "postgres://h:5432/b"
        );
    }

    #[test]
    fn an_unencoded_character_in_a_password_is_named_not_quoted() {
        let error = connect_options("postgres://u:pa#ss@h:5432/db").expect_err("refused");
        let message = error.to_string();
        assert!(message.contains("percent-encoded"), "{message}");
        assert!(!message.contains("pa#ss"), "{message}");
        let error = connect_options("host=h password=secret").expect_err("refused");
        assert!(error.to_string().contains("must be a URL"), "{error}");
    }

    #[test]
    fn a_user_named_in_the_url_is_kept() {
        let options = connect_options("postgres://alice:pw@127.0.0.1:5432/x").expect("url");
        assert_eq!(options.get_username(), "alice");
    }

    #[test]
    fn a_url_without_a_user_gets_an_explicit_one() {
        let options = connect_options("postgres://127.0.0.1:5432/x").expect("url");
        assert!(!options.get_username().is_empty());
        assert_ne!(options.get_username(), "anonymous");
    }
}
