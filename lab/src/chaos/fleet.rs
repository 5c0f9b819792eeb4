//! The system under test, as real processes on the private servers of [`super::servers`]: the order
//! service, two relays, the three projections and every read model of the
//! registry (`waybill-projection <name> run`; with `--cluster`, each projection and model in two
//! partition instances), each a child process the harness can kill, freeze, thaw and restart — and
//! restarts by itself when one exits on its own, as a supervisor would.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use rustix::process::Signal;
use serde::Serialize;
use tokio::process::Child;
use tokio::sync::Mutex;

use super::RelaySource;
use super::servers::Servers;
use crate::http::Http;
use crate::process::{self, Launch, peak_rss_kib, strings};

/// The projections, by binary suffix; each consumes through the durable consumer of the same name
/// (with partitions, `<name>-p<K>of<P>`).
pub(super) const PROJECTIONS: [&str; 3] = ["inventory", "points", "search"];
/// Partitions of each projection with `--cluster`, one instance per partition.
pub(super) const CLUSTER_PARTITIONS: u32 = 2;
/// The relays' claim timeout, shortened (from 30 s) so that a frozen relay outlives it within seconds.
pub(super) const CLAIM_TIMEOUT: Duration = Duration::from_secs(4);
/// JetStream's dedupe window, shortened (from 2 min) for the same reason: a zombie relay that wakes up
/// after it can only be stopped by the broker fence.
pub(super) const DEDUPE_WINDOW: Duration = Duration::from_secs(3);

/// Where each binary is.
#[derive(Debug, Clone)]
pub(super) struct Binaries {
    waybill: PathBuf,
    relay: PathBuf,
    console: PathBuf,
    projections: PathBuf,
}

impl Binaries {
    /// Checks that every binary is in `dir` (the projections in `projections`, when given).
    pub(super) fn find(dir: &Path, projections: Option<&Path>) -> anyhow::Result<Self> {
        let projections = projections.unwrap_or(dir).to_path_buf();
        let mut wanted = vec![
            dir.join("waybill"),
            dir.join("waybill-relay"),
            dir.join("waybill-console"),
        ];
        wanted.extend(PROJECTIONS.map(|p| projections.join(format!("waybill-{p}"))));
        for path in &wanted {
            anyhow::ensure!(
                path.is_file(),
                "{} is missing: build every binary first (`cargo build --workspace --bins`) or point \
                 --binaries at them",
                path.display()
            );
        }
        Ok(Self {
            waybill: dir.join("waybill"),
            relay: dir.join("waybill-relay"),
            console: dir.join("waybill-console"),
            projections,
        })
    }
}

/// What a process is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Role {
    /// `waybill serve`.
    OrderService,
    /// `waybill-relay run`.
    Relay,
    /// `waybill-<projection> run`.
    Projection,
    /// `waybill-console run`: there for an operator to watch the run; no fault aims at it.
    Console,
}

/// One supervised child process.
#[derive(Debug)]
struct Process {
    name: String,
    role: Role,
    program: PathBuf,
    args: Vec<String>,
    child: Option<Child>,
    frozen: bool,
    /// Killed by the harness, to be restarted by it: the supervisor leaves it alone meanwhile.
    held_down: bool,
    restarts: u32,
    unexpected_exits: u32,
    peak_rss_kib: u64,
}

impl Process {
    /// A process not started yet.
    fn new(name: &str, role: Role, program: &Path, args: Vec<String>) -> Self {
        Self {
            name: name.to_owned(),
            role,
            program: program.to_path_buf(),
            args,
            child: None,
            frozen: false,
            held_down: false,
            restarts: 0,
            unexpected_exits: 0,
            peak_rss_kib: 0,
        }
    }
}

/// How a process fared, for the report.
#[derive(Debug, Clone, Serialize)]
pub(super) struct ProcessSummary {
    /// Its name, e.g. `relay-1`.
    pub name: String,
    /// Highest resident memory of any of its incarnations, in MiB (VmHWM).
    pub peak_rss_mib: f64,
    /// Restarts after faults.
    pub restarts: u32,
    /// Times it exited without being killed (each restarted by the harness).
    pub unexpected_exits: u32,
}

/// The system under test as running child processes, each supervised and restarted if it exits on
/// its own, with the private servers they use.
#[derive(Debug)]
pub(super) struct Fleet {
    binaries: Binaries,
    processes: Mutex<Vec<Process>>,
    api_url: String,
    /// The console's base URL (pages under `/console`).
    console_url: String,
    logs: PathBuf,
    env: Vec<(String, String)>,
    /// Partitions of each projection (1: one instance, the consumer named after it).
    partitions: u32,
}

impl Fleet {
    /// Creates the schema (`waybill migrate`), then starts every process and waits until each answers
    /// its health check. Both relays read by `relay_source`. `broken_checkpoint` starts the
    /// projections with their checkpoint check broken on purpose (proving that the verdict catches
    /// it).
    pub(super) async fn start(
        binaries: Binaries,
        servers: &Servers,
        stream: &str,
        subject_prefix: &str,
        relay_source: RelaySource,
        broken_checkpoint: bool,
    ) -> anyhow::Result<Self> {
        let cluster = servers.nats_nodes > 1;
        let partitions = if cluster { CLUSTER_PARTITIONS } else { 1 };
        // Kept after the run: the report points at it.
        let logs = tempfile::Builder::new()
            .prefix("waybill-chaos-logs-")
            .tempdir()?
            .keep();
        // The children get this environment and nothing else from ours: a WAYBILL_LISTEN or NATS
        // credentials meant for another system must not reach them.
        let mut env = vec![
            ("PATH".to_owned(), std::env::var("PATH").unwrap_or_default()),
            ("DATABASE_URL".to_owned(), servers.database_url.clone()),
            ("NATS_URL".to_owned(), servers.nats_url.clone()),
            ("WAYBILL_STREAM".to_owned(), stream.to_owned()),
            (
                "WAYBILL_SUBJECT_PREFIX".to_owned(),
                subject_prefix.to_owned(),
            ),
            (
                "RUST_LOG".to_owned(),
                "info,sqlx=warn,async_nats=warn".to_owned(),
            ),
        ];
        if broken_checkpoint {
            env.push((
                projections::plan::BREAK_CHECKPOINT_VAR.to_owned(),
                projections::plan::BREAK_CHECKPOINT_CONSENT.to_owned(),
            ));
        }
        run_once(&binaries.waybill, &["migrate"], "migrate", &env, &logs).await?;
        // The stream, once, before two relays start: each then only verifies it.
        let window = humantime::format_duration(DEDUPE_WINDOW).to_string();
        let replicas = servers.nats_nodes.to_string();
        let split = CLUSTER_PARTITIONS.to_string();
        let mut provision = vec!["provision", "--duplicate-window", &window];
        if cluster {
            // Three replicas: the stream stays writable while one node is down. Split by the
            // server into the projections' partitions: each partition's consumer is delivered its
            // own events only, and the fence works on the stored (partitioned) subjects.
            provision.extend(["--replicas", &replicas, "--stream-partitions", &split]);
        }
        run_once(&binaries.relay, &provision, "provision", &env, &logs).await?;

        // The read models of projections/src/models/ run through one binary beside the projections'.
        let kit = binaries.projections.join("waybill-projection");
        anyhow::ensure!(
            kit.is_file() || projections::registry::MODELS.is_empty(),
            "{} is missing: build every binary first (`cargo build --workspace --bins`)",
            kit.display()
        );
        // Every listening port chosen at once, so that no two processes are handed the same one.
        let instances =
            (PROJECTIONS.len() + projections::registry::MODELS.len()) * partitions as usize;
        let mut ports = testkit::free_ports(2 + 2 + 1 + instances)?.into_iter();
        let mut next_port = move || ports.next().context("more processes than ports chosen");
        let api_port = next_port()?;
        let mut health = Vec::new();
        let mut processes = Vec::new();
        let mut add = |name: &str, role: Role, program: &Path, mut args: Vec<String>| {
            let metrics = next_port()?;
            args.extend([
                "--metrics-listen".to_owned(),
                format!("127.0.0.1:{metrics}"),
            ]);
            health.push((
                name.to_owned(),
                format!("http://127.0.0.1:{metrics}/health"),
            ));
            processes.push(Process::new(name, role, program, args));
            anyhow::Ok(())
        };
        add(
            "order-service",
            Role::OrderService,
            &binaries.waybill.clone(),
            strings(&["serve", "--listen", &format!("127.0.0.1:{api_port}")]),
        )?;
        for relay in ["relay-1", "relay-2"] {
            add(
                relay,
                Role::Relay,
                &binaries.relay,
                strings(&[
                    "run",
                    "--relay-id",
                    &format!("chaos-{relay}"),
                    // Shortened so that a frozen relay outlives both within seconds, as the
                    // zombie-relay fault needs; retries are quicker and more patient in proportion.
                    "--claim-idle-timeout",
                    &humantime::format_duration(CLAIM_TIMEOUT).to_string(),
                    "--duplicate-window",
                    &humantime::format_duration(DEDUPE_WINDOW).to_string(),
                    "--backoff",
                    "250ms,500ms,1s,2s",
                    "--max-attempts",
                    "200",
                    "--poll-interval",
                    "200ms",
                    // With wal: one relay reads the slot, the other stands by; both poll-drain
                    // before each session.
                    "--source",
                    relay_source.name(),
                ]),
            )?;
        }
        // A killed projection's unacknowledged messages come back after the ack wait.
        let run_args = strings(&["run", "--ack-wait", "5s"]);
        let mut launches = Vec::new();
        for projection in PROJECTIONS {
            // A broken checkpoint takes the faulty twin (`waybill-projection-faulty NAME …`): the
            // projection binaries have no fault flag.
            let (program, projection_args) = if broken_checkpoint {
                let (twin, ignore_checkpoint) = projections::cli::CHECKPOINT_BREAKING_TWIN
                    .context(
                        "--broken-checkpoint needs the projections' testing twin, which this build \
                     lacks: build with `--features lab/fault-injection`",
                    )?;
                let twin = binaries.projections.join(twin);
                anyhow::ensure!(
                    twin.is_file(),
                    "{} is missing: build the testing twins first (`cargo build --workspace --bins \
                     --features lab/fault-injection`)",
                    twin.display()
                );
                let mut args = vec![projection.to_owned()];
                args.extend(run_args.iter().cloned());
                args.push(ignore_checkpoint.to_owned());
                (twin, args)
            } else {
                let program = binaries.projections.join(format!("waybill-{projection}"));
                (program, run_args.clone())
            };
            launches.push((projection, program, projection_args));
        }
        // Every read model of the registry, as `waybill-projection NAME run` (the broken checkpoint
        // is the built-in projections' alone).
        for model in projections::registry::MODELS {
            let args = [vec![model.name().to_owned()], run_args.clone()].concat();
            launches.push((model.name(), kit.clone(), args));
        }
        for (projection, program, mut projection_args) in launches {
            if partitions == 1 {
                add(
                    projection,
                    Role::Projection,
                    &program,
                    std::mem::take(&mut projection_args),
                )?;
                continue;
            }
            // As many instances as partitions, sharing them through leases (no list: each takes its
            // share, and a killed or frozen one's partitions move to the other).
            for partition in 0..partitions {
                let mut args = projection_args.clone();
                args.extend([
                    "--partitions".to_owned(),
                    partitions.to_string(),
                    "--lease-time".to_owned(),
                    "3s".to_owned(),
                ]);
                add(
                    &format!("{projection}-p{partition}"),
                    Role::Projection,
                    &program,
                    args,
                )?;
            }
        }
        // The console on its own address, answering /health there.
        let console_port = next_port()?;
        let console_url = format!("http://127.0.0.1:{console_port}");
        health.push(("console".to_owned(), format!("{console_url}/health")));
        processes.push(Process::new(
            "console",
            Role::Console,
            &binaries.console,
            strings(&["run", "--listen", &format!("127.0.0.1:{console_port}")]),
        ));
        let fleet = Self {
            binaries,
            processes: Mutex::new(processes),
            api_url: format!("http://127.0.0.1:{api_port}"),
            console_url,
            logs,
            env,
            partitions,
        };
        {
            let mut processes = fleet.processes.lock().await;
            for process in processes.iter_mut() {
                fleet.spawn(process)?;
            }
        }
        fleet.wait_healthy(&health).await?;
        Ok(fleet)
    }

    /// Runs `waybill-<projection> ARGS` on the run's database and parses what it prints as JSON.
    pub(super) async fn projection_json(
        &self,
        projection: &str,
        args: &[&str],
    ) -> anyhow::Result<serde_json::Value> {
        let program = self
            .binaries
            .projections
            .join(format!("waybill-{projection}"));
        let args = strings(args);
        let stdout = Launch {
            program: &program,
            args: &args,
            env: &self.env,
            clear_env: true,
            unset: &[],
            name: &format!("{projection}-{}", args.join("-")),
        }
        .output(&self.logs)
        .await?;
        serde_json::from_slice(&stdout)
            .with_context(|| format!("waybill-{projection} {} printed no JSON", args.join(" ")))
    }

    /// Partitions of each projection (1 without `--cluster`).
    pub(super) fn partitions(&self) -> u32 {
        self.partitions
    }

    /// Every projection's durable consumers (the read models' too), by projection: the one named
    /// after it, or one per partition (`<name>-p<K>of<P>`).
    pub(super) fn consumers(&self) -> Vec<(&'static str, String)> {
        // With partitions the stream is split by the server (see `start`): their consumers' names.
        let layout = projections::Partitions::new(self.partitions, &[])
            .unwrap_or_else(|_| projections::Partitions::single())
            .split_by_server();
        projections::registry::names()
            .into_iter()
            .flat_map(|projection| {
                let layout = layout.clone();
                (0..layout.count()).map(move |k| (projection, layout.consumer_name(projection, k)))
            })
            .collect()
    }

    /// The order service's base URL.
    pub(super) fn api_url(&self) -> String {
        self.api_url.clone()
    }

    /// The console's base URL.
    pub(super) fn console_url(&self) -> &str {
        &self.console_url
    }

    /// Where the processes' logs are.
    pub(super) fn logs(&self) -> &Path {
        &self.logs
    }

    /// The names of the processes with this role.
    pub(super) async fn names(&self, role: Role) -> Vec<String> {
        let processes = self.processes.lock().await;
        processes
            .iter()
            .filter(|p| p.role == role)
            .map(|p| p.name.clone())
            .collect()
    }

    /// SIGKILLs `name`, waits `down`, and starts it again.
    pub(super) async fn kill_and_restart(&self, name: &str, down: Duration) -> anyhow::Result<()> {
        {
            let mut processes = self.processes.lock().await;
            let process = find(&mut processes, name)?;
            if let Some(mut child) = process.child.take() {
                if let Some(pid) = child.id() {
                    process.peak_rss_kib = process.peak_rss_kib.max(peak_rss_kib(pid));
                }
                let _ = child.start_kill();
                let _ = child.wait().await;
            }
            process.held_down = true;
        }
        tokio::time::sleep(down).await;
        let mut processes = self.processes.lock().await;
        let process = find(&mut processes, name)?;
        process.restarts += 1;
        // Should the start fail, the supervisor tries again.
        process.held_down = false;
        self.spawn(process)
    }

    /// SIGSTOPs `name` for `frozen`, then SIGCONTs it: the process is not dead, only silent.
    pub(super) async fn freeze(&self, name: &str, frozen: Duration) -> anyhow::Result<()> {
        self.signal(name, Signal::STOP, true).await?;
        tokio::time::sleep(frozen).await;
        self.signal(name, Signal::CONT, false).await
    }

    async fn signal(&self, name: &str, signal: Signal, frozen: bool) -> anyhow::Result<()> {
        let mut processes = self.processes.lock().await;
        let process = find(&mut processes, name)?;
        let child = process
            .child
            .as_ref()
            .with_context(|| format!("{name} is not running"))?;
        anyhow::ensure!(
            process::signal(child, signal),
            "{name} could not be signalled: it is not running"
        );
        process.frozen = frozen;
        Ok(())
    }

    /// Restarts every process that exited on its own (counted), and records resident memory.
    pub(super) async fn supervise(&self) {
        let mut processes = self.processes.lock().await;
        for process in processes.iter_mut().filter(|p| !p.held_down) {
            let exited = match process.child.as_mut().map(Child::try_wait) {
                Some(Ok(Some(status))) => Some(status.to_string()),
                Some(Err(error)) => Some(error.to_string()),
                Some(Ok(None)) => None,
                None => Some("not running".to_owned()),
            };
            if let Some(status) = exited {
                tracing::warn!(process = %process.name, %status, "exited on its own; restarting it");
                process.unexpected_exits += 1;
                process.child = None;
                if let Err(error) = self.spawn(process) {
                    tracing::error!(process = %process.name, error = format!("{error:#}"), "cannot restart");
                }
                continue;
            }
            if let Some(pid) = process.child.as_ref().and_then(Child::id) {
                process.peak_rss_kib = process.peak_rss_kib.max(peak_rss_kib(pid));
            }
        }
    }

    /// Stops every process (thawing frozen ones first): SIGTERM, then SIGKILL after 15 s.
    pub(super) async fn stop_all(&self) -> Vec<ProcessSummary> {
        let mut processes = self.processes.lock().await;
        for process in processes.iter_mut() {
            let Some(child) = process.child.as_ref() else {
                continue;
            };
            if let Some(pid) = child.id() {
                process.peak_rss_kib = process.peak_rss_kib.max(peak_rss_kib(pid));
            }
            // A frozen process cannot act on SIGTERM: thawed first.
            if process.frozen {
                process::signal(child, Signal::CONT);
            }
        }
        let mut running: Vec<(String, Child)> = processes
            .iter_mut()
            .filter_map(|p| Some((p.name.clone(), p.child.take()?)))
            .collect();
        process::stop_all(
            running
                .iter_mut()
                .map(|(name, child)| (name.as_str(), child)),
            process::GRACE,
        )
        .await;
        processes
            .iter()
            .map(|p| ProcessSummary {
                name: p.name.clone(),
                peak_rss_mib: (p.peak_rss_kib as f64 / 102.4).round() / 10.0,
                restarts: p.restarts,
                unexpected_exits: p.unexpected_exits,
            })
            .collect()
    }

    fn spawn(&self, process: &mut Process) -> anyhow::Result<()> {
        let child = Launch {
            program: &process.program,
            args: &process.args,
            env: &self.env,
            clear_env: true,
            unset: &[],
            name: &process.name,
        }
        .spawn(&self.logs)?;
        process.child = Some(child);
        process.frozen = false;
        process.held_down = false;
        Ok(())
    }

    async fn wait_healthy(&self, health: &[(String, String)]) -> anyhow::Result<()> {
        let client = Http::with_timeout(Duration::from_secs(2));
        for (name, url) in health {
            let mut healthy = false;
            for _ in 0..600 {
                if client.answers(url).await {
                    healthy = true;
                    break;
                }
                {
                    let mut processes = self.processes.lock().await;
                    let process = find(&mut processes, name)?;
                    if let Some(Ok(Some(status))) = process.child.as_mut().map(Child::try_wait) {
                        anyhow::bail!(
                            "{name} exited with {status} at start; its log is {}",
                            self.logs.join(format!("{name}.log")).display()
                        );
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            anyhow::ensure!(healthy, "{name} did not become healthy within 60 s");
        }
        Ok(())
    }
}

fn find<'a>(processes: &'a mut [Process], name: &str) -> anyhow::Result<&'a mut Process> {
    processes
        .iter_mut()
        .find(|p| p.name == name)
        .with_context(|| format!("no process named {name}"))
}

/// Runs a one-off command of the system (`migrate`, `provision`) to its end, with standard error in
/// `<name>.log` under `logs`; failing when it fails.
async fn run_once(
    binary: &Path,
    args: &[&str],
    name: &str,
    env: &[(String, String)],
    logs: &Path,
) -> anyhow::Result<()> {
    let args = strings(args);
    Launch {
        program: binary,
        args: &args,
        env,
        clear_env: true,
        unset: &[],
        name,
    }
    .output(logs)
    .await
    .map(drop)
}
