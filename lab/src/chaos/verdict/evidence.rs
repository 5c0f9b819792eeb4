//! What the verdict reads: the evidence a run hands over, and the stored events as the checks need
//! them.

use async_nats::jetstream;
use serde_json::Value;
use sqlx::PgPool;
use uuid::Uuid;

use crate::chaos::faults::{FaultKind, Injected};
use crate::chaos::fleet::Fleet;
use crate::chaos::load::Played;
use crate::chaos::watch::Drained;

/// What the verdict looks at.
#[derive(Debug)]
pub(in crate::chaos) struct Evidence<'a> {
    /// The event store.
    pub pool: &'a PgPool,
    /// Its URL (the read models read themselves and fold the store from it).
    pub database_url: &'a str,
    /// The broker.
    pub jetstream: &'a jetstream::Context,
    /// The stream.
    pub stream: &'a str,
    /// The processes (for the projection binaries).
    pub fleet: &'a Fleet,
    /// What the load did.
    pub played: &'a Played,
    /// What the faults did.
    pub injected: &'a Injected,
    /// The kinds the run was asked for.
    pub kinds: &'a [FaultKind],
    /// How the drain ended.
    pub drained: &'a Drained,
}

/// One stored event, as the fold needs it.
#[derive(Debug, sqlx::FromRow)]
pub(super) struct StoredEvent {
    pub(super) event_id: Uuid,
    pub(super) event_type: String,
    pub(super) aggregate_id: Uuid,
    pub(super) aggregate_version: i64,
    pub(super) payload: Value,
}
