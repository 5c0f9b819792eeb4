//! The one runner every projection shares: its settings and its connections. A message goes through
//! one pipeline, each stage a module that calls only the stages after it:
//!
//! ```text
//! consume ─▶ decode ─▶ apply (ONE transaction) ─────────────────────────▶ ack / term / nak
//!  (pull,     (bytes →   ├─ plan + checkpoint: duplicate, next, or gap       (consume, after
//!   route)     event)    ├─ held: gaps wait here      park: poison here       the commit)
//!                        └─ the projection's own tables, checkpoints moved
//! ```
//!
//! Before it, when `consume` starts a partition: the durable consumer (`consumer`), the catch-up from
//! the event store (`catch_up` through `history`), the handover a rebuild left (`handover`), and the
//! partition leases (`lease`). Above it, calling it and never called by it: blue/green `rebuild`,
//! the operator's `actions` (release, discard, redrive: they re-enter `apply` like a delivery), the
//! `cli` and the `operator_api`. Every stage counts into `tally` and `metrics`, which call none.
//!
//! Exactly once in effect: a version at or below the checkpoint is a duplicate (acked, not applied);
//! the next version is applied and moves the checkpoint in the same transaction; a later version is
//! held in the projection's own database (and acked) until its predecessor is applied. A crash between
//! commit and ack redelivers messages that are now duplicates.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use domain::Upcasters;
use sqlx::{PgConnection, PgPool};

use crate::apply::{ApplyError, OnPoison, decide_and_apply};
use crate::decode::RawMessage;
use crate::partition::Partitions;
use crate::plan::Verdict;
use crate::projection::Projection;
use crate::schema::{self, SchemaError};
pub use crate::tally::Tally;

/// How a batch's statements are planned, set with its `BEGIN` (no extra round trip). Each batch's
/// statements find rows by key (`= ANY($1)`, `ON CONFLICT`), so one generic plan per statement serves
/// every batch: planned each time instead (the session's `force_custom_plan`), the checkpoint read
/// spent ~150 µs planning for ~40 µs of work, and the projections' planning was more than their
/// statements' execution at 1,000 events/s. Sequential scans are priced out while planning because a
/// generic plan is made once and kept: made on a nearly empty table (right after a rebuild) it would
/// otherwise scan that table as it grows — the reason the session plans each statement afresh.
const BATCH_PLANS: &str =
    "SET LOCAL plan_cache_mode = force_generic_plan; SET LOCAL enable_seqscan = off";

/// Why a runner could not connect.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The projection's schema could not be opened.
    #[error(transparent)]
    Schema(#[from] SchemaError),
    /// NATS could not be reached or refused the login.
    #[error("connecting the {projection} projection to NATS")]
    Nats {
        projection: &'static str,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// Where the runner reads from and how it batches.
#[derive(Debug, Clone)]
pub struct RunnerConfig {
    /// JetStream stream holding the events.
    pub stream: String,
    /// Subject prefix the relay publishes under.
    pub subject_prefix: String,
    /// Messages applied per transaction at most.
    pub batch_size: usize,
    /// How long the broker waits for an ack before redelivering.
    pub ack_wait: Duration,
    /// Unacknowledged messages the broker lets this consumer hold.
    pub max_ack_pending: i64,
    /// When what had already arrived behind a batch's first message was a backlog (a replay, a
    /// catch-up), how long at most to wait for more before applying (what arrives meanwhile, up to
    /// `batch_size`, joins the batch). An idle or lightly loaded consumer never waits (`consume.rs`).
    pub linger: Duration,
    /// Where to stop on purpose (tests reproduce crashes with it).
    pub fail_point: FailPoint,
    /// The newest payload version to accept per event type (`--max-version`): newer ones are parked
    /// as an older binary would park them, to rehearse a rollout. Empty: every version this code knows.
    pub max_versions: Vec<(String, i32)>,
    /// How many partitions the orders are split into and which this instance applies
    /// (`--partitions`, `--partition`); one partition by default, today's single consumer.
    pub partitions: Partitions,
    /// The event store's database, whose `events` table a consumer that starts (a first start, a
    /// rebuild, one behind the stream) catches up from (`--events-url`); `None`: the projection's
    /// own database.
    pub events_url: Option<String>,
    /// Share the partitions with the projection's other instances through leases (`lease.rs`)
    /// instead of applying `partitions.owned()` as given: set when P > 1 and no `--partition` list
    /// was given. `run --once` applies every partition all the same.
    pub share: bool,
    /// How long a partition lease lasts unrenewed (`--lease-time`): the bound on how long a dead or
    /// frozen instance's partitions wait for another instance.
    pub lease_time: Duration,
}

impl Default for RunnerConfig {
    fn default() -> Self {
        Self {
            stream: domain::wire::DEFAULT_STREAM.to_owned(),
            subject_prefix: domain::wire::DEFAULT_SUBJECT_PREFIX.to_owned(),
            batch_size: 500,
            ack_wait: Duration::from_secs(30),
            max_ack_pending: 10_000,
            linger: Duration::from_millis(2),
            fail_point: FailPoint::None,
            max_versions: Vec::new(),
            partitions: Partitions::single(),
            events_url: None,
            share: false,
            lease_time: crate::lease::DEFAULT_LEASE_TIME,
        }
    }
}

/// Deliberate stops, to reproduce crashes. Only `None` exists unless the `fault-injection` feature
/// (the tests, the demo) is on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum FailPoint {
    /// Run normally.
    #[default]
    None,
    /// Abort the process after a batch committed, before any ack is sent.
    #[cfg(feature = "fault-injection")]
    AbortAfterCommit,
    /// Fail a rebuild after the new state is built, before it is swapped in.
    #[cfg(feature = "fault-injection")]
    FailBeforeSwap,
    /// Abort the process right after a rebuild's swap commits, before any consumer is moved.
    #[cfg(feature = "fault-injection")]
    AbortAfterSwap,
    /// Abort the process while a rebuild's handover moves the live consumers, after the first.
    #[cfg(feature = "fault-injection")]
    AbortAfterFirstConsumerMoved,
}

/// The consumer runner for projection `P`.
#[derive(Debug)]
pub struct Runner<P> {
    pub(crate) projection: Arc<P>,
    pub(crate) pool: PgPool,
    pub(crate) jetstream: jetstream::Context,
    pub(crate) client: async_nats::Client,
    pub(crate) config: RunnerConfig,
    pub(crate) upcasters: Upcasters,
    pub(crate) database_url: String,
    /// Where its state lives: the projection's name, or a rebuild's schema beside it.
    pub(crate) schema: String,
    /// Its durable consumer: the projection's name, or a rebuild's own.
    pub(crate) consumer_name: String,
    /// The partitions this instance applies now: `partitions.owned()`, or, when sharing, those
    /// it holds leases for (the partition loops and `/health` follow it).
    pub(crate) owned: Arc<tokio::sync::watch::Sender<std::collections::BTreeSet<u32>>>,
    /// This instance's name in the partition leases and `/health`.
    pub(crate) instance: String,
}

impl<P: Projection> Runner<P> {
    /// Connects, creates the projection's schema and tables when missing.
    pub async fn connect(
        projection: P,
        database_url: &str,
        nats: impl Into<ops::NatsConnection>,
        config: RunnerConfig,
    ) -> Result<Self, ConnectError> {
        let pool = schema::connect(database_url, P::NAME, P::TABLES).await?;
        let client = nats
            .into()
            .connect(&format!("waybill-{}", P::NAME))
            .await
            .map_err(|source| ConnectError::Nats {
                projection: P::NAME,
                source: source.into(),
            })?;
        let jetstream = jetstream::new(client.clone());
        let config = split_by_the_stream::<P>(&jetstream, config).await;
        Ok(Self {
            projection: Arc::new(projection),
            pool,
            jetstream,
            client,
            upcasters: config
                .max_versions
                .iter()
                .fold(Upcasters::all(), |upcasters, (event_type, max)| {
                    upcasters.capped(event_type, *max)
                }),
            owned: Arc::new(tokio::sync::watch::Sender::new(if config.share {
                std::collections::BTreeSet::new()
            } else {
                config.partitions.owned().iter().copied().collect()
            })),
            config,
            database_url: database_url.to_owned(),
            schema: P::NAME.to_owned(),
            consumer_name: P::NAME.to_owned(),
            instance: crate::lease::instance_id(),
        })
    }

    /// The partitions this instance applies now, ascending (with leases: those it holds).
    pub fn owned_partitions(&self) -> Vec<u32> {
        self.owned.borrow().iter().copied().collect()
    }

    /// This instance's name among the projection's instances (the partition leases name it).
    pub fn instance(&self) -> &str {
        &self.instance
    }

    /// The projection's database pool (its schema first on the search path).
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The NATS client.
    pub fn client(&self) -> &async_nats::Client {
        &self.client
    }

    /// The settings.
    pub fn config(&self) -> &RunnerConfig {
        &self.config
    }

    /// Takes this state's whole turn: operators' actions (redrive, release, discard) and the swap of
    /// a rebuild wait for every batch of every partition, and batches wait for them.
    pub(crate) async fn lock(&self, tx: &mut PgConnection) -> sqlx::Result<()> {
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1))")
            .bind(self.turn_key(None))
            .execute(&mut *tx)
            .await?;
        Ok(())
    }

    /// The name of a turn's advisory lock (hashed by PostgreSQL): the whole state's, or a partition's.
    fn turn_key(&self, partition: Option<u32>) -> String {
        match partition {
            None => format!("waybill.projection.{}", self.schema),
            Some(partition) => format!(
                "waybill.projection.{}.partition.{}",
                self.schema,
                self.config.partitions.label(partition)
            ),
        }
    }

    /// Opens a batch's transaction holding its turn, in one round trip (the lock travels with
    /// `BEGIN`). `None`: the whole state's turn, as [`Runner::lock`] takes it. `Some(partition)`: the
    /// projection's lock shared (so the batches of different partitions run side by side, and
    /// [`Runner::lock`] still waits for all of them), then the partition's own lock, so two instances
    /// that both consume one partition (a handover) take turns as before. Orders are disjoint between
    /// partitions; the rows they share (stock per SKU, balances per customer) are written in key
    /// order, and a deadlock is retried anyway.
    async fn begin_turn(
        &self,
        partition: Option<u32>,
    ) -> Result<sqlx::Transaction<'static, sqlx::Postgres>, ApplyError> {
        // Quoted as literals: a simple query takes no parameters.
        let key = |partition| {
            let name = self.turn_key(partition).replace('\'', "''");
            format!("hashtext('{name}')")
        };
        let lock = match partition {
            None => format!("pg_advisory_xact_lock({})", key(None)),
            Some(_) => format!(
                "pg_advisory_xact_lock_shared({}), pg_advisory_xact_lock({})",
                key(None),
                key(partition)
            ),
        };
        let begin = format!("BEGIN; {BATCH_PLANS}; SELECT {lock}");
        self.pool
            .begin_with(sqlx::AssertSqlSafe(begin))
            .await
            .map_err(ApplyError::Begin)
    }

    /// Decides and applies a batch in one transaction; returns one verdict per message. Nothing is
    /// acked here: the caller acks after this returns, so a crash in between only redelivers.
    pub async fn apply_batch(&self, messages: &[RawMessage]) -> Result<Vec<Verdict>, ApplyError> {
        let tx = self.begin_turn(None).await?;
        self.decide_and_commit(tx, messages).await
    }

    /// [`Runner::apply_batch`] for one partition's messages, beside the other partitions' batches. A
    /// batch that deadlocks with another partition's (or fails serialization) rolled back entirely,
    /// so it is simply run again: nothing was applied, nothing is applied twice.
    pub(crate) async fn apply_partition_batch(
        &self,
        partition: u32,
        messages: &[RawMessage],
    ) -> Result<Vec<Verdict>, ApplyError> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let outcome = async {
                let tx = self.begin_turn(Some(partition)).await?;
                self.decide_and_commit(tx, messages).await
            }
            .await;
            match outcome {
                Err(error) if attempt < CONFLICT_RETRIES && is_conflict(&error) => {
                    crate::metrics::record_conflict(P::NAME);
                    tracing::info!(
                        projection = P::NAME,
                        partition = %self.config.partitions.label(partition),
                        attempt,
                        error = %ops::error_chain(&error),
                        "batch conflicted with another partition's; running it again"
                    );
                    tokio::time::sleep(Duration::from_millis(10 * u64::from(attempt))).await;
                }
                outcome => return outcome,
            }
        }
    }

    async fn decide_and_commit(
        &self,
        mut tx: sqlx::Transaction<'static, sqlx::Postgres>,
        messages: &[RawMessage],
    ) -> Result<Vec<Verdict>, ApplyError> {
        let decisions = decide_and_apply(
            &mut tx,
            &*self.projection,
            &self.upcasters,
            messages,
            None,
            OnPoison::Park,
        )
        .await?;
        tx.commit().await.map_err(ApplyError::Commit)?;
        Ok(decisions.into_iter().map(|(verdict, _)| verdict).collect())
    }
}

/// How many times a batch that deadlocked or failed serialization is run before it counts as failed
/// (and is then applied message by message, as any failing batch).
const CONFLICT_RETRIES: u32 = 5;

/// True for a deadlock (40P01), a serialization failure (40001) or checkpoints moved under the batch:
/// the transaction was rolled back because of another one, not because of what it holds.
pub(crate) fn is_conflict(error: &ApplyError) -> bool {
    if matches!(error, ApplyError::CheckpointsMoved { .. }) {
        return true;
    }
    sqlx_causes(error).any(|cause| {
        matches!(cause, sqlx::Error::Database(db) if matches!(db.code().as_deref(), Some("40P01" | "40001")))
    })
}

/// The database errors in `error`'s chain of causes, outermost first.
pub(crate) fn sqlx_causes(error: &ApplyError) -> impl Iterator<Item = &sqlx::Error> {
    std::iter::successors(Some(error as &(dyn std::error::Error + 'static)), |cause| {
        cause.source()
    })
    .filter_map(|cause| cause.downcast_ref::<sqlx::Error>())
}

/// `config` with its partitions split by the server when the stream splits exactly as many
/// (`waybill-relay provision --stream-partitions P`); otherwise as it was, each partition's consumer
/// reading the whole stream. A stream that cannot be read yet (not provisioned) splits nothing: the
/// next start looks again, and its consumers have names of their own (`partition.rs`).
async fn split_by_the_stream<P: Projection>(
    jetstream: &jetstream::Context,
    mut config: RunnerConfig,
) -> RunnerConfig {
    let count = config.partitions.count();
    if count <= 1 {
        return config;
    }
    let split = match jetstream.get_stream(&config.stream).await {
        Ok(stream) => Some(ops::stream_partitions(
            &stream.cached_info().config,
            &config.subject_prefix,
        )),
        Err(_) => None,
    };
    match split {
        Some(split) if split == count => {
            tracing::info!(
                projection = P::NAME,
                partitions = count,
                "the stream splits the partitions: each partition's consumer is delivered its own events only"
            );
            config.partitions = config.partitions.split_by_server();
        }
        Some(split) if split > 1 => tracing::warn!(
            projection = P::NAME,
            partitions = count,
            stream_partitions = split,
            "the stream splits another number of partitions: each of this projection's partition consumers reads the whole stream"
        ),
        _ => tracing::info!(
            projection = P::NAME,
            partitions = count,
            "the stream does not split partitions: each partition's consumer reads the whole stream (waybill-relay provision --stream-partitions P splits it at the broker)"
        ),
    }
    config
}
