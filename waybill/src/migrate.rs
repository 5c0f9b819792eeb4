//! `waybill migrate`: create the database when it is missing, then apply pending migrations.

use anyhow::Context;
use serde_json::json;

use crate::failure::redact;

/// Runs the migration and prints what it did.
pub(crate) async fn run(database_url: &str, json: bool) -> anyhow::Result<()> {
    let shown = redact(database_url);
    let created = ops::database::ensure_database(database_url)
        .await
        .with_context(|| format!("cannot create or open the database at {shown}"))?;
    let pool = ops::database::connect(database_url, "waybill-migrate", 1)
        .await
        .with_context(|| format!("cannot connect to PostgreSQL at {shown}"))?;
    // Events are JSON in any language: a database that cannot hold every character would refuse
    // some of them, and a migration (whose comments are not all ASCII) halfway through.
    let encoding: String = sqlx::query_scalar("SHOW server_encoding")
        .fetch_one(&pool)
        .await
        .context("reading the database's encoding")?;
    if encoding != "UTF8" {
        return Err(ops::Refused::new(format!(
            "the database at {shown} is encoded {encoding}; waybill needs UTF8: create it with \
             CREATE DATABASE … ENCODING 'UTF8' TEMPLATE template0 (nothing was migrated)"
        ))
        .into());
    }
    let applied = store::migrate(&pool).await.context("applying migrations")?;
    pool.close().await;
    if json {
        let applied: Vec<_> = applied
            .iter()
            .map(|(version, description)| json!({"version": version, "description": description}))
            .collect();
        println!(
            "{}",
            json!({"database": shown, "created": created, "applied": applied})
        );
    } else {
        if created {
            println!("created database {shown}");
        }
        for (version, description) in &applied {
            println!("applied migration {version} {description}");
        }
        if applied.is_empty() {
            println!("database {shown} is up to date");
        }
    }
    Ok(())
}
