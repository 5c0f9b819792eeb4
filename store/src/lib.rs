//! The PostgreSQL event store: events and their outbox rows commit in one statement, history loads
//! through the upcasters, and commands run with optimistic concurrency and optional idempotency keys.
//!
//! Nothing here talks to NATS: only the relay publishes.

mod append;
mod commands;
mod database;
mod load;
mod notify;
pub mod roles;

pub use append::{AppendError, AppendOptions, AppendResult, append};
pub use commands::{CommandContext, CommandError, CommandOutcome, EventStore};
pub use database::migrate;
pub use load::{LoadError, envelope_from_row, load_envelopes, load_order};
pub use notify::{OUTBOX_CHANNEL, OutboxNotifier, notify_now};

// Connecting moved to `ops::database` so that the read side need not link the event store; the names
// stay reachable here for the write side's callers.
pub use ops::database::{
    connect, connect_options, connect_with, ensure_database, has_sqlstate, is_undefined_table,
    with_database,
};

/// Every migration under `migrations/`, embedded in the binary. Tests use it through
/// `#[sqlx::test(migrator = "store::MIGRATOR")]`, so each gets a fresh, migrated database.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations");
