//! `waybill bench`: every performance figure of the system from one run on the local services — the
//! command side against a plain transaction, the relay (one and two instances, best configuration, hot
//! aggregates, the seed article's algorithm, CPU per event), each projection's apply rate, and the whole
//! pipeline over HTTP (latency from commit to applied at a steady rate, and the highest rate it
//! sustains) — printed as a table or JSON, with the targets judged and an optional SVG plot.
//!
//! Benchmarks are programs that print figures, not tests: nothing here asserts a speed. Each figure is
//! the median of several rounds (the whole pipeline's too), targets are judged on those medians, and
//! ratios are taken between rounds of the same run.

mod pipeline;
mod plot;
mod projections;
mod relay;
mod report;
mod scaling;
mod server;
mod server_marks;
mod sources;
mod usage;
mod writers;

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;

use crate::demo::services::Services;

/// The oldest nats-server the bench measures (`docs/scale-out.md`: the supported minimum).
const SUPPORTED_NATS: (u64, u64) = (2, 11);

/// `waybill bench` options.
#[derive(Debug, clap::Args)]
pub(crate) struct BenchArgs {
    /// The quick profile: smaller sizes and three rounds (about ten minutes here, plus about three
    /// the first time, which seeds a million sent rows). The sizes of the run are in its output
    /// (`sizes`).
    #[arg(long)]
    pub quick: bool,

    /// Print one JSON document on standard output (progress and the table go to standard error).
    #[arg(long)]
    pub json: bool,

    /// Draw latency percentiles against offered load, and throughput per stage, into this SVG file.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,

    /// Testing the bench itself: tiny sizes, one round, figures of no value.
    #[arg(long, hide = true, conflicts_with = "quick")]
    pub tiny: bool,

    /// Exit 1 when a target is missed (the figures are printed either way).
    #[arg(long)]
    pub check: bool,

    /// Only these parts (comma-separated): writers, relay, projections, pipeline. Default: all.
    #[arg(long, value_delimiter = ',', value_enum)]
    pub only: Vec<Part>,

    /// Rounds per measurement: every measurement, the pipeline's steady rate and each sweep step
    /// included, runs this many times; the figures and the targets are the rounds' medians, the table
    /// shows their range and the JSON keeps every round. Default: the profile's (quick 3, full 5).
    #[arg(long, visible_alias = "repeat")]
    pub rounds: Option<usize>,

    /// NATS server URL (a private server is started when nothing answers there).
    #[arg(
        long,
        env = "NATS_URL",
        default_value = "nats://127.0.0.1:4222",
        hide_env_values = true
    )]
    pub nats_url: String,
}

/// The parts of a bench run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Part {
    /// Orders through the store against a plain two-row transaction.
    Writers,
    /// Draining a backlog: one relay, two, best, hot aggregates, the baseline, CPU per event.
    Relay,
    /// Each projection's apply rate.
    Projections,
    /// The whole pipeline over HTTP: end-to-end latency, the load sweep, the sustained rate.
    Pipeline,
    /// The relay's two sources side by side (polling and the WAL): backlog rate, CPU per event,
    /// commit to PubAck at 1,000 events/s.
    Sources,
}

/// Sizes of a run.
#[derive(Debug, Clone, serde::Serialize)]
pub(crate) struct Profile {
    /// `quick` or `full`.
    pub name: &'static str,
    /// Rounds per measurement.
    pub rounds: usize,
    /// Seconds per writer measurement.
    pub writer_seconds: f64,
    /// Events per relay drain.
    pub relay_events: i64,
    /// Sent rows present in the outbox during the relay drains.
    pub history: i64,
    /// Versions per aggregate in the hot-aggregate drain.
    pub hot_versions: i64,
    /// Seconds per baseline measurement (it cannot drain a backlog in reasonable time).
    pub baseline_seconds: f64,
    /// Events per projection measurement.
    pub projection_events: usize,
    /// Offered rate and seconds of the end-to-end latency measurement.
    pub e2e_rate: u64,
    /// Seconds of the end-to-end measurement.
    pub e2e_seconds: u64,
    /// Offered rates of the load sweep (events/s).
    pub sweep_rates: Vec<u64>,
    /// Seconds per sweep step.
    pub sweep_seconds: u64,
}

impl Profile {
    fn new(args: &BenchArgs) -> Self {
        let rounds = args.rounds;
        if args.tiny {
            Self {
                name: "tiny",
                rounds: rounds.unwrap_or(1),
                writer_seconds: 0.2,
                relay_events: 3_000,
                history: 10_000,
                hot_versions: 100,
                baseline_seconds: 0.5,
                projection_events: 900,
                e2e_rate: 100,
                e2e_seconds: 2,
                sweep_rates: vec![100, 200],
                sweep_seconds: 2,
            }
        } else if args.quick {
            Self {
                name: "quick",
                rounds: rounds.unwrap_or(3),
                writer_seconds: 1.0,
                relay_events: 50_000,
                history: 1_000_000,
                hot_versions: 100,
                baseline_seconds: 3.0,
                projection_events: 30_000,
                e2e_rate: 1_000,
                e2e_seconds: 10,
                sweep_rates: vec![250, 500, 1_000, 1_500, 2_000, 2_500, 3_000, 4_000],
                sweep_seconds: 6,
            }
        } else {
            Self {
                name: "full",
                rounds: rounds.unwrap_or(5),
                writer_seconds: 3.0,
                relay_events: 100_000,
                history: 1_000_000,
                hot_versions: 100,
                baseline_seconds: 10.0,
                projection_events: 100_000,
                e2e_rate: 1_000,
                e2e_seconds: 30,
                sweep_rates: vec![250, 500, 1_000, 1_500, 2_000, 2_500, 3_000, 3_500, 4_000],
                sweep_seconds: 15,
            }
        }
    }
}

/// Runs the bench; `Ok(false)` when `--check` found a missed target.
pub(crate) async fn run(database_url: &str, args: BenchArgs) -> anyhow::Result<bool> {
    let started = Instant::now();
    let profile = Profile::new(&args);
    anyhow::ensure!(profile.rounds >= 1, "--rounds must be at least 1");
    let database_url = crate::demo::services::without_tls_on_loopback(database_url);
    let mut services = Services::ensure(&database_url, &args.nats_url)?;
    let wanted = |part: Part| args.only.is_empty() || args.only.contains(&part);
    let progress = Progress { started };
    // The partitions' figures need a server that splits a stream (subject transforms, 2.10; the
    // project supports 2.11 and later). An older one is left alone, and a private one measured.
    if let Some(refused) = services.require_nats(SUPPORTED_NATS).await? {
        progress.say(&format!(
            "the NATS at {} is {refused}, older than the supported {}.{}: this run uses a private \
             nats-server (scripts/install-nats-server) instead",
            ops::redact_url(&args.nats_url),
            SUPPORTED_NATS.0,
            SUPPORTED_NATS.1
        ));
    }
    // The machine's yardstick is taken now, before anything this run starts keeps the cores busy.
    progress.say(&format!("machine: {}", report::machine_line()));
    progress.say(&format!(
        "profile {} ({} rounds); PostgreSQL and NATS: {}",
        profile.name,
        profile.rounds,
        services.describe().join("; ")
    ));

    if cfg!(debug_assertions) {
        progress.say(
            "WARNING: this is a debug build; its figures are several times too low. Build with \
             `cargo build --release --workspace --bins` and run target/release/waybill bench",
        );
    }
    let mut report = report::Report::new(&profile);
    match server::measure(&services).await {
        Ok(figures) => {
            progress.say(&format!("PostgreSQL: {}", figures.line()));
            report.server = Some(figures);
        }
        Err(error) => progress.say(&format!(
            "PostgreSQL's round trip and commit not measured: {}",
            ops::error_chain(error.as_ref())
        )),
    }
    if wanted(Part::Writers) {
        report.writers = Some(writers::measure(&services, &profile, &progress).await?);
    }
    if wanted(Part::Relay) {
        report.relay = Some(relay::measure(&services, &profile, &progress).await?);
    }
    if wanted(Part::Sources) {
        report.sources = Some(sources::measure(&services, &profile, &progress).await?);
    }
    if wanted(Part::Projections) {
        report.projections = Some(projections::measure(&services, &profile, &progress).await?);
    }
    if wanted(Part::Pipeline) {
        report.pipeline = Some(pipeline::measure(&services, &profile, &progress).await?);
    }
    report.seconds = started.elapsed().as_secs_f64();
    let targets = report.judge();

    eprint!("{}", report.table(&targets));
    if let Some(path) = &args.plot {
        plot::draw(path, &report).with_context(|| format!("drawing {}", path.display()))?;
        eprintln!("plot written to {}", path.display());
    }
    if args.json {
        println!("{}", report.json(&targets));
    }
    drop(services);
    Ok(!args.check || targets.iter().all(|t| t.met))
}

/// Connects to NATS and makes an empty stream `name` over `prefix.>` (deleted first, when it exists).
async fn fresh_stream(
    nats_url: &str,
    name: &str,
    prefix: &str,
) -> anyhow::Result<async_nats::jetstream::Context> {
    fresh_split_stream(nats_url, name, prefix, 1).await
}

/// [`fresh_stream`], split by the server into `partitions` partitions (1: not split).
async fn fresh_split_stream(
    nats_url: &str,
    name: &str,
    prefix: &str,
    partitions: u32,
) -> anyhow::Result<async_nats::jetstream::Context> {
    let js = async_nats::jetstream::new(async_nats::connect(nats_url).await?);
    let _ = js.delete_stream(name).await;
    let settings = ::relay::StreamSettings {
        name: name.into(),
        subject_prefix: prefix.into(),
        ..::relay::StreamSettings::default()
    };
    let limits = ::relay::StreamLimits {
        partitions: Some(partitions),
        ..::relay::StreamLimits::default()
    };
    ::relay::ensure_stream_with(&js, &settings, &limits, false).await?;
    Ok(js)
}

/// Progress lines on standard error, stamped with the time since the start.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Progress {
    started: Instant,
}

impl Progress {
    /// Prints one progress line.
    pub(crate) fn say(&self, text: &str) {
        eprintln!("[{:>6.1}s] {text}", self.started.elapsed().as_secs_f64());
    }
}
