//! The shipped NATS configuration (deploy/nats/accounts.conf) on a private nats-server with TLS: the
//! relay publishes over `tls://` as its own user, a projection's user consumes through its own durable
//! consumer and can neither publish an event nor touch another projection's consumer, and a failed login
//! is a clear error that does not print the password.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull};
use common::{Harness, PREFIX, STREAM};
use futures::StreamExt;
use ops::{NatsConnection, NatsServer};
use sqlx::PgPool;

const RELAY_PASSWORD: &str = "relay-Secret-1";
const INVENTORY_PASSWORD: &str = "inventory-Secret-2";

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

/// The shipped accounts, renamed to the test's stream and prefix, behind TLS.
fn secure_server(dir: &Path) -> (NatsServer, PathBuf) {
    let (ca, cert, key) = certificates(dir);
    let shipped = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/nats/accounts.conf"
    ))
    .expect("the shipped accounts.conf");
    let accounts = shipped
        .replace("WAYBILL_EVENTS", STREAM)
        .replace("waybill.events", PREFIX)
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
    (
        NatsServer::start_with_config(&config).expect("secure nats-server"),
        ca,
    )
}

fn as_user(url: &str, user: &str, password: &str, ca: &Path) -> NatsConnection {
    NatsConnection {
        url: url.replace("nats://", &format!("tls://{user}:{password}@")),
        ca: Some(ca.to_owned()),
        ..NatsConnection::default()
    }
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn the_shipped_permissions_let_each_process_do_its_job_and_nothing_more(pool: PgPool) {
    let dir = ops::unique_temp_dir("waybill-tls", 0).expect("temp dir");
    let (nats, ca) = secure_server(&dir);
    let url = nats.url();
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
    let _ = std::fs::remove_dir_all(&dir);
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
