//! Partitions shared by leases, over real processes (a real PostgreSQL and nats-server, the
//! `waybill-inventory` binary): instances started with `--partitions 2` and no `--partition` list
//! split the partitions between them by themselves; one killed under load has its partitions taken
//! over by the other with no manual step and every order applied once; a newcomer takes its share
//! without the others being restarted.

mod common;

use std::time::{Duration, Instant};

use common::*;
use sqlx::PgPool;

/// One running instance and the address of its `/health`.
struct Instance {
    child: tokio::process::Child,
    health: String,
}

fn start(h: &Harness) -> Instance {
    let port = testkit::free_port().expect("port");
    let listen = format!("127.0.0.1:{port}");
    let child = binary(
        h,
        INVENTORY,
        &[
            "--partitions",
            "2",
            "--lease-time",
            "2s",
            "run",
            "--metrics-listen",
            &listen,
        ],
    )
    .spawn()
    .expect("inventory starts");
    Instance {
        child,
        health: format!("http://{listen}/health"),
    }
}

/// The partitions an instance says it owns now (`None` while it does not answer).
async fn owned(instance: &Instance) -> Option<Vec<u64>> {
    let body: serde_json::Value = reqwest::get(&instance.health)
        .await
        .ok()?
        .json()
        .await
        .ok()?;
    let owned = body["partitions"]["owned"].as_array()?;
    Some(owned.iter().filter_map(serde_json::Value::as_u64).collect())
}

/// Waits up to `timeout` until `instances` own exactly `wanted` (one list per instance, in order).
async fn wait_owned(instances: &[&Instance], wanted: &[Vec<u64>], timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        let mut now = Vec::new();
        for instance in instances {
            now.push(owned(instance).await);
        }
        let now: Vec<Vec<u64>> = now.into_iter().map(Option::unwrap_or_default).collect();
        let mut sorted = now.clone();
        sorted.sort();
        let mut expected = wanted.to_vec();
        expected.sort();
        if sorted == expected {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "after {timeout:?} the instances own {now:?}, not {wanted:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Places `count` orders of one MUG each, as the relay would publish them.
async fn place(h: &Harness, count: usize) {
    for _ in 0..count {
        let order = new_order();
        h.publish(&envelope(order, 1, &placed("alice", &["MUG:1:100"])))
            .await;
    }
}

/// Waits up to `timeout` until inventory has reserved `mugs` MUGs, then checks it stays there (no
/// event applied twice).
async fn wait_reserved(pool: &PgPool, mugs: i64, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        let reserved = stock_of(pool, "MUG")
            .await
            .map_or(0, |(reserved, ..)| reserved);
        assert!(
            reserved <= mugs,
            "{reserved} MUGs reserved for {mugs} orders"
        );
        if reserved == mugs {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "after {timeout:?} {reserved} of {mugs} MUGs are reserved"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn instances_share_the_partitions_take_over_a_killed_ones_and_make_room_for_a_newcomer(
    pool: PgPool,
) {
    let h = Harness::new(&pool).await;
    let mut a = start(&h);
    let b = start(&h);
    wait_owned(&[&a, &b], &[vec![0], vec![1]], Duration::from_secs(30)).await;

    // Under load: orders keep coming while A is killed in the middle; no one restarts anything.
    place(&h, 300).await;
    a.child.start_kill().expect("SIGKILL");
    let _ = a.child.wait().await;
    place(&h, 200).await;

    wait_owned(&[&b], &[vec![0, 1]], Duration::from_secs(20)).await;
    wait_reserved(&pool, 500, Duration::from_secs(60)).await;

    // A newcomer takes its share; the survivor gives one partition up without a restart.
    let c = start(&h);
    wait_owned(&[&b, &c], &[vec![0], vec![1]], Duration::from_secs(30)).await;
    place(&h, 100).await;
    wait_reserved(&pool, 600, Duration::from_secs(60)).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    wait_reserved(&pool, 600, Duration::from_secs(1)).await;

    // Each partition has one durable consumer, read by whoever holds its lease, drained.
    for partition in 0..2 {
        let stream = h.jetstream.get_stream(STREAM).await.expect("stream");
        let name = format!("inventory-p{partition}of2");
        let info = stream
            .consumer_info(&name)
            .await
            .unwrap_or_else(|error| panic!("{name}: {error}"));
        assert_eq!(info.num_pending, 0, "{name} has nothing left to deliver");
    }
}
