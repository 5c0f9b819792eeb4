//! `waybill-inventory`: the inventory projection — per SKU, units reserved, shipped and released.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use projections::cli::{Common, Connection, run_common};
use projections::{Inventory, Projection, inventory, schema};

/// waybill-inventory: keeps per-SKU stock counters from the order events.
///
/// `reserved` counts units in placed or paid orders not yet shipped or cancelled, `shipped` units
/// shipped, `released` units of cancelled orders. State lives in the `inventory` schema of
/// DATABASE_URL, next to its per-order checkpoints; events come from the durable consumer `inventory`.
/// Exit codes: 0 success, 2 refused input, 1 failure.
#[derive(Debug, Parser)]
#[command(name = "waybill-inventory", version, max_term_width = 100)]
struct Cli {
    #[command(flatten)]
    connection: Connection,

    /// Print machine-readable JSON on standard output.
    #[arg(long, global = true)]
    json: bool,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    #[command(flatten)]
    Common(Common),
    /// Print the counters of every SKU (or one).
    Show {
        /// Only this SKU.
        #[arg(long)]
        sku: Option<String>,
    },
}

#[tokio::main]
async fn main() -> ExitCode {
    ops::init_logging("info,sqlx=warn,async_nats=warn");
    let cli = Cli::parse();
    match run(cli.command, &cli.connection, cli.json).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => ops::report_failure(&error, false, cli.json),
    }
}

async fn run(command: Command, connection: &Connection, json: bool) -> anyhow::Result<()> {
    match command {
        Command::Common(common) => {
            run_common(Inventory, connection, common, json, inventory::routes).await
        }
        Command::Show { sku } => {
            let pool =
                schema::connect(&connection.database_url, Inventory::NAME, Inventory::TABLES)
                    .await?;
            let stock = inventory::stock(&pool, sku.as_deref()).await?;
            if json {
                println!("{}", serde_json::to_string(&stock)?);
            } else {
                println!(
                    "{:<32} {:>10} {:>10} {:>10}",
                    "SKU", "reserved", "shipped", "released"
                );
                for s in stock {
                    println!(
                        "{:<32} {:>10} {:>10} {:>10}",
                        s.sku, s.reserved, s.shipped, s.released
                    );
                }
            }
            Ok(())
        }
    }
}
