//! One relay step: claim a batch, journal it, publish it in per-aggregate chains, settle it — and report
//! what happened. `run` loops over steps; tests drive steps directly.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use sqlx::PgPool;
use uuid::Uuid;

use crate::claim::{self, ClaimedRow, claim, into_runs, row_ids};
use crate::config::RelayConfig;
use crate::metrics;
use crate::publish::{OnRefusal, Outcome, publish_runs};
pub use crate::step_report::StepReport;
use store::outbox::relaying::{self, SentRow, Settlement, journal, settle};

/// Where a step may be told to stop, to reproduce the crash window deliberately. Only `None` exists
/// unless the `fault-injection` feature (tests, the demo, the chaos harness) is on.
#[derive(Debug, Clone, Default)]
pub enum FailPoint {
    /// Run normally.
    #[default]
    None,
    #[cfg(feature = "fault-injection")]
    /// After the PubAcks, give up the transaction without marking anything (as if the process died).
    AbandonAfterPublish,
    /// After the PubAcks, abort the whole process while the claim transaction is still open: the
    /// SIGKILL case, exactly.
    #[cfg(feature = "fault-injection")]
    AbortProcessAfterPublish,
    /// After the PubAcks, signal `reached` and wait for `resume` before settling (tests use it to end
    /// the session or start a rival relay in the window).
    #[cfg(feature = "fault-injection")]
    PauseAfterPublish {
        /// Notified when the step reaches the window.
        reached: Arc<tokio::sync::Notify>,
        /// Awaited before settling.
        resume: Arc<tokio::sync::Notify>,
    },
}

/// Why a step failed. Whatever the cause, nothing was marked that should not have been.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    /// Claiming or journaling failed; nothing was published.
    #[error("claiming outbox rows failed")]
    Claim(#[source] sqlx::Error),
    /// The claim ended before publishing began (the relay stalled longer than the claim timeout, or
    /// its session was ended): nothing was published; the rows are someone else's now.
    #[error("the claim was lost before publishing; nothing was published")]
    LostBeforePublish(#[source] sqlx::Error),
    /// Published, but the marks could not be written: the claim was lost (session ended) or the
    /// database failed. The rows stay unsent and will be published again (JetStream dedupes).
    #[error("settling a published batch failed; its rows stay unsent and will be published again")]
    Settle(#[source] sqlx::Error, Box<StepReport>),
}

/// Runs one claim–publish–settle step.
///
/// `journal_pool` must commit synchronously (`synchronous_commit = on`): the journal record has to
/// survive a PostgreSQL crash (see [`relaying::journal`]). `lane`: claim only that lane's aggregates (see
/// [`claim()`]).
pub async fn step(
    pool: &PgPool,
    journal_pool: &PgPool,
    jetstream: &async_nats::jetstream::Context,
    config: &RelayConfig,
    stopping: &Arc<AtomicBool>,
    fail_point: &FailPoint,
    lane: Option<(u32, u32)>,
) -> Result<StepReport, StepError> {
    let started = Instant::now();
    // Counted from the start: a step that stalled while claiming must not start publishing late.
    let deadline = started + config.effective_step_deadline();
    let mut tx = claim::begin(pool).await.map_err(StepError::Claim)?;
    let claimed_at = Utc::now();
    let rows = claim(
        &mut tx,
        config.batch_size,
        config.max_rows,
        config.max_claim_bytes,
        lane,
    )
    .await
    .map_err(StepError::Claim)?;
    if rows.is_empty() {
        return Ok(StepReport::default());
    }
    let claimed = rows.len();
    let claimed_bytes = rows.iter().map(|row| row.body.len()).sum();
    let lock_time = started.elapsed();
    let (runs, left_out) = into_runs(rows);
    let mut report = StepReport {
        claimed,
        claimed_bytes,
        heads: runs.len(),
        not_attempted: left_out,
        ..StepReport::default()
    };
    let claim_id = Uuid::now_v7();
    let maybe_published = journal(
        journal_pool,
        claim_id,
        &config.relay_id,
        &row_ids(&runs),
        config.stream.duplicate_window,
    )
    .await
    .map_err(StepError::Claim)?;
    // The journal is written on its own connection, so it succeeds even when the claim has already
    // ended (the relay stalled since claiming). Check that the claim still holds before publishing; if
    // it does not, withdraw the record: these rows were never published by this step. Only a claim
    // that stalled needs the check: PostgreSQL ends an idle claim, and other relays end a stale one,
    // only after the whole claim timeout, so a younger one still holds unless its session was killed
    // from outside — and then its marks fail and the rows are published again, deduplicated or
    // fenced, as after any crash. The round trip saved is one of the six of a step.
    if started.elapsed() >= config.claim_idle_timeout / 4
        && let Err(error) = sqlx::query("SELECT 1").execute(&mut *tx).await
    {
        metrics::record_lost_claim();
        forget_journal(pool, claim_id).await;
        return Err(StepError::LostBeforePublish(error));
    }
    let claim_time = started.elapsed();

    let outcomes = publish_runs(
        jetstream,
        &config.stream.name,
        &config.stream.subject_prefix,
        &runs,
        config.max_in_flight,
        deadline,
        stopping,
        config.faults(),
        OnRefusal::Judge,
    )
    .await;
    let settlement = assess(&runs, &outcomes, &maybe_published, config, &mut report);
    metrics::record_step(&report);
    let publish_time = started.elapsed() - claim_time;

    match fail_point {
        FailPoint::None => {}
        #[cfg(feature = "fault-injection")]
        FailPoint::AbandonAfterPublish => {
            // Roll back now rather than when the connection is next used, so the rows are free at once
            // (as they are when a process dies and PostgreSQL closes its session).
            let _ = tx.rollback().await;
            report.simulated_crash = true;
            tracing::warn!(%claim_id, published = report.published, "fail point: abandoning the step before marking sent");
            return Ok(report);
        }
        #[cfg(feature = "fault-injection")]
        FailPoint::AbortProcessAfterPublish => {
            tracing::warn!(%claim_id, published = report.published, "fail point: aborting the process before marking sent");
            std::process::abort();
        }
        #[cfg(feature = "fault-injection")]
        FailPoint::PauseAfterPublish { reached, resume } => {
            reached.notify_one();
            resume.notified().await;
        }
    }

    let settled = match settle(&mut tx, &settlement, &config.relay_id, claimed_at, claim_id).await {
        Ok(settled) => settled,
        Err(error) => {
            metrics::record_lost_claim();
            return Err(StepError::Settle(error, Box::new(report)));
        }
    };
    if let Err(error) = tx.commit().await {
        metrics::record_lost_claim();
        return Err(StepError::Settle(error, Box::new(report)));
    }
    // A count of updated rows: never negative.
    report.marked_sent = usize::try_from(settled.sent).unwrap_or(0);
    if report.marked_sent < settlement.sent.len() {
        // Cannot happen while the claim holds its locks; if it does, the rows stay unsent and are
        // published again (deduplicated), which is safe but worth knowing.
        tracing::warn!(%claim_id, acknowledged = settlement.sent.len(), marked = report.marked_sent, "fewer rows marked sent than acknowledged");
    }
    tracing::debug!(
        %claim_id,
        claimed,
        published = report.published,
        failed = report.failed,
        lock_us = micros(lock_time),
        claim_us = micros(claim_time),
        publish_us = micros(publish_time),
        settle_us = micros(started.elapsed() - claim_time - publish_time),
        "step settled"
    );
    Ok(report)
}

/// Turns publish outcomes into marks, counting as it goes.
fn assess(
    runs: &[Vec<ClaimedRow>],
    outcomes: &[Vec<Outcome>],
    maybe_published: &HashMap<i64, DateTime<Utc>>,
    config: &RelayConfig,
    report: &mut StepReport,
) -> Settlement {
    let mut settlement = Settlement::default();
    let mut rng = rand::rng();
    let window =
        chrono::Duration::from_std(config.stream.duplicate_window).unwrap_or(chrono::Duration::MAX);
    let now = Utc::now();
    for (run, outcomes) in runs.iter().zip(outcomes) {
        // The delay of the failed row this run stopped at; `Some(None)` when that row is now dead.
        let mut blocked_by: Option<Option<f64>> = None;
        for (row, outcome) in run.iter().zip(outcomes) {
            match outcome {
                Outcome::Sent {
                    sequence,
                    duplicate,
                    fenced,
                    latency,
                } => {
                    report.published += 1;
                    report.duplicates += usize::from(*duplicate);
                    report.fenced += usize::from(*fenced);
                    settlement.sent.push(SentRow {
                        id: row.id,
                        tid: row.tid.clone(),
                        sequence: i64::try_from(*sequence).ok(),
                    });
                    let commit_to_ack = (now - row.created_at).to_std().unwrap_or_default();
                    metrics::record_ack(*latency, commit_to_ack.max(*latency));
                    // An unsettled step may have published this row more than the dedupe window
                    // ago. JetStream no longer knows its id, so only the fence decided: the stream
                    // stored it now because no earlier copy reached it (an earlier copy would have
                    // moved the subject past the expected sequence), or refused it (`fenced`).
                    if let Some(earlier) = maybe_published.get(&row.id)
                        && !duplicate
                        && now - *earlier > window
                    {
                        report.republished_outside_window += 1;
                        tracing::debug!(
                            event_id = %row.event_id,
                            first_attempt = %earlier,
                            fenced,
                            "republished outside the dedupe window; the fence kept it once"
                        );
                    }
                }
                Outcome::Failed {
                    error,
                    ambiguous,
                    divergence,
                    ..
                } => {
                    if let Some(divergence) = divergence {
                        report.divergences += 1;
                        metrics::record_divergence(divergence.kind);
                    }
                    let failures = row.attempts + 1;
                    let delay = config.backoff.delay(failures, &mut rng);
                    let dead = settlement.fail(
                        row.id,
                        failures,
                        config.max_attempts,
                        delay,
                        error.clone(),
                        divergence.as_ref(),
                    );
                    if *ambiguous {
                        settlement.ambiguous.push(row.id);
                    }
                    if dead {
                        report.dead += 1;
                        tracing::error!(event_id = %row.event_id, attempts = failures, %error, "outbox row is dead");
                        blocked_by = Some(None);
                    } else {
                        report.failed += 1;
                        tracing::warn!(event_id = %row.event_id, attempts = failures, retry_in = ?delay, %error, "publish failed");
                        blocked_by = Some(Some(delay.as_secs_f64()));
                    }
                }
                Outcome::NotAttempted => match blocked_by {
                    Some(delay) => {
                        report.held_back += 1;
                        settlement.held.push((row.id, delay));
                    }
                    None => report.not_attempted += 1,
                },
            }
        }
    }
    settlement
}

/// Withdraws a journal record whose step published nothing (best effort: a record left behind only
/// makes a later republish be checked against the window).
async fn forget_journal(pool: &PgPool, claim_id: Uuid) {
    if let Err(error) = relaying::forget_journal(pool, claim_id).await {
        tracing::debug!(error = %ops::error_chain(&error), %claim_id, "cannot withdraw the journal record of a lost claim");
    }
}

/// A duration in whole milliseconds for the logs (saturating: no step lasts 2^64 ms).
fn micros(duration: Duration) -> u64 {
    u64::try_from(duration.as_micros()).unwrap_or(u64::MAX)
}
