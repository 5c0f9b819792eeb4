//! Each read model of the registry against its own fold of the event store, and a model of orders'
//! checkpoints against the orders' last versions.

use std::collections::BTreeMap;

use anyhow::Context;
use uuid::Uuid;

use super::checkpoints::checkpoint_differences;
use super::evidence::Evidence;

/// Each read model's document against its own fold of the event store (the first difference), and,
/// for a model of orders, its checkpoint of each order against the order's last version.
pub(super) async fn check_models(
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
