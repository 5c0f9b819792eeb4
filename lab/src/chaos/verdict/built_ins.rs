//! The built-in projections (inventory, points, search) against the fold, their checkpoints against
//! the orders' last versions; with the registry's read models ([`super::read_models`]), every
//! projection's mismatches in the findings.

use std::collections::BTreeMap;

use anyhow::Context;
use uuid::Uuid;

use super::checkpoints::checkpoint_differences;
use super::differences::differences;
use super::evidence::{Evidence, StoredEvent};
use super::findings::Verdict;
use super::fold::{Document, fold};
use super::read_models::check_models;

pub(super) async fn check_projections(
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
