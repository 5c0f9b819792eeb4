//! The relay handle: its connections, its settings and one step of a lane. How it runs lives below:
//! [`lanes`] (`run`: the lanes' step loops until shutdown), [`drain`] (`run --once`), [`wake`] (the
//! notification listener), [`chores`] (gauges, journal pruning, retention sweep), [`gate`] (standing
//! by while a WAL relay reads the slot), [`summary`] (the totals).

mod chores;
mod drain;
mod gate;
mod lanes;
mod summary;
mod wake;

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use async_nats::connection::State;
use async_nats::jetstream;
use sqlx::PgPool;

use crate::admin;
use crate::config::RelayConfig;
use crate::metrics;
use crate::peers::Seat;
use crate::step::{FailPoint, StepError, StepReport, step};
use crate::stream::{ProvisionError, ensure_stream};

pub(crate) use chores::Chores;
pub use summary::RunSummary;

/// Why [`Relay::connect`] failed.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// PostgreSQL refused or did not answer.
    #[error("opening the relay's PostgreSQL pool failed")]
    Database(#[source] sqlx::Error),
    /// The NATS URL, credentials or TLS files are wrong, or the server did not answer.
    #[error("opening the relay's NATS connection failed")]
    Nats(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// A relay instance: a database pool, a NATS connection and its settings.
#[derive(Debug, Clone)]
pub struct Relay {
    pool: PgPool,
    /// The same database with `synchronous_commit = on`, for the publish journal only.
    journal_pool: PgPool,
    client: async_nats::Client,
    jetstream: jetstream::Context,
    config: RelayConfig,
    stopping: Arc<AtomicBool>,
    fail_point: FailPoint,
    /// When this relay last looked for other relays' stalled claims.
    last_reap: Arc<Mutex<Option<Instant>>>,
}

impl Relay {
    /// Connects to PostgreSQL and NATS. Claim transactions left idle longer than
    /// `config.claim_idle_timeout` are ended by PostgreSQL, which releases a hung relay's rows.
    pub async fn connect(
        database_url: &str,
        nats: impl Into<ops::NatsConnection>,
        config: RelayConfig,
    ) -> Result<Self, ConnectError> {
        let idle = format!("{}ms", config.claim_idle_timeout.as_millis());
        let pool = ops::database::connect_with(
            database_url,
            // The prefix is how relays recognise each other's sessions (`waybill_end_stale_claims`).
            &format!("{}{}", crate::config::APPLICATION_PREFIX, config.relay_id),
            // Per lane: the claim transaction (the journal has its own pool); plus the gauges,
            // the notification listener (which keeps its connection) and the retention sweep.
            config.lane_count().saturating_add(3),
            &[
                ("idle_in_transaction_session_timeout", idle),
                // A lost mark (PostgreSQL crashing within ~0.6 s of the commit) only means the rows are
                // published again and JetStream drops the duplicates; waiting for the WAL flush on
                // every step would buy nothing. The events themselves are written with synchronous
                // commit by the command side.
                ("synchronous_commit", "off".to_owned()),
                // Every relay statement is short and index-driven, but the planner's cost of a count
                // over a large outbox passed `jit_above_cost`, and `run --once` spent ~100 ms
                // compiling expressions for a statement that then found nothing.
                ("jit", "off".to_owned()),
                // The settle statement (three UPDATEs over UNNESTed arrays) was planned again on every
                // execution under the default `auto`: pg_stat_statements in the pipeline benchmark
                // counted ~290 µs of planning per step against ~280 µs of execution. Every relay
                // statement looks rows up by key (`id`, `ctid`, the claim's index), so the generic plan
                // is the plan; claims also turn sequential scans off (`relaying::begin`).
                ("plan_cache_mode", "force_generic_plan".to_owned()),
            ],
        )
        .await
        .map_err(ConnectError::Database)?;
        let client = nats
            .into()
            .connect(&config.relay_id)
            .await
            .map_err(|error| ConnectError::Nats(error.into()))?;
        Ok(Self::new(pool, client, config))
    }

    /// A relay over existing connections.
    ///
    /// The publish journal gets a pool of its own (one connection per lane, opened when first used)
    /// over `pool`'s connect options with `synchronous_commit = on`: its record must survive a
    /// PostgreSQL crash, and a session setting lets it be written in one round trip.
    pub fn new(pool: PgPool, client: async_nats::Client, config: RelayConfig) -> Self {
        let journal_options = (*pool.connect_options())
            .clone()
            .options([("synchronous_commit", "on")]);
        let journal_pool =
            ops::database::pool_options(config.lane_count()).connect_lazy_with(journal_options);
        let jetstream = jetstream::context::ContextBuilder::new()
            .timeout(config.effective_publish_timeout())
            // Every lane may have `max_in_flight` publishes outstanding: lanes must not wait on each
            // other's permits, or a step could outlive its claim.
            .max_ack_inflight(config.max_in_flight.max(1) * config.lanes.max(1))
            .backpressure_on_inflight(true)
            .build(client.clone());
        Self {
            pool,
            journal_pool,
            client,
            jetstream,
            config,
            stopping: Arc::new(AtomicBool::new(false)),
            fail_point: FailPoint::None,
            last_reap: Arc::new(Mutex::new(None)),
        }
    }

    /// Stops every step at `fail_point` (to reproduce the crash window).
    #[cfg(feature = "fault-injection")]
    pub fn with_fail_point(mut self, fail_point: FailPoint) -> Self {
        self.fail_point = fail_point;
        self
    }

    /// The settings.
    pub fn config(&self) -> &RelayConfig {
        &self.config
    }

    /// The database pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The NATS client.
    pub fn client(&self) -> &async_nats::Client {
        &self.client
    }

    /// The JetStream context it publishes through.
    pub fn jetstream(&self) -> &jetstream::Context {
        &self.jetstream
    }

    /// Creates or verifies the stream (see [`ensure_stream`]).
    pub async fn provision(&self, update: bool) -> Result<jetstream::stream::Info, ProvisionError> {
        ensure_stream(&self.jetstream, &self.config.stream, update).await
    }

    /// One claim–publish–settle step over every aggregate (after ending other relays' stalled
    /// claims, at most once a second).
    pub async fn step(&self) -> Result<StepReport, StepError> {
        self.step_lane(None, None).await
    }

    /// A step of lane `lane` (`None`: every aggregate): with several lanes, each claims only its own
    /// share of the aggregates, so that lanes never compete for the same heads; with a `seat` among
    /// other relays (see [`crate::peers`]), only its share of this relay's share.
    async fn step_lane(
        &self,
        lane: Option<usize>,
        seat: Option<Seat>,
    ) -> Result<StepReport, StepError> {
        let ended = self.end_stale_claims().await.map_err(StepError::Claim)?;
        let alone = Seat::alone(self.config.lane_count());
        let share = lane.and_then(|lane| seat.unwrap_or(alone).share(u32::try_from(lane).ok()?));
        let mut report = step(
            &self.pool,
            &self.journal_pool,
            &self.jetstream,
            &self.config,
            &self.stopping,
            &self.fail_point,
            share,
        )
        .await?;
        report.stale_claims_ended = usize::try_from(ended).unwrap_or(usize::MAX);
        Ok(report)
    }

    /// Ends claim transactions of relays that stopped mid-claim (older than the claim timeout): a relay
    /// frozen while PostgreSQL was still sending it rows keeps its backend `active`, which
    /// `idle_in_transaction_session_timeout` never ends. Returns how many it ended (0 when it looked
    /// less than a second ago), or why it could not look: "none ended" is never a guess.
    pub async fn end_stale_claims(&self) -> sqlx::Result<u64> {
        {
            // The guarded value is a timestamp, whole whatever panicked while it was held.
            let mut last = self
                .last_reap
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if last.is_some_and(|at| at.elapsed() < Duration::from_secs(1)) {
                return Ok(0);
            }
            *last = Some(Instant::now());
        }
        let ended = admin::end_stale_claims(&self.pool, self.config.stale_claim_age()).await?;
        if ended > 0 {
            tracing::warn!(
                ended,
                older_than = ?self.config.stale_claim_age(),
                "ended stalled claim transactions of other relays; their rows are free again"
            );
            metrics::record_stale_claims_ended(ended);
        }
        Ok(ended)
    }

    /// True when the database answers and NATS is connected.
    pub async fn health(&self) -> (bool, serde_json::Value) {
        let database = sqlx::query("SELECT 1").execute(&self.pool).await.is_ok();
        let nats = self.client.connection_state() == State::Connected;
        (
            database && nats,
            serde_json::json!({"database": database, "nats": nats, "relay_id": self.config.relay_id}),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use ops::error_chain;

    use testkit::assert_no_clause_repeats as assert_said_once;

    #[test]
    fn a_step_error_chain_says_each_cause_once() {
        let io = || std::io::Error::other("connection refused");
        let error = StepError::Claim(sqlx::Error::Io(io()));
        let printed = error_chain(&error);
        assert_said_once(&printed);
        assert_eq!(
            printed,
            "claiming outbox rows failed: error communicating with database: connection refused"
        );

        let error = StepError::LostBeforePublish(sqlx::Error::PoolTimedOut);
        let printed = error_chain(&error);
        assert_said_once(&printed);
        assert!(printed.ends_with(": pool timed out while waiting for an open connection"));
    }

    #[test]
    fn a_connect_error_chain_says_each_cause_once() {
        let error = ConnectError::Database(sqlx::Error::PoolTimedOut);
        let printed = error_chain(&error);
        assert_said_once(&printed);
        assert_eq!(
            printed,
            "opening the relay's PostgreSQL pool failed: pool timed out while waiting for an open \
             connection"
        );

        // As `ops::NatsConnection::connect` fails: the address in its context, the cause below it.
        let why = anyhow::anyhow!("connection refused").context("connecting to NATS at nats://x:1");
        let error = ConnectError::Nats(why.into());
        let printed = error_chain(&error);
        assert_said_once(&printed);
        assert_eq!(
            printed,
            "opening the relay's NATS connection failed: connecting to NATS at nats://x:1: \
             connection refused"
        );
    }

    #[test]
    fn a_provision_error_chain_says_each_cause_once() {
        let error = ProvisionError::JetStream(Box::new(std::io::Error::other("timed out")));
        let printed = error_chain(&error);
        assert_said_once(&printed);
        assert_eq!(printed, "JetStream request failed: timed out");
    }

    #[test]
    fn a_cause_its_error_already_quotes_is_printed_once() {
        let decode = serde_json::from_str::<serde_json::Value>("{").expect_err("garbage");
        let why = decode.to_string();
        let error = StepError::Claim(sqlx::Error::Decode(Box::new(decode)));
        let printed = error_chain(&error);
        assert_said_once(&printed);
        assert_eq!(
            printed,
            format!("claiming outbox rows failed: error occurred while decoding: {why}")
        );
    }
}
