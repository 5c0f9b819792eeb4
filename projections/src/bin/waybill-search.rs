//! `waybill-search`: the search projection — one full-text document per order.

use std::process::ExitCode;

use clap::Subcommand;
use projections::{Search, search};

/// What only this projection can answer.
#[derive(Debug, Subcommand)]
enum Read {
    /// Find orders by customer, SKU or status, best matches first.
    Query {
        /// What to look for, e.g. `alice mug-blue paid`.
        text: String,
        /// At most this many orders.
        #[arg(long, default_value_t = 50)]
        limit: i64,
    },
}

const ABOUT: &str = "waybill-search: one document per order (customer, SKUs, status, total), searchable \
    by text.\n\n\
    Queries use web-search syntax: words, \"quoted phrases\", -excluded words, `or`. State lives in \
    the `search` schema of DATABASE_URL; events come from the durable consumer `search`. With \
    --listen, `run` serves GET /search?q=TEXT (paged: limit, cursor); --metrics-listen serves /metrics \
    and /health. Exit codes: 0 success, 2 refused \
    input, 1 failure.";

#[tokio::main]
async fn main() -> ExitCode {
    projections::cli::main(Search, ABOUT, search::routes, async |read, pool, json| {
        let Read::Query { text, limit } = read;
        if text.trim().is_empty() {
            return Err(ops::Refused::new("the query text is empty").into());
        }
        let found = search::query(&pool, &text, limit.clamp(1, 500), 0).await?;
        if json {
            println!("{}", serde_json::to_string(&found)?);
        } else if found.is_empty() {
            println!("no order matches {text:?}");
        } else {
            for d in found {
                println!(
                    "{}  {:<10} {:>10} {}  {}  {}",
                    d.order_id,
                    d.status.to_string(),
                    d.total_cents,
                    d.currency,
                    d.customer_id,
                    d.skus.join(" ")
                );
            }
        }
        Ok(())
    })
    .await
}
