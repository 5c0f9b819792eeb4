//! Partitions split by the server, measured: the inventory projection applying a stream that the
//! server splits into four partitions, with one, two and four instances sharing them (events per
//! second from the first delivery to the last applied event, and broker deliveries per event, read
//! from the consumers), and how long a dead instance's partitions wait before another instance holds
//! them (two instances sharing through leases, one of them dropped without releasing anything, as a
//! SIGKILL leaves it).
//!
//! The instances are runners in this process, each with its own connections, as `waybill-inventory`
//! would run them; on a two-core machine they share the cores with PostgreSQL and NATS, so more
//! instances measure the runner's parallelism here, not more hardware.

use std::time::{Duration, Instant};

use projections::{Inventory, Partitions, Projection, Runner, RunnerConfig};
use serde::Serialize;
use testkit::stats::median;

use super::Progress;

/// Partitions of the measured stream.
pub(super) const PARTITIONS: u32 = 4;
/// The instance counts measured.
const INSTANCES: [u32; 3] = [1, 2, 4];
/// The lease time of the takeover measurement (the projections' default is 6 s).
const LEASE_TIME: Duration = Duration::from_secs(3);

/// One instance count's figures (medians over the rounds).
#[derive(Debug, Clone, Serialize)]
pub(super) struct InstancesFigure {
    pub instances: u32,
    pub events_per_s: f64,
    /// Messages the broker delivered to the partition consumers per event in the stream.
    pub deliveries_per_event: f64,
}

/// What `measure` found.
#[derive(Debug, Clone, Serialize)]
pub(super) struct ScalingFigures {
    /// The stream's partitions (split by the server).
    pub partitions: u32,
    pub instances: Vec<InstancesFigure>,
    /// Seconds from a dead instance's last renewal to the survivor holding every partition
    /// (median; the lease time is `lease_seconds`).
    pub takeover_seconds: f64,
    pub lease_seconds: f64,
    /// Every round's values.
    pub runs: serde_json::Value,
}

/// Where the runners read and write.
pub(super) struct Wiring<'a> {
    pub url: &'a str,
    pub nats_url: &'a str,
    pub stream: &'a str,
    pub prefix: &'a str,
    pub rounds: usize,
}

/// Measures the split stream `wiring.stream`, filled with `events` events.
pub(super) async fn measure(
    wiring: &Wiring<'_>,
    events: usize,
    progress: &Progress,
) -> anyhow::Result<ScalingFigures> {
    let mut instances = Vec::new();
    let mut runs = serde_json::Map::new();
    for count in INSTANCES {
        let mut rates = Vec::new();
        let mut deliveries = Vec::new();
        for round in 1..=wiring.rounds {
            let (rate, delivered) = apply_with(wiring, count, events).await?;
            progress.say(&format!(
                "inventory on {PARTITIONS} partitions split by the server, {count} instance(s), round {round}/{}: {rate:.0} events/s, {delivered:.2} deliveries per event",
                wiring.rounds
            ));
            rates.push(rate);
            deliveries.push(delivered);
        }
        runs.insert(
            format!("instances_{count}"),
            serde_json::json!({"events_per_s": rates, "deliveries_per_event": deliveries}),
        );
        instances.push(InstancesFigure {
            instances: count,
            events_per_s: median(rates),
            deliveries_per_event: median(deliveries),
        });
    }
    let mut takeovers = Vec::new();
    for round in 1..=wiring.rounds {
        let seconds = takeover(wiring).await?;
        progress.say(&format!(
            "takeover of a dead instance's partitions, round {round}/{}: {seconds:.1} s (lease {} s)",
            wiring.rounds,
            LEASE_TIME.as_secs()
        ));
        takeovers.push(seconds);
    }
    runs.insert("takeover_seconds".into(), serde_json::json!(takeovers));
    Ok(ScalingFigures {
        partitions: PARTITIONS,
        instances,
        takeover_seconds: median(takeovers),
        lease_seconds: LEASE_TIME.as_secs_f64(),
        runs: serde_json::Value::Object(runs),
    })
}

fn config(wiring: &Wiring<'_>, owned: &[u32]) -> anyhow::Result<RunnerConfig> {
    Ok(RunnerConfig {
        stream: wiring.stream.into(),
        subject_prefix: wiring.prefix.into(),
        partitions: Partitions::new(PARTITIONS, owned)?,
        ..RunnerConfig::default()
    })
}

/// From a reset state, `count` instances dividing the partitions apply the whole stream; the rate
/// from their start to the last applied event, and the deliveries per event.
async fn apply_with(wiring: &Wiring<'_>, count: u32, events: usize) -> anyhow::Result<(f64, f64)> {
    let reset =
        Runner::connect(Inventory, wiring.url, wiring.nats_url, config(wiring, &[])?).await?;
    anyhow::ensure!(
        reset.config().partitions.is_split_by_server(),
        "stream {} is not split into {PARTITIONS} partitions by the server",
        wiring.stream
    );
    reset.reset().await?;
    let mut runners = Vec::new();
    for instance in 0..count {
        let owned: Vec<u32> = (0..PARTITIONS).filter(|k| k % count == instance).collect();
        runners.push(
            Runner::connect(
                Inventory,
                wiring.url,
                wiring.nats_url,
                config(wiring, &owned)?,
            )
            .await?,
        );
    }
    let started = Instant::now();
    let finished =
        futures::future::try_join_all(runners.iter().map(super::projections::apply_all)).await?;
    let applied: u64 = finished.iter().map(|(applied, _)| applied).sum();
    anyhow::ensure!(
        usize::try_from(applied).is_ok_and(|a| a == events),
        "{count} instance(s) applied {applied} of {events} events"
    );
    let last = finished.iter().map(|(_, at)| *at).max().unwrap_or(started);
    let rate = applied as f64 / (last - started).as_secs_f64().max(1e-6);
    let stream = async_nats::jetstream::new(reset.client().clone())
        .get_stream(wiring.stream)
        .await?;
    let layout = &reset.config().partitions;
    let mut delivered = 0;
    for partition in 0..PARTITIONS {
        let name = layout.consumer_name(Inventory::NAME, partition);
        delivered += stream
            .consumer_info(name)
            .await?
            .delivered
            .consumer_sequence;
    }
    Ok((rate, delivered as f64 / events as f64))
}

/// Two instances share the partitions through leases; once each holds two, one is dropped without
/// releasing (its leases simply stop being renewed, as after SIGKILL). Seconds until the other holds
/// all four.
async fn takeover(wiring: &Wiring<'_>) -> anyhow::Result<f64> {
    let shared = RunnerConfig {
        share: true,
        lease_time: LEASE_TIME,
        ..config(wiring, &[])?
    };
    let survivor = Runner::connect(Inventory, wiring.url, wiring.nats_url, shared.clone()).await?;
    let doomed = Runner::connect(Inventory, wiring.url, wiring.nats_url, shared).await?;
    let survivor = std::sync::Arc::new(survivor);
    let doomed = std::sync::Arc::new(doomed);
    let running = {
        let survivor = survivor.clone();
        tokio::spawn(async move { survivor.run(std::future::pending(), false, |_| {}).await })
    };
    let dying = {
        let doomed = doomed.clone();
        tokio::spawn(async move { doomed.run(std::future::pending(), false, |_| {}).await })
    };
    let half = usize::try_from(PARTITIONS / 2).unwrap_or(1);
    let shared_out = wait_until(Duration::from_secs(60), || {
        survivor.owned_partitions().len() == half && doomed.owned_partitions().len() == half
    })
    .await;
    anyhow::ensure!(
        shared_out,
        "the two instances did not share the partitions within 60 s"
    );
    dying.abort();
    let died = Instant::now();
    let all = usize::try_from(PARTITIONS).unwrap_or(usize::MAX);
    let taken = wait_until(Duration::from_secs(60), || {
        survivor.owned_partitions().len() == all
    })
    .await;
    let seconds = died.elapsed().as_secs_f64();
    running.abort();
    anyhow::ensure!(
        taken,
        "the survivor did not take every partition within 60 s"
    );
    Ok(seconds)
}

async fn wait_until(limit: Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if check() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    check()
}
