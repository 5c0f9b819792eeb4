//! `waybill demo --rollout`: the rolling upgrade of `order.placed` from v2 to v3, told over the real
//! processes. The projections start as old readers (`--max-version order.placed=2`) and the order
//! service as an old writer (`--write-version order.placed=2`): v2 orders flow, and an order v2
//! cannot carry is refused. Then the writer moves to v3 before the readers do — the wrong order — and
//! the old readers park every v3 order and hold the payments behind them, losing nothing. The readers
//! are upgraded (restarted without the flag) and each runs `redrive`; the verdict compares every
//! projection with the event store, as the main demo does. Every fact told is read back first.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use async_nats::jetstream;
use projections::{Inventory, Points, Projection, Search};
use reqwest::StatusCode;
use serde_json::{Value, json};
use sqlx::PgPool;
use uuid::Uuid;

use super::fleet::{Wiring, wait_for_health};
use super::{settled, step, verify, wait_for};
use crate::http::{Http, Orders};
use crate::process::{self, Launch, binary, strings};

/// The rollout's own database, stream and subject prefix by default.
pub(super) const NAMES: (&str, &str, &str) =
    ("waybill_rollout", "WAYBILL_ROLLOUT", "waybill.rollout");

/// What the old binaries know.
const OLD: &str = "order.placed=2";

/// Orders placed in each phase.
const ORDERS: usize = 8;
/// [`ORDERS`] as PostgreSQL counts it.
#[allow(clippy::cast_possible_wrap, reason = "8 fits")]
const ORDER_ROWS: i64 = ORDERS as i64;

const PROJECTIONS: [&str; 3] = [Inventory::NAME, Points::NAME, Search::NAME];

/// One supervised child process.
struct Child {
    name: String,
    child: tokio::process::Child,
    /// Its `/health`.
    health: String,
}

/// The processes of the story and where their logs go.
struct Processes {
    wiring: Wiring,
    logs: PathBuf,
    relay: Option<Child>,
    api: Option<(Child, String)>,
    projections: Vec<Child>,
    /// Each projection's read API, for the verdict (stable across restarts).
    reads: Vec<(&'static str, String)>,
}

impl Processes {
    fn new(wiring: &Wiring) -> anyhow::Result<Self> {
        let logs = tempfile::Builder::new()
            .prefix("waybill-rollout-logs-")
            .tempdir()?
            .keep();
        let reads = PROJECTIONS
            .iter()
            .map(|name| Ok((*name, format!("http://127.0.0.1:{}", testkit::free_port()?))))
            .collect::<anyhow::Result<_>>()?;
        Ok(Self {
            wiring: wiring.clone(),
            logs,
            relay: None,
            api: None,
            projections: Vec::new(),
            reads,
        })
    }

    fn spawn(
        &self,
        binary_name: &str,
        log: &str,
        args: &[&str],
        health: String,
    ) -> anyhow::Result<Child> {
        let args = strings(args);
        let child = Launch {
            program: &binary(binary_name)?,
            args: &args,
            env: &self.wiring.env(),
            clear_env: false,
            // The story sets the versions itself; none may come from the caller's environment.
            unset: &["WAYBILL_WRITE_VERSIONS", "WAYBILL_MAX_VERSIONS"],
            name: log,
        }
        .spawn(&self.logs)?;
        Ok(Child {
            name: log.to_owned(),
            child,
            health,
        })
    }

    fn start_relay(&mut self) -> anyhow::Result<()> {
        let metrics = format!("127.0.0.1:{}", testkit::free_port()?);
        let args = [
            "run",
            "--relay-id",
            "rollout-relay",
            "--poll-interval",
            "200ms",
            "--metrics-listen",
            &metrics,
        ];
        self.relay =
            Some(self.spawn("waybill-relay", "relay", &args, format!("http://{metrics}"))?);
        Ok(())
    }

    /// The order service; `old` writes `order.placed` v2.
    fn start_api(&mut self, old: bool) -> anyhow::Result<()> {
        let (api, metrics) = (testkit::free_port()?, testkit::free_port()?);
        let mut args = vec![
            "serve".to_owned(),
            "--listen".to_owned(),
            format!("127.0.0.1:{api}"),
            "--metrics-listen".to_owned(),
            format!("127.0.0.1:{metrics}"),
        ];
        if old {
            args.extend(["--write-version".to_owned(), OLD.to_owned()]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let log = if old {
            "order-service-v2-writer"
        } else {
            "order-service-current-writer"
        };
        let child = self.spawn("waybill", log, &args, format!("http://127.0.0.1:{metrics}"))?;
        self.api = Some((child, format!("http://127.0.0.1:{api}")));
        Ok(())
    }

    /// The three projections; `old` ones read as if they knew only `order.placed` v2.
    fn start_projections(&mut self, old: bool) -> anyhow::Result<()> {
        for (name, read) in self.reads.clone() {
            let metrics = format!("127.0.0.1:{}", testkit::free_port()?);
            let listen = read.trim_start_matches("http://").to_owned();
            let mut args = vec!["run", "--listen", &listen, "--metrics-listen", &metrics];
            if old {
                args.extend(["--max-version", OLD]);
            }
            let log = format!("{name}-{}", if old { "old" } else { "upgraded" });
            let child = self.spawn(
                &format!("waybill-{name}"),
                &log,
                &args,
                format!("http://{metrics}"),
            )?;
            self.projections.push(child);
        }
        Ok(())
    }

    async fn wait_healthy(&mut self) -> anyhow::Result<()> {
        let logs = self.logs.clone();
        let mut all: Vec<&mut Child> = self.projections.iter_mut().collect();
        all.extend(self.relay.as_mut());
        all.extend(self.api.as_mut().map(|(child, _)| child));
        for child in all {
            let health = child.health.clone();
            wait_for_health(&health, || match child.child.try_wait() {
                Ok(Some(status)) => Err(anyhow::anyhow!(
                    "{} exited with {status}{}",
                    child.name,
                    process::log_tail(&logs, &child.name)
                )),
                _ => Ok(()),
            })
            .await?;
        }
        Ok(())
    }

    async fn stop_api(&mut self) {
        if let Some((child, _)) = self.api.take() {
            stop(child).await;
        }
    }

    async fn stop_projections(&mut self) {
        for child in std::mem::take(&mut self.projections) {
            stop(child).await;
        }
    }

    async fn stop_all(mut self) -> PathBuf {
        self.stop_api().await;
        self.stop_projections().await;
        if let Some(relay) = self.relay.take() {
            stop(relay).await;
        }
        self.logs
    }

    fn api(&self) -> anyhow::Result<Orders> {
        let (_, base) = self
            .api
            .as_ref()
            .context("the order service is not running")?;
        Ok(Orders::new(base, Http::default()))
    }
}

/// SIGTERM, then a kill after the grace period.
async fn stop(mut child: Child) {
    process::stop_all([(child.name.as_str(), &mut child.child)], process::GRACE).await;
}

/// Places an order through `channel` and pays it; returns its id.
async fn place_and_pay(api: &Orders, i: usize, channel: &str) -> anyhow::Result<Uuid> {
    let placed = api
        .expect("/orders", &order(i, channel), StatusCode::CREATED)
        .await?;
    let id: Uuid = serde_json::from_value(placed["order_id"].clone())?;
    let total = placed["total_cents"].as_i64().context("a total")?;
    api.expect(
        &format!("/orders/{id}/pay"),
        &json!({"amount_cents": total}),
        StatusCode::OK,
    )
    .await?;
    Ok(id)
}

fn order(i: usize, channel: &str) -> Value {
    let sku = ["LAMP", "RUG", "VASE"][i % 3];
    json!({
        "customer_id": format!("rollout-{}", i % 3),
        "currency": "EUR",
        "lines": [{"sku": sku, "quantity": 1 + i % 2, "unit_price_cents": 1900}],
        "channel": channel,
    })
}

/// Stored `order.placed` events per payload version.
async fn placed_versions(pool: &PgPool) -> anyhow::Result<Vec<(i32, i64)>> {
    Ok(sqlx::query_as(
        "SELECT event_version, count(*) FROM events WHERE event_type = 'order.placed'
         GROUP BY event_version ORDER BY event_version",
    )
    .fetch_all(pool)
    .await?)
}

/// Per projection: open parked messages, held events, and one parked reason.
async fn waiting(pool: &PgPool) -> anyhow::Result<Vec<(&'static str, i64, i64, Option<String>)>> {
    let mut out = Vec::new();
    for name in PROJECTIONS {
        let (parked, held, reason): (i64, i64, Option<String>) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT (SELECT count(*) FROM \"{name}\".parked WHERE redriven_at IS NULL AND discarded_at IS NULL),
                    (SELECT count(*) FROM \"{name}\".held),
                    (SELECT reason FROM \"{name}\".parked WHERE redriven_at IS NULL AND discarded_at IS NULL LIMIT 1)"
        )))
        .fetch_one(pool)
        .await
        .with_context(|| format!("reading {name}'s parked and held tables"))?;
        out.push((name, parked, held, reason));
    }
    Ok(out)
}

async fn settle(
    pool: &PgPool,
    js: &jetstream::Context,
    stream: &str,
    what: &str,
) -> anyhow::Result<()> {
    anyhow::ensure!(
        // The rollout runs the three built-in projections only (old and new binaries of each).
        wait_for(
            || settled(pool, js, stream, &PROJECTIONS),
            Duration::from_secs(60)
        )
        .await,
        "{what}: the outbox and the projections did not settle within 60 s"
    );
    Ok(())
}

/// Tells the story; `Ok` only when every projection agrees with the event store at the end.
pub(super) async fn tell(
    wiring: &Wiring,
    pool: &PgPool,
    js: &jetstream::Context,
    started: Instant,
) -> anyhow::Result<()> {
    let mut processes = Processes::new(wiring)?;
    let outcome = story(&mut processes, pool, js, started).await;
    let logs = processes.stop_all().await;
    println!("           service logs: {}", logs.display());
    outcome
}

async fn story(
    processes: &mut Processes,
    pool: &PgPool,
    js: &jetstream::Context,
    started: Instant,
) -> anyhow::Result<()> {
    let stream = processes.wiring.stream.clone();

    // 1. Expand: everything old. Writers write v2; readers know v2.
    processes.start_relay()?;
    processes.start_projections(true)?;
    processes.start_api(true)?;
    processes.wait_healthy().await?;
    step(
        started,
        &format!(
            "old readers (inventory, points, search with --max-version {OLD}) and an old writer (waybill serve --write-version {OLD}) running, with a relay"
        ),
    );
    let api = processes.api()?;
    for i in 0..ORDERS {
        place_and_pay(&api, i, "web").await?;
    }
    let refused = api
        .expect(
            "/orders",
            &order(0, "store"),
            StatusCode::UNPROCESSABLE_ENTITY,
        )
        .await
        .context("a store order written as v2 must be refused")?;
    settle(pool, js, &stream, "phase 1").await?;
    let versions = placed_versions(pool).await?;
    anyhow::ensure!(
        versions == [(2, ORDER_ROWS)],
        "expected {ORDERS} order.placed v2, found {versions:?}"
    );
    let waits = waiting(pool).await?;
    anyhow::ensure!(
        waits.iter().all(|w| w.1 == 0 && w.2 == 0),
        "old readers parked or held v2 events: {waits:?}"
    );
    step(
        started,
        &format!(
            "{ORDERS} web orders placed and paid, stored as order.placed v2 (checked), applied by the old readers (nothing parked or held); a store order was refused 422: {}",
            refused["detail"].as_str().unwrap_or_default()
        ),
    );

    // 2. The writer moves to v3 before the readers do.
    processes.stop_api().await;
    processes.start_api(false)?;
    processes.wait_healthy().await?;
    let api = processes.api()?;
    let channels = ["store", "app", "phone", "marketplace", "web"];
    for i in 0..ORDERS {
        place_and_pay(&api, ORDERS + i, channels[i % channels.len()]).await?;
    }
    settle(pool, js, &stream, "phase 2").await?;
    // The current version: v3 when this story was written, whatever is current now.
    let current = domain::event::current_version(domain::OrderEvent::PLACED)
        .context("order.placed has a current version")?;
    let versions = placed_versions(pool).await?;
    anyhow::ensure!(
        versions == [(2, ORDER_ROWS), (current, ORDER_ROWS)],
        "expected {ORDERS} order.placed v2 and {ORDERS} v{current}, found {versions:?}"
    );
    let waits = waiting(pool).await?;
    for (name, parked, held, _) in &waits {
        anyhow::ensure!(
            *parked == ORDER_ROWS && *held == ORDER_ROWS,
            "{name} should park the {ORDERS} v3 orders and hold their {ORDERS} payments; it parked {parked} and holds {held}"
        );
    }
    step(
        started,
        &format!(
            "writer upgraded first (plain waybill serve): {ORDERS} orders stored as order.placed v{current} (checked); each old reader parked all {ORDERS} (\"{}\") and holds their {ORDERS} payments — nothing lost, nothing applied out of order",
            waits[0].3.as_deref().unwrap_or_default()
        ),
    );

    // 3. Readers upgraded: restarted without the flag, then redrive.
    processes.stop_projections().await;
    processes.start_projections(false)?;
    processes.wait_healthy().await?;
    for name in PROJECTIONS {
        redrive(&processes.wiring, &processes.logs, name).await?;
    }
    settle(pool, js, &stream, "phase 3").await?;
    let waits = waiting(pool).await?;
    anyhow::ensure!(
        waits.iter().all(|w| w.1 == 0 && w.2 == 0),
        "after the redrive something still waits: {waits:?}"
    );
    step(
        started,
        "readers upgraded (restarted without --max-version) and redriven: every parked v3 order applied, and the payments held behind them with it (checked: nothing parked or held)",
    );

    // 4. The verdict.
    let expected = verify::expected(pool).await?;
    let projected = verify::projected(&processes.reads).await?;
    let disagreements = verify::report(&expected, &projected);
    anyhow::ensure!(
        disagreements == 0,
        "{disagreements} disagreement(s) between the projections and the event store"
    );
    println!(
        "\nall three projections agree with the event store after the rollout ({:.1} s)",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// `waybill-<name> --json redrive`, as an operator runs it after the upgrade.
async fn redrive(wiring: &Wiring, logs: &Path, name: &str) -> anyhow::Result<()> {
    let mut env = wiring.env();
    env.push(("WAYBILL_OPERATOR".to_owned(), "waybill-demo".to_owned()));
    let stdout = Launch {
        program: &binary(&format!("waybill-{name}"))?,
        args: &["--json".to_owned(), "redrive".to_owned()],
        env: &env,
        clear_env: false,
        unset: &[],
        name: &format!("{name}-redrive"),
    }
    .output(logs)
    .await?;
    let report: Value = serde_json::from_slice(&stdout).context("redrive's JSON")?;
    let still = report["redriven"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|r| r["outcome"] == "parked")
        .count();
    anyhow::ensure!(
        still == 0,
        "waybill-{name} redrive left {still} message(s) parked: {report}"
    );
    Ok(())
}
