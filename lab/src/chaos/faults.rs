//! The faults: what each kind does to the running system, and when they strike — a schedule drawn from
//! the seed that gives every chosen kind at least one turn, spread over the load between a warm-up and
//! a quiet end.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use rand::Rng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use serde::Serialize;
use sqlx::PgPool;

use super::fleet::{CLAIM_TIMEOUT, DEDUPE_WINDOW, Fleet, Role};
use super::servers::Servers;
use super::watch::Clock;

/// A kind of fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum FaultKind {
    /// SIGKILL a relay, restart it.
    RelayKill,
    /// SIGSTOP a relay past its claim timeout and the dedupe window, then SIGCONT: a zombie.
    RelayPause,
    /// SIGKILL a projection while it applies, restart it.
    ProjectionKill,
    /// SIGKILL nats-server, restart it on the same store a few seconds later.
    NatsRestart,
    /// Immediate-mode stop of PostgreSQL, start again.
    PostgresRestart,
    /// `pg_terminate_backend` of random sessions of the relays and projections.
    PgTerminate,
    /// Garbage, disagreeing ids, events whose predecessors never come and replays of real events,
    /// published straight into the stream.
    HostilePublish,
    /// With `--cluster`: SIGKILL one node of the three-node NATS cluster under load, start it again
    /// after a few seconds (the stream has three replicas, so it stays writable meanwhile).
    NatsNodeKill,
    /// With `--cluster`: SIGSTOP one node for longer than the cluster's election timeout, then
    /// SIGCONT (a VM pause, a stalled process): the others elect new leaders, the node wakes up with
    /// stale state and must catch up without leaving a copy or a gap in the stream.
    NatsNodeFreeze,
    /// With `--cluster`: ask the stream's leader to step down under load
    /// (`$JS.API.STREAM.LEADER.STEPDOWN`), as an operator's maintenance or a rolling upgrade does.
    NatsStepDown,
}

impl FaultKind {
    /// Every kind.
    pub(crate) const ALL: [Self; 7] = [
        Self::RelayKill,
        Self::RelayPause,
        Self::ProjectionKill,
        Self::NatsRestart,
        Self::PostgresRestart,
        Self::PgTerminate,
        Self::HostilePublish,
    ];

    /// Every kind there is: [`FaultKind::ALL`] and the ones that need `--cluster`.
    pub(crate) const KNOWN: [Self; 10] = [
        Self::RelayKill,
        Self::RelayPause,
        Self::ProjectionKill,
        Self::NatsRestart,
        Self::PostgresRestart,
        Self::PgTerminate,
        Self::HostilePublish,
        Self::NatsNodeKill,
        Self::NatsNodeFreeze,
        Self::NatsStepDown,
    ];

    /// The kinds a run strikes by default: all of [`FaultKind::ALL`], and with a NATS cluster also
    /// the cluster's own (a node killed, a node frozen, a leader stepping down).
    pub(crate) fn defaults(cluster: bool) -> Vec<Self> {
        let mut kinds = Self::ALL.to_vec();
        if cluster {
            kinds.extend([Self::NatsNodeKill, Self::NatsNodeFreeze, Self::NatsStepDown]);
        }
        kinds
    }

    /// True for kinds that need `--cluster`.
    pub(crate) fn needs_cluster(self) -> bool {
        matches!(
            self,
            Self::NatsNodeKill | Self::NatsNodeFreeze | Self::NatsStepDown
        )
    }

    /// Its name on the command line and in the report.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::RelayKill => "relay_kill",
            Self::RelayPause => "relay_pause",
            Self::ProjectionKill => "projection_kill",
            Self::NatsRestart => "nats_restart",
            Self::PostgresRestart => "postgres_restart",
            Self::PgTerminate => "pg_terminate",
            Self::HostilePublish => "hostile_publish",
            Self::NatsNodeKill => "nats_node_kill",
            Self::NatsNodeFreeze => "nats_node_freeze",
            Self::NatsStepDown => "nats_step_down",
        }
    }

    /// Parses a name.
    pub(crate) fn parse(text: &str) -> Result<Self, String> {
        Self::KNOWN
            .into_iter()
            .find(|k| k.name() == text.trim())
            .ok_or_else(|| {
                format!(
                    "unknown fault kind {text:?}; the kinds are {}",
                    Self::KNOWN.map(Self::name).join(", ")
                )
            })
    }
}

/// How long a frozen relay stays frozen: until another relay has ended its claim (the claim timeout,
/// or the reaper at 1.1 × it, checking once a second) and republished its rows, and then past the
/// dedupe window, so that what the zombie still sends on waking is stopped by the broker fence alone.
#[allow(
    clippy::cast_possible_truncation,
    reason = "a claim timeout and a dedupe window of seconds, in ms: far below 2^64"
)]
const RELAY_FROZEN: Duration = Duration::from_millis(
    CLAIM_TIMEOUT.as_millis() as u64 * 11 / 10 + 1_000 + DEDUPE_WINDOW.as_millis() as u64 + 2_000,
);
/// How long a frozen relay stays frozen when the relays read the WAL (`wal_sender_timeout` given):
/// the frozen reader's replication session holds the slot until PostgreSQL ends it after that
/// timeout, the standby takes the slot over within a second and replays what the reader had not
/// confirmed — and the reader wakes past the dedupe window after that, so that what it still sends
/// is stopped by the broker fence alone, as a frozen polling relay's is. (Frozen only
/// [`RELAY_FROZEN`], it would wake as the standby takes over.)
pub(super) fn relay_frozen(wal_sender_timeout: Option<Duration>) -> Duration {
    wal_sender_timeout.map_or(RELAY_FROZEN, |timeout| {
        RELAY_FROZEN.max(timeout + Duration::from_secs(1) + DEDUPE_WINDOW + Duration::from_secs(2))
    })
}
/// How long a killed process or server stays down before it is started again.
const PROCESS_DOWN: Duration = Duration::from_secs(1);
const NATS_DOWN: Duration = Duration::from_secs(3);
/// How long a killed node of the NATS cluster stays down: long enough for the stream's and the
/// consumers' leaders on it to move to the other nodes.
const NATS_NODE_DOWN: Duration = Duration::from_secs(5);
/// How long a frozen node of the NATS cluster stays frozen: past the raft election timeout (a few
/// seconds), so that the others elect new leaders for what it led and it wakes up as a stale follower.
const NATS_NODE_FROZEN: Duration = Duration::from_secs(12);
const POSTGRES_DOWN: Duration = Duration::from_secs(2);
/// Faults leave the first part of the run alone (the backlog's normal level is measured there) and
/// the last seconds (so the last fault is over before the load stops).
const WARM_UP: Duration = Duration::from_secs(8);
const QUIET_END: Duration = Duration::from_secs(10);
/// The least time between one fault being over and the next striking, so that each fault's recovery
/// can be seen on its own (recovery is looked for only until the next fault).
const SETTLE: Duration = Duration::from_secs(5);

/// A fault due at a moment.
#[derive(Debug, Clone, Copy)]
pub(super) struct Planned {
    /// When, from the start of the run.
    pub at: Duration,
    pub kind: FaultKind,
}

/// The schedule: every kind once in a shuffled order, then random kinds, one fault per ~12 s of load
/// on average, each at a jittered moment of its own slot.
#[allow(
    clippy::cast_possible_truncation,
    reason = "count is the number of faults in one run: one per ~12 s, a few thousand at most"
)]
pub(super) fn schedule(kinds: &[FaultKind], duration: Duration, seed: u64) -> Vec<Planned> {
    use rand::SeedableRng;
    let mut rng = StdRng::seed_from_u64(seed);
    let count = kinds.len().max((duration.as_secs() / 12) as usize);
    let mut order: Vec<FaultKind> = kinds.to_vec();
    order.shuffle(&mut rng);
    while order.len() < count {
        order.push(kinds[rng.random_range(0..kinds.len())]);
    }
    let start = WARM_UP.min(duration / 5);
    let end = duration
        .saturating_sub(QUIET_END)
        .max(start + Duration::from_secs(1));
    let slot = (end - start) / count as u32;
    order
        .into_iter()
        .enumerate()
        .map(|(i, kind)| Planned {
            at: start + slot * i as u32 + slot.mul_f64(rng.random_range(0.0..0.6)),
            kind,
        })
        .collect()
}

/// One fault as it happened.
#[derive(Debug, Clone, Serialize)]
pub(super) struct Fault {
    /// Its kind.
    pub kind: FaultKind,
    /// Seconds from the start when it struck.
    pub at: f64,
    /// Seconds from the start when it was over (the process restarted, thawed, the server back).
    pub over: f64,
    /// What exactly was done.
    pub detail: String,
    /// Why it could not be done, if it could not.
    pub error: Option<String>,
}

/// Everything injected.
#[derive(Debug, Default)]
pub(super) struct Injected {
    /// Every fault injected, in the order it was injected.
    pub faults: Vec<Fault>,
    /// Stream sequences of the hostile messages the broker stored.
    pub hostile_sequences: BTreeSet<u64>,
    /// Hostile messages stored.
    pub hostile_sent: u64,
}

impl Injected {
    /// Faults per kind that were carried out.
    pub(super) fn count(&self, kind: FaultKind) -> usize {
        self.faults
            .iter()
            .filter(|f| f.kind == kind && f.error.is_none())
            .count()
    }
}

/// What the faults act on.
#[derive(Debug)]
pub(super) struct Context {
    pub fleet: Arc<Fleet>,
    pub servers: Servers,
    /// The harness's own pool on the event store.
    pub pool: PgPool,
    /// The harness's own JetStream client.
    pub jetstream: jetstream::Context,
    /// Its subject prefix.
    pub subject_prefix: String,
    /// The run's clock.
    pub clock: Clock,
    /// How long `relay_pause` freezes a relay ([`relay_frozen`]).
    pub relay_frozen: Duration,
}

/// Carries out the schedule, each fault at its moment or [`SETTLE`] after the previous one was over,
/// whichever is later, and returns what happened.
pub(super) async fn inject(plan: Vec<Planned>, context: &Context, rng: &mut StdRng) -> Injected {
    let mut injected = Injected::default();
    for planned in plan {
        let settled = injected
            .faults
            .last()
            .map_or(Duration::ZERO, |f| Duration::from_secs_f64(f.over) + SETTLE);
        if let Some(wait) = planned.at.max(settled).checked_sub(context.clock.elapsed()) {
            tokio::time::sleep(wait).await;
        }
        let at = context.clock.seconds();
        let outcome = strike(planned.kind, context, rng, &mut injected).await;
        let over = context.clock.seconds();
        let (detail, error) = match outcome {
            Ok(detail) => (detail, None),
            Err(error) => (String::new(), Some(format!("{error:#}"))),
        };
        eprintln!(
            "chaos: [{at:6.1} s] {:<16} {}{}",
            planned.kind.name(),
            detail,
            error
                .as_ref()
                .map(|e| format!("FAILED: {e}"))
                .unwrap_or_default()
        );
        injected.faults.push(Fault {
            kind: planned.kind,
            at,
            over,
            detail,
            error,
        });
    }
    injected
}

async fn strike(
    kind: FaultKind,
    context: &Context,
    rng: &mut StdRng,
    injected: &mut Injected,
) -> anyhow::Result<String> {
    let fleet = &context.fleet;
    let pick = |names: Vec<String>, rng: &mut StdRng| -> anyhow::Result<String> {
        names
            .get(rng.random_range(0..names.len().max(1)))
            .cloned()
            .ok_or_else(|| anyhow::anyhow!("no such process"))
    };
    match kind {
        FaultKind::RelayKill => {
            let picked = pick(fleet.names(Role::Relay).await, rng)?;
            let (relay, what) = victim(&context.pool, picked).await;
            fleet.kill_and_restart(&relay, PROCESS_DOWN).await?;
            Ok(format!(
                "SIGKILL {relay}{what}, restarted after {PROCESS_DOWN:?}"
            ))
        }
        FaultKind::RelayPause => {
            let picked = pick(fleet.names(Role::Relay).await, rng)?;
            let (relay, what) = victim(&context.pool, picked).await;
            let frozen = context.relay_frozen;
            fleet.freeze(&relay, frozen).await?;
            Ok(format!(
                "SIGSTOP {relay}{what} for {frozen:?}, then SIGCONT"
            ))
        }
        FaultKind::ProjectionKill => {
            let projection = pick(fleet.names(Role::Projection).await, rng)?;
            // A partition instance (`inventory-p1`) connects as its projection (`waybill-inventory`).
            let base = projection.split('-').next().unwrap_or(&projection);
            let writing = mid_batch(&context.pool, base).await;
            fleet.kill_and_restart(&projection, PROCESS_DOWN).await?;
            let moment = if writing {
                "while its batch transaction was open"
            } else {
                "between batches (no batch transaction was seen open within 3 s)"
            };
            Ok(format!(
                "SIGKILL {projection} {moment}, restarted after {PROCESS_DOWN:?}"
            ))
        }
        FaultKind::NatsRestart => {
            context.servers.restart_nats(NATS_DOWN).await?;
            Ok(format!(
                "SIGKILL nats-server, restarted after {NATS_DOWN:?}"
            ))
        }
        FaultKind::NatsNodeKill => {
            let index = rng.random_range(0..context.servers.nats_nodes.max(1));
            let node = context
                .servers
                .kill_nats_node(index, NATS_NODE_DOWN)
                .await?;
            Ok(format!(
                "SIGKILL NATS node {node} of {}, restarted after {NATS_NODE_DOWN:?}",
                context.servers.nats_nodes
            ))
        }
        FaultKind::NatsNodeFreeze => {
            let index = rng.random_range(0..context.servers.nats_nodes.max(1));
            let node = context
                .servers
                .freeze_nats_node(index, NATS_NODE_FROZEN)
                .await?;
            Ok(format!(
                "SIGSTOP NATS node {node} of {} for {NATS_NODE_FROZEN:?}, then SIGCONT",
                context.servers.nats_nodes
            ))
        }
        FaultKind::NatsStepDown => step_down(&context.jetstream, super::STREAM).await,
        FaultKind::PostgresRestart => {
            context.servers.restart_postgres(POSTGRES_DOWN).await?;
            Ok(format!(
                "immediate-mode stop of PostgreSQL, started after {POSTGRES_DOWN:?}"
            ))
        }
        FaultKind::PgTerminate => terminate_sessions(&context.pool, rng).await,
        FaultKind::HostilePublish => {
            let mut sent = super::hostile::Sent::default();
            let outcome = super::hostile::publish(context, rng, &mut sent).await;
            injected.hostile_sent += sent.sequences.len() as u64;
            injected.hostile_sequences.extend(&sent.sequences);
            outcome.map(|()| sent.describe())
        }
    }
}

/// Asks the stream's leader to step down and names the leader before and after.
async fn step_down(jetstream: &jetstream::Context, stream: &str) -> anyhow::Result<String> {
    let leader = |info: &jetstream::stream::Info| {
        info.cluster
            .as_ref()
            .and_then(|c| c.leader.clone())
            .unwrap_or_else(|| "none".to_owned())
    };
    let mut handle = jetstream.get_stream(stream).await?;
    let before = leader(handle.info().await?);
    let answer: serde_json::Value = jetstream
        .request(
            format!("STREAM.LEADER.STEPDOWN.{stream}"),
            &serde_json::json!({}),
        )
        .await
        .map_err(|error| anyhow::anyhow!("stream leader step-down: {error}"))?;
    anyhow::ensure!(
        answer.get("error").is_none(),
        "stream leader step-down refused: {answer}"
    );
    // The new leader is elected within moments; name it if it is there.
    let mut after = "being elected".to_owned();
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if let Ok(info) = handle.info().await {
            let now = leader(info);
            if now != "none" && now != before {
                after = now;
                break;
            }
        }
    }
    Ok(format!(
        "stream {stream}'s leader {before} stepped down; new leader {after}"
    ))
}

/// The relay a relay fault strikes: `picked`, unless the relays read the WAL — then the one reading
/// the slot now (known by its replication session's name, `waybill-relay chaos-<relay>`), as the
/// other only stands by and a fault there would test nothing. With what to say of it.
async fn victim(pool: &PgPool, picked: String) -> (String, &'static str) {
    let reader: Option<String> = sqlx::query_scalar(
        "SELECT substr(application_name, length('waybill-relay chaos-') + 1) FROM pg_stat_activity
         WHERE backend_type = 'walsender' AND datname = current_database()
           AND application_name LIKE 'waybill-relay chaos-%'
         LIMIT 1",
    )
    .fetch_optional(pool)
    .await
    .ok()
    .flatten();
    match reader {
        Some(reader) => (reader, " (the slot's reader)"),
        None => (picked, ""),
    }
}

/// Waits (up to 3 s) for a moment when `projection` has a write transaction open — a batch being
/// applied, seen from outside in `pg_stat_activity` — and says whether it found one.
async fn mid_batch(pool: &PgPool, projection: &str) -> bool {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
    while tokio::time::Instant::now() < deadline {
        let open: Option<bool> = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity
                            WHERE application_name = $1 AND backend_xid IS NOT NULL)",
        )
        .bind(format!("waybill-{projection}"))
        .fetch_one(pool)
        .await
        .ok();
        if open == Some(true) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    false
}

/// Ends one to three random sessions of the relays and projections. When a relay reads the WAL, its
/// replication session (a walsender named like the relay's other sessions) is one of them: among a
/// few dozen sessions a random pick would seldom reach the one session the WAL relay cannot do
/// without, and whose loss hands the slot to the standby.
async fn terminate_sessions(pool: &PgPool, rng: &mut StdRng) -> anyhow::Result<String> {
    let mut sessions: Vec<(i32, String, bool)> = sqlx::query_as(
        "SELECT pid, application_name, backend_type = 'walsender' FROM pg_stat_activity
         WHERE datname = current_database() AND pid <> pg_backend_pid()
           AND (application_name LIKE 'waybill-relay %'
                OR application_name IN ('waybill-inventory', 'waybill-points', 'waybill-search'))
         ORDER BY pid",
    )
    .fetch_all(pool)
    .await?;
    anyhow::ensure!(
        !sessions.is_empty(),
        "no relay or projection session is connected"
    );
    sessions.shuffle(rng);
    let walsender = sessions.iter().position(|(_, _, walsender)| *walsender);
    let count = rng.random_range(1..=3).min(sessions.len());
    if let Some(walsender) = walsender.filter(|&at| at >= count) {
        sessions.swap(count - 1, walsender);
    }
    sessions.truncate(count);
    for (pid, _, _) in &sessions {
        sqlx::query("SELECT pg_terminate_backend($1)")
            .bind(pid)
            .execute(pool)
            .await?;
    }
    Ok(format!(
        "terminated {}",
        sessions
            .iter()
            .map(|(pid, name, walsender)| {
                let what = if *walsender { ", its WAL session" } else { "" };
                format!("{name} (pid {pid}{what})")
            })
            .collect::<Vec<_>>()
            .join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_strikes_at_least_once_between_the_warm_up_and_the_quiet_end() {
        for seconds in [20, 75, 90, 600] {
            let duration = Duration::from_secs(seconds);
            let plan = schedule(&FaultKind::ALL, duration, 42);
            for kind in FaultKind::ALL {
                assert!(
                    plan.iter().any(|p| p.kind == kind),
                    "{} missing from a {seconds} s plan",
                    kind.name()
                );
            }
            assert!(plan.windows(2).all(|w| w[0].at < w[1].at), "in time order");
            assert!(plan.iter().all(|p| p.at >= WARM_UP.min(duration / 5)));
            assert!(plan.iter().all(|p| p.at < duration));
        }
        assert_eq!(
            schedule(&FaultKind::ALL, Duration::from_secs(600), 1).len(),
            50
        );
    }

    #[test]
    fn a_frozen_wal_reader_wakes_after_the_takeover_and_past_the_dedupe_window() {
        assert_eq!(relay_frozen(None), RELAY_FROZEN);
        let timeout = Duration::from_secs(10);
        assert!(relay_frozen(Some(timeout)) >= timeout + Duration::from_secs(1) + DEDUPE_WINDOW);
        assert!(relay_frozen(Some(Duration::from_secs(1))) >= RELAY_FROZEN);
    }

    #[test]
    fn a_seed_repeats_its_schedule_and_another_seed_does_not() {
        let kinds = |seed| {
            schedule(&FaultKind::ALL, Duration::from_secs(90), seed)
                .iter()
                .map(|p| (p.kind, p.at))
                .collect::<Vec<_>>()
        };
        assert_eq!(kinds(7), kinds(7));
        assert_ne!(kinds(7), kinds(8));
    }

    #[test]
    fn kinds_parse_by_name_and_unknown_ones_are_refused_with_the_list() {
        for kind in FaultKind::ALL {
            assert_eq!(FaultKind::parse(kind.name()), Ok(kind));
        }
        let refused = FaultKind::parse("disk_fill").expect_err("unknown");
        assert!(refused.contains("relay_kill"), "{refused}");
        assert_eq!(
            FaultKind::parse("nats_node_kill"),
            Ok(FaultKind::NatsNodeKill)
        );
        assert!(!FaultKind::ALL.contains(&FaultKind::NatsNodeKill));
        assert!(FaultKind::defaults(true).contains(&FaultKind::NatsNodeKill));
        for kind in [FaultKind::NatsNodeFreeze, FaultKind::NatsStepDown] {
            assert_eq!(FaultKind::parse(kind.name()), Ok(kind));
            assert!(kind.needs_cluster() && !FaultKind::ALL.contains(&kind));
            assert!(FaultKind::defaults(true).contains(&kind));
            assert!(!FaultKind::defaults(false).contains(&kind));
        }
    }
}
