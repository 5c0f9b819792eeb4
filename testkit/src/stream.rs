//! Reading a stream back and checking it from first principles: each event once, each aggregate in
//! version order, on its own subject, fenced on its predecessor.

use std::collections::BTreeMap;

use async_nats::HeaderMap;
use async_nats::jetstream;
use domain::EventEnvelope;
use uuid::Uuid;

/// One message read back from a stream.
#[derive(Debug, Clone)]
pub struct StoredEvent {
    /// Stream sequence.
    pub sequence: u64,
    /// Subject it was published to.
    pub subject: String,
    /// Its headers.
    pub headers: HeaderMap,
    /// The decoded envelope.
    pub envelope: EventEnvelope,
}

/// Every message in `stream`, in stream order.
pub async fn stream_events(jetstream: &jetstream::Context, stream: &str) -> Vec<StoredEvent> {
    let mut stream = jetstream.get_stream(stream).await.expect("stream exists");
    let state = stream.info().await.expect("stream info").state.clone();
    let mut events = Vec::with_capacity(usize::try_from(state.messages).unwrap_or(0));
    for sequence in state.first_sequence..=state.last_sequence {
        if state.messages == 0 {
            break;
        }
        let Ok(message) = stream.get_raw_message(sequence).await else {
            continue;
        };
        let envelope = EventEnvelope::from_json(&message.payload).expect("an envelope");
        events.push(StoredEvent {
            sequence,
            subject: message.subject.to_string(),
            headers: message.headers,
            envelope,
        });
    }
    events
}

/// For each aggregate, its versions in stream order.
pub fn versions_by_aggregate(events: &[StoredEvent]) -> BTreeMap<Uuid, Vec<i64>> {
    let mut by_aggregate: BTreeMap<Uuid, Vec<i64>> = BTreeMap::new();
    for event in events {
        by_aggregate
            .entry(event.envelope.aggregate_id)
            .or_default()
            .push(event.envelope.aggregate_version);
    }
    by_aggregate
}

/// What a stream read back says about the relay's promises.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StreamCheck {
    /// Messages read.
    pub messages: usize,
    /// Event ids stored more than once.
    pub duplicates: Vec<Uuid>,
    /// Aggregates whose versions, in stream order, are not exactly 1, 2, 3, …
    pub out_of_order: Vec<Uuid>,
    /// Sequences of messages whose `Nats-Expected-Last-Subject-Sequence` is missing or is not the
    /// sequence of the previous message on their subject.
    pub fence_mismatches: Vec<u64>,
    /// Sequences of messages not on `<prefix>.<aggregate type>.<aggregate id>` of their own envelope.
    pub wrong_subject: Vec<u64>,
}

impl StreamCheck {
    /// True when every promise holds.
    pub fn holds(&self) -> bool {
        self.duplicates.is_empty()
            && self.out_of_order.is_empty()
            && self.fence_mismatches.is_empty()
            && self.wrong_subject.is_empty()
    }
}

/// Checks `events` (in stream order) from first principles: each event once, each aggregate's versions
/// 1..n in order, each on its aggregate's subject under `prefix` (with the partition token of a stream
/// the server splits), and each message fenced on the
/// sequence of the previous message on its subject.
pub fn check_stream(events: &[StoredEvent], prefix: &str) -> StreamCheck {
    let mut check = StreamCheck {
        messages: events.len(),
        ..StreamCheck::default()
    };
    let mut seen = std::collections::BTreeSet::new();
    let mut last_on_subject: BTreeMap<&str, u64> = BTreeMap::new();
    for event in events {
        if !seen.insert(event.envelope.event_id) {
            check.duplicates.push(event.envelope.event_id);
        }
        let expected = event
            .headers
            .get("Nats-Expected-Last-Subject-Sequence")
            .and_then(|v| v.as_str().parse::<u64>().ok());
        let previous = last_on_subject.insert(event.subject.as_str(), event.sequence);
        if expected != Some(previous.unwrap_or(0)) {
            check.fence_mismatches.push(event.sequence);
        }
        // Its aggregate's subject, as published or as a stream that splits partitions stores it
        // (`<prefix>.<K>.<type>.<id>`).
        let own = domain::wire::parse_stored_subject(prefix, &event.subject).is_some_and(
            |(aggregate_type, id)| {
                aggregate_type == event.envelope.aggregate_type && id == event.envelope.aggregate_id
            },
        );
        if !own {
            check.wrong_subject.push(event.sequence);
        }
    }
    for (aggregate, versions) in versions_by_aggregate(events) {
        if !versions.iter().copied().eq((1_i64..).take(versions.len())) {
            check.out_of_order.push(aggregate);
        }
    }
    check
}
