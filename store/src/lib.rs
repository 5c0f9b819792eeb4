//! The PostgreSQL event store: events and their outbox rows commit in one statement, history loads
//! through the upcasters, and commands run with optimistic concurrency and optional idempotency keys.
//!
//! Nothing here talks to NATS: only the relay publishes.

mod alone;
mod append;
mod backend;
mod commands;
mod database;
mod group_commit;
mod lanes;
mod load;
mod notify;
pub mod outbox;
mod pending;
pub mod roles;

pub use append::{AppendError, AppendOptions, AppendResult, append};
pub use commands::{CommandContext, CommandError, CommandOutcome, EventStore};
pub use database::migrate;
pub use group_commit::{GroupCommit, GroupCommitSettings};
pub use load::{EnvelopeRow, LoadError, load_aggregate, load_envelopes, load_order};
pub use notify::{OUTBOX_CHANNEL, OutboxNotifier, notify_now};

/// Every migration under `migrations/`, embedded in the binary. Tests use it through
/// `#[sqlx::test(migrator = "store::MIGRATOR")]`, so each gets a fresh, migrated database.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations");
