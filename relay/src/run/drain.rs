//! `run --once`: every lane steps until nothing is claimable, waiting for rows another relay holds
//! or that retry within moments, so that no row a live relay could send now is left behind.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use async_nats::connection::State;
use ops::error_chain;

use super::{Relay, RunSummary};
use crate::admin;
use crate::peers::Peers;
use crate::step::{StepError, StepReport};

/// How far ahead `run --once` waits for failed rows to come due again (the first retries, 1 s and 5 s
/// by default), rather than leaving a transient failure behind.
const RETRY_WAIT: Duration = Duration::from_secs(10);

impl Relay {
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
            let round = self.pass_among(&peers).await?;
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

    /// One pass over the outbox: every lane steps until its claim finds nothing due now. Unlike
    /// [`Relay::drain`] it never waits for rows locked by another relay or failed and due again in a
    /// moment: a caller that comes back on its own schedule (the WAL source's hand-back to polling)
    /// must not stop its other work for them. It takes no seat among the relays sharing the outbox
    /// ([`Peers::none`]): joining for every pass would make them split their shares twice a pass.
    pub async fn pass(&self) -> Result<RunSummary, StepError> {
        self.pass_among(&Peers::none()).await
    }

    /// [`Relay::pass`] with this relay's seat among its peers already taken.
    async fn pass_among(&self, peers: &Peers) -> Result<RunSummary, StepError> {
        let mut summary = RunSummary::default();
        let lanes = (0..self.config.lanes.max(1)).map(|lane| self.drain_lane(lane, peers));
        for lane in futures::future::join_all(lanes).await {
            summary.merge(&lane?);
        }
        Ok(summary)
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
}
