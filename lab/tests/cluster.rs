//! A three-node NATS cluster (testkit's) under the real binaries: `waybill-relay provision --replicas 3`
//! creates a stream with three replicas through a comma-separated NATS_URL, refuses to treat it as a
//! one-replica stream, and still reaches the cluster when the first listed node is dead.

use sqlx::PgPool;
use testkit::NatsCluster;

async fn provision(database_url: &str, nats_url: &str, replicas: Option<&str>) -> testkit::Run {
    // The relay binary sits beside waybill-lab.
    let relay =
        std::path::Path::new(env!("CARGO_BIN_EXE_waybill-lab")).with_file_name("waybill-relay");
    let mut command = tokio::process::Command::new(relay);
    command
        .args(["--json", "provision"])
        .env("DATABASE_URL", database_url)
        .env("NATS_URL", nats_url)
        .env("WAYBILL_STREAM", "CLUSTERED")
        .env("WAYBILL_SUBJECT_PREFIX", "clustered.events")
        .env("RUST_LOG", "warn");
    if let Some(replicas) = replicas {
        command.env("WAYBILL_STREAM_REPLICAS", replicas);
    }
    command.output().await.expect("waybill-relay runs").into()
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn the_relay_provisions_a_replicated_stream_through_a_list_of_cluster_urls(pool: PgPool) {
    testkit::build_workspace_binaries(env!("CARGO_MANIFEST_DIR"));
    let url = testkit::database_url(&pool).await;
    let mut cluster = tokio::task::spawn_blocking(|| NatsCluster::start(3))
        .await
        .expect("join")
        .expect("a three-node cluster");
    let urls = cluster.urls();

    let created = provision(&url, &urls, Some("3")).await.ok();
    assert_eq!(created.json()["replicas"], 3, "{}", created.stdout);

    let one = provision(&url, &urls, Some("1")).await;
    assert_ne!(
        one.code, 0,
        "a three-replica stream is not a one-replica one"
    );
    assert!(
        one.stdout.contains("num_replicas is 3, needs 1"),
        "the difference is named: {}{}",
        one.stdout,
        one.stderr
    );
    // Not told: the relay takes the stream as provisioned.
    let untold = provision(&url, &urls, None).await.ok();
    assert_eq!(untold.json()["replicas"], 3);

    // The first listed node dies: the client connects to another one of the list. If the dead node
    // led JetStream's metadata, the others elect a new leader first (seconds), so a JetStream request
    // may time out meanwhile: retried, as an operator would.
    cluster.kill(0);
    let mut attempts = 0;
    let failover = loop {
        attempts += 1;
        let run = provision(&url, &urls, Some("3")).await;
        if run.code == 0 || attempts == 6 {
            break run.ok();
        }
        assert!(
            run.stdout.contains("timed out"),
            "only a timeout while the cluster elects a leader is retried: {}",
            run.stdout
        );
        tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    };
    assert_eq!(failover.json()["replicas"], 3, "{}", failover.stdout);
}
