//! Test support for the integration tests of every crate: the URL of a `#[sqlx::test]` database (to
//! hand to a binary), seeding orders through the real command path, and reading a stream back.
//! Used only as a dev-dependency; nothing here is on a production path.

use std::collections::BTreeMap;

use async_nats::HeaderMap;
use async_nats::jetstream;
use domain::{
    Currency, CustomerId, EventEnvelope, OrderCommand, OrderId, OrderLine, PayOrder, PlaceOrder,
};
use sqlx::PgPool;
use store::{CommandContext, EventStore};
use uuid::Uuid;

/// The URL of the database `pool` is connected to, on the server and as the user of `DATABASE_URL`.
pub async fn database_url(pool: &PgPool) -> String {
    let name: String = sqlx::query_scalar("SELECT current_database()")
        .fetch_one(pool)
        .await
        .expect("current_database()");
    let base = std::env::var("DATABASE_URL").expect("DATABASE_URL is set for sqlx::test");
    store::with_database(&base, &name)
}

/// A place-order command for `customer` with the given `SKU:QTY:PRICE` lines.
pub fn place(customer: &str, lines: &[&str]) -> OrderCommand {
    OrderCommand::Place(PlaceOrder {
        customer_id: CustomerId::parse(customer).expect("customer id"),
        currency: Currency::parse("EUR").expect("currency"),
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

/// One message read back from a stream.
#[derive(Debug, Clone)]
pub struct StoredEvent {
    /// Stream sequence.
    pub sequence: u64,
    /// Subject it was published to.
    pub subject: String,
    /// Its headers.
    pub headers: HeaderMap,
    /// The decoded envelope.
    pub envelope: EventEnvelope,
}

/// Every message in `stream`, in stream order.
pub async fn stream_events(jetstream: &jetstream::Context, stream: &str) -> Vec<StoredEvent> {
    let mut stream = jetstream.get_stream(stream).await.expect("stream exists");
    let state = stream.info().await.expect("stream info").state.clone();
    let mut events = Vec::with_capacity(state.messages as usize);
    for sequence in state.first_sequence..=state.last_sequence {
        if state.messages == 0 {
            break;
        }
        let Ok(message) = stream.get_raw_message(sequence).await else {
            continue;
        };
        let envelope = EventEnvelope::from_json(&message.payload).expect("an envelope");
        events.push(StoredEvent {
            sequence,
            subject: message.subject.to_string(),
            headers: message.headers,
            envelope,
        });
    }
    events
}

/// For each aggregate, its versions in stream order.
pub fn versions_by_aggregate(events: &[StoredEvent]) -> BTreeMap<Uuid, Vec<i64>> {
    let mut by_aggregate: BTreeMap<Uuid, Vec<i64>> = BTreeMap::new();
    for event in events {
        by_aggregate
            .entry(event.envelope.aggregate_id)
            .or_default()
            .push(event.envelope.aggregate_version);
    }
    by_aggregate
}

/// Counts rows of the outbox by status.
pub async fn outbox_counts(pool: &PgPool) -> BTreeMap<String, i64> {
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT status, count(*) FROM outbox GROUP BY status")
            .fetch_all(pool)
            .await
            .expect("outbox counts");
    rows.into_iter().collect()
}

/// What a stream read back says about the relay's promises.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StreamCheck {
    /// Messages read.
    pub messages: usize,
    /// Event ids stored more than once.
    pub duplicates: Vec<Uuid>,
    /// Aggregates whose versions, in stream order, are not exactly 1, 2, 3, …
    pub out_of_order: Vec<Uuid>,
    /// Sequences of messages whose `Nats-Expected-Last-Subject-Sequence` is missing or is not the
    /// sequence of the previous message on their subject.
    pub fence_mismatches: Vec<u64>,
    /// Sequences of messages not on `<prefix>.<aggregate type>.<aggregate id>` of their own envelope.
    pub wrong_subject: Vec<u64>,
}

impl StreamCheck {
    /// True when every promise holds.
    pub fn holds(&self) -> bool {
        self.duplicates.is_empty()
            && self.out_of_order.is_empty()
            && self.fence_mismatches.is_empty()
            && self.wrong_subject.is_empty()
    }
}

/// Checks `events` (in stream order) from first principles: each event once, each aggregate's versions
/// 1..n in order, each on its aggregate's subject under `prefix`, and each message fenced on the
/// sequence of the previous message on its subject.
pub fn check_stream(events: &[StoredEvent], prefix: &str) -> StreamCheck {
    let mut check = StreamCheck {
        messages: events.len(),
        ..StreamCheck::default()
    };
    let mut seen = std::collections::BTreeSet::new();
    let mut last_on_subject: BTreeMap<&str, u64> = BTreeMap::new();
    for event in events {
        if !seen.insert(event.envelope.event_id) {
            check.duplicates.push(event.envelope.event_id);
        }
        let expected = event
            .headers
            .get("Nats-Expected-Last-Subject-Sequence")
            .and_then(|v| v.as_str().parse::<u64>().ok());
        let previous = last_on_subject.insert(event.subject.as_str(), event.sequence);
        if expected != Some(previous.unwrap_or(0)) {
            check.fence_mismatches.push(event.sequence);
        }
        let subject = format!(
            "{prefix}.{}.{}",
            event.envelope.aggregate_type, event.envelope.aggregate_id
        );
        if event.subject != subject {
            check.wrong_subject.push(event.sequence);
        }
    }
    for (aggregate, versions) in versions_by_aggregate(events) {
        if !versions.iter().copied().eq(1..=versions.len() as i64) {
            check.out_of_order.push(aggregate);
        }
    }
    check
}

/// A private nats-server with TLS (a throwaway CA made with the `openssl` command) and the project's
/// shipped accounts (deploy/nats/accounts.conf), renamed to a test's stream and subject prefix.
pub mod secure_nats {
    use std::path::{Path, PathBuf};
    use std::process::Command;

    use ops::NatsServer;

    /// The relay user's password in [`SecureNats`].
    pub const RELAY_PASSWORD: &str = "relay-Secret-1";
    /// The inventory user's password in [`SecureNats`].
    pub const INVENTORY_PASSWORD: &str = "inventory-Secret-2";

    /// The running server, its CA and its folder (removed on drop).
    #[derive(Debug)]
    pub struct SecureNats {
        /// The server (TLS required; its `url()` says nats:// — use tls://).
        pub server: NatsServer,
        /// The CA file that signed the server's certificate.
        pub ca: PathBuf,
        dir: PathBuf,
    }

    impl Drop for SecureNats {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    impl SecureNats {
        /// Starts it for `stream` under `prefix`.
        pub fn start(stream: &str, prefix: &str) -> Self {
            let dir = ops::unique_temp_dir("waybill-tls", 0).expect("temp dir");
            let (ca, cert, key) = certificates(&dir);
            let shipped = std::fs::read_to_string(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../deploy/nats/accounts.conf"
            ))
            .expect("the shipped accounts.conf");
            let accounts = shipped
                .replace("WAYBILL_EVENTS", stream)
                .replace("waybill.events", prefix)
                .replace("$WAYBILL_RELAY_PASSWORD", &format!("\"{RELAY_PASSWORD}\""))
                .replace(
                    "$WAYBILL_INVENTORY_PASSWORD",
                    &format!("\"{INVENTORY_PASSWORD}\""),
                )
                .replace("$WAYBILL_POINTS_PASSWORD", "\"points-pw\"")
                .replace("$WAYBILL_SEARCH_PASSWORD", "\"search-pw\"")
                .replace("$WAYBILL_ADMIN_PASSWORD", "\"admin-pw\"");
            let config = format!(
                "tls {{\n  cert_file: \"{}\"\n  key_file: \"{}\"\n}}\n{accounts}",
                cert.display(),
                key.display()
            );
            let server = NatsServer::start_with_config(&config).expect("secure nats-server");
            Self { server, ca, dir }
        }

        /// `tls://user:password@127.0.0.1:PORT`.
        pub fn url_for(&self, user: &str, password: &str) -> String {
            self.server
                .url()
                .replace("nats://", &format!("tls://{user}:{password}@"))
        }
    }

    /// A self-signed CA and a server certificate for 127.0.0.1, made with the openssl command.
    fn certificates(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
        let run = |args: &[&str]| {
            let status = Command::new("openssl")
                .args(args)
                .current_dir(dir)
                .stderr(std::process::Stdio::null())
                .status()
                .expect("openssl runs");
            assert!(status.success(), "openssl {args:?}");
        };
        run(&[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=waybill test CA",
            "-keyout",
            "ca-key.pem",
            "-out",
            "ca.pem",
        ]);
        run(&[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=127.0.0.1",
            "-keyout",
            "server-key.pem",
            "-out",
            "server.csr",
        ]);
        std::fs::write(
            dir.join("san.ext"),
            "subjectAltName=IP:127.0.0.1,DNS:localhost\n",
        )
        .expect("ext");
        run(&[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca-key.pem",
            "-CAcreateserial",
            "-days",
            "1",
            "-extfile",
            "san.ext",
            "-out",
            "server.pem",
        ]);
        (
            dir.join("ca.pem"),
            dir.join("server.pem"),
            dir.join("server-key.pem"),
        )
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
