//! A read model in one file: what a demo builder writes to add a projection. It names itself and the
//! aggregate types it reads, declares its tables, and applies one event at a time to them and to the
//! state it keeps per aggregate; it reads itself back as one JSON document and says, with a pure fold
//! of the events, what that document must be. Everything else comes from the runner: consuming,
//! ordering, deduplicating, checkpoints, held and parked events, rebuilds, catching up from the event
//! store, the per-aggregate state, the command line, the read API, metrics — and the console, the
//! demo's verdict and chaos find it in the registry ([`crate::registry`]).
//!
//! The file goes in `projections/src/models/`, ends with [`crate::register_model!`], and runs as
//! `waybill-projection <name> run` ([`crate::model_cli`]). `revenue.rs` there is the worked example (README, "Add a
//! projection").

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use crate::decode::{Decoded, ProjectionEvent};
use crate::projection::Projection;

/// A read model in one file. See the module's documentation.
pub trait ReadModel: Send + Sync + 'static {
    /// Its name: its schema, its durable consumer and its command (`waybill-projection <NAME>`).
    /// Lower case letters, digits and `_`.
    const NAME: &'static str;
    /// What it answers, one sentence for `--help` and the console.
    const ABOUT: &'static str;
    /// The aggregate types whose events it reads; every other type is acknowledged unread.
    const AGGREGATES: &'static [&'static str];
    /// Idempotent DDL of its tables (run with `search_path` set to its schema).
    const TABLES: &'static str;
    /// Its events: `domain::OrderEvent` for a model of orders alone, `domain::AnyEvent` for more.
    type Event: ProjectionEvent;
    /// What it remembers of each aggregate between events (kept by the runner as JSON).
    type State: Default
        + Clone
        + PartialEq
        + Serialize
        + DeserializeOwned
        + Unpin
        + Send
        + Sync
        + 'static;

    /// Applies one event, the next version of its aggregate, inside the batch's transaction: change
    /// `state` (what is remembered of this aggregate) and the model's tables.
    fn apply(
        &self,
        tx: &mut PgConnection,
        state: &mut Self::State,
        event: &Decoded<Self::Event>,
    ) -> impl Future<Output = sqlx::Result<()>> + Send;

    /// The whole read model as one JSON document (`GET /state`, `show --json`).
    fn read(&self, db: &PgPool) -> impl Future<Output = sqlx::Result<Value>> + Send;

    /// The same document from the events alone, in each aggregate's version order: what
    /// [`ReadModel::read`] must return after applying them. Pure, and independent of the SQL, so
    /// that the demo and chaos can check the model against the event store.
    fn expected(&self, events: &[Decoded<Self::Event>]) -> Value;
}

/// A [`ReadModel`] run by the runner: its per-aggregate state loaded before a batch and written after
/// it, in the batch's transaction.
#[derive(Debug, Clone, Copy, Default)]
pub struct Kit<M>(pub M);

impl<M: ReadModel> Projection for Kit<M> {
    const NAME: &'static str = M::NAME;
    const TABLES: &'static str = M::TABLES;
    const AGGREGATES: &'static [&'static str] = M::AGGREGATES;
    type Event = M::Event;

    async fn apply(&self, tx: &mut PgConnection, events: &[Decoded<M::Event>]) -> sqlx::Result<()> {
        let mut ids: Vec<Uuid> = events.iter().map(|e| e.aggregate_id).collect();
        ids.sort_unstable();
        ids.dedup();
        let stored: Vec<(Uuid, sqlx::types::Json<M::State>)> = sqlx::query_as(
            "SELECT aggregate_id, state FROM aggregate_state WHERE aggregate_id = ANY($1)",
        )
        .bind(&ids)
        .fetch_all(&mut *tx)
        .await?;
        let before: HashMap<Uuid, M::State> = stored.into_iter().map(|(id, s)| (id, s.0)).collect();
        let mut states = before.clone();
        for event in events {
            let state = states.entry(event.aggregate_id).or_default();
            self.0.apply(tx, state, event).await?;
        }
        let changed: Vec<(Uuid, Value)> = states
            .into_iter()
            .filter(|(id, state)| before.get(id) != Some(state))
            .map(|(id, state)| {
                serde_json::to_value(&state)
                    .map(|json| (id, json))
                    .map_err(|e| sqlx::Error::Encode(Box::new(e)))
            })
            .collect::<sqlx::Result<_>>()?;
        if !changed.is_empty() {
            sqlx::query(
                "INSERT INTO aggregate_state (aggregate_id, state)
                 SELECT * FROM UNNEST($1::uuid[], $2::jsonb[])
                 ON CONFLICT (aggregate_id) DO UPDATE SET state = EXCLUDED.state",
            )
            .bind(changed.iter().map(|(id, _)| *id).collect::<Vec<_>>())
            .bind(changed.iter().map(|(_, s)| s.clone()).collect::<Vec<_>>())
            .execute(&mut *tx)
            .await?;
        }
        Ok(())
    }
}

/// A future the registry hands out (its entries are objects: one per model, of different types).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What the registry knows of a model without its type: enough for the console, the demo, chaos and
/// `waybill-projection` to run, read and check it.
pub trait Model: Send + Sync + 'static {
    /// Its name.
    fn name(&self) -> &'static str;
    /// What it answers.
    fn about(&self) -> &'static str;
    /// The aggregate types it reads.
    fn aggregates(&self) -> &'static [&'static str];
    /// The DDL of its own tables (how its schema's tables are told from the runner's: the console
    /// may read all of a model's, `crate::schema`).
    fn tables(&self) -> &'static str;
    /// Its command line (`waybill-projection <name> …`), run to the end.
    fn main(&self, args: Vec<String>) -> BoxFuture<'static, std::process::ExitCode>;
    /// Its read model now, from its schema in the database at `database_url`.
    fn read<'a>(&'a self, database_url: &'a str) -> BoxFuture<'a, anyhow::Result<Value>>;
    /// Its read model now, read through sessions like `pool`'s (the same server, login and session
    /// settings: the console's read-only ones) with its schema first on the search path. Creates
    /// nothing: a login that may only read can call it.
    fn read_from<'a>(&'a self, pool: &'a PgPool) -> BoxFuture<'a, anyhow::Result<Value>>;
    /// What its read model must be: its own fold of the events of the event store at
    /// `database_url`.
    fn expected<'a>(&'a self, database_url: &'a str) -> BoxFuture<'a, anyhow::Result<Value>>;
}
