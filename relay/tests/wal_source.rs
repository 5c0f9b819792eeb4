//! `waybill-relay run --source wal` against a private PostgreSQL made for logical decoding and a
//! private nats-server: events from concurrent writers reach the stream once each and in order per
//! aggregate across a SIGKILL of the relay, a standby takes over from a killed reader, a slot that is
//! dropped under the relay is recovered from the outbox without loss or copies, and a polling relay
//! beside a WAL relay stands by until that relay dies or freezes past the server's timeout.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use rustix::process::Signal;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use store::EventStore;
use testkit::{NatsServer, PostgresServer, wait_until};
use tokio::process::{Child, Command};

const RELAY: &str = env!("CARGO_BIN_EXE_waybill-relay");
const STREAM: &str = "WAL_EVENTS";
const PREFIX: &str = "wal.events";

/// Taken by the tests that write a large transaction, and by the one that counts polling passes
/// against the clock: run beside such a transaction on two cores, that one's passes came late (one
/// failure in a full run, and another beside the 1,500-row transaction of the broker-refuses test),
/// and the large ones are not run beside each other either.
static HEAVY_OR_TIMED: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

struct World {
    // Dropped last: the servers outlive the relays and pools.
    pool: PgPool,
    store: EventStore,
    url: String,
    nats_url: String,
    logs: tempfile::TempDir,
    nats: NatsServer,
    _postgres: PostgresServer,
}

impl World {
    async fn new() -> Self {
        Self::on(PostgresServer::start().expect("private PostgreSQL")).await
    }

    /// A world on `postgres`.
    async fn on(postgres: PostgresServer) -> Self {
        Self::on_with(postgres, NatsServer::start().expect("private nats-server")).await
    }

    /// A world on `postgres` and `nats`.
    async fn on_with(postgres: PostgresServer, nats: NatsServer) -> Self {
        let url = postgres.url("shop");
        ops::database::ensure_database(&url)
            .await
            .expect("database");
        let pool = PgPoolOptions::new()
            .max_connections(16)
            .connect(&url)
            .await
            .expect("connects");
        store::MIGRATOR.run(&pool).await.expect("migrated");
        Self {
            store: EventStore::new(pool.clone()),
            pool,
            url,
            nats_url: nats.url(),
            logs: tempfile::tempdir().expect("log directory"),
            nats,
            _postgres: postgres,
        }
    }

    /// Starts a WAL relay whose log goes to `<name>.log`.
    fn relay(&self, name: &str) -> Child {
        self.spawn_relay(name, "wal")
    }

    /// Starts a relay reading `source` (`wal` or `poll`) whose log goes to `<name>.log`.
    fn spawn_relay(&self, name: &str, source: &str) -> Child {
        self.spawn_relay_via(name, source, &self.nats_url, &[])
    }

    /// [`World::spawn_relay`] reaching NATS at `nats_url` (a proxy a test can take away), with
    /// `extra` arguments.
    fn spawn_relay_via(&self, name: &str, source: &str, nats_url: &str, extra: &[&str]) -> Child {
        let log = std::fs::File::create(self.log_path(name)).expect("log file");
        Command::new(RELAY)
            .args(["run", "--source", source, "--relay-id", name])
            .args(["--database-url", &self.url, "--nats-url", nats_url])
            .args(["--stream", STREAM, "--subject-prefix", PREFIX])
            .args(["--backoff", "100ms", "--publish-timeout", "2s"])
            .args(extra)
            .env("RUST_LOG", "info,relay=debug")
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .expect("relay starts")
    }

    fn log_path(&self, name: &str) -> PathBuf {
        self.logs.path().join(format!("{name}.log"))
    }

    fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.log_path(name)).unwrap_or_default()
    }

    async fn stream_messages(&self) -> u64 {
        let client = async_nats::connect(&self.nats_url).await.expect("NATS");
        let jetstream = async_nats::jetstream::new(client);
        match jetstream.get_stream(STREAM).await {
            Ok(mut stream) => stream.info().await.map(|i| i.state.messages).unwrap_or(0),
            Err(_) => 0,
        }
    }

    async fn unsent(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM outbox WHERE status <> 'sent'")
            .fetch_one(&self.pool)
            .await
            .expect("count")
    }

    async fn events(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM events")
            .fetch_one(&self.pool)
            .await
            .expect("count")
    }

    /// Waits until every event is in the stream and marked sent, then checks the stream from first
    /// principles: each event once, each aggregate's versions in order, each publish fenced.
    async fn everything_delivered_once_in_order(&self, relays: &[&str]) {
        let events = self.events().await;
        let logs = || {
            relays
                .iter()
                .map(|r| self.log(r))
                .collect::<Vec<_>>()
                .join("\n---\n")
        };
        let waited = tokio::time::timeout(Duration::from_secs(180), async {
            loop {
                let messages = self.stream_messages().await;
                if messages >= u64::try_from(events).expect("a count") && self.unsent().await == 0 {
                    return messages;
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        })
        .await;
        let Ok(messages) = waited else {
            panic!(
                "not delivered: {} of {events} in the stream, {} unsent\n{}",
                self.stream_messages().await,
                self.unsent().await,
                logs()
            );
        };
        assert_eq!(
            messages,
            u64::try_from(events).expect("a count"),
            "one message per event"
        );
        let client = async_nats::connect(&self.nats_url).await.expect("NATS");
        let stored = testkit::stream_events(&async_nats::jetstream::new(client), STREAM).await;
        let check = testkit::check_stream(&stored, PREFIX);
        assert!(check.holds(), "{check:?}\n{}", logs());
        assert_eq!(stored.len(), usize::try_from(events).expect("a count"));
    }

    /// Writes `orders` more orders, waits until the relays `wal` and `polling` delivered every event
    /// once and in order, and returns how many rows `polling` marked sent in all.
    async fn deliver_more_orders_and_count_polling_marks(&self, orders: usize) -> i64 {
        write(&self.store, 2, orders).await;
        self.everything_delivered_once_in_order(&["wal", "polling"])
            .await;
        self.sent_by("polling").await
    }

    /// Sets the newest outbox row back to pending, as `dead replay` and `outbox repair` set rows:
    /// the publication carries inserts only, so no WAL relay reads this from the slot.
    async fn make_the_last_row_due_again(&self) {
        sqlx::query(
            "UPDATE outbox SET status = 'pending', sent_at = NULL, next_run_at = now()
             WHERE id = (SELECT max(id) FROM outbox)",
        )
        .execute(&self.pool)
        .await
        .expect("a row due again");
    }

    /// Outbox rows the relay `relay_id` marked sent.
    async fn sent_by(&self, relay_id: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM outbox WHERE status = 'sent' AND claimed_by = $1")
            .bind(relay_id)
            .fetch_one(&self.pool)
            .await
            .expect("count")
    }

    /// Waits until a session reads the slot and nothing in the outbox is unsent.
    async fn until_the_slot_is_read_and_everything_sent(&self) {
        wait_until(
            Duration::from_secs(60),
            "a relay reads the slot and everything is sent",
            || async {
                self.slot().await.is_some_and(|(active, _)| active) && self.unsent().await == 0
            },
        )
        .await;
    }

    /// Writes `orders` orders, starts the WAL relay `wal` and waits until it delivered them (by its
    /// opening drain: written before the slot, they are not replayed from it, so no later mark of
    /// theirs races a test's own updates), then starts the polling relay `polling` and waits until
    /// it stands by.
    async fn wal_relay_and_a_polling_standby(&self, orders: usize) -> (Child, Child) {
        write(&self.store, 2, orders).await;
        let wal = self.relay("wal");
        self.until_the_slot_is_read_and_everything_sent().await;
        let polling = self.spawn_relay("polling", "poll");
        self.until_it_stands_by("polling").await;
        (wal, polling)
    }

    /// Waits until relay `name` logs that it stands by.
    async fn until_it_stands_by(&self, name: &str) {
        wait_until(
            Duration::from_secs(30),
            &format!("{name} says it stands by"),
            || async { self.log(name).contains("standing by") },
        )
        .await;
    }

    async fn slot(&self) -> Option<(bool, Option<i32>)> {
        sqlx::query_as(
            "SELECT active, active_pid FROM pg_replication_slots WHERE slot_name = 'waybill_outbox'",
        )
        .fetch_optional(&self.pool)
        .await
        .expect("slot")
    }
}

/// `orders` orders of three events each (placed, paid, shipped), written by `writers` tasks at once.
async fn write(store: &EventStore, writers: usize, orders: usize) {
    let mut tasks = tokio::task::JoinSet::new();
    for writer in 0..writers {
        let store = store.clone();
        let mine = orders / writers + usize::from(writer < orders % writers);
        tasks.spawn(async move {
            for _ in 0..mine {
                let id = testkit::place_order(&store, &format!("c{writer}"), &["MUG:1:100"]).await;
                testkit::pay_order(&store, id).await;
                testkit::ship_order(&store, id).await;
            }
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.expect("a writer");
    }
}

/// The relay's `/metrics` on `port`, by a plain HTTP/1.0 GET.
async fn get_metrics(port: u16) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("the metrics endpoint");
    stream
        .write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .await
        .expect("a request");
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await.expect("an answer");
    answer
}

fn sigkill(child: &mut Child) {
    child.start_kill().expect("SIGKILL");
}

fn signal(child: &Child, signal: Signal) {
    testkit::send_signal(child.id(), signal);
}

#[tokio::test]
async fn twenty_thousand_events_from_concurrent_writers_arrive_once_in_order_across_a_sigkill() {
    let world = World::new().await;
    let mut first = world.relay("first");
    // Writers start at once; the relay is killed while they write, with publishes in flight.
    let writing = {
        let store = world.store.clone();
        tokio::spawn(async move { write(&store, 8, 6_667).await })
    };
    wait_until(
        Duration::from_secs(120),
        "a third of the events relayed",
        || async { world.stream_messages().await >= 7_000 },
    )
    .await;
    sigkill(&mut first);
    let _ = first.wait().await;
    let mut second = world.relay("second");
    writing.await.expect("writers");
    assert!(world.events().await >= 20_000);
    world
        .everything_delivered_once_in_order(&["first", "second"])
        .await;
    // The slot's reader confirmed what it delivered: the slot holds on to nothing.
    wait_until(
        Duration::from_secs(10),
        "the slot confirmed the end of the WAL",
        || async {
            let lag: Option<i64> = sqlx::query_scalar(
                "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::int8
             FROM pg_replication_slots WHERE slot_name = 'waybill_outbox'",
            )
            .fetch_one(&world.pool)
            .await
            .expect("lag");
            lag.is_some_and(|lag| lag < 64 * 1024)
        },
    )
    .await;
    sigkill(&mut second);
}

#[tokio::test]
async fn a_standby_takes_over_when_the_reader_is_killed() {
    let world = World::new().await;
    let mut first = world.relay("first");
    write(&world.store, 2, 20).await;
    world.until_the_slot_is_read_and_everything_sent().await;
    let mut standby = world.relay("standby");
    world.until_it_stands_by("standby").await;
    sigkill(&mut first);
    let _ = first.wait().await;
    write(&world.store, 2, 20).await;
    wait_until(Duration::from_secs(30), "the standby streams", || async {
        world
            .log("standby")
            .contains("streaming the outbox from the WAL")
    })
    .await;
    world
        .everything_delivered_once_in_order(&["first", "standby"])
        .await;
    sigkill(&mut standby);
}

#[tokio::test]
async fn a_slot_dropped_under_the_relay_is_recovered_from_the_outbox() {
    let world = World::new().await;
    let mut relay = world.relay("relay");
    write(&world.store, 2, 50).await;
    wait_until(
        Duration::from_secs(60),
        "the first events relayed",
        || async {
            world.unsent().await == 0 && world.slot().await.is_some_and(|(active, _)| active)
        },
    )
    .await;
    // Writes go on while the slot is taken away: its reader's session ended and the slot dropped
    // (its position, and what it would have streamed, gone).
    let writing = {
        let store = world.store.clone();
        tokio::spawn(async move { write(&store, 4, 200).await })
    };
    let mut dropped = false;
    for _ in 0..100 {
        let _ = sqlx::query(
            "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots
             WHERE slot_name = 'waybill_outbox' AND active",
        )
        .execute(&world.pool)
        .await;
        if sqlx::query(
            "SELECT pg_drop_replication_slot('waybill_outbox')
             FROM pg_replication_slots WHERE slot_name = 'waybill_outbox' AND NOT active",
        )
        .execute(&world.pool)
        .await
        .is_ok_and(|done| done.rows_affected() == 1)
        {
            dropped = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(dropped, "the slot was dropped\n{}", world.log("relay"));
    writing.await.expect("writers");
    world.everything_delivered_once_in_order(&["relay"]).await;
    sigkill(&mut relay);
}

#[tokio::test]
async fn an_aggregate_the_stream_disagrees_with_goes_to_polling_and_the_others_flow_on() {
    let world = World::new().await;
    let mut relay = world.relay("relay");
    let order = testkit::place_order(&world.store, "alice", &["MUG:1:100"]).await;
    let other = testkit::place_order(&world.store, "bob", &["TEA:1:100"]).await;
    wait_until(
        Duration::from_secs(60),
        "both orders placed in the stream",
        || async { world.stream_messages().await == 2 && world.unsent().await == 0 },
    )
    .await;
    // Garbage lands on the first order's subject: its next version can never be fenced on its
    // predecessor.
    let client = async_nats::connect(&world.nats_url).await.expect("NATS");
    async_nats::jetstream::new(client)
        .publish(format!("{PREFIX}.order.{order}"), "garbage".into())
        .await
        .expect("publish")
        .await
        .expect("ack");
    testkit::pay_order(&world.store, order).await;
    testkit::pay_order(&world.store, other).await;
    write(&world.store, 2, 10).await;
    // Everything else arrives, promptly: the diverged order holds nobody up.
    wait_until(
        Duration::from_secs(15),
        "the other orders' events in the stream",
        || async { world.stream_messages().await == 2 + 1 + 1 + 30 },
    )
    .await;
    // Polling took the diverged order over: its row says why, as a polling relay's would.
    wait_until(
        Duration::from_secs(30),
        "the divergence recorded on the row",
        || async {
            let status = relay::admin::status(&world.pool, false)
                .await
                .expect("status");
            status.diverged == 1
                && status.divergences[0].aggregate_id == order.as_uuid()
                && status.divergences[0].aggregate_version == 2
        },
    )
    .await;
    assert_eq!(world.unsent().await, 1, "only the diverged row is unsent");
    assert_eq!(
        world.stream_messages().await,
        34,
        "and it is not in the stream"
    );
    sigkill(&mut relay);
}

#[tokio::test]
async fn a_row_read_from_the_wal_before_its_commit_is_visible_is_still_marked_sent() {
    let world = World::new().await;
    let mut relay = world.relay("relay");
    wait_until(Duration::from_secs(60), "the relay streams", || async {
        world
            .log("relay")
            .contains("streaming the outbox from the WAL")
    })
    .await;
    // A synchronous standby that never answers: a commit's WAL is flushed — and decoded, and so
    // relayed — but the transaction stays invisible to other sessions until the setting goes.
    // (The private server commits asynchronously: this writer asks for the wait.)
    let pool = &world.pool;
    let set = |statement: &'static str| async move {
        sqlx::query(statement)
            .execute(pool)
            .await
            .expect("ALTER SYSTEM");
        sqlx::query("SELECT pg_reload_conf()")
            .execute(pool)
            .await
            .expect("reload");
    };
    set("ALTER SYSTEM SET synchronous_standby_names = 'nobody'").await;
    let options: sqlx::postgres::PgConnectOptions = world.url.parse().expect("URL");
    let waiting = EventStore::new(
        PgPoolOptions::new()
            .max_connections(2)
            .connect_with(options.options([("synchronous_commit", "on")]))
            .await
            .expect("connects"),
    );
    let placing = tokio::spawn(async move {
        testkit::place_order(&waiting, "alice", &["MUG:1:100"]).await;
    });
    wait_until(
        Duration::from_secs(30),
        "the event in the stream while its commit is invisible",
        || async { world.stream_messages().await == 1 },
    )
    .await;
    assert_eq!(world.events().await, 0, "the commit is not visible yet");
    set("ALTER SYSTEM RESET synchronous_standby_names").await;
    placing.await.expect("the order placed");
    // Marked sent by the relay, not left pending with its position confirmed.
    world.everything_delivered_once_in_order(&["relay"]).await;
    sigkill(&mut relay);
}

/// Sets the stream's limit per subject: with `Some(n)` each subject holds at most `n` messages and
/// the stream refuses more on it (discard new), with `None` it takes everything again.
async fn limit_subjects(nats_url: &str, limit: Option<i64>) {
    use async_nats::jetstream::stream::DiscardPolicy;
    let jetstream = async_nats::jetstream::new(async_nats::connect(nats_url).await.expect("NATS"));
    let mut config = jetstream
        .get_stream(STREAM)
        .await
        .expect("the stream")
        .info()
        .await
        .expect("its info")
        .config
        .clone();
    config.max_messages_per_subject = limit.unwrap_or(-1);
    config.discard_new_per_subject = limit.is_some();
    config.discard = if limit.is_some() {
        DiscardPolicy::New
    } else {
        DiscardPolicy::Old
    };
    jetstream
        .update_stream(config)
        .await
        .expect("stream updated");
}

#[tokio::test]
async fn an_aggregate_handed_to_polling_is_retried_on_schedule_while_the_outbox_is_idle() {
    let _alone = HEAVY_OR_TIMED.lock().await;
    let world = World::new().await;
    // The server's default: on an idle stream a server asks for a reply (a keepalive, which the relay
    // sees) only when half of this has passed without one. The private server's 10 s (a command-line
    // setting, which a database's own setting overrides for the sessions that connect to it) would
    // hide a relay that waits for replication messages to come back to polling.
    sqlx::query("ALTER DATABASE shop SET wal_sender_timeout = '60s'")
        .execute(&world.pool)
        .await
        .expect("ALTER DATABASE");
    let fresh = PgPoolOptions::new()
        .max_connections(1)
        .connect(&world.url)
        .await
        .expect("connects");
    let timeout: String = sqlx::query_scalar("SHOW wal_sender_timeout")
        .fetch_one(&fresh)
        .await
        .expect("SHOW");
    assert_eq!(timeout, "1min", "the relay's sessions get the default");
    fresh.close().await;
    let mut relay = world.relay("relay");
    let order = testkit::place_order(&world.store, "alice", &["MUG:1:100"]).await;
    wait_until(
        Duration::from_secs(60),
        "the order in the stream",
        || async { world.stream_messages().await == 1 && world.unsent().await == 0 },
    )
    .await;
    // The broker refuses the order's next event: after its in-stream tries, polling takes the order.
    limit_subjects(&world.nats_url, Some(1)).await;
    testkit::pay_order(&world.store, order).await;
    wait_until(
        Duration::from_secs(30),
        "the order handed to polling",
        || async {
            world
                .log("relay")
                .contains("polling delivers this aggregate for now")
        },
    )
    .await;
    // Nothing more is written: the replication stream is idle, and polling's passes still come, one
    // every five seconds (each refused pass counts an attempt on the row). A server sends nothing on
    // an idle stream for longer than that.
    let attempts = || async {
        sqlx::query_scalar::<_, i32>("SELECT attempts FROM outbox WHERE aggregate_version = 2")
            .fetch_one(&world.pool)
            .await
            .expect("the row")
    };
    wait_until(Duration::from_secs(15), "a first polling pass", || async {
        attempts().await >= 1
    })
    .await;
    let first = attempts().await;
    // Within 20 s: a server with the default timeout asks for a keepalive only after 30 s, and a
    // busy test machine may stretch a pass or two.
    wait_until(
        Duration::from_secs(20),
        "two more polling passes on an idle outbox",
        || async { attempts().await >= first + 2 },
    )
    .await;
    // The stream goes on for every other aggregate meanwhile: a pass does not wait for the failing
    // row to come due again.
    testkit::place_order(&world.store, "bob", &["TEA:1:100"]).await;
    wait_until(
        Duration::from_secs(4),
        "another order in the stream",
        || async { world.stream_messages().await == 2 },
    )
    .await;
    limit_subjects(&world.nats_url, None).await;
    world.everything_delivered_once_in_order(&["relay"]).await;
    sigkill(&mut relay);
}

#[tokio::test]
async fn a_polling_relay_stands_by_while_a_wal_relay_reads_the_slot_and_takes_over_when_it_dies() {
    let world = World::new().await;
    let (mut wal, mut polling) = world.wal_relay_and_a_polling_standby(20).await;
    // Every row committed now wakes the polling relay too (its notification listener): it must
    // leave them to the WAL relay.
    write(&world.store, 2, 20).await;
    wait_until(
        Duration::from_secs(60),
        "the next orders delivered",
        || async { world.unsent().await == 0 },
    )
    .await;
    assert_eq!(
        world.sent_by("polling").await,
        0,
        "the polling relay claimed while the WAL relay read the slot\n{}",
        world.log("polling")
    );
    assert_eq!(world.sent_by("wal").await, 120, "{}", world.log("wal"));

    sigkill(&mut wal);
    let _ = wal.wait().await;
    assert_eq!(
        world.deliver_more_orders_and_count_polling_marks(20).await,
        60,
        "the polling relay delivered what was written after the WAL relay died\n{}",
        world.log("polling")
    );
    assert!(
        world
            .log("polling")
            .contains("nobody reads the WAL relay's slot"),
        "{}",
        world.log("polling")
    );
    sigkill(&mut polling);
}

#[tokio::test]
async fn a_polling_standby_waits_out_a_frozen_wal_relay_and_nothing_is_doubled() {
    let world = World::new().await;
    let (mut wal, mut polling) = world.wal_relay_and_a_polling_standby(10).await;

    // Frozen, not dead: the slot stays read until PostgreSQL's wal_sender_timeout (10 s on the
    // private server) ends the session; then the standby delivers.
    signal(&wal, Signal::STOP);
    write(&world.store, 2, 10).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        world.sent_by("polling").await,
        0,
        "the standby claimed while the frozen WAL relay still held the slot\n{}",
        world.log("polling")
    );
    wait_until(
        Duration::from_secs(60),
        "the polling relay delivers what the frozen WAL relay cannot",
        || async {
            world
                .log("polling")
                .contains("nobody reads the WAL relay's slot")
                && world.unsent().await == 0
        },
    )
    .await;
    assert_eq!(
        world.sent_by("polling").await,
        30,
        "{}",
        world.log("polling")
    );

    // Woken, the WAL relay reads the slot again from what it confirmed (replaying rows polling has
    // sent: deduplicated), and the polling relay stands by again.
    signal(&wal, Signal::CONT);
    wait_until(
        Duration::from_secs(60),
        "the polling relay stands by again",
        || async { world.log("polling").matches("standing by").count() >= 2 },
    )
    .await;
    assert_eq!(
        world.deliver_more_orders_and_count_polling_marks(10).await,
        30,
        "the polling relay marked rows after the WAL relay came back\n{}",
        world.log("polling")
    );
    sigkill(&mut wal);
    sigkill(&mut polling);
}

#[tokio::test]
async fn a_polling_standby_claims_beside_a_wal_relay_cut_off_from_nats() {
    let world = World::new().await;
    write(&world.store, 2, 10).await;
    let nats_port: u16 = world
        .nats_url
        .rsplit(':')
        .next()
        .and_then(|port| port.parse().ok())
        .expect("the NATS port");
    let proxy = testkit::CutProxy::start(([127, 0, 0, 1], nats_port).into())
        .await
        .expect("a proxy to NATS");
    let mut wal = world.spawn_relay_via(
        "wal",
        "wal",
        &format!("nats://127.0.0.1:{}", proxy.port()),
        &[],
    );
    world.until_the_slot_is_read_and_everything_sent().await;
    let mut polling = world.spawn_relay("polling", "poll");
    world.until_it_stands_by("polling").await;
    // The WAL relay loses NATS for good. Its batch waits for NATS a while, then it closes its
    // session (an open one would hold up PostgreSQL's shutdown) and opens none until NATS is back;
    // the polling relay delivers meanwhile, whichever it saw first: rows waiting, or the slot free.
    drop(proxy);
    write(&world.store, 2, 10).await;
    wait_until(
        Duration::from_secs(60),
        "the polling relay delivers beside the WAL relay that cannot",
        || async { world.unsent().await == 0 },
    )
    .await;
    wait_until(
        Duration::from_secs(40),
        "the WAL relay without NATS leaves the slot",
        || async { world.slot().await.is_some_and(|(active, _)| !active) },
    )
    .await;
    assert!(
        world
            .log("wal")
            .contains("the replication session is closed"),
        "{}",
        world.log("wal")
    );
    assert_eq!(
        world.sent_by("polling").await,
        30,
        "{}",
        world.log("polling")
    );
    world
        .everything_delivered_once_in_order(&["wal", "polling"])
        .await;
    sigkill(&mut wal);
    sigkill(&mut polling);
}

#[tokio::test]
async fn a_wal_relay_delivers_a_row_made_due_again_by_an_update() {
    let world = World::new().await;
    // Written before the slot exists: delivered by the opening drain, never replayed from the slot.
    write(&world.store, 2, 10).await;
    let mut wal = world.relay("wal");
    world.until_the_slot_is_read_and_everything_sent().await;
    world.make_the_last_row_due_again().await;
    wait_until(
        Duration::from_secs(40),
        "the WAL relay's polling pass delivers the row",
        || async { world.unsent().await == 0 },
    )
    .await;
    assert!(
        world.log("wal").contains("a polling pass delivers it"),
        "{}",
        world.log("wal")
    );
    world.everything_delivered_once_in_order(&["wal"]).await;
    sigkill(&mut wal);
}

#[tokio::test]
async fn rows_waiting_behind_a_dead_row_are_not_taken_for_undelivered_ones() {
    let world = World::new().await;
    let (mut wal, mut polling) = world.wal_relay_and_a_polling_standby(10).await;
    // One order's first event dead (poison) and its later ones pending behind it, due long ago:
    // nothing can deliver them until an operator acts, so neither relay should keep trying.
    sqlx::query(
        "WITH poisoned AS (SELECT aggregate_id FROM outbox ORDER BY id LIMIT 1)
         UPDATE outbox o
         SET status = CASE WHEN o.aggregate_version = 1 THEN 'dead' ELSE 'pending' END,
             sent_at = NULL, dead_at = CASE WHEN o.aggregate_version = 1 THEN now() END,
             next_run_at = now() - interval '1 minute'
         FROM poisoned p WHERE o.aggregate_id = p.aggregate_id",
    )
    .execute(&world.pool)
    .await
    .expect("a dead row with rows behind it");
    tokio::time::sleep(Duration::from_secs(13)).await;
    assert!(
        !world.log("polling").contains("claiming beside it"),
        "{}",
        world.log("polling")
    );
    assert!(
        !world.log("wal").contains("a polling pass delivers it"),
        "{}",
        world.log("wal")
    );
    assert_eq!(
        world.unsent().await,
        3,
        "the dead row and the two behind it"
    );
    sigkill(&mut wal);
    sigkill(&mut polling);
}

#[tokio::test]
async fn a_later_version_waits_in_the_outbox_behind_an_unsent_earlier_one_and_follows_it() {
    let world = World::new().await;
    // An order placed and paid before the slot exists, its payment dead (poison parked by polling):
    // the opening drain delivers the placement only.
    let order = testkit::place_order(&world.store, "c", &["MUG:1:100"]).await;
    testkit::pay_order(&world.store, order).await;
    sqlx::query(
        "UPDATE outbox SET status = 'dead', dead_at = now()
         WHERE aggregate_id = $1 AND aggregate_version = 2",
    )
    .bind(order.as_uuid())
    .execute(&world.pool)
    .await
    .expect("the payment dead");
    let metrics_port = testkit::free_ports(1).expect("a port")[0];
    let metrics_listen = format!("127.0.0.1:{metrics_port}");
    let mut wal = world.spawn_relay_via(
        "wal",
        "wal",
        &world.nats_url,
        &["--metrics-listen", &metrics_listen],
    );
    wait_until(
        Duration::from_secs(60),
        "the WAL relay reads the slot and delivered the placement",
        || async {
            world.slot().await.is_some_and(|(active, _)| active)
                && world.stream_messages().await == 1
        },
    )
    .await;
    // The shipment is read from the slot; publishing it would put version 3 on the stream before
    // version 2, which could then never be delivered.
    testkit::ship_order(&world.store, order).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        world.stream_messages().await,
        1,
        "the shipment was published before the payment\n{}",
        world.log("wal")
    );
    assert!(
        world
            .log("wal")
            .contains("an earlier version of this aggregate is unsent"),
        "{}",
        world.log("wal")
    );
    assert_eq!(world.unsent().await, 2, "the dead payment and the shipment");
    let metrics = get_metrics(metrics_port).await;
    assert!(
        metrics.contains("waybill_relay_wal_handovers_total{reason=\"unsent_predecessor\"} 1"),
        "{metrics}"
    );
    // Left to polling, the order is given back to the stream at the next pass: nothing of it can
    // move until the dead row is replayed, and passes every 5 s meanwhile would be wasted.
    wait_until(
        Duration::from_secs(20),
        "the order is given back while it waits behind the dead row",
        || async {
            world
                .log("wal")
                .contains("the rest waits behind a dead row")
        },
    )
    .await;
    // An operator replays the payment (`dead replay`): the WAL relay's polling pass delivers it,
    // then the shipment, in order.
    let replayed =
        store::outbox::admin::replay_dead(&world.pool, &store::outbox::admin::ReplayTarget::All)
            .await
            .expect("the payment replayed");
    assert_eq!(replayed, 1);
    world.everything_delivered_once_in_order(&["wal"]).await;
    sigkill(&mut wal);
}

#[tokio::test]
async fn a_slot_invalidated_by_max_slot_wal_keep_size_is_made_again_and_nothing_is_lost_or_doubled()
{
    let world = World::new().await;
    write(&world.store, 2, 10).await;
    let mut relay = world.relay("relay");
    world.until_the_slot_is_read_and_everything_sent().await;
    // The reader freezes; orders keep coming, and then enough other WAL that PostgreSQL gives the
    // slot up at a checkpoint (it ends the reader's session to do so): what the slot held is gone.
    signal(&relay, Signal::STOP);
    write(&world.store, 2, 20).await;
    for statement in [
        "ALTER SYSTEM SET max_slot_wal_keep_size = '32MB'",
        "SELECT pg_reload_conf()",
        "CREATE TABLE filler AS SELECT g, repeat('x', 1000) AS pad FROM generate_series(1, 120000) AS g",
        "CHECKPOINT",
    ] {
        sqlx::query(statement)
            .execute(&world.pool)
            .await
            .expect(statement);
    }
    wait_until(
        Duration::from_secs(30),
        "PostgreSQL invalidates the slot",
        || async {
            let _ = sqlx::query("CHECKPOINT").execute(&world.pool).await;
            sqlx::query_scalar::<_, Option<String>>(
                "SELECT wal_status FROM pg_replication_slots WHERE slot_name = 'waybill_outbox'",
            )
            .fetch_optional(&world.pool)
            .await
            .expect("slot")
            .flatten()
            .as_deref()
                == Some("lost")
        },
    )
    .await;
    // More orders while the slot is lost and nobody reads.
    write(&world.store, 2, 10).await;
    signal(&relay, Signal::CONT);
    world.everything_delivered_once_in_order(&["relay"]).await;
    assert!(
        world.log("relay").contains("the slot cannot be read"),
        "{}",
        world.log("relay")
    );
    // A new slot is in place and read: what commits next is streamed.
    write(&world.store, 2, 5).await;
    world.until_the_slot_is_read_and_everything_sent().await;
    world.everything_delivered_once_in_order(&["relay"]).await;
    sigkill(&mut relay);
}

#[tokio::test]
async fn a_version_after_one_rewound_by_outbox_repair_waits_for_it() {
    let world = World::new().await;
    // A short dedupe window, so that the rewound version can be published again soon.
    let mut wal =
        world.spawn_relay_via("wal", "wal", &world.nats_url, &["--duplicate-window", "2s"]);
    world.until_the_slot_is_read_and_everything_sent().await;
    // The session publishes versions 1 and 2 itself: it knows version 2's stream sequence.
    let order = testkit::place_order(&world.store, "c", &["MUG:1:100"]).await;
    testkit::pay_order(&world.store, order).await;
    wait_until(
        Duration::from_secs(30),
        "placed and paid delivered",
        || async { world.stream_messages().await == 2 && world.unsent().await == 0 },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    // The stream loses version 2, and an operator repairs the order as `outbox repair --apply`
    // does: version 1 agrees, version 2 is set pending again.
    let paid_at: i64 = sqlx::query_scalar(
        "SELECT stream_seq FROM outbox WHERE aggregate_id = $1 AND aggregate_version = 2",
    )
    .bind(order.as_uuid())
    .fetch_one(&world.pool)
    .await
    .expect("the payment's stream sequence");
    let client = async_nats::connect(&world.nats_url).await.expect("NATS");
    let stream = async_nats::jetstream::new(client)
        .get_stream(STREAM)
        .await
        .expect("the stream");
    stream
        .delete_message(u64::try_from(paid_at).expect("a sequence"))
        .await
        .expect("version 2 deleted");
    let plan = relay::repair::plan(&world.pool, &stream, PREFIX, order.as_uuid())
        .await
        .expect("a plan");
    assert_eq!(
        (plan.agreeing_versions, plan.republish.clone()),
        (1, vec![2])
    );
    relay::repair::apply(&world.pool, &stream, plan)
        .await
        .expect("repaired");
    // A new version at once, well before the pass that delivers the rewound one: the session's fence
    // (version 2) is refused, and the shipment must not follow version 1.
    testkit::ship_order(&world.store, order).await;
    world.everything_delivered_once_in_order(&["wal"]).await;
    // Held back by the refused fence, or, had a session started in between, by the look at the
    // outbox before publishing.
    let log = world.log("wal");
    assert!(
        log.contains("no longer holds the version this session published")
            || log.contains("an earlier version of this aggregate is unsent"),
        "{log}"
    );
    sigkill(&mut wal);
}

/// Operators' updates racing the stream, for half a minute: while ten writers place, pay and ship
/// orders, a task keeps setting the newest sent row of a random unfinished order back to pending (as
/// `outbox repair` does) or dead (as polling parks poison), and now and then replays every dead row,
/// while the WAL relay is SIGKILLed and restarted every 2.5 s (every session starts knowing no
/// aggregate, so each one's first version read is checked against the outbox). Every event ends up in
/// the stream once and in order. The rows touched here are in the stream already, so their copies
/// are deduplicated or fenced; versions that never reached it are the tests above.
#[tokio::test]
async fn rows_made_due_dead_and_replayed_while_writers_append_and_the_relay_restarts_stay_in_order()
{
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    let world = World::new().await;
    let mut wal = world.relay("wal");
    world.until_the_slot_is_read_and_everything_sent().await;
    let writers = {
        let store = world.store.clone();
        tokio::spawn(async move {
            let mut tasks = tokio::task::JoinSet::new();
            for writer in 0..10 {
                let store = store.clone();
                tasks.spawn(async move {
                    for _ in 0..40 {
                        let id =
                            testkit::place_order(&store, &format!("w{writer}"), &["MUG:1:100"])
                                .await;
                        tokio::time::sleep(Duration::from_millis(300)).await;
                        testkit::pay_order(&store, id).await;
                        tokio::time::sleep(Duration::from_millis(300)).await;
                        testkit::ship_order(&store, id).await;
                    }
                });
            }
            while let Some(done) = tasks.join_next().await {
                done.expect("a writer");
            }
        })
    };
    let stop = Arc::new(AtomicBool::new(false));
    let operators = {
        let pool = world.pool.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            const NEWEST_SENT_OF_AN_UNFINISHED_ORDER: &str = "(SELECT id FROM outbox o
                 WHERE status = 'sent' AND aggregate_version < 3 AND NOT EXISTS (
                     SELECT 1 FROM outbox n
                     WHERE n.aggregate_id = o.aggregate_id AND n.aggregate_version > o.aggregate_version)
                 ORDER BY random() LIMIT 1)";
            let mut round = 0u32;
            while !stop.load(Ordering::Relaxed) {
                round += 1;
                let statement = match round % 30 {
                    29 => "UPDATE outbox SET status = 'pending', attempts = 0, next_run_at = now(),
                                dead_at = NULL, dead_reason = NULL WHERE status = 'dead'"
                        .to_owned(),
                    r if r % 2 == 0 => format!(
                        "UPDATE outbox SET status = 'pending', sent_at = NULL, next_run_at = now()
                         WHERE id = {NEWEST_SENT_OF_AN_UNFINISHED_ORDER}"
                    ),
                    _ => format!(
                        "UPDATE outbox SET status = 'dead', dead_at = now(), sent_at = NULL
                         WHERE id = {NEWEST_SENT_OF_AN_UNFINISHED_ORDER}"
                    ),
                };
                let _ = sqlx::query(sqlx::AssertSqlSafe(statement))
                    .execute(&pool)
                    .await;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            store::outbox::admin::replay_dead(&pool, &store::outbox::admin::ReplayTarget::All)
                .await
                .expect("every dead row replayed");
        })
    };
    while !writers.is_finished() {
        tokio::time::sleep(Duration::from_millis(2_500)).await;
        sigkill(&mut wal);
        let _ = wal.wait().await;
        wal = world.relay("wal");
    }
    writers.await.expect("writers");
    stop.store(true, Ordering::Relaxed);
    operators.await.expect("operators");
    world.everything_delivered_once_in_order(&["wal"]).await;
    sigkill(&mut wal);
}

/// After a WAL relay was down, its slot replays everything written meanwhile, which the next
/// session's opening drain has just delivered by polling: those rows are found sent and not published
/// a second time (each would be a duplicate within the dedupe window, or a fence refusal and a read
/// of the subject after it, with new events waiting behind).
#[tokio::test]
async fn rows_the_opening_drain_delivered_are_not_published_again_from_the_slot() {
    let world = World::new().await;
    let mut wal = world.relay("before");
    write(&world.store, 2, 10).await;
    world.until_the_slot_is_read_and_everything_sent().await;
    // The position is confirmed once a second: past this, the next session replays only what is
    // written below.
    tokio::time::sleep(Duration::from_secs(2)).await;
    sigkill(&mut wal);
    let _ = wal.wait().await;
    write(&world.store, 2, 100).await;
    let mut wal = world.relay("after");
    world.everything_delivered_once_in_order(&["after"]).await;
    // One more order: its commit comes after the replay, which ends it (and is logged as it is read).
    write(&world.store, 1, 1).await;
    world.everything_delivered_once_in_order(&["after"]).await;
    signal(&wal, Signal::TERM);
    let _ = tokio::time::timeout(Duration::from_secs(20), wal.wait()).await;
    let log = world.log("after");
    let summary = log
        .lines()
        .find(|line| line.contains("relay stopped"))
        .unwrap_or_else(|| panic!("no summary:\n{log}"));
    // Published again, each would have come back a duplicate, or refused by the fence and found
    // in the stream (`fenced`).
    assert!(
        summary.contains("duplicates: 0") && summary.contains("fenced: 0"),
        "the replayed rows were published again: {summary}\n{log}"
    );
    let skipped: u64 = log
        .lines()
        .find(|line| line.contains("the slot's replay of rows delivered"))
        .and_then(|line| line.split("rows=").nth(1))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no count of skipped rows:\n{log}"));
    assert!(skipped >= 300, "{skipped} skipped\n{log}");
}

#[tokio::test]
async fn the_replication_session_is_encrypted_and_checked_as_the_url_says() {
    let postgres = PostgresServer::start_with_tls().expect("private PostgreSQL with TLS");
    let ca = postgres.ca().expect("its CA").to_owned();
    let plain_url = postgres.url("shop");
    let mut world = World::on(postgres).await;
    // Every session of the relay, the replication one included, checks the server's certificate
    // and name against the CA that signed it.
    world.url = format!(
        "{plain_url}?sslmode=verify-full&sslrootcert={}",
        ca.display()
    );
    write(&world.store, 2, 30).await;
    let mut relay = world.relay("tls");
    world.until_the_slot_is_read_and_everything_sent().await;
    // Written while it streams: these come from the slot, over the TLS session.
    write(&world.store, 2, 30).await;
    world.everything_delivered_once_in_order(&["tls"]).await;
    let encrypted: Vec<(String, bool)> = sqlx::query_as(
        "SELECT r.application_name, s.ssl FROM pg_stat_replication r JOIN pg_stat_ssl s USING (pid)",
    )
    .fetch_all(&world.pool)
    .await
    .expect("the replication sessions");
    assert_eq!(encrypted.len(), 1, "{encrypted:?}");
    assert!(
        encrypted[0].1,
        "the replication session is not encrypted: {encrypted:?}"
    );
    sigkill(&mut relay);

    // The check is the relay's own, before the replication client sends a byte: a CA that did not
    // sign the server's certificate is refused, and a server without TLS too.
    let stranger = tempfile::tempdir().expect("a directory");
    let stranger_ca = testkit::secure_nats::self_signed_ca(stranger.path(), "stranger");
    let port = url::Url::parse(&plain_url)
        .expect("URL")
        .port()
        .expect("port");
    let target = |port, verify, roots| relay::wal::tls::TlsTarget {
        host: "127.0.0.1".to_owned(),
        port,
        verify,
        roots,
        identity: None,
    };
    let refused = target(
        port,
        relay::wal::tls::Verify::Authority,
        Some(relay::wal::tls::Pem::File(stranger_ca)),
    )
    .open_bridge()
    .await
    .expect_err("a stranger's CA is refused");
    assert!(
        format!("{refused:#}").contains("certificate"),
        "{refused:#}"
    );
    let plain = PostgresServer::start().expect("private PostgreSQL without TLS");
    let refused = target(plain.port(), relay::wal::tls::Verify::Nothing, None)
        .open_bridge()
        .await
        .expect_err("a server without TLS is refused");
    assert!(
        format!("{refused:#}").contains("does not offer TLS"),
        "{refused:#}"
    );
}

/// Waits until the slot's reader has confirmed (nearly) the end of the WAL: it reads on.
async fn until_the_slot_confirms_the_end_of_the_wal(world: &World) {
    wait_until(
        Duration::from_secs(60),
        "the slot confirmed the end of the WAL",
        || async {
            let lag: Option<i64> = sqlx::query_scalar(
                "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::int8
                 FROM pg_replication_slots WHERE slot_name = 'waybill_outbox' AND active",
            )
            .fetch_optional(&world.pool)
            .await
            .expect("lag")
            .flatten();
            lag.is_some_and(|lag| lag < 64 * 1024)
        },
    )
    .await;
}

#[tokio::test]
async fn a_database_with_another_datestyle_and_another_schemas_outbox_is_read_as_its_own() {
    let world = World::new().await;
    // pgoutput writes values in the session's DateStyle, which the database may set.
    sqlx::query("ALTER DATABASE shop SET datestyle = 'SQL, DMY'")
        .execute(&world.pool)
        .await
        .expect("datestyle");
    // A tenant's outbox in another schema, in the same publication.
    for statement in [
        "CREATE SCHEMA tenant_b",
        "CREATE TABLE tenant_b.outbox (LIKE public.outbox INCLUDING ALL)",
        "ALTER PUBLICATION waybill_outbox ADD TABLE tenant_b.outbox",
    ] {
        sqlx::query(statement)
            .execute(&world.pool)
            .await
            .expect(statement);
    }
    write(&world.store, 2, 10).await;
    let mut wal = world.relay("wal");
    world.until_the_slot_is_read_and_everything_sent().await;
    // Streamed from the slot: this database's orders, and a row of the tenant's outbox with an id
    // of ours and an event of its own.
    write(&world.store, 2, 10).await;
    let mut tenant = world.pool.acquire().await.expect("a connection");
    for statement in [
        "CREATE TEMP TABLE copied AS SELECT * FROM public.outbox ORDER BY id LIMIT 1",
        "UPDATE copied SET event_id = gen_random_uuid(), aggregate_id = gen_random_uuid(),
                           aggregate_version = 1, status = 'pending'",
        "INSERT INTO tenant_b.outbox OVERRIDING SYSTEM VALUE SELECT * FROM copied",
    ] {
        sqlx::query(statement)
            .execute(&mut *tenant)
            .await
            .expect(statement);
    }
    drop(tenant);
    write(&world.store, 2, 10).await;
    world.everything_delivered_once_in_order(&["wal"]).await;
    until_the_slot_confirms_the_end_of_the_wal(&world).await;
    let log = world.log("wal");
    assert!(!log.contains("does not parse"), "{log}");
    assert!(!log.contains("cannot be read"), "{log}");
    assert!(!log.contains("WAL session failed"), "{log}");
    sigkill(&mut wal);
}

#[tokio::test]
async fn a_publication_dropped_and_made_again_is_read_past_with_a_new_slot() {
    let world = World::new().await;
    let mut wal = world.relay("wal");
    world.until_the_slot_is_read_and_everything_sent().await;
    write(&world.store, 2, 5).await;
    sqlx::query("DROP PUBLICATION waybill_outbox")
        .execute(&world.pool)
        .await
        .expect("dropped");
    // Written while there is none: the slot's changes from here on name a publication that did
    // not exist when they were written, in every session.
    write(&world.store, 2, 5).await;
    sqlx::query("CREATE PUBLICATION waybill_outbox FOR TABLE outbox WITH (publish = 'insert')")
        .execute(&world.pool)
        .await
        .expect("made again");
    write(&world.store, 2, 5).await;
    world.everything_delivered_once_in_order(&["wal"]).await;
    // Not only delivered by the drains of failing sessions: a slot is read again, up to the end.
    write(&world.store, 2, 5).await;
    world.everything_delivered_once_in_order(&["wal"]).await;
    until_the_slot_confirms_the_end_of_the_wal(&world).await;
    assert!(
        world
            .log("wal")
            .contains("every session fails at the slot's position"),
        "{}",
        world.log("wal")
    );

    // A row written while the publication leaves out a column the relay reads (traceparent)
    // cannot be read by any session on that slot: the slot is made again after a drain, which
    // delivers the row from the outbox.
    sqlx::query(
        "ALTER PUBLICATION waybill_outbox SET TABLE outbox (id, attempts, created_at, event_id,
             event_type, event_version, aggregate_type, aggregate_id, aggregate_version, body,
             status)",
    )
    .execute(&world.pool)
    .await
    .expect("narrowed");
    write(&world.store, 2, 3).await;
    wait_until(
        Duration::from_secs(60),
        "the relay makes the slot again past the row it cannot read",
        || async {
            world
                .log("wal")
                .contains("cannot be read: no column traceparent")
        },
    )
    .await;
    sqlx::query("ALTER PUBLICATION waybill_outbox SET TABLE outbox")
        .execute(&world.pool)
        .await
        .expect("whole again");
    write(&world.store, 2, 3).await;
    world.everything_delivered_once_in_order(&["wal"]).await;
    until_the_slot_confirms_the_end_of_the_wal(&world).await;
    sigkill(&mut wal);
}

#[tokio::test]
async fn a_wal_relay_sweeps_sent_rows_past_the_retention_and_exports_the_outbox_gauges() {
    let world = World::new().await;
    let metrics_port = testkit::free_ports(1).expect("a port")[0];
    let metrics_listen = format!("127.0.0.1:{metrics_port}");
    let mut wal = world.spawn_relay_via(
        "wal",
        "wal",
        &world.nats_url,
        &["--retention", "1s", "--metrics-listen", &metrics_listen],
    );
    world.until_the_slot_is_read_and_everything_sent().await;
    write(&world.store, 2, 10).await;
    world.everything_delivered_once_in_order(&["wal"]).await;
    wait_until(
        Duration::from_secs(60),
        "the sent rows past the retention deleted",
        || async {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM outbox")
                .fetch_one(&world.pool)
                .await
                .expect("count")
                == 0
        },
    )
    .await;
    let metrics = get_metrics(metrics_port).await;
    assert!(metrics.contains("waybill_outbox_pending 0"), "{metrics}");
    assert!(
        metrics.contains("waybill_outbox_purged_total 30"),
        "{metrics}"
    );
    sigkill(&mut wal);
}

/// Writes `aggregates` orders of three events each, interleaved (every order's v1, then every v2,
/// ...), in ONE transaction, each event's payload padded with `pad` bytes: a bulk import, as one
/// commit the server sends whole. Returns the WAL position just before its commit record: no
/// position at or past it may be confirmed before all its rows are delivered.
async fn one_large_transaction(
    pool: &PgPool,
    aggregates: i32,
    pad: i32,
    open_for: Duration,
) -> String {
    one_large_transaction_padded(pool, aggregates, pad, pad, open_for).await
}

/// [`one_large_transaction`] with the first order's first event padded with `first_pad` bytes.
async fn one_large_transaction_padded(
    pool: &PgPool,
    aggregates: i32,
    pad: i32,
    first_pad: i32,
    open_for: Duration,
) -> String {
    let mut tx = pool.begin().await.expect("a transaction");
    sqlx::query(
        "WITH rows AS (
            SELECT gen_random_uuid() AS event_id, aggregate_id, v AS aggregate_version,
                   (ARRAY['order.placed', 'order.paid', 'order.shipped'])[v] AS event_type,
                   jsonb_build_object('pad', repeat('x', CASE WHEN n = 1 AND v = 1 THEN $3 ELSE $2 END))
                       AS payload
            FROM generate_series(1, 3) v,
                 (SELECT gen_random_uuid() AS aggregate_id, n FROM generate_series(1, $1) n) a
            ORDER BY v, aggregate_id
        ),
        ev AS (
            INSERT INTO events (event_id, event_type, event_version, aggregate_type, aggregate_id,
                                aggregate_version, occurred_at, payload)
            SELECT event_id, event_type, 1, 'order', aggregate_id, aggregate_version, now(), payload
            FROM rows
            RETURNING *
        )
        INSERT INTO outbox (event_id, event_type, event_version, aggregate_id, aggregate_version, body)
        SELECT event_id, event_type, event_version, aggregate_id, aggregate_version,
               jsonb_build_object('event_id', event_id, 'event_type', event_type,
                   'event_version', event_version, 'aggregate_type', 'order',
                   'aggregate_id', aggregate_id, 'aggregate_version', aggregate_version,
                   'occurred_at', occurred_at, 'correlation_id', null, 'causation_id', null,
                   'payload', payload)::text
        FROM ev ORDER BY position",
    )
    .bind(aggregates)
    .bind(pad)
    .bind(first_pad)
    .execute(&mut *tx)
    .await
    .expect("one large transaction");
    // Its rows' `next_run_at` is the transaction's start.
    tokio::time::sleep(open_for).await;
    let before_commit: String = sqlx::query_scalar("SELECT pg_current_wal_insert_lsn()::text")
        .fetch_one(&mut *tx)
        .await
        .expect("position");
    tx.commit().await.expect("committed");
    before_commit
}

/// The peak resident memory of a running process, in KiB.
fn peak_rss_kib(child: &Child) -> u64 {
    let pid = child.id().expect("running");
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("its status");
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .and_then(|kib| kib.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM")
}

#[tokio::test]
async fn a_large_transaction_is_published_in_parts_with_memory_bounded_and_survives_a_sigkill() {
    let _alone = HEAVY_OR_TIMED.lock().await;
    const AGGREGATES: i32 = 4_000;
    const PAD: i32 = 12_000;
    let world = World::new().await;
    let mut first = world.relay("first");
    world.until_the_slot_is_read_and_everything_sent().await;
    let idle = peak_rss_kib(&first);
    // 12,000 rows of about 12 KB: 144 MB of outbox bodies in one commit.
    one_large_transaction(&world.pool, AGGREGATES, PAD, Duration::ZERO).await;
    let rows = 3 * u64::try_from(AGGREGATES).expect("positive");
    wait_until(
        Duration::from_secs(180),
        "the whole transaction relayed and marked",
        || async { world.stream_messages().await >= rows && world.unsent().await == 0 },
    )
    .await;
    // Held whole, the transaction's bodies alone would be 144 MB; in parts of at most 4 MiB of
    // bodies the relay holds the parts in hand and what the replication client reads ahead.
    let grown = peak_rss_kib(&first).saturating_sub(idle);
    assert!(
        grown < 96 * 1024,
        "the relay's resident memory peaked {grown} KiB above its idle peak for a 144 MB transaction\n{}",
        world.log("first")
    );
    // A second one, and the relay killed while it is half published: the next relay's drain and
    // its replay of the slot deliver the rest, once each and in order.
    let before_commit = one_large_transaction(&world.pool, AGGREGATES, PAD, Duration::ZERO).await;
    wait_until(
        Duration::from_secs(180),
        "part of the second transaction relayed",
        || async { world.stream_messages().await >= rows + rows / 3 },
    )
    .await;
    // Half published, and parts of it marked: the slot's position has not reached its commit.
    let held: bool = sqlx::query_scalar(
        "SELECT confirmed_flush_lsn <= $1::pg_lsn FROM pg_replication_slots
         WHERE slot_name = 'waybill_outbox'",
    )
    .bind(&before_commit)
    .fetch_one(&world.pool)
    .await
    .expect("the slot");
    // (Read after the slot: rows still unsent then were unsent when the slot was read.)
    let unsent = world.unsent().await;
    assert!(
        held || unsent == 0,
        "the slot confirmed the commit of a transaction with {unsent} rows unsent\n{}",
        world.log("first")
    );
    sigkill(&mut first);
    let _ = first.wait().await;
    let mut second = world.relay("second");
    world
        .everything_delivered_once_in_order(&["first", "second"])
        .await;
    until_the_slot_confirms_the_end_of_the_wal(&world).await;
    sigkill(&mut second);
}

#[tokio::test]
async fn a_bulk_import_open_longer_than_the_overdue_threshold_is_delivered_by_the_stream_alone() {
    let _alone = HEAVY_OR_TIMED.lock().await;
    // 12,000 rows of about 12 KB in a transaction open 11 s: every row looks overdue (due for more
    // than 10 s, unsent) the moment it commits, and stays so until the stream has delivered and
    // marked it — about 10 s for a transaction this size, here. A polling pass in that time claimed
    // and published the same rows beside the stream (against the relay built before the put-off,
    // this test failed so in both of two runs).
    let world = World::new().await;
    let mut relay = world.relay("wal");
    world.until_the_slot_is_read_and_everything_sent().await;
    let started = Instant::now();
    one_large_transaction(&world.pool, 4_000, 12_000, Duration::from_secs(11)).await;
    let committed = started.elapsed();
    world.everything_delivered_once_in_order(&["wal"]).await;
    let log = world.log("wal");
    assert!(
        !log.contains("a polling pass delivers it"),
        "a polling pass ran beside the stream (committed {committed:?} and delivered {:?} after the transaction began)\n{log}",
        started.elapsed()
    );
    sigkill(&mut relay);
}

#[tokio::test]
async fn a_polling_standby_leaves_a_bulk_import_to_the_wal_relay_delivering_it() {
    let _alone = HEAVY_OR_TIMED.lock().await;
    // The import's 60,000 rows look overdue the moment it commits (open 11 s, the threshold is
    // 10 s), and the WAL relay takes longer than the standby's 5 s grace to decode and deliver them
    // (this debug build relayed 45,000 such rows in 12 s here): a standby that takes overdue rows for
    // a stuck reader claims and publishes them beside it. Past the grace, the reader's marks keep
    // the standby standing by.
    let world = World::new().await;
    let (mut wal, mut polling) = world.wal_relay_and_a_polling_standby(5).await;
    let started = Instant::now();
    one_large_transaction(&world.pool, 20_000, 200, Duration::from_secs(11)).await;
    let committed = started.elapsed();
    world
        .everything_delivered_once_in_order(&["wal", "polling"])
        .await;
    let log = world.log("polling");
    let timing = format!(
        "committed {committed:?} and delivered {:?} after the transaction began",
        started.elapsed()
    );
    assert!(
        !log.contains("claiming beside it"),
        "the standby claimed beside the WAL relay delivering the import ({timing})\n{log}"
    );
    assert_eq!(world.sent_by("polling").await, 0, "{log}");
    assert!(
        log.contains("marks rows as it delivers them"),
        "the import was delivered within the grace: the reader's marks were never asked for ({timing})\n{log}"
    );
    sigkill(&mut wal);
    sigkill(&mut polling);
}

#[tokio::test]
async fn a_row_the_broker_refuses_inside_a_large_transaction_goes_dead_through_polling_and_the_rest_flows()
 {
    let _alone = HEAVY_OR_TIMED.lock().await;
    // One body over the server's `max_payload` among 1,500 rows of one commit: the stream tries it,
    // hands its order to polling, and polling parks it dead with the broker's reason; the order's
    // later versions wait behind it, every other row is delivered and marked, and the slot moves
    // past the commit (a refused row must not hold the WAL back).
    let nats = NatsServer::start_with_config("max_payload: 65536\n").expect("nats-server");
    let postgres = PostgresServer::start().expect("private PostgreSQL");
    let mut world = World::on_with(postgres, nats).await;
    // Three attempts, not twelve: polling's passes come every 5 s, one attempt each.
    let mut relay = world.spawn_relay_via("wal", "wal", &world.nats_url, &["--max-attempts", "3"]);
    world.until_the_slot_is_read_and_everything_sent().await;
    one_large_transaction_padded(&world.pool, 500, 200, 100_000, Duration::ZERO).await;
    let big: uuid::Uuid =
        sqlx::query_scalar("SELECT aggregate_id FROM outbox WHERE octet_length(body) > 65536")
            .fetch_one(&world.pool)
            .await
            .expect("the oversized row");
    let by_status = || async {
        sqlx::query_as::<_, (String, i64)>(
            "SELECT status, count(*) FROM outbox GROUP BY status ORDER BY status",
        )
        .fetch_all(&world.pool)
        .await
        .expect("counts")
    };
    let parked = vec![
        ("dead".to_owned(), 1),
        ("pending".to_owned(), 2),
        ("sent".to_owned(), 1_497),
    ];
    wait_until(
        Duration::from_secs(90),
        "the refused row dead, its order's later versions pending, the rest sent",
        || async { by_status().await == parked },
    )
    .await;
    let (version, reason): (i64, String) =
        sqlx::query_as("SELECT aggregate_version, dead_reason FROM outbox WHERE status = 'dead'")
            .fetch_one(&world.pool)
            .await
            .expect("the dead row");
    assert_eq!(version, 1);
    assert!(reason.contains("payload"), "dead for {reason:?}");
    assert_eq!(world.stream_messages().await, 1_497);
    let client = async_nats::connect(&world.nats_url).await.expect("NATS");
    let stored = testkit::stream_events(&async_nats::jetstream::new(client), STREAM).await;
    assert!(
        !testkit::versions_by_aggregate(&stored).contains_key(&big),
        "a later version of the refused order overtook it"
    );
    until_the_slot_confirms_the_end_of_the_wal(&world).await;

    // The limit raised and the dead row replayed: the order follows, once each and in order.
    world.nats.stop();
    world.nats.set_config("max_payload: 1048576\n");
    world.nats.resume().expect("NATS back");
    let replayed =
        store::outbox::admin::replay_dead(&world.pool, &store::outbox::admin::ReplayTarget::All)
            .await
            .expect("replay");
    assert_eq!(replayed, 1);
    world.everything_delivered_once_in_order(&["wal"]).await;
    sigkill(&mut relay);
}

#[tokio::test]
async fn a_role_that_logs_in_with_a_client_certificate_reads_the_slot_presenting_it() {
    // The server lets a TCP session in, a replication one too, only over TLS with a client
    // certificate that names the role (`pg_hba.conf`'s `cert`); the URL names the certificate and
    // its key. Before, the WAL source refused such a URL: its replication session presented none.
    let postgres = PostgresServer::start_requiring_client_certificates()
        .expect("private PostgreSQL requiring client certificates");
    let without = format!(
        "postgres://postgres@127.0.0.1:{}/postgres?sslmode=require",
        postgres.port()
    );
    let world = World::on(postgres).await;
    // The server does ask: TLS without a certificate is turned away.
    let refused = PgPoolOptions::new()
        .max_connections(1)
        .connect(&without)
        .await
        .expect_err("no certificate, no session");
    assert!(refused.to_string().contains("certificate"), "{refused}");
    // The operator's check opens a replication session the same way, under sqlx's default
    // `prefer` too (the pool presents the certificate in the TLS the server offers).
    let prefer = world.url.replace("sslmode=verify-full", "sslmode=prefer");
    for url in [&world.url, &prefer] {
        let check = Command::new(RELAY)
            .args(["wal", "check", "--json", "--database-url", url])
            .env("RUST_LOG", "warn")
            .output()
            .await
            .expect("wal check runs");
        let findings: serde_json::Value =
            serde_json::from_slice(&check.stdout).expect("the check's JSON");
        let replication = findings["findings"]
            .as_array()
            .and_then(|findings| {
                findings
                    .iter()
                    .find(|f| f["check"] == "replication connection")
            })
            .unwrap_or_else(|| panic!("no replication finding: {findings}"));
        assert_eq!(replication["verdict"], "ok", "{url}: {findings}");
    }
    write(&world.store, 2, 30).await;
    let mut relay = world.relay("cert");
    world.until_the_slot_is_read_and_everything_sent().await;
    // Written while it streams: these come from the slot, over the session the certificate opened.
    write(&world.store, 2, 30).await;
    world.everything_delivered_once_in_order(&["cert"]).await;
    let sessions: Vec<(bool, Option<String>)> = sqlx::query_as(
        "SELECT s.ssl, s.client_dn FROM pg_stat_replication r JOIN pg_stat_ssl s USING (pid)",
    )
    .fetch_all(&world.pool)
    .await
    .expect("the replication sessions");
    assert_eq!(
        sessions,
        vec![(true, Some("/CN=postgres".to_owned()))],
        "{}",
        world.log("cert")
    );
    sigkill(&mut relay);
}

#[tokio::test]
async fn verify_full_refuses_a_certificate_for_another_name_that_verify_ca_accepts() {
    // The server's certificate, signed by the CA the relay trusts, names localhost only; the relay
    // reaches it at 127.0.0.1.
    let postgres =
        PostgresServer::start_with_tls_for("DNS:localhost").expect("private PostgreSQL with TLS");
    let ca = postgres.ca().expect("its CA").to_owned();
    let target = |verify| relay::wal::tls::TlsTarget {
        host: "127.0.0.1".to_owned(),
        port: postgres.port(),
        verify,
        roots: Some(relay::wal::tls::Pem::File(ca.clone())),
        identity: None,
    };
    let bridge = target(relay::wal::tls::Verify::Authority)
        .open_bridge()
        .await
        .expect("verify-ca checks the chain only: accepted");
    drop(bridge);
    let refused = target(relay::wal::tls::Verify::AuthorityAndName)
        .open_bridge()
        .await
        .expect_err("verify-full checks the name too: refused");
    assert!(
        format!("{refused:#}").contains("certificate"),
        "{refused:#}"
    );
}
