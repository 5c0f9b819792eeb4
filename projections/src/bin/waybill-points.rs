//! `waybill-points`: the loyalty points projection — per customer, a ledger and a balance.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use projections::cli::{Common, Connection, run_common};
use projections::{Points, Projection, points, schema};

/// waybill-points: one point per 100 cents paid, taken back when a paid order is cancelled.
///
/// Every change is a ledger entry keyed by the event that caused it; a balance is the sum of its
/// ledger. State lives in the `points` schema of DATABASE_URL; events come from the durable consumer
/// `points`. Exit codes: 0 success, 2 refused input, 1 failure.
#[derive(Debug, Parser)]
#[command(name = "waybill-points", version, max_term_width = 100)]
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
    /// Print every customer's balance and ledger (or one customer's).
    Show {
        /// Only this customer.
        #[arg(long)]
        customer: Option<String>,
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
            run_common(Points, connection, common, json, points::routes).await
        }
        Command::Show { customer } => {
            let pool =
                schema::connect(&connection.database_url, Points::NAME, Points::TABLES).await?;
            let accounts = points::accounts(&pool, customer.as_deref()).await?;
            if json {
                println!("{}", serde_json::to_string(&accounts)?);
            } else {
                for account in accounts {
                    println!("{:<32} {:>10} points", account.customer_id, account.balance);
                    for entry in account.ledger {
                        println!(
                            "    {:>+8}  {}  order {}  {}",
                            entry.points,
                            entry.occurred_at.format("%F %T"),
                            entry.order_id,
                            entry.reason
                        );
                    }
                }
            }
            Ok(())
        }
    }
}
