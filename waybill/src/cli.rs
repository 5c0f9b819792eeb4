//! The command-line grammar: every subcommand, flag and environment fallback of `waybill`.

use clap::{Args, Parser, Subcommand};
use domain::{Cents, Currency, CustomerId, Note, OrderId, OrderLine};
use uuid::Uuid;

/// waybill: an event-sourced order service whose events leave PostgreSQL through a transactional outbox.
///
/// Commands write events and their outbox rows in one transaction; the relay (`waybill-relay`) publishes
/// them to NATS JetStream. Exit codes: 0 success, 2 the input was refused (a domain rule or a bad
/// argument; nothing was written), 1 anything else.
#[derive(Debug, Parser)]
#[command(
    name = "waybill",
    version,
    propagate_version = true,
    max_term_width = 100
)]
pub(crate) struct Cli {
    /// The event store.
    #[command(flatten)]
    pub database: ops::DatabaseArgs,

    /// Print machine-readable JSON on standard output (errors too) instead of text.
    #[arg(long, global = true)]
    pub json: bool,

    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Create the database if it does not exist and apply every pending migration.
    Migrate,
    /// Run the HTTP order service (POST /orders, /orders/{id}/pay|cancel|ship, GET /orders/{id},
    /// /openapi.json; /health and /metrics on --metrics-listen) until SIGTERM/Ctrl-C.
    Serve(ServeArgs),
    /// The whole system in one command: fresh database and stream, the order service, the relay and
    /// the three projections, a scripted story with a relay crash, a legacy event and a duplicate,
    /// then a comparison of the projections with the event store (exit 0 only when they agree).
    /// Runs `waybill-lab demo`; see `waybill demo --help`.
    #[command(disable_help_flag = true)]
    Demo(HandedOver),
    /// Play realistic order lifecycles against the order service, with a progress bar and a summary.
    /// Runs `waybill-lab load`; see `waybill load --help`.
    #[command(disable_help_flag = true)]
    Load(HandedOver),
    /// Start private PostgreSQL and NATS servers for whichever of DATABASE_URL and NATS_URL does not
    /// answer, print their URLs as shell exports, and keep them until SIGTERM/Ctrl-C. Runs
    /// `waybill-lab services`; see `waybill services --help`.
    #[command(disable_help_flag = true)]
    Services(HandedOver),
    /// Every kind of fault (killed and frozen relays, killed projections, NATS and PostgreSQL crashes,
    /// ended sessions, hostile messages) against the real processes under load on private servers,
    /// then a verdict from first principles. Runs `waybill-lab chaos`; see `waybill chaos --help`.
    #[command(disable_help_flag = true)]
    Chaos(HandedOver),
    /// Every performance figure from one run on the local services (command side, relay, projections,
    /// the whole pipeline over HTTP), a table or --json, --plot FILE.svg, and the performance targets
    /// judged. Runs `waybill-lab bench`; see `waybill bench --help`.
    #[command(disable_help_flag = true)]
    Bench(HandedOver),
    /// The event catalog: every payload's JSON Schema, or (with --asyncapi) an AsyncAPI document of the
    /// stream's subjects, headers and messages; `show` and `diff` explore it.
    Schema(SchemaArgs),
    /// Inspect and repair the outbox: status, dead rows, purge (the same as `waybill-relay`), and
    /// verify or repair the stream against the event store.
    #[command(subcommand)]
    Outbox(OutboxCommand),
    /// Least-privilege PostgreSQL roles for the processes (run as the database's owner).
    #[command(subcommand)]
    Roles(RolesCommand),
    /// Register, rename and show customers (the second aggregate type beside orders).
    #[command(subcommand)]
    Customer(CustomerCommand),
    #[command(flatten)]
    Order(OrderCommand),
}

/// `waybill customer …`.
#[derive(Debug, Subcommand)]
pub(crate) enum CustomerCommand {
    /// Register a customer under a handle (the `customer_id` its orders carry).
    ///
    /// Example: waybill customer register --customer alice --name "Alice Liddell"
    Register(CustomerRegisterArgs),
    /// Give a registered customer a new name.
    Rename(CustomerRenameArgs),
    /// Show a customer as folded from its events.
    Show(CustomerShowArgs),
}

/// `waybill customer register`.
#[derive(Debug, Args)]
pub(crate) struct CustomerRegisterArgs {
    /// The handle, 1–64 characters from [A-Za-z0-9._:-].
    #[arg(long, value_parser = parse_customer)]
    pub customer: CustomerId,
    /// The name to show.
    #[arg(long, value_parser = |t: &str| Note::required("name", t).map_err(|e| e.to_string()))]
    pub name: Note,
    /// A key that makes the command safe to retry (as for orders).
    #[arg(long, value_name = "KEY")]
    pub idempotency_key: Option<String>,
}

/// `waybill customer rename`.
#[derive(Debug, Args)]
pub(crate) struct CustomerRenameArgs {
    /// The handle.
    #[arg(long, value_parser = parse_customer)]
    pub customer: CustomerId,
    /// The new name.
    #[arg(long, value_parser = |t: &str| Note::required("name", t).map_err(|e| e.to_string()))]
    pub name: Note,
    /// Only rename if the customer is at exactly this version.
    #[arg(long, value_name = "VERSION")]
    pub expected_version: Option<i64>,
}

/// `waybill customer show`.
#[derive(Debug, Args)]
pub(crate) struct CustomerShowArgs {
    /// The handle.
    #[arg(long, value_parser = parse_customer)]
    pub customer: CustomerId,
}

fn parse_customer(text: &str) -> Result<CustomerId, String> {
    CustomerId::parse(text).map_err(|e| e.to_string())
}

/// `waybill outbox …`.
#[derive(Debug, Subcommand)]
pub(crate) enum OutboxCommand {
    #[command(flatten)]
    Rows(relay::cli::OutboxCommand),
    #[command(flatten)]
    Stream(relay::cli::StreamCheckCommand),
}

/// The arguments of a command that another binary carries out (`waybill-lab`), passed on as given.
#[derive(Debug, Args)]
pub(crate) struct HandedOver {
    /// Arguments for the `waybill-lab` command of the same name (try --help).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    pub args: Vec<String>,
}

/// `waybill roles …`.
#[derive(Debug, Subcommand)]
pub(crate) enum RolesCommand {
    /// Create (or bring up to date) the group roles waybill_app (the command side: append events,
    /// outbox rows and idempotency keys; read events), waybill_relay (read and settle the outbox, its
    /// journal, purge) and waybill_projection (its own schemas, and read events to catch up from
    /// them; no write to events, no access to the outbox).
    /// Idempotent. Make login users members, e.g.
    /// CREATE ROLE relay1 LOGIN PASSWORD '…' IN ROLE waybill_relay;
    Create,
}

/// The commands that read or change one order.
#[derive(Debug, Subcommand)]
pub(crate) enum OrderCommand {
    /// Place a new order.
    ///
    /// Example: waybill place --customer alice --currency EUR --line MUG-BLUE:2:1250 --line TEA:1:500
    Place(PlaceArgs),
    /// Pay a placed order; the amount must equal the order total.
    Pay(PayArgs),
    /// Cancel a placed or paid order (cancelling a paid order is a refund).
    Cancel(CancelArgs),
    /// Ship a paid order.
    Ship(ShipArgs),
    /// Show an order as folded from its events.
    Show(ShowArgs),
}

/// `waybill schema`: without a subcommand, the whole catalog (as it always printed it).
#[derive(Debug, Args)]
// `waybill schema` and `waybill schema --asyncapi` keep their meaning; a subcommand takes none of
// these flags, so mixing them is an error rather than a flag silently ignored.
#[command(args_conflicts_with_subcommands = true)]
pub(crate) struct SchemaArgs {
    /// Print the AsyncAPI document instead of the payload schemas.
    #[arg(long)]
    pub asyncapi: bool,
    /// The stream named in the AsyncAPI document.
    #[arg(long, env = "WAYBILL_STREAM", default_value = domain::wire::DEFAULT_STREAM)]
    pub stream: String,
    /// The subject prefix of the channels.
    #[arg(long, env = "WAYBILL_SUBJECT_PREFIX", default_value = domain::wire::DEFAULT_SUBJECT_PREFIX)]
    pub subject_prefix: String,
    #[command(subcommand)]
    pub command: Option<SchemaCommand>,
}

/// `waybill schema show|diff`.
#[derive(Debug, Subcommand)]
pub(crate) enum SchemaCommand {
    /// Print the JSON Schema of one payload version, exactly as it is committed under
    /// domain/schemas/ (maintainers write that file with `cargo xtask write-schema`).
    ///
    /// Example: waybill schema show order.placed --version 2
    // `--version` is the payload version here, not this program's.
    #[command(disable_version_flag = true)]
    Show(SchemaShowArgs),
    /// What changed in a payload from version A to version B: fields added, removed and changed (type,
    /// required or optional, pattern, enum, bounds…), nested fields included (`lines[].sku`).
    ///
    /// Example: waybill schema diff order.placed 1 2 --json
    Diff(SchemaDiffArgs),
}

/// `waybill schema show`.
#[derive(Debug, Args)]
pub(crate) struct SchemaShowArgs {
    /// The event type, e.g. order.placed or customer.renamed.
    pub event_type: String,
    /// The payload version [default: the type's current version].
    #[arg(long = "version", value_name = "N")]
    pub version: Option<i32>,
}

/// `waybill schema diff`.
#[derive(Debug, Args)]
pub(crate) struct SchemaDiffArgs {
    /// The event type, e.g. order.placed.
    pub event_type: String,
    /// The version to compare from.
    #[arg(value_name = "A")]
    pub from: i32,
    /// The version to compare to.
    #[arg(value_name = "B")]
    pub to: i32,
}

/// `waybill serve`.
#[derive(Debug, Args)]
pub(crate) struct ServeArgs {
    /// Address of the public API.
    #[arg(long, env = "WAYBILL_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: std::net::SocketAddr,

    /// Address of /metrics and /health, kept apart from the API so they need not be exposed with it
    /// and stay reachable when the API is busy.
    #[arg(long, env = "WAYBILL_METRICS_LISTEN", default_value = "127.0.0.1:9463")]
    pub metrics_listen: std::net::SocketAddr,

    /// How often at most the service wakes the relays (one `pg_notify` from its own connection,
    /// never inside a command's transaction) after commands wrote events. Shorter: events leave
    /// sooner after their commit; longer: fewer notifications and relay steps under load. Relays
    /// poll on their own as well, so a lost notification only delays. At most 10s: longer would
    /// leave the relays to their polling (likely a typo for milliseconds).
    #[arg(long, env = "WAYBILL_NOTIFY_INTERVAL", default_value = "5ms", value_parser = notify_interval)]
    pub notify_interval: std::time::Duration,

    /// Group commit's writer tasks: commands of different orders that arrive together are written by
    /// one statement and one commit, several times cheaper for PostgreSQL per command under load; a
    /// command that finds no other waiting is written at once. More writers: more statements at once,
    /// smaller groups. 0 writes every command alone. Commands with an Idempotency-Key are always
    /// written alone (the key's record shares their transaction).
    #[arg(long, env = "WAYBILL_GROUP_COMMIT_WRITERS", default_value_t = store::GroupCommit::DEFAULT_WRITERS, value_parser = clap::value_parser!(u16).range(0..=64))]
    pub group_commit_writers: u16,

    #[command(flatten)]
    pub edge: EdgeArgs,

    #[command(flatten)]
    pub versions: WriteVersionArgs,
}

/// The limits of the HTTP edge, on both listeners.
#[derive(Debug, Args)]
pub(crate) struct EdgeArgs {
    /// Time a client has to send a request's headers (from connect, or from the previous response).
    #[arg(long, env = "WAYBILL_HEADER_READ_TIMEOUT", default_value = "10s", value_parser = duration)]
    pub header_read_timeout: std::time::Duration,

    /// Time a request may take from its headers to its response, body included (then 503).
    #[arg(long, env = "WAYBILL_REQUEST_TIMEOUT", default_value = "30s", value_parser = duration)]
    pub request_timeout: std::time::Duration,

    /// A kept-alive connection without a request for this long is closed (at most the header read
    /// timeout, whose clock also runs between requests).
    #[arg(long, env = "WAYBILL_KEEP_ALIVE_IDLE", default_value = "5s", value_parser = duration)]
    pub keep_alive_idle: std::time::Duration,

    /// Open connections per listener at most; further clients wait to be accepted.
    #[arg(long, env = "WAYBILL_MAX_CONNECTIONS", default_value_t = 1024,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub max_connections: u32,
}

impl EdgeArgs {
    /// The edge configuration these flags describe.
    pub(crate) fn config(&self) -> ops::EdgeConfig {
        ops::EdgeConfig {
            header_read_timeout: self.header_read_timeout,
            request_timeout: self.request_timeout,
            keep_alive_idle: self.keep_alive_idle,
            max_connections: self.max_connections as usize,
        }
    }
}

/// A notify interval: a positive duration of at most 10 seconds.
fn notify_interval(text: &str) -> Result<std::time::Duration, String> {
    const LONGEST: std::time::Duration = std::time::Duration::from_secs(10);
    let interval = duration(text)?;
    if interval > LONGEST {
        return Err(format!(
            "at most {LONGEST:?}: relays would wait for their own polling instead"
        ));
    }
    Ok(interval)
}

/// A positive duration like `10s` or `500ms`.
fn duration(text: &str) -> Result<std::time::Duration, String> {
    match humantime::parse_duration(text) {
        Ok(d) if !d.is_zero() => Ok(d),
        Ok(_) => Err("it must be longer than zero".to_owned()),
        Err(e) => Err(format!("{e}; write it like 10s or 500ms")),
    }
}

/// Options every state-changing command accepts.
#[derive(Debug, Args)]
pub(crate) struct WriteOptions {
    /// A key that makes the command safe to retry: a repeat with the same key and the same request
    /// returns the first result and writes nothing; the same key with a different request is refused.
    #[arg(long, value_name = "KEY")]
    pub idempotency_key: Option<String>,

    /// Only apply the command if the order is at exactly this version (optimistic locking).
    #[arg(long, value_name = "VERSION")]
    pub expected_version: Option<i64>,

    /// Correlation id to stamp on the events (a new one is started when absent).
    #[arg(long, value_name = "UUID")]
    pub correlation_id: Option<Uuid>,

    #[command(flatten)]
    pub versions: WriteVersionArgs,
}

/// Which payload versions to write: the expand phase of a rollout.
#[derive(Debug, Args)]
pub(crate) struct WriteVersionArgs {
    /// Write this event type in an older payload version, as TYPE=VERSION (e.g. order.placed=2), while
    /// readers that know only that version are still running; repeatable (comma-separated in the
    /// environment variable). Each event is downcast from the current version, and one the older
    /// version cannot represent is refused (exit 2, HTTP 422) rather than changed. Default: every
    /// type in its current version.
    #[arg(long = "write-version", env = "WAYBILL_WRITE_VERSIONS", value_name = "TYPE=VERSION", value_delimiter = ',', value_parser = write_version)]
    pub write_versions: Vec<(String, i32)>,
}

impl WriteVersionArgs {
    /// The versions to write.
    pub(crate) fn versions(&self) -> domain::WriteVersions {
        domain::WriteVersions::from_pairs(self.write_versions.iter().cloned())
    }
}

fn write_version(text: &str) -> Result<(String, i32), String> {
    domain::WriteVersions::parse_one(text, &domain::Upcasters::all())
}

/// `waybill place`.
#[derive(Debug, Args)]
pub(crate) struct PlaceArgs {
    /// Who places the order: 1–64 characters from letters, digits, '-', '_', '.' and ':'.
    #[arg(long, value_name = "CUSTOMER_ID", value_parser = CustomerId::parse)]
    pub customer: CustomerId,

    /// ISO 4217 currency code of the prices, e.g. EUR.
    #[arg(long, value_parser = Currency::parse)]
    pub currency: Currency,

    /// An order line, repeatable: SKU (A-Z, 0-9, '-', '_'), quantity (1–1000000) and unit price in
    /// cents (positive), e.g. --line MUG-BLUE:2:1250.
    #[arg(long = "line", value_name = "SKU:QTY:UNIT_PRICE_CENTS", value_parser = OrderLine::parse)]
    pub lines: Vec<OrderLine>,

    /// Where the order is placed: web, app, store, phone or marketplace.
    #[arg(long, default_value = "web", value_parser = domain::Channel::parse)]
    pub channel: domain::Channel,

    /// Use this id for the new order instead of generating a UUID v7.
    #[arg(long, value_name = "UUID", value_parser = OrderId::parse)]
    pub order_id: Option<OrderId>,

    #[command(flatten)]
    pub write: WriteOptions,
}

/// `waybill pay`.
#[derive(Debug, Args)]
pub(crate) struct PayArgs {
    /// The order to pay.
    #[arg(value_parser = OrderId::parse)]
    pub order_id: OrderId,

    /// The amount in cents; must equal the order total.
    #[arg(long, value_name = "CENTS", value_parser = Cents::parse, allow_hyphen_values = true)]
    pub amount: Cents,

    /// The payment provider's reference.
    #[arg(long, value_name = "REF", value_parser = Note::parse)]
    pub payment_ref: Option<Note>,

    #[command(flatten)]
    pub write: WriteOptions,
}

/// `waybill cancel`.
#[derive(Debug, Args)]
pub(crate) struct CancelArgs {
    /// The order to cancel.
    #[arg(value_parser = OrderId::parse)]
    pub order_id: OrderId,

    /// Why the order is cancelled (at most 200 characters).
    #[arg(long, default_value = "no reason given", value_parser = Note::parse)]
    pub reason: Note,

    #[command(flatten)]
    pub write: WriteOptions,
}

/// `waybill ship`.
#[derive(Debug, Args)]
pub(crate) struct ShipArgs {
    /// The order to ship.
    #[arg(value_parser = OrderId::parse)]
    pub order_id: OrderId,

    /// Who carries the parcel.
    #[arg(long, value_parser = |s: &str| Note::required("carrier", s))]
    pub carrier: Note,

    /// The carrier's tracking number.
    #[arg(long = "tracking", value_name = "TRACKING_NUMBER", value_parser = |s: &str| Note::required("tracking number", s))]
    pub tracking_number: Note,

    #[command(flatten)]
    pub write: WriteOptions,
}

/// `waybill show`.
#[derive(Debug, Args)]
pub(crate) struct ShowArgs {
    /// The order to show.
    #[arg(value_parser = OrderId::parse)]
    pub order_id: OrderId,
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_grammar_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn the_notify_interval_is_a_positive_duration() {
        let interval = |extra: &[&str]| {
            let args = [&["waybill", "serve"][..], extra].concat();
            Cli::try_parse_from(args).map(|cli| match cli.command {
                Command::Serve(serve) => serve.notify_interval,
                _ => unreachable!("parsed as serve"),
            })
        };
        assert_eq!(
            interval(&[]).expect("default"),
            std::time::Duration::from_millis(5)
        );
        assert_eq!(
            interval(&["--notify-interval", "20ms"]).expect("20ms"),
            std::time::Duration::from_millis(20)
        );
        assert!(interval(&["--notify-interval", "0s"]).is_err());
        assert!(interval(&["--notify-interval", "soon"]).is_err());
        assert!(interval(&["--notify-interval", "10s"]).is_ok());
        assert!(
            interval(&["--notify-interval", "11s"]).is_err(),
            "a typo for ms"
        );
        assert!(interval(&["--notify-interval", "100years"]).is_err());
    }
}
