//! What the projections must say, computed straight from the event store by folding every order, and
//! what they do say, read from their HTTP APIs — side by side. Each read model of the registry is
//! checked the same way against its own fold of the event store ([`models`]).

use std::collections::{BTreeMap, BTreeSet};

use domain::{OrderId, OrderStatus};
use serde_json::Value;
use sqlx::PgPool;
use store::EventStore;
use uuid::Uuid;

use crate::http::Http;

/// One loyalty point per this many cents paid: the loyalty rule, written here again on purpose rather
/// than imported from `projections::points` (lab's chaos verdict keeps its own copy for the same reason). The verification is an independent oracle:
/// had it used the projection's own constant, a wrong rate there would be agreed with, not caught.
const CENTS_PER_POINT: i64 = 100;

/// The largest page the read APIs serve (`projections::http::MAX_LIMIT`): asking for it keeps the number
/// of requests low, and every list is read to its last page whatever its size.
const PAGE: usize = 500;

/// The state all three projections describe, in comparable form.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Truth {
    /// SKU → (reserved, shipped, released).
    pub stock: BTreeMap<String, (i64, i64, i64)>,
    /// Customer → points.
    pub points: BTreeMap<String, i64>,
    /// Status → orders in it.
    pub statuses: BTreeMap<String, BTreeSet<Uuid>>,
}

/// The truth according to the event store: every order folded from its events.
pub(super) async fn expected(pool: &PgPool) -> anyhow::Result<Truth> {
    let store = EventStore::new(pool.clone());
    let ids: Vec<Uuid> = sqlx::query_scalar("SELECT DISTINCT aggregate_id FROM events")
        .fetch_all(pool)
        .await?;
    let mut truth = Truth::default();
    for id in ids {
        let order = store.load(OrderId::from_uuid(id)).await?;
        let customer = order
            .customer_id
            .as_ref()
            .map(ToString::to_string)
            .unwrap_or_default();
        for line in &order.lines {
            let entry = truth.stock.entry(line.sku.to_string()).or_default();
            let quantity = i64::from(line.quantity.get());
            match order.status {
                OrderStatus::Placed | OrderStatus::Paid => entry.0 += quantity,
                OrderStatus::Shipped => entry.1 += quantity,
                OrderStatus::Cancelled => entry.2 += quantity,
                OrderStatus::New => {}
            }
        }
        // Paid and not cancelled keeps its points; a cancelled paid order gave them back.
        let kept = if order.status == OrderStatus::Cancelled {
            0
        } else {
            order.paid_cents / CENTS_PER_POINT
        };
        if order.paid_cents > 0 {
            *truth.points.entry(customer).or_default() += kept;
        }
        truth
            .statuses
            .entry(order.status.to_string())
            .or_default()
            .insert(id);
    }
    Ok(truth)
}

/// The truth according to the projections' read APIs.
pub(super) async fn projected(reads: &[(&'static str, String)]) -> anyhow::Result<Truth> {
    let client = Http::default();
    let url = |name: &str, path: &str| {
        reads
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, base)| format!("{base}{path}"))
            .unwrap_or_default()
    };
    let mut truth = Truth::default();
    for s in all_pages(&client, &url("inventory", &format!("/stock?limit={PAGE}"))).await? {
        let counters = (
            s["reserved"].as_i64().unwrap_or(0),
            s["shipped"].as_i64().unwrap_or(0),
            s["released"].as_i64().unwrap_or(0),
        );
        truth
            .stock
            .insert(s["sku"].as_str().unwrap_or("").to_owned(), counters);
    }
    for a in all_pages(&client, &url("points", &format!("/customers?limit={PAGE}"))).await? {
        truth.points.insert(
            a["customer_id"].as_str().unwrap_or("").to_owned(),
            a["balance"].as_i64().unwrap_or(0),
        );
    }
    for status in ["placed", "paid", "shipped", "cancelled"] {
        // Every page: a long story has more orders in one status than a page holds.
        let documents = all_pages(
            &client,
            &url("search", &format!("/search?q={status}&limit={PAGE}")),
        )
        .await?;
        let found: Vec<Uuid> = documents
            .iter()
            .filter(|d| d["status"] == status)
            .filter_map(|d| d["order_id"].as_str().and_then(|s| Uuid::parse_str(s).ok()))
            .collect();
        let ids: BTreeSet<Uuid> = found.iter().copied().collect();
        // Search pages are ranked, their cursor an offset: a document that moved between two pages
        // shows twice and pushes another off every page. Collected into a set, that would read as a
        // projection missing an order; say what happened instead.
        anyhow::ensure!(
            ids.len() == found.len(),
            "search for {status:?} returned {} document(s) twice while paging: the ranking moved under the cursor",
            found.len() - ids.len()
        );
        if !ids.is_empty() {
            truth.statuses.insert(status.to_owned(), ids);
        }
    }
    Ok(truth)
}

/// Every item of a paged list (`{items, next_cursor}`), following the cursors from `first`.
async fn all_pages(client: &Http, first: &str) -> anyhow::Result<Vec<Value>> {
    let mut items = Vec::new();
    let mut url = first.to_owned();
    loop {
        let page = client.get_json(&url).await?;
        let page_items = page["items"].as_array().cloned().unwrap_or_default();
        let more = page["next_cursor"].as_str();
        // A page that announces another but brought nothing would be asked for forever.
        anyhow::ensure!(
            more.is_none() || !page_items.is_empty(),
            "{url} answered an empty page with a next cursor"
        );
        items.extend(page_items);
        match more {
            Some(cursor) => url = format!("{first}&cursor={cursor}"),
            None => return Ok(items),
        }
    }
}

/// Prints the comparison; returns the number of disagreements.
pub(super) fn report(expected: &Truth, projected: &Truth) -> usize {
    let mut disagreements = 0;
    let mark = |same: bool| if same { "ok" } else { "DIFFERS" };
    println!("\ninventory (reserved / shipped / released)      event store       projection");
    let skus: BTreeSet<&String> = expected
        .stock
        .keys()
        .chain(projected.stock.keys())
        .collect();
    for sku in skus {
        let (e, p) = (
            expected.stock.get(sku).copied().unwrap_or_default(),
            projected.stock.get(sku).copied().unwrap_or_default(),
        );
        disagreements += usize::from(e != p);
        println!(
            "  {sku:<12} {:>28} {:>16}  {}",
            format!("{}/{}/{}", e.0, e.1, e.2),
            format!("{}/{}/{}", p.0, p.1, p.2),
            mark(e == p)
        );
    }
    println!("points (balance)");
    let customers: BTreeSet<&String> = expected
        .points
        .keys()
        .chain(projected.points.keys())
        .collect();
    for customer in customers {
        let (e, p) = (
            expected.points.get(customer).copied().unwrap_or(0),
            projected.points.get(customer).copied().unwrap_or(0),
        );
        disagreements += usize::from(e != p);
        println!("  {customer:<12} {e:>28} {p:>16}  {}", mark(e == p));
    }
    println!("search (orders found by status)");
    for status in ["placed", "paid", "shipped", "cancelled"] {
        let empty = BTreeSet::new();
        let (e, p) = (
            expected.statuses.get(status).unwrap_or(&empty),
            projected.statuses.get(status).unwrap_or(&empty),
        );
        disagreements += usize::from(e != p);
        println!(
            "  {status:<12} {:>28} {:>16}  {}",
            e.len(),
            p.len(),
            mark(e == p)
        );
    }
    disagreements
}

/// One read model's verdict: its document (`GET /state` of its read API) against its own pure fold
/// of the event store ([`projections::kit::Model::expected`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct ModelVerdict {
    /// The model.
    pub name: &'static str,
    /// `None` when they are equal; else the first difference, or why one could not be read.
    pub difference: Option<String>,
}

/// Every read model of the registry checked against its fold of the event store at
/// `database_url`, its document read from its read API in `reads`.
pub(super) async fn models(
    database_url: &str,
    reads: &[(&'static str, String)],
) -> Vec<ModelVerdict> {
    let client = Http::default();
    let mut verdicts = Vec::new();
    for model in projections::registry::MODELS {
        let name = model.name();
        let difference = match compare(&client, *model, database_url, reads).await {
            Ok(difference) => difference,
            Err(error) => Some(format!(
                "could not be compared: {}",
                ops::error_chain(&*error)
            )),
        };
        verdicts.push(ModelVerdict { name, difference });
    }
    verdicts
}

async fn compare(
    client: &Http,
    model: &dyn projections::kit::Model,
    database_url: &str,
    reads: &[(&'static str, String)],
) -> anyhow::Result<Option<String>> {
    let base = reads
        .iter()
        .find(|(name, _)| *name == model.name())
        .map(|(_, base)| base)
        .ok_or_else(|| anyhow::anyhow!("the fleet did not start it"))?;
    let expected = model.expected(database_url).await?;
    let actual = client.get_json(&format!("{base}/state")).await?;
    Ok(projections::model_cli::first_difference(
        &expected, &actual, "",
    ))
}

/// Prints one line per read model ("ok", or "DIFFERS: " and the first difference); returns the
/// number that differ.
pub(super) fn report_models(verdicts: &[ModelVerdict]) -> usize {
    if verdicts.is_empty() {
        return 0;
    }
    println!("read models (projections/src/models/): document vs its fold of the event store");
    for verdict in verdicts {
        match &verdict.difference {
            None => println!("  {:<12} ok", verdict.name),
            Some(difference) => println!("  {:<12} DIFFERS: {difference}", verdict.name),
        }
    }
    verdicts.iter().filter(|v| v.difference.is_some()).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_model_that_differs_is_a_disagreement_and_says_where() {
        let verdicts = [
            ModelVerdict {
                name: "revenue",
                difference: None,
            },
            ModelVerdict {
                name: "customers",
                difference: Some(".[0].orders: the fold says 2, the read model 1".into()),
            },
        ];
        assert_eq!(report_models(&verdicts), 1);
        assert_eq!(report_models(&verdicts[..1]), 0);
    }
}
