//! The verdict, from first principles: what the load saw accepted is in the event store; every stored
//! event is in the stream exactly once and in its order's version order (read back from the stream);
//! the projections equal a fold of the event store written here, in a few lines of its own, and each
//! read model of the registry its own fold of the event store; nothing is left unsent, dead, parked
//! or held but what `hostile_publish` sent.
//!
//! One module per check, each adding to the findings ([`findings`]) from the evidence
//! ([`evidence`]); [`judge`] runs them in order. The outbox check stays in this file: the outbox's
//! owner test (`store/tests/outbox_owner.rs`) exempts it by this path as the one place outside
//! `store::outbox` that spells outbox SQL.

mod accepted;
mod built_ins;
mod checkpoints;
mod conduct;
mod differences;
mod evidence;
mod findings;
mod fold;
mod parked;
mod read_models;
mod stream;

use std::collections::{BTreeSet, HashMap};

use anyhow::Context;
use sqlx::PgPool;
use uuid::Uuid;

pub(super) use evidence::Evidence;
use evidence::StoredEvent;
pub(super) use findings::Verdict;

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
    conduct::check_conduct(&mut verdict, &evidence);

    // By event id: what the accepted commands and the stream's messages are matched against.
    let stored: HashMap<Uuid, &StoredEvent> = events.iter().map(|e| (e.event_id, e)).collect();
    accepted::check_accepted(&mut verdict, &evidence, &stored);

    stream::check_stream(&mut verdict, evidence.jetstream, evidence.stream, &stored).await?;
    check_outbox(&mut verdict, evidence.pool).await?;
    built_ins::check_projections(&mut verdict, &evidence, &events).await?;
    parked::check_parked_and_held(&mut verdict, evidence.pool, evidence.injected).await?;
    Ok(verdict)
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
