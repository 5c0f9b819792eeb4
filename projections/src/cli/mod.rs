//! The command line every projection binary shares: `run`, `rebuild`, `redrive`, `parked list|discard`,
//! `held list|release`, plus connection flags. Each binary adds its own read command (`show`, `query`).
//! It has no fault flag: the testing twin `waybill-projection-faulty` (built only with the
//! `fault-injection` feature) reads its own and hands them in as [`Faults`].
//!
//! The jobs, one module each: `args` the flags and subcommands, `dispatch` runs a shared command,
//! `operator` prints the operator commands' answers, `telemetry` serves metrics and health,
//! `summary` reports a run, `faults` the twin's deliberate failures.

mod args;
mod dispatch;
mod faults;
mod operator;
mod summary;
mod telemetry;

use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand};
use sqlx::PgPool;

use crate::projection::Projection;

pub use args::{Common, Connection, HeldCommand, Operator, ParkedCommand, RunArgs};
pub use dispatch::run_common;
pub use faults::{CHECKPOINT_BREAKING_TWIN, Faults};

/// The command line of a projection binary: connection flags, the commands every projection has, and
/// the binary's own read commands `R`.
#[derive(Debug, Parser)]
#[command(version, max_term_width = 100)]
pub struct Cli<R: Subcommand> {
    #[command(flatten)]
    connection: Connection,

    /// Print machine-readable JSON on standard output.
    #[arg(long, global = true)]
    json: bool,

    #[command(subcommand)]
    command: Command<R>,
}

/// The shared commands and the binary's own.
#[derive(Debug, Subcommand)]
pub enum Command<R: Subcommand> {
    #[command(flatten)]
    Common(Common),
    #[command(flatten)]
    Read(R),
}

/// The whole `main` of a projection binary: parses the command line (named `waybill-<name>` and
/// described by `about`), sets up logging, runs the command — the shared ones here, the binary's own
/// through `read` with a pool on the projection's schema — and turns the outcome into an exit code.
pub async fn main<P: Projection, R: Subcommand + std::fmt::Debug>(
    projection: P,
    about: &'static str,
    read_routes: impl FnOnce(PgPool) -> axum::Router,
    read: impl AsyncFnOnce(R, PgPool, bool) -> anyhow::Result<()>,
) -> ExitCode {
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    main_from(
        args,
        format!("waybill-{}", P::NAME),
        projection,
        about,
        read_routes,
        read,
    )
    .await
}

/// [`main`] of `args` (the program's name first) under the command name `name`.
pub async fn main_from<P: Projection, R: Subcommand + std::fmt::Debug>(
    args: Vec<std::ffi::OsString>,
    name: String,
    projection: P,
    about: &'static str,
    read_routes: impl FnOnce(PgPool) -> axum::Router,
    read: impl AsyncFnOnce(R, PgPool, bool) -> anyhow::Result<()>,
) -> ExitCode {
    let command = Cli::<R>::command().name(name).about(about);
    main_with(
        args,
        command,
        projection,
        read_routes,
        read,
        Faults::default(),
    )
    .await
}

/// [`main_from`] with the command already named and described, and `faults` (only the faulty twin
/// hands in others than none).
pub async fn main_with<P: Projection, R: Subcommand + std::fmt::Debug>(
    args: Vec<std::ffi::OsString>,
    command: clap::Command,
    projection: P,
    read_routes: impl FnOnce(PgPool) -> axum::Router,
    read: impl AsyncFnOnce(R, PgPool, bool) -> anyhow::Result<()>,
    faults: Faults,
) -> ExitCode {
    let cli: Cli<R> = ops::command_line::parse_command_from(command, args);
    ops::init_logging("info,sqlx=warn,async_nats=warn");
    let outcome = match cli.command {
        Command::Common(common) => {
            run_common(
                projection,
                &cli.connection,
                common,
                cli.json,
                read_routes,
                faults,
            )
            .await
        }
        Command::Read(command) => {
            match crate::schema::connect(&cli.connection.shared.database.url, P::NAME, P::TABLES)
                .await
            {
                Ok(pool) => read(command, pool, cli.json).await,
                Err(error) => Err(error.into()),
            }
        }
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => ops::report_failure(&error, false, cli.json),
    }
}
