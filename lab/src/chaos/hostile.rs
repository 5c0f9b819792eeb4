//! `hostile_publish`: messages nobody should trust, published straight into the stream past the relay,
//! each marked `Waybill-Chaos: hostile` for the checker (the projections must not care either way).
//!
//! Each is built so that a correct projection can never apply it, and a careless one would show it:
//! garbage; a well-formed first event whose `Nats-Msg-Id` or subject disagrees with its body (a trusting
//! projection would apply it as a new order); an event whose predecessors never come; an event dated
//! 5001 BC; a burst of garbage; and an exact replay of a real event already applied (a projection that
//! does not check its checkpoint would apply it twice). Every one of them is on a subject the relay
//! publishes nothing more to.

use async_nats::HeaderMap;
use bytes::Bytes;
use domain::wire;
use rand::Rng;
use rand::rngs::StdRng;
use serde_json::Value;
use store::outbox::fixtures;
use uuid::Uuid;

use super::faults::Context;

/// Garbage messages per burst.
const BURST: usize = 20;

/// What one `hostile_publish` stored.
#[derive(Debug, Default)]
pub(super) struct Sent {
    /// The stream sequence of each stored message.
    pub sequences: Vec<u64>,
    /// Names of the kinds sent.
    pub kinds: Vec<&'static str>,
}

impl Sent {
    /// A line for the fault log.
    pub(super) fn describe(&self) -> String {
        format!(
            "{} messages into the stream: {}",
            self.sequences.len(),
            self.kinds.join(", ")
        )
    }
}

/// Publishes one of each hostile kind (the replay only once a real event is old enough to have left
/// the dedupe window).
/// What was stored is in `sent` even when a later publish fails.
pub(super) async fn publish(
    context: &Context,
    rng: &mut StdRng,
    sent: &mut Sent,
) -> anyhow::Result<()> {
    let placed = fixtures::newest_body(&context.pool, "order.placed").await?;
    let placed: Value = serde_json::from_str(
        &placed.ok_or_else(|| anyhow::anyhow!("no order placed yet to model hostile events on"))?,
    )?;

    let garbage = |rng: &mut StdRng| -> Vec<u8> {
        let mut bytes: Vec<u8> = (0..rng.random_range(1..512))
            .map(|_| rng.random())
            .collect();
        bytes.extend_from_slice(b"\0\xff{\"event_id\":");
        bytes
    };
    let body = garbage(rng);
    let aggregate = Uuid::now_v7();
    let headers = hostile_headers(&[(wire::MSG_ID, Uuid::now_v7().to_string())]);
    sent.push("garbage", send(context, aggregate, headers, body).await?);

    // A valid first event, but its message id is not its event id.
    let forged = fresh(&placed, 1);
    let mut headers = relay_headers(&forged);
    headers.insert(wire::MSG_ID, Uuid::now_v7().to_string().as_str());
    sent.push(
        "forged message id",
        send(context, aggregate_of(&forged), headers, encode(&forged)).await?,
    );

    // A valid first event, published under another order's subject.
    let misrouted = fresh(&placed, 1);
    sent.push(
        "wrong subject",
        send(
            context,
            Uuid::now_v7(),
            relay_headers(&misrouted),
            encode(&misrouted),
        )
        .await?,
    );

    // Version 3 of an order whose versions 1 and 2 never come (a payment: only a first event may be
    // order.placed).
    let paid = fixtures::newest_body(&context.pool, "order.paid").await?;
    let paid: Value = match paid {
        Some(body) => serde_json::from_str(&body)?,
        None => placed.clone(),
    };
    let orphan = fresh(&paid, 3);
    sent.push(
        "missing predecessors",
        send(
            context,
            aggregate_of(&orphan),
            relay_headers(&orphan),
            encode(&orphan),
        )
        .await?,
    );

    // A first event from 5001 BC, before anything PostgreSQL can store.
    let mut ancient = fresh(&placed, 1);
    ancient["occurred_at"] = Value::from("-5000-01-01T00:00:00Z");
    sent.push(
        "year -5000",
        send(
            context,
            aggregate_of(&ancient),
            relay_headers(&ancient),
            encode(&ancient),
        )
        .await?,
    );

    for _ in 0..BURST {
        let headers = hostile_headers(&[(wire::MSG_ID, Uuid::now_v7().to_string())]);
        let sequence = send(context, Uuid::now_v7(), headers, garbage(rng)).await?;
        sent.sequences.extend(sequence);
    }
    sent.kinds.push("a burst of garbage");

    // The exact message of a real order's first event, published a while ago (past the 5 s dedupe
    // window), again: applied twice, it would reserve the order's stock again and set it back to
    // placed. The order has ended (shipped or cancelled), so no later event of it meets the replay on
    // its subject: the relay's fence reads a subject's last message, and a forged one there is another
    // fault than this one.
    let old =
        fixtures::first_body_of_finished(&context.pool, &["order.shipped", "order.cancelled"], 7.0)
            .await?;
    let Some(old) = old else {
        sent.kinds
            .push("no replay (no finished order old enough yet)");
        return Ok(());
    };
    {
        let replay: Value = serde_json::from_str(&old)?;
        sent.push(
            "replay of a real event",
            send(
                context,
                aggregate_of(&replay),
                relay_headers(&replay),
                old.into_bytes(),
            )
            .await?,
        );
    }
    Ok(())
}

impl Sent {
    fn push(&mut self, kind: &'static str, sequence: Option<u64>) {
        self.sequences.extend(sequence);
        self.kinds.push(kind);
    }
}

/// A copy of `template` as event `version` of a new order, with a new event id.
fn fresh(template: &Value, version: i64) -> Value {
    let mut envelope = template.clone();
    envelope["event_id"] = Value::from(Uuid::now_v7().to_string());
    envelope["aggregate_id"] = Value::from(Uuid::now_v7().to_string());
    envelope["aggregate_version"] = Value::from(version);
    envelope
}

fn aggregate_of(envelope: &Value) -> Uuid {
    envelope["aggregate_id"]
        .as_str()
        .and_then(|id| Uuid::parse_str(id).ok())
        .unwrap_or_else(Uuid::now_v7)
}

fn encode(envelope: &Value) -> Vec<u8> {
    serde_json::to_vec(envelope).expect("a serde_json::Value always encodes")
}

/// The headers the relay would set for `envelope`, plus the hostile mark.
fn relay_headers(envelope: &Value) -> HeaderMap {
    let text = |field: &str| match &envelope[field] {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    hostile_headers(&[
        (wire::MSG_ID, text("event_id")),
        (wire::EVENT_TYPE, text("event_type")),
        (wire::EVENT_VERSION, text("event_version")),
        (wire::AGGREGATE_TYPE, text("aggregate_type")),
        (wire::AGGREGATE_ID, text("aggregate_id")),
        (wire::AGGREGATE_VERSION, text("aggregate_version")),
        (wire::CONTENT_TYPE, "application/json".to_owned()),
    ])
}

fn hostile_headers(pairs: &[(&str, String)]) -> HeaderMap {
    let mut headers = HeaderMap::new();
    for (name, value) in pairs {
        headers.insert(*name, value.as_str());
    }
    headers.insert(super::HOSTILE_HEADER, "hostile");
    headers
}

/// Publishes on the subject of `aggregate` and returns the stream sequence the broker stored it at
/// (`None` when the broker says it already held it: that sequence is another message's).
async fn send(
    context: &Context,
    aggregate: Uuid,
    headers: HeaderMap,
    body: Vec<u8>,
) -> anyhow::Result<Option<u64>> {
    let subject = format!("{}.order.{aggregate}", context.subject_prefix);
    let publish = async {
        let ack = context
            .jetstream
            .publish_with_headers(subject, headers, Bytes::from(body))
            .await?
            .await?;
        anyhow::Ok((!ack.duplicate).then_some(ack.sequence))
    };
    tokio::time::timeout(std::time::Duration::from_secs(5), publish)
        .await
        .map_err(|_| anyhow::anyhow!("no PubAck within 5 s"))?
}
