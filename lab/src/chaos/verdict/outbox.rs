//! The outbox: every row sent in the end, none left pending, failed or dead.

use sqlx::PgPool;

use super::findings::Verdict;

// The verdict reads the outbox with its own SQL, not through `relay::admin`: the other tools share
// that one way in, but a checker that trusted the code it checks could not catch it being wrong.
pub(super) async fn check_outbox(verdict: &mut Verdict, pool: &PgPool) -> anyhow::Result<()> {
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
