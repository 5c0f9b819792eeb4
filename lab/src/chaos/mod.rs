//! `waybill chaos`: the whole system under load on private PostgreSQL and NATS, faults of every kind
//! injected at seeded random moments, then a verdict checked from first principles.
//!
//! The run: start the servers and the real binaries ([`fleet`]), play order lifecycles over HTTP
//! ([`load`]) while [`faults`] strikes and [`watch`] samples the backlog and memory; stop the load, let
//! everything drain, and judge ([`verdict`]) what the event store, the stream and the projections hold.

mod faults;
mod fleet;
mod hostile;
mod load;
mod report;
mod servers;
mod verdict;
mod watch;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use rand::SeedableRng;

pub(crate) use faults::FaultKind;

/// `waybill chaos` options.
#[derive(Debug, clap::Args)]
pub(crate) struct ChaosArgs {
    /// How long the load runs (faults land within it); the drain and the verdict follow. Default: the
    /// profile's (short 75s, long 10m).
    #[arg(long, value_parser = humantime::parse_duration)]
    pub duration: Option<Duration>,

    /// Seed of every random choice (fault kinds, moments, victims, order contents); printed, so a run
    /// can be repeated. Default: taken from the clock.
    #[arg(long)]
    pub seed: Option<u64>,

    /// short: every fault kind at least once in about a minute (what CI runs); long: ten minutes,
    /// thousands of orders, a fault every ~12 s.
    #[arg(long, value_enum, default_value_t = Profile::Short)]
    pub profile: Profile,

    /// Print the verdict as JSON on standard output (the table goes to standard error).
    #[arg(long)]
    pub json: bool,

    /// After the verdict, keep the private PostgreSQL and NATS running (the processes are stopped)
    /// until SIGTERM/Ctrl-C, so what the run left can be inspected at the printed URLs.
    #[arg(long)]
    pub keep: bool,

    /// Only these fault kinds (comma-separated), e.g. relay_kill,hostile_publish. Default: all.
    #[arg(long, value_delimiter = ',', value_parser = FaultKind::parse)]
    pub faults: Vec<FaultKind>,

    /// Order lifecycles started per second. Default: the profile's (short 20, long 30).
    #[arg(long)]
    pub rate: Option<f64>,

    /// Where the waybill binaries are (waybill, waybill-relay, waybill-inventory, waybill-points,
    /// waybill-search). Default: beside this program.
    #[arg(long, value_name = "DIR")]
    pub binaries: Option<PathBuf>,

    /// Take the projection binaries from this directory instead (another build of them).
    #[arg(long, value_name = "DIR")]
    pub projection_binaries: Option<PathBuf>,

    /// Run on a three-node NATS cluster with the stream in three replicas, each projection as two
    /// instances sharing --partitions 2 through leases, and add the cluster's faults to the
    /// schedule: nats_node_kill (SIGKILL one node under load, restart it after a few seconds),
    /// nats_node_freeze (SIGSTOP one node past the election timeout, then SIGCONT) and
    /// nats_step_down (the stream's leader steps down).
    #[arg(long)]
    pub cluster: bool,

    /// Where both relays read new outbox rows: poll (claimed from the table, the default) or wal
    /// (`waybill-relay run --source wal`: one relay streams them from the `waybill_outbox`
    /// replication slot, the other stands by to take the slot over). The verdict stays the same; with
    /// wal, relay_kill and relay_pause strike the slot's reader (relay_pause freezes it past
    /// wal_sender_timeout, so that the standby takes over first) and pg_terminate also ends its
    /// replication session.
    #[arg(long, value_enum, default_value_t = RelaySource::Poll)]
    pub relay_source: RelaySource,

    /// Testing the harness: run the projections with their checkpoint check broken on purpose
    /// (they apply redeliveries again); the verdict must fail.
    #[arg(long, hide = true)]
    pub broken_checkpoint: bool,
}

/// How big a run is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Profile {
    /// About a minute; every fault kind at least once.
    Short,
    /// Ten minutes; thousands of orders.
    Long,
}

/// Where the relays read new outbox rows (`waybill-relay run --source`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum RelaySource {
    /// Claimed from the outbox table, by both relays side by side.
    Poll,
    /// Streamed from a logical replication slot: one reader, one standby.
    Wal,
}

impl RelaySource {
    /// Its name, as `waybill-relay run --source` and the report spell it.
    fn name(self) -> &'static str {
        match self {
            Self::Poll => "poll",
            Self::Wal => "wal",
        }
    }
}

impl Profile {
    fn duration(self) -> Duration {
        match self {
            Self::Short => Duration::from_secs(75),
            Self::Long => Duration::from_secs(600),
        }
    }

    fn rate(self) -> f64 {
        match self {
            Self::Short => 20.0,
            Self::Long => 30.0,
        }
    }
}

/// The stream and subject prefix of a chaos run (its own servers, so the defaults would do; distinct
/// names make a kept run's stream obvious).
const STREAM: &str = "WAYBILL_CHAOS";
const SUBJECT_PREFIX: &str = "chaos.events";
/// The database on the private server.
const DATABASE: &str = "waybill_chaos";
/// The header every hostile message carries, so that the checker can set them apart.
pub(crate) const HOSTILE_HEADER: &str = "Waybill-Chaos";

/// Runs the harness; `Ok(true)` when the verdict is pass.
pub(crate) async fn run(args: ChaosArgs) -> anyhow::Result<bool> {
    let duration = args.duration.unwrap_or(args.profile.duration());
    anyhow::ensure!(
        duration >= Duration::from_secs(30),
        "--duration must be at least 30s: faults need room between the warm-up and the end"
    );
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| {
                #[allow(
                    clippy::cast_possible_truncation,
                    reason = "only a seed from the clock: dropping the high bits is fine"
                )]
                let nanos = d.as_nanos() as u64;
                nanos % 1_000_000_007
            })
    });
    let kinds = if args.faults.is_empty() {
        FaultKind::defaults(args.cluster)
    } else {
        args.faults.clone()
    };
    if let Some(kind) = kinds.iter().find(|k| k.needs_cluster() && !args.cluster) {
        return Err(ops::Refused::new(format!("the {} fault needs --cluster", kind.name())).into());
    }
    let rate = args.rate.unwrap_or(args.profile.rate());
    anyhow::ensure!(
        rate > 0.0 && rate <= 1000.0,
        "--rate must be above 0 and at most 1000 lifecycles/s"
    );
    let here = std::env::current_exe()?
        .parent()
        .map(PathBuf::from)
        .context("cannot tell where this program lives")?;
    let binaries = fleet::Binaries::find(
        args.binaries.as_deref().unwrap_or(&here),
        args.projection_binaries.as_deref(),
    )?;

    eprintln!(
        "chaos: seed {seed}, {} of load at {rate} lifecycles/s, relays reading by {}, faults: {}",
        humantime::format_duration(duration),
        args.relay_source.name(),
        kinds
            .iter()
            .map(|k| k.name())
            .collect::<Vec<_>>()
            .join(", ")
    );
    let started = Instant::now();
    let servers = servers::Servers::start(DATABASE, args.cluster).await?;
    eprintln!(
        "chaos: PostgreSQL {} and NATS {} ({} node(s)) started",
        servers.database_url, servers.nats_url, servers.nats_nodes
    );
    let wal_sender_timeout = match args.relay_source {
        RelaySource::Poll => None,
        RelaySource::Wal => Some(servers.check_logical_decoding().await?),
    };
    let fleet = Arc::new(
        fleet::Fleet::start(
            binaries,
            &servers,
            STREAM,
            SUBJECT_PREFIX,
            args.relay_source,
            args.broken_checkpoint,
        )
        .await?,
    );
    eprintln!("chaos: the console is at {}/console", fleet.console_url());
    let run = Run {
        seed,
        profile: args.profile,
        relay_source: args.relay_source,
        wal_sender_timeout,
        duration,
        rate,
        kinds,
        started,
    };
    // Ctrl-C or SIGTERM mid-run: stop the processes (thawing a frozen relay) and remove the servers,
    // rather than leave them behind.
    let pass = tokio::select! {
        outcome = exercise(&run, &servers, fleet.clone(), args.json) => outcome?,
        () = ops::shutdown_signal() => {
            fleet.stop_all().await;
            anyhow::bail!("interrupted: the processes are stopped and the private servers removed");
        }
    };
    if args.keep {
        eprintln!(
            "chaos: keeping PostgreSQL ({}) and NATS ({}, stream {STREAM}) until SIGTERM/Ctrl-C",
            servers.database_url, servers.nats_url
        );
        ops::shutdown_signal().await;
    }
    drop(servers);
    Ok(pass)
}

/// What a run was asked to do.
#[derive(Debug)]
struct Run {
    seed: u64,
    profile: Profile,
    relay_source: RelaySource,
    /// With the WAL source: how long a frozen slot reader holds the slot.
    wal_sender_timeout: Option<Duration>,
    duration: Duration,
    rate: f64,
    kinds: Vec<FaultKind>,
    started: Instant,
}

/// Load, faults, drain, verdict and report; `Ok(true)` when the verdict is pass.
async fn exercise(
    run: &Run,
    servers: &servers::Servers,
    fleet: Arc<fleet::Fleet>,
    json: bool,
) -> anyhow::Result<bool> {
    let Run {
        seed,
        profile,
        relay_source,
        wal_sender_timeout,
        duration,
        rate,
        ref kinds,
        started,
    } = *run;
    let pool = servers.pool().await?;
    let nats = async_nats::ConnectOptions::new()
        .name("waybill-chaos")
        .retry_on_initial_connect()
        // One URL, or every node of the cluster.
        .connect(servers.nats_url.split(',').collect::<Vec<_>>())
        .await
        .context("connecting to the private NATS")?;
    let jetstream = async_nats::jetstream::new(nats);

    let clock = watch::Clock::new();
    let watcher = watch::Watcher::spawn(
        clock.clone(),
        pool.clone(),
        jetstream.clone(),
        fleet.clone(),
        servers.clone_handles(),
    );
    let load = load::Load::spawn(fleet.api_url(), rate, duration, seed, clock.clone());
    let plan = faults::schedule(kinds, duration, seed);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x5eed_fa17);
    let context = faults::Context {
        fleet: fleet.clone(),
        servers: servers.clone_handles(),
        pool: pool.clone(),
        jetstream: jetstream.clone(),
        subject_prefix: SUBJECT_PREFIX.to_owned(),
        clock: clock.clone(),
        relay_frozen: faults::relay_frozen(wal_sender_timeout),
    };
    let injected = faults::inject(plan, &context, &mut rng).await;
    let played = load.finish().await;
    eprintln!(
        "chaos: load over at {:.0} s: {} commands accepted, {} lifecycles abandoned; draining",
        clock.seconds(),
        played.accepted.len(),
        played.abandoned
    );
    let drained = watch::drain(&pool, &jetstream, &fleet, Duration::from_secs(180)).await;
    let samples = watcher.stop().await;
    let mut verdict = verdict::judge(verdict::Evidence {
        pool: &pool,
        database_url: &servers.database_url,
        jetstream: &jetstream,
        stream: STREAM,
        fleet: &fleet,
        played: &played,
        injected: &injected,
        kinds,
        drained: &drained,
    })
    .await?;
    let stopped = fleet.stop_all().await;
    verdict.note_exits(&stopped);
    let report = report::Report::new(report::Inputs {
        seed,
        profile,
        relay_source: relay_source.name(),
        duration,
        elapsed: started.elapsed(),
        verdict: &verdict,
        played: &played,
        injected: &injected,
        samples: &samples,
        drained: &drained,
        stopped: &stopped,
        database_url: &servers.database_url,
        nats_url: &servers.nats_url,
        nats_nodes: servers.nats_nodes,
        nats_server: testkit::server_version(),
        partitions: fleet.partitions(),
        stream: STREAM,
        logs: fleet.logs(),
    });
    report.print(json)?;
    Ok(verdict.pass())
}
