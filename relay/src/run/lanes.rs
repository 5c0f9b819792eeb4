//! `Relay::run`: one step loop per lane until shutdown, beside the notification listener and the
//! chores; the shutdown future stops new claims and wakes every idle lane.

use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use async_nats::connection::State;
use ops::error_chain;
use tokio::sync::Notify;

use super::chores::Chores;
use super::gate::SlotGate;
use super::summary::Progress;
use super::wake::listen;
use super::{Relay, RunSummary};
use crate::metrics;
use crate::peers::Peers;
use crate::step::{StepError, StepReport};

/// How long a [`Relay::run`] lane may claim only its share among the relays sharing the outbox
/// before it claims once over every aggregate: a frozen relay keeps its slot, and its share must not
/// wait for it longer than this.
const UNSPLIT_EVERY: Duration = Duration::from_secs(1);

impl Relay {
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
        let (gate, gate_task) = SlotGate::watch(
            self.pool.clone(),
            self.config.stand_by_for_slot.clone(),
            wakes.clone(),
        )
        .await;
        let listener = tokio::spawn(listen(self.pool.clone(), wakes.clone()));
        let chores = Chores::start(&self.pool, &self.config);
        let totals = Arc::new(Mutex::new(RunSummary::default()));
        let lanes = wakes
            .iter()
            .enumerate()
            .map(|(lane, wake)| self.lane(lane, wake, &totals, &peers, &gate));
        futures::future::join_all(lanes).await;
        listener.abort();
        drop(chores);
        if let Some(gate_task) = gate_task {
            gate_task.abort();
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
    /// then over every aggregate, so that what a frozen relay's share holds still moves. While a WAL
    /// relay reads the slot it stands by for, it claims nothing (`gate.rs`).
    async fn lane(
        &self,
        lane: usize,
        wake: &Notify,
        totals: &Mutex<RunSummary>,
        peers: &Peers,
        gate: &SlotGate,
    ) {
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
            if gate.standing_by() {
                self.idle(wake, self.config.poll_interval).await;
                continue;
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
}
