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
            // A server without logical decoding has no slots; one that cannot say is not an error.
            let slots = crate::wal::slot::database_slots(pool)
                .await
                .unwrap_or_default();
            if json_output {
                let mut document = serde_json::to_value(&status)?;
                document["wal_slots"] = serde_json::to_value(&slots)?;
                println!("{document}");
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
                println!("diverged from stream  {}", status.diverged);
                for row in &status.divergences {
                    println!(
                        "  {} {} v{} (store event {}, stream {} at {}, {}): {}",
                        row.aggregate_type,
                        row.aggregate_id,
                        row.aggregate_version,
                        row.event_id,
                        row.divergence.stream_msg_id.as_deref().unwrap_or("-"),
                        row.divergence
                            .stream_sequence
                            .map_or_else(|| "-".to_owned(), |s| s.to_string()),
                        row.status,
                        row.divergence
                    );
                }
                if status.diverged > 0 {
                    println!(
                        "  the stream disagrees with the store: run `waybill outbox verify` (README, \"After a restore\")"
                    );
                }
                let keep: String = if slots.is_empty() {
                    String::new()
                } else {
                    sqlx::query_scalar("SELECT current_setting('max_slot_wal_keep_size')")
                        .fetch_one(pool)
                        .await
                        .unwrap_or_default()
                };
                for slot in &slots {
                    let (verdict, detail) = crate::wal::slot::describe_slot(slot, &keep);
                    let flag = match verdict {
                        crate::wal::slot::Verdict::Ok => "",
                        crate::wal::slot::Verdict::Warn => " (warning)",
                        crate::wal::slot::Verdict::Missing => " (ALERT)",
                    };
                    println!("wal slot              {detail}{flag}");
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

/// `waybill outbox verify` and `repair`: the store compared with the stream. They read `events` (which
/// the relay's role may not), so `waybill` carries them, not `waybill-relay`.
#[derive(Debug, Subcommand)]
pub enum StreamCheckCommand {
    /// Compare the event store with the stream, aggregate by aggregate: every event in the stream
    /// exactly once, under its own message id, at its own version, in version order, and nothing else
    /// on an aggregate's subject. Run it after restoring the database, a failover, or any incident.
    /// Exits 1 and names every aggregate that differs (unsent events are a backlog, not a difference).
    /// Needs read access to `events` and `outbox`, and a NATS user that may create an ordered consumer
    /// (the admin user of deploy/nats/accounts.conf) unless --aggregate is given.
    Verify(VerifyArgs),
    /// Make one aggregate's subject hold exactly the store's events again, the store being the truth:
    /// the stream's messages after the versions both agree on are deleted and the store's later versions
    /// published again by the relay. Prints the plan; --apply carries it out. Rebuild every projection
    /// afterwards (README, "After a restore").
    Repair(RepairArgs),
}

/// Where the stream is, for the commands that compare it with the store.
#[derive(Debug, Args)]
pub struct StreamArgs {
    /// The NATS server, credentials and TLS.
    #[command(flatten)]
    pub nats: Box<ops::NatsConnection>,
    /// The JetStream stream the relay publishes into.
    #[arg(long, env = "WAYBILL_STREAM", default_value = domain::wire::DEFAULT_STREAM)]
    pub stream: String,
    /// The subject prefix (PREFIX.AGGREGATE_TYPE.AGGREGATE_ID).
    #[arg(long, env = "WAYBILL_SUBJECT_PREFIX", default_value = domain::wire::DEFAULT_SUBJECT_PREFIX)]
    pub subject_prefix: String,
}

/// `verify`.
#[derive(Debug, Args)]
pub struct VerifyArgs {
    #[command(flatten)]
    pub stream: StreamArgs,
    /// Only this aggregate (repeatable); its subject is read message by message.
    #[arg(long = "aggregate", value_name = "ID")]
    pub aggregates: Vec<uuid::Uuid>,
    /// Only aggregates with an event recorded since then: a duration ago (`1h`, `2d`) or an RFC 3339
    /// time.
    #[arg(long, value_name = "WHEN", value_parser = parse_since)]
    pub since: Option<chrono::DateTime<chrono::Utc>>,
}

/// `repair`.
#[derive(Debug, Args)]
pub struct RepairArgs {
    #[command(flatten)]
    pub stream: StreamArgs,
    /// The aggregate to repair.
    #[arg(long = "aggregate", value_name = "ID")]
    pub aggregate: uuid::Uuid,
    /// Carry the plan out (without it, only print it).
    #[arg(long)]
    pub apply: bool,
}

fn parse_since(text: &str) -> Result<chrono::DateTime<chrono::Utc>, String> {
    if let Ok(ago) = humantime::parse_duration(text) {
        let ago =
            chrono::Duration::from_std(ago).map_err(|_| format!("{text:?} is too long ago"))?;
        return chrono::Utc::now()
            .checked_sub_signed(ago)
            .ok_or_else(|| format!("{text:?} is too long ago"));
    }
    chrono::DateTime::parse_from_rfc3339(text)
        .map(|t| t.with_timezone(&chrono::Utc))
        .map_err(|_| format!("{text:?} is neither a duration (1h, 2d) nor an RFC 3339 time"))
}

/// Runs `verify` or `repair` and prints the result (JSON with `json_output`).
pub async fn run_stream_check(
    pool: &PgPool,
    command: StreamCheckCommand,
    json_output: bool,
) -> anyhow::Result<()> {
    let args = match &command {
        StreamCheckCommand::Verify(args) => &args.stream,
        StreamCheckCommand::Repair(args) => &args.stream,
    };
    let client = args
        .nats
        .connect("waybill-outbox-verify")
        .await
        .with_context(|| format!("cannot connect to NATS at {}", args.nats.shown()))?;
    let jetstream = async_nats::jetstream::new(client);
    match command {
        StreamCheckCommand::Verify(args) => {
            let scope = crate::verify::VerifyScope {
                aggregates: args.aggregates,
                since: args.since,
            };
            let show_progress = !json_output;
            let report = crate::verify::verify(
                pool,
                &jetstream,
                &args.stream.stream,
                &args.stream.subject_prefix,
                &scope,
                &|done, last| {
                    if show_progress {
                        eprint!("\rread {done} of {last} stream messages");
                        let _ = std::io::stderr().flush();
                    }
                },
            )
            .await
            .context("comparing the store with the stream")?;
            if show_progress && report.stream_last_sequence > 0 && scope.aggregates.is_empty() {
                eprintln!();
            }
            if json_output {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                print_verify(&report);
            }
            if !report.ok {
                return Err(ops::AlreadyReported(format!(
                    "the store and the stream differ for {} aggregate(s){}",
                    report.differing.len(),
                    if report.foreign_subjects.is_empty() {
                        String::new()
                    } else {
                        format!(
                            " and {} message(s) name no aggregate",
                            report.foreign_subjects.len()
                        )
                    }
                ))
                .into());
            }
        }
        StreamCheckCommand::Repair(args) => {
            let stream = jetstream
                .get_stream(&args.stream.stream)
                .await
                .with_context(|| format!("opening stream {}", args.stream.stream))?;
            let plan =
                crate::repair::plan(pool, &stream, &args.stream.subject_prefix, args.aggregate)
                    .await
                    .map_err(|e| match e {
                        crate::repair::RepairError::Unknown(_) => {
                            anyhow::Error::new(ops::Refused::new(e))
                        }
                        e => anyhow::Error::new(e),
                    })?;
            let plan = if args.apply && !(plan.delete.is_empty() && plan.republish.is_empty()) {
                crate::repair::apply(pool, &stream, plan)
                    .await
                    .context("repairing the aggregate")?
            } else {
                plan
            };
            if json_output {
                println!("{}", serde_json::to_string(&plan)?);
            } else {
                print_repair(&plan, args.apply);
            }
        }
    }
    Ok(())
}

fn print_verify(report: &crate::verify::VerifyReport) {
    println!(
        "compared {} aggregate(s): {} event(s) in the store, {} message(s) in the stream (sequences {}..={})",
        report.aggregates,
        report.store_events,
        report.stream_messages,
        report.stream_first_sequence,
        report.stream_last_sequence
    );
    println!(
        "not yet sent {}, older than the stream's retention {}",
        report.unsent, report.beyond_retention
    );
    for aggregate in &report.differing {
        println!("{} {}", aggregate.aggregate_type, aggregate.aggregate_id);
        for difference in &aggregate.differences {
            println!(
                "  {:?} v{}: {}",
                difference.kind,
                difference
                    .aggregate_version
                    .map_or_else(|| "?".to_owned(), |v| v.to_string()),
                difference.detail
            );
        }
    }
    for foreign in &report.foreign_subjects {
        println!(
            "message at stream sequence {} on {} names no aggregate",
            foreign.stream_sequence, foreign.subject
        );
    }
    if report.ok {
        println!("the store and the stream agree");
    } else {
        println!(
            "to make an aggregate's stream match the store: waybill outbox repair --aggregate ID (README, \"After a restore\")"
        );
    }
}

fn print_repair(plan: &crate::repair::RepairPlan, asked_to_apply: bool) {
    println!(
        "{} {}: the stream holds the store's versions 1..={} correctly",
        plan.aggregate_type, plan.aggregate_id, plan.agreeing_versions
    );
    if plan.delete.is_empty() && plan.republish.is_empty() {
        println!("nothing to repair");
        return;
    }
    let verb = if plan.applied {
        "deleted"
    } else {
        "would delete"
    };
    for message in &plan.delete {
        println!(
            "  {verb} stream sequence {} ({}, version {})",
            message.stream_sequence,
            message.msg_id.as_deref().unwrap_or("no message id"),
            message
                .aggregate_version
                .map_or_else(|| "?".to_owned(), |v| v.to_string())
        );
    }
    let verb = if plan.applied {
        "set pending to publish again"
    } else {
        "would publish again"
    };
    println!("  {verb}: versions {:?}", plan.republish);
    if plan.applied {
        println!("now rebuild every projection: each applied the deleted messages");
    } else if !asked_to_apply {
        println!("run again with --apply to carry it out");
    }
}
