//! The verdict, from first principles: what the load saw accepted is in the event store; every stored
//! event is in the stream exactly once and in its order's version order (read back from the stream);
//! the projections equal a fold of the event store written here, in a few lines of its own, and each
//! read model of the registry its own fold of the event store; nothing is left unsent, dead, parked
//! or held but what `hostile_publish` sent.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use anyhow::Context;
use async_nats::jetstream;
use futures::StreamExt;
use serde::Serialize;
use serde_json::Value;
use sqlx::PgPool;
use uuid::Uuid;

use super::faults::{FaultKind, Injected};
use super::fleet::Fleet;
use super::load::Played;
use super::watch::Drained;

/// A loyalty point is earned per this many cents paid: the rule as the README states it, written
/// here again on purpose rather than taken from the projection's code.
const CENTS_PER_POINT: i64 = 100;

/// What the verdict looks at.
#[derive(Debug)]
pub(super) struct Evidence<'a> {
    /// The event store.
    pub pool: &'a PgPool,
    /// Its URL (the read models read themselves and fold the store from it).
    pub database_url: &'a str,
    /// The broker.
    pub jetstream: &'a jetstream::Context,
    /// The stream.
    pub stream: &'a str,
    /// The processes (for the projection binaries).
    pub fleet: &'a Fleet,
    /// What the load did.
    pub played: &'a Played,
    /// What the faults did.
    pub injected: &'a Injected,
    /// The kinds the run was asked for.
    pub kinds: &'a [FaultKind],
    /// How the drain ended.
    pub drained: &'a Drained,
}

/// The findings; the run passes when `violations` is empty.
#[derive(Debug, Default, Serialize)]
pub(super) struct Verdict {
    /// Events in the event store.
    pub events: usize,
    /// Orders in the event store.
    pub orders: usize,
    /// Accepted commands whose event is not in the event store.
    pub lost_commands: usize,
    /// Stored events missing from the stream.
    pub missing_from_stream: usize,
    /// Extra copies of stored events in the stream.
    pub duplicates_in_stream: usize,
    /// Stream messages (not hostile) whose event the store does not hold, or that cannot be read.
    pub strangers_in_stream: usize,
    /// Orders whose versions do not appear in the stream in increasing order.
    pub out_of_order: usize,
    /// Hostile messages found in the stream.
    pub hostile_in_stream: usize,
    /// Outbox rows by status other than sent.
    pub outbox_unsent: BTreeMap<String, i64>,
    /// Per projection, entries that differ from the fold (SKUs, customers, orders).
    pub mismatches: BTreeMap<String, Vec<String>>,
    /// Parked messages per projection.
    pub parked: BTreeMap<String, usize>,
    /// Held events per projection.
    pub held: BTreeMap<String, usize>,
    /// Every reason the run fails.
    pub violations: Vec<String>,
}

impl Verdict {
    /// True when nothing was violated.
    pub(super) fn pass(&self) -> bool {
        self.violations.is_empty()
    }

    /// A process that exited without being killed is a violation: the system must ride out every
    /// fault without crashing (the harness restarted it, as a supervisor would, and counted it).
    pub(super) fn note_exits(&mut self, processes: &[super::fleet::ProcessSummary]) {
        for process in processes.iter().filter(|p| p.unexpected_exits > 0) {
            self.violations.push(format!(
                "{} exited on its own {} time(s); its log says why",
                process.name, process.unexpected_exits
            ));
        }
    }

    /// Accepted commands lost plus stored events missing from the stream.
    pub(super) fn lost(&self) -> usize {
        self.lost_commands + self.missing_from_stream
    }

    /// Entries differing between projections and the fold, all projections together.
    pub(super) fn projection_mismatches(&self) -> usize {
        self.mismatches.values().map(Vec::len).sum()
    }
}

/// One stored event, as the fold needs it.
#[derive(Debug, sqlx::FromRow)]
struct StoredEvent {
    event_id: Uuid,
    event_type: String,
    aggregate_id: Uuid,
    aggregate_version: i64,
    payload: Value,
}

/// Checks everything and returns the findings.
pub(super) async fn judge(evidence: Evidence<'_>) -> anyhow::Result<Verdict> {
    let mut verdict = Verdict::default();
    let events: Vec<StoredEvent> = sqlx::query_as(
        "SELECT event_id, event_type, aggregate_id, aggregate_version, payload
         FROM events ORDER BY aggregate_id, aggregate_version",
    )
    .fetch_all(evidence.pool)
    .await
    .context("reading the event store")?;
    verdict.events = events.len();
    verdict.orders = events
        .iter()
        .map(|e| e.aggregate_id)
        .collect::<BTreeSet<_>>()
        .len();

    if !evidence.drained.complete {
        verdict.violations.push(format!(
            "the system did not drain within {:.0} s after the load; still to do: {:?}",
            evidence.drained.seconds, evidence.drained.remaining
        ));
    }
    for kind in evidence.kinds {
        if evidence.injected.count(*kind) == 0 {
            verdict.violations.push(format!(
                "no {} fault was carried out: the run did not test what it was asked to",
                kind.name()
            ));
        }
    }
    for fault in &evidence.injected.faults {
        if let Some(error) = &fault.error {
            verdict.violations.push(format!(
                "the {} fault at {:.1} s could not be carried out: {error}",
                fault.kind.name(),
                fault.at
            ));
        }
    }
    if evidence.played.accepted.is_empty() {
        verdict
            .violations
            .push("the order service accepted no command at all".to_owned());
    }
    if evidence.played.abandoned > 0 {
        verdict.violations.push(format!(
            "{} lifecycle(s) were abandoned: a command still failed long after the load ended",
            evidence.played.abandoned
        ));
    }
    for unexpected in evidence.played.unexpected.iter().take(5) {
        verdict
            .violations
            .push(format!("the order service answered wrongly: {unexpected}"));
    }

    // Every accepted command is in the store.
    let stored: HashMap<Uuid, &StoredEvent> = events.iter().map(|e| (e.event_id, e)).collect();
    let lost: Vec<_> = evidence
        .played
        .accepted
        .iter()
        .filter(|a| !stored.contains_key(&a.event_id))
        .collect();
    verdict.lost_commands = lost.len();
    if let Some(first) = lost.first() {
        verdict.violations.push(format!(
            "{} accepted command(s) have no event in the store, e.g. {} of order {} (event {})",
            lost.len(),
            first.command,
            first.order_id,
            first.event_id
        ));
    }

    check_stream(&mut verdict, evidence.jetstream, evidence.stream, &stored).await?;
    check_outbox(&mut verdict, evidence.pool).await?;
    check_projections(&mut verdict, &evidence, &events).await?;
    check_parked_and_held(&mut verdict, evidence.pool, evidence.injected).await?;
    Ok(verdict)
}

/// Reads the whole stream back and compares it with the store.
async fn check_stream(
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

/// Every message of the stream, in order, through an ephemeral consumer that acknowledges nothing.
async fn read_stream(
    jetstream: &jetstream::Context,
    stream: &str,
) -> anyhow::Result<Vec<StreamMessage>> {
    let mut stream = jetstream.get_stream(stream).await?;
    let last = stream.info().await?.state.last_sequence;
    let consumer = stream
        .create_consumer(jetstream::consumer::pull::Config {
            deliver_policy: jetstream::consumer::DeliverPolicy::All,
            ack_policy: jetstream::consumer::AckPolicy::None,
            inactive_threshold: Duration::from_secs(60),
            ..Default::default()
        })
        .await?;
    let mut messages = consumer.messages().await?;
    let mut read = Vec::new();
    let mut sequence = 0;
    while sequence < last {
        let next = tokio::time::timeout(Duration::from_secs(10), messages.next())
            .await
            .map_err(|_| {
                anyhow::anyhow!("the stream stopped delivering at sequence {sequence} of {last}")
            })?;
        let Some(message) = next else { break };
        let message = message.map_err(|e| anyhow::anyhow!("reading the stream: {e}"))?;
        sequence = message
            .info()
            .map_err(|e| anyhow::anyhow!("a message without delivery info: {e}"))?
            .stream_sequence;
        let hostile = message
            .headers
            .as_ref()
            .is_some_and(|h| h.get(super::HOSTILE_HEADER).is_some());
        read.push(StreamMessage {
            hostile,
            body: message.payload.clone(),
        });
    }
    Ok(read)
}

// The verdict reads the outbox with its own SQL, not through `relay::admin`: the other tools share
// that one way in, but a checker that trusted the code it checks could not catch it being wrong.
async fn check_outbox(verdict: &mut Verdict, pool: &PgPool) -> anyhow::Result<()> {
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT status, count(*) FROM outbox WHERE status <> 'sent' GROUP BY status ORDER BY status",
    )
    .fetch_all(pool)
    .await?;
    for (status, count) in &rows {
        verdict
            .violations
            .push(format!("{count} outbox row(s) are {status}"));
    }
    verdict.outbox_unsent = rows.into_iter().collect();
    Ok(())
}

/// What the projections should hold, folded from the stored events.
#[derive(Debug, Default)]
struct Folded {
    /// SKU → [reserved, shipped, released].
    stock: BTreeMap<String, [i64; 3]>,
    /// Customer → points balance.
    points: BTreeMap<String, i64>,
    /// Order → its search document.
    documents: BTreeMap<Uuid, Document>,
    /// Order → its last version.
    versions: BTreeMap<Uuid, i64>,
}

/// What the search index says of an order.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct Document {
    status: String,
    customer: String,
    total_cents: i64,
}

/// The fold: each order's lines, customer and payment, and what each event does to stock and points.
fn fold(events: &[StoredEvent]) -> Folded {
    #[derive(Default)]
    struct Order {
        customer: String,
        total_cents: i64,
        lines: Vec<(String, i64)>,
        paid: i64,
    }
    let mut folded = Folded::default();
    let mut orders: HashMap<Uuid, Order> = HashMap::new();
    for event in events {
        let order = orders.entry(event.aggregate_id).or_default();
        let payload = &event.payload;
        let status = match event.event_type.as_str() {
            "order.placed" => {
                order.customer = payload["customer_id"].as_str().unwrap_or("").to_owned();
                order.total_cents = payload["total_cents"].as_i64().unwrap_or(0);
                for line in payload["lines"].as_array().into_iter().flatten() {
                    let sku = line["sku"].as_str().unwrap_or("").to_owned();
                    let quantity = line["quantity"].as_i64().unwrap_or(0);
                    folded.stock.entry(sku.clone()).or_default()[0] += quantity;
                    order.lines.push((sku, quantity));
                }
                "placed"
            }
            "order.paid" => {
                order.paid = payload["amount_cents"].as_i64().unwrap_or(0);
                *folded.points.entry(order.customer.clone()).or_default() +=
                    order.paid / CENTS_PER_POINT;
                "paid"
            }
            "order.shipped" => {
                for (sku, quantity) in &order.lines {
                    let stock = folded.stock.entry(sku.clone()).or_default();
                    stock[0] -= quantity;
                    stock[1] += quantity;
                }
                "shipped"
            }
            "order.cancelled" => {
                for (sku, quantity) in &order.lines {
                    let stock = folded.stock.entry(sku.clone()).or_default();
                    stock[0] -= quantity;
                    stock[2] += quantity;
                }
                *folded.points.entry(order.customer.clone()).or_default() -=
                    order.paid / CENTS_PER_POINT;
                "cancelled"
            }
            other => other,
        };
        let document = folded.documents.entry(event.aggregate_id).or_default();
        document.status = status.to_owned();
        document.customer.clone_from(&order.customer);
        document.total_cents = order.total_cents;
        folded
            .versions
            .insert(event.aggregate_id, event.aggregate_version);
    }
    folded
}

async fn check_projections(
    verdict: &mut Verdict,
    evidence: &Evidence<'_>,
    events: &[StoredEvent],
) -> anyhow::Result<()> {
    let folded = fold(events);
    let inventory = evidence
        .fleet
        .projection_json("inventory", &["show", "--json"])
        .await?;
    let mut stock: BTreeMap<String, [i64; 3]> = BTreeMap::new();
    for row in inventory.as_array().into_iter().flatten() {
        let field = |name: &str| row[name].as_i64().unwrap_or(i64::MIN);
        stock.insert(
            row["sku"].as_str().unwrap_or("").to_owned(),
            [field("reserved"), field("shipped"), field("released")],
        );
    }
    let points_shown = evidence
        .fleet
        .projection_json("points", &["show", "--json"])
        .await?;
    let mut points: BTreeMap<String, i64> = BTreeMap::new();
    for account in points_shown.as_array().into_iter().flatten() {
        points.insert(
            account["customer_id"].as_str().unwrap_or("").to_owned(),
            account["balance"].as_i64().unwrap_or(i64::MIN),
        );
    }
    let documents: Vec<(Uuid, String, String, i64)> =
        sqlx::query_as("SELECT order_id, status, customer_id, total_cents FROM search.orders")
            .fetch_all(evidence.pool)
            .await
            .context("reading the search projection's documents")?;
    let documents: BTreeMap<Uuid, Document> = documents
        .into_iter()
        .map(|(id, status, customer, total_cents)| {
            (
                id,
                Document {
                    status,
                    customer,
                    total_cents,
                },
            )
        })
        .collect();

    let mut found = vec![
        ("inventory", differences(&folded.stock, &stock, [0; 3])),
        ("points", differences(&folded.points, &points, 0)),
        (
            "search",
            differences(&folded.documents, &documents, Document::default()),
        ),
    ];
    // Each projection's checkpoint of each order is the order's last version: nothing skipped,
    // nothing applied past the store, whatever field an event touches.
    for (name, differing) in &mut found {
        differing
            .extend(checkpoint_differences(evidence.pool, name, &folded.versions, false).await?);
    }
    check_models(&mut found, evidence, &folded.versions).await?;
    for (name, found) in found {
        if !found.is_empty() {
            verdict.violations.push(format!(
                "{name} differs from the fold of the event store in {} entr(ies), e.g. {}",
                found.len(),
                found[0]
            ));
        }
        verdict.mismatches.insert(name.to_owned(), found);
    }
    Ok(())
}

/// The keys whose values differ (a key missing on one side counts as `zero` there), described.
fn differences<K: Ord + std::fmt::Display, V: PartialEq + std::fmt::Debug>(
    expected: &BTreeMap<K, V>,
    found: &BTreeMap<K, V>,
    zero: V,
) -> Vec<String> {
    let keys: BTreeSet<&K> = expected.keys().chain(found.keys()).collect();
    keys.into_iter()
        .filter_map(|key| {
            let want = expected.get(key).unwrap_or(&zero);
            let have = found.get(key).unwrap_or(&zero);
            (want != have)
                .then(|| format!("{key}: the fold says {want:?}, the projection {have:?}"))
        })
        .collect()
}

/// Projection `name`'s checkpoint of each order against the order's last version (`versions`), one
/// line per difference. `orders_only`: leave out the checkpoints of aggregates that are not orders
/// (a projection of several aggregate types keeps theirs in the same table).
async fn checkpoint_differences(
    pool: &PgPool,
    name: &str,
    versions: &BTreeMap<Uuid, i64>,
    orders_only: bool,
) -> anyhow::Result<Vec<String>> {
    let sql = format!("SELECT aggregate_id, version FROM {name}.checkpoints");
    let checkpoints: BTreeMap<Uuid, i64> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .fetch_all(pool)
        .await
        .with_context(|| format!("reading {name}.checkpoints"))?
        .into_iter()
        .filter(|(id, _)| !orders_only || versions.contains_key(id))
        .collect();
    Ok(differences(versions, &checkpoints, 0)
        .into_iter()
        .map(|d| format!("checkpoint of {d}"))
        .collect())
}

/// Each read model's document against its own fold of the event store (the first difference), and,
/// for a model of orders, its checkpoint of each order against the order's last version.
async fn check_models(
    found: &mut Vec<(&'static str, Vec<String>)>,
    evidence: &Evidence<'_>,
    versions: &BTreeMap<Uuid, i64>,
) -> anyhow::Result<()> {
    for model in projections::registry::MODELS {
        let name = model.name();
        let expected = model
            .expected(evidence.database_url)
            .await
            .with_context(|| format!("folding the event store as the {name} read model does"))?;
        let actual = model
            .read(evidence.database_url)
            .await
            .with_context(|| format!("reading the {name} read model"))?;
        let mut differing: Vec<String> =
            projections::model_cli::first_difference(&expected, &actual, "")
                .into_iter()
                .map(|d| format!("its document: {d}"))
                .collect();
        if model.aggregates().contains(&"order") {
            // Only orders' checkpoints: a model of several types has others' too.
            differing.extend(checkpoint_differences(evidence.pool, name, versions, true).await?);
        }
        found.push((name, differing));
    }
    Ok(())
}

async fn check_parked_and_held(
    verdict: &mut Verdict,
    pool: &PgPool,
    injected: &Injected,
) -> anyhow::Result<()> {
    for projection in projections::registry::names() {
        for (table, counts) in [("parked", &mut verdict.parked), ("held", &mut verdict.held)] {
            // Both names come from the registry and the list above, never from input.
            let sql = format!("SELECT stream_sequence, headers FROM {projection}.{table}");
            let rows: Vec<(Option<i64>, Vec<u8>)> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
                .fetch_all(pool)
                .await
                .with_context(|| format!("reading {projection}.{table}"))?;
            counts.insert(projection.to_owned(), rows.len());
            let unexplained = rows
                .iter()
                .filter(|(sequence, headers)| {
                    let sent = sequence.is_some_and(|s| {
                        u64::try_from(s).is_ok_and(|s| injected.hostile_sequences.contains(&s))
                    });
                    !sent && !marked_hostile(headers)
                })
                .count();
            if unexplained > 0 {
                verdict.violations.push(format!(
                    "{projection} has {unexplained} {table} message(s) that hostile_publish did not send"
                ));
            }
        }
    }
    Ok(())
}

/// True when stored headers (a JSON object of name → value) carry the hostile mark: a hostile message
/// whose PubAck was lost still counts as hostile.
fn marked_hostile(headers: &[u8]) -> bool {
    serde_json::from_slice::<serde_json::Map<String, Value>>(headers).is_ok_and(|headers| {
        headers
            .keys()
            .any(|name| name.eq_ignore_ascii_case(super::HOSTILE_HEADER))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn event(order: u128, version: i64, event_type: &str, payload: Value) -> StoredEvent {
        StoredEvent {
            event_id: Uuid::from_u128(
                order * 100 + u128::try_from(version).expect("a positive version"),
            ),
            event_type: event_type.to_owned(),
            aggregate_id: Uuid::from_u128(order),
            aggregate_version: version,
            payload,
        }
    }

    #[test]
    fn the_fold_moves_stock_and_points_through_each_lifecycle() {
        let lines = json!([{"sku": "MUG", "quantity": 2, "unit_price_cents": 1250}, {"sku": "TEA", "quantity": 1, "unit_price_cents": 500}]);
        let placed =
            json!({"customer_id": "ann", "currency": "EUR", "lines": lines, "total_cents": 3000});
        let paid = json!({"amount_cents": 3000, "payment_ref": null});
        let events = vec![
            // shipped
            event(1, 1, "order.placed", placed.clone()),
            event(1, 2, "order.paid", paid.clone()),
            event(
                1,
                3,
                "order.shipped",
                json!({"carrier": "DHL", "tracking_number": "X"}),
            ),
            // refunded
            event(2, 1, "order.placed", placed.clone()),
            event(2, 2, "order.paid", paid),
            event(2, 3, "order.cancelled", json!({"reason": "r"})),
            // left placed
            event(3, 1, "order.placed", placed),
        ];
        let folded = fold(&events);
        assert_eq!(folded.stock["MUG"], [2, 2, 2]);
        assert_eq!(folded.stock["TEA"], [1, 1, 1]);
        assert_eq!(
            folded.points["ann"], 30,
            "one order's 30 points kept, the refund's taken back"
        );
        let status = |order| folded.documents[&Uuid::from_u128(order)].status.as_str();
        assert_eq!(status(1), "shipped");
        assert_eq!(status(2), "cancelled");
        assert_eq!(status(3), "placed");
        assert_eq!(folded.documents[&Uuid::from_u128(3)].total_cents, 3000);
        assert_eq!(folded.versions[&Uuid::from_u128(1)], 3);
        assert_eq!(folded.versions[&Uuid::from_u128(3)], 1);
    }

    #[test]
    fn differences_count_a_missing_key_as_zero_and_name_what_differs() {
        let expected = BTreeMap::from([("a", 1), ("b", 0), ("c", 3)]);
        let found = BTreeMap::from([("a", 1), ("c", 4), ("d", 0)]);
        let differing = differences(&expected, &found, 0);
        assert_eq!(differing.len(), 1, "{differing:?}");
        assert!(differing[0].starts_with("c:"), "{differing:?}");
    }

    #[test]
    fn only_headers_carrying_the_chaos_mark_count_as_hostile() {
        assert!(marked_hostile(
            br#"{"Waybill-Chaos":"hostile","Nats-Msg-Id":"x"}"#
        ));
        assert!(marked_hostile(br#"{"waybill-chaos":"anything"}"#));
        assert!(!marked_hostile(br#"{"Nats-Msg-Id":"x"}"#));
        assert!(!marked_hostile(b"not json"));
    }
}
