//! `waybill`: the command side and administration of the order service.

mod cli;
mod failure;
mod migrate;
mod orders;

use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use store::EventStore;

use crate::cli::{Cli, Command, OrderCommand};
use crate::failure::{Failure, redact};

#[tokio::main]
async fn main() -> ExitCode {
    ops::init_logging("warn");
    let cli = Cli::parse();
    let json = cli.json;
    match run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => failure.report(json),
    }
}

async fn run(cli: Cli) -> Result<(), Failure> {
    match cli.command {
        Command::Migrate => migrate::run(&cli.database_url, cli.json).await,
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
        Command::Order(command) => order_command(&cli.database_url, command, cli.json).await,
    }
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
