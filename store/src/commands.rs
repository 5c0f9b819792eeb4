//! Running a command end to end: load, decide, append — with optimistic concurrency, retries on a lost
//! race, and idempotency keys that make a retried request return its original result.

use std::sync::Arc;

use chrono::{DateTime, SubsecRound, Utc};
use domain::{
    Aggregate, AggregateId, Command, DowncastError, EventEnvelope, EventMeta, Order, OrderError,
    OrderId, Upcasters, WriteVersions,
};
use serde_json::{Value, json};
use sqlx::PgPool;
use uuid::Uuid;

use crate::append::{AppendError, AppendOptions, append_with};
use crate::group_commit::GroupCommit;
use crate::load::{LoadError, load_aggregate};
use crate::notify::OutboxNotifier;

/// How often a command is re-decided after losing a race to a concurrent writer.
const CONFLICT_RETRIES: usize = 3;

/// How a command is to be run, beyond the command itself.
#[derive(Debug, Clone, Default)]
pub struct CommandContext {
    /// A caller-chosen key: a retry with the same key and request returns the first result.
    pub idempotency_key: Option<String>,
    /// Only apply if the order is at exactly this version (HTTP `If-Match`); no automatic retry.
    pub expected_version: Option<i64>,
    /// The flow this command belongs to; a new one is started when absent.
    pub correlation_id: Option<Uuid>,
    /// W3C trace context to forward to consumers.
    pub traceparent: Option<String>,
}

/// What a command did to an aggregate of type `A`.
#[derive(Debug, Clone)]
pub struct CommandOutcome<A: Aggregate = Order> {
    /// The aggregate.
    pub id: A::Id,
    /// Its version after the command.
    pub aggregate_version: i64,
    /// The events the command recorded.
    pub event_ids: Vec<Uuid>,
    /// True when this is a retry answered from the idempotency record (nothing was written).
    pub replayed: bool,
    /// Its state right after the command; for a replay, its current state (it may have moved on
    /// since the first request).
    pub state: A,
}

/// Why a command to an aggregate whose refusals are `E` did not complete.
/// [`CommandError::is_refusal`] tells a caller's mistake from a fault.
#[derive(Debug, thiserror::Error)]
pub enum CommandError<E: std::error::Error + 'static = OrderError> {
    /// A domain rule refused the command; nothing was written.
    #[error(transparent)]
    Refused(E),
    /// The caller required a version (`If-Match`, `--expected-version`) the aggregate is no longer at.
    #[error("{aggregate_type} {aggregate_id} is at version {actual}, not the expected {expected}")]
    StaleVersion {
        /// Its type, e.g. `order`.
        aggregate_type: &'static str,
        /// The aggregate.
        aggregate_id: Uuid,
        /// The version the caller required.
        expected: i64,
        /// The version found.
        actual: i64,
    },
    /// Concurrent writers kept winning the race; retrying later may succeed.
    #[error(
        "{aggregate_type} {aggregate_id} is at version {actual}, not {expected}: it was changed concurrently"
    )]
    Conflict {
        /// Its type.
        aggregate_type: &'static str,
        /// The aggregate.
        aggregate_id: Uuid,
        /// The version the command was decided against.
        expected: i64,
        /// The version found.
        actual: i64,
    },
    /// Another transaction holds the aggregate (another writer wrote its next version and has not
    /// committed, or holds its rows locked) for longer than the lock timeout: nothing was written;
    /// retrying shortly may succeed. Every other aggregate is written meanwhile.
    #[error(
        "{aggregate_type} {aggregate_id} is locked by another transaction (another writer holds it, uncommitted): nothing was written; retry shortly"
    )]
    Locked {
        /// Its type.
        aggregate_type: &'static str,
        /// The aggregate.
        aggregate_id: Uuid,
    },
    /// The idempotency key was first used for a different request.
    #[error("idempotency key {0:?} was already used for a different request")]
    KeyReused(String),
    /// The idempotency key is empty or too long.
    #[error("idempotency key must be 1 to 200 characters")]
    InvalidKey,
    /// The events cannot be written in the older version this store writes (`--write-version`):
    /// nothing was written. Only [`DowncastError::Unrepresentable`]: what the caller asked for does
    /// not fit the older version.
    #[error("the command's events cannot be written")]
    Unrepresentable(#[source] DowncastError),
    /// Writing the older version failed for a reason that is not the caller's (a downcaster that does
    /// not round-trip, a missing step): a fault, logged; nothing was written.
    #[error("the command's events could not be brought to the version this store writes")]
    WriteVersion(#[source] DowncastError),
    /// The aggregate's history could not be read.
    #[error(transparent)]
    Load(LoadError),
    /// Writing failed.
    #[error(transparent)]
    Append(AppendError),
    /// The database failed.
    #[error("database error")]
    Database(#[source] sqlx::Error),
}

impl<E: std::error::Error + 'static> From<LoadError> for CommandError<E> {
    fn from(error: LoadError) -> Self {
        Self::Load(error)
    }
}

impl<E: std::error::Error + 'static> From<sqlx::Error> for CommandError<E> {
    fn from(error: sqlx::Error) -> Self {
        Self::Database(error)
    }
}

impl From<OrderError> for CommandError<OrderError> {
    fn from(error: OrderError) -> Self {
        Self::Refused(error)
    }
}

impl<E: std::error::Error + 'static> CommandError<E> {
    /// True when the caller's input was refused (exit code 2, HTTP 4xx), false for faults.
    pub fn is_refusal(&self) -> bool {
        matches!(
            self,
            Self::Refused(_)
                | Self::StaleVersion { .. }
                | Self::KeyReused(_)
                | Self::InvalidKey
                | Self::Unrepresentable(_)
        )
    }
}

/// The command side over one PostgreSQL database.
#[derive(Debug, Clone)]
pub struct EventStore {
    pool: PgPool,
    upcasters: Arc<Upcasters>,
    notifier: Option<OutboxNotifier>,
    group: Option<GroupCommit>,
    writes: Arc<WriteVersions>,
}

impl EventStore {
    /// A store on `pool` that reads every aggregate type's events with the standard upcasters.
    pub fn new(pool: PgPool) -> Self {
        crate::alone::describe_metrics();
        Self {
            pool,
            upcasters: Arc::new(Upcasters::all()),
            notifier: None,
            group: None,
            writes: Arc::new(WriteVersions::default()),
        }
    }

    /// Writes the payload versions `writes` asks for instead of the current ones (the expand phase
    /// of a rollout: readers that know only the older version are still running).
    pub fn with_write_versions(mut self, writes: WriteVersions) -> Self {
        self.writes = Arc::new(writes);
        self
    }

    /// Pokes `notifier` after every successful append, so relays wake without polling.
    pub fn with_notifier(mut self, notifier: OutboxNotifier) -> Self {
        self.notifier = Some(notifier);
        self
    }

    /// Writes appends without an idempotency key through `group`, several commands to a statement
    /// when they arrive together (see [`GroupCommit`]).
    pub fn with_group_commit(mut self, group: GroupCommit) -> Self {
        self.group = Some(group);
        self
    }

    /// The pool the store writes through.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Loads and folds one order (status `new`, version 0 when it does not exist).
    pub async fn load(&self, order_id: OrderId) -> Result<Order, LoadError> {
        self.load_as::<Order>(order_id).await
    }

    /// Loads and folds one aggregate of type `A` (version 0 when it does not exist — also when the id
    /// belongs to an aggregate of another type).
    pub async fn load_as<A: Aggregate>(&self, id: A::Id) -> Result<A, LoadError> {
        load_aggregate::<A>(&self.pool, id, &self.upcasters).await
    }

    /// Decides `command` against the current state of aggregate `id` and records its events.
    pub async fn execute<C: Command>(
        &self,
        id: <C::Aggregate as Aggregate>::Id,
        command: &C,
        context: &CommandContext,
    ) -> Result<CommandOutcome<C::Aggregate>, CommandError<<C::Aggregate as Aggregate>::Error>>
    {
        let aggregate_type = <C::Aggregate as Aggregate>::TYPE;
        let aggregate_id = id.as_uuid();
        let request = request_of(id, command);
        if let Some(key) = &context.idempotency_key {
            if key.is_empty() || key.chars().count() > 200 {
                return Err(CommandError::InvalidKey);
            }
            if let Some(outcome) = self.recorded::<C::Aggregate>(key, &request).await? {
                return Ok(outcome);
            }
        }
        // A new aggregate needs no read: decide against an empty history and let the unique version
        // constraint catch an id that already exists.
        let mut state = if command.creates() && context.expected_version.unwrap_or(0) == 0 {
            C::Aggregate::new(id)
        } else {
            self.load_as::<C::Aggregate>(id).await?
        };
        let causation_id = Uuid::now_v7();
        let correlation_id = context.correlation_id.unwrap_or(causation_id);
        let mut attempt = 0;
        loop {
            attempt += 1;
            // An unknown aggregate is "not found" whatever version the caller expected.
            if state.version() == 0 && !command.creates() {
                return Err(CommandError::Refused(C::Aggregate::not_found(id)));
            }
            if let Some(expected) = context.expected_version
                && state.version() != expected
            {
                return Err(CommandError::StaleVersion {
                    aggregate_type,
                    aggregate_id,
                    expected,
                    actual: state.version(),
                });
            }
            let events = match state.decide(command) {
                Ok(events) => events,
                Err(refusal) => {
                    // A retry that raced its own first attempt: the first check found no record
                    // while the first attempt was still writing, and the state read since is the
                    // one that attempt left (an order already paid refuses a second payment). The
                    // record committed with those events: answer with it, not with the refusal.
                    if let Some(key) = &context.idempotency_key
                        && let Some(outcome) = self.recorded::<C::Aggregate>(key, &request).await?
                    {
                        return Ok(outcome);
                    }
                    return Err(CommandError::Refused(refusal));
                }
            };
            let now = now();
            let envelopes: Vec<EventEnvelope> = events
                .iter()
                .zip(state.version() + 1..)
                .map(|(event, version)| {
                    let meta = EventMeta {
                        event_id: Uuid::now_v7(),
                        occurred_at: now,
                        correlation_id: Some(correlation_id),
                        causation_id: Some(causation_id),
                    };
                    EventEnvelope::wrap_as::<C::Aggregate>(
                        event,
                        id,
                        version,
                        meta,
                        &self.writes,
                        &self.upcasters,
                    )
                })
                .collect::<Result<_, _>>()
                .map_err(|error| match error {
                    DowncastError::Unrepresentable { .. } => CommandError::Unrepresentable(error),
                    other => CommandError::WriteVersion(other),
                })?;
            let options = AppendOptions {
                idempotency: context
                    .idempotency_key
                    .clone()
                    .map(|k| (k, request.clone())),
                traceparent: context.traceparent.clone(),
            };
            match append_with(
                &self.pool,
                self.group.as_ref(),
                aggregate_id,
                state.version(),
                &envelopes,
                &options,
            )
            .await
            {
                Ok(written) => {
                    if let Some(notifier) = &self.notifier {
                        notifier.poke();
                    }
                    let state = events.iter().fold(state, |state, e| state.apply(e));
                    return Ok(CommandOutcome {
                        id,
                        aggregate_version: written.aggregate_version,
                        event_ids: written.event_ids,
                        replayed: false,
                        state,
                    });
                }
                Err(AppendError::VersionConflict {
                    expected, actual, ..
                }) => {
                    if context.expected_version.is_some() {
                        return Err(CommandError::StaleVersion {
                            aggregate_type,
                            aggregate_id,
                            expected,
                            actual,
                        });
                    }
                    if attempt > CONFLICT_RETRIES {
                        return Err(CommandError::Conflict {
                            aggregate_type,
                            aggregate_id,
                            expected,
                            actual,
                        });
                    }
                    tracing::debug!(aggregate_type, %aggregate_id, attempt, expected, actual, "lost a race; deciding again");
                    state = self.load_as::<C::Aggregate>(id).await?;
                }
                Err(AppendError::IdempotencyKeyTaken(key)) => {
                    // A concurrent request with the same key committed first.
                    return match self.recorded::<C::Aggregate>(&key, &request).await? {
                        Some(outcome) => Ok(outcome),
                        None => Err(CommandError::Append(AppendError::IdempotencyKeyTaken(key))),
                    };
                }
                Err(AppendError::Locked { .. }) => {
                    return Err(CommandError::Locked {
                        aggregate_type,
                        aggregate_id,
                    });
                }
                Err(other) => return Err(CommandError::Append(other)),
            }
        }
    }

    /// The recorded result of an earlier request with `key`, if there was one.
    async fn recorded<A: Aggregate>(
        &self,
        key: &str,
        request: &Value,
    ) -> Result<Option<CommandOutcome<A>>, CommandError<A::Error>> {
        let Some(record) = sqlx::query_as::<_, IdempotencyRecord>(
            "SELECT request, aggregate_id, aggregate_version, event_ids
             FROM command_idempotency WHERE idempotency_key = $1",
        )
        .bind(key)
        .fetch_optional(&self.pool)
        .await?
        else {
            return Ok(None);
        };
        if &record.request != request {
            return Err(CommandError::KeyReused(key.to_owned()));
        }
        let id = A::Id::from_uuid(record.aggregate_id);
        Ok(Some(CommandOutcome {
            id,
            aggregate_version: record.aggregate_version,
            event_ids: record.event_ids,
            replayed: true,
            state: self.load_as::<A>(id).await?,
        }))
    }
}

/// What the first request with an idempotency key recorded (`command_idempotency`).
#[derive(sqlx::FromRow)]
struct IdempotencyRecord {
    request: Value,
    aggregate_id: Uuid,
    aggregate_version: i64,
    event_ids: Vec<Uuid>,
}

/// The request as recorded with an idempotency key. A new aggregate's id is left out: a retried
/// `place` arrives with a freshly generated id and must still be recognised. An order's request keeps
/// the shape it always had (`order_id`), so keys recorded before other aggregate types existed still
/// match; any other type's names its type and `aggregate_id`.
fn request_of<C: Command>(id: <C::Aggregate as Aggregate>::Id, command: &C) -> Value {
    let mut request = serde_json::to_value(command).expect(
        "a command is a tagged struct of strings, integers and lists of them; serializing it into a \
         `Value` cannot fail",
    );
    let is_order = <C::Aggregate as Aggregate>::TYPE == Order::TYPE;
    if !is_order {
        request["aggregate_type"] = json!(<C::Aggregate as Aggregate>::TYPE);
    }
    if !command.creates() {
        let key = if is_order { "order_id" } else { "aggregate_id" };
        request[key] = json!(id.as_uuid());
    }
    request
}

/// Now, at the microsecond precision PostgreSQL stores, so a loaded envelope equals the written one.
fn now() -> DateTime<Utc> {
    Utc::now().trunc_subsecs(6)
}
