//! The whole pipeline on a private nats-server with TLS and the shipped accounts: the relay publishes as
//! `relay` over `tls://`, `waybill-inventory` applies as `inventory` (trusting the server through
//! NATS_CA), and neither a failed login nor `--help` prints a password.

mod common;

use common::{PREFIX, STREAM, stock_of};
use relay::{Relay, RelayConfig, StreamSettings};
use sqlx::PgPool;
use store::EventStore;
use testkit::secure_nats::{INVENTORY_PASSWORD, POINTS_PASSWORD, RELAY_PASSWORD, SecureNats};

fn inventory(
    url: &str,
    nats_url: &str,
    ca: &std::path::Path,
    args: &[&str],
) -> tokio::process::Command {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_waybill-inventory"));
    command
        .args(["--stream", STREAM, "--subject-prefix", PREFIX])
        .args(args)
        .env("DATABASE_URL", url)
        .env("NATS_URL", nats_url)
        .env("NATS_CA", ca)
        .env("RUST_LOG", "warn");
    command
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn the_pipeline_runs_over_tls_with_a_user_per_process(pool: PgPool) {
    let secure = SecureNats::start(STREAM, PREFIX);
    let url = testkit::database_url(&pool).await;
    let store = EventStore::new(pool.clone());
    let order = testkit::place_order(&store, "alice", &["MUG:2:1250"]).await;
    testkit::pay_order(&store, order).await;

    let relay_nats = ops::NatsConnection {
        ca: Some(secure.ca.clone()),
        ..ops::NatsConnection::from(secure.url_for("relay", RELAY_PASSWORD))
    };
    let config = RelayConfig {
        stream: StreamSettings {
            name: STREAM.into(),
            subject_prefix: PREFIX.into(),
            ..StreamSettings::default()
        },
        ..RelayConfig::default()
    };
    let relay = Relay::connect(&url, relay_nats, config)
        .await
        .expect("relay over TLS");
    relay.provision(false).await.expect("provision");
    assert_eq!(relay.drain().await.expect("drain").marked_sent, 2);

    let inventory_url = secure.url_for("inventory", INVENTORY_PASSWORD);
    let output = inventory(
        &url,
        &inventory_url,
        &secure.ca,
        &["--json", "run", "--once"],
    )
    .output()
    .await
    .expect("waybill-inventory runs");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(
        stock_of(&pool, "MUG").await,
        Some((2, 0, 0)),
        "reserved by the paid order"
    );

    // A wrong password: exit 1, a clear error, and the password nowhere.
    let wrong = secure.url_for("inventory", "Wrong-Secret-9");
    let failed = inventory(&url, &wrong, &secure.ca, &["run", "--once"])
        .output()
        .await
        .expect("runs");
    let printed = String::from_utf8_lossy(&failed.stderr).into_owned();
    assert_eq!(failed.status.code(), Some(1), "{printed}");
    assert!(printed.contains("NATS"), "{printed}");
    assert!(!printed.contains("Wrong-Secret-9"), "{printed}");

    let help = inventory(&url, &inventory_url, &secure.ca, &["--help"])
        .output()
        .await
        .expect("runs");
    let printed = String::from_utf8_lossy(&help.stdout).into_owned();
    assert!(printed.contains("--nats-ca"), "{printed}");
    assert!(!printed.contains(INVENTORY_PASSWORD), "{printed}");
}

/// Publishes an order through the relay as user `relay` on `secure`, returning its id.
async fn relay_an_order(pool: &PgPool, secure: &SecureNats, lines: &[&str]) {
    let url = testkit::database_url(pool).await;
    let store = EventStore::new(pool.clone());
    testkit::place_order(&store, "alice", lines).await;
    let relay_nats = ops::NatsConnection {
        ca: Some(secure.ca.clone()),
        ..ops::NatsConnection::from(secure.url_for("relay", RELAY_PASSWORD))
    };
    let config = RelayConfig {
        stream: StreamSettings {
            name: STREAM.into(),
            subject_prefix: PREFIX.into(),
            ..StreamSettings::default()
        },
        ..RelayConfig::default()
    };
    let relay = Relay::connect(&url, relay_nats, config)
        .await
        .expect("relay over TLS");
    relay.provision(false).await.expect("provision");
    relay.drain().await.expect("drain");
}

/// `waybill-inventory --json run --once --partitions 2 --partition K` as `nats_url`'s user; it must
/// succeed, and its summary is returned.
async fn run_partition(
    url: &str,
    nats_url: &str,
    secure: &SecureNats,
    k: &str,
) -> serde_json::Value {
    let args = [
        "--json",
        "run",
        "--once",
        "--partitions",
        "2",
        "--partition",
        k,
    ];
    let output = inventory(url, nats_url, &secure.ca, &args)
        .output()
        .await
        .expect("waybill-inventory runs");
    let printed = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "partition {k}: {printed}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_str(printed.trim()).expect("a JSON summary")
}

/// The shipped accounts let a projection's user run each partition of a partitioned layout, and
/// refuse what is beyond them — another projection's consumers, a layout past the generated maximum
/// — with an error that names the refused subject instead of "timed out".
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn partitions_run_under_the_shipped_accounts_and_a_refusal_names_its_subject(pool: PgPool) {
    let secure = SecureNats::start(STREAM, PREFIX);
    let url = testkit::database_url(&pool).await;
    for n in 0..6 {
        relay_an_order(&pool, &secure, &[&format!("SKU{n}:1:100")]).await;
    }
    let as_inventory = secure.url_for("inventory", INVENTORY_PASSWORD);
    for k in ["0", "1"] {
        run_partition(&url, &as_inventory, &secure, k).await;
    }
    let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM inventory.checkpoints")
        .fetch_one(&pool)
        .await
        .expect("checkpoints");
    assert_eq!(applied, 6, "both partitions together applied every order");

    // Past the generated maximum, and another projection's user: refused, and said so.
    let beyond = projections::accounts::SHIPPED_MAX_PARTITIONS + 1;
    let beyond = beyond.to_string();
    let as_points = secure.url_for("points", POINTS_PASSWORD);
    let cases = [
        (
            &as_inventory,
            vec![
                "run",
                "--once",
                "--partitions",
                beyond.as_str(),
                "--partition",
                "0",
            ],
            format!("$JS.API.CONSUMER.INFO.{STREAM}.inventory-p0of{beyond}"),
        ),
        (
            &as_points,
            vec!["run", "--once"],
            format!("$JS.API.CONSUMER.INFO.{STREAM}.inventory"),
        ),
    ];
    for (nats_url, args, subject) in cases {
        for json in [false, true] {
            let mut args = args.clone();
            if json {
                args.insert(0, "--json");
            }
            let output = inventory(&url, nats_url, &secure.ca, &args)
                .output()
                .await
                .expect("runs");
            let printed = format!(
                "{}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            );
            assert_eq!(output.status.code(), Some(1), "{args:?}: {printed}");
            let said = format!("permission denied by the NATS server: publish to {subject}");
            assert!(
                printed.contains(&said),
                "{args:?} should say {said:?}:\n{printed}"
            );
        }
    }
}

/// Shared partitions (no `--partition` list) work under the shipped accounts as the projection's
/// own user: its lease bucket is within its permissions, and it takes every partition alone.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn shared_partitions_take_their_leases_under_the_shipped_accounts(pool: PgPool) {
    let secure = SecureNats::start(STREAM, PREFIX);
    let url = testkit::database_url(&pool).await;
    for n in 0..4 {
        relay_an_order(&pool, &secure, &[&format!("SKU{n}:1:100")]).await;
    }
    let as_inventory = secure.url_for("inventory", INVENTORY_PASSWORD);
    let listen = format!("127.0.0.1:{}", testkit::free_port().expect("port"));
    let mut running = inventory(
        &url,
        &as_inventory,
        &secure.ca,
        &[
            "run",
            "--partitions",
            "2",
            "--lease-time",
            "2s",
            "--metrics-listen",
            &listen,
        ],
    )
    .kill_on_drop(true)
    .spawn()
    .expect("waybill-inventory starts");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let health: Option<serde_json::Value> =
            match reqwest::get(format!("http://{listen}/health")).await {
                Ok(response) => response.json().await.ok(),
                Err(_) => None,
            };
        let owned = health.as_ref().map(|h| h["partitions"]["owned"].clone());
        let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM inventory.checkpoints")
            .fetch_one(&pool)
            .await
            .unwrap_or(0);
        if owned == Some(serde_json::json!([0, 1])) && applied == 4 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "after 30 s: owned {owned:?}, {applied} of 4 orders applied (health {health:?})"
        );
        assert!(
            running.try_wait().expect("wait").is_none(),
            "inventory exited"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    running.start_kill().expect("kill");
}

/// On a stream the server splits, each partition's consumer (`inventory-s<K>of2`, filtered on its
/// partition) runs as the projection's own user under the shipped accounts, and the two are
/// delivered each event once between them.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn partitions_split_by_the_server_run_under_the_shipped_accounts(pool: PgPool) {
    let secure = SecureNats::start(STREAM, PREFIX);
    let url = testkit::database_url(&pool).await;
    let relay_nats = ops::NatsConnection {
        ca: Some(secure.ca.clone()),
        ..ops::NatsConnection::from(secure.url_for("relay", RELAY_PASSWORD))
    };
    let relay = Relay::connect(&url, relay_nats, RelayConfig::default())
        .await
        .expect("relay over TLS");
    let settings = StreamSettings {
        name: STREAM.into(),
        subject_prefix: PREFIX.into(),
        ..StreamSettings::default()
    };
    let split = relay::StreamLimits {
        partitions: Some(2),
        ..relay::StreamLimits::default()
    };
    relay::ensure_stream_with(relay.jetstream(), &settings, &split, false)
        .await
        .expect("the relay's user provisions a split stream");
    for n in 0..6 {
        relay_an_order(&pool, &secure, &[&format!("SKU{n}:1:100")]).await;
    }
    let as_inventory = secure.url_for("inventory", INVENTORY_PASSWORD);
    let mut messages = 0;
    for k in ["0", "1"] {
        let summary = run_partition(&url, &as_inventory, &secure, k).await;
        assert_eq!(
            summary["tally"]["skipped"],
            serde_json::Value::Null,
            "{summary}"
        );
        messages += summary["tally"]["messages"].as_u64().expect("messages");
    }
    assert_eq!(
        messages, 6,
        "each event delivered once between the two partitions"
    );
    let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM inventory.checkpoints")
        .fetch_one(&pool)
        .await
        .expect("checkpoints");
    assert_eq!(applied, 6);
}
