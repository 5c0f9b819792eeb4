//! The operator commands over the outbox (`status`, `dead list`, `dead replay`, `purge`), shared by
//! `waybill-relay` and `waybill outbox`.

use std::io::Write;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Subcommand};
use serde_json::json;
use sqlx::PgPool;

use crate::admin::{self, ReplayTarget};

/// `status`, `dead …` and `purge`.
#[derive(Debug, Subcommand)]
pub enum OutboxCommand {
    /// Counts by status, the age of the oldest unsent row, aggregates held back, dead rows.
    Status(StatusArgs),
    /// Rows that reached the attempt limit.
    #[command(subcommand)]
    Dead(DeadCommand),
    /// Delete sent rows older than a duration, in batches; unsent rows are never touched.
    Purge(PurgeArgs),
}

/// `status`.
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// Also count sent rows (walks the whole table).
    #[arg(long)]
    pub with_sent: bool,
}

/// `dead list` and `dead replay`.
#[derive(Debug, Subcommand)]
pub enum DeadCommand {
    /// List dead rows with their reason and how many later events wait behind each.
    List {
        /// At most this many rows.
        #[arg(long, default_value_t = 100)]
        limit: i64,
    },
    /// Put dead rows back to pending with their attempts reset (after fixing the cause).
    Replay {
        /// An outbox id (number) or event id (UUID).
        #[arg(value_name = "ID", required_unless_present = "all", conflicts_with = "all", value_parser = ReplayTarget::parse)]
        target: Option<ReplayTarget>,
        /// Replay every dead row.
        #[arg(long)]
        all: bool,
    },
}

/// `purge`.
#[derive(Debug, Args)]
pub struct PurgeArgs {
    /// Delete sent rows whose `sent_at` is older than this, e.g. `7d`, `12h`, `30m`.
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub sent_older_than: Duration,
    /// Rows deleted per statement (each batch is its own short transaction).
    #[arg(long, default_value_t = 5000)]
    pub batch: i64,
}

/// Runs one outbox command and prints its result (JSON with `json`).
pub async fn run_outbox(
    pool: &PgPool,
    command: OutboxCommand,
    json_output: bool,
) -> anyhow::Result<()> {
    match command {
        OutboxCommand::Status(args) => {
            let status = admin::status(pool, args.with_sent)
                .await
                .context("reading the outbox status")?;
            if json_output {
                println!("{}", serde_json::to_string(&status)?);
            } else {
                println!("pending               {}", status.pending);
                println!("failed                {}", status.failed);
                println!("dead                  {}", status.dead);
                if let Some(sent) = status.sent {
                    println!("sent                  {sent}");
                }
                match status.oldest_pending_age_seconds {
                    Some(age) => println!("oldest unsent age     {age:.1}s"),
                    None => println!("oldest unsent age     -"),
                }
                println!("aggregates held back  {}", status.aggregates_held_back);
                println!("unsettled publishes   {}", status.unsettled_publishes);
                println!("fence conflicts       {}", status.fence_conflicts.len());
                for conflict in &status.fence_conflicts {
                    println!(
                        "  {} v{} ({}, {}): {}",
                        conflict.aggregate_id,
                        conflict.aggregate_version,
                        conflict.event_id,
                        conflict.status,
                        conflict.last_error
                    );
                }
            }
        }
        OutboxCommand::Dead(DeadCommand::List { limit }) => {
            let rows = admin::dead_rows(pool, limit)
                .await
                .context("listing dead rows")?;
            if json_output {
                println!("{}", serde_json::to_string(&rows)?);
            } else if rows.is_empty() {
                println!("no dead rows");
            } else {
                for row in rows {
                    println!(
                        "{:>8}  {}  {} v{} of {}  attempts {}  waiting behind {}\n          {}",
                        row.id,
                        row.event_id,
                        row.event_type,
                        row.aggregate_version,
                        row.aggregate_id,
                        row.attempts,
                        row.waiting_behind,
                        row.dead_reason.as_deref().unwrap_or("")
                    );
                }
            }
        }
        OutboxCommand::Dead(DeadCommand::Replay { target, all }) => {
            let target = if all {
                ReplayTarget::All
            } else {
                target.unwrap_or(ReplayTarget::All)
            };
            let replayed = admin::replay_dead(pool, &target)
                .await
                .context("replaying dead rows")?;
            if replayed == 0 && target != ReplayTarget::All {
                return Err(
                    ops::Refused::new(format!("{target:?} is not a dead outbox row")).into(),
                );
            }
            let _ = store::notify_now(pool).await;
            if json_output {
                println!("{}", json!({ "replayed": replayed }));
            } else {
                println!("replayed {replayed} dead row(s); they are pending again");
            }
        }
        OutboxCommand::Purge(args) => {
            let show_progress = !json_output;
            let deleted =
                admin::purge_sent(pool, args.sent_older_than, args.batch.max(1), |total| {
                    if show_progress {
                        eprint!("\rpurged {total} sent rows");
                        let _ = std::io::stderr().flush();
                    }
                })
                .await
                .context("purging sent rows")?;
            if show_progress && deleted > 0 {
                eprintln!();
            }
            if json_output {
                println!("{}", json!({ "deleted": deleted }));
            } else {
                println!(
                    "deleted {deleted} sent row(s) older than {}",
                    humantime::format_duration(args.sent_older_than)
                );
            }
        }
    }
    Ok(())
}
