//! `waybill-console`: the operator console as a service of its own, on its own address and its own
//! database role.

use std::net::SocketAddr;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use waybill_console::{ConsoleConfig, Database, Endpoint, ProjectionApi};

/// waybill-console: the pipeline, every order's events and the event catalog in a browser.
///
/// A service of the read side: it reads the event store, the outbox and the projections' bookkeeping
/// tables (as a login member of the database role waybill_console, see `waybill roles create`), the
/// stream and consumers from NATS, and the relays' /metrics. It changes nothing unless it has an
/// operator token; then dead outbox rows can be replayed from it, and parked or held events redriven,
/// discarded or released through each projection's operator API, every request with
/// `Authorization: Bearer <token>`. It listens on loopback unless told otherwise: it shows every
/// order and every parked body, so give it an operators' address, never the public API's. Exit
/// codes: 0 stopped, 2 refused input, 1 failure.
#[derive(Debug, Parser)]
#[command(name = "waybill-console", version, max_term_width = 100)]
struct Cli {
    /// The event store's database (the projections' schemas are read there too), NATS and the stream.
    #[command(flatten)]
    connection: ops::StreamConnection,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve the console until SIGTERM/Ctrl-C.
    #[command(visible_alias = "serve")]
    Run(RunArgs),
}

#[derive(Debug, Args)]
struct RunArgs {
    /// Address of the console's pages, its JSON and /health. Not the order service's: the console
    /// shows every order and every parked body, so keep it on loopback or an operators' network.
    #[arg(long, env = "WAYBILL_CONSOLE_LISTEN", default_value = "127.0.0.1:8090")]
    listen: SocketAddr,

    /// Enables the console's state-changing actions (replaying dead outbox rows; with
    /// --projection-api, redrive, discard and release), each of which then requires
    /// `Authorization: Bearer <token>`. Without it the console only reads and opens no session that
    /// could write. At least 16 characters; prefer the environment variable (flags show up in `ps`).
    #[arg(long, env = "WAYBILL_OPERATOR_TOKEN", hide_env_values = true, value_parser = ops::OperatorToken::parse)]
    operator_token: Option<ops::OperatorToken>,

    /// A relay's metrics endpoint (`waybill-relay run --metrics-listen`), e.g.
    /// http://127.0.0.1:9464/metrics: the console scrapes it with each sample (1 s timeout) for the
    /// counters only the relays keep — duplicate PubAcks and fenced publishes — and shows them per
    /// relay and in total. Repeat it once per relay (comma-separated in the environment variable).
    #[arg(long = "relay-metrics", env = "WAYBILL_RELAY_METRICS", value_name = "URL", value_delimiter = ',', value_parser = waybill_console::metrics_url)]
    relay_metrics: Vec<Endpoint>,

    /// A projection's operator API, as NAME=URL (e.g. inventory=http://127.0.0.1:8081, its
    /// `run --listen` address): the console's redrive, discard and release buttons call it with this
    /// console's operator token, so start the projection with the same one. Repeat it once per
    /// projection (comma-separated in the environment variable). Without it, the console shows the
    /// command to run instead.
    #[arg(long = "projection-api", env = "WAYBILL_PROJECTION_APIS", value_name = "NAME=URL", value_delimiter = ',', value_parser = ProjectionApi::parse)]
    projection_apis: Vec<ProjectionApi>,
}

#[tokio::main]
async fn main() -> ExitCode {
    ops::init_logging("info,sqlx=warn,async_nats=warn");
    let cli = Cli::parse();
    match run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => ops::report_failure(&error, false, false),
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let Command::Run(args) = cli.command;
    let connection = cli.connection;
    let database_url = &connection.database.url;
    let database = Database::connect(database_url, args.operator_token.is_some())
        .await
        .with_context(|| {
            format!(
                "the console cannot use PostgreSQL at {}",
                ops::redact_url(database_url)
            )
        })?;
    tracing::info!(
        nats = %connection.nats.shown(),
        stream = %connection.stream,
        actions = args.operator_token.is_some(),
        relays_scraped = args.relay_metrics.len(),
        projection_apis = args.projection_apis.len(),
        "console starting"
    );
    let config = ConsoleConfig {
        nats: Some(connection.nats),
        stream: connection.stream,
        subject_prefix: connection.subject_prefix,
        operator_token: args.operator_token,
        relay_metrics: args.relay_metrics,
        projection_apis: args.projection_apis,
    };
    let served = ops::serve_with(
        args.listen,
        waybill_console::router(database, config),
        ops::shutdown_signal(),
        ops::EdgeConfig::default(),
    )
    .await
    .with_context(|| format!("cannot listen on {} for the console", args.listen))?;
    tracing::info!(console = %served.address, "console listening");
    served.stopped().await;
    Ok(())
}
