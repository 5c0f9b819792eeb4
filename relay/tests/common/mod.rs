//! Shared set-up for the relay's integration tests: a private nats-server per test, relays named after
//! their role, fast retry settings, and waiting helpers.
#![allow(dead_code, reason = "each test binary uses a different subset")]

use std::time::Duration;

use async_nats::jetstream;
use relay::{Backoff, Relay, RelayConfig, StreamSettings};
use sqlx::PgPool;
use store::EventStore;
use testkit::{NatsServer, StoredEvent};

// One poller for every test crate; re-exported so the test files keep importing it from here.
pub(crate) use testkit::wait_until;

pub(crate) const STREAM: &str = "TEST_EVENTS";
pub(crate) const PREFIX: &str = "test.events";

pub(crate) struct Harness {
    pub pool: PgPool,
    pub url: String,
    pub nats: NatsServer,
    pub jetstream: jetstream::Context,
    pub store: EventStore,
}

impl Harness {
    pub(crate) async fn new(pool: PgPool) -> Self {
        Self::with_nats(pool, NatsServer::start().expect("nats-server")).await
    }

    pub(crate) async fn with_nats(pool: PgPool, nats: NatsServer) -> Self {
        let url = testkit::database_url(&pool).await;
        let client = async_nats::connect(nats.url())
            .await
            .expect("connect to NATS");
        Self {
            store: EventStore::new(pool.clone()),
            pool,
            url,
            nats,
            jetstream: jetstream::new(client),
        }
    }

    /// Fast settings: short timeouts and retries, so failure paths finish in test time.
    pub(crate) fn config(&self, relay_id: &str) -> RelayConfig {
        RelayConfig {
            relay_id: relay_id.to_owned(),
            stream: StreamSettings {
                name: STREAM.to_owned(),
                subject_prefix: PREFIX.to_owned(),
                duplicate_window: Duration::from_secs(120),
            },
            publish_timeout: Duration::from_secs(1),
            backoff: Backoff::new(vec![Duration::from_millis(50)], 0.2),
            poll_interval: Duration::from_millis(100),
            claim_idle_timeout: Duration::from_secs(20),
            ..RelayConfig::default()
        }
    }

    /// A relay with its own database pool (named after it in pg_stat_activity) and NATS connection.
    pub(crate) async fn relay(&self, config: RelayConfig) -> Relay {
        let relay = Relay::connect(&self.url, &self.nats.url(), config)
            .await
            .expect("relay connects");
        relay.provision(false).await.expect("stream provisioned");
        relay
    }

    pub(crate) async fn stream(&self) -> Vec<StoredEvent> {
        testkit::stream_events(&self.jetstream, STREAM).await
    }

    /// Deletes the message at `sequence` from the stream, as an operator (or a repair) would.
    pub(crate) async fn delete_message(&self, sequence: u64) {
        self.jetstream
            .get_stream(STREAM)
            .await
            .expect("stream")
            .delete_message(sequence)
            .await
            .expect("message deleted");
    }

    /// Waits until the stream holds at least `count` messages.
    pub(crate) async fn wait_for_messages(&self, count: u64) {
        let js = self.jetstream.clone();
        wait_until(
            Duration::from_secs(20),
            &format!("{count} messages in the stream"),
            || {
                let js = js.clone();
                async move {
                    let mut stream = js.get_stream(STREAM).await.expect("stream");
                    stream.info().await.is_ok_and(|i| i.state.messages >= count)
                }
            },
        )
        .await;
    }

    pub(crate) async fn count(&self, sql: &'static str) -> i64 {
        sqlx::query_scalar(sql)
            .fetch_one(&self.pool)
            .await
            .expect(sql)
    }
}

/// A relay's [`Relay::run`] in a task of its own, until [`Running::stop`].
pub(crate) struct Running {
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<relay::RunSummary>,
}

impl Running {
    pub(crate) fn start(relay: &Relay) -> Self {
        let (stop, mut stopped) = tokio::sync::watch::channel(false);
        let relay = relay.clone();
        let task = tokio::spawn(async move {
            relay
                .run(async move {
                    let _ = stopped.wait_for(|s| *s).await;
                })
                .await
        });
        Self { stop, task }
    }

    /// Asks the relay to stop and returns its totals; it must stop within 15 s.
    pub(crate) async fn stop(self) -> relay::RunSummary {
        self.stop.send(true).expect("the relay is running");
        tokio::time::timeout(Duration::from_secs(15), self.task)
            .await
            .expect("the relay stops promptly")
            .expect("the run task")
    }
}

/// Inserts `aggregates` orders with `versions` (1 to 3: placed, paid, shipped) events each, written in
/// interleaved order (every order's v1, then every v2, ...) straight into `events` and `outbox`.
pub(crate) async fn seed(pool: &PgPool, aggregates: i64, versions: i64) {
    sqlx::query(
        "WITH rows AS (
            SELECT gen_random_uuid() AS event_id,
                   ('00000000-0000-7000-8000-' || lpad(to_hex(a), 12, '0'))::uuid AS aggregate_id,
                   v AS aggregate_version,
                   (ARRAY['order.placed', 'order.paid', 'order.shipped'])[v] AS event_type,
                   (ARRAY[
                       '{\"customer_id\": \"c\", \"currency\": \"EUR\", \"lines\": [{\"sku\": \"MUG\", \"quantity\": 1, \"unit_price_cents\": 100}], \"total_cents\": 100}',
                       '{\"amount_cents\": 100, \"payment_ref\": null}',
                       '{\"carrier\": \"DHL\", \"tracking_number\": \"T\"}'])[v]::jsonb AS payload,
                   (ARRAY[2, 1, 1])[v] AS event_version
            FROM generate_series(1, $2::int) v, generate_series(1, $1::int) a
            ORDER BY v, a
        ),
        ev AS (
            INSERT INTO events (event_id, event_type, event_version, aggregate_type, aggregate_id,
                                aggregate_version, occurred_at, payload)
            SELECT event_id, event_type, event_version, 'order', aggregate_id, aggregate_version, now(), payload
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
    .bind(versions)
    .execute(pool)
    .await
    .expect("seed");
}
