//! `waybill outbox verify`: the event store compared with the stream, aggregate by aggregate — what an
//! operator runs after restoring a database, failing over, or any incident that may have left the two
//! apart.
//!
//! The store side is `events` (never changed) with each event's outbox row, if it is still there; the
//! stream side is every message under the subject prefix, read once in stream order (an ordered
//! consumer), or, for a few named aggregates, their subjects one message at a time. Each event must be
//! in the stream exactly once, under its own message id, at its own version, in version order; each
//! message on an aggregate's subject must be one of its events. Events not yet sent are a backlog, not
//! a difference; sent events older than the stream's retention are counted apart.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use async_nats::jetstream::{self, consumer::DeliverPolicy, consumer::pull::OrderedConfig};
use chrono::{DateTime, Utc};
use domain::wire;
use futures::StreamExt;
use serde::Serialize;
use sqlx::PgPool;
use uuid::Uuid;

use store::outbox::Status;
use store::outbox::admin::{DeliveredEvent, delivered_events};

use crate::fence::{self, ReadBack};

/// What to compare.
#[derive(Debug, Clone, Default)]
pub struct VerifyScope {
    /// Only these aggregates (all when empty).
    pub aggregates: Vec<Uuid>,
    /// Only aggregates with an event recorded at or after this time.
    pub since: Option<DateTime<Utc>>,
}

/// The comparison's result.
#[derive(Debug, Clone, Default, Serialize)]
pub struct VerifyReport {
    /// No difference found.
    pub ok: bool,
    /// Aggregates compared (in the store, the stream, or both).
    pub aggregates: usize,
    /// Events of those aggregates in the store.
    pub store_events: usize,
    /// Messages of those aggregates in the stream.
    pub stream_messages: usize,
    /// Store events whose outbox row is not sent yet (the relay's backlog; not a difference).
    pub unsent: usize,
    /// Sent events older than the stream's first message (removed by its retention; not a difference).
    pub beyond_retention: usize,
    /// The stream's first and last sequence when the comparison began.
    pub stream_first_sequence: u64,
    /// See `stream_first_sequence`.
    pub stream_last_sequence: u64,
    /// Every aggregate that differs, with its differences.
    pub differing: Vec<AggregateDifferences>,
    /// Messages under the prefix whose subject names no aggregate.
    pub foreign_subjects: Vec<ForeignMessage>,
}

/// One aggregate on which the store and the stream disagree.
#[derive(Debug, Clone, Serialize)]
pub struct AggregateDifferences {
    /// Its type (from the subject when the store does not know it).
    pub aggregate_type: String,
    /// Its id.
    pub aggregate_id: Uuid,
    /// What differs.
    pub differences: Vec<Difference>,
}

/// One difference.
#[derive(Debug, Clone, Serialize)]
pub struct Difference {
    /// What kind.
    pub kind: DifferenceKind,
    /// The aggregate version it concerns, if known.
    pub aggregate_version: Option<i64>,
    /// The store's event there, if any.
    pub store_event_id: Option<Uuid>,
    /// The stream's message id there, if any.
    pub stream_msg_id: Option<String>,
    /// The stream sequence, if any.
    pub stream_sequence: Option<u64>,
    /// A sentence for the operator.
    pub detail: String,
}

/// Kinds of difference.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DifferenceKind {
    /// The same version is a different event in the store and in the stream (a store restored behind
    /// its stream that wrote a new version, or a forged message).
    Diverged,
    /// A sent event the stream does not hold.
    MissingFromStream,
    /// An event in the stream that the store does not hold (a store restored behind its stream).
    NotInStore,
    /// An event in the stream more than once (a copy under another message id, or the same id twice).
    Duplicate,
    /// The stream holds the aggregate's events out of version order.
    OutOfOrder,
    /// The outbox row records another stream sequence than where its event is.
    WrongSequence,
    /// A message on the aggregate's subject that is not a readable event of it.
    Foreign,
}

/// A message whose subject names no aggregate.
#[derive(Debug, Clone, Serialize)]
pub struct ForeignMessage {
    /// Its subject.
    pub subject: String,
    /// Its stream sequence.
    pub stream_sequence: u64,
}

/// Why the comparison could not run.
#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    /// Reading the store failed.
    #[error("reading the event store")]
    Store(#[source] sqlx::Error),
    /// Reading the stream failed.
    #[error("reading stream {stream}: {message}")]
    Stream {
        /// The stream.
        stream: String,
        /// What failed.
        message: String,
    },
}

/// One event of the store, with its delivery state (`status` is `None` when the outbox row was
/// purged after it was sent).
type StoreEvent = DeliveredEvent;

/// One message of the stream, as far as the comparison cares.
#[derive(Debug, Clone)]
struct StreamEntry {
    aggregate_type: String,
    read: ReadBack,
}

/// How long the stream may stay silent before the ordered read gives up.
const READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Compares the store of `pool` with `stream` under `subject_prefix`.
pub async fn verify(
    pool: &PgPool,
    jetstream: &jetstream::Context,
    stream: &str,
    subject_prefix: &str,
    scope: &VerifyScope,
    progress: &dyn Fn(u64, u64),
) -> Result<VerifyReport, VerifyError> {
    let broker = |message: String| VerifyError::Stream {
        stream: stream.to_owned(),
        message,
    };
    let mut handle = jetstream
        .get_stream(stream)
        .await
        .map_err(|e| broker(ops::error_chain(&e)))?;
    let state = handle
        .info()
        .await
        .map_err(|e| broker(ops::error_chain(&e)))?
        .state
        .clone();
    let store = read_store(pool, scope).await.map_err(VerifyError::Store)?;
    let wanted: Option<HashSet<Uuid>> = (!scope.aggregates.is_empty() || scope.since.is_some())
        .then(|| {
            store
                .keys()
                .copied()
                .chain(scope.aggregates.iter().copied())
                .collect()
        });
    let (messages, foreign_subjects) = if scope.aggregates.is_empty() {
        read_stream(
            jetstream,
            stream,
            subject_prefix,
            state.last_sequence,
            wanted.as_ref(),
            progress,
        )
        .await
        .map_err(broker)?
    } else {
        let types: HashMap<Uuid, String> = store
            .iter()
            .filter_map(|(id, events)| Some((*id, events.first()?.aggregate_type.clone())))
            .collect();
        (
            read_subjects(&handle, subject_prefix, &scope.aggregates, &types)
                .await
                .map_err(broker)?,
            Vec::new(),
        )
    };
    let first_message_time = if state.first_sequence > 1 {
        Some(state.first_timestamp)
    } else {
        None
    };
    let mut report = VerifyReport {
        stream_first_sequence: state.first_sequence,
        stream_last_sequence: state.last_sequence,
        foreign_subjects,
        ..VerifyReport::default()
    };
    let mut ids: Vec<Uuid> = store.keys().chain(messages.keys()).copied().collect();
    ids.sort_unstable();
    ids.dedup();
    for id in ids {
        let events = store.get(&id).map_or(&[][..], Vec::as_slice);
        let entries = messages.get(&id).map_or(&[][..], Vec::as_slice);
        report.aggregates += 1;
        report.store_events += events.len();
        report.stream_messages += entries.len();
        let compared = compare(
            events,
            entries,
            state.first_sequence,
            first_message_time.map(|t| DateTime::<Utc>::from(std::time::SystemTime::from(t))),
        );
        report.unsent += compared.unsent;
        report.beyond_retention += compared.beyond_retention;
        if !compared.differences.is_empty() {
            let aggregate_type = events
                .first()
                .map(|e| e.aggregate_type.clone())
                .or_else(|| entries.first().map(|e| e.aggregate_type.clone()))
                .unwrap_or_default();
            report.differing.push(AggregateDifferences {
                aggregate_type,
                aggregate_id: id,
                differences: compared.differences,
            });
        }
    }
    report.ok = report.differing.is_empty() && report.foreign_subjects.is_empty();
    Ok(report)
}

/// The store's events in scope, by aggregate, in version order.
async fn read_store(
    pool: &PgPool,
    scope: &VerifyScope,
) -> sqlx::Result<BTreeMap<Uuid, Vec<StoreEvent>>> {
    let rows = delivered_events(pool, &scope.aggregates, scope.since).await?;
    let mut store: BTreeMap<Uuid, Vec<StoreEvent>> = BTreeMap::new();
    for row in rows {
        store.entry(row.aggregate_id).or_default().push(row);
    }
    Ok(store)
}

type Messages = HashMap<Uuid, Vec<StreamEntry>>;

/// Reads every message under the prefix up to `last`, in stream order, with an ordered consumer.
async fn read_stream(
    jetstream: &jetstream::Context,
    stream: &str,
    subject_prefix: &str,
    last: u64,
    wanted: Option<&HashSet<Uuid>>,
    progress: &dyn Fn(u64, u64),
) -> Result<(Messages, Vec<ForeignMessage>), String> {
    let mut messages = Messages::new();
    let mut foreign = Vec::new();
    if last == 0 {
        return Ok((messages, foreign));
    }
    let handle = jetstream
        .get_stream(stream)
        .await
        .map_err(|e| ops::error_chain(&e))?;
    let consumer = handle
        .create_consumer(OrderedConfig {
            filter_subject: wire::all_subjects(subject_prefix),
            deliver_policy: DeliverPolicy::All,
            ..OrderedConfig::default()
        })
        .await
        .map_err(|e| format!("creating an ordered consumer: {}", ops::error_chain(&e)))?;
    let mut feed = consumer
        .messages()
        .await
        .map_err(|e| format!("reading the stream: {}", ops::error_chain(&e)))?;
    loop {
        let next = tokio::time::timeout(READ_TIMEOUT, feed.next())
            .await
            .map_err(|_| format!("no message for {READ_TIMEOUT:?} before sequence {last}"))?;
        let Some(message) = next else { break };
        let message =
            message.map_err(|e| format!("reading the stream: {}", ops::error_chain(&e)))?;
        let sequence = message
            .info()
            .map_err(|e| format!("a message without its stream sequence: {e}"))?
            .stream_sequence;
        if sequence > last {
            break;
        }
        if sequence % 10_000 == 0 {
            progress(sequence, last);
        }
        let subject = message.subject.as_str();
        match parse_subject(subject_prefix, subject) {
            Some((aggregate_type, id)) => {
                if wanted.is_some_and(|w| !w.contains(&id)) {
                    continue;
                }
                let headers = message.headers.clone().unwrap_or_default();
                messages.entry(id).or_default().push(StreamEntry {
                    aggregate_type,
                    read: ReadBack::from_parts(sequence, &headers, &message.payload),
                });
            }
            None if wanted.is_none() => foreign.push(ForeignMessage {
                subject: subject.to_owned(),
                stream_sequence: sequence,
            }),
            None => {}
        }
        if sequence == last {
            break;
        }
    }
    progress(last, last);
    Ok((messages, foreign))
}

/// Reads the subjects of `aggregates` one message at a time (for a few named aggregates).
async fn read_subjects(
    stream: &jetstream::stream::Stream,
    subject_prefix: &str,
    aggregates: &[Uuid],
    types: &HashMap<Uuid, String>,
) -> Result<Messages, String> {
    let mut messages = Messages::new();
    let partitions = ops::stream_partitions(&stream.cached_info().config, subject_prefix);
    for id in aggregates {
        let Some(aggregate_type) = types.get(id) else {
            // Not in the store: its type (and so its subject) is unknown; nothing to read.
            continue;
        };
        let subject = wire::stored_subject(subject_prefix, aggregate_type, *id, partitions)?;
        let entries = fence::read_subject(stream, &subject).await?;
        messages.insert(
            *id,
            entries
                .into_iter()
                .map(|read| StreamEntry {
                    aggregate_type: aggregate_type.clone(),
                    read,
                })
                .collect(),
        );
    }
    Ok(messages)
}

/// A stored subject (`<prefix>.[<K>.]<aggregate type>.<aggregate id>`) → its type and id.
fn parse_subject(prefix: &str, subject: &str) -> Option<(String, Uuid)> {
    wire::parse_stored_subject(prefix, subject).map(|(t, id)| (t.to_owned(), id))
}

/// One aggregate's comparison.
#[derive(Debug, Default)]
struct Compared {
    unsent: usize,
    beyond_retention: usize,
    differences: Vec<Difference>,
}

/// Compares one aggregate's store events (version order) with its stream messages (stream order).
/// `first_sequence`/`first_time`: where the stream's retention now starts (`first_time` only when
/// messages were removed).
fn compare(
    events: &[StoreEvent],
    entries: &[StreamEntry],
    first_sequence: u64,
    first_time: Option<DateTime<Utc>>,
) -> Compared {
    let mut compared = Compared::default();
    let by_id: HashMap<Uuid, &StoreEvent> = events.iter().map(|e| (e.event_id, e)).collect();
    let by_version: HashMap<i64, &StoreEvent> =
        events.iter().map(|e| (e.aggregate_version, e)).collect();
    let mut found: HashMap<Uuid, u64> = HashMap::new();
    let mut last_version = 0;
    for entry in entries {
        let message = &entry.read.message;
        let store_event = message
            .msg_id
            .as_deref()
            .and_then(|id| Uuid::parse_str(id).ok())
            .and_then(|id| by_id.get(&id).copied());
        let version = message.aggregate.map(|(_, v)| v);
        let difference = |kind, version, store_event_id, detail| Difference {
            kind,
            aggregate_version: version,
            store_event_id,
            stream_msg_id: message.msg_id.clone(),
            stream_sequence: Some(message.sequence),
            detail,
        };
        if let Some(event) = store_event {
            if found.insert(event.event_id, message.sequence).is_some() {
                compared.differences.push(difference(
                    DifferenceKind::Duplicate,
                    Some(event.aggregate_version),
                    Some(event.event_id),
                    format!("event {} is in the stream again", event.event_id),
                ));
                continue;
            }
            if event.aggregate_version < last_version {
                compared.differences.push(difference(
                    DifferenceKind::OutOfOrder,
                    Some(event.aggregate_version),
                    Some(event.event_id),
                    format!(
                        "version {} comes after version {last_version} in the stream",
                        event.aggregate_version
                    ),
                ));
            }
            last_version = last_version.max(event.aggregate_version);
            if let Some(recorded) = event.stream_seq
                && u64::try_from(recorded).ok() != Some(message.sequence)
                && event.status == Some(Status::Sent)
            {
                compared.differences.push(difference(
                    DifferenceKind::WrongSequence,
                    Some(event.aggregate_version),
                    Some(event.event_id),
                    format!(
                        "the outbox records stream sequence {recorded}, the event is at {}",
                        message.sequence
                    ),
                ));
            }
            continue;
        }
        match (version, version.and_then(|v| by_version.get(&v).copied())) {
            (Some(v), Some(event)) if entry.read.body_event_id == Some(event.event_id) => {
                compared.differences.push(difference(
                    DifferenceKind::Duplicate,
                    Some(v),
                    Some(event.event_id),
                    format!(
                        "a copy of event {} under another message id",
                        event.event_id
                    ),
                ));
            }
            (Some(v), Some(event)) => compared.differences.push(difference(
                DifferenceKind::Diverged,
                Some(v),
                Some(event.event_id),
                format!(
                    "version {v} is event {} in the store and {} in the stream",
                    event.event_id,
                    message.msg_id.as_deref().unwrap_or("a message without id")
                ),
            )),
            (Some(v), None) => compared.differences.push(difference(
                DifferenceKind::NotInStore,
                Some(v),
                None,
                format!(
                    "the stream holds version {v} ({}), the store does not",
                    message.msg_id.as_deref().unwrap_or("a message without id")
                ),
            )),
            (None, _) => compared.differences.push(difference(
                DifferenceKind::Foreign,
                None,
                None,
                "a message on the aggregate's subject that is not a readable event".to_owned(),
            )),
        }
    }
    for event in events {
        if found.contains_key(&event.event_id) {
            continue;
        }
        match event.status {
            Some(status) if status.is_unsent() => compared.unsent += 1,
            _ => {
                let aged_out = match event.stream_seq.and_then(|s| u64::try_from(s).ok()) {
                    Some(sequence) => sequence < first_sequence,
                    // The row (and its sequence) was purged: older than the stream's first message
                    // means removed by the stream's retention.
                    None => first_time.is_some_and(|first| event.recorded_at < first),
                };
                if aged_out {
                    compared.beyond_retention += 1;
                } else {
                    compared.differences.push(Difference {
                        kind: DifferenceKind::MissingFromStream,
                        aggregate_version: Some(event.aggregate_version),
                        store_event_id: Some(event.event_id),
                        stream_msg_id: None,
                        stream_sequence: event.stream_seq.and_then(|s| u64::try_from(s).ok()),
                        detail: format!(
                            "event {} is sent in the store but not in the stream",
                            event.event_id
                        ),
                    });
                }
            }
        }
    }
    compared
        .differences
        .sort_by_key(|d| (d.aggregate_version, d.stream_sequence));
    compared
}

#[cfg(test)]
mod tests {
    use super::*;

    const AGGREGATE: Uuid = Uuid::from_u128(7);

    fn event(version: i64, status: Option<&str>, stream_seq: Option<i64>) -> StoreEvent {
        StoreEvent {
            aggregate_type: "order".into(),
            aggregate_id: AGGREGATE,
            aggregate_version: version,
            event_id: Uuid::from_u128(100 + u128::try_from(version).expect("a positive version")),
            recorded_at: Utc::now(),
            status: status.map(|s| s.parse().expect("an outbox status")),
            stream_seq,
        }
    }

    fn entry(sequence: u64, msg_id: Uuid, version: i64) -> StreamEntry {
        StreamEntry {
            aggregate_type: "order".into(),
            read: ReadBack {
                message: fence::SubjectMessage {
                    sequence,
                    msg_id: Some(msg_id.to_string()),
                    aggregate: Some((AGGREGATE, version)),
                },
                body_event_id: Some(msg_id),
            },
        }
    }

    fn kinds(compared: &Compared) -> Vec<DifferenceKind> {
        compared.differences.iter().map(|d| d.kind).collect()
    }

    #[test]
    fn the_same_events_in_order_agree() {
        let events = [
            event(1, Some("sent"), Some(1)),
            event(2, Some("pending"), None),
        ];
        let entries = [entry(1, events[0].event_id, 1)];
        let compared = compare(&events, &entries, 1, None);
        assert!(
            compared.differences.is_empty(),
            "{:?}",
            compared.differences
        );
        assert_eq!(compared.unsent, 1);
    }

    #[test]
    fn a_store_restored_behind_its_stream_shows_every_kind_it_causes() {
        // Stream: v1, old v2, v3. Store: v1, a new v2 (unsent).
        let events = [
            event(1, Some("sent"), Some(1)),
            event(2, Some("failed"), None),
        ];
        let entries = [
            entry(1, events[0].event_id, 1),
            entry(2, Uuid::from_u128(900), 2),
            entry(3, Uuid::from_u128(901), 3),
        ];
        let compared = compare(&events, &entries, 1, None);
        assert_eq!(
            kinds(&compared),
            vec![DifferenceKind::Diverged, DifferenceKind::NotInStore]
        );
        assert_eq!(compared.unsent, 1);
    }

    #[test]
    fn a_sent_event_the_stream_lacks_is_missing_unless_retention_removed_it() {
        let events = [
            event(1, Some("sent"), Some(5)),
            event(2, Some("sent"), Some(9)),
        ];
        let compared = compare(&events, &[], 7, None);
        assert_eq!(kinds(&compared), vec![DifferenceKind::MissingFromStream]);
        assert_eq!(
            compared.beyond_retention, 1,
            "sequence 5 is before the first, 7"
        );
        // A purged outbox row: its age decides.
        let old = event(1, None, None);
        let later = Utc::now() + chrono::Duration::seconds(60);
        assert_eq!(
            compare(std::slice::from_ref(&old), &[], 7, Some(later)).beyond_retention,
            1
        );
        assert_eq!(
            kinds(&compare(&[old], &[], 1, None)),
            vec![DifferenceKind::MissingFromStream]
        );
    }

    #[test]
    fn copies_order_and_sequences_are_checked() {
        let events = [
            event(1, Some("sent"), Some(1)),
            event(2, Some("sent"), Some(7)),
        ];
        let mut copy = entry(4, Uuid::from_u128(555), 1);
        copy.read.body_event_id = Some(events[0].event_id);
        let entries = [
            entry(2, events[1].event_id, 2),
            entry(3, events[0].event_id, 1),
            copy,
        ];
        let compared = compare(&events, &entries, 1, None);
        let mut found = kinds(&compared);
        found.sort();
        assert_eq!(
            found,
            vec![
                DifferenceKind::Duplicate,
                DifferenceKind::OutOfOrder,
                DifferenceKind::WrongSequence,
                DifferenceKind::WrongSequence
            ]
        );
    }

    #[test]
    fn subjects_name_their_aggregate() {
        let id = Uuid::from_u128(9);
        assert_eq!(
            parse_subject("waybill.events", &format!("waybill.events.order.{id}")),
            Some(("order".to_owned(), id))
        );
        assert_eq!(
            parse_subject("waybill.events", "waybill.events.order.x"),
            None
        );
        assert_eq!(
            parse_subject("waybill.events", "waybill.eventsx.order"),
            None
        );
    }
}
