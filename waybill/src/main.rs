//! `waybill`: the command side and administration of the order service.

mod catalog;
mod cli;
mod customers;
mod failure;
mod migrate;
mod orders;

use std::process::ExitCode;

use anyhow::Context;
use store::EventStore;

use crate::cli::{Cli, Command, OrderCommand};
use crate::failure::redact;
use waybill::http;

/// Replaces this process with the sibling binary `program` running `command ARGS` (as `cargo foo` runs
/// `cargo-foo`), so the order service's binary links none of the tools; returns only on failure.
fn hand_over(program: &str, command: &str, args: &[String], database_url: &str) -> anyhow::Error {
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
    // The URL goes by the environment, not the command line, where any local user could read a
    // password in it.
    let error = std::process::Command::new(&path)
        .arg(command)
        .args(args)
        .env("DATABASE_URL", database_url)
        .exec();
    anyhow::Error::new(error).context(format!("cannot run {}", path.display()))
}

/// Hands `command` over to `waybill-lab`, passing on this program's global flags: the event store's
/// URL (as resolved from the flag, DATABASE_URL or the default) and `--json`.
fn lab(database_url: &str, command: &str, mut args: Vec<String>, json: bool) -> anyhow::Error {
    if json {
        args.push("--json".to_owned());
    }
    hand_over("waybill-lab", command, &args, database_url)
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli: Cli = ops::command_line::parse();
    // Long-running services say what they do; one-shot commands only warn.
    ops::init_logging(match cli.command {
        Command::Serve(_) => "info,sqlx=warn",
        _ => "warn",
    });
    let json = cli.json;
    match run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => ops::report_failure(&error, false, json),
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Demo(handed) => Err(lab(&cli.database.url, "demo", handed.args, false)),
        Command::Services(handed) => Err(lab(&cli.database.url, "services", handed.args, false)),
        Command::Load(handed) => Err(lab(&cli.database.url, "load", handed.args, cli.json)),
        Command::Chaos(handed) => Err(lab(&cli.database.url, "chaos", handed.args, cli.json)),
        Command::Bench(handed) => Err(lab(&cli.database.url, "bench", handed.args, cli.json)),
        Command::Migrate => migrate::run(&cli.database.url, cli.json).await,
        Command::Serve(args) => serve(&cli.database.url, args).await,
        Command::Schema(args) => catalog::tool::run(args, cli.json),
        Command::Outbox(command) => {
            let pool = ops::database::connect(&cli.database.url, "waybill-outbox", 2)
                .await
                .with_context(|| {
                    format!(
                        "cannot connect to PostgreSQL at {}",
                        redact(&cli.database.url)
                    )
                })?;
            match command {
                cli::OutboxCommand::Rows(command) => {
                    relay::cli::run_outbox(&pool, command, cli.json).await
                }
                cli::OutboxCommand::Stream(command) => {
                    relay::cli::run_stream_check(&pool, command, cli.json).await
                }
            }
        }
        Command::Roles(cli::RolesCommand::Create) => {
            roles_create(&cli.database.url, cli.json).await
        }
        Command::Customer(command) => customer_command(&cli.database.url, command, cli.json).await,
        Command::Order(command) => order_command(&cli.database.url, command, cli.json).await,
    }
}

/// `waybill roles create`: the least-privilege group roles, and what was done.
async fn roles_create(database_url: &str, json: bool) -> anyhow::Result<()> {
    let pool = ops::database::connect(database_url, "waybill-roles", 1)
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

/// How long a statement of the order service waits for another transaction's lock before it fails.
const LOCK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// `waybill serve`: the HTTP order service, and its metrics and health check on their own listener.
async fn serve(database_url: &str, args: cli::ServeArgs) -> anyhow::Result<()> {
    // A command waits on another transaction's lock only while that one writes the same order's
    // version, which takes milliseconds — unless its process froze mid-transaction. Group commit's
    // statement waits for such a lock only briefly (its own `lock_timeout`, 100 ms) and then hands
    // its commands to lone writes, which wait up to `LOCK_TIMEOUT` each, off the group's path: only
    // the locked order's commands wait, and then fail with 503 order-locked. And end this
    // service's own transactions if it freezes.
    let settings = [
        ("lock_timeout", format!("{}ms", LOCK_TIMEOUT.as_millis())),
        ("idle_in_transaction_session_timeout", "15s".to_owned()),
    ];
    let pool = ops::database::connect_with(database_url, "waybill-serve", 16, &settings)
        .await
        .with_context(|| format!("cannot connect to PostgreSQL at {}", redact(database_url)))?;
    sqlx::query("SELECT 1 FROM events LIMIT 1")
        .execute(&pool)
        .await
        .map_err(failure::with_hint)?;
    let notifier = store::OutboxNotifier::spawn(pool.clone(), args.notify_interval);
    let writes = args.versions.versions();
    if !writes.is_empty() {
        tracing::info!(write_versions = %writes, "writing older payload versions (expand phase)");
    }
    // Before anything describes its metrics: descriptions given to no recorder are lost.
    let metrics = ops::install_metrics_recorder()?;
    let mut store = EventStore::new(pool.clone())
        .with_notifier(notifier)
        .with_write_versions(writes);
    if args.group_commit_writers > 0 {
        let writers = usize::from(args.group_commit_writers);
        store = store.with_group_commit(store::GroupCommit::spawn(pool.clone(), writers));
    }
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

async fn customer_command(
    database_url: &str,
    command: cli::CustomerCommand,
    json: bool,
) -> anyhow::Result<()> {
    let pool = ops::database::connect(database_url, "waybill", 2)
        .await
        .with_context(|| format!("cannot connect to PostgreSQL at {}", redact(database_url)))?;
    let store = EventStore::new(pool.clone());
    let result = match command {
        cli::CustomerCommand::Register(args) => customers::register(&store, args, json).await,
        cli::CustomerCommand::Rename(args) => customers::rename(&store, args, json).await,
        cli::CustomerCommand::Show(args) => customers::show(&store, args, json).await,
    };
    pool.close().await;
    result
}

async fn order_command(
    database_url: &str,
    command: OrderCommand,
    json: bool,
) -> anyhow::Result<()> {
    let pool = ops::database::connect(database_url, "waybill", 2)
        .await
        .with_context(|| format!("cannot connect to PostgreSQL at {}", redact(database_url)))?;
    let writes = match &command {
        OrderCommand::Place(args) => args.write.versions.versions(),
        OrderCommand::Pay(args) => args.write.versions.versions(),
        OrderCommand::Cancel(args) => args.write.versions.versions(),
        OrderCommand::Ship(args) => args.write.versions.versions(),
        OrderCommand::Show(_) => domain::WriteVersions::default(),
    };
    let store = EventStore::new(pool.clone()).with_write_versions(writes);
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
