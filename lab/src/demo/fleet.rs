//! The demo's services: the order service, the console, the relay, the three built-in projections
//! and every read model of the registry (`projections/src/models/`), either as separate processes (the
//! real shape) or as tasks in this process, each serving HTTP on a free port. A read model runs as
//! `waybill-projection <name> run`; as a task it is that same command line's `main`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use projections::{Inventory, Points, Projection, Runner, RunnerConfig, Search};
use relay::{Relay, RelayConfig, StreamSettings};
use store::{EventStore, GroupCommit, OutboxNotifier};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::http::Http;
use crate::process::{self, Launch, binary, strings};

/// The order service's name among the processes (and, spaces as dashes, its log file's).
const ORDER_SERVICE: &str = "order service";

/// The console's name among the processes.
const CONSOLE: &str = "waybill-console";

/// The relay that keeps running after the crash window; the demo checks that it settled the row the
/// crashed relay had published.
pub(crate) const RELAY_ID: &str = "demo-relay";

/// Where everything reads and writes.
#[derive(Debug, Clone)]
pub(crate) struct Wiring {
    /// The demo's database.
    pub database_url: String,
    /// NATS.
    pub nats_url: String,
    /// The demo's stream.
    pub stream: String,
    /// Its subject prefix.
    pub subject_prefix: String,
    /// `RUST_LOG` of the processes (the demo's are chatty; the bench's must not pay for logging).
    pub log_filter: &'static str,
    /// Run the registry's read models beside the three built-in projections (the demo does; the
    /// bench measures the shipped pipeline without them).
    pub read_models: bool,
}

impl Wiring {
    /// The environment that wires a process of the fleet to the demo's database, NATS and stream.
    pub(crate) fn env(&self) -> Vec<(String, String)> {
        [
            ("DATABASE_URL", self.database_url.as_str()),
            ("NATS_URL", &self.nats_url),
            ("WAYBILL_STREAM", &self.stream),
            ("WAYBILL_SUBJECT_PREFIX", &self.subject_prefix),
            ("RUST_LOG", self.log_filter),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
    }

    /// Starts the fleet's `program` as process `name` with `args`, wired by the environment, its
    /// log under `logs`.
    pub(crate) fn spawn(
        &self,
        program: &str,
        name: &str,
        args: &[String],
        logs: &std::path::Path,
    ) -> anyhow::Result<tokio::process::Child> {
        Launch {
            program: &binary(program)?,
            args,
            env: &self.env(),
            clear_env: false,
            unset: &[],
            name,
        }
        .spawn(logs)
    }
}

/// The registry's read models the fleet runs: all of them, or none.
fn read_models(wiring: &Wiring) -> &'static [&'static dyn projections::kit::Model] {
    if wiring.read_models {
        projections::registry::MODELS
    } else {
        &[]
    }
}

/// The demo's log filter: every request and step, libraries only when something is wrong.
pub(crate) const DEMO_LOG_FILTER: &str = "info,sqlx=warn,async_nats=warn";

/// Running services and their HTTP addresses.
#[derive(Debug)]
pub(crate) struct Fleet {
    /// The order service's base URL.
    pub api: String,
    /// The console's base URL (its pages are under `/console`).
    pub console: String,
    /// Each projection's name and the base URL of its read API (the read models' too: their
    /// `GET /state`).
    pub reads: Vec<(&'static str, String)>,
    /// Base URLs answering `/health`: the order service's, the console's, and each projection
    /// process's metrics address (the read APIs serve no `/health`).
    health: Vec<String>,
    /// URLs that answer 2xx once a service runs that has no `/health` to ask: a read model run as a
    /// task serves its read API only (its metrics would need a second recorder in this process).
    ready: Vec<String>,
    wiring: Wiring,
    running: Running,
}

#[derive(Debug)]
enum Running {
    Tasks {
        stop: watch::Sender<bool>,
        tasks: Vec<JoinHandle<()>>,
        /// The read models' command lines, run to the end: they stop on SIGTERM/Ctrl-C, as their
        /// process would, so the fleet aborts them when it stops.
        models: Vec<(&'static str, JoinHandle<std::process::ExitCode>)>,
    },
    Processes {
        children: Vec<(String, tokio::process::Child)>,
        logs: PathBuf,
    },
}

impl Fleet {
    /// Starts the order service and the projections (the relay comes later, after the crash window).
    pub(crate) async fn start(processes: bool, wiring: Wiring) -> anyhow::Result<Self> {
        let mut fleet = if processes {
            Self::start_processes(wiring).await?
        } else {
            Self::start_tasks(wiring).await?
        };
        fleet.wait_healthy().await?;
        Ok(fleet)
    }

    async fn start_tasks(wiring: Wiring) -> anyhow::Result<Self> {
        let (stop, watcher) = watch::channel(false);
        let stopped = move || {
            let mut watcher = watcher.clone();
            async move {
                let _ = watcher.wait_for(|stop| *stop).await;
            }
        };
        let mut tasks = Vec::new();
        let pool = ops::database::connect(&wiring.database_url, "waybill-demo-api", 8).await?;
        let store = EventStore::new(pool.clone())
            .with_group_commit(GroupCommit::spawn(
                pool.clone(),
                GroupCommit::DEFAULT_WRITERS.into(),
            ))
            .with_notifier(OutboxNotifier::spawn(pool, Duration::from_millis(5)));
        let telemetry = ops::telemetry_routes(
            ops::install_metrics_recorder()?,
            std::sync::Arc::new(|| Box::pin(async { (true, serde_json::json!({})) })),
        );
        let api = ops::serve(
            local(),
            // Inside the demo the API and its telemetry share one listener; `waybill serve` keeps them apart.
            waybill::http::router(store).merge(telemetry.clone()),
            stopped(),
        )
        .await?;
        // The console as `waybill-console run` serves it, only reading (no operator token).
        let console = waybill_console::router(
            waybill_console::Database::connect(&wiring.database_url, false).await?,
            waybill_console::ConsoleConfig {
                nats: Some(wiring.nats_url.as_str().into()),
                stream: wiring.stream.clone(),
                subject_prefix: wiring.subject_prefix.clone(),
                operator_token: None,
                relay_metrics: Vec::new(),
                projection_apis: Vec::new(),
            },
        );
        let console = ops::serve(local(), console, stopped()).await?;
        let config = RunnerConfig {
            stream: wiring.stream.clone(),
            subject_prefix: wiring.subject_prefix.clone(),
            ..RunnerConfig::default()
        };
        let mut reads = Vec::new();
        macro_rules! projection {
            ($projection:expr, $routes:path) => {{
                let runner = Runner::connect(
                    $projection,
                    &wiring.database_url,
                    &wiring.nats_url,
                    config.clone(),
                )
                .await?;
                // The read API alone: metrics and health live on their own address.
                let routes = $routes(runner.pool().clone());
                let address = ops::serve(local(), routes, stopped()).await?;
                reads.push((name_of(&$projection), format!("http://{address}")));
                let shutdown = stopped();
                tasks.push(tokio::spawn(async move {
                    if let Err(error) = runner.run(shutdown, false, |_| {}).await {
                        tracing::error!(error = %ops::error_chain(&error), "projection task failed");
                    }
                }));
            }};
        }
        projection!(Inventory, projections::inventory::routes);
        projection!(Points, projections::points::routes);
        projection!(Search, projections::search::routes);
        let mut models = Vec::new();
        let mut ready = Vec::new();
        for model in read_models(&wiring) {
            let port = testkit::free_port()?;
            let mut args = vec![format!("waybill-projection {}", model.name())];
            args.extend(model_wiring(&wiring));
            args.extend(["run".to_owned(), "--listen".to_owned()]);
            args.push(format!("127.0.0.1:{port}"));
            models.push((model.name(), tokio::spawn(model.main(args))));
            reads.push((model.name(), format!("http://127.0.0.1:{port}")));
            ready.push(format!("http://127.0.0.1:{port}/state"));
        }
        Ok(Self {
            api: format!("http://{api}"),
            console: format!("http://{console}"),
            reads,
            health: vec![format!("http://{api}"), format!("http://{console}")],
            ready,
            wiring,
            running: Running::Tasks {
                stop,
                tasks,
                models,
            },
        })
    }

    async fn start_processes(wiring: Wiring) -> anyhow::Result<Self> {
        // Kept after the run: stopping the demo hands back where its logs are.
        let logs = tempfile::Builder::new()
            .prefix("waybill-demo-logs-")
            .tempdir()?
            .keep();
        let mut children = Vec::new();
        let api_port = testkit::free_port()?;
        let api_metrics_port = testkit::free_port()?;
        let serve = strings(&[
            "serve",
            "--listen",
            &format!("127.0.0.1:{api_port}"),
            "--metrics-listen",
            &format!("127.0.0.1:{api_metrics_port}"),
        ]);
        children.push((
            ORDER_SERVICE.to_owned(),
            wiring.spawn("waybill", ORDER_SERVICE, &serve, &logs)?,
        ));
        // The console on an address of its own; it answers /health there.
        let console_port = testkit::free_port()?;
        let console = strings(&["run", "--listen", &format!("127.0.0.1:{console_port}")]);
        children.push((
            CONSOLE.to_owned(),
            wiring.spawn(CONSOLE, CONSOLE, &console, &logs)?,
        ));
        let mut reads = Vec::new();
        // The order service answers /health on its metrics listener.
        let mut health = vec![
            format!("http://127.0.0.1:{api_metrics_port}"),
            format!("http://127.0.0.1:{console_port}"),
        ];
        // The built-in projections (`waybill-NAME run`), then every read model of the registry
        // (`waybill-projection NAME run`), all wired alike (by the environment).
        let built_in = [Inventory::NAME, Points::NAME, Search::NAME]
            .map(|name| (name, format!("waybill-{name}"), Vec::new()));
        let models = read_models(&wiring).iter().map(|model| {
            let name = model.name();
            (name, "waybill-projection".to_owned(), vec![name])
        });
        for (name, program, command_words) in built_in.into_iter().chain(models) {
            let process = if command_words.is_empty() {
                program.clone()
            } else {
                format!("{program}-{name}")
            };
            let (port, metrics_port) = (testkit::free_port()?, testkit::free_port()?);
            let mut args = strings(&command_words);
            args.extend(strings(&[
                "run",
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--metrics-listen",
                &format!("127.0.0.1:{metrics_port}"),
            ]));
            health.push(format!("http://127.0.0.1:{metrics_port}"));
            children.push((
                process.clone(),
                wiring.spawn(&program, &process, &args, &logs)?,
            ));
            reads.push((name, format!("http://127.0.0.1:{port}")));
        }
        Ok(Self {
            api: format!("http://127.0.0.1:{api_port}"),
            console: format!("http://127.0.0.1:{console_port}"),
            reads,
            health,
            ready: Vec::new(),
            wiring,
            running: Running::Processes { children, logs },
        })
    }

    /// Each process's name and id (none when the services run as tasks).
    pub(crate) fn pids(&self) -> Vec<(String, u32)> {
        match &self.running {
            Running::Processes { children, .. } => children
                .iter()
                .filter_map(|(name, child)| Some((name.clone(), child.id()?)))
                .collect(),
            Running::Tasks { .. } => Vec::new(),
        }
    }

    /// Where everything reads and writes.
    pub(crate) fn wiring(&self) -> &Wiring {
        &self.wiring
    }

    /// Reproduces the crash window once: a relay publishes, gets its PubAck, and dies before marking.
    /// In either shape it is the relay's testing twin, a process: the relay as installed has no
    /// fault flag (and this program no fail point). Refused by a build without the twin.
    pub(crate) async fn crash_a_relay(&self) -> anyhow::Result<()> {
        let (twin, crash_after_publish) = relay::app::CRASHING_TWIN.context(
            "the crash window needs the relay's testing twin, which this build lacks: build with \
             `--features lab/fault-injection` (scripts/demo does)",
        )?;
        let scratch;
        let logs = match &self.running {
            Running::Processes { logs, .. } => logs.as_path(),
            Running::Tasks { .. } => {
                scratch = tempfile::tempdir()?;
                scratch.path()
            }
        };
        let args = strings(&[
            "run",
            "--once",
            crash_after_publish,
            "--relay-id",
            "demo-relay-crashing",
        ]);
        let status = self
            .wiring
            .spawn(twin, "relay-crashing", &args, logs)?
            .wait()
            .await?;
        anyhow::ensure!(
            !status.success(),
            "the crashing relay did not crash{}",
            process::log_tail(logs, "relay-crashing")
        );
        Ok(())
    }

    /// Starts the relay that keeps running.
    pub(crate) async fn start_relay(&mut self) -> anyhow::Result<()> {
        let wiring = self.wiring.clone();
        let config = self.relay_config(RELAY_ID);
        match &mut self.running {
            Running::Tasks { stop, tasks, .. } => {
                let relay = Relay::connect(&wiring.database_url, &wiring.nats_url, config).await?;
                let mut watcher = stop.subscribe();
                tasks.push(tokio::spawn(async move {
                    relay
                        .run(async move {
                            let _ = watcher.wait_for(|stop| *stop).await;
                        })
                        .await;
                }));
            }
            Running::Processes { children, logs } => {
                let args = strings(&["run", "--relay-id", RELAY_ID, "--poll-interval", "200ms"]);
                children.push((
                    "waybill-relay".to_owned(),
                    wiring.spawn("waybill-relay", "waybill-relay", &args, logs)?,
                ));
            }
        }
        Ok(())
    }

    fn relay_config(&self, relay_id: &str) -> RelayConfig {
        RelayConfig {
            relay_id: relay_id.to_owned(),
            stream: StreamSettings {
                name: self.wiring.stream.clone(),
                subject_prefix: self.wiring.subject_prefix.clone(),
                ..StreamSettings::default()
            },
            poll_interval: Duration::from_millis(200),
            ..RelayConfig::default()
        }
    }

    async fn wait_healthy(&mut self) -> anyhow::Result<()> {
        let urls = self.health.iter().map(|base| format!("{base}/health"));
        for url in urls.chain(self.ready.iter().cloned()).collect::<Vec<_>>() {
            let running = &mut self.running;
            wait_for_url(&url, || match running {
                Running::Processes { children, logs } => process::first_exited(
                    children
                        .iter_mut()
                        .map(|(name, child)| (name.as_str(), child)),
                    logs,
                ),
                Running::Tasks { models, .. } => ended(models),
            })
            .await?;
        }
        Ok(())
    }

    /// Stops everything gracefully (SIGTERM for processes) and returns where the logs are, if any.
    pub(crate) async fn stop(self) -> Option<PathBuf> {
        match self.running {
            Running::Tasks {
                stop,
                tasks,
                models,
            } => {
                for (_, model) in &models {
                    model.abort();
                }
                let _ = stop.send(true);
                for task in tasks {
                    let _ = tokio::time::timeout(Duration::from_secs(15), task).await;
                }
                None
            }
            Running::Processes { mut children, logs } => {
                process::stop_all(
                    children
                        .iter_mut()
                        .map(|(name, child)| (name.as_str(), child)),
                    process::GRACE,
                )
                .await;
                Some(logs)
            }
        }
    }
}

/// Waits up to 30 s for `base`/health to answer 2xx; `alive` is asked before each try and ends the
/// wait with its error (a process that exited will never answer).
pub(super) async fn wait_for_health(
    base: &str,
    alive: impl FnMut() -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    wait_for_url(&format!("{base}/health"), alive).await
}

/// [`wait_for_health`] of any URL.
async fn wait_for_url(
    url: &str,
    mut alive: impl FnMut() -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let client = Http::with_timeout(Duration::from_secs(2));
    for _ in 0..300 {
        alive()?;
        if client.answers(url).await {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    anyhow::bail!("{url} did not answer within 30 s")
}

/// An error naming the first read model task that has ended (it runs until it is stopped).
fn ended(models: &[(&'static str, JoinHandle<std::process::ExitCode>)]) -> anyhow::Result<()> {
    match models.iter().find(|(_, task)| task.is_finished()) {
        Some((name, _)) => anyhow::bail!(
            "the read model {name} stopped before serving (`waybill-projection {name} run`; its error is logged above)"
        ),
        None => Ok(()),
    }
}

/// The flags that wire a read model's command line to the demo's database, NATS and stream: in a
/// task, the environment of this process is not the demo's.
fn model_wiring(wiring: &Wiring) -> Vec<String> {
    [
        ("--database-url", &wiring.database_url),
        ("--nats-url", &wiring.nats_url),
        ("--stream", &wiring.stream),
        ("--subject-prefix", &wiring.subject_prefix),
    ]
    .into_iter()
    .flat_map(|(flag, value)| [flag.to_owned(), value.clone()])
    .collect()
}

fn local() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

fn name_of<P: Projection>(_: &P) -> &'static str {
    P::NAME
}
