//! `run --source wal`: the relay reads new outbox rows from a logical replication slot instead of
//! claiming them, publishes them exactly as a claim's rows are published (the event id as
//! `Nats-Msg-Id`, each aggregate's versions chained behind their predecessor's PubAck and fenced with
//! `Nats-Expected-Last-Subject-Sequence`), marks them sent in one statement per batch — while the next
//! batch is published, one mark at a time — and only then confirms their WAL position to PostgreSQL.
//!
//! What the slot does not carry is the polling machinery's: before every session starts streaming,
//! one polling drain delivers whatever the outbox holds unsent (rows committed before the slot
//! existed, rows whose marks a crash lost, rows handed over below), and an aggregate whose publish
//! keeps failing is handed over to polling — its rows stay unsent in the outbox, where the claim's
//! retries, dead rows and divergences apply — until it has nothing unsent left. A crash anywhere
//! replays from the last confirmed position; the stream's dedupe and the fence absorb the copies.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use async_nats::connection::State;
use futures::FutureExt;
use ops::error_chain;
use pgwire_replication::{Lsn, ReplicationEvent};
use tokio::task::JoinHandle;
use uuid::Uuid;

use super::ledger::{Ledger, Ticket};
use super::pgoutput::{Change, DecodeError, Relations, decode};
use super::slot;
use crate::claim::ClaimedRow;
use crate::metrics;
use crate::publish::{OnRefusal, Outcome, publish_runs};
use crate::{Relay, RunSummary};

/// The slot and publication a WAL relay reads.
#[derive(Debug, Clone)]
pub struct WalSource {
    /// The database URL, for the replication session (it must not ask for TLS).
    pub database_url: String,
    pub slot: String,
    pub publication: String,
}

/// Fence positions remembered per aggregate before the map is cleared (a miss only asks the stream).
const FENCES_KEPT: usize = 200_000;
/// How often aggregates handed over to polling are drained and looked at again.
const HANDOVER_EVERY: Duration = Duration::from_secs(5);
/// While the stream is delivering rows (a transaction being read, a mark running), the look for
/// overdue rows, and the polling pass it starts, are put off by this much at a time, for at most
/// [`PASS_PUT_OFF_AT_MOST`] in all. The rows being delivered are committed and due: the rows of a
/// bulk import open longer than [`crate::config::UNDELIVERED_AFTER`] look overdue the moment it
/// commits, and a pass would claim and publish them beside the stream (the dedupe absorbed the
/// copies), with the stream waiting for the pass meanwhile. The bound keeps a steadily busy stream
/// from putting the pass off for good: rows made due by an update (a repair, a replayed dead row)
/// are in no replication message, and only a pass delivers them. Aggregates handed over to polling
/// are not put off.
const PASS_PUT_OFF_BY: Duration = Duration::from_secs(1);
const PASS_PUT_OFF_AT_MOST: Duration = Duration::from_secs(30);
/// Publishes of an aggregate's row in the stream before polling takes the aggregate over (while the
/// broker is connected; while it is not, the stream waits for it).
const IN_STREAM_ATTEMPTS: i32 = 2;
/// Marks of a delivered row its statement cannot see yet, and the pause after the first (doubling
/// each time): together about a second, far more than a commit normally takes to become visible
/// after its WAL is flushed — microseconds, but a relay at low load meets that moment often: with
/// pauses of 10, 20, 30… ms, commit to mark at 1,000 events/s was p50 8.5 / p99 58.6 ms; with 1, 2,
/// 4… ms, 4.8 / 15.4 (`waybill bench --quick --only sources`, one run each).
const UNSEEN_MARKS: u32 = 10;
const UNSEEN_PAUSE: Duration = Duration::from_millis(1);
/// The bodies' bytes at which an open transaction's rows read so far are handed out to be published.
const PART_BYTES: usize = 4 << 20;
/// Replication messages the client reads ahead of the relay: each row, Begin, Commit, relation and
/// keepalive (of transactions without outbox rows too) is one. Counted in messages, not bytes: rows
/// of 256 KB make it 64 MB.
const READ_AHEAD: usize = 256;
/// How often the slot's lag is read into the metrics.
const LAG_EVERY: Duration = Duration::from_secs(5);

/// Why an aggregate goes to polling: the `reason` of `waybill_relay_wal_handovers_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HandOver {
    /// An earlier version of it is unsent in the outbox.
    UnsentPredecessor,
    /// The stream no longer holds the version this session published before.
    FenceMoved,
    /// The fence found the stream disagreeing with the store.
    Diverged,
    /// Publishing failed [`IN_STREAM_ATTEMPTS`] times with the broker connected.
    Failing,
    /// A delivered row's transaction was still not visible to its mark.
    Unseen,
}

impl HandOver {
    fn as_str(self) -> &'static str {
        match self {
            Self::UnsentPredecessor => "unsent_predecessor",
            Self::FenceMoved => "fence_moved",
            Self::Diverged => "diverged",
            Self::Failing => "failing",
            Self::Unseen => "unseen",
        }
    }
}

/// How a streaming session ended.
enum Ended {
    /// Shutdown was asked for.
    Stopped,
    /// Another relay reads the slot: this one is a standby.
    SlotBusy(String),
    /// The slot was invalidated (or dropped): a new one is made, after a polling drain.
    SlotGone(String),
}

impl Relay {
    /// Relays from the WAL until `shutdown` resolves. A second relay started on the same slot waits as
    /// a standby and takes over when the first one's session ends.
    pub async fn run_wal(
        &self,
        source: &WalSource,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<RunSummary> {
        slot::check_name("slot", &source.slot)?;
        slot::check_name("publication", &source.publication)?;
        // Refused now, not at the first session: a URL the replication session cannot follow.
        slot::replication_config(&source.database_url, &source.slot, &source.publication)?;
        let relay_id = &self.config().relay_id;
        if !crate::config::relay_id_kept_whole(relay_id) {
            tracing::warn!(
                relay_id,
                kept = crate::config::RELAY_ID_KEPT,
                "PostgreSQL does not keep this relay id whole in the session's application_name \
                 (over the bytes kept, or outside printable ASCII): a polling standby cannot tell \
                 this relay's marks, and claims beside it 5 s after rows look overdue (a bulk import \
                 is then published twice, the copies deduplicated)"
            );
        }
        slot::refuse_what_is_missing(
            self.pool(),
            &source.database_url,
            &source.slot,
            &source.publication,
        )
        .await?;
        metrics::describe();
        let stopping = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(tokio::sync::Notify::new());
        let stopper = {
            let (stopping, stop) = (stopping.clone(), stop.clone());
            tokio::spawn(async move {
                shutdown.await;
                stopping.store(true, Ordering::Relaxed);
                stop.notify_waiters();
            })
        };
        let lag = tokio::spawn(watch_lag(self.pool().clone(), source.slot.clone()));
        // The outbox gauges and the retention sweep, as a polling relay runs them.
        let chores = crate::run::Chores::start(self.pool(), self.config());
        let mut summary = RunSummary::default();
        let mut failures = 0u32;
        let mut standby_since: Option<Instant> = None;
        // The confirmed position at which streaming sessions failed, and how many in a row.
        let mut stuck: (Option<u64>, u32) = (None, 0);
        while !stopping.load(Ordering::Relaxed) {
            let mut streamed = false;
            let ended = self
                .stream_session(source, &stopping, &stop, &mut summary, &mut streamed)
                .await;
            if streamed {
                // It read the slot: whatever ended it, the next one starts afresh.
                failures = 0;
                standby_since = None;
            }
            let pause = match ended {
                Ok(Ended::Stopped) => break,
                // A session that streamed and ended (the slot taken away, an error after a while) or
                // that found the slot busy is not a failure in a row: back off from scratch.
                Ok(Ended::SlotBusy(reason)) => {
                    failures = 0;
                    if standby_since.is_none() {
                        tracing::info!(slot = %source.slot, %reason, "another relay reads the slot; standing by");
                    }
                    standby_since.get_or_insert_with(Instant::now);
                    Duration::from_secs(1)
                }
                Ok(Ended::SlotGone(reason)) => {
                    failures = 0;
                    standby_since = None;
                    tracing::warn!(slot = %source.slot, %reason, "the slot cannot be read; dropping it and starting again from the outbox");
                    if let Err(error) = slot::drop_slot(self.pool(), &source.slot).await {
                        tracing::warn!(error = %error_chain(&error), "dropping the slot failed");
                    }
                    Duration::ZERO
                }
                Err(error) => {
                    failures += 1;
                    tracing::error!(error = %error_chain(error.as_ref()), "WAL session failed; starting again");
                    // pgoutput looks the publication up as of each change: after one was dropped
                    // and made again, every session fails at the first change written meanwhile,
                    // and so it does at a row written while the publication left out a column.
                    // Sessions that stream and fail at the same position, with the publication
                    // there, have the slot made again after a drain, which delivers those rows.
                    let position = slot::confirmed_position(self.pool(), &source.slot)
                        .await
                        .ok()
                        .flatten();
                    stuck = match stuck {
                        (at, sessions) if streamed && position.is_some() && at == position => {
                            (at, sessions + 1)
                        }
                        _ => (position, u32::from(streamed)),
                    };
                    if stuck.1 >= STUCK_SESSIONS
                        && slot::publication_exists(self.pool(), &source.publication)
                            .await
                            .unwrap_or(false)
                    {
                        tracing::warn!(slot = %source.slot, sessions = stuck.1, "every session fails at the slot's position; dropping it and starting again from the outbox");
                        if let Err(error) = slot::drop_slot(self.pool(), &source.slot).await {
                            tracing::warn!(error = %error_chain(&error), "dropping the slot failed");
                        }
                        stuck = (None, 0);
                        continue;
                    }
                    Duration::from_millis(250) * 2u32.pow(failures.min(6))
                }
            };
            if pause.is_zero() {
                continue;
            }
            tokio::select! {
                _ = tokio::time::sleep(pause) => {}
                _ = stop.notified() => {}
            }
        }
        lag.abort();
        drop(chores);
        stopper.abort();
        tracing::info!(?summary, "relay stopped");
        Ok(summary)
    }

    /// One replication session: the slot made if missing, a polling drain, then the stream until
    /// shutdown or an error.
    async fn stream_session(
        &self,
        source: &WalSource,
        stopping: &Arc<AtomicBool>,
        stop: &tokio::sync::Notify,
        summary: &mut RunSummary,
        streamed: &mut bool,
    ) -> anyhow::Result<Ended> {
        // A session without NATS could publish nothing, and an open one holds up PostgreSQL's
        // shutdown (it waits for every reader to confirm what it was sent): none until NATS is back.
        if self.client().connection_state() != State::Connected {
            tracing::warn!("NATS is disconnected; no replication session until it is back");
            while self.client().connection_state() != State::Connected {
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(250)) => {}
                    _ = stop.notified() => return Ok(Ended::Stopped),
                }
                if stopping.load(Ordering::Relaxed) {
                    return Ok(Ended::Stopped);
                }
            }
            tracing::info!("NATS is back; opening a replication session");
        }
        match slot::slot_state(self.pool(), &source.slot).await? {
            Some(state) if !state.in_this_database => {
                anyhow::bail!(
                    "slot {} belongs to database {}: slot names are shared by the whole server; give \
                     this database's relays a slot of their own (--slot)",
                    source.slot,
                    state
                        .database
                        .as_deref()
                        .unwrap_or("none (a physical slot)")
                );
            }
            Some(state) if state.active => {
                return Ok(Ended::SlotBusy(format!(
                    "read by pid {}",
                    state.active_pid.unwrap_or_default()
                )));
            }
            Some(state) if state.wal_status.as_deref() == Some("lost") => {
                return Ok(Ended::SlotGone("invalidated (wal_status lost)".to_owned()));
            }
            Some(_) => {}
            None => {
                if slot::create_slot(self.pool(), &source.slot).await? {
                    tracing::info!(slot = %source.slot, "replication slot created");
                }
            }
        }
        // Everything unsent now is delivered by polling; what commits from here on is in the slot.
        let drained = self.drain().await?;
        add(summary, &drained);
        if drained.published > 0 {
            tracing::info!(
                published = drained.published,
                "drained the outbox before streaming"
            );
        }
        // What the slot replays up to here was committed before the drain ended: some of it is sent.
        let drained_through = slot::current_position(self.pool()).await?;
        let confirmed = slot::confirmed_position(self.pool(), &source.slot)
            .await?
            .unwrap_or(0);
        let outbox_schema = slot::outbox_schema(self.pool()).await?;
        let mut replication =
            slot::replication_config(&source.database_url, &source.slot, &source.publication)?;
        replication.config = replication
            .config
            .with_start_lsn(Lsn::from_u64(confirmed))
            .with_status_interval(Duration::from_secs(1))
            // The crate's default read-ahead (8,192) held 43 MB of rows of 5 KB.
            .with_buffer_size(READ_AHEAD)
            // Named like the relay's other sessions: operators and the bench find its walsender.
            .with_application_name(format!(
                "{}{}",
                crate::config::APPLICATION_PREFIX,
                self.config().relay_id
            ));
        let mut client = replication.connect().await?;
        if let Err(error) = client.wait_started().await {
            return classify(self.pool(), source, error).await;
        }
        tracing::info!(slot = %source.slot, from = %Lsn::from_u64(confirmed), "streaming the outbox from the WAL");
        *streamed = true;
        let mut session = Session {
            relay: self,
            ledger: Ledger::starting_at(confirmed),
            relations: Relations::default(),
            outbox_schema,
            fences: HashMap::new(),
            handed_over: HashSet::new(),
            open: None,
            open_rows: Vec::new(),
            open_bytes: 0,
            part_rows: usize::try_from(self.config().max_rows.max(1)).unwrap_or(usize::MAX),
            batch: Vec::new(),
            batch_rows: 0,
            batch_bytes: 0,
            drained_through,
            replay_skipped: 0,
            marking: None,
            stopping: stopping.clone(),
        };
        let mut last_handover = Instant::now();
        // When the pass now put off first came due.
        let mut put_off_since: Option<Instant> = None;
        let ended = 'session: loop {
            // Checked first: a stop that came while no `stop.notified()` was waiting (the timer's
            // pass below runs without one) must not wait for the next replication message.
            if stopping.load(Ordering::Relaxed) {
                break Ended::Stopped;
            }
            // Aggregates handed over to polling, and rows the slot does not carry, are looked at on
            // a timer, not after a replication message: an idle outbox sends none but keepalives,
            // which a server sends only when half its `wal_sender_timeout` (60 s by default) passes
            // without a reply. On a busy stream the timer still fires: `select!` picks among ready
            // branches at random.
            let hand_back_at = tokio::time::Instant::from_std(last_handover + HANDOVER_EVERY);
            let event = tokio::select! {
                event = client.recv() => event,
                marked = session.marked() => {
                    // Nothing new arrived before the last mark ended: confirm what it completed.
                    session.settle(marked?, summary);
                    client.update_applied_lsn(Lsn::from_u64(session.ledger.confirmable()));
                    continue;
                }
                () = tokio::time::sleep_until(hand_back_at) => {
                    // Aggregates handed over wait for no one; a look for overdue rows waits
                    // while the stream is delivering (see `PASS_PUT_OFF_BY`).
                    let put_off_for = put_off_since.get_or_insert_with(Instant::now).elapsed();
                    if session.handed_over.is_empty()
                        && session.delivering()
                        && put_off_for < PASS_PUT_OFF_AT_MOST
                    {
                        last_handover = Instant::now()
                            .checked_sub(HANDOVER_EVERY - PASS_PUT_OFF_BY)
                            .unwrap_or_else(Instant::now);
                        continue;
                    }
                    put_off_since = None;
                    if session.handed_over.is_empty() && !undelivered_heads(self.pool()).await {
                        last_handover = Instant::now();
                        continue;
                    }
                    if stopping.load(Ordering::Relaxed) {
                        break Ended::Stopped;
                    }
                    session.finish_mark(summary).await?;
                    session.hand_back(summary).await?;
                    // Counted from the pass's end: the stream gets its time between passes.
                    last_handover = Instant::now();
                    client.update_applied_lsn(Lsn::from_u64(session.ledger.confirmable()));
                    continue;
                }
                _ = stop.notified() => break Ended::Stopped,
            };
            let event = match event {
                Ok(Some(event)) => event,
                Ok(None) => break Ended::SlotGone("the server ended the stream".to_owned()),
                Err(error) => break classify(self.pool(), source, error).await?,
            };
            if let Err(error) = session.read(event) {
                break unreadable(error)?;
            }
            // Publish when nothing more is waiting, or the batch is full; what arrives meanwhile
            // waits in the replication client's buffer.
            let mut full = session.batch_full();
            while !full {
                match client.recv().now_or_never() {
                    Some(Ok(Some(event))) => {
                        if let Err(error) = session.read(event) {
                            break 'session unreadable(error)?;
                        }
                        full = session.batch_full();
                    }
                    Some(Ok(None)) | None => break,
                    Some(Err(error)) => {
                        break 'session classify(self.pool(), source, error).await?;
                    }
                }
            }
            if !session.batch.is_empty() {
                session.deliver(summary).await?;
            }
            client.update_applied_lsn(Lsn::from_u64(session.ledger.confirmable()));
            if stopping.load(Ordering::Relaxed) {
                break Ended::Stopped;
            }
        };
        // What the last mark completes is confirmed too (a failed mark confirms nothing).
        if let Err(error) = session.finish_mark(summary).await {
            tracing::warn!(error = %error_chain(error.as_ref()), "the last mark failed; its rows are read again");
        }
        // The client sends positions once per status interval and not when it stops: wait (a
        // little longer than the interval, at most) until the last one has been sent, so that the
        // next session does not replay what this one delivered.
        let last = Lsn::from_u64(session.ledger.confirmable());
        client.update_applied_lsn(last);
        let metrics = client.metrics();
        let deadline = Instant::now() + Duration::from_millis(1_500);
        while metrics.last_applied_lsn() < last && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if let Err(error) = client.shutdown().await {
            tracing::debug!(error = %error, "closing the replication session");
        }
        Ok(ended)
    }
}

/// Why a replication session failed, told from the slot's state rather than from the error's text
/// (the replication client carries the SQLSTATE only inside its message): another session reads the
/// slot, or it was dropped or invalidated — or neither, and the failure is the error.
async fn classify(
    pool: &sqlx::PgPool,
    source: &WalSource,
    error: pgwire_replication::PgWireError,
) -> anyhow::Result<Ended> {
    match slot::slot_state(pool, &source.slot).await? {
        None => Ok(Ended::SlotGone(format!("dropped ({error})"))),
        Some(state) if !state.in_this_database => Err(error.into()),
        Some(state) if state.wal_status.as_deref() == Some("lost") => {
            Ok(Ended::SlotGone(format!("invalidated ({error})")))
        }
        Some(state) if state.active => Ok(Ended::SlotBusy(format!(
            "read by pid {}",
            state.active_pid.unwrap_or_default()
        ))),
        Some(_) => Err(error.into()),
    }
}

/// A session's end at a change it cannot read. A row the slot carries that this relay cannot read
/// (written while the publication left out a column, say) would stop every later session at the
/// same place: the slot is made again after a drain, which delivers that row by polling.
fn unreadable(error: anyhow::Error) -> anyhow::Result<Ended> {
    match error.downcast_ref::<DecodeError>() {
        Some(DecodeError::Row(reason)) => Ok(Ended::SlotGone(format!(
            "a row it carries cannot be read: {reason}"
        ))),
        _ => Err(error),
    }
}

fn add(summary: &mut RunSummary, other: &RunSummary) {
    summary.claimed += other.claimed;
    summary.published += other.published;
    summary.duplicates += other.duplicates;
    summary.fenced += other.fenced;
    summary.divergences += other.divergences;
    summary.marked_sent += other.marked_sent;
    summary.failed += other.failed;
    summary.dead += other.dead;
    summary.steps += other.steps;
}

/// Streaming sessions failing in a row at one position before the slot is made again.
const STUCK_SESSIONS: u32 = 3;

/// How long a batch waits for NATS with the replication session open.
const BROKER_AWAY: Duration = Duration::from_secs(10);

/// A streaming session's state.
struct Session<'a> {
    relay: &'a Relay,
    ledger: Ledger,
    relations: Relations,
    /// The schema of the outbox this relay delivers: another schema's `outbox` is not its own.
    outbox_schema: String,
    /// Each aggregate's last delivered version and its stream sequence: the next version's fence.
    fences: HashMap<Uuid, (i64, u64)>,
    /// Aggregates whose rows polling delivers for now.
    handed_over: HashSet<Uuid>,
    /// The transaction being read — its ticket, and whether it committed before the opening drain
    /// ended — and its rows not yet handed to the batch.
    open: Option<(Ticket, bool)>,
    open_rows: Vec<ClaimedRow>,
    /// The bodies' bytes in `open_rows`.
    open_bytes: usize,
    /// Rows of an open transaction handed to the batch at a time, and the rows at which a batch is
    /// published (`--max-rows`), or fewer once their bodies reach [`PART_BYTES`]: a large
    /// transaction is published in parts as it arrives (the server sends it only once committed),
    /// not held whole in memory. A batch may hold up to twice as many: rows of small transactions,
    /// then a part.
    part_rows: usize,
    /// Rows read and not yet delivered — each transaction's, or each part of a large one's — with
    /// whether their transaction committed before the session's opening drain ended (a replay: its
    /// rows may be sent already).
    batch: Vec<(Ticket, Vec<ClaimedRow>, bool)>,
    /// The rows in `batch`, and their bodies' bytes.
    batch_rows: usize,
    batch_bytes: usize,
    /// The server's WAL position when the opening drain ended.
    drained_through: u64,
    /// Replayed rows found sent and not published again, this session.
    replay_skipped: u64,
    /// The mark of the last delivered rows, running while the next batch is published.
    marking: Option<JoinHandle<anyhow::Result<Marked>>>,
    stopping: Arc<AtomicBool>,
}

/// A row in the stream waiting for its mark.
#[derive(Debug, Clone, Copy)]
struct Delivered {
    id: i64,
    sequence: i64,
    aggregate: Uuid,
    ticket: Ticket,
}

/// What a mark did.
#[derive(Debug, Default)]
struct Marked {
    /// Rows marked sent (not counting those already sent).
    marked: u64,
    /// Rows marked or found sent: done.
    seen: Vec<Ticket>,
    /// Rows still not visible after every try.
    unseen: Vec<Delivered>,
}

impl Session<'_> {
    /// Whether the batch is to be published now, more waiting or not: it holds `--max-rows` rows,
    /// or [`PART_BYTES`] of bodies (a few large rows).
    fn batch_full(&self) -> bool {
        self.batch_rows >= self.part_rows || self.batch_bytes >= PART_BYTES
    }

    /// Takes one replication event into the ledger and the batch.
    fn read(&mut self, event: ReplicationEvent) -> anyhow::Result<()> {
        match event {
            ReplicationEvent::Begin { final_lsn, .. } => {
                // Never without streaming of in-progress transactions, which the relay does not ask
                // for; the open one's ticket would hold the position back for good.
                anyhow::ensure!(
                    self.open.is_none(),
                    "the server sent a Begin inside a transaction"
                );
                // `final_lsn` is where its commit record starts, before the commit's end that the
                // position is confirmed at: a commit straddling the drain's end counts as replayed,
                // which only costs a look at the outbox.
                let replayed = final_lsn.as_u64() <= self.drained_through;
                self.open = Some((self.ledger.begin(), replayed));
                self.open_rows.clear();
                self.open_bytes = 0;
            }
            ReplicationEvent::XLogData { data, .. } => match decode(&data)? {
                Change::Relation(relation) => self.relations.describe(relation),
                Change::Insert { relation, values } => {
                    let insert = self.relations.outbox_insert(
                        &self.outbox_schema,
                        store::outbox::TABLE,
                        relation,
                        &values,
                    )?;
                    // Rows written as anything but pending (fixtures, restores) are not new events.
                    if let Some(insert) = insert.filter(|i| i.status == "pending") {
                        anyhow::ensure!(
                            self.open.is_some(),
                            "the server sent an outbox row outside a transaction"
                        );
                        self.open_bytes += insert.row.body.len();
                        self.open_rows.push(insert.row);
                        if self.open_rows.len() >= self.part_rows || self.open_bytes >= PART_BYTES {
                            self.hand_out_open_rows();
                        }
                    }
                }
                Change::Skipped(_) => {}
            },
            ReplicationEvent::Commit { end_lsn, .. } => {
                let Some((ticket, _)) = self.open else {
                    anyhow::bail!("the server sent a Commit without its Begin");
                };
                self.hand_out_open_rows();
                self.open = None;
                let end = end_lsn.as_u64();
                self.ledger.commit(ticket, end);
                if end > self.drained_through && self.drained_through > 0 {
                    if self.replay_skipped > 0 {
                        tracing::info!(
                            rows = self.replay_skipped,
                            "the slot's replay of rows delivered before streaming is over; they were not published again"
                        );
                    }
                    // Once past, every later commit is new.
                    self.drained_through = 0;
                }
            }
            ReplicationEvent::KeepAlive { wal_end, .. } => self.ledger.keepalive(wal_end.as_u64()),
            ReplicationEvent::Message { .. } | ReplicationEvent::StoppedAt { .. } => {}
        }
        Ok(())
    }

    /// Hands the open transaction's rows read so far to the batch.
    fn hand_out_open_rows(&mut self) {
        let Some((ticket, replayed)) = self.open else {
            return;
        };
        if self.open_rows.is_empty() {
            return;
        }
        let rows = std::mem::take(&mut self.open_rows);
        self.batch_bytes += std::mem::take(&mut self.open_bytes);
        self.batch_rows += rows.len();
        self.ledger.hand_out(ticket, rows.len());
        self.batch.push((ticket, rows, replayed));
    }

    /// Publishes the batch — each aggregate's rows as one chain, in commit order — retrying what fails
    /// with the relay's backoff, marks what was delivered, and moves the ledger. An aggregate whose
    /// row fails `max_attempts` times is handed over to polling with its unsent rows.
    async fn deliver(&mut self, summary: &mut RunSummary) -> anyhow::Result<()> {
        let batch = std::mem::take(&mut self.batch);
        self.batch_bytes = 0;
        self.batch_rows = 0;
        let sent = self.sent_already(&batch).await?;
        let mut tickets: HashMap<i64, Ticket> = HashMap::new();
        let mut chains: Vec<Vec<ClaimedRow>> = Vec::new();
        let mut chain_of: HashMap<Uuid, usize> = HashMap::new();
        for (ticket, rows, _) in batch {
            for row in rows {
                if sent.contains(&row.id) {
                    // Delivered since it was written (by the opening drain, mostly): done.
                    self.ledger.done(ticket, 1);
                    continue;
                }
                tickets.insert(row.id, ticket);
                if self.handed_over.contains(&row.aggregate_id) {
                    // Polling delivers it, after the rows before it.
                    self.ledger.done(ticket, 1);
                    continue;
                }
                let chain = *chain_of.entry(row.aggregate_id).or_insert_with(|| {
                    chains.push(Vec::new());
                    chains.len() - 1
                });
                chains[chain].push(row);
            }
        }
        let mut chains = self.hold_back_behind_unsent(chains, &tickets).await?;
        let mut failures = 0i32;
        let mut rng = rand::rng();
        while !chains.is_empty() {
            for chain in &mut chains {
                let head = &mut chain[0];
                head.previous_sequence = if head.aggregate_version == 1 {
                    Some(0)
                } else {
                    self.fences
                        .get(&head.aggregate_id)
                        .filter(|(version, _)| *version == head.aggregate_version - 1)
                        .and_then(|(_, sequence)| i64::try_from(*sequence).ok())
                };
            }
            let config = self.relay.config();
            let deadline = Instant::now() + config.effective_step_deadline();
            let outcomes = publish_runs(
                self.relay.jetstream(),
                &config.stream.name,
                &config.stream.subject_prefix,
                &chains,
                config.max_in_flight,
                deadline,
                &self.stopping,
                config.faults(),
                // Its fences are this session's memory: a subject that moved past one is for polling
                // to judge, in the outbox's order.
                OnRefusal::Return,
            )
            .await;
            let before = summary.clone();
            let mut diverged: HashMap<Uuid, HandOver> = HashMap::new();
            let mut delivered = Vec::new();
            let mut left: Vec<Vec<ClaimedRow>> = Vec::new();
            let now = chrono::Utc::now();
            for (chain, outcomes) in chains.into_iter().zip(outcomes) {
                let mut rest = Vec::new();
                for (row, outcome) in chain.into_iter().zip(outcomes) {
                    match outcome {
                        Outcome::Sent {
                            sequence,
                            duplicate,
                            fenced,
                            latency,
                        } if rest.is_empty() => {
                            summary.published += 1;
                            summary.duplicates += u64::from(duplicate);
                            summary.fenced += u64::from(fenced);
                            let commit_to_ack = (now - row.created_at).to_std().unwrap_or_default();
                            metrics::record_ack(latency, commit_to_ack.max(latency));
                            self.fences
                                .insert(row.aggregate_id, (row.aggregate_version, sequence));
                            if let Some(&ticket) = tickets.get(&row.id) {
                                delivered.push(Delivered {
                                    id: row.id,
                                    sequence: i64::try_from(sequence).unwrap_or(i64::MAX),
                                    aggregate: row.aggregate_id,
                                    ticket,
                                });
                            }
                        }
                        Outcome::Failed {
                            error,
                            divergence,
                            fence_moved,
                            ..
                        } if rest.is_empty() => {
                            // A moved fence is a hand-over, not a failed publish: nothing was sent.
                            summary.failed += u64::from(!fence_moved);
                            if fence_moved {
                                // The stream lost the version this session published before this
                                // one (`outbox repair` may have rewound it): forget the fence, and
                                // let polling deliver the aggregate from the outbox, in its order.
                                tracing::warn!(event_id = %row.event_id, aggregate_id = %row.aggregate_id, error, "the stream no longer holds the version this session published before this one; polling delivers this aggregate for now");
                                self.fences.remove(&row.aggregate_id);
                                diverged.insert(row.aggregate_id, HandOver::FenceMoved);
                            } else if let Some(divergence) = divergence {
                                // The stream disagrees with the store about this aggregate: no retry
                                // here will change that, and the other aggregates must not wait for
                                // it. Polling records the divergence on the row, retries with backoff
                                // and shows it to operators.
                                summary.divergences += 1;
                                metrics::record_divergence(divergence.kind);
                                tracing::warn!(event_id = %row.event_id, aggregate_id = %row.aggregate_id, error, "the stream disagrees with the store; polling delivers this aggregate for now");
                                diverged.insert(row.aggregate_id, HandOver::Diverged);
                            } else {
                                tracing::warn!(event_id = %row.event_id, aggregate_id = %row.aggregate_id, error, "publish failed; retrying");
                            }
                            rest.push(row);
                        }
                        _ => rest.push(row),
                    }
                }
                if !rest.is_empty() {
                    left.push(rest);
                }
            }
            metrics::record_wal_publishes(
                summary.published - before.published,
                summary.duplicates - before.duplicates,
                summary.fenced - before.fenced,
                summary.failed - before.failed,
            );
            if self.fences.len() > FENCES_KEPT {
                // Forget all but this batch's: once the running mark has ended, theirs are the only
                // delivered rows not yet marked, and without their fences the next batch's check
                // would find them unsent and hand the aggregates after them to polling.
                self.finish_mark(summary).await?;
                let kept: HashMap<Uuid, (i64, u64)> = delivered
                    .iter()
                    .filter_map(|row| Some((row.aggregate, *self.fences.get(&row.aggregate)?)))
                    .collect();
                self.fences = kept;
            }
            if !delivered.is_empty() {
                self.mark(delivered, summary).await?;
            }
            let (handed, kept): (Vec<_>, Vec<_>) = left
                .into_iter()
                .partition(|chain| diverged.contains_key(&chain[0].aggregate_id));
            for chain in handed {
                let reason = diverged[&chain[0].aggregate_id];
                self.hand_over(chain, &tickets, reason);
            }
            chains = kept;
            if chains.is_empty() || self.stopping.load(Ordering::Relaxed) {
                // Stopping: what is left is not confirmed, and the next session reads it again.
                break;
            }
            // The broker is away: nothing can be published, so the batch waits for it (as polling
            // relays stop claiming) rather than hand every aggregate over. Not for long with the
            // session open: PostgreSQL's shutdown waits until every reader has confirmed all it was
            // sent, which this one cannot, and a standby claims only once the slot is free.
            if self.relay.client().connection_state() != State::Connected {
                let away = Instant::now();
                while self.relay.client().connection_state() != State::Connected
                    && !self.stopping.load(Ordering::Relaxed)
                {
                    anyhow::ensure!(
                        away.elapsed() < BROKER_AWAY,
                        "NATS has been away for {BROKER_AWAY:?}: the replication session is closed \
                         until it is back (the outbox keeps every row)"
                    );
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
                continue;
            }
            // A failure of some aggregates with the broker there is theirs (a message the broker
            // refuses, a timeout): one quick retry, then polling's retries with backoff and dead rows
            // take them over, and the stream moves on.
            failures += 1;
            if failures >= IN_STREAM_ATTEMPTS {
                for chain in chains.drain(..) {
                    tracing::warn!(aggregate = %chain[0].aggregate_id, rows = chain.len(), attempts = failures, "publishing keeps failing; polling delivers this aggregate for now");
                    self.hand_over(chain, &tickets, HandOver::Failing);
                }
                break;
            }
            tokio::time::sleep(config.backoff.delay(failures, &mut rng)).await;
        }
        summary.steps += 1;
        Ok(())
    }

    /// Of the batch's replayed rows (committed before the opening drain ended), those the outbox has
    /// marked sent. After a relay was down for a while, the slot replays everything written
    /// meanwhile, which the drain has just delivered: publishing it again costs a publish, a fence
    /// refusal and a read of the subject per event (the dedupe window is long past) while new events
    /// wait behind it. A row marked sent is in the stream as far as every relay is concerned (polling
    /// trusts the mark the same way). One statement per batch, during the replay only.
    async fn sent_already(
        &mut self,
        batch: &[(Ticket, Vec<ClaimedRow>, bool)],
    ) -> anyhow::Result<HashSet<i64>> {
        let replayed: Vec<i64> = batch
            .iter()
            .filter(|(_, _, replayed)| *replayed)
            .flat_map(|(_, rows, _)| rows.iter().map(|row| row.id))
            .collect();
        if replayed.is_empty() {
            return Ok(HashSet::new());
        }
        let sent: HashSet<i64> = store::outbox::relaying::sent_among(self.relay.pool(), &replayed)
            .await?
            .into_iter()
            .collect();
        self.replay_skipped += sent.len() as u64;
        Ok(sent)
    }

    /// Hands over to polling every chain whose first row's predecessor is unsent in the outbox, and
    /// returns the others. The slot carries inserts only: an earlier version of the aggregate that
    /// is dead, failing, or made due again by an update (`dead replay`, `outbox repair`) is in no
    /// replication message, and the fence would let this later version follow the stream's last one
    /// — after which the earlier one could never be delivered in its place. Polling claims an
    /// aggregate's rows in order, so it delivers both, once the earlier one can go. Only chains whose
    /// predecessor this session did not publish itself are looked up: one statement per batch, and
    /// none on a busy stream whose aggregates it already knows.
    async fn hold_back_behind_unsent(
        &mut self,
        chains: Vec<Vec<ClaimedRow>>,
        tickets: &HashMap<i64, Ticket>,
    ) -> anyhow::Result<Vec<Vec<ClaimedRow>>> {
        let unknown: Vec<(Uuid, i64)> = chains
            .iter()
            .map(|chain| &chain[0])
            .filter(|head| {
                head.aggregate_version > 1
                    && self
                        .fences
                        .get(&head.aggregate_id)
                        .is_none_or(|(version, _)| *version != head.aggregate_version - 1)
            })
            .map(|head| (head.aggregate_id, head.aggregate_version))
            .collect();
        if unknown.is_empty() {
            return Ok(chains);
        }
        let behind: HashSet<Uuid> =
            store::outbox::relaying::unsent_predecessors(self.relay.pool(), &unknown)
                .await?
                .into_iter()
                .collect();
        if behind.is_empty() {
            return Ok(chains);
        }
        let (held, free): (Vec<_>, Vec<_>) = chains
            .into_iter()
            .partition(|chain| behind.contains(&chain[0].aggregate_id));
        for chain in held {
            tracing::info!(aggregate = %chain[0].aggregate_id, version = chain[0].aggregate_version, rows = chain.len(), "an earlier version of this aggregate is unsent in the outbox; polling delivers it and these in order");
            self.hand_over(chain, tickets, HandOver::UnsentPredecessor);
        }
        Ok(free)
    }

    /// Starts marking the `delivered` rows sent, once the mark before has ended: the batch after
    /// them is published meanwhile, and their positions are confirmed when [`Session::settle`] counts
    /// them done.
    async fn mark(
        &mut self,
        delivered: Vec<Delivered>,
        summary: &mut RunSummary,
    ) -> anyhow::Result<()> {
        self.finish_mark(summary).await?;
        let relay = self.relay;
        self.marking = Some(tokio::spawn(mark_visible(
            relay.pool().clone(),
            relay.config().relay_id.clone(),
            delivered,
            self.stopping.clone(),
        )));
        Ok(())
    }

    /// The running mark's outcome, when it ends; never, when none runs.
    async fn marked(&mut self) -> anyhow::Result<Marked> {
        let Some(task) = self.marking.as_mut() else {
            return std::future::pending().await;
        };
        let outcome = task.await;
        self.marking = None;
        outcome?
    }

    /// Whether rows read from the stream are on their way: a transaction is being read (its parts
    /// published as they arrive), or a mark runs. (Between replication messages, the batch has
    /// always been published.)
    fn delivering(&self) -> bool {
        self.open.is_some() || self.marking.is_some()
    }

    /// Waits for the running mark, if any, and counts what it did.
    async fn finish_mark(&mut self, summary: &mut RunSummary) -> anyhow::Result<()> {
        if self.marking.is_some() {
            let marked = self.marked().await?;
            self.settle(marked, summary);
        }
        Ok(())
    }

    /// Counts a mark's rows done (and in the summary); one its statement never saw goes to polling
    /// with its aggregate.
    fn settle(&mut self, marked: Marked, summary: &mut RunSummary) {
        summary.marked_sent += marked.marked;
        for ticket in marked.seen {
            self.ledger.done(ticket, 1);
        }
        for row in marked.unseen {
            tracing::warn!(outbox_id = row.id, aggregate = %row.aggregate, "a delivered row's transaction is still not visible; polling marks it once it is");
            if self.handed_over.insert(row.aggregate) {
                metrics::record_wal_handover(HandOver::Unseen.as_str());
            }
            self.ledger.done(row.ticket, 1);
        }
    }

    /// Leaves `chain`'s rows unsent in the outbox for polling to deliver, with every later row of
    /// their aggregate, until [`Session::hand_back`] finds nothing of it unsent.
    fn hand_over(
        &mut self,
        chain: Vec<ClaimedRow>,
        tickets: &HashMap<i64, Ticket>,
        reason: HandOver,
    ) {
        if self.handed_over.insert(chain[0].aggregate_id) {
            metrics::record_wal_handover(reason.as_str());
        }
        for row in &chain {
            if let Some(ticket) = tickets.get(&row.id) {
                self.ledger.done(*ticket, 1);
            }
        }
    }

    /// Delivers what is due in the outbox by one polling pass, for the aggregates handed over, and
    /// takes back those with nothing unsent left. One pass, not a drain: a drain waits up to seconds
    /// for a failing row to come due again, and the replication stream — every other aggregate —
    /// would wait with it; the next pass comes [`HANDOVER_EVERY`] later.
    async fn hand_back(&mut self, summary: &mut RunSummary) -> anyhow::Result<()> {
        let drained = self.relay.pass().await?;
        add(summary, &drained);
        let aggregates: Vec<Uuid> = self.handed_over.iter().copied().collect();
        let first_unsent: HashMap<Uuid, String> =
            store::outbox::relaying::first_unsent(self.relay.pool(), &aggregates)
                .await?
                .into_iter()
                .collect();
        for aggregate in aggregates {
            let waits = match first_unsent.get(&aggregate).map(String::as_str) {
                None => "all delivered",
                // Nothing moves until an operator replays the dead row; keeping the aggregate would
                // keep a pass running every 5 s meanwhile. A new version of it is held back by the
                // look at the outbox, and the replayed row is delivered once it has waited 10 s.
                Some("dead") => "the rest waits behind a dead row",
                Some(_) => continue,
            };
            self.handed_over.remove(&aggregate);
            // Its fence is the stream's now: forget ours.
            self.fences.remove(&aggregate);
            tracing::info!(%aggregate, "{waits}; streaming this aggregate again");
        }
        Ok(())
    }
}

/// Whether an aggregate's next row has waited [`crate::config::UNDELIVERED_AFTER`] with nobody
/// delivering it: made due by an update (a dead row replayed, `outbox repair`) or left failing by the opening
/// drain, it is in no replication message, so a polling pass must deliver it. A look that fails or
/// does not answer within 5 s says no: the next tick looks again, and the stream goes on meanwhile.
async fn undelivered_heads(pool: &sqlx::PgPool) -> bool {
    let look =
        store::outbox::admin::any_head_due_for_longer_than(pool, crate::config::UNDELIVERED_AFTER);
    match tokio::time::timeout(Duration::from_secs(5), look).await {
        Ok(Ok(due)) => {
            if due {
                tracing::info!(after = ?crate::config::UNDELIVERED_AFTER, "an outbox row has been due that long with nobody delivering it (not in the slot, or not read from it yet); a polling pass delivers it");
            }
            due
        }
        Ok(Err(error)) => {
            tracing::warn!(error = %error_chain(&error), "cannot look for outbox rows the slot does not carry; looking again in 5 s");
            false
        }
        Err(_) => {
            tracing::warn!(
                "no answer within 5 s looking for outbox rows the slot does not carry; looking again in 5 s"
            );
            false
        }
    }
}

/// Marks `delivered` rows sent, by id. A row can reach the WAL, and so this relay, before its
/// transaction is visible to other sessions: PostgreSQL flushes the commit record, which the
/// walsender decodes at once, before it ends the transaction for everyone else. The mark cannot see
/// such a row, and counting it done unmarked would confirm its position with the row left pending for
/// good; so it is marked again for a moment. One still unseen after that (a synchronous standby that
/// does not answer, or a row purged meanwhile) is returned, and goes to polling with its aggregate as
/// a failing one does: the next polling pass marks it if it can see it by then, and the next
/// session's drain if not. Stopping ends the tries: a row left unmarked is not confirmed, and the
/// next session reads it again.
async fn mark_visible(
    pool: sqlx::PgPool,
    relay_id: String,
    mut delivered: Vec<Delivered>,
    stopping: Arc<AtomicBool>,
) -> anyhow::Result<Marked> {
    let mut outcome = Marked::default();
    for round in 1..=UNSEEN_MARKS {
        let (ids, sequences): (Vec<i64>, Vec<i64>) =
            delivered.iter().map(|row| (row.id, row.sequence)).unzip();
        let marked =
            store::outbox::relaying::mark_delivered(&pool, &relay_id, &ids, &sequences).await?;
        outcome.marked += marked.marked;
        let unseen: HashSet<i64> = marked.unseen.into_iter().collect();
        delivered.retain(|row| {
            let seen = !unseen.contains(&row.id);
            if seen {
                outcome.seen.push(row.ticket);
            }
            !seen
        });
        if delivered.is_empty() || stopping.load(Ordering::Relaxed) {
            return Ok(outcome);
        }
        tokio::time::sleep(UNSEEN_PAUSE * 2u32.pow(round - 1)).await;
    }
    outcome.unseen = delivered;
    Ok(outcome)
}

/// Reads the slot's lag into the metrics every few seconds, and warns while it risks invalidation.
async fn watch_lag(pool: sqlx::PgPool, slot: String) {
    let mut every = tokio::time::interval(LAG_EVERY);
    // Where the slot was last confirmed, and since when: without a reader PostgreSQL measures no
    // lag, and the time the slot has stood still is what an operator needs then.
    let mut confirmed: (Option<u64>, Instant) = (None, Instant::now());
    loop {
        every.tick().await;
        match slot::slot_state(&pool, &slot).await {
            Ok(Some(state)) => {
                let position = slot::confirmed_position(&pool, &slot).await.ok().flatten();
                if position != confirmed.0 {
                    confirmed = (position, Instant::now());
                }
                let lag_seconds = if state.active {
                    state.lag_seconds
                } else {
                    Some(confirmed.1.elapsed().as_secs_f64())
                };
                metrics::record_slot(
                    state.lag_bytes.unwrap_or(0),
                    lag_seconds,
                    state.retained_bytes.unwrap_or(0),
                    state.active,
                    state.safe_wal_size,
                );
                if let Some(left) = state.near_invalidation() {
                    tracing::warn!(%slot, wal_left_bytes = left, max_slot_wal_keep_bytes = state.keep_bytes, lag_bytes = state.lag_bytes, "the slot is near max_slot_wal_keep_size: PostgreSQL invalidates it once that much more WAL is written");
                }
                match state.wal_status.as_deref() {
                    Some("unreserved") => {
                        tracing::warn!(%slot, retained_bytes = state.retained_bytes, "the slot is past max_slot_wal_keep_size and about to be invalidated")
                    }
                    Some("lost") => tracing::error!(%slot, "the slot was invalidated"),
                    _ => {}
                }
            }
            Ok(None) => {}
            Err(error) => tracing::debug!(error = %error_chain(&error), "reading the slot's lag"),
        }
    }
}
