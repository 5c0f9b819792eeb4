//! What tests, benchmarks and the lab (demo, chaos and load tool) need to stand the system up and
//! check it: private nats-server and PostgreSQL instances, free ports, the URL of a `#[sqlx::test]`
//! database (to hand to a binary), a proxy whose connections break on the client's side only,
//! seeding orders through the real command path, reading a stream back, polling until a condition
//! holds, and measurement helpers for the benchmark programs. A dev-dependency of the libraries and
//! a dependency of `lab` only; no service links it.

use std::collections::BTreeMap;
use std::future::Future;
use std::time::{Duration, Instant};

use domain::{
    Currency, CustomerId, EventEnvelope, OrderCommand, OrderId, OrderLine, PayOrder, PlaceOrder,
};
use sqlx::PgPool;
use store::{CommandContext, EventStore};
use uuid::Uuid;

pub mod cut_proxy;
pub mod local_nats;
pub mod local_postgres;
pub mod login;
pub mod nats_cluster;
mod relaying;
pub mod secure_nats;
pub mod stats;
mod stream;

pub use cut_proxy::CutProxy;
pub use local_nats::{
    NatsServer, find_binary, free_port, free_ports, nats_server_binary, server_version,
};
pub use local_postgres::{PostgresServer, reachable};
pub use login::Login;
pub use nats_cluster::NatsCluster;
pub use relaying::relay_everything;
pub use stream::{StoredEvent, StreamCheck, check_stream, stream_events, versions_by_aggregate};

/// A finished command as a test reads it: its exit code (-1 when a signal ended it) and its output
/// as text.
#[derive(Debug)]
pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl From<std::process::Output> for Run {
    fn from(output: std::process::Output) -> Self {
        Self {
            code: output.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
        }
    }
}

impl Run {
    /// Fails the test, with the output, unless the command exited 0.
    pub fn ok(self) -> Self {
        assert_eq!(self.code, 0, "{}{}", self.stdout, self.stderr);
        self
    }

    /// Standard output parsed as JSON; a test fails with the output when it is not JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {}", self.stdout))
    }
}

/// Builds every binary of the workspace that holds the crate at `crate_dir` (a test's
/// `env!("CARGO_MANIFEST_DIR")`), and the relay's and the projections' testing twins
/// (`waybill-relay-faulty`, `waybill-projection-faulty`), for tests that run another crate's binary:
/// cargo builds only the test's own crate's binaries for it. Always this one feature set (the one
/// scripts/test and scripts/demo build), so that the builds share what they compiled.
pub fn build_workspace_binaries(crate_dir: &str) {
    let workspace = std::path::Path::new(crate_dir)
        .parent()
        .expect("the crate sits in the workspace");
    let built = std::process::Command::new(env!("CARGO"))
        .current_dir(workspace)
        .args(["build", "--quiet", "--workspace", "--bins"])
        .args(["--features", "lab/fault-injection"])
        .status()
        .expect("cargo runs");
    assert!(built.success(), "the workspace's binaries build");
}

/// Another crate's binary (`waybill-relay`, `waybill-inventory`, …), built now with the whole
/// workspace if needed: it lands beside `own_binary` (a test's `env!("CARGO_BIN_EXE_<name>")`) in the
/// same target directory. `crate_dir` is the test's `env!("CARGO_MANIFEST_DIR")`.
pub fn workspace_binary(crate_dir: &str, own_binary: &str, name: &str) -> std::path::PathBuf {
    build_workspace_binaries(crate_dir);
    let binary = std::path::Path::new(own_binary).with_file_name(name);
    assert!(binary.is_file(), "{} is missing", binary.display());
    binary
}

/// The URL of the database `pool` is connected to, on the server and as the user of `DATABASE_URL`.
pub async fn database_url(pool: &PgPool) -> String {
    let name: String = sqlx::query_scalar("SELECT current_database()")
        .fetch_one(pool)
        .await
        .expect("current_database()");
    let base = std::env::var("DATABASE_URL").expect("DATABASE_URL is set for sqlx::test");
    ops::database::with_database(&base, &name)
}

/// A place-order command for `customer` with the given `SKU:QTY:PRICE` lines.
pub fn place(customer: &str, lines: &[&str]) -> OrderCommand {
    OrderCommand::Place(PlaceOrder {
        customer_id: CustomerId::parse(customer).expect("customer id"),
        currency: Currency::parse("EUR").expect("currency"),
        channel: domain::Channel::Web,
        lines: lines
            .iter()
            .map(|l| OrderLine::parse(l).expect("line"))
            .collect(),
    })
}

/// Places an order through the event store and returns its id.
pub async fn place_order(store: &EventStore, customer: &str, lines: &[&str]) -> OrderId {
    let id = OrderId::from_uuid(Uuid::now_v7());
    store
        .execute(id, &place(customer, lines), &CommandContext::default())
        .await
        .expect("place");
    id
}

/// Pays an order in full through the event store.
pub async fn pay_order(store: &EventStore, id: OrderId) {
    let order = store.load(id).await.expect("load");
    let command = OrderCommand::Pay(PayOrder {
        amount_cents: domain::Cents::new(order.total_cents).expect("amount"),
        payment_ref: None,
    });
    store
        .execute(id, &command, &CommandContext::default())
        .await
        .expect("pay");
}

/// Ships a paid order through the event store.
pub async fn ship_order(store: &EventStore, id: OrderId) {
    let command = OrderCommand::Ship(domain::ShipOrder {
        carrier: domain::Note::required("carrier", "DHL").expect("carrier"),
        tracking_number: domain::Note::required("tracking_number", "T-1").expect("tracking"),
    });
    store
        .execute(id, &command, &CommandContext::default())
        .await
        .expect("ship");
}

/// Cancels an order through the event store; returns the event id written.
pub async fn cancel_order(store: &EventStore, id: OrderId) -> Uuid {
    let command = OrderCommand::Cancel(domain::CancelOrder {
        reason: domain::Note::required("reason", "changed my mind").expect("reason"),
    });
    let written = store
        .execute(id, &command, &CommandContext::default())
        .await
        .expect("cancel");
    written.event_ids[0]
}

/// Leaves the database as a restore from an older backup would: the aggregate's events after version
/// `keep`, and their outbox rows, never happened. (Rows of `events` are otherwise immutable;
/// replication mode skips the trigger that says so.)
pub async fn restore_behind(pool: &PgPool, aggregate: Uuid, keep: i64) {
    let mut tx = pool.begin().await.expect("begin");
    sqlx::query("SET LOCAL session_replication_role = replica")
        .execute(&mut *tx)
        .await
        .expect("replica mode");
    store::outbox::fixtures::forget_after(&mut tx, aggregate, keep)
        .await
        .expect("forget the later outbox rows");
    sqlx::query("DELETE FROM events WHERE aggregate_id = $1 AND aggregate_version > $2")
        .bind(aggregate)
        .bind(keep)
        .execute(&mut *tx)
        .await
        .expect("forget the later events");
    tx.commit().await.expect("commit");
}

/// Counts rows of the outbox by status.
pub async fn outbox_counts(pool: &PgPool) -> BTreeMap<String, i64> {
    store::outbox::fixtures::counts_by_status(pool)
        .await
        .expect("outbox counts")
        .into_iter()
        .map(|(status, count)| (status.to_string(), count))
        .collect()
}

/// Polls `check` until it is true or `timeout` passes; panics naming `what` on timeout.
pub async fn wait_until<F, Fut>(timeout: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if check().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("timed out after {timeout:?} waiting for {what}");
}

/// Sends `signal` to process `pid` (a child's `id()`, `None` once it was reaped): a test's SIGSTOP,
/// SIGCONT or SIGKILL of a process under test.
pub fn send_signal(pid: Option<u32>, signal: rustix::process::Signal) {
    let pid = pid
        .and_then(|id| rustix::process::Pid::from_raw(i32::try_from(id).ok()?))
        .expect("a running process");
    rustix::process::kill_process(pid, signal).expect("signal sent");
}

/// An `order.placed` v1 for a new order: the legacy shape (an order number and an amount, before
/// currency and lines existed), as an import from the old system writes it. Appended with
/// `store::append`, it bypasses the domain, so only the upcaster can make sense of it.
pub fn legacy_placed(order: Uuid) -> EventEnvelope {
    EventEnvelope {
        event_id: Uuid::now_v7(),
        event_type: "order.placed".into(),
        event_version: 1,
        aggregate_type: "order".into(),
        aggregate_id: order,
        aggregate_version: 1,
        occurred_at: chrono::Utc::now(),
        correlation_id: None,
        causation_id: None,
        payload: serde_json::json!({"order_no": "A-1001", "amount_cents": 4200}),
    }
}

/// Asserts that no ": "-separated clause of a printed error chain appears twice (a message that quotes
/// its own source prints the cause twice).
pub fn assert_no_clause_repeats(printed: &str) {
    let clauses: Vec<&str> = printed.split(": ").collect();
    for (i, clause) in clauses.iter().enumerate() {
        assert!(
            !clauses[i + 1..].contains(clause),
            "{clause:?} appears twice in {printed:?}"
        );
    }
}

/// Prints `error` and its causes as a report does (outermost first, joined by ": "), asserts that no
/// clause repeats and that no message quotes its source, and returns the printed chain.
pub fn assert_said_once(error: &dyn std::error::Error) -> String {
    let mut messages = vec![error.to_string()];
    let mut source = error.source();
    while let Some(cause) = source {
        messages.push(cause.to_string());
        source = cause.source();
    }
    let printed = messages.join(": ");
    assert_no_clause_repeats(&printed);
    for pair in messages.windows(2) {
        assert!(
            !pair[0].contains(&pair[1]),
            "{:?} repeats its source {:?}",
            pair[0],
            pair[1]
        );
    }
    printed
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    #[tokio::test]
    async fn waiting_ends_as_soon_as_the_check_holds() {
        let calls = AtomicU32::new(0);
        wait_until(Duration::from_secs(5), "the third call", || async {
            calls.fetch_add(1, Ordering::SeqCst) == 2
        })
        .await;
        assert_eq!(calls.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    #[should_panic(expected = "waiting for the impossible")]
    async fn a_check_that_never_holds_panics_naming_what_was_awaited() {
        wait_until(Duration::from_millis(100), "the impossible", || async {
            false
        })
        .await;
    }
}
