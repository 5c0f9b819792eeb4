//! The relay handle and its loop: step while there is work, sleep when idle until a notification or the
//! polling backstop, stop gracefully when asked.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use async_nats::connection::State;
use async_nats::jetstream;
use ops::error_chain;
use serde::Serialize;
use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tokio::sync::Notify;

use crate::admin;
use crate::config::RelayConfig;
use crate::metrics;
use crate::peers::{Peers, Seat};
use crate::step::{FailPoint, StepError, StepReport, step};
use crate::stream::{ProvisionError, ensure_stream};

/// How far ahead `run --once` waits for failed rows to come due again (the first retries, 1 s and 5 s
/// by default), rather than leaving a transient failure behind.
const RETRY_WAIT: Duration = Duration::from_secs(10);

/// How long a [`Relay::run`] lane may claim only its share among the relays sharing the outbox
/// before it claims once over every aggregate: a frozen relay keeps its slot, and its share must not
/// wait for it longer than this.
const UNSPLIT_EVERY: Duration = Duration::from_secs(1);

/// How a relay names its PostgreSQL sessions (`application_name`), followed by its relay id. Relays
/// end each other's stalled claims by this prefix; nothing else may use it.
pub(crate) const APPLICATION_PREFIX: &str = "waybill-relay ";

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

/// Totals over a run.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct RunSummary {
    /// Steps that claimed something.
    pub steps: u64,
    /// Rows claimed.
    pub claimed: u64,
    /// Rows acknowledged by JetStream.
    pub published: u64,
    /// Of those, duplicates.
    pub duplicates: u64,
    /// Failed publishes scheduled for retry.
    pub failed: u64,
    /// Rows that went dead.
    pub dead: u64,
    /// Rows marked sent.
    pub marked_sent: u64,
    /// Republished outside the dedupe window.
    pub republished_outside_window: u64,
    /// Rows the broker's fence showed were in the stream already (marked sent, not stored again).
    pub fenced: u64,
    /// Rows whose fence found the stream disagreeing with the store (not marked sent; retried with
    /// backoff).
    pub divergences: u64,
    /// Other relays' stalled claim transactions this relay ended.
    pub stale_claims_ended: u64,
    /// Steps that failed (claim or settle).
    pub step_errors: u64,
}

impl RunSummary {
    fn merge(&mut self, other: &RunSummary) {
        self.steps += other.steps;
        self.claimed += other.claimed;
        self.published += other.published;
        self.duplicates += other.duplicates;
        self.failed += other.failed;
        self.dead += other.dead;
        self.marked_sent += other.marked_sent;
        self.republished_outside_window += other.republished_outside_window;
        self.fenced += other.fenced;
        self.divergences += other.divergences;
        self.stale_claims_ended += other.stale_claims_ended;
        self.step_errors += other.step_errors;
    }

    fn add(&mut self, r: &StepReport) {
        self.steps += u64::from(r.claimed > 0);
        self.claimed += r.claimed as u64;
        self.published += r.published as u64;
        self.duplicates += r.duplicates as u64;
        self.failed += r.failed as u64;
        self.dead += r.dead as u64;
        self.marked_sent += r.marked_sent as u64;
        self.republished_outside_window += r.republished_outside_window as u64;
        self.fenced += r.fenced as u64;
        self.divergences += r.divergences as u64;
        self.stale_claims_ended += r.stale_claims_ended as u64;
    }
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
            &format!("{APPLICATION_PREFIX}{}", config.relay_id),
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

    /// Steps until nothing is claimable, then returns (`run --once`). Every lane drains in parallel.
    ///
    /// Rows that are due but locked by another relay are waited for: that relay either settles them
    /// or stalled, and a stalled claim is ended (by PostgreSQL, or by [`Relay::end_stale_claims`])
    /// within the claim timeout. So are failed rows due again within a few seconds. So `--once`
    /// leaves no row behind that a live relay could send now.
    pub async fn drain(&self) -> Result<RunSummary, StepError> {
        let mut summary = RunSummary::default();
        let mut waiting_since: Option<Instant> = None;
        let peers = Peers::join(&self.pool, self.config.lane_count()).await;
        loop {
            let mut round = RunSummary::default();
            let lanes = (0..self.config.lanes.max(1)).map(|lane| self.drain_lane(lane, &peers));
            for lane in futures::future::join_all(lanes).await {
                round.merge(&lane?);
            }
            summary.merge(&round);
            if self.stopping.load(Ordering::Relaxed)
                || self.client.connection_state() != State::Connected
            {
                return Ok(summary);
            }
            // Heads locked by another relay, or failed and due again within moments (a transient
            // publish failure): wait for them rather than leave them behind.
            let waiting = admin::any_head_due_within(&self.pool, RETRY_WAIT)
                .await
                .map_err(StepError::Claim)?;
            if !waiting {
                return Ok(summary);
            }
            if round.published > 0 {
                waiting_since = None;
            }
            let since = *waiting_since.get_or_insert_with(Instant::now);
            if since.elapsed() > self.config.stale_claim_age() * 2 + RETRY_WAIT {
                tracing::warn!("rows stay locked by another relay or keep failing; leaving them");
                return Ok(summary);
            }
            tracing::info!("rows are locked by another relay or retry shortly; waiting for them");
            summary.stale_claims_ended +=
                self.end_stale_claims().await.map_err(StepError::Claim)?;
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// One lane of [`Relay::drain`]: its share among the relays sharing the outbox until that is empty,
    /// then every aggregate (this relay's lanes still split), so that a drain never ends with rows a
    /// frozen or slower relay's share left behind.
    async fn drain_lane(&self, lane: usize, peers: &Peers) -> Result<RunSummary, StepError> {
        let mut summary = RunSummary::default();
        let mut lost_in_a_row = 0;
        let mut split = true;
        loop {
            let seat = peers.seat().filter(|seat| split && seat.relays > 1);
            let report = match self.step_lane(Some(lane), seat).await {
                Ok(report) => report,
                // A lost claim (or a claim whose session was ended while it was read) is not the end
                // of a drain: its rows are someone else's or free again, and the pool reconnects.
                // Failing over and over means the database is failing: give up then.
                Err(error) if lost_in_a_row < 5 => {
                    lost_in_a_row += 1;
                    tracing::warn!(error = %error_chain(&error), "a claim was lost; continuing");
                    tokio::time::sleep(Duration::from_millis(100) * lost_in_a_row).await;
                    summary.step_errors += 1;
                    if let StepError::Settle(_, report) = &error {
                        summary.add(&StepReport {
                            marked_sent: 0,
                            ..(**report).clone()
                        });
                    }
                    continue;
                }
                Err(error) => return Err(error),
            };
            lost_in_a_row = 0;
            summary.add(&report);
            if report.claimed == 0 && seat.is_some() {
                split = false;
                continue;
            }
            // Nothing attempted (NATS is disconnected, or the relay is stopping): claiming again would
            // only spin. What is left stays pending for the next run.
            let attempted = report.published + report.failed + report.dead + report.held_back;
            if report.claimed == 0 || report.simulated_crash || attempted == 0 {
                return Ok(summary);
            }
        }
    }

    /// Runs until `shutdown` resolves: steps without pause while batches come back full, otherwise
    /// waits for a notification from a writer or the polling backstop. On shutdown no new claim is
    /// made, the step in flight stops starting publishes, settles what was acknowledged and commits;
    /// its unpublished rows go back with the released locks.
    ///
    /// `config.lanes` steps run at once, each its own claim transaction, so one lane's database work
    /// overlaps another's publishing (they never share a row: the claim skips locked rows, and the
    /// head rule keeps an aggregate in one lane until its predecessor is sent).
    pub async fn run(&self, shutdown: impl Future<Output = ()> + Send + 'static) -> RunSummary {
        metrics::describe();
        let wakes: Vec<Arc<Notify>> = (0..self.config.lanes.max(1))
            .map(|_| Arc::new(Notify::new()))
            .collect();
        let stopper = {
            let (stopping, wakes) = (self.stopping.clone(), wakes.clone());
            tokio::spawn(async move {
                shutdown.await;
                stopping.store(true, Ordering::Relaxed);
                wakes.iter().for_each(|w| w.notify_one());
            })
        };
        let peers = Peers::join(&self.pool, self.config.lane_count()).await;
        let listener = tokio::spawn(listen(self.pool.clone(), wakes.clone()));
        let gauges = tokio::spawn(refresh_gauges(self.pool.clone()));
        let sweeper = self.config.retention.map(|retention| {
            tokio::spawn(sweep(
                self.pool.clone(),
                retention,
                self.config.retention_batch.max(1),
            ))
        });
        let totals = Arc::new(Mutex::new(RunSummary::default()));
        let lanes = wakes
            .iter()
            .enumerate()
            .map(|(lane, wake)| self.lane(lane, wake, &totals, &peers));
        futures::future::join_all(lanes).await;
        listener.abort();
        gauges.abort();
        if let Some(sweeper) = sweeper {
            sweeper.abort();
        }
        stopper.abort();
        // Counters stay whole whatever panicked while they were held: report them, never zeros.
        let summary = totals
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        tracing::info!(?summary, "relay stopped");
        summary
    }

    /// One lane of [`Relay::run`]: the step loop. It claims its share among the relays sharing the
    /// outbox, except right after such a claim found nothing and at least every [`UNSPLIT_EVERY`]:
    /// then over every aggregate, so that what a frozen relay's share holds still moves.
    async fn lane(&self, lane: usize, wake: &Notify, totals: &Mutex<RunSummary>, peers: &Peers) {
        let mut progress = Progress::new();
        let mut errors_in_a_row = 0u32;
        let mut nats_down_since: Option<Instant> = None;
        let mut split_next = true;
        let mut unsplit_at = Instant::now();
        while !self.stopping.load(Ordering::Relaxed) {
            // While NATS is unreachable nothing is claimed: publishing would only burn attempts.
            if self.client.connection_state() != State::Connected {
                if nats_down_since.is_none() && lane == 0 {
                    tracing::warn!("NATS is disconnected; not claiming until it is back");
                }
                nats_down_since.get_or_insert_with(Instant::now);
                self.idle(wake, self.config.poll_interval).await;
                continue;
            }
            if let Some(since) = nats_down_since.take()
                && lane == 0
            {
                tracing::info!(after = ?since.elapsed(), "NATS is back; resuming");
            }
            let seat = peers.seat().filter(|seat| {
                seat.relays > 1 && split_next && unsplit_at.elapsed() < UNSPLIT_EVERY
            });
            if seat.is_none() {
                unsplit_at = Instant::now();
            }
            let result = self.step_lane(Some(lane), seat).await;
            let report = match &result {
                Ok(report) => report.clone(),
                // A failed settle published without marking: count what it did, mark nothing.
                Err(StepError::Settle(_, report)) => StepReport {
                    marked_sent: 0,
                    ..(**report).clone()
                },
                Err(StepError::Claim(_) | StepError::LostBeforePublish(_)) => StepReport::default(),
            };
            {
                let mut totals = totals.lock().unwrap_or_else(PoisonError::into_inner);
                totals.add(&report);
                totals.step_errors += u64::from(result.is_err());
                if lane == 0 {
                    progress.tick(&totals);
                }
            }
            split_next = seat.is_none() || report.claimed > 0;
            let pause = match result {
                Ok(report) => {
                    errors_in_a_row = 0;
                    if report.was_full(&self.config) {
                        continue;
                    }
                    self.config.poll_interval
                }
                Err(error) => {
                    errors_in_a_row += 1;
                    tracing::error!(lane, error = %error_chain(&error), "relay step failed");
                    // Back off on repeated errors (database down), up to 30 s.
                    (self.config.poll_interval * 2u32.saturating_pow(errors_in_a_row.min(5)))
                        .min(Duration::from_secs(30))
                }
            };
            self.idle(wake, pause).await;
        }
    }

    async fn idle(&self, wake: &Notify, pause: Duration) {
        if self.stopping.load(Ordering::Relaxed) {
            return;
        }
        let _ = tokio::time::timeout(pause, wake.notified()).await;
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

/// Wakes the loop on every outbox notification; on a lost connection, wakes it too (notifications
/// may have been missed) and reconnects.
async fn listen(pool: PgPool, wakes: Vec<Arc<Notify>>) {
    let wake_all = || wakes.iter().for_each(|w| w.notify_one());
    loop {
        match PgListener::connect_with(&pool).await {
            Ok(mut listener) => {
                if let Err(error) = listener.listen(store::OUTBOX_CHANNEL).await {
                    tracing::warn!(error = %error_chain(&error), "LISTEN failed; relying on polling");
                } else {
                    loop {
                        match listener.try_recv().await {
                            Ok(Some(_)) => wake_all(),
                            Ok(None) => {
                                tracing::debug!("notification connection lost; reconnecting");
                                wake_all();
                            }
                            Err(error) => {
                                tracing::warn!(error = %error_chain(&error), "notification listener failed; relying on polling");
                                break;
                            }
                        }
                    }
                }
            }
            Err(error) => {
                tracing::warn!(error = %error_chain(&error), "cannot open the notification listener; relying on polling")
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Refreshes the outbox gauges every 5 s and prunes the journal every minute.
async fn refresh_gauges(pool: PgPool) {
    let mut ticks = 0u64;
    loop {
        match admin::status(&pool, false).await {
            Ok(status) => metrics::record_status(&status),
            Err(error) => {
                tracing::debug!(error = %error_chain(&error), "cannot read the outbox status")
            }
        }
        match admin::vacuum_state(&pool).await {
            Ok(vacuum) => metrics::record_vacuum(&vacuum),
            Err(error) => {
                tracing::debug!(error = %error_chain(&error), "cannot read the outbox's vacuum state")
            }
        }
        if ticks.is_multiple_of(12)
            && let Err(error) = admin::prune_journal(&pool).await
        {
            tracing::debug!(error = %error_chain(&error), "cannot prune the publish journal");
        }
        ticks += 1;
        tokio::time::sleep(Duration::from_secs(5)).await;
    }
}

/// How often the retention sweep looks for sent rows past the retention.
const SWEEP_EVERY: Duration = Duration::from_secs(10);

/// Deletes sent rows older than `retention`, `batch` per statement, every [`SWEEP_EVERY`]: the outbox
/// stays bounded by what is sent in `retention` plus what is unsent. Each batch is its own short
/// statement on rows no relay will touch again (sent, and `SKIP LOCKED`), so the sweep never waits for
/// a claim and several relays can sweep at once. The fence does not need a purged row: a relay reads
/// a purged predecessor's sequence from the stream.
async fn sweep(pool: PgPool, retention: Duration, batch: i64) {
    loop {
        // Counted batch by batch: a first sweep over a large backlog takes a while.
        let mut counted = 0;
        let purged = admin::purge_sent(&pool, retention, batch, |total| {
            metrics::record_purged(total - counted);
            counted = total;
        })
        .await;
        match purged {
            Ok(0) => {}
            Ok(deleted) => {
                tracing::info!(
                    deleted,
                    retention = %humantime::format_duration(retention),
                    "deleted sent outbox rows past the retention"
                );
            }
            Err(error) => {
                tracing::warn!(error = %error_chain(&error), "the retention sweep failed; retrying later")
            }
        }
        tokio::time::sleep(SWEEP_EVERY).await;
    }
}

/// An info line every 10 s while the relay is moving rows: totals and the recent rate.
struct Progress {
    last: Instant,
    published_at_last: u64,
}

impl Progress {
    fn new() -> Self {
        Self {
            last: Instant::now(),
            published_at_last: 0,
        }
    }

    fn tick(&mut self, summary: &RunSummary) {
        let elapsed = self.last.elapsed();
        if elapsed < Duration::from_secs(10) || summary.published == self.published_at_last {
            return;
        }
        let rate = (summary.published - self.published_at_last) as f64 / elapsed.as_secs_f64();
        tracing::info!(
            published = summary.published,
            duplicates = summary.duplicates,
            failed = summary.failed,
            dead = summary.dead,
            rate_per_s = rate.round(),
            "relaying"
        );
        self.last = Instant::now();
        self.published_at_last = summary.published;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
