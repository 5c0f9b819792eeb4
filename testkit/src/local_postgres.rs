//! A private PostgreSQL server from the installed `initdb` and `postgres` binaries, in a temporary
//! directory on a free loopback port: what `waybill demo` and the test command use when no server is
//! reachable. Stopped and deleted on drop.

use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use rustix::process::{Pid, Signal, kill_process};
use tempfile::TempDir;

use crate::local_nats::{find_binary, free_port};

/// A running private PostgreSQL; the superuser is `postgres` with trust authentication on loopback.
#[derive(Debug)]
pub struct PostgresServer {
    port: u16,
    // Removed when the handle drops, after `Drop` has stopped the server that writes into it.
    dir: TempDir,
    bindir: PathBuf,
    durable: bool,
    /// Offers TLS with a certificate signed by this throwaway CA (in `dir`).
    ca: Option<PathBuf>,
    /// Logs in over TCP only with a client certificate signed by that CA: this one (for `postgres`)
    /// and its key.
    client: Option<(PathBuf, PathBuf)>,
    child: Option<Child>,
}

impl PostgresServer {
    /// Initializes a cluster in a fresh temporary directory and starts it on a free port. Commits are
    /// acknowledged before their WAL is written (`synchronous_commit=off`): fast, and fine for a server
    /// that is never crashed on purpose.
    pub fn start() -> anyhow::Result<Self> {
        Self::start_with(false)
    }

    /// Like [`PostgresServer::start`]; with `durable`, a commit is acknowledged only once its WAL is
    /// written, so an immediate-mode stop ([`PostgresServer::crash`]) loses no acknowledged commit —
    /// what a harness that crashes the server needs. (`fsync` stays off either way: the operating
    /// system does not crash here, and written WAL survives in its page cache.)
    pub fn start_with(durable: bool) -> anyhow::Result<Self> {
        Self::start_configured(durable, None, false)
    }

    /// Like [`PostgresServer::start`], offering TLS too (plain connections are still accepted): a
    /// certificate for 127.0.0.1 and localhost signed by a throwaway CA, [`PostgresServer::ca`].
    pub fn start_with_tls() -> anyhow::Result<Self> {
        Self::start_configured(false, Some(crate::secure_nats::LOOPBACK_NAMES), false)
    }

    /// Like [`PostgresServer::start_with_tls`], logging in over TCP (replication sessions too) only
    /// with TLS and a client certificate signed by the same CA whose name is the role's
    /// (`pg_hba.conf`'s `cert` method); its Unix socket still trusts everyone. [`PostgresServer::url`]
    /// then names the certificate made for `postgres`, its key and the CA, with `verify-full`.
    pub fn start_requiring_client_certificates() -> anyhow::Result<Self> {
        Self::start_configured(false, Some(crate::secure_nats::LOOPBACK_NAMES), true)
    }

    /// Like [`PostgresServer::start_with_tls`], with a certificate for `names` only (a
    /// `subjectAltName` list: `DNS:localhost`, say) — to show that a client checks the name.
    pub fn start_with_tls_for(names: &str) -> anyhow::Result<Self> {
        Self::start_configured(false, Some(names), false)
    }

    /// The CA that signed the server's certificate, when it offers TLS.
    pub fn ca(&self) -> Option<&Path> {
        self.ca.as_deref()
    }

    fn start_configured(
        durable: bool,
        tls: Option<&str>,
        require_client_certificates: bool,
    ) -> anyhow::Result<Self> {
        let bindir = find_bindir().context(
            "PostgreSQL server binaries (initdb, postgres) were not found; install the Debian package \
             `postgresql` (or put its bin directory on PATH)",
        )?;
        let port = free_port()?;
        let dir = tempfile::Builder::new()
            .prefix("waybill-postgres-")
            .tempdir()
            .context("creating the cluster's directory")?;
        let data = dir.path().join("data");
        let (ca, client) = if let Some(names) = tls {
            let certificates = dir.path().join("tls");
            std::fs::create_dir(&certificates)?;
            let (ca, _, key) = crate::secure_nats::certificates(&certificates, names);
            // PostgreSQL refuses a key others may read.
            std::fs::set_permissions(&key, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
            let client = require_client_certificates
                .then(|| crate::secure_nats::client_certificate(&certificates, "postgres"));
            (Some(ca), client)
        } else {
            (None, None)
        };
        // initdb and postgres run as the `postgres` user when we are root: it must own the directory.
        if running_as_root() {
            let status = Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(dir.path())
                .status()?;
            anyhow::ensure!(
                status.success(),
                "cannot hand {} to the postgres user",
                dir.path().display()
            );
        }
        let init = server_command(&bindir, "initdb")
            .arg("-D")
            .arg(&data)
            .args(["-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output()
            .context("running initdb")?;
        if !init.status.success() {
            bail!("initdb failed: {}", String::from_utf8_lossy(&init.stderr));
        }
        if client.is_some() {
            // Rewritten in place: the file keeps the owner initdb gave it.
            std::fs::write(
                data.join("pg_hba.conf"),
                "local all all trust\n\
                 hostssl all all 127.0.0.1/32 cert\n\
                 hostssl replication all 127.0.0.1/32 cert\n",
            )
            .context("writing pg_hba.conf")?;
        }
        let mut server = Self {
            port,
            dir,
            bindir,
            durable,
            ca,
            client,
            child: None,
        };
        server.resume()?;
        Ok(server)
    }

    /// Starts the server (again) on the same port and data directory, and waits until it accepts
    /// connections (after crash recovery, if it was crashed).
    pub fn resume(&mut self) -> anyhow::Result<()> {
        if self.child.is_some() {
            return Ok(());
        }
        // Each start logs to a fresh file: readiness is read from it.
        let log_path = self.dir.path().join("postgres.log");
        if log_path.exists() {
            let _ = std::fs::rename(&log_path, self.dir.path().join("postgres.previous.log"));
        }
        let log = std::fs::File::create(&log_path)?;
        if running_as_root() {
            let _ = Command::new("chown")
                .args(["postgres:postgres"])
                .arg(&log_path)
                .status();
        }
        let synchronous_commit = if self.durable { "on" } else { "off" };
        let child = server_command(&self.bindir, "postgres")
            .arg("-D")
            .arg(self.dir.path().join("data"))
            .args([
                "-p",
                &self.port.to_string(),
                "-c",
                "listen_addresses=127.0.0.1",
            ])
            .arg("-k")
            .arg(self.dir.path())
            // A throwaway cluster: speed helps the demo and the tests.
            .args([
                "-c",
                "fsync=off",
                "-c",
                &format!("synchronous_commit={synchronous_commit}"),
                "-c",
                "max_connections=200",
            ])
            // Ready for a relay that reads the WAL (`--source wal`): logical decoding, a few slots and
            // their senders, and a dead reader's slot freed within seconds rather than a minute.
            .args([
                "-c",
                "wal_level=logical",
                "-c",
                "max_replication_slots=16",
                "-c",
                "max_wal_senders=16",
                "-c",
                "wal_sender_timeout=10s",
            ])
            .args(self.ca.iter().flat_map(|_| {
                let certificates = self.dir.path().join("tls");
                [
                    "-c".to_owned(),
                    "ssl=on".to_owned(),
                    "-c".to_owned(),
                    format!(
                        "ssl_cert_file={}",
                        certificates.join("server.pem").display()
                    ),
                    "-c".to_owned(),
                    format!(
                        "ssl_key_file={}",
                        certificates.join("server-key.pem").display()
                    ),
                ]
            }))
            // Client certificates are checked against the CA that signed the server's.
            .args(self.client.iter().flat_map(|_| {
                [
                    "-c".to_owned(),
                    format!(
                        "ssl_ca_file={}",
                        self.dir.path().join("tls").join("ca.pem").display()
                    ),
                ]
            }))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("starting postgres")?;
        self.child = Some(child);
        self.wait_until_ready(Duration::from_secs(60))
    }

    /// Stops the server in immediate mode, as a crash would: every session is cut, nothing is
    /// checkpointed, and the next [`PostgresServer::resume`] runs crash recovery.
    pub fn crash(&mut self) {
        self.signal_postmaster(Signal::QUIT, Duration::from_secs(10));
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// True while the server process runs.
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// Where its data and logs are.
    pub fn directory(&self) -> &Path {
        self.dir.path()
    }

    /// Sends `signal` to the postmaster (its pid is the first line of postmaster.pid: when it runs
    /// through `runuser`, our child is runuser, which does not pass signals on), waits up to `wait`
    /// for it to exit, then kills it.
    fn signal_postmaster(&self, signal: Signal, wait: Duration) {
        let postmaster =
            std::fs::read_to_string(self.dir.path().join("data").join("postmaster.pid"))
                .ok()
                .and_then(|text| text.lines().next()?.trim().parse::<i32>().ok())
                .and_then(Pid::from_raw);
        if let Some(pid) = postmaster {
            let alive = || Path::new(&format!("/proc/{}", pid.as_raw_nonzero())).exists();
            let _ = kill_process(pid, signal);
            let deadline = Instant::now() + wait;
            while Instant::now() < deadline && alive() {
                std::thread::sleep(Duration::from_millis(50));
            }
            if alive() {
                let _ = kill_process(pid, Signal::KILL);
            }
        }
    }

    /// `postgres://postgres@127.0.0.1:PORT/DATABASE`; on a server that requires client certificates,
    /// with `sslmode=verify-full` and the CA's, the certificate's and the key's paths.
    pub fn url(&self, database: &str) -> String {
        let url = format!("postgres://postgres@127.0.0.1:{}/{database}", self.port);
        match (&self.ca, &self.client) {
            (Some(ca), Some((certificate, key))) => format!(
                "{url}?sslmode=verify-full&sslrootcert={}&sslcert={}&sslkey={}",
                ca.display(),
                certificate.display(),
                key.display()
            ),
            _ => url,
        }
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    fn wait_until_ready(&mut self, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        let address = SocketAddr::from((Ipv4Addr::LOCALHOST, self.port));
        while Instant::now() < deadline {
            if let Some(child) = &mut self.child
                && let Ok(Some(status)) = child.try_wait()
            {
                bail!("postgres exited with {status}: {}", self.log_tail());
            }
            // The port opens before recovery finishes; the log says when connections are accepted.
            let ready = std::fs::read_to_string(self.dir.path().join("postgres.log"))
                .is_ok_and(|log| log.contains("ready to accept connections"));
            if ready && TcpStream::connect_timeout(&address, Duration::from_millis(200)).is_ok() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        bail!(
            "postgres on port {} did not become ready: {}",
            self.port,
            self.log_tail()
        )
    }

    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.dir.path().join("postgres.log")).unwrap_or_default();
        log.lines()
            .rev()
            .take(10)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect::<Vec<_>>()
            .join("\n")
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        // SIGINT is PostgreSQL's fast shutdown: it ends the sessions and stops.
        self.signal_postmaster(Signal::INT, Duration::from_secs(10));
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A command running `program` from `bindir`, as the `postgres` user when we are root (initdb and
/// postgres refuse to run as root).
fn server_command(bindir: &Path, program: &str) -> Command {
    let binary = bindir.join(program);
    if running_as_root() {
        let mut command = Command::new("runuser");
        command.args(["-u", "postgres", "--"]).arg(binary);
        command
    } else {
        Command::new(binary)
    }
}

/// True when this process runs as uid 0.
fn running_as_root() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|status| {
        status
            .lines()
            .find(|l| l.starts_with("Uid:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .is_some_and(|uid| uid == "0")
    })
}

/// The directory holding `initdb` and `postgres`: PATH, `pg_config --bindir`, then Debian's layout
/// (newest major version first).
fn find_bindir() -> Option<PathBuf> {
    let has_both = |dir: &Path| dir.join("initdb").is_file() && dir.join("postgres").is_file();
    if let Some(initdb) = find_binary("initdb")
        && let Some(dir) = initdb.parent()
        && has_both(dir)
    {
        return Some(dir.to_path_buf());
    }
    if let Ok(output) = Command::new("pg_config").arg("--bindir").output() {
        let dir = PathBuf::from(String::from_utf8_lossy(&output.stdout).trim());
        if has_both(&dir) {
            return Some(dir);
        }
    }
    std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            Some((
                version_of(&e.file_name().to_string_lossy())?,
                e.path().join("bin"),
            ))
        })
        .filter(|(_, dir)| has_both(dir))
        .max_by_key(|(version, _)| version.clone())
        .map(|(_, dir)| dir)
}

/// A Debian version folder's name ("15", "9.6") as numbers, so that 16 is newer than 9.6 (as text,
/// "9.6" sorts after "16"); `None` for a name that is not a version.
fn version_of(name: &str) -> Option<Vec<u32>> {
    name.split('.').map(|part| part.parse().ok()).collect()
}

/// True when something accepts TCP connections at `host:port`.
pub fn reachable(host: &str, port: u16) -> bool {
    use std::net::ToSocketAddrs;
    (host, port)
        .to_socket_addrs()
        .ok()
        .into_iter()
        .flatten()
        .any(|address| TcpStream::connect_timeout(&address, Duration::from_millis(500)).is_ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_private_postgres_starts_and_accepts_connections() {
        let server = PostgresServer::start().expect("postgres starts");
        assert!(reachable("127.0.0.1", server.port()));
        assert!(server.url("x").ends_with("/x"));
        let dir = server.directory().to_path_buf();
        drop(server);
        assert!(!dir.exists(), "{} is left behind", dir.display());
    }

    #[test]
    fn versions_compare_by_number_not_as_text() {
        assert!(version_of("16") > version_of("9.6"));
        assert!(version_of("9.6") > version_of("9"));
        assert_eq!(version_of("main"), None);
    }

    /// Talks to the server through sqlx rather than `psql`, which a server-only install may lack.
    #[tokio::test]
    async fn a_crashed_server_resumes_on_its_port_with_its_data() {
        use sqlx::Connection;
        let mut server = PostgresServer::start_with(true).expect("postgres starts");
        let url = server.url("postgres");
        let mut connection = sqlx::PgConnection::connect(&url).await.expect("connects");
        sqlx::raw_sql("CREATE TABLE kept (x int); INSERT INTO kept VALUES (42)")
            .execute(&mut connection)
            .await
            .expect("writes");
        server.crash();
        assert!(
            !reachable("127.0.0.1", server.port()),
            "a crashed server still answers"
        );
        server.resume().expect("resumes after crash recovery");
        let mut connection = sqlx::PgConnection::connect(&url).await.expect("reconnects");
        let kept: i32 = sqlx::query_scalar("SELECT x FROM kept")
            .fetch_one(&mut connection)
            .await
            .expect("reads");
        assert_eq!(kept, 42, "a committed row survives the crash");
    }
}
