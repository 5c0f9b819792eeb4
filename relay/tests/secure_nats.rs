//! The shipped NATS configuration (deploy/nats/accounts.conf) on a private nats-server with TLS: the
//! relay publishes over `tls://` as its own user, a projection's user consumes through its own durable
//! consumer and can neither publish an event nor touch another projection's consumer, and a failed login
//! is a clear error that does not print the password.

mod common;

use std::path::Path;
use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull};
use common::{Harness, PREFIX, STREAM};
use futures::StreamExt;
use ops::NatsConnection;
use sqlx::PgPool;
use testkit::NatsServer;

use testkit::secure_nats::{INVENTORY_PASSWORD, RELAY_PASSWORD, SecureNats};

fn as_user(url: &str, user: &str, password: &str, ca: &Path) -> NatsConnection {
    NatsConnection {
        url: url.replace("nats://", &format!("tls://{user}:{password}@")),
        ca: Some(ca.to_owned()),
        ..NatsConnection::default()
    }
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn the_shipped_permissions_let_each_process_do_its_job_and_nothing_more(pool: PgPool) {
    let secure = SecureNats::start(STREAM, PREFIX);
    let (url, ca) = (secure.server.url(), secure.ca.clone());
    let h = Harness::with_nats(pool, NatsServer::start().expect("unused plain server")).await;
    let order = testkit::place_order(&h.store, "alice", &["MUG:1:100"]).await;
    testkit::pay_order(&h.store, order).await;

    // The relay, over TLS as `relay`, provisions the stream and publishes.
    let relay = relay::Relay::connect(
        &h.url,
        as_user(&url, "relay", RELAY_PASSWORD, &ca),
        h.config("relay-a"),
    )
    .await
    .expect("the relay logs in over TLS");
    relay
        .provision(false)
        .await
        .expect("the relay may provision");
    let report = relay.step().await.expect("step");
    assert_eq!(report.marked_sent, 2, "{report:?}");

    // The inventory projection's user consumes through its own durable consumer.
    let inventory = as_user(&url, "inventory", INVENTORY_PASSWORD, &ca)
        .connect("inventory")
        .await
        .expect("inventory logs in");
    let js = jetstream::new(inventory.clone());
    let stream = js
        .get_stream(STREAM)
        .await
        .expect("inventory may read the stream's info");
    let consumer = stream
        .get_or_create_consumer(
            "inventory",
            pull::Config {
                durable_name: Some("inventory".into()),
                filter_subject: format!("{PREFIX}.>"),
                ..Default::default()
            },
        )
        .await
        .expect("inventory may create its own consumer");
    let mut messages = consumer
        .fetch()
        .max_messages(10)
        .messages()
        .await
        .expect("fetch");
    let mut received = 0;
    while let Some(message) = messages.next().await {
        message
            .expect("message")
            .ack()
            .await
            .expect("inventory may ack");
        received += 1;
    }
    assert_eq!(received, 2);

    // …but may not publish an event, nor use another projection's consumer.
    let forged = js
        .publish(format!("{PREFIX}.order.{order}"), "forged".into())
        .await;
    let refused = match forged {
        Ok(ack) => tokio::time::timeout(Duration::from_secs(5), ack)
            .await
            .map_or(true, |r| r.is_err()),
        Err(_) => true,
    };
    assert!(refused, "a projection's user must not publish events");
    let other = stream
        .get_or_create_consumer(
            "points",
            pull::Config {
                durable_name: Some("points".into()),
                ..Default::default()
            },
        )
        .await;
    assert!(
        other.is_err(),
        "inventory must not create the points consumer"
    );
    let mut info = js.get_stream(STREAM).await.expect("stream");
    assert_eq!(
        info.info().await.expect("info").state.messages,
        2,
        "nothing forged was stored"
    );

    // A wrong password: a clear error naming the server, and no password in it.
    let error = as_user(&url, "relay", "wrong-password-XYZ", &ca)
        .connect("relay")
        .await
        .expect_err("wrong password");
    let message = format!("{error:#}");
    assert!(
        message.contains("connecting to NATS at tls://relay:***@127.0.0.1"),
        "{message}"
    );
    assert!(!message.contains("wrong-password-XYZ"), "{message}");
}

#[tokio::test]
async fn the_relay_prints_no_secret_in_help_or_errors() {
    let run = |args: &'static [&'static str]| {
        tokio::process::Command::new(env!("CARGO_BIN_EXE_waybill-relay"))
            .args(args)
            .env(
                "DATABASE_URL",
                "postgres://nobody:Pg-Secret-1@127.0.0.1:5432/nowhere?password=Pg-Secret-2",
            )
            .env("NATS_URL", "tls://relay:Nats-Secret-3@127.0.0.1:1")
            .env("NATS_PASSWORD", "Nats-Secret-4")
            .env("NATS_TOKEN", "Nats-Secret-5")
            .output()
    };
    for args in [
        &["--help"][..],
        &["run", "--help"],
        &["status"],
        &["run", "--once"],
    ] {
        let output = run(args).await.expect("waybill-relay runs");
        let printed = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        assert!(
            !printed.contains("Secret"),
            "{args:?} printed a secret:\n{printed}"
        );
        if args != ["--help"] && args != ["run", "--help"] {
            assert_eq!(output.status.code(), Some(1), "{args:?}: {printed}");
            assert!(printed.contains("error:"), "{printed}");
        }
    }
}
