//! What the projection tests share: a private nats-server with the stream, publishing as the relay
//! does (or not), the event builders, and readers of the projections' state.

#![allow(dead_code)]

use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream;
use domain::{EventEnvelope, EventMeta, OrderEvent, OrderId};
use projections::{Inventory, Points, Projection, Runner, RunnerConfig, Tally, inventory, points};
use relay::StreamSettings;
use sqlx::PgPool;
use testkit::NatsServer;
use uuid::Uuid;

pub(crate) const STREAM: &str = "PROJ_EVENTS";
pub(crate) const PREFIX: &str = "proj.events";

pub(crate) struct Harness {
    pub url: String,
    pub nats: NatsServer,
    pub jetstream: jetstream::Context,
}

impl Harness {
    pub(crate) async fn new(pool: &PgPool) -> Self {
        Self::with_duplicate_window(pool, StreamSettings::default().duplicate_window).await
    }

    /// With JetStream's dedupe window this short, the same message id can be stored again after it.
    pub(crate) async fn with_duplicate_window(pool: &PgPool, duplicate_window: Duration) -> Self {
        Self::with_stream(pool, duplicate_window, 1).await
    }

    /// With a stream the server splits into `partitions` partitions (`--stream-partitions`).
    pub(crate) async fn split(pool: &PgPool, partitions: u32) -> Self {
        Self::with_stream(pool, StreamSettings::default().duplicate_window, partitions).await
    }

    async fn with_stream(pool: &PgPool, duplicate_window: Duration, partitions: u32) -> Self {
        let nats = NatsServer::start().expect("nats-server");
        let client = async_nats::connect(nats.url()).await.expect("connect");
        let jetstream = jetstream::new(client);
        let settings = StreamSettings {
            name: STREAM.into(),
            subject_prefix: PREFIX.into(),
            duplicate_window,
        };
        let limits = relay::StreamLimits {
            partitions: Some(partitions),
            ..relay::StreamLimits::default()
        };
        relay::ensure_stream_with(&jetstream, &settings, &limits, false)
            .await
            .expect("stream");
        Self {
            url: testkit::database_url(pool).await,
            nats,
            jetstream,
        }
    }

    pub(crate) fn config(&self) -> RunnerConfig {
        RunnerConfig {
            stream: STREAM.into(),
            subject_prefix: PREFIX.into(),
            ack_wait: Duration::from_secs(2),
            ..RunnerConfig::default()
        }
    }

    pub(crate) async fn runner<P: Projection>(
        &self,
        projection: P,
        config: RunnerConfig,
    ) -> Runner<P> {
        Runner::connect(projection, &self.url, &self.nats.url(), config)
            .await
            .expect("runner")
    }

    /// Consumes with projection `P` until nothing more can be applied.
    pub(crate) async fn consume<P: Projection>(&self, projection: P) -> Tally {
        self.runner(projection, self.config())
            .await
            .run(std::future::pending(), true, |_| {})
            .await
            .expect("run")
    }

    /// Publishes `body` on `subject` with exactly `headers`, not waiting for the PubAck.
    pub(crate) async fn publish_with_headers(
        &self,
        subject: &str,
        headers: HeaderMap,
        body: Vec<u8>,
    ) {
        self.jetstream
            .publish_with_headers(subject.to_owned(), headers, body.into())
            .await
            .expect("publish")
            .await
            .expect("puback");
    }

    /// Publishes `body` with only a message id.
    pub(crate) async fn publish_raw(&self, subject: &str, body: Vec<u8>, msg_id: &str) {
        let mut headers = HeaderMap::new();
        headers.insert("Nats-Msg-Id", msg_id);
        self.publish_with_headers(subject, headers, body).await;
    }

    /// Publishes `envelope` as the relay does: its subject and headers.
    pub(crate) async fn publish(&self, envelope: &EventEnvelope) {
        self.publish_with_headers(
            &subject(envelope),
            projections::decode::relay_headers(envelope),
            envelope.to_json(),
        )
        .await;
    }
}

/// The relay's subject for `envelope`.
pub(crate) fn subject(envelope: &EventEnvelope) -> String {
    domain::wire::subject(PREFIX, envelope).expect("subject")
}

pub(crate) fn envelope(order: OrderId, version: i64, event: &OrderEvent) -> EventEnvelope {
    let meta = EventMeta {
        event_id: Uuid::now_v7(),
        occurred_at: chrono::Utc::now(),
        correlation_id: None,
        causation_id: None,
    };
    EventEnvelope::wrap(event, order, version, meta)
}

pub(crate) fn placed(customer: &str, lines: &[&str]) -> OrderEvent {
    domain::Order::new(OrderId::from_uuid(Uuid::now_v7()))
        .decide(&testkit::place(customer, lines))
        .expect("valid order")
        .remove(0)
}

pub(crate) fn paid(cents: i64) -> OrderEvent {
    OrderEvent::Paid(domain::OrderPaid::from_command(&domain::PayOrder {
        amount_cents: domain::Cents::new(cents).expect("cents"),
        payment_ref: None,
    }))
}

pub(crate) fn cancelled() -> OrderEvent {
    OrderEvent::Cancelled(domain::OrderCancelled::from_command(&domain::CancelOrder {
        reason: domain::Note::parse("changed my mind").expect("note"),
    }))
}

pub(crate) fn shipped() -> OrderEvent {
    OrderEvent::Shipped(domain::OrderShipped::from_command(&domain::ShipOrder {
        carrier: domain::Note::parse("DHL").expect("note"),
        tracking_number: domain::Note::parse("T1").expect("note"),
    }))
}

pub(crate) fn new_order() -> OrderId {
    OrderId::from_uuid(Uuid::now_v7())
}

pub(crate) async fn stock_of(pool: &PgPool, sku: &str) -> Option<(i64, i64, i64)> {
    let pool = projections::schema::connect(
        &testkit::database_url(pool).await,
        Inventory::NAME,
        Inventory::TABLES,
    )
    .await
    .expect("inventory pool");
    inventory::stock(&pool, Some(sku))
        .await
        .expect("stock")
        .pop()
        .map(|s| (s.reserved, s.shipped, s.released))
}

pub(crate) async fn balance_of(pool: &PgPool, customer: &str) -> Option<i64> {
    let pool = projections::schema::connect(
        &testkit::database_url(pool).await,
        Points::NAME,
        Points::TABLES,
    )
    .await
    .expect("points pool");
    points::accounts(&pool, Some(customer))
        .await
        .expect("accounts")
        .pop()
        .map(|a| a.balance)
}

/// A projection binary wired to the harness, with `args` after the connection flags.
pub(crate) fn binary(h: &Harness, path: &str, args: &[&str]) -> tokio::process::Command {
    binary_with(h, path, &[], args)
}

/// `waybill-projection <model>` wired to the harness, with `args` after the connection flags.
pub(crate) fn model(h: &Harness, name: &str, args: &[&str]) -> tokio::process::Command {
    binary_with(h, PROJECTION, &[name], args)
}

/// `waybill-projection-faulty <projection>` (the projection binary with fault flags, `fault-injection`
/// builds only) wired to the harness, with `args` after the connection flags.
pub(crate) fn faulty(h: &Harness, projection: &str, args: &[&str]) -> tokio::process::Command {
    binary_with(h, FAULTY, &[projection], args)
}

fn binary_with(h: &Harness, path: &str, first: &[&str], args: &[&str]) -> tokio::process::Command {
    let mut command = tokio::process::Command::new(path);
    command
        .args(first)
        .args([
            "--database-url",
            &h.url,
            "--nats-url",
            &h.nats.url(),
            "--stream",
            STREAM,
            "--subject-prefix",
            PREFIX,
            "--ack-wait",
            "2s",
        ])
        .args(args)
        .env("RUST_LOG", "warn")
        .env("WAYBILL_OPERATOR", "test-operator")
        .kill_on_drop(true);
    command
}

/// Runs a projection binary to its end; returns its exit code and standard output parsed as JSON.
pub(crate) async fn run_json(h: &Harness, path: &str, args: &[&str]) -> (i32, serde_json::Value) {
    let output = binary(h, path, args).output().await.expect("runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let json = serde_json::from_str(stdout.trim()).unwrap_or_else(|e| {
        panic!(
            "{path} {args:?}: stdout is not JSON ({e}): {stdout}\nstderr: {}",
            String::from_utf8_lossy(&output.stderr)
        )
    });
    (output.status.code().unwrap_or(-1), json)
}

pub(crate) const INVENTORY: &str = env!("CARGO_BIN_EXE_waybill-inventory");
pub(crate) const POINTS: &str = env!("CARGO_BIN_EXE_waybill-points");
pub(crate) const SEARCH: &str = env!("CARGO_BIN_EXE_waybill-search");
pub(crate) const PROJECTION: &str = env!("CARGO_BIN_EXE_waybill-projection");
pub(crate) const FAULTY: &str = env!("CARGO_BIN_EXE_waybill-projection-faulty");
