//! `waybill schema` and its subcommands: the whole catalog, one payload schema (`show`) and what
//! changed between two versions (`diff`). They only read: this build's catalog
//! (`domain::catalog`) is printed, nothing is written. Writing the committed files and scaffolding a
//! new version are maintainer tools, in `cargo xtask` (`xtask/`). A bad type or version is refused
//! (exit 2).

use anyhow::Context;
use domain::catalog::{LookupError, committed_text, find_schema};
use serde_json::json;

use super::diff;
use crate::cli::{SchemaArgs, SchemaCommand, SchemaDiffArgs, SchemaShowArgs};

/// Runs `waybill schema …`; `json` is the global `--json`.
pub(crate) fn run(args: SchemaArgs, json: bool) -> anyhow::Result<()> {
    match args.command {
        None => {
            let document = if args.asyncapi {
                super::asyncapi(&args.stream, &args.subject_prefix)
            } else {
                super::schemas()
            };
            println!(
                "{}",
                serde_json::to_string_pretty(&document).context("encoding the catalog")?
            );
            Ok(())
        }
        Some(SchemaCommand::Show(args)) => show(args),
        Some(SchemaCommand::Diff(args)) => diff_command(args, json),
    }
}

fn refused(error: LookupError) -> anyhow::Error {
    ops::Refused::new(error).into()
}

/// `waybill schema show`: the schema exactly as it is committed under `domain/schemas/`.
fn show(args: SchemaShowArgs) -> anyhow::Result<()> {
    let found = find_schema(&args.event_type, args.version).map_err(refused)?;
    print!("{}", committed_text(&found.schema));
    Ok(())
}

/// `waybill schema diff`.
fn diff_command(args: SchemaDiffArgs, json: bool) -> anyhow::Result<()> {
    let old = find_schema(&args.event_type, Some(args.from)).map_err(refused)?;
    let new = find_schema(&args.event_type, Some(args.to)).map_err(refused)?;
    let changes = diff::diff(&old.schema, &new.schema);
    let (from, to) = (old.event_version, new.event_version);
    if json {
        println!(
            "{}",
            json!({"event_type": args.event_type, "from": from, "to": to, "changes": changes})
        );
    } else {
        print!("{}", diff::render(&args.event_type, from, to, &changes));
    }
    Ok(())
}
