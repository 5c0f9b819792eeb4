//! `cargo xtask`: the maintainer tools' command line (the alias is in `.cargo/config.toml`).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use serde_json::json;
use xtask::{XtaskError, scaffold, schema_file, workspace};

/// Maintainer tools of the waybill workspace. Run from anywhere inside it: the `domain/` folder is
/// found from the current directory upwards (or given with --dir). Exit codes: 0 done, 2 input
/// refused (nothing written), 1 anything else.
#[derive(Debug, Parser)]
#[command(name = "cargo xtask")]
struct Cli {
    /// Print the result (or the error) as one JSON object.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Scaffold the next version of an event type, of any aggregate: its schema file and golden
    /// fixture, copied from the current version, then the checklist of what is left by hand, each
    /// step naming its file and line. Never overwrites a file. The guide:
    /// docs/guides/new-event-version.md.
    ///
    /// Example: cargo xtask new-version order.shipped
    NewVersion {
        /// The event type, e.g. order.shipped or customer.renamed.
        event_type: String,
        /// The domain crate's folder, holding src/, schemas/ and fixtures/ [default: the
        /// workspace's domain/, found from the current directory upwards].
        #[arg(long, value_name = "DOMAIN_DIR")]
        dir: Option<PathBuf>,
    },
    /// Write a payload version's committed schema, DOMAIN_DIR/schemas/<type>.v<N>.schema.json, from
    /// this build's catalog, exactly as committed files are laid out; print its path. Refuses to
    /// change a released version's schema (schemas/released.json).
    ///
    /// Example: cargo xtask write-schema order.shipped --version 2
    WriteSchema {
        /// The event type, e.g. order.shipped.
        event_type: String,
        /// The payload version [default: the type's current version].
        #[arg(long = "version", value_name = "N")]
        version: Option<i32>,
        /// The domain crate's folder [default: found from the current directory upwards].
        #[arg(long, value_name = "DOMAIN_DIR")]
        dir: Option<PathBuf>,
    },
    /// Render the README's table of benchmark targets from a `waybill bench --json` document (each
    /// target's median, its rounds' range, bound and verdict) between the README's marker lines.
    ///
    /// Example: cargo xtask bench-table (after `waybill bench --quick --json > docs/bench.json`)
    BenchTable {
        /// The bench document [default: docs/bench.json of the workspace].
        #[arg(long, value_name = "FILE")]
        bench: Option<PathBuf>,
        /// The README [default: README.md of the workspace].
        #[arg(long, value_name = "FILE")]
        readme: Option<PathBuf>,
        /// Write nothing; exit 2 when the README's table is not the document's.
        #[arg(long)]
        check: bool,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli.command, cli.json) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => report(&error, cli.json),
    }
}

fn run(command: Command, json: bool) -> Result<(), XtaskError> {
    match command {
        Command::BenchTable {
            bench,
            readme,
            check,
        } => {
            // The workspace root: the domain folder's parent.
            let root = workspace::domain_dir(None)?
                .parent()
                .map(PathBuf::from)
                .unwrap_or_default();
            let bench = bench.unwrap_or_else(|| root.join("docs/bench.json"));
            let readme = readme.unwrap_or_else(|| root.join("README.md"));
            let outcome = xtask::bench_table::regenerate(&bench, &readme, check)?;
            let written = outcome == xtask::bench_table::Regenerated::Written;
            if json {
                println!(
                    "{}",
                    json!({"readme": readme, "bench": bench, "written": written})
                );
            } else if written {
                println!("{} rewritten from {}", readme.display(), bench.display());
            } else {
                println!(
                    "{} already holds the table of {}",
                    readme.display(),
                    bench.display()
                );
            }
            Ok(())
        }
        Command::NewVersion { event_type, dir } => {
            let dir = workspace::domain_dir(dir)?;
            let done = scaffold::new_version(&dir, &event_type)?;
            if json {
                println!(
                    "{}",
                    json!({
                        "event_type": done.event_type,
                        "from": done.from,
                        "to": done.to,
                        "created": done.created,
                        "steps": done.steps,
                        "note": done.note,
                    })
                );
                return Ok(());
            }
            for path in &done.created {
                println!("created {}", path.display());
            }
            println!(
                "\n{} v{} is scaffolded from v{}, not done. What is left, by hand (each step builds; \
                 the guide: {}):",
                done.event_type,
                done.to,
                done.from,
                xtask::checklist::GUIDE
            );
            for (n, step) in done.steps.iter().enumerate() {
                println!("  {}. {step}", n + 1);
            }
            if let Some(note) = done.note {
                println!("\nnote: {note}");
            }
            Ok(())
        }
        Command::WriteSchema {
            event_type,
            version,
            dir,
        } => {
            let dir = workspace::domain_dir(dir)?;
            let written = schema_file::write_schema(&dir, &event_type, version)?;
            if json {
                println!(
                    "{}",
                    json!({
                        "event_type": written.event_type,
                        "version": written.version,
                        "path": written.path,
                    })
                );
            } else {
                println!("{}", written.path.display());
            }
            Ok(())
        }
    }
}

/// Prints `error` with its causes (on standard error, or as JSON on standard output) and returns
/// its exit code, as every waybill binary does: 2 refused, 1 failed.
fn report(error: &XtaskError, json: bool) -> ExitCode {
    let mut message = error.to_string();
    let mut cause = std::error::Error::source(error);
    while let Some(inner) = cause {
        message.push_str(&format!(": {inner}"));
        cause = inner.source();
    }
    let kind = if error.is_refusal() {
        "refused"
    } else {
        "failed"
    };
    if json {
        println!("{}", json!({"error": {"kind": kind, "message": message}}));
    } else {
        eprintln!("error: {message}");
    }
    ExitCode::from(if error.is_refusal() { 2 } else { 1 })
}
