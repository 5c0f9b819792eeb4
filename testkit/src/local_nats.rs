//! A private `nats-server` with JetStream on a free loopback port and its own store directory: each test
//! gets an independent broker it can stop and restart, and the demo gets one when none is running.

use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tempfile::TempDir;

/// A running (or stopped, restartable) private nats-server. Killed and cleaned up on drop.
#[derive(Debug)]
pub struct NatsServer {
    binary: PathBuf,
    port: u16,
    // Removed when the handle drops, after `Drop` has killed the server that writes into it.
    dir: TempDir,
    extra_args: Vec<String>,
    config: Option<String>,
    child: Option<Child>,
}

impl NatsServer {
    /// Starts a server on a free port with JetStream storing under a fresh temporary directory.
    pub fn start() -> anyhow::Result<Self> {
        Self::start_with(&[])
    }

    /// Like [`NatsServer::start`], with extra command-line arguments (e.g. `--max_payload`).
    pub fn start_with(extra_args: &[&str]) -> anyhow::Result<Self> {
        let binary = nats_server_binary().context(
            "nats-server is not installed: run scripts/install-nats-server (or set WAYBILL_NATS_SERVER)",
        )?;
        let port = free_port()?;
        let dir = tempfile::Builder::new()
            .prefix("waybill-nats-")
            .tempdir()
            .context("creating the nats-server's directory")?;
        let mut server = Self {
            binary,
            port,
            dir,
            extra_args: extra_args.iter().map(|s| s.to_string()).collect(),
            config: None,
            child: None,
        };
        server.resume()?;
        Ok(server)
    }

    /// A server on `port` with `extra_args`, not yet started ([`NatsServer::resume`] starts it): the
    /// nodes of a cluster must know each other's ports before the first one starts.
    pub(crate) fn prepared(port: u16, extra_args: Vec<String>) -> anyhow::Result<Self> {
        let binary = nats_server_binary().context(
            "nats-server is not installed: run scripts/install-nats-server (or set WAYBILL_NATS_SERVER)",
        )?;
        let dir = tempfile::Builder::new()
            .prefix("waybill-nats-")
            .tempdir()
            .context("creating the nats-server's directory")?;
        Ok(Self {
            binary,
            port,
            dir,
            extra_args,
            config: None,
            child: None,
        })
    }

    /// The log file of the current incarnation (a restart starts a new one).
    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("nats-server.log")
    }

    /// Starts a server that also reads `config` (nats-server configuration syntax, e.g.
    /// `max_payload: 8192`).
    pub fn start_with_config(config: &str) -> anyhow::Result<Self> {
        let mut server = Self::start()?;
        server.stop();
        server.set_config(config);
        server.resume()?;
        Ok(server)
    }

    /// Replaces the configuration file used from the next [`NatsServer::resume`] on.
    pub fn set_config(&mut self, config: &str) {
        self.config = Some(config.to_owned());
    }

    /// `nats://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// The port it listens on (kept across restarts).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Kills the server abruptly (as a crash or an outage would); its store survives for [`resume`].
    ///
    /// [`resume`]: NatsServer::resume
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port with the same store, and waits until it is ready.
    pub fn resume(&mut self) -> anyhow::Result<()> {
        if self.child.is_some() {
            return Ok(());
        }
        let log = self.dir.path().join("nats-server.log");
        let _ = std::fs::remove_file(&log);
        let mut command = Command::new(&self.binary);
        if let Some(config) = &self.config {
            let file = self.dir.path().join("nats-server.conf");
            std::fs::write(&file, config).with_context(|| format!("writing {}", file.display()))?;
            command.arg("-c").arg(file);
        }
        let child = command
            .args(["-a", "127.0.0.1", "-p", &self.port.to_string(), "-js"])
            .arg("-sd")
            .arg(self.dir.path().join("jetstream"))
            .arg("-l")
            .arg(&log)
            .args(&self.extra_args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", self.binary.display()))?;
        self.child = Some(child);
        wait_until_ready(&log, self.port, Duration::from_secs(15))
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Waits for the port to accept connections and the log to say the server (JetStream included) is ready.
fn wait_until_ready(log: &Path, port: u16, timeout: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    let address = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    while Instant::now() < deadline {
        let ready = std::fs::read_to_string(log).is_ok_and(|text| text.contains("Server is ready"));
        if ready && TcpStream::connect_timeout(&address, Duration::from_millis(200)).is_ok() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let tail = std::fs::read_to_string(log).unwrap_or_default();
    bail!("nats-server on port {port} did not become ready in {timeout:?}; its log:\n{tail}")
}

/// A port that was free a moment ago on 127.0.0.1.
pub fn free_port() -> anyhow::Result<u16> {
    Ok(free_ports(1)?[0])
}

/// `count` distinct ports that were free a moment ago on 127.0.0.1, none handed out before by this
/// process: a caller often draws several ports before it starts the servers that bind them (or
/// stops a server and starts it again on its port), and a later draw must not pick a port that is
/// free only because its server is not running yet (the rollout story failed once in CI so).
///
/// They are drawn below the kernel's ephemeral range (`ip_local_port_range`): a port the kernel hands
/// out for binding port 0 comes from that range, where every outgoing connection also takes its
/// local port, and a client connecting between the choice and the server's bind took it (seen once
/// in the demo: "Address already in use" for a metrics port). Below the range only listeners compete,
/// and a bind here tells whether one holds the port.
pub fn free_ports(count: usize) -> anyhow::Result<Vec<u16>> {
    let ceiling = ephemeral_floor().clamp(LOWEST_PORT + 1_000, u16::MAX);
    let mut held: Vec<TcpListener> = Vec::with_capacity(count);
    let mut draws = 0;
    while held.len() < count {
        draws += 1;
        if draws > 10_000 {
            // A crowded range: let the kernel choose, as before.
            held.push(TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?);
            continue;
        }
        #[allow(
            clippy::cast_possible_truncation,
            reason = "a remainder modulo a u16 difference fits in a u16"
        )]
        let port = LOWEST_PORT + (random() % u64::from(ceiling - LOWEST_PORT)) as u16;
        if handed_out().contains(&port) {
            continue;
        }
        if let Ok(listener) = TcpListener::bind((Ipv4Addr::LOCALHOST, port)) {
            held.push(listener);
        }
    }
    let ports: Vec<u16> = held
        .iter()
        .map(|listener| listener.local_addr().map(|a| a.port()))
        .collect::<Result<_, _>>()?;
    handed_out().extend(&ports);
    Ok(ports)
}

/// Every port [`free_ports`] has handed out in this process.
fn handed_out() -> std::sync::MutexGuard<'static, std::collections::BTreeSet<u16>> {
    static PORTS: std::sync::Mutex<std::collections::BTreeSet<u16>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    PORTS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The lowest port drawn by [`free_ports`]: above the well-known and most registered service ports.
const LOWEST_PORT: u16 = 20_000;

/// The first port of the kernel's ephemeral range (Linux's default, 32768, where it cannot be read).
fn ephemeral_floor() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

/// A random number (no dependency for picking ports): every `RandomState` has fresh keys, so hashing
/// a counter with it gives a new value each call.
fn random() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    hasher.finish()
}

/// The nats-server private servers are started from: `WAYBILL_NATS_SERVER` when set, else the one the
/// project installs into `.tools/bin` (installed on first use by `scripts/install-nats-server`), else
/// whichever is on PATH — with a warning, since a distribution's server may be older than the
/// supported minimum (2.11).
pub fn nats_server_binary() -> Option<PathBuf> {
    static FOUND: std::sync::OnceLock<Option<PathBuf>> = std::sync::OnceLock::new();
    FOUND.get_or_init(locate_nats_server).clone()
}

fn locate_nats_server() -> Option<PathBuf> {
    if let Some(named) = std::env::var_os("WAYBILL_NATS_SERVER").filter(|v| !v.is_empty()) {
        return Some(PathBuf::from(named));
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let installed = root.join(".tools/bin/nats-server");
    if !installed.is_file() {
        let script = root.join("scripts/install-nats-server");
        let ran = Command::new(&script)
            .stdout(Stdio::null())
            .status()
            .map(|status| status.success())
            .unwrap_or(false);
        if !ran {
            eprintln!(
                "testkit: {} failed; looking for nats-server on PATH",
                script.display()
            );
        }
    }
    if installed.is_file() {
        return Some(installed);
    }
    let found = find_binary("nats-server")?;
    eprintln!(
        "testkit: using {} (not the project's own server: run scripts/install-nats-server)",
        found.display()
    );
    Some(found)
}

/// Looks `name` up on PATH and in the sbin folders, where Debian installs server binaries.
pub fn find_binary(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/usr/local/sbin", "/usr/local/bin", "/usr/bin"].map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}

/// What `nats-server --version` says of the binary private servers are started from (e.g.
/// `nats-server: v2.9.10`), so that a report names the server its verdict is about.
pub fn server_version() -> Option<String> {
    let output = std::process::Command::new(nats_server_binary()?)
        .arg("--version")
        .output()
        .ok()?;
    let version = String::from_utf8_lossy(&output.stdout).trim().to_owned();
    (!version.is_empty()).then_some(version)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_chosen_together_are_distinct() {
        let ports = free_ports(50).expect("ports");
        let distinct: std::collections::BTreeSet<_> = ports.iter().collect();
        assert_eq!(distinct.len(), 50, "{ports:?}");
    }

    #[test]
    fn a_private_server_starts_stops_and_resumes_on_its_port() {
        let mut server = NatsServer::start().expect("nats-server starts");
        let address = SocketAddr::from((Ipv4Addr::LOCALHOST, server.port()));
        assert!(TcpStream::connect(address).is_ok());
        server.stop();
        assert!(
            TcpStream::connect(address).is_err(),
            "stopped server still accepts connections"
        );
        server.resume().expect("resumes");
        assert!(TcpStream::connect(address).is_ok());
    }

    #[test]
    fn a_dropped_server_leaves_no_directory_behind() {
        let server = NatsServer::start().expect("nats-server starts");
        let dir = server.dir.path().to_path_buf();
        assert!(dir.join("jetstream").is_dir(), "JetStream stores in it");
        drop(server);
        assert!(!dir.exists(), "{} is left behind", dir.display());
    }

    #[test]
    fn free_ports_are_distinct_bindable_and_below_the_ephemeral_range() {
        let ports = free_ports(20).expect("ports");
        let mut distinct = ports.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), 20, "{ports:?}");
        let floor = ephemeral_floor();
        assert!(
            ports
                .iter()
                .all(|&p| p >= LOWEST_PORT && p < floor.max(LOWEST_PORT + 1_000)),
            "{ports:?} (ephemeral range from {floor})"
        );
        // Released (their listeners dropped), yet never handed out again: their servers may not have
        // started yet. Whether each is free again is not asserted: the servers of the tests running
        // beside this one draw from the same range, and any process on the machine may bind one.
        let later: Vec<u16> = (0..400).map(|_| free_port().expect("port")).collect();
        assert!(
            later.iter().all(|p| !ports.contains(p)),
            "{later:?} vs {ports:?}"
        );
        let mut distinct = later.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(
            distinct.len(),
            later.len(),
            "one after another, all distinct"
        );
    }
}
