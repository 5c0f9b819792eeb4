//! Where a projection's consumers start. A consumer that does not exist yet (a projection started for
//! the first time, a rebuild's own, one deleted by hand), or that has fallen behind the stream's
//! first message (the stream's retention removed messages it had not delivered), starts from the
//! event store, not from the stream: the stream's last sequence L is read first, then one snapshot
//! of `events` — every message up to L was published from an event committed before L was read, so
//! the snapshot holds it — which is applied through the same decode, checkpoint and apply path as
//! deliveries; the consumer is then created at L + 1. Messages after L that the snapshot held too are
//! duplicates to the per-order checkpoints. So the stream may be bounded: history lives in the store.
//!
//! Where the events table cannot be read (the role lacks SELECT, it is in another database) or does
//! not account for the stream (the stream holds more messages than the store has events: something
//! else published into it, or it is another store's), the stream is the only history. It is read
//! from its first message if it still holds it; otherwise nothing starts, and the error says why —
//! a state built from what is left would be silently smaller than the store's.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use async_nats::jetstream::consumer::{self, DeliverPolicy, PullConsumer};
use async_nats::jetstream::stream;

use crate::consumer::BrokerError;
use crate::decode::RawMessage;
use crate::handover::HandoverError;
use crate::history::{HistoryError, Snapshot};
use crate::metrics;
use crate::projection::Projection;
use crate::runner::Runner;
use crate::tally::Tally;

/// Why a consumer could not be made ready to consume.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The stream or a consumer was unavailable, or an existing consumer is unusable.
    #[error(transparent)]
    Broker(#[from] BrokerError),
    /// A rebuild's recorded move of the consumers could not be completed.
    #[error(transparent)]
    Handover(#[from] HandoverError),
    /// The event store's history could not be read.
    #[error("catching up from the event store")]
    History(#[source] HistoryError),
    /// Events of the store could neither be applied nor parked (the projection's database failed).
    #[error(
        "catching up from the event store: the events after position {after} could neither be \
         applied nor parked; the next start catches up again"
    )]
    Unapplied {
        /// The position the failing page started after.
        after: i64,
    },
    /// Neither the store nor the stream holds the whole history: starting would leave events out.
    #[error(
        "{} cannot start: {why}; and the stream cannot stand in for the event store, because {gap}. \
         Nothing was changed",
        .consumers.join(", ")
    )]
    NoHistory {
        /// The consumers that were to start.
        consumers: Vec<String>,
        /// Why the event store could not be used.
        why: String,
        /// What the stream lacks.
        gap: String,
    },
    /// The consumer was deleted by someone else between being made ready and being opened.
    #[error("consumer {consumer} vanished while it was being opened")]
    Vanished { consumer: String },
}

impl StartError {
    /// True for failures that may pass (the broker or a database away); false for refusals that
    /// need an operator (no history to start from, a consumer with settings the server cannot fix).
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::NoHistory { .. } => false,
            Self::Broker(error) => !matches!(
                error,
                BrokerError::ConsumerMismatch { .. } | BrokerError::NotUpdated { .. }
            ),
            _ => true,
        }
    }
}

/// How often a running partition's loop checks that its consumer is where it must be (a rebuild's
/// handover not done, messages removed from the stream before their delivery).
pub(crate) const RECHECK_EVERY: Duration = Duration::from_secs(5);

/// A consumer to start, and why.
#[derive(Debug)]
struct Start {
    partition: u32,
    consumer: String,
    /// `Some((needed, first))`: it still needed stream sequence `needed`, and the stream now starts
    /// at `first`. `None`: it does not exist.
    behind: Option<(u64, u64)>,
}

/// The first stream sequence consumer `info` still needs, when the stream no longer holds it: the
/// messages between it and the stream's first were removed (retention, a purge) before the consumer
/// delivered them, or while they waited for an ack. Nothing is lost from a stream that still starts
/// at its first message.
pub(crate) fn lost_from(info: &consumer::Info, state: &stream::State) -> Option<u64> {
    if state.first_sequence <= 1 {
        return None;
    }
    let next = info.delivered.stream_sequence + 1;
    // The ack floor is 0 until a new consumer's first ack (nats-server 2.9), which says nothing.
    let unacknowledged = (info.num_ack_pending > 0 && info.ack_floor.stream_sequence > 0)
        .then_some(info.ack_floor.stream_sequence + 1);
    let needed = unacknowledged.map_or(next, |floor| floor.min(next));
    (needed < state.first_sequence).then_some(needed)
}

impl<P: Projection> Runner<P> {
    /// The projection's durable consumer (its first owned partition's), made ready as `run` makes
    /// it: created when missing (after catching up from the event store), moved where a rebuild
    /// left it, checked (see `Runner::open_consumer`).
    pub async fn consumer(&self) -> Result<PullConsumer, StartError> {
        let first = self.config.partitions.owned()[0];
        self.partition_consumer_ready(first).await
    }

    /// Makes the consumers of `partitions` ready: completes a rebuild's recorded handover, then starts
    /// every consumer that is missing or behind the stream's first message from the event store (all
    /// of them in one pass over it) or, failing that, from the stream. Returns what the catch-up
    /// applied; `progress` sees it page by page.
    pub(crate) async fn prepare(
        &self,
        partitions: &[u32],
        progress: &mut (dyn FnMut(&Tally) + Send),
    ) -> Result<Tally, StartError> {
        let moved = self.complete_handovers().await?;
        if moved > 0 {
            tracing::info!(
                projection = P::NAME,
                consumers = moved,
                "completed a rebuild's handover"
            );
        }
        let state = self.stream_state().await?;
        let mut starts = Vec::new();
        for &partition in partitions {
            let consumer = self.partition_consumer(partition);
            match self.consumer_info(&consumer).await? {
                None => starts.push(Start {
                    partition,
                    consumer,
                    behind: None,
                }),
                Some(info) => {
                    if let Some(needed) = lost_from(&info, &state) {
                        tracing::warn!(
                            projection = P::NAME,
                            consumer = %consumer,
                            needed,
                            stream_first_sequence = state.first_sequence,
                            "the stream removed messages this consumer had not settled; catching up"
                        );
                        starts.push(Start {
                            partition,
                            consumer,
                            behind: Some((needed, state.first_sequence)),
                        });
                    }
                }
            }
        }
        if starts.is_empty() {
            return Ok(Tally::default());
        }
        self.start(&starts, progress).await
    }

    /// [`Runner::prepare`] for one partition, then its consumer opened and checked.
    pub(crate) async fn partition_consumer_ready(
        &self,
        partition: u32,
    ) -> Result<PullConsumer, StartError> {
        self.prepare(&[partition], &mut |_| {}).await?;
        let consumer = self.partition_consumer(partition);
        self.open_consumer(&consumer)
            .await?
            .ok_or(StartError::Vanished { consumer })
    }

    /// True when the consumer of `partition` must be made ready again: a rebuild's handover waits
    /// for it, it vanished, or the stream removed messages it had not settled. Failures to look are
    /// logged and answer false (the loop's own reconnects cover an unreachable broker).
    pub(crate) async fn needs_restart(&self, partition: u32) -> bool {
        let consumer = self.partition_consumer(partition);
        match self.handover_pending(&consumer).await {
            Ok(true) => {
                tracing::info!(consumer = %consumer, "a rebuild's handover waits for this consumer");
                return true;
            }
            Ok(false) => {}
            Err(error) => {
                tracing::debug!(error = %ops::error_chain(&error), "reading the handover failed");
            }
        }
        let (info, state) = match (
            self.consumer_info(&consumer).await,
            self.stream_state().await,
        ) {
            (Ok(info), Ok(state)) => (info, state),
            (Err(error), _) | (_, Err(error)) => {
                tracing::debug!(error = %ops::error_chain(&error), "checking the consumer failed");
                return false;
            }
        };
        match info {
            None => true,
            Some(info) => lost_from(&info, &state).is_some(),
        }
    }

    /// How many events a rebuild will go through, about (for a progress bar): the event store's last
    /// position, or the stream's message count when the store cannot be read.
    pub async fn history_size(&self) -> u64 {
        let stream = self.stream_messages().await.unwrap_or(0);
        match Snapshot::take(self.events_url(), &self.history_application()).await {
            Ok((pool, snapshot)) => {
                let size = u64::try_from(snapshot.last_position).unwrap_or(0);
                drop(snapshot);
                pool.close().await;
                size.max(stream)
            }
            Err(_) => stream,
        }
    }

    fn events_url(&self) -> &str {
        self.config
            .events_url
            .as_deref()
            .unwrap_or(&self.database_url)
    }

    fn history_application(&self) -> String {
        format!("waybill-{}-history", P::NAME)
    }

    async fn start(
        &self,
        starts: &[Start],
        progress: &mut (dyn FnMut(&Tally) + Send),
    ) -> Result<Tally, StartError> {
        // The stream first, then the store: every message up to `last` was published from an event
        // committed before this read, so the snapshot taken next holds all of them.
        let state = self.stream_state().await?;
        let last = state.last_sequence;
        let why_not = match Snapshot::take(self.events_url(), &self.history_application()).await {
            Ok((pool, snapshot))
                if i64::try_from(state.messages).is_ok_and(|m| m <= snapshot.last_position) =>
            {
                let caught_up = self.catch_up(snapshot, starts, last, progress).await;
                pool.close().await;
                let tally = caught_up?;
                for start in starts {
                    if start.behind.is_some() {
                        self.delete_consumer(&start.consumer).await?;
                    }
                    self.create_consumer_at(
                        &start.consumer,
                        DeliverPolicy::ByStartSequence {
                            start_sequence: last + 1,
                        },
                        None,
                    )
                    .await?;
                }
                return Ok(tally);
            }
            Ok((pool, snapshot)) => {
                let why = format!(
                    "the event store holds at most {} events and the stream {} messages, so not \
                     all of them were published from it (another publisher, or another store)",
                    snapshot.last_position, state.messages
                );
                drop(snapshot);
                pool.close().await;
                why
            }
            Err(error) if error.is_unavailable() => ops::error_chain(&error),
            Err(error) => return Err(StartError::History(error)),
        };
        self.start_from_the_stream(starts, &state, why_not).await
    }

    /// Without the event store: a missing consumer reads the stream from its first message, if the
    /// stream still holds every message it ever stored; otherwise nothing starts.
    async fn start_from_the_stream(
        &self,
        starts: &[Start],
        state: &stream::State,
        why_not: String,
    ) -> Result<Tally, StartError> {
        let deleted = state.deleted_count.unwrap_or(0);
        // A consumer behind the stream needs exactly what the stream no longer has.
        let gap = if let Some((needed, first)) = starts.iter().find_map(|s| s.behind) {
            Some(format!(
                "it removed sequences {needed} to {} before they were settled",
                first - 1
            ))
        } else if state.first_sequence > 1 {
            Some(format!(
                "its first messages are gone (it starts at sequence {})",
                state.first_sequence
            ))
        } else if deleted > 0 {
            Some(format!("{deleted} message(s) were deleted from inside it"))
        } else {
            None
        };
        if let Some(gap) = gap {
            return Err(StartError::NoHistory {
                consumers: starts.iter().map(|s| s.consumer.clone()).collect(),
                why: why_not,
                gap,
            });
        }
        tracing::warn!(
            projection = P::NAME,
            why = %why_not,
            "starting from the stream's first message instead of the event store"
        );
        for start in starts {
            self.create_consumer_at(&start.consumer, DeliverPolicy::All, None)
                .await?;
        }
        Ok(Tally::default())
    }

    /// Applies the snapshot's events of the starting consumers' partitions, page by page, each page
    /// in one transaction per partition (as a delivered batch), logging progress every 10 s.
    async fn catch_up(
        &self,
        mut snapshot: Snapshot,
        starts: &[Start],
        handover_after: u64,
        progress: &mut (dyn FnMut(&Tally) + Send),
    ) -> Result<Tally, StartError> {
        let partitions: BTreeSet<u32> = starts.iter().map(|s| s.partition).collect();
        let consumers: Vec<&str> = starts.iter().map(|s| s.consumer.as_str()).collect();
        let reason = if starts.iter().any(|s| s.behind.is_some()) {
            "behind_stream"
        } else {
            "missing_consumer"
        };
        metrics::record_catch_up_started(P::NAME, reason);
        tracing::info!(
            projection = P::NAME,
            consumers = %consumers.join(","),
            events_up_to_position = snapshot.last_position,
            handover_after_stream_sequence = handover_after,
            "catching up from the event store"
        );
        let started = Instant::now();
        let mut logged = started;
        let mut tally = Tally::default();
        loop {
            let after = snapshot.position();
            let page = snapshot
                .next_page(self.config.batch_size, P::AGGREGATES)
                .await
                .map_err(StartError::History)?;
            if page.is_empty() {
                break;
            }
            let read = page.len() as u64;
            let mut by_partition: BTreeMap<u32, Vec<RawMessage>> = BTreeMap::new();
            for event in page {
                let partition = self.config.partitions.of_aggregate(event.aggregate_id);
                if partitions.contains(&partition) {
                    by_partition
                        .entry(partition)
                        .or_default()
                        .push(event.message(&self.config.subject_prefix));
                }
            }
            for (partition, messages) in by_partition {
                let batch_started = Instant::now();
                let verdicts = match self.apply_partition_batch(partition, &messages).await {
                    Ok(verdicts) => verdicts,
                    Err(error) => {
                        // As with a delivered batch: one event may be to blame, so they go one by
                        // one and the culprit alone is parked. There is no broker to redeliver, so
                        // an event that cannot even be parked stops the catch-up.
                        tracing::warn!(
                            projection = P::NAME,
                            error = %ops::error_chain(&error),
                            after,
                            "applying events of the store failed; applying them one by one"
                        );
                        let mut verdicts = Vec::with_capacity(messages.len());
                        for message in &messages {
                            match self.apply_alone(partition, message).await {
                                Some(verdict) => verdicts.push(verdict),
                                None => return Err(StartError::Unapplied { after }),
                            }
                        }
                        verdicts
                    }
                };
                let mut batch = Tally {
                    from_store: verdicts.len() as u64,
                    ..Tally::default()
                };
                batch.count(&verdicts);
                metrics::record_batch(P::NAME, &batch, batch_started.elapsed());
                tally.merge(&batch);
            }
            let remaining =
                u64::try_from(snapshot.last_position - snapshot.position()).unwrap_or(0);
            metrics::record_catch_up(P::NAME, read, remaining);
            progress(&tally);
            if logged.elapsed() >= Duration::from_secs(10) {
                logged = Instant::now();
                let rate = tally.from_store as f64 / started.elapsed().as_secs_f64().max(1e-3);
                tracing::info!(
                    projection = P::NAME,
                    events = tally.from_store,
                    position = snapshot.position(),
                    of = snapshot.last_position,
                    applied = tally.applied,
                    duplicates = tally.duplicates,
                    held = tally.held,
                    parked = tally.parked,
                    rate_per_s = rate.round(),
                    eta_s = (remaining as f64 / rate.max(1e-3)).round(),
                    "catching up from the event store"
                );
            }
        }
        tracing::info!(
            projection = P::NAME,
            events = tally.from_store,
            applied = tally.applied,
            duplicates = tally.duplicates,
            held = tally.held,
            parked = tally.parked,
            took_s = started.elapsed().as_secs_f64(),
            next_stream_sequence = handover_after + 1,
            "caught up from the event store; the stream takes over"
        );
        Ok(tally)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(delivered: u64, ack_floor: u64, ack_pending: usize) -> consumer::Info {
        let mut info: consumer::Info = serde_json::from_value(serde_json::json!({
            "stream_name": "S", "name": "c", "created": "2026-01-01T00:00:00Z",
            "config": {"durable_name": "c", "deliver_policy": "all", "ack_policy": "explicit",
                       "replay_policy": "instant"},
            "delivered": {"consumer_seq": delivered, "stream_seq": delivered},
            "ack_floor": {"consumer_seq": ack_floor, "stream_seq": ack_floor},
            "num_ack_pending": ack_pending, "num_redelivered": 0, "num_waiting": 0,
            "num_pending": 0
        }))
        .expect("consumer info");
        info.num_ack_pending = ack_pending;
        info
    }

    fn stream_from(first: u64) -> stream::State {
        serde_json::from_value(serde_json::json!({
            "messages": 5, "bytes": 0, "first_seq": first, "first_ts": "2026-01-01T00:00:00Z",
            "last_seq": first + 4, "last_ts": "2026-01-01T00:00:00Z", "consumer_count": 1
        }))
        .expect("stream state")
    }

    #[test]
    fn a_consumer_is_behind_when_the_stream_removed_what_it_had_not_delivered() {
        // Measured on 2.9.10: a purge or max_age leaves the consumer's delivered sequence as it was.
        assert_eq!(lost_from(&info(3, 3, 0), &stream_from(6)), Some(4));
        assert_eq!(lost_from(&info(5, 5, 0), &stream_from(6)), None);
        assert_eq!(lost_from(&info(3, 3, 0), &stream_from(1)), None);
    }

    #[test]
    fn an_unacknowledged_message_removed_from_the_stream_counts_as_lost() {
        assert_eq!(lost_from(&info(9, 4, 5), &stream_from(7)), Some(5));
        // A new consumer's ack floor is 0 until its first ack: not a loss.
        assert_eq!(lost_from(&info(9, 0, 3), &stream_from(7)), None);
    }
}
