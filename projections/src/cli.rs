//! The command line every projection binary shares: `run`, `rebuild`, `redrive`, `parked list|discard`,
//! `held list|release`, plus connection flags. Each binary adds its own read command (`show`, `query`).
//! It has no fault flag: the testing twin `waybill-projection-faulty` (built only with the
//! `fault-injection` feature) reads its own and hands them in as [`Faults`].

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, CommandFactory, Parser, Subcommand};
use serde_json::json;
use sqlx::PgPool;
use uuid::Uuid;

use crate::held::{self, HeldError};
use crate::park::{self, ParkedError};
use crate::partition::Partitions;
use crate::projection::Projection;
use crate::runner::{FailPoint, Runner, RunnerConfig, Tally};

/// The testing twin's name and its flag that breaks the checkpoint check of `run` (for the chaos
/// harness's proof): `None` without the `fault-injection` feature, so that a build without it names
/// neither (the harness asks for them here).
#[cfg(feature = "fault-injection")]
pub const CHECKPOINT_BREAKING_TWIN: Option<(&str, &str)> =
    Some(("waybill-projection-faulty", "--ignore-checkpoint"));
/// See above: this build has no twin.
#[cfg(not(feature = "fault-injection"))]
pub const CHECKPOINT_BREAKING_TWIN: Option<(&str, &str)> = None;

/// The deliberate failures a faulty twin asks for; the projection binaries always run with none.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Faults {
    /// Where `run` or `rebuild` stops on purpose.
    pub fail_point: FailPoint,
    /// `run` applies redelivered events again (a deliberately broken projection, which the chaos
    /// harness must catch); refused without its consent in the environment.
    #[cfg(feature = "fault-injection")]
    pub ignore_checkpoint: bool,
}

/// The command line of a projection binary: connection flags, the commands every projection has, and
/// the binary's own read commands `R`.
#[derive(Debug, Parser)]
#[command(version, max_term_width = 100)]
pub struct Cli<R: Subcommand> {
    #[command(flatten)]
    connection: Connection,

    /// Print machine-readable JSON on standard output.
    #[arg(long, global = true)]
    json: bool,

    #[command(subcommand)]
    command: Command<R>,
}

/// The shared commands and the binary's own.
#[derive(Debug, Subcommand)]
pub enum Command<R: Subcommand> {
    #[command(flatten)]
    Common(Common),
    #[command(flatten)]
    Read(R),
}

/// The whole `main` of a projection binary: parses the command line (named `waybill-<name>` and
/// described by `about`), sets up logging, runs the command — the shared ones here, the binary's own
/// through `read` with a pool on the projection's schema — and turns the outcome into an exit code.
pub async fn main<P: Projection, R: Subcommand + std::fmt::Debug>(
    projection: P,
    about: &'static str,
    read_routes: impl FnOnce(PgPool) -> axum::Router,
    read: impl AsyncFnOnce(R, PgPool, bool) -> anyhow::Result<()>,
) -> ExitCode {
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    main_from(
        args,
        format!("waybill-{}", P::NAME),
        projection,
        about,
        read_routes,
        read,
    )
    .await
}

/// [`main`] of `args` (the program's name first) under the command name `name`.
pub async fn main_from<P: Projection, R: Subcommand + std::fmt::Debug>(
    args: Vec<std::ffi::OsString>,
    name: String,
    projection: P,
    about: &'static str,
    read_routes: impl FnOnce(PgPool) -> axum::Router,
    read: impl AsyncFnOnce(R, PgPool, bool) -> anyhow::Result<()>,
) -> ExitCode {
    let command = Cli::<R>::command().name(name).about(about);
    main_with(
        args,
        command,
        projection,
        read_routes,
        read,
        Faults::default(),
    )
    .await
}

/// [`main_from`] with the command already named and described, and `faults` (only the faulty twin
/// hands in others than none).
pub async fn main_with<P: Projection, R: Subcommand + std::fmt::Debug>(
    args: Vec<std::ffi::OsString>,
    command: clap::Command,
    projection: P,
    read_routes: impl FnOnce(PgPool) -> axum::Router,
    read: impl AsyncFnOnce(R, PgPool, bool) -> anyhow::Result<()>,
    faults: Faults,
) -> ExitCode {
    let cli: Cli<R> = ops::command_line::parse_command_from(command, args);
    ops::init_logging("info,sqlx=warn,async_nats=warn");
    let outcome = match cli.command {
        Command::Common(common) => {
            run_common(
                projection,
                &cli.connection,
                common,
                cli.json,
                read_routes,
                faults,
            )
            .await
        }
        Command::Read(command) => {
            match crate::schema::connect(&cli.connection.shared.database.url, P::NAME, P::TABLES)
                .await
            {
                Ok(pool) => read(command, pool, cli.json).await,
                Err(error) => Err(error.into()),
            }
        }
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => ops::report_failure(&error, false, cli.json),
    }
}

/// Where the projection keeps its state and where it reads events from.
#[derive(Debug, Args)]
pub struct Connection {
    /// The database holding this projection's schema, NATS, and the stream's names.
    #[command(flatten)]
    pub shared: ops::StreamConnection,

    /// Messages applied per database transaction at most.
    #[arg(long, default_value_t = RunnerConfig::default().batch_size, global = true)]
    pub batch_size: usize,

    /// How long the broker waits for an ack before redelivering a message.
    #[arg(long, default_value_t = RunnerConfig::default().ack_wait.into(), global = true)]
    pub ack_wait: humantime::Duration,

    /// Read as if this code knew no version of TYPE above VERSION (e.g. order.placed=2): newer events
    /// are parked exactly as an older binary would park them, and `redrive` without the flag applies
    /// them later. For rehearsing a rollout; repeatable (comma-separated in the environment variable).
    #[arg(long = "max-version", env = "WAYBILL_MAX_VERSIONS", value_name = "TYPE=VERSION", value_delimiter = ',', value_parser = max_version, global = true)]
    pub max_versions: Vec<(String, i32)>,

    /// Split the orders into P partitions by order id (the id as a number, modulo P), each read
    /// through its own durable consumer `<name>-p<K>of<P>`; every instance of the projection must be
    /// given the same P. 1 (the default) is one consumer named after the projection.
    #[arg(
        long,
        env = "WAYBILL_PARTITIONS",
        value_name = "P",
        default_value_t = 1,
        global = true
    )]
    pub partitions: u32,

    /// The event store's database, whose `events` table a consumer that starts (the first run, a
    /// rebuild, a consumer the stream's retention left behind) catches up from before the stream
    /// takes over (default: --database-url). The projection's role needs SELECT on it (`waybill
    /// roles create`); without it, history comes from the stream, which must still hold its first
    /// message. Prefer the environment variable: flags show up in `ps`.
    #[arg(
        long,
        env = "WAYBILL_EVENTS_URL",
        value_name = "URL",
        hide_env_values = true,
        global = true
    )]
    pub events_url: Option<String>,

    /// The partitions this instance applies, 0 to P-1; repeatable, or comma-separated. Without it
    /// (and P > 1), the instances of the projection share the P partitions by themselves through
    /// leases in NATS: start as many as you like, and a dead or frozen one's partitions move to the
    /// others within --lease-time (`run --once` applies all of them). See docs/scale-out.md.
    #[arg(
        long = "partition",
        env = "WAYBILL_PARTITION",
        value_name = "K",
        value_delimiter = ',',
        global = true
    )]
    pub partition: Vec<u32>,

    /// With shared partitions: how long a partition's lease lasts unrenewed, so how long a dead or
    /// frozen instance's partitions wait before another instance takes them (renewed every third
    /// of it).
    #[arg(long, env = "WAYBILL_LEASE_TIME", value_name = "DURATION", default_value = "6s", value_parser = lease_time, global = true)]
    pub lease_time: humantime::Duration,
}

fn lease_time(text: &str) -> Result<humantime::Duration, String> {
    let parsed: humantime::Duration = text.parse().map_err(|error| format!("{error}"))?;
    let time: Duration = parsed.into();
    if time < Duration::from_secs(1) || time > Duration::from_secs(300) {
        return Err(format!(
            "{text} is outside 1s..5m (shorter renews too often to survive a slow broker; longer \
             leaves a dead instance's partitions waiting)"
        ));
    }
    Ok(parsed)
}

fn max_version(text: &str) -> Result<(String, i32), String> {
    let (event_type, version) = text
        .split_once('=')
        .ok_or_else(|| format!("{text:?} is not TYPE=VERSION (e.g. order.placed=2)"))?;
    let event_type = event_type.trim();
    let current = domain::event::current_version(event_type)
        .ok_or_else(|| format!("unknown event type {event_type:?}"))?;
    let version: i32 = version
        .trim()
        .parse()
        .map_err(|_| format!("{version:?} is not a version number"))?;
    if !(1..=current).contains(&version) {
        return Err(format!(
            "{event_type} has versions 1 to {current}; {version} is not one of them"
        ));
    }
    Ok((event_type.to_owned(), version))
}

/// The commands every projection has.
#[derive(Debug, Subcommand)]
pub enum Common {
    /// Consume until SIGTERM/Ctrl-C (or, with --once, until nothing more can be applied).
    Run(RunArgs),
    /// Build the state anew beside the live one — from the event store's history, then the stream
    /// after it — then swap it in and move the live consumers behind it. Refused, changing nothing,
    /// when neither the event store (no SELECT on events) nor the stream (first messages gone)
    /// holds the whole history.
    Rebuild,
    /// Re-apply parked messages (after an upgrade taught the code their shape); reports why each one
    /// that is still parked failed again. Recorded in the operator log.
    Redrive {
        /// Why (kept in the operator log).
        #[arg(long, default_value = "redrive from the command line")]
        reason: String,
        /// At most this many messages, oldest first (default: all).
        #[arg(long)]
        limit: Option<i64>,
        #[command(flatten)]
        operator: Operator,
    },
    /// Poison messages kept with their reason, headers and (the first 64 KiB of) their body.
    #[command(subcommand)]
    Parked(ParkedCommand),
    /// Events waiting in the held table for a predecessor.
    #[command(subcommand)]
    Held(HeldCommand),
}

/// `parked …`.
#[derive(Debug, Subcommand)]
pub enum ParkedCommand {
    /// List parked messages, newest first.
    List {
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: i64,
        /// Only ids below this one (the last id of the previous listing).
        #[arg(long)]
        before: Option<i64>,
        /// Include messages already redriven or discarded.
        #[arg(long)]
        all: bool,
    },
    /// Give up on a parked message on purpose (it will not be redriven); recorded with who and why.
    Discard {
        /// The parked message's id.
        id: i64,
        /// Why (kept in the operator log).
        #[arg(long)]
        reason: String,
        #[command(flatten)]
        operator: Operator,
    },
}

/// `held …`.
#[derive(Debug, Subcommand)]
pub enum HeldCommand {
    /// List held events by order and version, with what each waits for.
    List {
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: i64,
        /// Continue after this `ORDER_ID:VERSION` (the last one of the previous listing).
        #[arg(long, value_parser = parse_position)]
        after: Option<(Uuid, i64)>,
    },
    /// Skip an order's missing versions deliberately and apply the events held behind them; recorded
    /// with who and why.
    Release {
        /// The order.
        aggregate: Uuid,
        /// Why (kept in the operator log).
        #[arg(long)]
        reason: String,
        #[command(flatten)]
        operator: Operator,
    },
}

/// Who acts, for the operator log.
#[derive(Debug, Args)]
pub struct Operator {
    /// Who is acting (default: $USER).
    #[arg(long = "by", env = "WAYBILL_OPERATOR")]
    pub by: Option<String>,
}

impl Operator {
    fn name(&self) -> Result<String, ops::Refused> {
        self.by
            .clone()
            .or_else(|| std::env::var("USER").ok())
            .filter(|name| !name.trim().is_empty())
            .ok_or_else(|| {
                ops::Refused::new("say who is acting with --by (or WAYBILL_OPERATOR, or USER)")
            })
    }
}

fn parse_position(text: &str) -> Result<(Uuid, i64), String> {
    let (id, version) = text
        .split_once(':')
        .ok_or_else(|| format!("{text:?} is not ORDER_ID:VERSION"))?;
    let id = Uuid::parse_str(id).map_err(|e| format!("order id {id:?}: {e}"))?;
    let version = version
        .parse()
        .map_err(|e| format!("version {version:?}: {e}"))?;
    Ok((id, version))
}

/// `run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// Consume until nothing more can be applied, print what is held and parked, and exit 0.
    #[arg(long)]
    pub once: bool,

    /// Serve the read API here (its own address: exposing metrics must not expose customer data).
    #[arg(long, env = "WAYBILL_LISTEN", value_name = "ADDR")]
    pub listen: Option<SocketAddr>,

    /// Serve Prometheus metrics at /metrics and a health check at /health here.
    #[arg(long, env = "WAYBILL_METRICS_LISTEN", value_name = "ADDR")]
    pub metrics_listen: Option<SocketAddr>,

    /// Enables the operator API on the --listen address (POST /operator/redrive,
    /// /operator/parked/{id}/discard, /operator/held/{order}/release — what the console's buttons
    /// call), each call then requiring `Authorization: Bearer <token>`. Without it the API only reads.
    /// At least 16 characters; prefer the environment variable (flags show up in `ps`).
    #[arg(long, env = "WAYBILL_OPERATOR_TOKEN", hide_env_values = true, value_parser = ops::OperatorToken::parse)]
    pub operator_token: Option<ops::OperatorToken>,
}

impl Connection {
    /// The runner settings these flags describe; refused (exit 2) when `--partition` names a
    /// partition not below `--partitions`.
    pub fn runner_config(&self) -> Result<RunnerConfig, ops::Refused> {
        let partitions =
            Partitions::new(self.partitions, &self.partition).map_err(ops::Refused::new)?;
        Ok(RunnerConfig {
            stream: self.shared.stream.clone(),
            subject_prefix: self.shared.subject_prefix.clone(),
            batch_size: self.batch_size.max(1),
            ack_wait: self.ack_wait.into(),
            max_versions: self.max_versions.clone(),
            share: partitions.count() > 1 && self.partition.is_empty(),
            lease_time: self.lease_time.into(),
            partitions,
            events_url: self.events_url.clone(),
            ..RunnerConfig::default()
        })
    }
}

/// Runs a shared command for projection `P`, with `faults` (none but in the faulty twin).
/// `read_routes` are served by `run --listen`.
pub async fn run_common<P: Projection>(
    projection: P,
    connection: &Connection,
    command: Common,
    json_output: bool,
    read_routes: impl FnOnce(PgPool) -> axum::Router,
    faults: Faults,
) -> anyhow::Result<()> {
    let mut config = connection.runner_config()?;
    #[cfg(feature = "fault-injection")]
    apply_faults(P::NAME, &command, faults)?;
    config.fail_point = faults.fail_point;
    let runner = Arc::new(
        Runner::connect(
            projection,
            &connection.shared.database.url,
            connection.shared.nats.clone(),
            config,
        )
        .await?,
    );
    if !matches!(command, Common::Rebuild) {
        crate::schema::check_layout(runner.pool(), P::NAME).await?;
    }
    match command {
        Common::Run(args) => {
            if let Some(listen) = args.listen {
                let operator = args.operator_token.is_some();
                let routes = read_routes(runner.pool().clone()).merge(crate::operator_api::routes(
                    runner.clone(),
                    args.operator_token.clone(),
                ));
                let bound = ops::serve(listen, routes, ops::shutdown_signal())
                    .await
                    .with_context(|| format!("serving the read API on {listen}"))?;
                tracing::info!(%bound, projection = P::NAME, operator, "read API at http://{bound}");
            }
            if let Some(listen) = args.metrics_listen {
                serve_telemetry(&runner, listen).await?;
            }
            let lag = tokio::spawn(refresh_gauges(runner.clone()));
            tracing::info!(
                projection = P::NAME,
                once = args.once,
                partitions = %runner.config().partitions,
                "projection starting"
            );
            let mut progress = Progress::new(P::NAME);
            let tally = runner
                .run(ops::shutdown_signal(), args.once, |tally| {
                    progress.log(tally)
                })
                .await?;
            lag.abort();
            print_summary(&runner, "consumed", &tally, json_output).await?;
        }
        Common::Rebuild => {
            let total = runner.history_size().await;
            let bar =
                indicatif::ProgressBar::new(total).with_message(format!("rebuilding {}", P::NAME));
            bar.set_style(
                indicatif::ProgressStyle::with_template(
                    "{msg} [{bar:40}] {pos}/{len} events, {per_sec}, eta {eta}",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            let mut progress = Progress::new(P::NAME);
            let tally = runner
                .rebuild(|tally| {
                    bar.set_position(tally.messages);
                    if bar.is_hidden() {
                        progress.log(tally);
                    }
                })
                .await?;
            bar.finish_and_clear();
            print_summary(&runner, "rebuilt from", &tally, json_output).await?;
        }
        Common::Redrive {
            reason,
            limit,
            operator,
        } => {
            // A redrive only re-applies what the code now understands; unlike a discard or a release
            // it decides nothing, so an unnamed operator is recorded as such rather than refused.
            let actor = operator.name().unwrap_or_else(|_| "unnamed".to_owned());
            let request = crate::park::RedriveRequest {
                actor: &actor,
                reason: &reason,
                limit: limit.map(|n| n.max(1)),
            };
            let report = runner.redrive(&request).await?;
            if json_output {
                println!("{}", json!({"projection": P::NAME, "redriven": report}));
            } else if report.is_empty() {
                println!("nothing parked to redrive");
            } else {
                for r in report {
                    println!(
                        "{:>6}  {:<10} {}",
                        r.id,
                        format!("{:?}", r.outcome).to_lowercase(),
                        r.reason.unwrap_or_default()
                    );
                }
            }
        }
        Common::Parked(ParkedCommand::List { limit, before, all }) => {
            let parked = park::list(runner.pool(), limit, before, all).await?;
            if json_output {
                println!("{}", serde_json::to_string(&parked)?);
            } else if parked.is_empty() {
                println!("nothing parked");
            } else {
                for p in parked {
                    println!(
                        "{:>6}  seq {:<8} {}  {}",
                        p.id,
                        p.stream_sequence.map_or("-".into(), |s| s.to_string()),
                        p.subject,
                        p.reason
                    );
                }
            }
        }
        Common::Parked(ParkedCommand::Discard {
            id,
            reason,
            operator,
        }) => {
            let done = runner.discard(id, &operator.name()?, &reason).await?;
            if json_output {
                println!("{done}");
            } else {
                println!(
                    "parked message {id} discarded ({} event(s) of its order still held)",
                    done["held_behind"]
                );
            }
        }
        Common::Held(HeldCommand::List { limit, after }) => {
            let held = held::list(runner.pool(), limit, after).await?;
            if json_output {
                println!("{}", serde_json::to_string(&held)?);
            } else if held.is_empty() {
                println!("nothing held");
            } else {
                for h in held {
                    println!(
                        "{}:{}  since {}  {}",
                        h.aggregate_id,
                        h.version,
                        h.since.format("%F %T"),
                        h.reason
                    );
                }
            }
        }
        Common::Held(HeldCommand::Release {
            aggregate,
            reason,
            operator,
        }) => {
            let done = runner
                .release(aggregate, &operator.name()?, &reason)
                .await?;
            if json_output {
                println!("{done}");
            } else {
                println!(
                    "order {aggregate}: skipped versions {}..={}, applied through version {}, {} still held",
                    done["skipped_from"],
                    done["skipped_to"],
                    done["applied_through"],
                    done["still_held"]
                );
            }
        }
    }
    Ok(())
}

/// Why `run --metrics-listen` could not serve metrics.
#[derive(Debug, thiserror::Error)]
enum TelemetryError {
    #[error("installing the metrics recorder")]
    Recorder(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("serving metrics on {listen}")]
    Serve {
        listen: SocketAddr,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

async fn serve_telemetry<P: Projection>(
    runner: &Arc<Runner<P>>,
    listen: SocketAddr,
) -> Result<(), TelemetryError> {
    let metrics = ops::install_metrics_recorder()
        .map_err(|source| TelemetryError::Recorder(source.into()))?;
    crate::metrics::describe();
    if !runner.config().share {
        crate::metrics::record_owned(P::NAME, &runner.config().partitions);
    }
    let health_runner = runner.clone();
    let health: ops::HealthCheck = Arc::new(move || {
        let runner = health_runner.clone();
        Box::pin(async move {
            let database = sqlx::query("SELECT 1").execute(runner.pool()).await.is_ok();
            let nats =
                runner.client().connection_state() == async_nats::connection::State::Connected;
            let config = runner.config();
            (
                database && nats,
                json!({"projection": P::NAME, "database": database, "nats": nats,
                       "instance": runner.instance(),
                       "partitions": {"count": config.partitions.count(),
                                      "owned": runner.owned_partitions(),
                                      "shared": config.share}}),
            )
        })
    });
    let router = ops::telemetry_routes(metrics, health);
    let bound = ops::serve(listen, router, ops::shutdown_signal())
        .await
        .map_err(|source| TelemetryError::Serve {
            listen,
            source: source.into(),
        })?;
    tracing::info!(%bound, projection = P::NAME, "metrics at http://{bound}/metrics");
    Ok(())
}

/// Refreshes the lag, held and parked gauges every 5 s.
async fn refresh_gauges<P: Projection>(runner: Arc<Runner<P>>) {
    loop {
        let partitions = &runner.config().partitions;
        let mut total = Some((0, 0));
        for partition in runner.owned_partitions() {
            match runner.lag_of(&runner.partition_consumer(partition)).await {
                Ok((pending, ack_pending)) => {
                    if !partitions.is_single() {
                        crate::metrics::record_partition_lag(
                            P::NAME,
                            partitions.label(partition),
                            pending,
                            ack_pending,
                        );
                    }
                    total = total.map(|(p, a)| (p + pending, a + ack_pending));
                }
                Err(_) => total = None,
            }
        }
        if let Some((pending, ack_pending)) = total {
            crate::metrics::record_lag(P::NAME, pending, ack_pending);
        }
        if let (Ok(held), Ok(parked)) = (
            held::stats(runner.pool()).await,
            park::open_count(runner.pool()).await,
        ) {
            crate::metrics::record_backlog(P::NAME, &held, parked);
        }
        tokio::time::sleep(Duration::from_secs(5)).await;
    }
}

/// Why a summary could not be printed: what is held or parked could not be read.
#[derive(Debug, thiserror::Error)]
enum SummaryError {
    #[error(transparent)]
    Held(#[from] HeldError),
    #[error(transparent)]
    Parked(#[from] ParkedError),
}

/// What a run or rebuild did, and what it leaves held and parked (the first 20 of each).
async fn print_summary<P: Projection>(
    runner: &Runner<P>,
    verb: &str,
    tally: &Tally,
    json_output: bool,
) -> Result<(), SummaryError> {
    let stats = held::stats(runner.pool()).await?;
    let held = held::list(runner.pool(), 20, None).await?;
    let parked_open = park::open_count(runner.pool()).await?;
    let parked = park::list(runner.pool(), 20, None, false).await?;
    if json_output {
        let parked: Vec<_> = parked
            .iter()
            .map(|p| {
                json!({"id": p.id, "event_id": p.event_id, "aggregate_id": p.aggregate_id,
                            "aggregate_version": p.aggregate_version, "reason": p.reason})
            })
            .collect();
        let mut summary = json!({
            "projection": P::NAME,
            "tally": tally,
            "held": {"count": stats.count, "aggregates": stats.aggregates,
                     "oldest_seconds": stats.oldest_seconds, "first": held},
            "parked": {"count": parked_open, "first": parked},
        });
        let partitions = &runner.config().partitions;
        if !partitions.is_single() {
            summary["partitions"] =
                json!({"count": partitions.count(), "owned": partitions.owned()});
        }
        println!("{summary}");
    } else {
        println!(
            "{}: {verb} {} messages{}: applied={} duplicates={} held={} parked={}{}",
            P::NAME,
            tally.messages,
            if tally.from_store > 0 {
                format!(" ({} from the event store)", tally.from_store)
            } else {
                String::new()
            },
            tally.applied,
            tally.duplicates,
            tally.held,
            tally.parked,
            if runner.config().partitions.is_single() {
                String::new()
            } else {
                format!(
                    " (partitions {}; {} other partitions' messages skipped)",
                    runner.config().partitions,
                    tally.skipped
                )
            }
        );
        println!(
            "held now: {} event(s) of {} order(s); parked now: {parked_open}",
            stats.count, stats.aggregates
        );
        for h in &held {
            println!("  held   {}:{}  {}", h.aggregate_id, h.version, h.reason);
        }
        for p in &parked {
            println!("  parked {:>6}  {}", p.id, p.reason);
        }
    }
    Ok(())
}

/// Refuses a fault that the command would never reach (a `run` fault given to `rebuild`, or the
/// reverse), and breaks this process's checkpoint check when asked — only with its consent in the
/// environment, so that a pasted command line cannot break a real projection.
#[cfg(feature = "fault-injection")]
fn apply_faults(projection: &str, command: &Common, faults: Faults) -> Result<(), ops::Refused> {
    let for_run = faults.ignore_checkpoint || faults.fail_point == FailPoint::AbortAfterCommit;
    let for_rebuild = matches!(
        faults.fail_point,
        FailPoint::FailBeforeSwap
            | FailPoint::AbortAfterSwap
            | FailPoint::AbortAfterFirstConsumerMoved
    );
    match command {
        Common::Run(_) if for_rebuild => {
            return Err(ops::Refused::new(format!(
                "{:?} stops a rebuild; `run` never reaches it",
                faults.fail_point
            )));
        }
        Common::Rebuild if for_run => {
            return Err(ops::Refused::new(
                "--crash-after-commit and --ignore-checkpoint are faults of `run`, not `rebuild`",
            ));
        }
        Common::Run(_) | Common::Rebuild => {}
        _ if for_run || for_rebuild => {
            return Err(ops::Refused::new(
                "the fault flags apply to `run` and `rebuild` only",
            ));
        }
        _ => {}
    }
    if faults.ignore_checkpoint {
        if std::env::var(crate::plan::BREAK_CHECKPOINT_VAR).as_deref()
            != Ok(crate::plan::BREAK_CHECKPOINT_CONSENT)
        {
            return Err(ops::Refused::new(format!(
                "--ignore-checkpoint applies events twice on purpose; it runs only with {}={}",
                crate::plan::BREAK_CHECKPOINT_VAR,
                crate::plan::BREAK_CHECKPOINT_CONSENT
            )));
        }
        tracing::error!(
            projection,
            "deliberately broken: redelivered events will be applied again (--ignore-checkpoint)"
        );
        crate::plan::ignore_checkpoint();
    }
    Ok(())
}

/// An info line every 10 s while messages flow.
struct Progress {
    projection: &'static str,
    last: Instant,
    messages_at_last: u64,
}

impl Progress {
    fn new(projection: &'static str) -> Self {
        Self {
            projection,
            last: Instant::now(),
            messages_at_last: 0,
        }
    }

    fn log(&mut self, tally: &Tally) {
        let elapsed = self.last.elapsed();
        if elapsed < Duration::from_secs(10) {
            return;
        }
        let rate = (tally.messages - self.messages_at_last) as f64 / elapsed.as_secs_f64();
        tracing::info!(
            projection = self.projection,
            applied = tally.applied,
            duplicates = tally.duplicates,
            held = tally.held,
            parked = tally.parked,
            rate_per_s = rate.round(),
            "consuming"
        );
        self.last = Instant::now();
        self.messages_at_last = tally.messages;
    }
}
