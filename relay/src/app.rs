//! The `waybill-relay` command line, shared by that binary and its testing twin `waybill-relay-faulty`
//! (built only with the `fault-injection` feature): the grammar here never has a fault flag, the twin
//! reads its own and hands the fail point in, so an installed relay cannot be told to crash.

use std::ffi::OsString;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use anyhow::Context;
use clap::{Args, CommandFactory, Parser, Subcommand};

use crate::cli::{OutboxCommand, run_outbox};
use crate::{Backoff, FailPoint, Relay, RelayConfig, StreamSettings};

/// waybill-relay: publishes the transactional outbox to NATS JetStream.
///
/// Each step claims a batch of outbox rows by locking them (FOR UPDATE SKIP LOCKED) in one short
/// transaction, publishes them with Nats-Msg-Id = event id (an aggregate's next version only after the
/// previous one's PubAck), and marks them sent, failed (retried with backoff) or dead in the same
/// transaction. Run as many instances as you like. Exit codes: 0 success, 2 refused input, 1 failure.
#[derive(Debug, Parser)]
#[command(name = "waybill-relay", version, max_term_width = 100)]
struct Cli {
    #[command(flatten)]
    connection: Connection,

    /// Print machine-readable JSON on standard output.
    #[arg(long, global = true)]
    json: bool,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Args)]
struct Connection {
    #[command(flatten)]
    shared: ops::StreamConnection,

    /// JetStream's dedupe window for Nats-Msg-Id (sized in ARCHITECTURE.md: longer than a crashed
    /// relay's rows take to be re-claimed, short enough for the server memory it costs). Past it, the
    /// fence (Nats-Expected-Last-Subject-Sequence) still keeps each event once and in order.
    #[arg(long, value_name = "DURATION", default_value_t = StreamSettings::default().duplicate_window.into(), global = true)]
    duplicate_window: humantime::Duration,

    /// Replicas of the stream on a NATS cluster (3 keeps it available while one node is down):
    /// `provision` and `run` create it with N and refuse an existing one with another count (unless
    /// --update, which changes it). Without it a new stream gets 1 and an existing one keeps its own.
    #[arg(long, env = "WAYBILL_STREAM_REPLICAS", value_name = "N", value_parser = clap::value_parser!(u8).range(1..=5), global = true)]
    replicas: Option<u8>,

    /// How long the stream keeps a message (e.g. 7d, 36h; `off` for no limit, the default). History
    /// lives in the event store: a projection that starts, rebuilds or was down longer than this
    /// catches up from the events table (its role needs SELECT on it) and the stream takes over.
    /// At least 1h and the dedupe window. `provision` and `run` create the stream with it and
    /// refuse an existing one with another limit (unless --update, which changes it); without it
    /// a new stream keeps every message and an existing one keeps its own limit.
    #[arg(long, env = "WAYBILL_STREAM_MAX_AGE", value_name = "DURATION|off", value_parser = max_age, global = true)]
    max_age: Option<Duration>,

    /// Partitions the server splits the stream into (nats-server 2.10+): P > 1 gives the stream a
    /// subject transform that stores each order's events under `<prefix>.<K>.<type>.<id>`, K its
    /// partition, so that a projection run with the same --partitions P is delivered each event
    /// once in all, each partition's consumer its own. Fixed when the stream is created: an
    /// existing stream with messages and another split is refused. Without it a new stream is not
    /// split and an existing one keeps its own. See docs/scale-out.md.
    #[arg(long, env = "WAYBILL_STREAM_PARTITIONS", value_name = "P", value_parser = clap::value_parser!(u32).range(1..=i64::from(crate::MAX_STREAM_PARTITIONS)), global = true)]
    stream_partitions: Option<u32>,
}

/// `--max-age`: a duration, or `off` (no limit, which JetStream spells 0).
fn max_age(text: &str) -> Result<Duration, String> {
    if text.trim().eq_ignore_ascii_case("off") {
        return Ok(Duration::ZERO);
    }
    let age: Duration = text
        .trim()
        .parse::<humantime::Duration>()
        .map_err(|e| format!("{text:?} is not a duration (e.g. 7d, 36h) or off: {e}"))?
        .into();
    if age.is_zero() {
        return Err("a max age of 0 is spelled `off` (no limit)".into());
    }
    Ok(age)
}

/// With `--replicas`, `--max-age` or `--stream-partitions`: creates or checks the stream with them before anything else
/// uses it (the relay's own check then finds it in shape, whatever its replica count and age limit).
async fn provision_limits(
    connection: &Connection,
    stream: &StreamSettings,
    update: bool,
) -> anyhow::Result<Option<async_nats::jetstream::stream::Info>> {
    let limits = crate::StreamLimits {
        replicas: connection.replicas.map(usize::from),
        max_age: connection.max_age,
        partitions: connection.stream_partitions,
    };
    if limits == crate::StreamLimits::default() {
        return Ok(None);
    }
    if let Some(max_age) = limits.max_age {
        crate::check_max_age(max_age, stream.duplicate_window).map_err(ops::Refused::new)?;
    }
    let client = connection
        .shared
        .nats
        .connect("waybill-relay-provision")
        .await?;
    let jetstream = async_nats::jetstream::new(client);
    let info = crate::ensure_stream_with(&jetstream, stream, &limits, update).await?;
    Ok(Some(info))
}

/// The library's defaults, which the flags' defaults are taken from (so `--help` cannot drift from them).
static DEFAULTS: LazyLock<RelayConfig> = LazyLock::new(RelayConfig::default);
/// The default retry schedule as `--backoff` spells it.
static DEFAULT_BACKOFF: LazyLock<String> = LazyLock::new(|| {
    let schedule = DEFAULTS.backoff.schedule().iter();
    let parts: Vec<String> = schedule
        .map(|d| humantime::format_duration(*d).to_string())
        .collect();
    parts.join(",")
});

#[derive(Debug, Subcommand)]
enum Command {
    /// Relay until SIGTERM/Ctrl-C (or, with --once, until nothing is claimable).
    Run(RunArgs),
    /// Create the stream, or verify that the existing one has the settings the relay needs (and the
    /// --replicas and --max-age given, if any).
    Provision {
        /// Change an existing stream's settings to the ones needed instead of refusing.
        #[arg(long)]
        update: bool,
    },
    #[command(flatten)]
    Outbox(OutboxCommand),
    /// Reading the outbox from PostgreSQL's write-ahead log (logical decoding).
    #[command(subcommand)]
    Wal(WalCommand),
}

#[derive(Debug, Subcommand)]
enum WalCommand {
    /// Check, read-only, what reading the WAL needs: wal_level = logical, free slots and senders, the
    /// REPLICATION privilege of this role, the publication of the outbox's inserts, the slot's state
    /// and lag, a WAL limit for slots, and a replication session's round trip. One line each; exit 1
    /// when anything is missing.
    Check {
        /// The replication slot.
        #[arg(long, env = "WAYBILL_WAL_SLOT", default_value = crate::wal::slot::DEFAULT_SLOT)]
        slot: String,
        /// The publication of the outbox (migration 0005 creates it).
        #[arg(long, env = "WAYBILL_WAL_PUBLICATION", default_value = crate::wal::slot::DEFAULT_PUBLICATION)]
        publication: String,
    },
}

#[derive(Debug, Args)]
struct RunArgs {
    /// Drain what is claimable now, print a summary and exit 0.
    #[arg(long)]
    once: bool,

    /// Serve Prometheus metrics at /metrics and a health check at /health on this address.
    #[arg(long, env = "WAYBILL_METRICS_LISTEN", value_name = "ADDR")]
    metrics_listen: Option<SocketAddr>,

    /// This instance's name in `claimed_by` and logs (default relay-<host>-<pid>).
    #[arg(long)]
    relay_id: Option<String>,

    /// Aggregate heads claimed per step.
    #[arg(long, default_value_t = DEFAULTS.batch_size)]
    batch_size: i64,

    /// Rows claimed per step at most, heads plus their following versions (never fewer than
    /// --batch-size). With `--source wal`, the rows at which a batch is published; a larger
    /// transaction goes out in parts of this many rows (or 4 MiB of bodies) as it arrives.
    #[arg(long, default_value_t = DEFAULTS.max_rows)]
    max_rows: i64,

    /// Bytes of message bodies claimed per step at most (the row that crosses it is still taken,
    /// so a step always takes one): bounds each lane's memory when rows are large. Rows of
    /// the usual size never reach it.
    #[arg(long, default_value_t = DEFAULTS.max_claim_bytes, value_name = "BYTES")]
    max_claim_bytes: i64,

    /// Publishes awaiting their PubAck at once.
    #[arg(long, default_value_t = DEFAULTS.max_in_flight)]
    max_in_flight: usize,

    /// Steps in progress at once, each its own claim transaction: one lane's database work overlaps
    /// another's publishing.
    #[arg(long, default_value_t = DEFAULTS.lanes)]
    lanes: usize,

    /// Failed publishes before a row is dead.
    #[arg(long, default_value_t = DEFAULTS.max_attempts)]
    max_attempts: i32,

    /// Retry delays (the last one repeats); ±20 % jitter is added.
    #[arg(long, default_value = DEFAULT_BACKOFF.as_str(), value_parser = Backoff::parse_schedule)]
    backoff: std::vec::Vec<Duration>,

    /// How long to wait for a PubAck (at most a quarter of --claim-idle-timeout is used).
    #[arg(long, default_value_t = DEFAULTS.publish_timeout.into())]
    publish_timeout: humantime::Duration,

    /// How often to look for due rows when no notification arrives.
    #[arg(long, default_value_t = DEFAULTS.poll_interval.into())]
    poll_interval: humantime::Duration,

    /// How long a claim may live: PostgreSQL ends a claim transaction idle this long, and other relays
    /// end one older than this (a relay frozen mid-claim), releasing its rows. Give every relay the
    /// same value. A step starts publishes for at most half of it.
    #[arg(long, default_value_t = DEFAULTS.claim_idle_timeout.into())]
    claim_idle_timeout: humantime::Duration,

    /// Sent rows older than this are deleted as the relay runs, in batches (`off` keeps them until
    /// `outbox purge`). Every relay may sweep; they never wait for one another. An order's fence
    /// does not need its purged rows: their stream sequences are read from the stream.
    #[arg(long, env = "WAYBILL_OUTBOX_RETENTION", value_name = "DURATION|off", default_value = "24h", value_parser = retention)]
    retention: Retention,

    /// Rows the retention sweep deletes per statement.
    #[arg(long, default_value_t = DEFAULTS.retention_batch)]
    retention_batch: i64,

    /// Do not create or verify the stream at start.
    #[arg(long)]
    no_provision: bool,

    /// Where new outbox rows are read from. `poll` (the default): claimed from the table, by any
    /// number of relays side by side. `wal`: streamed from a logical replication slot as they commit
    /// — less database work per event and no wait for a poll — with one reader per slot (another
    /// relay started on it stands by and takes over when the first one's session ends). Needs
    /// wal_level = logical, the REPLICATION privilege and the outbox's publication: `wal check` says
    /// what is missing. See docs/decisions/relay-wal.md.
    #[arg(long, env = "WAYBILL_RELAY_SOURCE", value_enum, default_value_t = Source::Poll)]
    source: Source,

    /// With --source wal: the replication slot (made when missing). With polling: the slot whose
    /// reader this relay stands by for — while a WAL relay reads it and no aggregate's next row has
    /// been due for over 10 s, this relay claims nothing (it would only publish every event a second time);
    /// it claims again within a second of that session ending (a frozen reader's ends after
    /// PostgreSQL's wal_sender_timeout) or of rows waiting that long, so polling relays are the WAL
    /// relay's standbys.
    #[arg(long, env = "WAYBILL_WAL_SLOT", default_value = crate::wal::slot::DEFAULT_SLOT)]
    slot: String,

    /// With polling: claim even while a WAL relay reads --slot (both then publish every event; the
    /// copies are deduplicated). Refused with --source wal; `run --once` never stands by anyway.
    #[arg(long)]
    ignore_slot: bool,

    /// With --source wal: the publication of the outbox's inserts (migration 0005 makes it).
    #[arg(long, env = "WAYBILL_WAL_PUBLICATION", default_value = crate::wal::slot::DEFAULT_PUBLICATION)]
    publication: String,
}

/// `run --source`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Source {
    /// Claim rows from the outbox table.
    Poll,
    /// Stream rows from a logical replication slot.
    Wal,
}

/// `--retention`: a duration, or `off`.
#[derive(Debug, Clone, Copy)]
struct Retention(Option<Duration>);

fn retention(text: &str) -> Result<Retention, String> {
    if text.trim().eq_ignore_ascii_case("off") {
        return Ok(Retention(None));
    }
    let retention: Duration = text
        .trim()
        .parse::<humantime::Duration>()
        .map_err(|e| format!("{text:?} is not a duration (e.g. 24h, 30m) or off: {e}"))?
        .into();
    if retention < Duration::from_secs(1) {
        return Err(
            "a retention under 1s would delete rows as they are sent; use off to keep them".into(),
        );
    }
    Ok(Retention(Some(retention)))
}

/// The testing twin's name and its flag that makes `run` abort in the crash window (after the PubAcks,
/// before marking anything sent): `None` without the `fault-injection` feature, so that a build
/// without it names neither (the demo asks for them here).
#[cfg(feature = "fault-injection")]
pub const CRASHING_TWIN: Option<(&str, &str)> =
    Some(("waybill-relay-faulty", "--crash-after-publish"));
/// See above: this build has no twin.
#[cfg(not(feature = "fault-injection"))]
pub const CRASHING_TWIN: Option<(&str, &str)> = None;

/// Which binary runs the command line: its name in `--help` and errors, what its help adds, and
/// where its `run` stops on purpose ([`FailPoint::None`] but in the faulty twin).
#[derive(Debug)]
pub struct Program {
    /// The command's name, `waybill-relay` or its twin's.
    pub name: &'static str,
    /// Printed after `--help` and `run --help` (the twin lists its fault flag there).
    pub after_help: Option<&'static str>,
    /// Where every step of `run` stops.
    pub fail_point: FailPoint,
}

impl Program {
    /// `waybill-relay` itself.
    pub fn relay() -> Self {
        Self {
            name: "waybill-relay",
            after_help: None,
            fail_point: FailPoint::None,
        }
    }
}

/// The whole `main` of `program` over `args` (the program's name first): parses them, sets up
/// logging, runs the command and turns the outcome into an exit code.
pub async fn main(args: Vec<OsString>, program: Program) -> ExitCode {
    ops::init_logging("info,sqlx=warn,async_nats=warn");
    let mut command = Cli::command().name(program.name).bin_name(program.name);
    if let Some(after_help) = program.after_help {
        command = command
            .after_help(after_help)
            .mut_subcommand("run", |run| run.after_help(after_help));
    }
    let cli: Cli = ops::command_line::parse_command_from(command, args);
    let json = cli.json;
    match run(cli, program.fail_point).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => ops::report_failure(&error, false, json),
    }
}

async fn run(cli: Cli, fail_point: FailPoint) -> anyhow::Result<()> {
    let stream = StreamSettings {
        name: cli.connection.shared.stream.clone(),
        subject_prefix: cli.connection.shared.subject_prefix.clone(),
        duplicate_window: cli.connection.duplicate_window.into(),
    };
    match cli.command {
        Command::Run(args) => {
            provision_limits(&cli.connection, &stream, false).await?;
            relay_run(&cli.connection, stream, args, cli.json, fail_point).await
        }
        Command::Provision { update } => {
            let limited = provision_limits(&cli.connection, &stream, update).await?;
            let relay = Relay::connect(
                &cli.connection.shared.database.url,
                cli.connection.shared.nats.clone(),
                RelayConfig {
                    stream,
                    ..RelayConfig::default()
                },
            )
            .await?;
            let info = match limited {
                Some(info) => info,
                None => relay.provision(update).await?,
            };
            if cli.json {
                println!(
                    "{}",
                    serde_json::json!({"stream": info.config.name, "subjects": info.config.subjects, "duplicate_window_s": info.config.duplicate_window.as_secs_f64(), "replicas": info.config.num_replicas.max(1), "max_age_s": (!info.config.max_age.is_zero()).then_some(info.config.max_age.as_secs_f64()), "partitions": ops::stream_partitions(&info.config, &cli.connection.shared.subject_prefix), "messages": info.state.messages, "first_sequence": info.state.first_sequence})
                );
            } else {
                let max_age = if info.config.max_age.is_zero() {
                    "no age limit".to_owned()
                } else {
                    format!(
                        "messages kept {}",
                        humantime::format_duration(info.config.max_age)
                    )
                };
                let partitions =
                    ops::stream_partitions(&info.config, &cli.connection.shared.subject_prefix);
                let split = if partitions > 1 {
                    format!(", split into {partitions} partitions by the server")
                } else {
                    String::new()
                };
                println!(
                    "stream {} ready: subjects {:?}{split}, duplicate window {}, {} replica(s), {max_age}, {} messages from sequence {}",
                    info.config.name,
                    info.config.subjects,
                    humantime::format_duration(info.config.duplicate_window),
                    info.config.num_replicas.max(1),
                    info.state.messages,
                    info.state.first_sequence
                );
            }
            Ok(())
        }
        Command::Outbox(command) => {
            let pool = ops::database::connect(
                &cli.connection.shared.database.url,
                "waybill-relay-admin",
                2,
            )
            .await
            .context("connecting to PostgreSQL")?;
            run_outbox(&pool, command, cli.json).await
        }
        Command::Wal(WalCommand::Check { slot, publication }) => {
            wal_check(
                &cli.connection.shared.database.url,
                &slot,
                &publication,
                cli.json,
            )
            .await
        }
    }
}

/// `wal check`: the findings, one line each (or one JSON document); exit 1 when any is missing.
async fn wal_check(url: &str, slot: &str, publication: &str, json: bool) -> anyhow::Result<()> {
    use crate::wal::slot::{Verdict, check, check_name};
    check_name("slot", slot)?;
    check_name("publication", publication)?;
    let pool = ops::database::connect(url, "waybill-relay-wal-check", 1)
        .await
        .context("connecting to PostgreSQL")?;
    let findings = check(&pool, url, slot, publication, true).await?;
    let missing = findings
        .iter()
        .filter(|f| f.verdict == Verdict::Missing)
        .count();
    if json {
        println!(
            "{}",
            serde_json::json!({"ready": missing == 0, "findings": findings})
        );
    } else {
        for finding in &findings {
            let verdict = match finding.verdict {
                Verdict::Ok => "ok",
                Verdict::Warn => "warn",
                Verdict::Missing => "MISSING",
            };
            println!("{verdict:<8} {:<24} {}", finding.check, finding.detail);
        }
    }
    if missing > 0 {
        return Err(ops::AlreadyReported(format!(
            "{missing} prerequisite(s) of --source wal missing"
        ))
        .into());
    }
    Ok(())
}

async fn relay_run(
    connection: &Connection,
    stream: StreamSettings,
    args: RunArgs,
    json: bool,
    fail_point: FailPoint,
) -> anyhow::Result<()> {
    let mut config = RelayConfig {
        stream,
        batch_size: args.batch_size.max(1),
        max_rows: args.max_rows.max(args.batch_size),
        max_claim_bytes: args.max_claim_bytes.max(1),
        max_in_flight: args.max_in_flight.max(1),
        lanes: args.lanes.max(1),
        max_attempts: args.max_attempts.max(1),
        backoff: Backoff::new(args.backoff, DEFAULTS.backoff.jitter()),
        publish_timeout: args.publish_timeout.into(),
        poll_interval: args.poll_interval.into(),
        claim_idle_timeout: args.claim_idle_timeout.into(),
        retention: args.retention.0,
        retention_batch: args.retention_batch.max(1),
        ..RelayConfig::default()
    };
    if let Some(id) = args.relay_id {
        config.relay_id = id;
    }
    if args.source == Source::Poll && !args.once && !args.ignore_slot {
        crate::wal::slot::check_name("slot", &args.slot)?;
        config.stand_by_for_slot = Some(args.slot.clone());
    }
    config.validate().map_err(ops::Refused::new)?;
    if args.source == Source::Wal {
        if args.once {
            return Err(ops::Refused::new(
                "--once drains the outbox by polling; run it without --source wal",
            )
            .into());
        }
        if args.ignore_slot {
            return Err(ops::Refused::new(
                "--ignore-slot is for polling relays standing by for a WAL relay; a relay with --source wal reads the slot itself",
            )
            .into());
        }
        crate::wal::slot::check_name("slot", &args.slot)?;
        crate::wal::slot::check_name("publication", &args.publication)?;
        let url = &connection.shared.database.url;
        crate::wal::slot::replication_config(url, &args.slot, &args.publication)?;
        // What the server lacks is said now, before NATS is needed (the relay checks again).
        let pool = ops::database::connect(url, "waybill-relay-wal-check", 1)
            .await
            .context("connecting to PostgreSQL")?;
        crate::wal::slot::refuse_what_is_missing(&pool, url, &args.slot, &args.publication).await?;
        pool.close().await;
    }
    let relay = Relay::connect(
        &connection.shared.database.url,
        connection.shared.nats.clone(),
        config,
    )
    .await?;
    #[cfg(feature = "fault-injection")]
    let relay = relay.with_fail_point(fail_point);
    // Without the feature there is no other fail point to hand in.
    #[cfg(not(feature = "fault-injection"))]
    let FailPoint::None = fail_point;
    if !args.no_provision {
        relay.provision(false).await?;
    }
    if let Some(listen) = args.metrics_listen {
        let metrics = ops::install_metrics_recorder()?;
        crate::metrics::describe();
        let health_relay = relay.clone();
        let health: ops::HealthCheck = Arc::new(move || {
            let relay = health_relay.clone();
            Box::pin(async move { relay.health().await })
        });
        let bound = ops::serve(
            listen,
            ops::telemetry_routes(metrics, health),
            ops::shutdown_signal(),
        )
        .await?;
        tracing::info!(%bound, "metrics at http://{bound}/metrics");
    }
    tracing::info!(relay_id = %relay.config().relay_id, stream = %relay.config().stream.name, once = args.once, source = ?args.source, "relay starting");
    let summary = if args.once {
        relay.drain().await.context("relay step failed")?
    } else if args.source == Source::Wal {
        let source = crate::wal::WalSource {
            database_url: connection.shared.database.url.clone(),
            slot: args.slot,
            publication: args.publication,
        };
        relay.run_wal(&source, ops::shutdown_signal()).await?
    } else {
        relay.run(ops::shutdown_signal()).await
    };
    if args.once {
        let status = crate::admin::status(relay.pool(), false).await?;
        if json {
            println!(
                "{}",
                serde_json::json!({"summary": summary, "outbox": status})
            );
        } else {
            println!(
                "claimed={} published={} duplicates={} fenced={} divergences={} marked_sent={} failed={} dead={} | still pending={} failed={} dead={}",
                summary.claimed,
                summary.published,
                summary.duplicates,
                summary.fenced,
                summary.divergences,
                summary.marked_sent,
                summary.failed,
                summary.dead,
                status.pending,
                status.failed,
                status.dead
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::Cli;

    /// Two flags with one clap id (the shared connection types flattened side by side) would take each
    /// other's values; clap's own consistency check catches that and every other grammar mistake.
    #[test]
    fn the_command_line_grammar_is_consistent() {
        Cli::command().debug_assert();
    }
}
