//! `waybill-search`: the search projection — one full-text document per order.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use projections::cli::{Common, Connection, run_common};
use projections::{Projection, Search, schema, search};

/// waybill-search: one document per order (customer, SKUs, status, total), searchable by text.
///
/// Queries use web-search syntax: words, "quoted phrases", -excluded words, `or`. State lives in the
/// `search` schema of DATABASE_URL; events come from the durable consumer `search`.
/// Exit codes: 0 success, 2 refused input, 1 failure.
#[derive(Debug, Parser)]
#[command(name = "waybill-search", version, max_term_width = 100)]
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
    /// Find orders by customer, SKU or status, best matches first.
    Query {
        /// What to look for, e.g. `alice mug-blue paid`.
        text: String,
        /// At most this many orders.
        #[arg(long, default_value_t = 50)]
        limit: i64,
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
            run_common(Search, connection, common, json, search::routes).await
        }
        Command::Query { text, limit } => {
            if text.trim().is_empty() {
                return Err(ops::Refused("the query text is empty".into()).into());
            }
            let pool =
                schema::connect(&connection.database_url, Search::NAME, Search::TABLES).await?;
            let found = search::query(&pool, &text, limit.clamp(1, 500)).await?;
            if json {
                println!("{}", serde_json::to_string(&found)?);
            } else if found.is_empty() {
                println!("no order matches {text:?}");
            } else {
                for d in found {
                    println!(
                        "{}  {:<10} {:>10} {}  {}  {}",
                        d.order_id,
                        d.status,
                        d.total_cents,
                        d.currency,
                        d.customer_id,
                        d.skus.join(" ")
                    );
                }
            }
            Ok(())
        }
    }
}
