//! `waybill-lab`: the tools that run the whole system to test it. `waybill chaos` hands over to
//! `waybill-lab chaos`, so the order service's binary links none of this.

mod chaos;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// waybill-lab: runs the whole waybill system — its real binaries, private PostgreSQL and NATS — to
/// test it. Exit codes: 0 the run passed, 1 it failed (or could not run), 2 a bad argument.
#[derive(Debug, Parser)]
#[command(name = "waybill-lab", version, max_term_width = 100)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Every kind of fault, at random moments from a seed, against the real processes under load; then
    /// a verdict from first principles: nothing lost, nothing applied twice or out of order, nothing
    /// stalled. Exit 0 only when every check holds.
    Chaos(chaos::ChaosArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // sqlx reports every session PostgreSQL ends as a warning: a crash does that on purpose here.
    ops::init_logging("info,sqlx=error,async_nats=warn");
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("waybill-lab: cannot start the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let outcome = runtime.block_on(async {
        match cli.command {
            Command::Chaos(args) => chaos::run(args).await,
        }
    });
    match outcome {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(error) => {
            eprintln!("waybill-lab: {error:#}");
            ExitCode::FAILURE
        }
    }
}
