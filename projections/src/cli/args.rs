//! The flags and subcommands every projection binary shares, and their parsers: where the state and
//! the events are, partitions and leases, `run`'s addresses, the operator commands' arguments.

use std::net::SocketAddr;
use std::time::Duration;

use clap::{Args, Subcommand};
use uuid::Uuid;

use crate::partition::Partitions;
use crate::runner::RunnerConfig;

/// Where the projection keeps its state and where it reads events from.
#[derive(Debug, Args)]
pub struct Connection {
    /// The database holding this projection's schema, NATS, and the stream's names.
    #[command(flatten)]
    pub shared: ops::StreamConnection,

    /// Messages applied per database transaction at most.
    #[arg(long, default_value_t = RunnerConfig::default().batch_size, global = true)]
    pub batch_size: usize,

    /// How long the broker waits for an ack before redelivering a message.
    #[arg(long, default_value_t = RunnerConfig::default().ack_wait.into(), global = true)]
    pub ack_wait: humantime::Duration,

    /// Read as if this code knew no version of TYPE above VERSION (e.g. order.placed=2): newer events
    /// are parked exactly as an older binary would park them, and `redrive` without the flag applies
    /// them later. For rehearsing a rollout; repeatable (comma-separated in the environment variable).
    #[arg(long = "max-version", env = "WAYBILL_MAX_VERSIONS", value_name = "TYPE=VERSION", value_delimiter = ',', value_parser = max_version, global = true)]
    pub max_versions: Vec<(String, i32)>,

    /// Split the orders into P partitions by order id (the id as a number, modulo P), each read
    /// through its own durable consumer `<name>-p<K>of<P>`; every instance of the projection must be
    /// given the same P. 1 (the default) is one consumer named after the projection.
    #[arg(
        long,
        env = "WAYBILL_PARTITIONS",
        value_name = "P",
        default_value_t = 1,
        global = true
    )]
    pub partitions: u32,

    /// The event store's database, whose `events` table a consumer that starts (the first run, a
    /// rebuild, a consumer the stream's retention left behind) catches up from before the stream
    /// takes over (default: --database-url). The projection's role needs SELECT on it (`waybill
    /// roles create`); without it, history comes from the stream, which must still hold its first
    /// message. Prefer the environment variable: flags show up in `ps`.
    #[arg(
        long,
        env = "WAYBILL_EVENTS_URL",
        value_name = "URL",
        hide_env_values = true,
        global = true
    )]
    pub events_url: Option<String>,

    /// The partitions this instance applies, 0 to P-1; repeatable, or comma-separated. Without it
    /// (and P > 1), the instances of the projection share the P partitions by themselves through
    /// leases in NATS: start as many as you like, and a dead or frozen one's partitions move to the
    /// others within --lease-time (`run --once` applies all of them). See docs/scale-out.md.
    #[arg(
        long = "partition",
        env = "WAYBILL_PARTITION",
        value_name = "K",
        value_delimiter = ',',
        global = true
    )]
    pub partition: Vec<u32>,

    /// With shared partitions: how long a partition's lease lasts unrenewed, so how long a dead or
    /// frozen instance's partitions wait before another instance takes them (renewed every third
    /// of it).
    #[arg(long, env = "WAYBILL_LEASE_TIME", value_name = "DURATION", default_value = "6s", value_parser = lease_time, global = true)]
    pub lease_time: humantime::Duration,
}

fn lease_time(text: &str) -> Result<humantime::Duration, String> {
    let parsed: humantime::Duration = text.parse().map_err(|error| format!("{error}"))?;
    let time: Duration = parsed.into();
    if time < Duration::from_secs(1) || time > Duration::from_secs(300) {
        return Err(format!(
            "{text} is outside 1s..5m (shorter renews too often to survive a slow broker; longer \
             leaves a dead instance's partitions waiting)"
        ));
    }
    Ok(parsed)
}

fn max_version(text: &str) -> Result<(String, i32), String> {
    let (event_type, version) = text
        .split_once('=')
        .ok_or_else(|| format!("{text:?} is not TYPE=VERSION (e.g. order.placed=2)"))?;
    let event_type = event_type.trim();
    let current = domain::event::current_version(event_type)
        .ok_or_else(|| format!("unknown event type {event_type:?}"))?;
    let version: i32 = version
        .trim()
        .parse()
        .map_err(|_| format!("{version:?} is not a version number"))?;
    if !(1..=current).contains(&version) {
        return Err(format!(
            "{event_type} has versions 1 to {current}; {version} is not one of them"
        ));
    }
    Ok((event_type.to_owned(), version))
}

/// The commands every projection has.
#[derive(Debug, Subcommand)]
pub enum Common {
    /// Consume until SIGTERM/Ctrl-C (or, with --once, until nothing more can be applied).
    Run(RunArgs),
    /// Build the state anew beside the live one — from the event store's history, then the stream
    /// after it — then swap it in and move the live consumers behind it. Refused, changing nothing,
    /// when neither the event store (no SELECT on events) nor the stream (first messages gone)
    /// holds the whole history.
    Rebuild,
    /// Re-apply parked messages (after an upgrade taught the code their shape); reports why each one
    /// that is still parked failed again. Recorded in the operator log.
    Redrive {
        /// Why (kept in the operator log).
        #[arg(long, default_value = "redrive from the command line")]
        reason: String,
        /// At most this many messages, oldest first (default: all).
        #[arg(long)]
        limit: Option<i64>,
        #[command(flatten)]
        operator: Operator,
    },
    /// Poison messages kept with their reason, headers and (the first 64 KiB of) their body.
    #[command(subcommand)]
    Parked(ParkedCommand),
    /// Events waiting in the held table for a predecessor.
    #[command(subcommand)]
    Held(HeldCommand),
}

/// `parked …`.
#[derive(Debug, Subcommand)]
pub enum ParkedCommand {
    /// List parked messages, newest first.
    List {
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: i64,
        /// Only ids below this one (the last id of the previous listing).
        #[arg(long)]
        before: Option<i64>,
        /// Include messages already redriven or discarded.
        #[arg(long)]
        all: bool,
    },
    /// Give up on a parked message on purpose (it will not be redriven); recorded with who and why.
    Discard {
        /// The parked message's id.
        id: i64,
        /// Why (kept in the operator log).
        #[arg(long)]
        reason: String,
        #[command(flatten)]
        operator: Operator,
    },
}

/// `held …`.
#[derive(Debug, Subcommand)]
pub enum HeldCommand {
    /// List held events by order and version, with what each waits for.
    List {
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: i64,
        /// Continue after this `ORDER_ID:VERSION` (the last one of the previous listing).
        #[arg(long, value_parser = parse_position)]
        after: Option<(Uuid, i64)>,
    },
    /// Skip an order's missing versions deliberately and apply the events held behind them; recorded
    /// with who and why.
    Release {
        /// The order.
        aggregate: Uuid,
        /// Why (kept in the operator log).
        #[arg(long)]
        reason: String,
        #[command(flatten)]
        operator: Operator,
    },
}

/// Who acts, for the operator log.
#[derive(Debug, Args)]
pub struct Operator {
    /// Who is acting (default: $USER).
    #[arg(long = "by", env = "WAYBILL_OPERATOR")]
    pub by: Option<String>,
}

impl Operator {
    pub(super) fn name(&self) -> Result<String, ops::Refused> {
        self.by
            .clone()
            .or_else(|| std::env::var("USER").ok())
            .filter(|name| !name.trim().is_empty())
            .ok_or_else(|| {
                ops::Refused::new("say who is acting with --by (or WAYBILL_OPERATOR, or USER)")
            })
    }
}

fn parse_position(text: &str) -> Result<(Uuid, i64), String> {
    let (id, version) = text
        .split_once(':')
        .ok_or_else(|| format!("{text:?} is not ORDER_ID:VERSION"))?;
    let id = Uuid::parse_str(id).map_err(|e| format!("order id {id:?}: {e}"))?;
    let version = version
        .parse()
        .map_err(|e| format!("version {version:?}: {e}"))?;
    Ok((id, version))
}

/// `run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// Consume until nothing more can be applied, print what is held and parked, and exit 0.
    #[arg(long)]
    pub once: bool,

    /// Serve the read API here (its own address: exposing metrics must not expose customer data).
    #[arg(long, env = "WAYBILL_LISTEN", value_name = "ADDR")]
    pub listen: Option<SocketAddr>,

    /// Serve Prometheus metrics at /metrics and a health check at /health here.
    #[arg(long, env = "WAYBILL_METRICS_LISTEN", value_name = "ADDR")]
    pub metrics_listen: Option<SocketAddr>,

    /// Enables the operator API on the --listen address (POST /operator/redrive,
    /// /operator/parked/{id}/discard, /operator/held/{order}/release — what the console's buttons
    /// call), each call then requiring `Authorization: Bearer <token>`. Without it the API only reads.
    /// At least 16 characters; prefer the environment variable (flags show up in `ps`).
    #[arg(long, env = "WAYBILL_OPERATOR_TOKEN", hide_env_values = true, value_parser = ops::OperatorToken::parse)]
    pub operator_token: Option<ops::OperatorToken>,
}

impl Connection {
    /// The runner settings these flags describe; refused (exit 2) when `--partition` names a
    /// partition not below `--partitions`.
    pub fn runner_config(&self) -> Result<RunnerConfig, ops::Refused> {
        let partitions =
            Partitions::new(self.partitions, &self.partition).map_err(ops::Refused::new)?;
        Ok(RunnerConfig {
            stream: self.shared.stream.clone(),
            subject_prefix: self.shared.subject_prefix.clone(),
            batch_size: self.batch_size.max(1),
            ack_wait: self.ack_wait.into(),
            max_versions: self.max_versions.clone(),
            share: partitions.count() > 1 && self.partition.is_empty(),
            lease_time: self.lease_time.into(),
            partitions,
            events_url: self.events_url.clone(),
            ..RunnerConfig::default()
        })
    }
}
