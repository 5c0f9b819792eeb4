//! The facts the demo narrates, read back from where they live (the stream, the outbox, the projections'
//! parked messages) before they are told: a claim that does not hold fails the demo with what was found.

use std::time::{Duration, Instant};

use anyhow::Context;
use async_nats::jetstream;
use async_nats::jetstream::stream::RawMessageErrorKind;
use domain::EventEnvelope;
use relay::admin::{self, OutboxRow, RowStatus};
use sqlx::PgPool;
use uuid::Uuid;

use crate::http::Http;

/// One stored message carrying the watched event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Copy {
    /// Its stream sequence.
    pub sequence: u64,
    /// Its `Nats-Msg-Id` header (the event id when a relay published it).
    pub msg_id: Option<String>,
}

/// The copies as a sentence, for a failure message.
fn describe(copies: &[Copy]) -> String {
    if copies.is_empty() {
        return "no copy".to_owned();
    }
    let each: Vec<String> = copies
        .iter()
        .map(|c| {
            format!(
                "sequence {} under Nats-Msg-Id {}",
                c.sequence,
                c.msg_id.as_deref().unwrap_or("(none)")
            )
        })
        .collect();
    let noun = if copies.len() == 1 { "copy" } else { "copies" };
    format!("{} {noun}: {}", copies.len(), each.join(", "))
}

/// The crash-window event: the first event of the first order, and the subject its aggregate's events
/// are published on.
#[derive(Debug, Clone)]
pub(super) struct Watched {
    /// The event.
    pub event_id: Uuid,
    order: Uuid,
    aggregate_type: String,
    prefix: String,
    stream: String,
}

impl Watched {
    /// The first event of order `order`, published under `prefix` in `stream`.
    pub(super) async fn first_event_of(
        pool: &PgPool,
        order: Uuid,
        stream: &str,
        prefix: &str,
    ) -> anyhow::Result<Self> {
        let (event_id, aggregate_type): (Uuid, String) = sqlx::query_as(
            "SELECT event_id, aggregate_type FROM events WHERE aggregate_id = $1 AND aggregate_version = 1",
        )
        .bind(order)
        .fetch_one(pool)
        .await
        .context("reading the first event")?;
        Ok(Self {
            event_id,
            order,
            aggregate_type,
            prefix: prefix.to_owned(),
            stream: stream.to_owned(),
        })
    }

    /// Every copy of the event in the stream. Read through its aggregate's subject alone: walking the
    /// whole stream message by message took seconds once the story had written thousands of events.
    pub(super) async fn copies(&self, js: &jetstream::Context) -> anyhow::Result<Vec<Copy>> {
        let stream = js.get_stream(&self.stream).await?;
        // Where the stream stores the order: its subject, with its partition when the stream splits.
        let partitions = ops::stream_partitions(&stream.cached_info().config, &self.prefix);
        let subject = domain::wire::stored_subject(
            &self.prefix,
            &self.aggregate_type,
            self.order,
            partitions,
        )
        .map_err(anyhow::Error::msg)?;
        let mut copies = Vec::new();
        let mut from = 1;
        loop {
            match stream
                .get_first_raw_message_by_subject(&subject, from)
                .await
            {
                Ok(message) => {
                    from = message.sequence + 1;
                    if EventEnvelope::from_json(&message.payload)
                        .is_ok_and(|e| e.event_id == self.event_id)
                    {
                        copies.push(Copy {
                            sequence: message.sequence,
                            msg_id: message
                                .headers
                                .get(domain::wire::MSG_ID)
                                .map(|v| v.as_str().to_owned()),
                        });
                    }
                }
                Err(error) if error.kind() == RawMessageErrorKind::NoMessageFound => {
                    return Ok(copies);
                }
                Err(error) => {
                    return Err(error).with_context(|| format!("reading {subject}"));
                }
            }
        }
    }

    /// The event's outbox row, as the relay left it.
    pub(super) async fn outbox_row(&self, pool: &PgPool) -> anyhow::Result<OutboxRow> {
        admin::row_of_event(pool, self.event_id)
            .await
            .context("reading the crash-window event's outbox row")?
            .with_context(|| format!("event {} has no outbox row", self.event_id))
    }

    fn is_own(&self, copy: &Copy) -> bool {
        copy.msg_id.as_deref() == Some(self.event_id.to_string().as_str())
    }

    /// The crash window is open: the crashed relay's publish reached the stream (one copy, under the
    /// event id) but its mark did not reach the outbox (the row is still pending). Returns the copy's
    /// sequence.
    pub(super) async fn crash_window(
        &self,
        pool: &PgPool,
        js: &jetstream::Context,
    ) -> anyhow::Result<u64> {
        let copies = self.copies(js).await?;
        let row = self.outbox_row(pool).await?;
        match copies.as_slice() {
            [copy] if self.is_own(copy) && row.status == RowStatus::Pending => Ok(copy.sequence),
            _ => anyhow::bail!(
                "the crash window did not happen: event {} should be in the stream once under its own \
                 Nats-Msg-Id with its outbox row pending, but the stream holds {} and the row is {}",
                self.event_id,
                describe(&copies),
                row.status
            ),
        }
    }

    /// The relay started after the crash published the row again and JetStream recognised it: the row
    /// is sent by `relay_id` with the crashed relay's copy as its stream sequence, and the stream still
    /// holds that one copy. Waits up to `timeout` for the row to be marked.
    pub(super) async fn deduplicated(
        &self,
        pool: &PgPool,
        js: &jetstream::Context,
        crash_copy: u64,
        relay_id: &str,
        timeout: Duration,
    ) -> anyhow::Result<OutboxRow> {
        let deadline = Instant::now() + timeout;
        let row = loop {
            let row = self.outbox_row(pool).await?;
            if row.status == RowStatus::Sent {
                break row;
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "the restarted relay did not mark event {}'s outbox row sent within {timeout:?} (it is {})",
                self.event_id,
                row.status
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let copies = self.copies(js).await?;
        let expected = Copy {
            sequence: crash_copy,
            msg_id: Some(self.event_id.to_string()),
        };
        anyhow::ensure!(
            copies == [expected] && row.stream_seq == i64::try_from(crash_copy).ok(),
            "JetStream did not deduplicate the relay's second publish of event {}: the stream holds \
             {} (expected only sequence {crash_copy}) and the outbox row names sequence {:?}",
            self.event_id,
            describe(&copies),
            row.stream_seq
        );
        anyhow::ensure!(
            row.claimed_by.as_deref() == Some(relay_id),
            "event {}'s outbox row was settled by {:?}, not by the restarted relay {relay_id}",
            self.event_id,
            row.claimed_by
        );
        Ok(row)
    }

    /// Exactly two copies: the relayed one (`crash_copy`, under the event id) and the deliberate
    /// duplicate under another message id. Returns the duplicate's sequence.
    pub(super) async fn duplicated(
        &self,
        js: &jetstream::Context,
        crash_copy: u64,
    ) -> anyhow::Result<u64> {
        let copies = self.copies(js).await?;
        match copies.as_slice() {
            [relayed, duplicate]
                if relayed.sequence == crash_copy
                    && self.is_own(relayed)
                    && !self.is_own(duplicate) =>
            {
                Ok(duplicate.sequence)
            }
            _ => anyhow::bail!(
                "event {} should be in the stream twice (sequence {crash_copy} under its own \
                 Nats-Msg-Id, then the duplicate under another), but the stream holds {}",
                self.event_id,
                describe(&copies)
            ),
        }
    }
}

/// The projections that read orders (built in and read models), whose consumers see the duplicated
/// order event; a model of other aggregate types acknowledges it unread.
pub(super) fn reading_orders() -> Vec<&'static str> {
    projections::registry::names()
        .into_iter()
        .filter(|name| {
            projections::registry::aggregates(name).is_some_and(|types| types.contains(&"order"))
        })
        .collect()
}

/// Every projection that reads orders parked the duplicate (stream sequence `duplicate`) instead of
/// applying it.
pub(super) async fn parked_by_every_projection(
    pool: &PgPool,
    duplicate: u64,
) -> anyhow::Result<()> {
    for schema in reading_orders() {
        // The projections keep their tables in a schema named after them, in the demo's database.
        let parked: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FROM \"{schema}\".parked WHERE stream_sequence = $1"
        )))
        .bind(i64::try_from(duplicate)?)
        .fetch_one(pool)
        .await
        .with_context(|| format!("reading {schema}'s parked messages"))?;
        anyhow::ensure!(
            parked == 1,
            "projection {schema} should have parked the duplicate (stream sequence {duplicate}) once, \
             but holds {parked} parked row(s) for it"
        );
    }
    Ok(())
}

/// The console shows what the event store holds: as many events stored, every projection of the
/// registry (the read models too), and each caught up with the events of the aggregate types it reads
/// (`/console/api/overview`, read now). Returns the count.
pub(super) async fn console_agrees(pool: &PgPool, console: &str) -> anyhow::Result<i64> {
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM events")
        .fetch_one(pool)
        .await?;
    let overview = Http::default()
        .get_json(&format!("{console}/console/api/overview"))
        .await
        .context("the console's overview")?;
    let snapshot = &overview["snapshot"];
    anyhow::ensure!(
        snapshot["events"]["stored"] == stored,
        "the console shows {} events stored, the event store holds {stored}",
        snapshot["events"]["stored"]
    );
    let shown: Vec<&str> = snapshot["projections"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| p["name"].as_str())
        .collect();
    anyhow::ensure!(
        shown == projections::registry::names(),
        "the console shows the projections {shown:?}, the registry has {:?}",
        projections::registry::names()
    );
    for projection in snapshot["projections"].as_array().into_iter().flatten() {
        let name = projection["name"].as_str().unwrap_or_default();
        // What it reads of the store: the events of its aggregate types.
        let types = projections::registry::aggregates(name).unwrap_or_default();
        let of_its_types: i64 =
            sqlx::query_scalar("SELECT count(*) FROM events WHERE aggregate_type = ANY($1)")
                .bind(types)
                .fetch_one(pool)
                .await?;
        anyhow::ensure!(
            projection["applied"] == of_its_types && projection["error"].is_null(),
            "the console shows {name} with {} applied of the {of_its_types} events of {} stored (error: {})",
            projection["applied"],
            types.join(", "),
            projection["error"]
        );
    }
    Ok(stored)
}
