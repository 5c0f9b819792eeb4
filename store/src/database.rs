//! Applying the embedded migrations. Connecting lives in [`ops::database`], which the read side shares.

use sqlx::PgPool;

/// Applies every pending migration; returns the versions and descriptions it applied.
pub async fn migrate(pool: &PgPool) -> Result<Vec<(i64, String)>, sqlx::migrate::MigrateError> {
    let applied_before: Vec<i64> = applied_versions(pool).await.unwrap_or_default();
    crate::MIGRATOR.run(pool).await?;
    Ok(crate::MIGRATOR
        .iter()
        .filter(|m| !applied_before.contains(&m.version))
        .map(|m| (m.version, m.description.to_string()))
        .collect())
}

async fn applied_versions(pool: &PgPool) -> sqlx::Result<Vec<i64>> {
    sqlx::query_scalar("SELECT version FROM _sqlx_migrations WHERE success")
        .fetch_all(pool)
        .await
}
