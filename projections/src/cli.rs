//! The command line every projection binary shares: `run`, `rebuild`, `redrive`, `parked list`, plus
//! connection flags. Each binary adds its own read command (`show`, `query`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};
use serde_json::json;
use sqlx::{PgPool, Row};

use crate::projection::Projection;
use crate::runner::{FailPoint, Runner, RunnerConfig, Tally};

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
    let matches = Cli::<R>::command()
        .name(format!("waybill-{}", P::NAME))
        .about(about)
        .get_matches();
    let cli = match Cli::<R>::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(error) => error.exit(),
    };
    ops::init_logging("info,sqlx=warn,async_nats=warn");
    let outcome = match cli.command {
        Command::Common(common) => {
            run_common(projection, &cli.connection, common, cli.json, read_routes).await
        }
        Command::Read(command) => {
            match crate::schema::connect(&cli.connection.database_url, P::NAME, P::TABLES).await {
                Ok(pool) => read(command, pool, cli.json).await,
                Err(error) => Err(error),
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
    /// PostgreSQL URL of the database holding this projection's schema (it may be its own database).
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "postgres://127.0.0.1:5432/waybill",
        global = true,
        hide_env_values = true
    )]
    pub database_url: String,

    /// NATS server URL.
    #[arg(
        long,
        env = "NATS_URL",
        default_value = "nats://127.0.0.1:4222",
        global = true
    )]
    pub nats_url: String,

    /// JetStream stream the relay publishes into.
    #[arg(long, env = "WAYBILL_STREAM", default_value = domain::wire::DEFAULT_STREAM, global = true)]
    pub stream: String,

    /// Subject prefix the relay publishes under.
    #[arg(long, env = "WAYBILL_SUBJECT_PREFIX", default_value = domain::wire::DEFAULT_SUBJECT_PREFIX, global = true)]
    pub subject_prefix: String,

    /// Messages applied per database transaction at most.
    #[arg(long, default_value_t = 500, global = true)]
    pub batch_size: usize,

    /// How long the broker waits for an ack before redelivering a message.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration, global = true)]
    pub ack_wait: Duration,
}

/// The commands every projection has.
#[derive(Debug, Subcommand)]
pub enum Common {
    /// Consume until SIGTERM/Ctrl-C (or, with --once, until nothing is pending).
    Run(RunArgs),
    /// Wipe the projection's state and replay the stream from its start, with a progress bar.
    Rebuild,
    /// Re-apply parked messages (after an upgrade taught the code their shape).
    Redrive,
    /// Poison messages kept with their raw bytes, headers and reason.
    #[command(subcommand)]
    Parked(ParkedCommand),
}

/// `parked …`.
#[derive(Debug, Subcommand)]
pub enum ParkedCommand {
    /// List parked messages, newest first.
    List {
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: i64,
        /// Include messages already redriven.
        #[arg(long)]
        all: bool,
    },
}

/// `run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// Consume until nothing is pending, print a summary and exit 0.
    #[arg(long)]
    pub once: bool,

    /// Serve Prometheus metrics at /metrics, a health check at /health (and the read API) here.
    #[arg(long, env = "WAYBILL_METRICS_LISTEN", value_name = "ADDR")]
    pub metrics_listen: Option<SocketAddr>,

    /// Testing only: abort after a batch commits, before acking it.
    #[arg(long, hide = true)]
    pub crash_after_commit: bool,
}

impl Connection {
    /// The runner settings these flags describe.
    pub fn runner_config(&self) -> RunnerConfig {
        RunnerConfig {
            stream: self.stream.clone(),
            subject_prefix: self.subject_prefix.clone(),
            batch_size: self.batch_size.max(1),
            ack_wait: self.ack_wait,
            ..RunnerConfig::default()
        }
    }
}

/// Runs a shared command for projection `P`. `read_routes` are served next to the metrics by `run`.
pub async fn run_common<P: Projection>(
    projection: P,
    connection: &Connection,
    command: Common,
    json_output: bool,
    read_routes: impl FnOnce(PgPool) -> axum::Router,
) -> anyhow::Result<()> {
    let mut config = connection.runner_config();
    if let Common::Run(args) = &command
        && args.crash_after_commit
    {
        config.fail_point = FailPoint::AbortAfterCommit;
    }
    let runner = Arc::new(
        Runner::connect(
            projection,
            &connection.database_url,
            &connection.nats_url,
            config,
        )
        .await?,
    );
    match command {
        Common::Run(args) => {
            if let Some(listen) = args.metrics_listen {
                serve_telemetry(&runner, listen, read_routes(runner.pool().clone())).await?;
            }
            let lag = tokio::spawn(refresh_lag(runner.clone()));
            tracing::info!(
                projection = P::NAME,
                once = args.once,
                "projection starting"
            );
            let mut progress = Progress::new(P::NAME);
            let tally = runner
                .run(ops::shutdown_signal(), args.once, |tally| {
                    progress.log(tally)
                })
                .await?;
            lag.abort();
            print_tally(P::NAME, "consumed", &tally, json_output);
        }
        Common::Rebuild => {
            let total = runner.stream_messages().await.unwrap_or(0);
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
            print_tally(P::NAME, "rebuilt from", &tally, json_output);
        }
        Common::Redrive => {
            let (resolved, remaining) = runner.redrive().await?;
            if json_output {
                println!(
                    "{}",
                    json!({"resolved": resolved, "still_parked": remaining})
                );
            } else {
                println!("redrove {resolved} parked message(s); {remaining} still parked");
            }
        }
        Common::Parked(ParkedCommand::List { limit, all }) => {
            let parked = list_parked(runner.pool(), limit, all).await?;
            if json_output {
                println!("{}", serde_json::Value::Array(parked));
            } else if parked.is_empty() {
                println!("nothing parked");
            } else {
                for p in parked {
                    println!(
                        "{:>6}  seq {}  {}  {}",
                        p["id"], p["stream_sequence"], p["subject"], p["reason"]
                    );
                }
            }
        }
    }
    Ok(())
}

async fn serve_telemetry<P: Projection>(
    runner: &Arc<Runner<P>>,
    listen: SocketAddr,
    read: axum::Router,
) -> anyhow::Result<()> {
    let metrics = ops::install_metrics_recorder()?;
    crate::metrics::describe();
    let health_runner = runner.clone();
    let health: ops::HealthCheck = Arc::new(move || {
        let runner = health_runner.clone();
        Box::pin(async move {
            let database = sqlx::query("SELECT 1").execute(runner.pool()).await.is_ok();
            let nats =
                runner.client().connection_state() == async_nats::connection::State::Connected;
            (
                database && nats,
                json!({"projection": P::NAME, "database": database, "nats": nats}),
            )
        })
    });
    let router = ops::telemetry_routes(metrics, health).merge(read);
    let bound = ops::serve(listen, router, ops::shutdown_signal()).await?;
    tracing::info!(%bound, projection = P::NAME, "metrics at http://{bound}/metrics");
    Ok(())
}

async fn refresh_lag<P: Projection>(runner: Arc<Runner<P>>) {
    loop {
        if let Ok((pending, ack_pending)) = runner.lag().await {
            crate::metrics::record_lag(P::NAME, pending, ack_pending);
        }
        tokio::time::sleep(Duration::from_secs(5)).await;
    }
}

async fn list_parked(
    pool: &PgPool,
    limit: i64,
    all: bool,
) -> anyhow::Result<Vec<serde_json::Value>> {
    let rows = sqlx::query(
        "SELECT id, stream_sequence, subject, headers, reason, event_id, aggregate_id, aggregate_version,
                parked_at, redriven_at, redrive_note, encode(body, 'escape') AS body
         FROM parked WHERE $2 OR redriven_at IS NULL ORDER BY id DESC LIMIT $1",
    )
    .bind(limit)
    .bind(all)
    .fetch_all(pool)
    .await
    .context("listing parked messages")?;
    rows.iter()
        .map(|r| {
            Ok(json!({
                "id": r.try_get::<i64, _>("id")?,
                "stream_sequence": r.try_get::<Option<i64>, _>("stream_sequence")?,
                "subject": r.try_get::<String, _>("subject")?,
                "headers": r.try_get::<serde_json::Value, _>("headers")?,
                "reason": r.try_get::<String, _>("reason")?,
                "event_id": r.try_get::<Option<uuid::Uuid>, _>("event_id")?,
                "aggregate_id": r.try_get::<Option<uuid::Uuid>, _>("aggregate_id")?,
                "aggregate_version": r.try_get::<Option<i64>, _>("aggregate_version")?,
                "parked_at": r.try_get::<chrono::DateTime<chrono::Utc>, _>("parked_at")?,
                "redriven_at": r.try_get::<Option<chrono::DateTime<chrono::Utc>>, _>("redriven_at")?,
                "redrive_note": r.try_get::<Option<String>, _>("redrive_note")?,
                "body": r.try_get::<String, _>("body")?,
            }))
        })
        .collect()
}

fn print_tally(projection: &str, verb: &str, tally: &Tally, json_output: bool) {
    if json_output {
        println!("{}", json!({"projection": projection, "tally": tally}));
    } else {
        println!(
            "{projection}: {verb} {} messages: applied={} duplicates={} gaps={} parked={}",
            tally.messages, tally.applied, tally.duplicates, tally.gaps, tally.parked
        );
    }
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
            gaps = tally.gaps,
            parked = tally.parked,
            rate_per_s = rate.round(),
            "consuming"
        );
        self.last = Instant::now();
        self.messages_at_last = tally.messages;
    }
}
