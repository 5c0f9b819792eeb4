//! What a run or rebuild reports: the closing summary (text or `--json`) and the progress line
//! logged while messages flow.

use std::time::{Duration, Instant};

use serde_json::json;

use crate::held::{self, HeldError};
use crate::park::{self, ParkedError};
use crate::projection::Projection;
use crate::runner::Runner;
use crate::tally::Tally;

/// Why a summary could not be printed: what is held or parked could not be read.
#[derive(Debug, thiserror::Error)]
pub(super) enum SummaryError {
    #[error(transparent)]
    Held(#[from] HeldError),
    #[error(transparent)]
    Parked(#[from] ParkedError),
}

/// What a run or rebuild did, and what it leaves held and parked (the first 20 of each).
pub(super) async fn print_summary<P: Projection>(
    runner: &Runner<P>,
    verb: &str,
    tally: &Tally,
    json_output: bool,
) -> Result<(), SummaryError> {
    let stats = held::stats(runner.pool()).await?;
    let held = held::list(runner.pool(), 20, None).await?;
    let parked_open = park::open_count(runner.pool()).await?;
    let parked = park::list(runner.pool(), 20, None, false).await?;
    if json_output {
        let parked: Vec<_> = parked
            .iter()
            .map(|p| {
                json!({"id": p.id, "event_id": p.event_id, "aggregate_id": p.aggregate_id,
                            "aggregate_version": p.aggregate_version, "reason": p.reason})
            })
            .collect();
        let mut summary = json!({
            "projection": P::NAME,
            "tally": tally,
            "held": {"count": stats.count, "aggregates": stats.aggregates,
                     "oldest_seconds": stats.oldest_seconds, "first": held},
            "parked": {"count": parked_open, "first": parked},
        });
        let partitions = &runner.config().partitions;
        if !partitions.is_single() {
            summary["partitions"] =
                json!({"count": partitions.count(), "owned": partitions.owned()});
        }
        println!("{summary}");
    } else {
        println!(
            "{}: {verb} {} messages{}: applied={} duplicates={} held={} parked={}{}",
            P::NAME,
            tally.messages,
            if tally.from_store > 0 {
                format!(" ({} from the event store)", tally.from_store)
            } else {
                String::new()
            },
            tally.applied,
            tally.duplicates,
            tally.held,
            tally.parked,
            if runner.config().partitions.is_single() {
                String::new()
            } else {
                format!(
                    " (partitions {}; {} other partitions' messages skipped)",
                    runner.config().partitions,
                    tally.skipped
                )
            }
        );
        println!(
            "held now: {} event(s) of {} order(s); parked now: {parked_open}",
            stats.count, stats.aggregates
        );
        for h in &held {
            println!("  held   {}:{}  {}", h.aggregate_id, h.version, h.reason);
        }
        for p in &parked {
            println!("  parked {:>6}  {}", p.id, p.reason);
        }
    }
    Ok(())
}

/// An info line every 10 s while messages flow.
pub(super) struct Progress {
    projection: &'static str,
    last: Instant,
    messages_at_last: u64,
}

impl Progress {
    pub(super) fn new(projection: &'static str) -> Self {
        Self {
            projection,
            last: Instant::now(),
            messages_at_last: 0,
        }
    }

    pub(super) fn log(&mut self, tally: &Tally) {
        let elapsed = self.last.elapsed();
        if elapsed < Duration::from_secs(10) {
            return;
        }
        let rate = (tally.messages - self.messages_at_last) as f64 / elapsed.as_secs_f64();
        tracing::info!(
            projection = self.projection,
            applied = tally.applied,
            duplicates = tally.duplicates,
            held = tally.held,
            parked = tally.parked,
            rate_per_s = rate.round(),
            "consuming"
        );
        self.last = Instant::now();
        self.messages_at_last = tally.messages;
    }
}
