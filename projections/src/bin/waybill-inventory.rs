//! `waybill-inventory`: the inventory projection — per SKU, units reserved, shipped and released.

use std::process::ExitCode;

use clap::Subcommand;
use projections::{Inventory, inventory};

/// What only this projection can answer.
#[derive(Debug, Subcommand)]
enum Read {
    /// Print the counters of every SKU (or one).
    Show {
        /// Only this SKU.
        #[arg(long)]
        sku: Option<String>,
    },
}

const ABOUT: &str = "waybill-inventory: keeps per-SKU stock counters from the order events.\n\n\
    `reserved` counts units in placed or paid orders not yet shipped or cancelled, `shipped` \
    units shipped, `released` units of cancelled orders. State lives in the `inventory` schema \
    of DATABASE_URL, next to its per-order checkpoints; events come from the durable consumer \
    `inventory`. With --listen, `run` serves GET /stock and /stock/{sku} (paged: limit, cursor); \
    --metrics-listen serves /metrics and /health on their own address. Exit \
    codes: 0 success, 2 refused input, 1 failure.";

#[tokio::main]
async fn main() -> ExitCode {
    projections::cli::main(
        Inventory,
        ABOUT,
        inventory::routes,
        async |read, pool, json| {
            let Read::Show { sku } = read;
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
        },
    )
    .await
}
