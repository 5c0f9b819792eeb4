//! The one consumer runner every projection shares: fetch a batch from the projection's durable pull
//! consumer, decode and upcast, sort out duplicates, gaps and poison against the per-aggregate
//! checkpoints, apply the rest together with the new checkpoints in ONE transaction, commit, then ack.
//!
//! Exactly once in effect: a version at or below the checkpoint is a duplicate (acked, not applied); the
//! next version is applied and moves the checkpoint in the same transaction; a later version is a gap
//! (NAKed with a delay, applied once its predecessor is). A crash between commit and ack redelivers
//! messages that are now duplicates.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, PullConsumer, pull};
use async_nats::jetstream::{self, AckKind};
use domain::Upcasters;
use futures::StreamExt;
use serde::Serialize;
use sqlx::{PgConnection, PgPool, Row};
use uuid::Uuid;

use crate::decode::{Decoded, Poison, RawMessage, decode};
use crate::metrics;
use crate::projection::Projection;
use crate::schema;

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
    /// After the first message of a batch, how long to wait for more before applying.
    pub linger: Duration,
    /// Where to stop on purpose (tests reproduce crashes with it).
    pub fail_point: FailPoint,
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
        }
    }
}

/// Deliberate stops, to reproduce crashes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum FailPoint {
    /// Run normally.
    #[default]
    None,
    /// Abort the process after a batch committed, before any ack is sent.
    AbortAfterCommit,
}

/// What the runner decided for one message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// Applied; the checkpoint moved.
    Applied,
    /// Already applied (at or below the checkpoint): acked, not applied.
    Duplicate,
    /// A later version than the next one: not applied, redelivered after a delay.
    Gap,
    /// Cannot be applied by this code: stored in `parked`, terminated on the broker.
    Parked,
}

/// Counts over a batch or a run.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Tally {
    /// Messages seen.
    pub messages: u64,
    /// Applied.
    pub applied: u64,
    /// Duplicates absorbed.
    pub duplicates: u64,
    /// Gaps sent back for later.
    pub gaps: u64,
    /// Poison parked.
    pub parked: u64,
}

impl Tally {
    fn count(&mut self, verdicts: &[Verdict]) {
        for verdict in verdicts {
            self.messages += 1;
            match verdict {
                Verdict::Applied => self.applied += 1,
                Verdict::Duplicate => self.duplicates += 1,
                Verdict::Gap => self.gaps += 1,
                Verdict::Parked => self.parked += 1,
            }
        }
    }

    fn merge(&mut self, other: &Tally) {
        self.messages += other.messages;
        self.applied += other.applied;
        self.duplicates += other.duplicates;
        self.gaps += other.gaps;
        self.parked += other.parked;
    }
}

/// The consumer runner for projection `P`.
#[derive(Debug)]
pub struct Runner<P> {
    projection: Arc<P>,
    pool: PgPool,
    jetstream: jetstream::Context,
    client: async_nats::Client,
    config: RunnerConfig,
    upcasters: Upcasters,
}

impl<P: Projection> Runner<P> {
    /// Connects, creates the projection's schema and tables when missing.
    pub async fn connect(
        projection: P,
        database_url: &str,
        nats_url: &str,
        config: RunnerConfig,
    ) -> anyhow::Result<Self> {
        let pool = schema::connect(database_url, P::NAME, P::TABLES).await?;
        let client = async_nats::ConnectOptions::new()
            .name(format!("waybill-{}", P::NAME))
            .connection_timeout(Duration::from_secs(5))
            .connect(nats_url)
            .await
            .with_context(|| format!("connecting to NATS at {nats_url}"))?;
        Ok(Self {
            projection: Arc::new(projection),
            pool,
            jetstream: jetstream::new(client.clone()),
            client,
            config,
            upcasters: Upcasters::orders(),
        })
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

    fn consumer_config(&self) -> pull::Config {
        pull::Config {
            durable_name: Some(P::NAME.to_owned()),
            description: Some(format!("waybill {} projection", P::NAME)),
            deliver_policy: DeliverPolicy::All,
            ack_policy: AckPolicy::Explicit,
            ack_wait: self.config.ack_wait,
            max_ack_pending: self.config.max_ack_pending,
            filter_subject: domain::wire::all_subjects(&self.config.subject_prefix),
            ..Default::default()
        }
    }

    /// The projection's durable consumer, created when missing. An existing one with another filter or
    /// ack policy is refused with the difference named.
    pub async fn consumer(&self) -> anyhow::Result<PullConsumer> {
        let stream = self
            .jetstream
            .get_stream(&self.config.stream)
            .await
            .with_context(|| {
                format!(
                    "stream {} (start waybill-relay to create it)",
                    self.config.stream
                )
            })?;
        let wanted = self.consumer_config();
        let mut consumer: PullConsumer = stream
            .get_or_create_consumer(P::NAME, wanted.clone())
            .await
            .with_context(|| format!("creating consumer {}", P::NAME))?;
        let actual = consumer.info().await?.config.clone();
        if actual.filter_subject != wanted.filter_subject || actual.ack_policy != wanted.ack_policy
        {
            anyhow::bail!(
                "consumer {} exists with filter {:?} and ack policy {:?}, but the projection needs {:?} and {:?}; \
                 delete it or run `rebuild`",
                P::NAME,
                actual.filter_subject,
                actual.ack_policy,
                wanted.filter_subject,
                wanted.ack_policy
            );
        }
        if actual.ack_wait != wanted.ack_wait || actual.max_ack_pending != wanted.max_ack_pending {
            tracing::warn!(
                consumer = P::NAME,
                ack_wait = ?actual.ack_wait,
                max_ack_pending = actual.max_ack_pending,
                "the existing consumer keeps its own ack wait and ack-pending limit; `rebuild` recreates it with the new ones"
            );
        }
        Ok(consumer)
    }

    /// Messages in the stream not yet delivered to the consumer, and delivered but not acknowledged.
    pub async fn lag(&self) -> anyhow::Result<(u64, u64)> {
        let stream = self.jetstream.get_stream(&self.config.stream).await?;
        let mut consumer: PullConsumer = stream
            .get_consumer(P::NAME)
            .await
            .map_err(|e| anyhow::anyhow!("consumer {}: {e}", P::NAME))?;
        let info = consumer.info().await?;
        Ok((info.num_pending, info.num_ack_pending as u64))
    }

    /// Decides and applies a batch in one transaction; returns one verdict per message. Nothing is
    /// acked here: the caller acks after this returns, so a crash in between only redelivers.
    pub async fn apply_batch(&self, messages: &[RawMessage]) -> anyhow::Result<Vec<Verdict>> {
        let mut tx = self.pool.begin().await?;
        // Batches of every instance (and redrive, and rebuild) of this projection take turns.
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext('waybill.projection.' || $1))")
            .bind(P::NAME)
            .execute(&mut *tx)
            .await?;
        let verdicts =
            decide_and_apply(&mut tx, &*self.projection, &self.upcasters, messages).await?;
        tx.commit().await?;
        Ok(verdicts)
    }

    /// Consumes until `shutdown` resolves (or, with `once`, until nothing is pending).
    pub async fn run(
        &self,
        shutdown: impl std::future::Future<Output = ()> + Send,
        once: bool,
        mut progress: impl FnMut(&Tally) + Send,
    ) -> anyhow::Result<Tally> {
        metrics::describe();
        tokio::pin!(shutdown);
        let mut tally = Tally::default();
        // When a message was last applied, found a duplicate or parked: gaps alone are no progress.
        let mut last_progress = Instant::now();
        'connect: loop {
            let consumer = match self.consumer().await {
                Ok(consumer) => consumer,
                Err(error) if !once => {
                    tracing::warn!(
                        error = format!("{error:#}"),
                        "consumer unavailable; retrying in 2 s"
                    );
                    tokio::select! {
                        () = &mut shutdown => return Ok(tally),
                        () = tokio::time::sleep(Duration::from_secs(2)) => continue 'connect,
                    }
                }
                Err(error) => return Err(error),
            };
            let mut messages = consumer
                .stream()
                .max_messages_per_batch(self.config.batch_size.max(1))
                .messages()
                .await
                .context("opening the consumer's message stream")?;
            loop {
                let first = tokio::select! {
                    () = &mut shutdown => return Ok(tally),
                    next = tokio::time::timeout(Duration::from_secs(1), messages.next()) => next,
                };
                let first = match first {
                    Ok(Some(Ok(message))) => message,
                    Ok(Some(Err(error))) => {
                        tracing::warn!(%error, "consumer stream error; reconnecting");
                        tokio::time::sleep(Duration::from_millis(500)).await;
                        continue 'connect;
                    }
                    Ok(None) => continue 'connect,
                    Err(_idle) => {
                        if once && self.caught_up(last_progress).await? {
                            return Ok(tally);
                        }
                        continue;
                    }
                };
                let mut batch = vec![first];
                while batch.len() < self.config.batch_size {
                    match tokio::time::timeout(self.config.linger, messages.next()).await {
                        Ok(Some(Ok(message))) => batch.push(message),
                        _ => break,
                    }
                }
                let report = self.handle(batch).await;
                let moved = report.applied + report.duplicates + report.parked > 0;
                if moved {
                    last_progress = Instant::now();
                }
                tally.merge(&report);
                progress(&tally);
                // Gaps that keep coming back are not progress: --once must still end.
                if once && !moved && self.caught_up(last_progress).await? {
                    return Ok(tally);
                }
            }
        }
    }

    /// With `--once`: true when the consumer has nothing left to deliver and nothing unacknowledged —
    /// or only gaps, and nothing has been applied for 10 s (their predecessors are not in the stream,
    /// or are parked).
    async fn caught_up(&self, last_progress: Instant) -> anyhow::Result<bool> {
        let (pending, ack_pending) = self.lag().await?;
        if pending > 0 {
            return Ok(false);
        }
        if ack_pending == 0 {
            return Ok(true);
        }
        let stuck = last_progress.elapsed() > Duration::from_secs(10);
        if stuck {
            tracing::warn!(
                waiting = ack_pending,
                "events still wait for an earlier version that is not in the stream"
            );
        }
        Ok(stuck)
    }

    /// Applies one batch and settles every message with the broker.
    async fn handle(&self, batch: Vec<jetstream::Message>) -> Tally {
        let started = Instant::now();
        let raw: Vec<RawMessage> = batch.iter().map(raw_message).collect();
        let verdicts: Vec<Option<Verdict>> = match self.apply_batch(&raw).await {
            Ok(verdicts) => verdicts.into_iter().map(Some).collect(),
            Err(error) => {
                // Nothing was committed. One message may be to blame: apply them one by one, so
                // the others go through and the culprit alone is parked.
                tracing::warn!(
                    error = format!("{error:#}"),
                    messages = batch.len(),
                    "applying a batch failed; applying its messages one by one"
                );
                let mut verdicts = Vec::with_capacity(raw.len());
                for message in &raw {
                    verdicts.push(self.apply_alone(message).await);
                }
                verdicts
            }
        };
        if self.config.fail_point == FailPoint::AbortAfterCommit {
            tracing::warn!("fail point: aborting after the commit, before acking");
            std::process::abort();
        }
        for (message, verdict) in batch.iter().zip(&verdicts) {
            let kind = match verdict {
                Some(Verdict::Applied | Verdict::Duplicate) => AckKind::Ack,
                Some(Verdict::Parked) => AckKind::Term,
                Some(Verdict::Gap) => AckKind::Nak(Some(gap_delay(message))),
                // Neither applied nor parked (the database is failing): try again shortly.
                None => AckKind::Nak(Some(Duration::from_secs(1))),
            };
            if let Err(error) = message.ack_with(kind).await {
                // A lost ack means a redelivery, which the checkpoint absorbs.
                tracing::debug!(%error, "ack failed");
            }
        }
        let mut tally = Tally::default();
        tally.count(&verdicts.iter().flatten().copied().collect::<Vec<_>>());
        metrics::record_batch(P::NAME, &tally, started.elapsed());
        tracing::debug!(projection = P::NAME, ?tally, "batch");
        tally
    }

    /// Applies one message on its own. A message that fails twice while the database answers is
    /// parked with the error as its reason (a transient failure rarely repeats); if even parking fails,
    /// `None`: the broker redelivers it later.
    async fn apply_alone(&self, message: &RawMessage) -> Option<Verdict> {
        let mut last_error = None;
        for _ in 0..2 {
            match self.apply_batch(std::slice::from_ref(message)).await {
                Ok(verdicts) => return verdicts.first().copied(),
                Err(error) => last_error = Some(format!("{error:#}")),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let reason = format!("applying it failed: {}", last_error.unwrap_or_default());
        let poison = Poison {
            reason,
            event_id: None,
            aggregate_id: None,
            aggregate_version: None,
        };
        let mut conn = self.pool.acquire().await.ok()?;
        match park(&mut conn, message, &poison).await {
            Ok(()) => Some(Verdict::Parked),
            Err(error) => {
                tracing::error!(%error, "cannot park a message that keeps failing; the broker will redeliver it");
                None
            }
        }
    }

    /// Re-applies parked messages (after an upgrade taught the code their shape). Returns how many were
    /// applied or found to be duplicates, and how many stay parked.
    pub async fn redrive(&self) -> anyhow::Result<(u64, u64)> {
        let parked = sqlx::query(
            "SELECT id, stream_sequence, subject, headers, body FROM parked WHERE redriven_at IS NULL ORDER BY id",
        )
        .fetch_all(&self.pool)
        .await?;
        let mut resolved = 0;
        let mut remaining = 0;
        for row in &parked {
            let id: i64 = row.try_get("id")?;
            let message = RawMessage {
                stream_sequence: row
                    .try_get::<Option<i64>, _>("stream_sequence")?
                    .unwrap_or(0) as u64,
                subject: row.try_get("subject")?,
                headers: RawMessage::headers_from_json(&row.try_get("headers")?),
                body: bytes::Bytes::from(row.try_get::<Vec<u8>, _>("body")?),
            };
            let mut tx = self.pool.begin().await?;
            sqlx::query("SELECT pg_advisory_xact_lock(hashtext('waybill.projection.' || $1))")
                .bind(P::NAME)
                .execute(&mut *tx)
                .await?;
            // Redrive applies the message like a delivery, but never parks it a second time.
            let verdict = match decode(&message.body, &self.upcasters) {
                Err(poison) => Err(poison.reason),
                Ok(decoded) => {
                    let verdicts = decide_and_apply(
                        &mut tx,
                        &*self.projection,
                        &self.upcasters,
                        std::slice::from_ref(&message),
                    )
                    .await?;
                    match verdicts[0] {
                        Verdict::Gap => Err(format!(
                            "waiting for version {} first",
                            decoded.aggregate_version - 1
                        )),
                        verdict => Ok(verdict),
                    }
                }
            };
            match verdict {
                Ok(verdict) => {
                    sqlx::query(
                        "UPDATE parked SET redriven_at = now(), redrive_note = $2 WHERE id = $1",
                    )
                    .bind(id)
                    .bind(format!("{verdict:?}").to_lowercase())
                    .execute(&mut *tx)
                    .await?;
                    resolved += 1;
                }
                Err(reason) => {
                    sqlx::query("UPDATE parked SET redrive_note = $2 WHERE id = $1")
                        .bind(id)
                        .bind(format!("still parked: {reason}"))
                        .execute(&mut *tx)
                        .await?;
                    remaining += 1;
                }
            }
            tx.commit().await?;
        }
        Ok((resolved, remaining))
    }

    /// Wipes the projection's state and consumer, then replays the stream from its start.
    pub async fn rebuild(&self, progress: impl FnMut(&Tally) + Send) -> anyhow::Result<Tally> {
        self.reset().await?;
        self.run(std::future::pending(), true, progress).await
    }

    /// Wipes the projection's state (its schema recreated empty) and deletes its consumer, so the next
    /// run starts from the beginning of the stream.
    pub async fn reset(&self) -> anyhow::Result<()> {
        let mut tx = self.pool.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext('waybill.projection.' || $1))")
            .bind(P::NAME)
            .execute(&mut *tx)
            .await?;
        // The consumer goes first: if the wipe then fails, the state is replayed onto itself (the
        // checkpoints absorb it); the other way round, an empty state would resume mid-stream.
        let stream = self.jetstream.get_stream(&self.config.stream).await?;
        match stream.delete_consumer(P::NAME).await {
            Ok(_) => tracing::info!(
                consumer = P::NAME,
                "deleted the consumer; replaying from the start"
            ),
            Err(error) if is_not_found(&error) => tracing::debug!("no consumer to delete"),
            Err(error) => return Err(anyhow::anyhow!("deleting consumer {}: {error}", P::NAME)),
        }
        schema::reset(&mut tx, P::NAME, P::TABLES).await?;
        tx.commit().await?;
        Ok(())
    }

    /// How many messages the stream holds (a rebuild's total).
    pub async fn stream_messages(&self) -> anyhow::Result<u64> {
        let mut stream = self.jetstream.get_stream(&self.config.stream).await?;
        Ok(stream.info().await?.state.messages)
    }
}

/// The heart of the runner, shared by delivery and redrive: classify every message against the
/// checkpoints, apply the next versions through the projection, move the checkpoints, park poison.
async fn decide_and_apply<P: Projection>(
    tx: &mut PgConnection,
    projection: &P,
    upcasters: &Upcasters,
    messages: &[RawMessage],
) -> anyhow::Result<Vec<Verdict>> {
    let mut verdicts = vec![Verdict::Parked; messages.len()];
    let mut decoded: Vec<(usize, Decoded)> = Vec::with_capacity(messages.len());
    let mut poison: Vec<(usize, Poison)> = Vec::new();
    for (index, message) in messages.iter().enumerate() {
        match decode(&message.body, upcasters) {
            Ok(event) => decoded.push((index, event)),
            Err(reason) => poison.push((index, reason)),
        }
    }

    let aggregates: Vec<Uuid> = decoded.iter().map(|(_, d)| d.order_id.as_uuid()).collect();
    let mut checkpoints: HashMap<Uuid, i64> = sqlx::query_as::<_, (Uuid, i64)>(
        "SELECT aggregate_id, version FROM checkpoints WHERE aggregate_id = ANY($1)",
    )
    .bind(&aggregates)
    .fetch_all(&mut *tx)
    .await?
    .into_iter()
    .collect();

    // Per aggregate in version order: a version 2 that arrived before version 1 in the same batch is
    // applied right after it.
    decoded.sort_by_key(|(index, d)| (d.order_id, d.aggregate_version, *index));
    let mut to_apply: Vec<Decoded> = Vec::new();
    let mut moved: HashMap<Uuid, (i64, Uuid)> = HashMap::new();
    for (index, event) in decoded {
        let current = checkpoints.entry(event.order_id.as_uuid()).or_insert(0);
        verdicts[index] = if event.aggregate_version <= *current {
            Verdict::Duplicate
        } else if event.aggregate_version == *current + 1 {
            *current = event.aggregate_version;
            moved.insert(
                event.order_id.as_uuid(),
                (event.aggregate_version, event.event_id),
            );
            to_apply.push(event);
            Verdict::Applied
        } else {
            Verdict::Gap
        };
    }

    if !to_apply.is_empty() {
        projection.apply(tx, &to_apply).await?;
        let mut moved: Vec<(Uuid, (i64, Uuid))> = moved.into_iter().collect();
        moved.sort_by_key(|(id, _)| *id);
        sqlx::query(
            "INSERT INTO checkpoints (aggregate_id, version, event_id)
             SELECT * FROM UNNEST($1::uuid[], $2::int8[], $3::uuid[])
             ON CONFLICT (aggregate_id) DO UPDATE
                 SET version = EXCLUDED.version, event_id = EXCLUDED.event_id, updated_at = now()",
        )
        .bind(moved.iter().map(|(id, _)| *id).collect::<Vec<_>>())
        .bind(moved.iter().map(|(_, (v, _))| *v).collect::<Vec<_>>())
        .bind(moved.iter().map(|(_, (_, e))| *e).collect::<Vec<_>>())
        .execute(&mut *tx)
        .await?;
    }

    for (index, poison) in &poison {
        park(tx, &messages[*index], poison).await?;
    }
    Ok(verdicts)
}

/// Stores a message that cannot be applied, whole, with why. PostgreSQL text cannot hold NUL, which a
/// hostile message can smuggle into a reason or a header: those characters are dropped there (the
/// body is kept byte for byte).
async fn park(conn: &mut PgConnection, message: &RawMessage, poison: &Poison) -> sqlx::Result<()> {
    tracing::warn!(stream_sequence = message.stream_sequence, subject = %message.subject, reason = %poison.reason, "parking poison message");
    let text = |s: &str| s.replace('\0', "");
    sqlx::query(
        "INSERT INTO parked (stream_sequence, subject, headers, body, reason, event_id, aggregate_id, aggregate_version)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
    )
    .bind(i64::try_from(message.stream_sequence).ok().filter(|s| *s > 0))
    .bind(text(&message.subject))
    .bind(message.headers_json())
    .bind(message.body.as_ref())
    .bind(text(&poison.reason))
    .bind(poison.event_id)
    .bind(poison.aggregate_id)
    .bind(poison.aggregate_version)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

fn is_not_found(error: &jetstream::stream::ConsumerError) -> bool {
    matches!(error.kind(), jetstream::stream::ConsumerErrorKind::JetStream(e) if e.error_code() == jetstream::ErrorCode::CONSUMER_NOT_FOUND)
}

fn raw_message(message: &jetstream::Message) -> RawMessage {
    RawMessage {
        stream_sequence: message.info().map(|i| i.stream_sequence).unwrap_or(0),
        subject: message.subject.to_string(),
        headers: message.headers.clone(),
        body: message.payload.clone(),
    }
}

/// How long a gap waits before redelivery: longer each time, at most 10 s.
fn gap_delay(message: &jetstream::Message) -> Duration {
    let delivered = message.info().map(|i| i.delivered).unwrap_or(1).max(1) as u64;
    Duration::from_millis((250 * delivered).min(10_000))
}
