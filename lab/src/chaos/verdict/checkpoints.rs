//! A projection's checkpoint of each order against the order's last version in the store.

use std::collections::BTreeMap;

use anyhow::Context;
use sqlx::PgPool;
use uuid::Uuid;

use super::differences::differences;

/// Projection `name`'s checkpoint of each order against the order's last version (`versions`), one
/// line per difference. `orders_only`: leave out the checkpoints of aggregates that are not orders
/// (a projection of several aggregate types keeps theirs in the same table).
pub(super) async fn checkpoint_differences(
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
