//! The stream read back against the store: every stored event exactly once, each order's versions in
//! increasing order, nothing else but the hostile messages.

use std::collections::{BTreeMap, HashMap};

use async_nats::jetstream;
use serde_json::Value;
use uuid::Uuid;

use super::evidence::StoredEvent;
use super::findings::Verdict;

/// Reads the whole stream back and compares it with the store.
pub(super) async fn check_stream(
    verdict: &mut Verdict,
    jetstream: &jetstream::Context,
    stream: &str,
    stored: &HashMap<Uuid, &StoredEvent>,
) -> anyhow::Result<()> {
    let messages = read_stream(jetstream, stream).await?;
    let mut copies: HashMap<Uuid, usize> = HashMap::new();
    let mut versions: BTreeMap<Uuid, Vec<i64>> = BTreeMap::new();
    for message in &messages {
        if message.hostile {
            verdict.hostile_in_stream += 1;
            continue;
        }
        let body: Option<(Uuid, Uuid, i64)> = serde_json::from_slice::<Value>(&message.body)
            .ok()
            .and_then(|v| {
                Some((
                    Uuid::parse_str(v["event_id"].as_str()?).ok()?,
                    Uuid::parse_str(v["aggregate_id"].as_str()?).ok()?,
                    v["aggregate_version"].as_i64()?,
                ))
            });
        match body {
            Some((event_id, aggregate_id, version))
                if stored.get(&event_id).is_some_and(|e| {
                    e.aggregate_id == aggregate_id && e.aggregate_version == version
                }) =>
            {
                *copies.entry(event_id).or_default() += 1;
                versions.entry(aggregate_id).or_default().push(version);
            }
            _ => verdict.strangers_in_stream += 1,
        }
    }
    verdict.missing_from_stream = stored.keys().filter(|id| !copies.contains_key(id)).count();
    verdict.duplicates_in_stream = copies.values().map(|n| n - 1).sum();
    verdict.out_of_order = versions
        .values()
        .filter(|v| v.windows(2).any(|w| w[0] >= w[1]))
        .count();
    let counts = [
        (
            verdict.missing_from_stream,
            "stored event(s) are missing from the stream",
        ),
        (
            verdict.duplicates_in_stream,
            "extra copies of stored events are in the stream",
        ),
        (
            verdict.strangers_in_stream,
            "message(s) in the stream are not hostile and not a stored event",
        ),
        (
            verdict.out_of_order,
            "order(s) have versions out of order in the stream",
        ),
    ];
    for (count, what) in counts {
        if count > 0 {
            verdict.violations.push(format!("{count} {what}"));
        }
    }
    // Examples, so that a failing run can be followed in the relays' logs.
    let missing: Vec<String> = stored
        .iter()
        .filter(|(id, _)| !copies.contains_key(id))
        .take(3)
        .map(|(id, e)| format!("{id} (order {} v{})", e.aggregate_id, e.aggregate_version))
        .collect();
    let copied: Vec<String> = copies
        .iter()
        .filter(|(_, n)| **n > 1)
        .take(3)
        .map(|(id, n)| format!("{id} x{n}"))
        .collect();
    let disordered: Vec<String> = versions
        .iter()
        .filter(|(_, v)| v.windows(2).any(|w| w[0] >= w[1]))
        .take(3)
        .map(|(id, v)| format!("{id} {v:?}"))
        .collect();
    for (examples, what) in [
        (missing, "missing"),
        (copied, "copied"),
        (disordered, "out of order"),
    ] {
        if !examples.is_empty() {
            verdict
                .violations
                .push(format!("{what}, e.g.: {}", examples.join("; ")));
        }
    }
    Ok(())
}

/// A message read back.
struct StreamMessage {
    hostile: bool,
    body: bytes::Bytes,
}

/// Every message of the stream, in order.
async fn read_stream(
    jetstream: &jetstream::Context,
    stream: &str,
) -> anyhow::Result<Vec<StreamMessage>> {
    let mut read = Vec::new();
    crate::stream_read::each_message(jetstream, stream, |message, _| {
        let hostile = message
            .headers
            .as_ref()
            .is_some_and(|h| h.get(crate::chaos::HOSTILE_HEADER).is_some());
        read.push(StreamMessage {
            hostile,
            body: message.payload.clone(),
        });
    })
    .await?;
    Ok(read)
}
