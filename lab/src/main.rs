//! `waybill-lab`: the tools that run the whole system — the demo, the load generator, private
//! services and the chaos harness. `waybill demo|load|services|chaos` hand over to it, so the order
//! service's binary links none of this (nor the relay's and projections' libraries the demo runs).

mod bench;
mod chaos;
mod demo;
mod http;
mod load;
mod process;
mod stream_read;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// waybill-lab: runs the whole waybill system — its real binaries, private PostgreSQL and NATS — to
/// test it. Exit codes: 0 the run passed, 1 it failed (or could not run), 2 a bad argument.
#[derive(Debug, Parser)]
#[command(name = "waybill-lab", version, max_term_width = 100)]
struct Cli {
    /// The event store (demo, load, services).
    #[command(flatten)]
    database: ops::DatabaseArgs,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Every kind of fault, at random moments from a seed, against the real processes under load; then
    /// a verdict from first principles: nothing lost, nothing applied twice or out of order, nothing
    /// stalled. Exit 0 only when every check holds.
    Chaos(chaos::ChaosArgs),
    /// The whole system in one command: fresh database and stream, the order service, the relay and
    /// the three projections, a scripted story with a relay crash, a legacy event and a duplicate,
    /// then a comparison of the projections with the event store (exit 0 only when they agree).
    Demo(demo::DemoArgs),
    /// Play realistic order lifecycles against the order service, with a progress bar and a summary.
    Load(load::LoadArgs),
    /// Start private PostgreSQL and NATS servers for whichever of DATABASE_URL and NATS_URL does not
    /// answer, print their URLs as shell exports, and keep them until SIGTERM/Ctrl-C.
    Services(demo::services::ServicesArgs),
    /// Every performance figure from one run on the local services: the command side, the relay (one
    /// and two instances, hot aggregates, the seed article's algorithm, CPU per event), each
    /// projection, and the whole pipeline over HTTP (latency against offered load, the highest
    /// sustained rate); a table, --json, --plot FILE.svg, and the targets judged.
    Bench(bench::BenchArgs),
    /// Write the nats-server accounts file (deploy/nats/accounts.conf): one least-privilege user per
    /// process, each projection's user allowed its own consumers only, partitioned ones included up
    /// to --max-partitions. For a stream or subject prefix of your own, or more partitions.
    NatsAccounts(NatsAccountsArgs),
}

#[derive(Debug, clap::Args)]
struct NatsAccountsArgs {
    /// The JetStream stream the users may use.
    #[arg(long, env = "WAYBILL_STREAM", default_value = domain::wire::DEFAULT_STREAM,
          value_parser = projections::accounts::stream_name)]
    stream: String,
    /// The subject prefix only the relay may publish under.
    #[arg(long, env = "WAYBILL_SUBJECT_PREFIX", default_value = domain::wire::DEFAULT_SUBJECT_PREFIX,
          value_parser = projections::accounts::subject_prefix)]
    subject_prefix: String,
    /// Allow every partition layout up to this many partitions (`--partitions` of the projections).
    #[arg(long, value_name = "P", default_value_t = projections::accounts::SHIPPED_MAX_PARTITIONS,
          value_parser = clap::value_parser!(u32).range(1..=i64::from(projections::partition::MAX_PARTITIONS)))]
    max_partitions: u32,
    /// Write the file here instead of printing it.
    #[arg(long, value_name = "FILE")]
    write: Option<std::path::PathBuf>,
}

/// `waybill-lab nats-accounts`: renders the accounts file and prints or writes it.
fn nats_accounts(args: NatsAccountsArgs) -> anyhow::Result<()> {
    let layout = projections::accounts::AccountsLayout {
        projections: projections::accounts::projections(),
        stream: &args.stream,
        subject_prefix: &args.subject_prefix,
        max_partitions: args.max_partitions,
    };
    let text = layout.render();
    match args.write {
        Some(path) => std::fs::write(&path, text)
            .map_err(|error| anyhow::anyhow!("cannot write {}: {error}", path.display())),
        None => {
            print!("{text}");
            Ok(())
        }
    }
}

fn main() -> ExitCode {
    let cli: Cli = ops::command_line::parse();
    ops::init_logging(match cli.command {
        // sqlx reports every session PostgreSQL ends as a warning: a crash does that on purpose here.
        Command::Chaos(_) => "info,sqlx=error,async_nats=warn",
        // The bench prints its own progress; the projections it runs in-process only warn.
        Command::Bench(_) => "warn,projections=error,sqlx=error",
        Command::NatsAccounts(_) => "warn",
        // The demo and the load tell their own story; the libraries they run only warn.
        _ => "warn,relay=error,projections=error",
    });
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("waybill-lab: cannot start the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let outcome = runtime.block_on(async {
        let database_url = cli.database.url;
        match cli.command {
            Command::Chaos(args) => chaos::run(args).await,
            Command::Bench(args) => bench::run(&database_url, args).await,
            Command::Demo(args) => demo::run(&database_url, args).await.map(|()| true),
            Command::Load(args) => load::run(&database_url, args).await.map(|()| true),
            Command::Services(args) => demo::services::serve(&database_url, args)
                .await
                .map(|()| true),
            Command::NatsAccounts(args) => nats_accounts(args).map(|()| true),
        }
    });
    match outcome {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(error) => {
            eprintln!("waybill-lab: {}", ops::redact_text(&format!("{error:#}")));
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::Cli;

    /// Clap's own consistency check: unique argument ids (the shared connection flags included), valid
    /// defaults, no conflicting short flags.
    #[test]
    fn the_command_line_grammar_is_consistent() {
        Cli::command().debug_assert();
    }
}
