//! The connection flags every binary shares, declared once: where PostgreSQL is, and — for the
//! processes that touch the stream — where NATS is and which stream and subjects carry the events.

use crate::nats::NatsConnection;

/// Where PostgreSQL is unless `--database-url` or `DATABASE_URL` says otherwise.
pub const DEFAULT_DATABASE_URL: &str = "postgres://127.0.0.1:5432/waybill";

/// The database flag of every binary.
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct DatabaseArgs {
    /// PostgreSQL URL, e.g. postgres://user@host:5432/db?sslmode=verify-full (a projection may keep
    /// its schema in a database of its own). Prefer the environment variable: flags show up in `ps`.
    #[arg(
        id = "database_url",
        value_name = "URL",
        long = "database-url",
        env = "DATABASE_URL",
        default_value = DEFAULT_DATABASE_URL,
        global = true,
        hide_env_values = true
    )]
    pub url: String,
}

/// What a process on the stream needs: the database, the NATS server, and the stream's names.
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct StreamConnection {
    #[command(flatten)]
    pub database: DatabaseArgs,

    /// The NATS server, credentials and TLS.
    #[command(flatten)]
    pub nats: NatsConnection,

    /// JetStream stream the relay publishes into and the projections read.
    #[arg(long, env = "WAYBILL_STREAM", default_value = domain::wire::DEFAULT_STREAM, global = true)]
    pub stream: String,

    /// Subject prefix: every event of an aggregate goes to `<prefix>.<aggregate type>.<aggregate id>`
    /// (the event type travels in the Waybill-Event-Type header).
    #[arg(long, env = "WAYBILL_SUBJECT_PREFIX", default_value = domain::wire::DEFAULT_SUBJECT_PREFIX, global = true)]
    pub subject_prefix: String,
}
