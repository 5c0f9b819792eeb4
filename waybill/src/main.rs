//! `waybill`: the command side and administration of the order service.

mod catalog;
mod cli;
mod demo;
mod failure;
mod http;
mod load;
mod migrate;
mod openapi;
mod orders;

use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use store::EventStore;

use crate::cli::{Cli, Command, OrderCommand};
use crate::failure::{Failure, redact};

/// Replaces this process with the sibling binary `program` running `command ARGS` (as `cargo foo` runs
/// `cargo-foo`), so the order service's binary links none of the tools; returns only on failure.
fn hand_over(program: &str, command: &str, args: &[String]) -> anyhow::Error {
    use std::os::unix::process::CommandExt;
    let path = match std::env::current_exe() {
        Ok(here) => here.with_file_name(program),
        Err(error) => return anyhow::Error::new(error).context("cannot tell where waybill lives"),
    };
    if !path.is_file() {
        return anyhow::anyhow!(
            "{} is missing: build it with `cargo build --workspace --bins`",
            path.display()
        );
    }
    let error = std::process::Command::new(&path)
        .arg(command)
        .args(args)
        .exec();
    anyhow::Error::new(error).context(format!("cannot run {}", path.display()))
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    // Long-running services say what they do; one-shot commands only warn.
    ops::init_logging(match cli.command {
        Command::Serve(_) => "info,sqlx=warn",
        Command::Demo(_) | Command::Services(_) | Command::Load(_) => {
            "warn,relay=error,projections=error"
        }
        _ => "warn",
    });
    let json = cli.json;
    match run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => failure.report(json),
    }
}

async fn run(cli: Cli) -> Result<(), Failure> {
    match cli.command {
        Command::Chaos { mut args } => {
            // `--json` is one of this program's global flags: clap took it, so pass it on.
            if cli.json {
                args.push("--json".to_owned());
            }
            Err(hand_over("waybill-lab", "chaos", &args).into())
        }
        Command::Migrate => migrate::run(&cli.database_url, cli.json).await,
        Command::Serve(args) => serve(&cli.database_url, args).await.map_err(Failure::from),
        Command::Demo(args) => demo::run(&cli.database_url, args)
            .await
            .map_err(Failure::from),
        Command::Services(args) => services(&cli.database_url, args)
            .await
            .map_err(Failure::from),
        Command::Load(args) => load::run(&cli.database_url, args, cli.json)
            .await
            .map_err(Failure::from),
        Command::Schema(args) => {
            let document = if args.asyncapi {
                catalog::asyncapi(&args.stream, &args.subject_prefix)
            } else {
                catalog::schemas()
            };
            println!(
                "{}",
                serde_json::to_string_pretty(&document).context("encoding the catalog")?
            );
            Ok(())
        }
        Command::Outbox(command) => {
            let pool = store::connect(&cli.database_url, "waybill-outbox", 2)
                .await
                .with_context(|| {
                    format!(
                        "cannot connect to PostgreSQL at {}",
                        redact(&cli.database_url)
                    )
                })?;
            relay::cli::run_outbox(&pool, command, cli.json)
                .await
                .map_err(Failure::from)
        }
        Command::Roles(cli::RolesCommand::Create) => roles_create(&cli.database_url, cli.json)
            .await
            .map_err(Failure::from),
        Command::Order(command) => order_command(&cli.database_url, command, cli.json).await,
    }
}

/// `waybill roles create`: the least-privilege group roles, and what was done.
async fn roles_create(database_url: &str, json: bool) -> anyhow::Result<()> {
    let pool = store::connect(database_url, "waybill-roles", 1)
        .await
        .with_context(|| format!("cannot connect to PostgreSQL at {}", redact(database_url)))?;
    let done = store::roles::create_roles(&pool)
        .await
        .map_err(failure::with_hint)
        .context("creating the roles (this needs the database's owner, with CREATEROLE)")?;
    if json {
        println!(
            "{}",
            serde_json::json!({"roles": store::roles::ROLES, "statements": done})
        );
    } else {
        for statement in &done {
            println!("{statement}");
        }
        println!("roles ready: {}", store::roles::ROLES.join(", "));
    }
    Ok(())
}

/// `waybill services`: private PostgreSQL and NATS where the configured ones do not answer.
async fn services(database_url: &str, args: cli::ServicesArgs) -> anyhow::Result<()> {
    let services = demo::services::Services::ensure(database_url, &args.nats_url)?;
    // The database's name as PostgreSQL reads it (a `?sslmode=…` after it is no part of the name).
    let options = store::connect_options(database_url).context("reading --database-url")?;
    let database = options.get_database().unwrap_or("waybill").to_owned();
    let exports = format!(
        "export DATABASE_URL='{}'\nexport NATS_URL='{}'\n",
        services.database_url(&database),
        services.nats_url
    );
    for line in services.describe() {
        eprintln!("{line}");
    }
    print!("{exports}");
    if let Some(file) = &args.env_file {
        std::fs::write(file, &exports).with_context(|| format!("writing {}", file.display()))?;
    }
    ops::shutdown_signal().await;
    drop(services);
    Ok(())
}

/// `waybill serve`: the HTTP order service, and its metrics and health check on their own listener.
async fn serve(database_url: &str, args: cli::ServeArgs) -> anyhow::Result<()> {
    let pool = store::connect(database_url, "waybill-serve", 16)
        .await
        .with_context(|| format!("cannot connect to PostgreSQL at {}", redact(database_url)))?;
    sqlx::query("SELECT 1 FROM events LIMIT 1")
        .execute(&pool)
        .await
        .map_err(failure::with_hint)?;
    let notifier = store::OutboxNotifier::spawn(pool.clone(), std::time::Duration::from_millis(5));
    let store = EventStore::new(pool.clone()).with_notifier(notifier);
    let metrics = ops::install_metrics_recorder()?;
    let health: ops::HealthCheck = std::sync::Arc::new(move || {
        let pool = pool.clone();
        Box::pin(async move {
            let database = sqlx::query("SELECT 1").execute(&pool).await.is_ok();
            (database, serde_json::json!({"database": database}))
        })
    });
    let edge = args.edge.config();
    let api = ops::serve_with(
        args.listen,
        http::router(store),
        ops::shutdown_signal(),
        edge,
    )
    .await
    .with_context(|| format!("cannot listen on {}", args.listen))?;
    let telemetry = ops::serve_with(
        args.metrics_listen,
        ops::telemetry_routes(metrics, health),
        ops::shutdown_signal(),
        edge,
    )
    .await
    .with_context(|| format!("cannot listen on {}", args.metrics_listen))?;
    tracing::info!(api = %api.address, metrics = %telemetry.address, "order service listening");
    tokio::join!(api.stopped(), telemetry.stopped());
    Ok(())
}

async fn order_command(
    database_url: &str,
    command: OrderCommand,
    json: bool,
) -> Result<(), Failure> {
    let pool = store::connect(database_url, "waybill", 2)
        .await
        .with_context(|| format!("cannot connect to PostgreSQL at {}", redact(database_url)))?;
    let store = EventStore::new(pool.clone());
    let result = match command {
        OrderCommand::Place(args) => orders::place(&store, args, json).await,
        OrderCommand::Pay(args) => orders::pay(&store, args, json).await,
        OrderCommand::Cancel(args) => orders::cancel(&store, args, json).await,
        OrderCommand::Ship(args) => orders::ship(&store, args, json).await,
        OrderCommand::Show(args) => orders::show(&store, args, json).await,
    };
    pool.close().await;
    result
}
