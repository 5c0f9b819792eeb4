//! Consuming: pull batches from the durable consumer, apply each in one transaction, then settle every
//! message with the broker. Applied, duplicate and held messages are acked, parked ones terminated:
//! only a failing database leaves a message unacknowledged (redelivered after a growing delay, and
//! never parked for it: `blame.rs`), so no number of gaps or poison messages can fill the consumer's
//! ack-pending window. A batch that fails on what one of its messages holds is applied again message
//! by message, so the one bad message is parked alone and the others go through.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, AckKind};
use futures::{FutureExt, StreamExt};

use crate::blame::{Blame, blame, retry_delay};
use crate::consumer::BrokerError;
use crate::decode::{Poison, RawMessage, subject_aggregate_type};
use crate::metrics;
use crate::park::{self, ParkRecord};
use crate::plan::Verdict;
use crate::projection::{Projection, reads};
use crate::runner::Runner;
use crate::schema::SchemaError;
use crate::tally::Tally;

/// Why consuming stopped. A failing database does not stop it: its messages stay on the broker.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The schema is not in the layout this code needs.
    #[error(transparent)]
    Layout(#[from] SchemaError),
    /// The stream or the consumer is unavailable (with `--once`; otherwise the run retries).
    #[error(transparent)]
    Broker(#[from] BrokerError),
    /// A consumer could not start: no whole history to start from, an unusable existing consumer,
    /// or (with `--once`) a failure that may pass.
    #[error(transparent)]
    Start(#[from] crate::catch_up::StartError),
}

/// With `--once`: how long the database may keep failing (nothing settled) before the run gives up
/// waiting for the unacknowledged messages.
const STUCK_AFTER: Duration = Duration::from_secs(10);

impl<P: Projection> Runner<P> {
    /// Consumes until `shutdown` resolves (or, with `once`, until nothing more can be applied: nothing
    /// is left to deliver and nothing is unacknowledged). With several owned partitions, each one's
    /// consumer is read by its own loop, side by side; `progress` sees the sum.
    pub async fn run(
        &self,
        shutdown: impl std::future::Future<Output = ()> + Send,
        once: bool,
        progress: impl FnMut(&Tally) + Send,
    ) -> Result<Tally, RunError> {
        metrics::describe();
        crate::schema::check_layout(&self.pool, &self.schema).await?;
        let mut progress = progress;
        tokio::pin!(shutdown);
        // Consumers that are missing or behind the stream start from the event store first, all
        // owned partitions in one pass over it (`catch_up.rs`); a failure that may pass is left to
        // each partition's loop, which retries.
        let started = tokio::select! {
            started = self.prepare(self.config.partitions.owned(), &mut progress) => started,
            () = &mut shutdown => return Ok(Tally::default()),
        };
        let caught_up = match started {
            Ok(tally) => tally,
            Err(error) if !once && error.is_retryable() => {
                tracing::warn!(
                    error = %ops::error_chain(&error),
                    "starting the consumers failed; each partition's loop retries"
                );
                Tally::default()
            }
            Err(error) => return Err(error.into()),
        };
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let shared = std::sync::Mutex::new((caught_up, progress));
        if self.config.share && !once {
            return self.run_shared(shutdown, stop, stopped, shared).await;
        }
        let mut loops = Box::pin(futures::future::try_join_all(
            self.config.partitions.owned().iter().map(|&partition| {
                self.consume_partition(partition, stopped.clone(), once, &shared)
            }),
        ));
        let finished = tokio::select! {
            finished = &mut loops => finished,
            () = &mut shutdown => {
                // Each loop stops between batches, as a single one always did.
                let _ = stop.send(true);
                (&mut loops).await
            }
        };
        drop(loops);
        finished?;
        let (tally, _) = shared
            .into_inner()
            .unwrap_or_else(|poison| poison.into_inner());
        Ok(tally)
    }

    /// [`Runner::run`] for an instance that shares the partitions with the projection's other
    /// instances: a lease keeper decides which partitions it applies (`lease.rs`), and each
    /// partition's loop runs while its lease is held.
    async fn run_shared<F: FnMut(&Tally) + Send>(
        &self,
        shutdown: impl std::future::Future<Output = ()> + Send,
        stop: tokio::sync::watch::Sender<bool>,
        stopped: tokio::sync::watch::Receiver<bool>,
        shared: std::sync::Mutex<(Tally, F)>,
    ) -> Result<Tally, RunError> {
        tokio::pin!(shutdown);
        let count = self.config.partitions.count();
        let mut settings = crate::lease::LeaseSettings::new(
            &self.config.stream,
            P::NAME,
            count,
            self.config.lease_time,
        );
        settings.instance.clone_from(&self.instance);
        if let Ok(mut stream) = self.stream().await
            && let Ok(info) = stream.info().await
        {
            settings.replicas = info.config.num_replicas;
        }
        let store = loop {
            match crate::lease::open_bucket(&self.jetstream, &settings).await {
                Ok(store) => break store,
                Err(error) => {
                    tracing::warn!(error = %ops::error_chain(&error), "partition leases unavailable; retrying in 2 s");
                    tokio::select! {
                        () = tokio::time::sleep(Duration::from_secs(2)) => {}
                        () = &mut shutdown => return Ok(Tally::default()),
                    }
                }
            }
        };
        tracing::info!(
            projection = P::NAME,
            instance = %settings.instance,
            bucket = %settings.bucket,
            lease_time = %humantime::format_duration(settings.lease_time),
            "sharing {count} partitions with the other instances through leases"
        );
        let keeper =
            crate::lease::keep_share(store, settings, Arc::clone(&self.owned), stopped.clone());
        let follow = futures::future::try_join_all(
            (0..count).map(|partition| self.follow_lease(partition, stopped.clone(), &shared)),
        );
        let mut both = Box::pin(async { futures::join!(keeper, follow).1 });
        let finished = tokio::select! {
            finished = &mut both => finished,
            () = &mut shutdown => {
                let _ = stop.send(true);
                (&mut both).await
            }
        };
        drop(both);
        finished?;
        let (tally, _) = shared
            .into_inner()
            .unwrap_or_else(|poison| poison.into_inner());
        Ok(tally)
    }

    /// Runs `partition`'s loop whenever this instance holds its lease, and stops it between
    /// batches when the lease goes (released to a newcomer, lost, or the instance stopping).
    async fn follow_lease<F: FnMut(&Tally) + Send>(
        &self,
        partition: u32,
        mut stopped: tokio::sync::watch::Receiver<bool>,
        shared: &std::sync::Mutex<(Tally, F)>,
    ) -> Result<(), RunError> {
        let mut owned = self.owned.subscribe();
        let label = self.config.partitions.label(partition);
        loop {
            // Wait for the lease.
            loop {
                if *stopped.borrow() {
                    return Ok(());
                }
                if owned.borrow_and_update().contains(&partition) {
                    break;
                }
                tokio::select! {
                    _ = owned.changed() => {}
                    _ = stopped.changed() => {}
                }
            }
            metrics::record_partition_owned(P::NAME, label.clone(), true);
            let (stop_one, stopped_one) = tokio::sync::watch::channel(false);
            let consume = self.consume_partition(partition, stopped_one, false, shared);
            tokio::pin!(consume);
            let lease_gone = async {
                loop {
                    if *stopped.borrow() || !owned.borrow_and_update().contains(&partition) {
                        return;
                    }
                    tokio::select! {
                        _ = owned.changed() => {}
                        _ = stopped.changed() => {}
                    }
                }
            };
            let ended = tokio::select! {
                ended = &mut consume => ended,
                () = lease_gone => {
                    let _ = stop_one.send(true);
                    (&mut consume).await
                }
            };
            metrics::record_partition_owned(P::NAME, label.clone(), false);
            ended?;
        }
    }

    /// One partition's loop: its consumer's batches, applied and settled one after the other.
    async fn consume_partition<F: FnMut(&Tally) + Send>(
        &self,
        partition: u32,
        mut stopped: tokio::sync::watch::Receiver<bool>,
        once: bool,
        shared: &std::sync::Mutex<(Tally, F)>,
    ) -> Result<(), RunError> {
        let consumer_name = self.partition_consumer(partition);
        // When a batch last settled anything: only a failing database settles nothing.
        let mut last_progress = Instant::now();
        let mut last_check = Instant::now();
        'connect: loop {
            let consumer = match self.partition_consumer_ready(partition).await {
                Ok(consumer) => consumer,
                Err(error) if !once && error.is_retryable() => {
                    tracing::warn!(
                        error = %ops::error_chain(&error),
                        consumer = %consumer_name,
                        "consumer unavailable; retrying in 2 s"
                    );
                    tokio::select! {
                        _ = stopped.changed() => return Ok(()),
                        () = tokio::time::sleep(Duration::from_secs(2)) => continue 'connect,
                    }
                }
                Err(error) => return Err(error.into()),
            };
            let mut messages = consumer
                .stream()
                .max_messages_per_batch(self.config.batch_size.max(1))
                .messages()
                .await
                .map_err(|source| BrokerError::Messages {
                    consumer: consumer_name.clone(),
                    source,
                })?;
            loop {
                // A rebuild's handover, or messages the stream removed before they were settled.
                if last_check.elapsed() >= crate::catch_up::RECHECK_EVERY {
                    last_check = Instant::now();
                    if self.needs_restart(partition).await {
                        continue 'connect;
                    }
                }
                let first = tokio::select! {
                    _ = stopped.changed() => return Ok(()),
                    next = tokio::time::timeout(Duration::from_secs(1), messages.next()) => next,
                };
                let first = match first {
                    Ok(Some(Ok(message))) => message,
                    Ok(Some(Err(error))) => {
                        tracing::warn!(
                            error = %ops::error_chain(&error),
                            consumer = %consumer_name,
                            "consumer stream error; reconnecting"
                        );
                        tokio::time::sleep(Duration::from_millis(500)).await;
                        continue 'connect;
                    }
                    Ok(None) => continue 'connect,
                    Err(_idle) => {
                        if once && self.caught_up(&consumer_name, last_progress).await? {
                            return Ok(());
                        }
                        continue;
                    }
                };
                let batch = collect(
                    first,
                    &mut messages,
                    self.config.linger,
                    self.config.batch_size,
                )
                .await;
                let report = self.handle(partition, batch).await;
                let settled = report.messages + report.skipped > 0;
                if settled {
                    last_progress = Instant::now();
                }
                {
                    let mut shared = shared.lock().unwrap_or_else(|poison| poison.into_inner());
                    let (tally, progress) = &mut *shared;
                    tally.merge(&report);
                    progress(tally);
                }
                if once && !settled && self.caught_up(&consumer_name, last_progress).await? {
                    return Ok(());
                }
            }
        }
    }

    /// With `--once`: true when consumer `name` has nothing left to deliver and nothing
    /// unacknowledged — or when the database has settled nothing for [`STUCK_AFTER`] (the messages
    /// stay on the broker).
    async fn caught_up(&self, name: &str, last_progress: Instant) -> Result<bool, BrokerError> {
        let (pending, ack_pending) = self.lag_of(name).await?;
        if pending > 0 {
            return Ok(false);
        }
        if ack_pending == 0 {
            return Ok(true);
        }
        let stuck = last_progress.elapsed() > STUCK_AFTER;
        if stuck {
            tracing::warn!(
                consumer = name,
                unacknowledged = ack_pending,
                "messages stay unacknowledged because the database keeps failing; ending the run"
            );
        }
        Ok(stuck)
    }

    /// Applies one batch of `partition`'s consumer and settles every message with the broker. The
    /// other partitions' messages are acked without being applied: their own partition applies them.
    async fn handle(&self, partition: u32, delivered: Vec<jetstream::Message>) -> Tally {
        let started = Instant::now();
        let partitions = &self.config.partitions;
        // Events of aggregate types this projection does not read are acknowledged unread: never
        // decoded, parked or held (a subject of another shape is decoded, and parked if it is not
        // an event).
        let prefix = self.config.subject_prefix.as_str();
        let (delivered, other_types): (Vec<_>, Vec<_>) =
            delivered.into_iter().partition(|message| {
                subject_aggregate_type(prefix, &message.subject)
                    .is_none_or(|aggregate_type| reads::<P>(aggregate_type))
            });
        let (batch, others): (Vec<_>, Vec<_>) = delivered
            .into_iter()
            .partition(|message| partitions.of_subject(&message.subject) == partition);
        for message in others.iter().chain(&other_types) {
            if let Err(error) = message.ack().await {
                // A lost ack means a redelivery, skipped again.
                tracing::debug!(error = %ops::error_chain(error.as_ref()), "ack failed");
            }
        }
        let mut tally = Tally {
            skipped: others.len() as u64,
            other_types: other_types.len() as u64,
            ..Tally::default()
        };
        if !other_types.is_empty() {
            metrics::record_other_types(P::NAME, tally.other_types);
        }
        if !others.is_empty() {
            metrics::record_skipped(P::NAME, partitions.label(partition), tally.skipped);
        }
        if batch.is_empty() {
            return tally;
        }
        let raw: Vec<RawMessage> = batch.iter().map(raw_message).collect();
        let verdicts: Vec<Option<Verdict>> = match self.apply_partition_batch(partition, &raw).await
        {
            Ok(verdicts) => verdicts.into_iter().map(Some).collect(),
            Err(error) if blame(&error) == Blame::Database => {
                // Not the messages' fault: none of them is parked for it, all are delivered again.
                tracing::warn!(
                    projection = P::NAME,
                    error = %ops::error_chain(&error),
                    messages = batch.len(),
                    first_sequence = raw.first().map(|m| m.stream_sequence),
                    "the database failed the batch; its messages are retried"
                );
                vec![None; raw.len()]
            }
            Err(error) => {
                // Nothing was committed. One message may be to blame: apply them one by one, so
                // the others go through and the culprit alone is parked.
                tracing::warn!(
                    projection = P::NAME,
                    error = %ops::error_chain(&error),
                    messages = batch.len(),
                    first_sequence = raw.first().map(|m| m.stream_sequence),
                    "applying a batch failed; applying its messages one by one"
                );
                let mut verdicts = Vec::with_capacity(raw.len());
                for message in &raw {
                    verdicts.push(self.apply_alone(partition, message).await);
                }
                verdicts
            }
        };
        #[cfg(feature = "fault-injection")]
        if self.config.fail_point == crate::runner::FailPoint::AbortAfterCommit {
            tracing::warn!("fail point: aborting after the commit, before acking");
            std::process::abort();
        }
        let retried = verdicts.iter().filter(|v| v.is_none()).count() as u64;
        if retried > 0 {
            metrics::record_retried(P::NAME, retried);
        }
        for (message, verdict) in batch.iter().zip(&verdicts) {
            let kind = match verdict {
                Some(Verdict::Applied | Verdict::Duplicate | Verdict::Held) => AckKind::Ack,
                Some(Verdict::Parked) => AckKind::Term,
                // Neither applied nor parked (the database is failing): again after a delay that
                // grows with each delivery.
                None => AckKind::Nak(Some(retry_delay(
                    message.info().map_or(1, |info| info.delivered),
                ))),
            };
            if let Err(error) = message.ack_with(kind).await {
                // A lost ack means a redelivery, which the checkpoint absorbs.
                tracing::debug!(error = %ops::error_chain(error.as_ref()), "ack failed");
            }
        }
        tally.count(&verdicts.iter().flatten().copied().collect::<Vec<_>>());
        metrics::record_batch(P::NAME, &tally, started.elapsed());
        tracing::debug!(projection = P::NAME, ?tally, "batch");
        tally
    }

    /// Applies one message on its own. A message that fails twice on what it holds is parked with the
    /// error as its reason; one the database fails (see `blame.rs`), or that cannot even be parked,
    /// is `None`: the broker delivers it again later.
    pub(crate) async fn apply_alone(
        &self,
        partition: u32,
        message: &RawMessage,
    ) -> Option<Verdict> {
        let mut last_error = String::new();
        for attempt in 0..2 {
            match self
                .apply_partition_batch(partition, std::slice::from_ref(message))
                .await
            {
                Ok(verdicts) => return verdicts.first().copied(),
                Err(error) if blame(&error) == Blame::Database => {
                    // Not the message's fault: it must not be parked for it. The broker redelivers.
                    tracing::warn!(
                        projection = P::NAME,
                        stream_sequence = message.stream_sequence,
                        error = %ops::error_chain(&error),
                        "the database failed; leaving the message to the broker"
                    );
                    return None;
                }
                Err(error) => last_error = ops::error_chain(&error),
            }
            if attempt == 0 {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        let poison = Poison {
            reason: format!("applying it failed: {last_error}"),
            event_id: None,
            aggregate_id: None,
            aggregate_version: None,
        };
        let parked = async {
            let mut conn = self.pool.acquire().await?;
            park::park(&mut conn, &ParkRecord::new(message, poison)).await
        };
        match parked.await {
            Ok(()) => Some(Verdict::Parked),
            Err(error) => {
                tracing::error!(
                    projection = P::NAME,
                    stream_sequence = message.stream_sequence,
                    error = %ops::error_chain(&error),
                    apply_error = %last_error,
                    "cannot park a message that keeps failing; the broker will redeliver it"
                );
                None
            }
        }
    }
}

/// What had already arrived behind a batch's first message, at least, for the batch to wait its linger
/// for more: a backlog is being read (a replay, a catch-up), where fuller batches are cheaper per event.
const BUSY: usize = 64;

/// A batch: `first`, every message that has already arrived behind it and — only when that was a
/// backlog ([`BUSY`] messages or more) — what follows within `linger` of its arrival; `max` messages
/// at most.
///
/// An idle or lightly loaded consumer never waits on a timer: it applies what it has, and what arrives
/// while a batch is applied is waiting when the next one is collected, so a busy consumer batches by
/// itself. A linger counts from the first message, not between messages: while messages kept arriving
/// less than a linger apart, a batch went on collecting (60 ms and more at 1,500 events/s) and its
/// first message waited all that time. A stream error ends the batch; the caller's next read meets it
/// again.
async fn collect<M, E>(
    first: M,
    messages: &mut (impl futures::Stream<Item = Result<M, E>> + Unpin),
    linger: Duration,
    max: usize,
) -> Vec<M> {
    let until = tokio::time::Instant::now() + linger;
    let mut batch = vec![first];
    while batch.len() < max {
        match messages.next().now_or_never() {
            Some(Some(Ok(message))) => batch.push(message),
            Some(_) => return batch,
            None => break,
        }
    }
    if batch.len() < BUSY.min(max) {
        return batch;
    }
    while batch.len() < max {
        match tokio::time::timeout_at(until, messages.next()).await {
            Ok(Some(Ok(message))) => batch.push(message),
            _ => break,
        }
    }
    batch
}

fn raw_message(message: &jetstream::Message) -> RawMessage {
    RawMessage {
        stream_sequence: message.info().map(|i| i.stream_sequence).unwrap_or(0),
        subject: message.subject.to_string(),
        headers: message.headers.clone(),
        body: message.payload.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A message every 2 ms, forever (each ready 2 ms after the previous one was read).
    fn steady_arrivals() -> impl futures::Stream<Item = Result<u32, ()>> + Unpin {
        Box::pin(futures::stream::unfold(1u32, |n| async move {
            tokio::time::sleep(Duration::from_millis(2)).await;
            Some((Ok(n), n + 1))
        }))
    }

    #[tokio::test(start_paused = true)]
    async fn a_backlog_waits_the_linger_from_the_first_message_not_between_messages() {
        let started = tokio::time::Instant::now();
        let busy = u32::try_from(BUSY).expect("a small constant");
        let backlog = futures::stream::iter((1..busy).map(Ok)).chain(steady_arrivals());
        let batch = collect(0, &mut backlog.boxed(), Duration::from_millis(5), 500).await;
        // The backlog, then the messages of 2 and 4 ms; the next, at 6 ms, is for the next batch.
        // With the linger between messages instead, every gap was shorter and the batch filled.
        assert_eq!(batch.len(), BUSY + 2, "{:?}", &batch[batch.len() - 3..]);
        assert_eq!(started.elapsed(), Duration::from_millis(5));
    }

    #[tokio::test(start_paused = true)]
    async fn below_a_backlog_a_batch_is_what_has_arrived_and_nothing_waits() {
        let started = tokio::time::Instant::now();
        let arrived = futures::stream::iter([Ok(1), Ok(2), Ok(3)]).chain(steady_arrivals());
        let batch = collect(0, &mut arrived.boxed(), Duration::from_millis(5), 500).await;
        assert_eq!(batch, [0, 1, 2, 3], "what had arrived, not the next one");
        assert_eq!(started.elapsed(), Duration::ZERO, "no timer waited");
        let batch = collect(0, &mut steady_arrivals(), Duration::from_millis(5), 500).await;
        assert_eq!(
            batch,
            [0],
            "an idle stream: the first message alone, at once"
        );
        assert_eq!(started.elapsed(), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn a_batch_ends_when_full_or_when_the_stream_fails_or_ends() {
        let waiting = futures::stream::iter([Ok(1), Ok(2), Ok(3), Ok(4)]).chain(steady_arrivals());
        let full = collect(0, &mut waiting.boxed(), Duration::from_secs(1), 3).await;
        assert_eq!(full, vec![0, 1, 2], "at most `max` messages");
        let failing = futures::stream::iter([Ok(1), Err(()), Ok(2)]);
        let batch = collect(0, &mut failing.boxed(), Duration::from_secs(1), 10).await;
        assert_eq!(batch, vec![0, 1], "an error ends the batch");
        let ended = futures::stream::iter(Vec::<Result<u32, ()>>::new());
        let batch = collect(7, &mut ended.boxed(), Duration::from_secs(1), 10).await;
        assert_eq!(
            batch,
            vec![7],
            "the end of the stream ends the batch at once"
        );
    }
}
