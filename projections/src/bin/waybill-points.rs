//! `waybill-points`: the loyalty points projection — per customer, a ledger and a balance.

use std::process::ExitCode;

use clap::Subcommand;
use projections::{Points, points};

/// What only this projection can answer.
#[derive(Debug, Subcommand)]
enum Read {
    /// Print every customer's balance and ledger (or one customer's).
    Show {
        /// Only this customer.
        #[arg(long)]
        customer: Option<String>,
    },
}

const ABOUT: &str = "waybill-points: one point per 100 cents paid, taken back when a paid order is cancelled.\n\n\
    Every change is a ledger entry keyed by the event that caused it; a balance is the sum of \
    its ledger. State lives in the `points` schema of DATABASE_URL; events come from the \
    durable consumer `points`. With --listen, `run` serves GET /customers and \
    /customers/{id} (paged: limit, cursor); --metrics-listen serves /metrics and /health. Exit codes: 0 success, 2 refused input, 1 failure.";

#[tokio::main]
async fn main() -> ExitCode {
    projections::cli::main(Points, ABOUT, points::routes, async |read, pool, json| {
        let Read::Show { customer } = read;
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
    })
    .await
}
