//! The one runner every projection shares: its settings, its durable consumer, and the transaction at
//! its heart — decode and check each message, let the [`Plan`] decide against the per-aggregate
//! checkpoints and the held table, apply through the projection, move the checkpoints, hold gaps and
//! park poison, all in ONE transaction. Consuming is in `consume.rs`, parking in `park.rs`, the held
//! table in `held.rs`, blue/green rebuilds in `rebuild.rs`.
//!
//! Exactly once in effect: a version at or below the checkpoint is a duplicate (acked, not applied);
//! the next version is applied and moves the checkpoint in the same transaction; a later version is
//! held in the projection's own database (and acked) until its predecessor is applied. A crash between
//! commit and ack redelivers messages that are now duplicates.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, PullConsumer, pull};
use async_nats::jetstream::{self};
use domain::{OrderEvent, Upcasters};
use serde::Serialize;
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use crate::decode::{Decoded, Poison, RawMessage, decode, decode_message};
use crate::park::{self, ParkRecord};
use crate::plan::{Checkpoint, Facts, Offer, Plan, Slot, Verdict};
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
}

/// Counts over a batch or a run.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Tally {
    /// Messages seen.
    pub messages: u64,
    /// Applied straight from the delivery.
    pub applied: u64,
    /// Duplicates absorbed.
    pub duplicates: u64,
    /// Kept in the held table for a missing predecessor.
    pub held: u64,
    /// Poison parked.
    pub parked: u64,
}

impl Tally {
    pub(crate) fn count(&mut self, verdicts: &[Verdict]) {
        for verdict in verdicts {
            self.messages += 1;
            match verdict {
                Verdict::Applied => self.applied += 1,
                Verdict::Duplicate => self.duplicates += 1,
                Verdict::Held => self.held += 1,
                Verdict::Parked => self.parked += 1,
            }
        }
    }

    pub(crate) fn merge(&mut self, other: &Tally) {
        self.messages += other.messages;
        self.applied += other.applied;
        self.duplicates += other.duplicates;
        self.held += other.held;
        self.parked += other.parked;
    }
}

/// What happens to a message that cannot be applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OnPoison {
    /// Park it (deliveries).
    Park,
    /// Report why, park nothing (redrive: the message is parked already).
    Report,
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
}

impl<P: Projection> Runner<P> {
    /// Connects, creates the projection's schema and tables when missing.
    pub async fn connect(
        projection: P,
        database_url: &str,
        nats: impl Into<ops::NatsConnection>,
        config: RunnerConfig,
    ) -> anyhow::Result<Self> {
        let pool = schema::connect(database_url, P::NAME, P::TABLES).await?;
        let client = nats.into().connect(&format!("waybill-{}", P::NAME)).await?;
        Ok(Self {
            projection: Arc::new(projection),
            pool,
            jetstream: jetstream::new(client.clone()),
            client,
            config,
            upcasters: Upcasters::orders(),
            database_url: database_url.to_owned(),
            schema: P::NAME.to_owned(),
            consumer_name: P::NAME.to_owned(),
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

    pub(crate) fn consumer_config(&self, deliver_policy: DeliverPolicy) -> pull::Config {
        pull::Config {
            durable_name: Some(self.consumer_name.clone()),
            description: Some(format!("waybill {} projection", P::NAME)),
            deliver_policy,
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
        let wanted = self.consumer_config(DeliverPolicy::All);
        let mut consumer: PullConsumer = stream
            .get_or_create_consumer(&self.consumer_name, wanted.clone())
            .await
            .with_context(|| format!("creating consumer {}", self.consumer_name))?;
        let actual = consumer.info().await?.config.clone();
        if actual.filter_subject != wanted.filter_subject || actual.ack_policy != wanted.ack_policy
        {
            anyhow::bail!(
                "consumer {} exists with filter {:?} and ack policy {:?}, but the projection needs {:?} and {:?}; \
                 delete it or run `rebuild`",
                self.consumer_name,
                actual.filter_subject,
                actual.ack_policy,
                wanted.filter_subject,
                wanted.ack_policy
            );
        }
        if actual.ack_wait != wanted.ack_wait || actual.max_ack_pending != wanted.max_ack_pending {
            tracing::warn!(
                consumer = %self.consumer_name,
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
            .get_consumer(&self.consumer_name)
            .await
            .map_err(|e| anyhow::anyhow!("consumer {}: {e}", self.consumer_name))?;
        let info = consumer.info().await?;
        Ok((info.num_pending, info.num_ack_pending as u64))
    }

    /// Takes this state's turn: batches of every instance (and redrive, release, the swap of a
    /// rebuild) of one projection state take turns.
    pub(crate) async fn lock(&self, tx: &mut PgConnection) -> sqlx::Result<()> {
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext('waybill.projection.' || $1))")
            .bind(&self.schema)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }

    /// Decides and applies a batch in one transaction; returns one verdict per message. Nothing is
    /// acked here: the caller acks after this returns, so a crash in between only redelivers.
    pub async fn apply_batch(&self, messages: &[RawMessage]) -> anyhow::Result<Vec<Verdict>> {
        let mut tx = self.pool.begin().await?;
        self.lock(&mut tx).await?;
        let decisions = decide_and_apply(
            &mut tx,
            &*self.projection,
            &self.upcasters,
            messages,
            None,
            OnPoison::Park,
        )
        .await?;
        tx.commit().await?;
        Ok(decisions.into_iter().map(|(verdict, _)| verdict).collect())
    }

    /// How many messages the stream holds (a rebuild's total).
    pub async fn stream_messages(&self) -> anyhow::Result<u64> {
        let mut stream = self.jetstream.get_stream(&self.config.stream).await?;
        Ok(stream.info().await?.state.messages)
    }
}

/// An aggregate's checkpoint (absent before its first event) and whether anything is held for it.
#[derive(Debug, sqlx::FromRow)]
struct CheckpointRow {
    aggregate_id: Uuid,
    version: Option<i64>,
    total_cents: Option<i64>,
    has_held: bool,
}

/// A held row taken out of the held table to be applied (or found stale).
#[derive(Debug, sqlx::FromRow)]
pub(crate) struct HeldRow {
    pub(crate) aggregate_id: Uuid,
    pub(crate) version: i64,
    pub(crate) event_id: Uuid,
    pub(crate) stream_sequence: Option<i64>,
    pub(crate) subject: String,
    pub(crate) headers: Vec<u8>,
    pub(crate) body: Vec<u8>,
}

impl HeldRow {
    fn message(&self) -> RawMessage {
        RawMessage {
            stream_sequence: self.stream_sequence.unwrap_or(0).max(0) as u64,
            subject: self.subject.clone(),
            headers: serde_json::from_slice(&self.headers)
                .ok()
                .and_then(|v| RawMessage::headers_from_json(&v)),
            body: bytes::Bytes::from(self.body.clone()),
        }
    }
}

fn facts(event: &OrderEvent) -> Facts {
    match event {
        OrderEvent::Placed(placed) => Facts::Placed {
            total_cents: placed.total_cents,
        },
        OrderEvent::Paid(paid) => Facts::Paid {
            amount_cents: paid.amount_cents.get(),
        },
        OrderEvent::Cancelled(_) | OrderEvent::Shipped(_) => Facts::Other,
    }
}

fn offer(slot: Slot, decoded: &Decoded) -> Offer {
    Offer {
        slot,
        aggregate_id: decoded.order_id.as_uuid(),
        version: decoded.aggregate_version,
        facts: facts(&decoded.event),
    }
}

/// The heart of the runner, shared by delivery, redrive and release: decode and check every message,
/// let the plan decide against the checkpoints and the held table, apply, move the checkpoints, hold
/// the gaps, and park the poison (or, with [`OnPoison::Report`], return why). `force` sets one
/// aggregate's checkpoint first (an operator's release). One `(verdict, reason)` per message; the
/// reason is set for parked ones.
pub(crate) async fn decide_and_apply<P: Projection>(
    tx: &mut PgConnection,
    projection: &P,
    upcasters: &Upcasters,
    messages: &[RawMessage],
    force: Option<(Uuid, i64)>,
    on_poison: OnPoison,
) -> anyhow::Result<Vec<(Verdict, Option<String>)>> {
    let mut decoded: Vec<Option<Decoded>> = Vec::with_capacity(messages.len());
    let mut poison: Vec<(usize, Poison)> = Vec::new();
    for (index, message) in messages.iter().enumerate() {
        match decode_message(message, upcasters) {
            Ok(event) => decoded.push(Some(event)),
            Err(reason) => {
                decoded.push(None);
                poison.push((index, reason));
            }
        }
    }

    let mut aggregates: Vec<Uuid> = decoded
        .iter()
        .flatten()
        .map(|d| d.order_id.as_uuid())
        .chain(force.map(|(id, _)| id))
        .collect();
    aggregates.sort();
    aggregates.dedup();
    // One round trip for the checkpoints and for which orders have held events: the held table is
    // then queried only for those, which is almost never.
    let rows: Vec<CheckpointRow> = sqlx::query_as(
        "SELECT a.aggregate_id, c.version, c.total_cents,
                EXISTS (SELECT 1 FROM held h WHERE h.aggregate_id = a.aggregate_id) AS has_held
         FROM UNNEST($1::uuid[]) AS a(aggregate_id)
         LEFT JOIN checkpoints c ON c.aggregate_id = a.aggregate_id",
    )
    .bind(&aggregates)
    .fetch_all(&mut *tx)
    .await
    .context("reading checkpoints")?;
    let with_held: std::collections::HashSet<Uuid> = rows
        .iter()
        .filter(|row| row.has_held)
        .map(|row| row.aggregate_id)
        .collect();
    let checkpoints: HashMap<Uuid, Checkpoint> = rows
        .into_iter()
        .filter_map(|row| {
            let version = row.version?;
            Some((
                row.aggregate_id,
                Checkpoint {
                    version,
                    total_cents: row.total_cents,
                },
            ))
        })
        .collect();

    let mut plan = Plan::new(messages.len(), checkpoints);
    if let Some((aggregate_id, version)) = force {
        plan.force(aggregate_id, version);
    }
    plan.offer_batch(
        decoded
            .iter()
            .enumerate()
            .filter_map(|(index, d)| d.as_ref().map(|d| offer(Slot::Batch(index), d)))
            .collect(),
    );

    // Chase the held table behind every checkpoint that moved, until nothing more moves. Rows at or
    // below the new checkpoint are stale and leave the table too.
    let mut held: Vec<(HeldRow, Result<Decoded, Poison>)> = Vec::new();
    let mut held_poison: Vec<usize> = Vec::new();
    loop {
        // Rows are added to `held` only after this loop, so an order without held rows at the start
        // of the transaction has none to take.
        let wanted: Vec<(Uuid, i64)> = plan
            .wanted()
            .into_iter()
            .filter(|(id, _)| with_held.contains(id))
            .collect();
        if wanted.is_empty() {
            break;
        }
        let rows: Vec<HeldRow> = sqlx::query_as(
            "DELETE FROM held h USING UNNEST($1::uuid[], $2::int8[]) AS w(aggregate_id, upto)
             WHERE h.aggregate_id = w.aggregate_id AND h.version <= w.upto
             RETURNING h.aggregate_id, h.version, h.event_id, h.stream_sequence, h.subject, h.headers, h.body",
        )
        .bind(wanted.iter().map(|(id, _)| *id).collect::<Vec<_>>())
        .bind(wanted.iter().map(|(_, v)| *v).collect::<Vec<_>>())
        .fetch_all(&mut *tx)
        .await
        .context("taking held events")?;
        let mut offers = Vec::with_capacity(rows.len());
        for row in rows {
            let index = held.len();
            // Checked when it was held; decoded again because this code may be newer than that.
            let result = decode(&row.body, upcasters);
            match &result {
                Ok(decoded) => offers.push(offer(Slot::Held(index), decoded)),
                Err(_) => held_poison.push(index),
            }
            held.push((row, result));
        }
        plan.offer_held(offers);
    }
    let outcome = plan.finish();

    if !outcome.apply.is_empty() {
        let mut events: Vec<Decoded> = Vec::with_capacity(outcome.apply.len());
        for slot in &outcome.apply {
            let event = match *slot {
                Slot::Batch(index) => decoded[index].as_ref(),
                Slot::Held(index) => held[index].1.as_ref().ok(),
            };
            events.push(event.expect("the plan applies only decoded events").clone());
        }
        projection.apply(tx, &events).await.with_context(|| {
            format!(
                "applying {} events to the {} projection",
                events.len(),
                P::NAME
            )
        })?;
        let mut last_event: HashMap<Uuid, Uuid> = HashMap::new();
        for event in &events {
            last_event.insert(event.order_id.as_uuid(), event.event_id);
        }
        write_checkpoints(tx, &outcome.checkpoints, &last_event).await?;
    } else if !outcome.checkpoints.is_empty() {
        write_checkpoints(tx, &outcome.checkpoints, &HashMap::new()).await?;
    }

    if !outcome.hold.is_empty() {
        let held_now: Vec<(&RawMessage, &Decoded)> = outcome
            .hold
            .iter()
            .filter_map(|&i| decoded[i].as_ref().map(|d| (&messages[i], d)))
            .collect();
        sqlx::query(
            "INSERT INTO held (aggregate_id, version, event_id, stream_sequence, subject, headers, body)
             SELECT * FROM UNNEST($1::uuid[], $2::int8[], $3::uuid[], $4::int8[], $5::text[], $6::bytea[], $7::bytea[])
             ON CONFLICT (aggregate_id, version) DO NOTHING",
        )
        .bind(held_now.iter().map(|(_, d)| d.order_id.as_uuid()).collect::<Vec<_>>())
        .bind(held_now.iter().map(|(_, d)| d.aggregate_version).collect::<Vec<_>>())
        .bind(held_now.iter().map(|(_, d)| d.event_id).collect::<Vec<_>>())
        .bind(held_now.iter().map(|(m, _)| sequence(m)).collect::<Vec<_>>())
        .bind(held_now.iter().map(|(m, _)| park::storable(&m.subject)).collect::<Vec<_>>())
        .bind(held_now.iter().map(|(m, _)| park::headers_bytes(m)).collect::<Vec<_>>())
        .bind(held_now.iter().map(|(m, _)| m.body.to_vec()).collect::<Vec<_>>())
        .execute(&mut *tx)
        .await
        .context("holding events that wait for their predecessor")?;
    }

    let mut results: Vec<(Verdict, Option<String>)> =
        outcome.verdicts.iter().map(|v| (*v, None)).collect();
    let mut to_park: Vec<ParkRecord> = Vec::new();
    for (index, poison) in poison {
        results[index].1 = Some(poison.reason.clone());
        to_park.push(ParkRecord::new(&messages[index], poison));
    }
    for (slot, reason) in &outcome.refuse {
        match *slot {
            Slot::Batch(index) => {
                results[index].1 = Some(reason.clone());
                let decoded = decoded[index].as_ref();
                to_park.push(ParkRecord::new(
                    &messages[index],
                    Poison {
                        reason: reason.clone(),
                        event_id: decoded.map(|d| d.event_id),
                        aggregate_id: decoded.map(|d| d.order_id.as_uuid()),
                        aggregate_version: decoded.map(|d| d.aggregate_version),
                    },
                ));
            }
            Slot::Held(index) => {
                // Out of the held table already: parked whatever `on_poison` says, or it is lost.
                let row = &held[index].0;
                park::park(
                    tx,
                    &ParkRecord::new(
                        &row.message(),
                        Poison {
                            reason: reason.clone(),
                            event_id: Some(row.event_id),
                            aggregate_id: Some(row.aggregate_id),
                            aggregate_version: Some(row.version),
                        },
                    ),
                )
                .await?;
            }
        }
    }
    for index in held_poison {
        let (row, result) = &held[index];
        if let Err(poison) = result {
            park::park(tx, &ParkRecord::new(&row.message(), poison.clone())).await?;
        }
    }
    if on_poison == OnPoison::Park {
        for record in &to_park {
            park::park(tx, record).await?;
        }
    }
    Ok(results)
}

async fn write_checkpoints(
    tx: &mut PgConnection,
    moved: &std::collections::BTreeMap<Uuid, Checkpoint>,
    last_event: &HashMap<Uuid, Uuid>,
) -> anyhow::Result<()> {
    // An operator's release moves a checkpoint without an event: `event_id` stays NULL then.
    sqlx::query(
        "INSERT INTO checkpoints (aggregate_id, version, event_id, total_cents)
         SELECT * FROM UNNEST($1::uuid[], $2::int8[], $3::uuid[], $4::int8[])
         ON CONFLICT (aggregate_id) DO UPDATE
             SET version = EXCLUDED.version, event_id = EXCLUDED.event_id,
                 total_cents = EXCLUDED.total_cents, updated_at = now()",
    )
    .bind(moved.keys().copied().collect::<Vec<_>>())
    .bind(moved.values().map(|c| c.version).collect::<Vec<_>>())
    .bind(
        moved
            .keys()
            .map(|id| last_event.get(id).copied())
            .collect::<Vec<_>>(),
    )
    .bind(moved.values().map(|c| c.total_cents).collect::<Vec<_>>())
    .execute(&mut *tx)
    .await
    .context("moving checkpoints")?;
    Ok(())
}

fn sequence(message: &RawMessage) -> Option<i64> {
    i64::try_from(message.stream_sequence)
        .ok()
        .filter(|s| *s > 0)
}

pub(crate) fn is_not_found(error: &jetstream::stream::ConsumerError) -> bool {
    matches!(error.kind(), jetstream::stream::ConsumerErrorKind::JetStream(e) if e.error_code() == jetstream::ErrorCode::CONSUMER_NOT_FOUND)
}
