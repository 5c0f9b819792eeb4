//! Group commit: concurrent appends of different aggregates written by one statement and one commit.
//!
//! PostgreSQL's fixed cost per statement and commit is several times the cost of the rows an append
//! writes (measured with pgbench on the 2-core machine: ~300 µs of server CPU per one-event append,
//! ~90 µs per event when eight go in one statement; DESIGN.md, platform facts). So a busy order service
//! hands its appends to a few writer tasks: each takes whatever appends are waiting — never waiting for
//! more, so an idle service adds no latency — and writes them in one statement, on a connection of
//! its own. The statement is all or nothing; when it is refused (another process took a version, a
//! lock held elsewhere outlasted the group's short wait), each append of the group is written alone
//! in its aggregate's lane ([`crate::lanes`]), which the writer does not wait for: one aggregate's
//! trouble holds up only that aggregate, and every caller gets exactly the answer it would have had
//! alone.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use domain::EventEnvelope;
use sqlx::{PgConnection, PgPool};
use tokio::sync::{Mutex, mpsc, oneshot};
use uuid::Uuid;

use crate::alone::{self, Unwritten, is_lock_timeout};
use crate::backend::Backend;
use crate::lanes::Lanes;
use crate::outbox::Part;
use crate::outbox::insert_events;
use crate::pending::Pending;

/// At most this many appends go in one statement.
const MAX_GROUP: usize = 128;

/// A cloneable handle to the writer tasks; they end when the last handle is dropped.
#[derive(Debug, Clone)]
pub struct GroupCommit {
    appends: mpsc::Sender<Pending>,
}

/// How group commit writes ([`GroupCommit::spawn_with`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupCommitSettings {
    /// Writer tasks, each with a connection of its own (at least one). More writers: more
    /// statements in flight at once and smaller groups; fewer: bigger groups, cheaper for the
    /// database.
    pub writers: usize,
    /// How long a group's statement waits for a lock another transaction holds (the group's own
    /// `lock_timeout`; at least 1 ms) before the group is handed to the lanes. Another writer's
    /// group on the same order commits within milliseconds; a writer frozen mid-transaction never
    /// does, and every append queued behind the group waits this long once.
    pub lock_wait: Duration,
}

impl Default for GroupCommitSettings {
    fn default() -> Self {
        Self {
            writers: GroupCommit::DEFAULT_WRITERS.into(),
            lock_wait: GroupCommit::DEFAULT_LOCK_WAIT,
        }
    }
}

impl GroupCommit {
    /// Writer tasks unless told otherwise (`waybill serve --group-commit-writers`): one statement in
    /// flight at a time. In the pipeline benchmark at 1,000 orders/s (two cores) two writers took
    /// turns with groups of 1.3 appends; one writer made bigger groups, cost PostgreSQL 8 % less CPU
    /// and cut every stage's latency after it (README "Benchmarks").
    pub const DEFAULT_WRITERS: u16 = 1;

    /// A group's wait for a lock held elsewhere, unless told otherwise: a hundred times a group's
    /// usual commit, and well under a request's latency budget.
    pub const DEFAULT_LOCK_WAIT: Duration = Duration::from_millis(100);

    /// Starts `writers` writer tasks on `pool` with the default lock wait.
    pub fn spawn(pool: PgPool, writers: usize) -> Self {
        Self::spawn_with(
            pool,
            GroupCommitSettings {
                writers,
                ..GroupCommitSettings::default()
            },
        )
    }

    /// Starts the writer tasks on `pool`. Lone writes use the pool's sessions as they are (their
    /// `lock_timeout` is how long a lock held elsewhere may hold up one aggregate's command).
    pub fn spawn_with(pool: PgPool, settings: GroupCommitSettings) -> Self {
        let (appends, waiting) = mpsc::channel::<Pending>(MAX_GROUP * 8);
        let waiting = Arc::new(Mutex::new(waiting));
        let lanes = Lanes::new(pool.clone());
        for _ in 0..settings.writers.max(1) {
            let mut writer = Writer {
                pool: pool.clone(),
                lock_wait: settings.lock_wait.max(Duration::from_millis(1)),
                session: None,
                lanes: lanes.clone(),
            };
            let waiting = waiting.clone();
            tokio::spawn(async move {
                while let Some(group) = next_group(&waiting).await {
                    writer.write(group).await;
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
    ) -> Result<u64, Unwritten> {
        let crashed = || Unwritten::Error(sqlx::Error::WorkerCrashed);
        let (done, answer) = oneshot::channel();
        let pending = Pending {
            aggregate_id,
            expected_version,
            events: events.to_vec(),
            traceparent: traceparent.map(str::to_owned),
            done,
        };
        self.appends.send(pending).await.map_err(|_| crashed())?;
        answer.await.map_err(|_| crashed())?
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

/// One writer task: its connection (opened when first needed, and again after it broke) and the
/// lanes it hands appends to.
struct Writer {
    pool: PgPool,
    lock_wait: Duration,
    session: Option<Session>,
    lanes: Arc<Lanes>,
}

/// The writer's connection, with the group's short `lock_timeout` set, and its backend.
struct Session {
    connection: PgConnection,
    backend: Backend,
}

impl Writer {
    /// Writes a group in one statement; appends of aggregates that are being written alone, and
    /// second appends of an aggregate, go to their lanes. A second append of an aggregate already
    /// in the group is queued behind the group's: both were decided against the same state, so it
    /// is refused as a conflict after the first commits, as it would have been alone. A caller that
    /// has gone (its request timed out) is not written: it was told nothing.
    async fn write(&mut self, group: Vec<Pending>) {
        let mut seen = HashSet::with_capacity(group.len());
        let mut together = Vec::with_capacity(group.len());
        let mut after = Vec::new();
        for pending in group {
            if pending.done.is_closed() {
                continue;
            }
            let Some(pending) = self.lanes.divert(pending) else {
                continue;
            };
            if seen.insert(pending.aggregate_id) {
                together.push(pending);
            } else {
                after.push(pending);
            }
        }
        if !together.is_empty() {
            // Every group inserts its keys in the same order, so two groups waiting on each
            // other's uncommitted rows queue up instead of deadlocking.
            together.sort_by_key(|pending| pending.aggregate_id);
            metrics::histogram!("waybill_group_commit_appends").record(together.len() as f64);
            self.write_together(together).await;
        }
        for pending in after {
            self.lanes.push(pending);
        }
    }

    async fn write_together(&mut self, together: Vec<Pending>) {
        let session = match self.session().await {
            Ok(session) => session,
            Err(error) => {
                tracing::warn!(%error, appends = together.len(), "group commit cannot open its connection; writing each append alone");
                self.hand_over(together, "split");
                return;
            }
        };
        let parts: Vec<Part<'_>> = together.iter().map(Pending::part).collect();
        let written = insert_events(&mut session.connection, &parts).await;
        drop(parts);
        match written {
            Ok(written) => answer(together, &written),
            // The server refused the statement, so it wrote nothing. Expected now and then: a
            // version taken by another process, or a lock held elsewhere for longer than the
            // group's wait (another writer frozen mid-transaction on one of these aggregates).
            // Each append alone, in its lane, finds out which it was and answers for itself.
            Err(error @ sqlx::Error::Database(_)) => {
                let outcome = if is_lock_timeout(&error) {
                    "lock_wait"
                } else {
                    "split"
                };
                tracing::debug!(%error, appends = together.len(), outcome, "group commit refused; writing each append alone");
                self.hand_over(together, outcome);
            }
            // No answer: the statement may have committed before the connection broke, may still
            // commit, or never ran. Ending its backend first makes its rows say which.
            Err(error) => {
                let backend = session.backend;
                self.session = None;
                self.settle_unanswered(backend, together, error).await;
            }
        }
    }

    /// The writer's connection, opened if it has none.
    async fn session(&mut self) -> sqlx::Result<&mut Session> {
        if self.session.is_none() {
            // Out of the pool for good: the session keeps a `lock_timeout` no other user of the
            // pool should get (the pool may open another connection in its place).
            let mut connection = self.pool.acquire().await?.detach();
            // The generic plan, always: the group's statement (a CTE over UNNESTed arrays, its guard
            // an equality on the unique (aggregate_id, aggregate_version) index) was planned again on
            // every execution under the default `auto` — ~200 µs of PostgreSQL CPU per group in the
            // pipeline benchmark, more than executing it (pg_stat_statements, docs/benchmarks.md).
            sqlx::query(
                "SELECT set_config('lock_timeout', $1, false),
                        set_config('plan_cache_mode', 'force_generic_plan', false)",
            )
            .bind(format!("{}ms", self.lock_wait.as_millis()))
            .execute(&mut connection)
            .await?;
            let backend = Backend::of(&mut connection).await?;
            self.session = Some(Session {
                connection,
                backend,
            });
        }
        Ok(self
            .session
            .as_mut()
            .expect("the session was opened just above"))
    }

    /// Hands every append of a group that wrote nothing to its lane.
    fn hand_over(&self, together: Vec<Pending>, outcome: &'static str) {
        metrics::counter!("waybill_group_commit_groups_total", "outcome" => outcome).increment(1);
        for pending in together {
            self.lanes.push(pending);
        }
    }

    /// After a group's statement got no answer: once its backend is gone, the statement is all or
    /// nothing, so if any of its events are stored it committed and each append is answered from
    /// the rows; if none are, each is written alone. When even that cannot be found out, every
    /// caller is told the outcome is unknown.
    async fn settle_unanswered(
        &self,
        backend: Backend,
        together: Vec<Pending>,
        error: sqlx::Error,
    ) {
        let ids: Vec<Uuid> = together
            .iter()
            .flat_map(|pending| pending.events.iter().map(|event| event.event_id))
            .collect();
        let first = together[0].aggregate_id;
        match alone::settle(&self.pool, &backend, &ids, first, &error).await {
            Some(written) if !written.is_empty() => answer(together, &written),
            Some(_) => self.hand_over(together, "split"),
            None => {
                metrics::counter!("waybill_group_commit_groups_total", "outcome" => "unknown")
                    .increment(1);
                for pending in together {
                    let unknown =
                        std::io::Error::other(format!("group commit got no answer: {error}"));
                    let _ = pending
                        .done
                        .send(Err(Unwritten::Unknown(sqlx::Error::Io(unknown))));
                }
            }
        }
    }
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

fn describe_metrics() {
    metrics::describe_histogram!(
        "waybill_group_commit_appends",
        "Appends (commands) written by one statement and one commit of the order service's group commit"
    );
    metrics::describe_counter!(
        "waybill_group_commit_groups_total",
        "Groups of appends: committed together; split (the statement was refused, or got no answer and wrote nothing: each append was written alone); lock_wait (a lock held elsewhere outlasted the group's short wait: each append was written alone); unknown (no answer, and the outcome could not be found out: every caller was told so)"
    );
    crate::lanes::describe_metrics();
    alone::describe_metrics();
}
