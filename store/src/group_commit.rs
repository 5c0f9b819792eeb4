//! Group commit: concurrent appends of different aggregates written by one statement and one commit.
//!
//! PostgreSQL's fixed cost per statement and commit is several times the cost of the rows an append
//! writes (measured with pgbench on the 2-core machine: ~300 µs of server CPU per one-event append,
//! ~90 µs per event when eight go in one statement; DESIGN.md, platform facts). So a busy order service
//! hands its appends to a few writer tasks: each takes whatever appends are waiting — never waiting for
//! more, so an idle service adds no latency — and writes them in one statement. The statement is all or
//! nothing; when it fails (another process took a version, a unique key collided), the writer runs
//! each append of the group alone, so every caller gets exactly the answer it would have had alone.

use std::collections::HashSet;
use std::sync::Arc;

use domain::EventEnvelope;
use sqlx::PgPool;
use tokio::sync::{Mutex, mpsc, oneshot};
use uuid::Uuid;

use crate::append::{Part, insert_events};

/// At most this many appends go in one statement.
const MAX_GROUP: usize = 128;

/// A cloneable handle to the writer tasks; they end when the last handle is dropped.
#[derive(Debug, Clone)]
pub struct GroupCommit {
    appends: mpsc::Sender<Pending>,
}

/// One append waiting for a writer.
#[derive(Debug)]
struct Pending {
    aggregate_id: Uuid,
    expected_version: i64,
    events: Vec<EventEnvelope>,
    traceparent: Option<String>,
    /// How many of the append's events were written: all, or none when the aggregate was not at the
    /// expected version.
    done: oneshot::Sender<sqlx::Result<u64>>,
}

impl Pending {
    fn part(&self) -> Part<'_> {
        Part::new(
            self.expected_version,
            &self.events,
            self.traceparent.as_deref(),
        )
    }
}

impl GroupCommit {
    /// Writer tasks unless told otherwise (`waybill serve --group-commit-writers`): one statement in
    /// flight at a time. In the pipeline benchmark at 1,000 orders/s (two cores) two writers took
    /// turns with groups of 1.3 appends; one writer made bigger groups, cost PostgreSQL 8 % less CPU
    /// and cut every stage's latency after it (README "Benchmarks"). A second writer only helps
    /// while one waits on a lock another process holds (at most `lock_timeout`).
    pub const DEFAULT_WRITERS: u16 = 1;

    /// Starts `writers` writer tasks on `pool` (at least one). More writers: more statements in
    /// flight at once and smaller groups; fewer: bigger groups, cheaper for the database.
    pub fn spawn(pool: PgPool, writers: usize) -> Self {
        let (appends, waiting) = mpsc::channel::<Pending>(MAX_GROUP * 8);
        let waiting = Arc::new(Mutex::new(waiting));
        for _ in 0..writers.max(1) {
            let (pool, waiting) = (pool.clone(), waiting.clone());
            tokio::spawn(async move {
                while let Some(group) = next_group(&waiting).await {
                    write_group(&pool, group).await;
                }
            });
        }
        describe_metrics();
        Self { appends }
    }

    /// Writes one aggregate's checked run of events with the next group; returns how many were written.
    pub(crate) async fn insert(
        &self,
        aggregate_id: Uuid,
        expected_version: i64,
        events: &[EventEnvelope],
        traceparent: Option<&str>,
    ) -> sqlx::Result<u64> {
        let (done, answer) = oneshot::channel();
        let pending = Pending {
            aggregate_id,
            expected_version,
            events: events.to_vec(),
            traceparent: traceparent.map(str::to_owned),
            done,
        };
        self.appends
            .send(pending)
            .await
            .map_err(|_| sqlx::Error::WorkerCrashed)?;
        answer.await.map_err(|_| sqlx::Error::WorkerCrashed)?
    }
}

/// Waits for one append, then takes every other one already waiting, up to [`MAX_GROUP`]. `None`
/// when every handle is gone.
async fn next_group(waiting: &Mutex<mpsc::Receiver<Pending>>) -> Option<Vec<Pending>> {
    let mut waiting = waiting.lock().await;
    let first = waiting.recv().await?;
    let mut group = vec![first];
    while group.len() < MAX_GROUP {
        match waiting.try_recv() {
            Ok(pending) => group.push(pending),
            Err(_) => break,
        }
    }
    Some(group)
}

/// Writes a group in one statement, or each append alone when that fails. A second append of an
/// aggregate already in the group waits for the group: both were decided against the same state, so
/// it is refused as a conflict after the first commits, as it would have been alone. A caller that
/// has gone (its request timed out) is not written: it was told nothing.
async fn write_group(pool: &PgPool, group: Vec<Pending>) {
    let mut seen = HashSet::with_capacity(group.len());
    let (mut together, after): (Vec<Pending>, Vec<Pending>) = group
        .into_iter()
        .filter(|pending| !pending.done.is_closed())
        .partition(|pending| seen.insert(pending.aggregate_id));
    // Every group inserts its keys in the same order, so two groups waiting on each other's
    // uncommitted rows queue up instead of deadlocking.
    together.sort_by_key(|pending| pending.aggregate_id);
    metrics::histogram!("waybill_group_commit_appends").record(together.len() as f64);
    if together.len() <= 1 {
        write_alone(pool, together).await;
    } else {
        let parts: Vec<Part<'_>> = together.iter().map(Pending::part).collect();
        let written = insert_events(pool, &parts).await;
        drop(parts);
        match written {
            Ok(written) => answer(together, &written),
            // The server refused the statement, so it wrote nothing. Expected now and then (a
            // version taken by another process, a lock waited on too long): each append alone
            // finds out which it was and answers for itself.
            Err(sqlx::Error::Database(error)) => {
                tracing::debug!(%error, appends = together.len(), "group commit refused; writing each append alone");
                metrics::counter!("waybill_group_commit_groups_total", "outcome" => "split")
                    .increment(1);
                write_alone(pool, together).await;
            }
            // No answer: the statement may have committed before the connection broke, or never
            // run. Its rows say which.
            Err(error) => settle_unanswered(pool, together, error).await,
        }
    }
    write_alone(pool, after).await;
}

/// Answers every append of a committed group with how many of its events the statement wrote.
fn answer(together: Vec<Pending>, written: &[Uuid]) {
    metrics::counter!("waybill_group_commit_groups_total", "outcome" => "committed").increment(1);
    for pending in together {
        let n = written
            .iter()
            .filter(|&&id| id == pending.aggregate_id)
            .count();
        let _ = pending.done.send(Ok(n as u64));
    }
}

/// After a group's statement got no answer: the statement is all or nothing, so if any of its events
/// are stored it committed, and each append is answered from the rows; if none are, each is written
/// alone. When even that cannot be read, every caller gets the failure (the outcome is unknown, as
/// for a command written alone whose connection broke).
async fn settle_unanswered(pool: &PgPool, together: Vec<Pending>, error: sqlx::Error) {
    let ids: Vec<Uuid> = together
        .iter()
        .flat_map(|pending| pending.events.iter().map(|event| event.event_id))
        .collect();
    let stored = sqlx::query_scalar("SELECT aggregate_id FROM events WHERE event_id = ANY($1)")
        .bind(&ids)
        .fetch_all(pool)
        .await;
    match stored {
        Ok(written) if !written.is_empty() => answer(together, &written),
        Ok(_) => {
            metrics::counter!("waybill_group_commit_groups_total", "outcome" => "split")
                .increment(1);
            write_alone(pool, together).await;
        }
        Err(check) => {
            tracing::warn!(%error, %check, appends = together.len(), "group commit got no answer and its outcome cannot be read");
            metrics::counter!("waybill_group_commit_groups_total", "outcome" => "unknown")
                .increment(1);
            for pending in together {
                let failed = std::io::Error::other(format!("group commit got no answer: {error}"));
                let _ = pending.done.send(Err(sqlx::Error::Io(failed)));
            }
        }
    }
}

/// Writes each append with its own statement, side by side: one waiting on a lock must not hold up
/// the others.
async fn write_alone(pool: &PgPool, appends: Vec<Pending>) {
    let writes = appends
        .into_iter()
        .filter(|pending| !pending.done.is_closed())
        .map(|pending| async move {
            let written = insert_events(pool, &[pending.part()])
                .await
                .map(|w| w.len() as u64);
            let _ = pending.done.send(written);
        });
    futures::future::join_all(writes).await;
}

fn describe_metrics() {
    metrics::describe_histogram!(
        "waybill_group_commit_appends",
        "Appends (commands) written by one statement and one commit of the order service's group commit"
    );
    metrics::describe_counter!(
        "waybill_group_commit_groups_total",
        "Groups of appends: committed together, split (the statement was refused; each append was written alone), or unknown (no answer, and the outcome could not be read: every caller was told it failed)"
    );
}
