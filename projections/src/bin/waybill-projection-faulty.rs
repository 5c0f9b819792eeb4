//! `waybill-projection-faulty NAME …`: the projection binary `waybill-NAME` (inventory, points or
//! search) that can be told to crash or to break its checkpoint, for the tests and the chaos harness.
//! It exists only in builds with the `fault-injection` feature; it reads its own flags out of the
//! command line and hands the rest to the projections' shared one (without the read commands).

use std::ffi::OsString;
use std::process::ExitCode;

use clap::{CommandFactory, Subcommand};
use projections::cli::{Cli, Faults};
use projections::{FailPoint, Inventory, Points, Projection, Search, inventory, points, search};

/// No read commands: the twin is for `run` and `rebuild`.
#[derive(Debug, Subcommand)]
enum NoRead {}

/// This binary's own flags, each with the fault it asks for.
const FLAGS: [(&str, &str); 5] = [
    (
        "--crash-after-commit",
        "`run`: abort after a batch commits, before acking it",
    ),
    (
        "--ignore-checkpoint",
        "`run`: apply redelivered events again (needs WAYBILL_BREAK_CHECKPOINT)",
    ),
    (
        "--fail-before-swap",
        "`rebuild`: fail after building, before the swap",
    ),
    (
        "--crash-after-swap",
        "`rebuild`: abort after the swap commits, before moving any consumer",
    ),
    (
        "--crash-after-first-consumer-moved",
        "`rebuild`: abort after moving the first live consumer behind the swap",
    ),
];

async fn no_read(read: NoRead, _: sqlx::PgPool, _: bool) -> anyhow::Result<()> {
    match read {}
}

fn main() -> ExitCode {
    let mut args = std::env::args_os().skip(1);
    let name = args.next().and_then(|name| name.into_string().ok());
    let (ours, rest): (Vec<OsString>, Vec<OsString>) =
        args.partition(|arg| FLAGS.iter().any(|(flag, _)| arg == flag));
    let mut faults = Faults::default();
    for flag in &ours {
        let Some(flag) = flag.to_str() else { continue };
        let fail_point = match flag {
            "--crash-after-commit" => FailPoint::AbortAfterCommit,
            "--fail-before-swap" => FailPoint::FailBeforeSwap,
            "--crash-after-swap" => FailPoint::AbortAfterSwap,
            "--crash-after-first-consumer-moved" => FailPoint::AbortAfterFirstConsumerMoved,
            _ => {
                faults.ignore_checkpoint = true;
                continue;
            }
        };
        if faults.fail_point != FailPoint::None {
            eprintln!("error: give one fail point at most");
            return ExitCode::from(2);
        }
        faults.fail_point = fail_point;
    }
    let after_help: String = std::iter::once("Testing only, this binary's own flags:".to_owned())
        .chain(
            FLAGS
                .iter()
                .map(|(flag, what)| format!("  {flag:<36} {what}")),
        )
        .collect::<Vec<_>>()
        .join("\n");
    let Some(name) =
        name.filter(|n| [Inventory::NAME, Points::NAME, Search::NAME].contains(&n.as_str()))
    else {
        eprintln!(
            "usage: waybill-projection-faulty inventory|points|search COMMAND …\n\n{after_help}"
        );
        return ExitCode::from(2);
    };
    let program = format!("waybill-projection-faulty {name}");
    let args: Vec<OsString> = std::iter::once(program.clone().into())
        .chain(rest)
        .collect();
    let command = Cli::<NoRead>::command()
        .name(program.clone())
        .bin_name(program)
        .about(format!(
            "waybill-{name} with deliberate failures, for tests and the chaos harness"
        ))
        .after_help(after_help.clone())
        .mut_subcommand("run", |run| run.after_help(after_help.clone()))
        .mut_subcommand("rebuild", |rebuild| rebuild.after_help(after_help.clone()));
    let Ok(runtime) = tokio::runtime::Runtime::new() else {
        return ExitCode::FAILURE;
    };
    runtime.block_on(async move {
        use projections::cli::main_with;
        match name.as_str() {
            "inventory" => {
                main_with(args, command, Inventory, inventory::routes, no_read, faults).await
            }
            "points" => main_with(args, command, Points, points::routes, no_read, faults).await,
            _ => main_with(args, command, Search, search::routes, no_read, faults).await,
        }
    })
}
