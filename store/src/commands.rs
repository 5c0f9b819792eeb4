//! Running a command end to end: load, decide, append — with optimistic concurrency, retries on a lost
//! race, and idempotency keys that make a retried request return its original result.

use std::sync::Arc;

use chrono::{DateTime, SubsecRound, Utc};
use domain::{
    DowncastError, EventEnvelope, EventMeta, Order, OrderCommand, OrderError, OrderId, Upcasters,
    WriteVersions,
};
use serde_json::{Value, json};
use sqlx::PgPool;
use uuid::Uuid;

use crate::append::{AppendError, AppendOptions, append_with};
use crate::group_commit::GroupCommit;
use crate::load::{LoadError, load_order};
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

/// What a command did.
#[derive(Debug, Clone)]
pub struct CommandOutcome {
    /// The order.
    pub order_id: OrderId,
    /// The order's version after the command.
    pub aggregate_version: i64,
    /// The events the command recorded.
    pub event_ids: Vec<Uuid>,
    /// True when this is a retry answered from the idempotency record (nothing was written).
    pub replayed: bool,
    /// The order's state right after the command; for a replay, its current state (it may have moved
    /// on since the first request).
    pub order: Order,
}

/// Why a command did not complete. [`CommandError::is_refusal`] tells a caller's mistake from a fault.
#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    /// A domain rule refused the command; nothing was written.
    #[error(transparent)]
    Refused(#[from] OrderError),
    /// The caller required a version (`If-Match`, `--expected-version`) the order is no longer at.
    #[error("order {order_id} is at version {actual}, not the expected {expected}")]
    StaleVersion {
        /// The order.
        order_id: OrderId,
        /// The version the caller required.
        expected: i64,
        /// The version found.
        actual: i64,
    },
    /// Concurrent writers kept winning the race; retrying later may succeed.
    #[error("order {order_id} is at version {actual}, not {expected}: it was changed concurrently")]
    Conflict {
        /// The order.
        order_id: OrderId,
        /// The version the command was decided against.
        expected: i64,
        /// The version found.
        actual: i64,
    },
    /// Another transaction holds the order (another writer wrote its next version and has not
    /// committed, or holds its rows locked) for longer than the lock timeout: nothing was written;
    /// retrying shortly may succeed. Every other order is written meanwhile.
    #[error(
        "order {order_id} is locked by another transaction (another writer holds it, uncommitted): nothing was written; retry shortly"
    )]
    Locked {
        /// The order.
        order_id: OrderId,
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
    /// The order's history could not be read.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// Writing failed.
    #[error(transparent)]
    Append(AppendError),
    /// The database failed.
    #[error("database error")]
    Database(#[from] sqlx::Error),
}

impl CommandError {
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
    /// A store on `pool` that reads order events with the standard upcasters.
    pub fn new(pool: PgPool) -> Self {
        crate::alone::describe_metrics();
        Self {
            pool,
            upcasters: Arc::new(Upcasters::orders()),
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
        load_order(&self.pool, order_id, &self.upcasters).await
    }

    /// Decides `command` against the current state of `order_id` and records its events.
    pub async fn execute(
        &self,
        order_id: OrderId,
        command: &OrderCommand,
        context: &CommandContext,
    ) -> Result<CommandOutcome, CommandError> {
        let request = request_of(order_id, command);
        if let Some(key) = &context.idempotency_key {
            if key.is_empty() || key.chars().count() > 200 {
                return Err(CommandError::InvalidKey);
            }
            if let Some(outcome) = self.recorded(key, &request).await? {
                return Ok(outcome);
            }
        }
        // A new order needs no read: decide against an empty history and let the unique version
        // constraint catch an id that already exists.
        let mut order = match command {
            OrderCommand::Place(_) if context.expected_version.unwrap_or(0) == 0 => {
                Order::new(order_id)
            }
            _ => self.load(order_id).await?,
        };
        let causation_id = Uuid::now_v7();
        let correlation_id = context.correlation_id.unwrap_or(causation_id);
        let mut attempt = 0;
        loop {
            attempt += 1;
            // An unknown order is "not found" whatever version the caller expected.
            if order.status == domain::OrderStatus::New
                && !matches!(command, OrderCommand::Place(_))
            {
                return Err(OrderError::NotFound(order_id).into());
            }
            if let Some(expected) = context.expected_version
                && order.version != expected
            {
                return Err(CommandError::StaleVersion {
                    order_id,
                    expected,
                    actual: order.version,
                });
            }
            let events = match order.decide(command) {
                Ok(events) => events,
                Err(refusal) => {
                    // A retry that raced its own first attempt: the first check found no record
                    // while the first attempt was still writing, and the state read since is the
                    // one that attempt left (an order already paid refuses a second payment). The
                    // record committed with those events: answer with it, not with the refusal.
                    if let Some(key) = &context.idempotency_key
                        && let Some(outcome) = self.recorded(key, &request).await?
                    {
                        return Ok(outcome);
                    }
                    return Err(refusal.into());
                }
            };
            let now = now();
            let envelopes: Vec<EventEnvelope> = events
                .iter()
                .zip(order.version + 1..)
                .map(|(event, version)| {
                    let meta = EventMeta {
                        event_id: Uuid::now_v7(),
                        occurred_at: now,
                        correlation_id: Some(correlation_id),
                        causation_id: Some(causation_id),
                    };
                    EventEnvelope::wrap_as::<domain::Order>(
                        event,
                        order_id,
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
                order_id.as_uuid(),
                order.version,
                &envelopes,
                &options,
            )
            .await
            {
                Ok(written) => {
                    if let Some(notifier) = &self.notifier {
                        notifier.poke();
                    }
                    let order = events.iter().fold(order, Order::apply);
                    return Ok(CommandOutcome {
                        order_id,
                        aggregate_version: written.aggregate_version,
                        event_ids: written.event_ids,
                        replayed: false,
                        order,
                    });
                }
                Err(AppendError::VersionConflict {
                    expected, actual, ..
                }) => {
                    if context.expected_version.is_some() {
                        return Err(CommandError::StaleVersion {
                            order_id,
                            expected,
                            actual,
                        });
                    }
                    if attempt > CONFLICT_RETRIES {
                        return Err(CommandError::Conflict {
                            order_id,
                            expected,
                            actual,
                        });
                    }
                    tracing::debug!(%order_id, attempt, expected, actual, "lost a race; deciding again");
                    order = self.load(order_id).await?;
                }
                Err(AppendError::IdempotencyKeyTaken(key)) => {
                    // A concurrent request with the same key committed first.
                    return match self.recorded(&key, &request).await? {
                        Some(outcome) => Ok(outcome),
                        None => Err(CommandError::Append(AppendError::IdempotencyKeyTaken(key))),
                    };
                }
                Err(AppendError::Locked { .. }) => return Err(CommandError::Locked { order_id }),
                Err(other) => return Err(CommandError::Append(other)),
            }
        }
    }

    /// The recorded result of an earlier request with `key`, if there was one.
    async fn recorded(
        &self,
        key: &str,
        request: &Value,
    ) -> Result<Option<CommandOutcome>, CommandError> {
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
        let order_id = OrderId::from_uuid(record.aggregate_id);
        Ok(Some(CommandOutcome {
            order_id,
            aggregate_version: record.aggregate_version,
            event_ids: record.event_ids,
            replayed: true,
            order: self.load(order_id).await?,
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

/// The request as recorded with an idempotency key. A new order's id is left out: a retried `place`
/// arrives with a freshly generated id and must still be recognised.
fn request_of(order_id: OrderId, command: &OrderCommand) -> Value {
    let mut request = serde_json::to_value(command).expect(
        "a command is a tagged struct of strings, integers and lists of them; serializing it into a \
         `Value` cannot fail",
    );
    if !matches!(command, OrderCommand::Place(_)) {
        request["order_id"] = json!(order_id);
    }
    request
}

/// Now, at the microsecond precision PostgreSQL stores, so a loaded envelope equals the written one.
fn now() -> DateTime<Utc> {
    Utc::now().trunc_subsecs(6)
}
