//! PostgreSQL and NATS for the demo (and `waybill services`): the configured ones when they answer,
//! private ones started from the installed binaries when they do not.

use anyhow::Context;
use testkit::{NatsServer, PostgresServer};

/// The services in use; private ones stop when this is dropped.
#[derive(Debug)]
pub(crate) struct Services {
    /// A URL of the PostgreSQL in use (its database name is replaced as needed).
    pub postgres_url: String,
    pub nats_url: String,
    /// Set when PostgreSQL was started for this run.
    pub private_postgres: Option<PostgresServer>,
    /// Set when NATS was started for this run.
    pub private_nats: Option<NatsServer>,
}

impl Services {
    /// Uses the services at `database_url` and `nats_url` when they accept connections, and starts
    /// private ones in their place when they do not.
    pub(crate) fn ensure(database_url: &str, nats_url: &str) -> anyhow::Result<Self> {
        let (pg_host, pg_port) = host_port(database_url, 5432);
        let (nats_host, nats_port) = host_port(nats_url, 4222);
        let mut services = Self {
            postgres_url: database_url.to_owned(),
            nats_url: nats_url.to_owned(),
            private_postgres: None,
            private_nats: None,
        };
        if !testkit::reachable(&pg_host, pg_port) {
            let private = PostgresServer::start()
                .with_context(|| format!("PostgreSQL is not reachable at {pg_host}:{pg_port} and a private one could not start"))?;
            services.postgres_url = private.url("postgres");
            services.private_postgres = Some(private);
        }
        if !testkit::reachable(&nats_host, nats_port) {
            let private = NatsServer::start()
                .with_context(|| format!("NATS is not reachable at {nats_host}:{nats_port} and a private one could not start"))?;
            services.nats_url = private.url();
            services.private_nats = Some(private);
        }
        Ok(services)
    }

    /// Replaces NATS at the configured URL with a private server (the installed one, of a supported
    /// version) when the server there is older than `minimum` (major, minor) — a distribution's 2.9
    /// has no subject transforms, which the partitions' split needs. Returns the version it refused.
    pub(crate) async fn require_nats(
        &mut self,
        minimum: (u64, u64),
    ) -> anyhow::Result<Option<String>> {
        if self.private_nats.is_some() {
            return Ok(None);
        }
        let connect = async_nats::ConnectOptions::new()
            .connection_timeout(std::time::Duration::from_secs(5))
            .connect(self.nats_url.as_str());
        let client = connect.await.with_context(|| {
            format!("connecting to NATS at {}", ops::redact_url(&self.nats_url))
        })?;
        let version = client.server_info().version;
        drop(client);
        if version_at_least(&version, minimum) {
            return Ok(None);
        }
        let private = NatsServer::start().with_context(|| {
            format!(
                "NATS at {} is {version}, older than {}.{}, and a private one could not start",
                ops::redact_url(&self.nats_url),
                minimum.0,
                minimum.1
            )
        })?;
        self.nats_url = private.url();
        self.private_nats = Some(private);
        Ok(Some(version))
    }

    /// The URL of `database` on the PostgreSQL in use.
    pub(crate) fn database_url(&self, database: &str) -> String {
        ops::database::with_database(&self.postgres_url, database)
    }

    /// One line per service: where it is and whose it is.
    pub(crate) fn describe(&self) -> [String; 2] {
        let whose = |private: bool| {
            if private {
                "private, started for this run"
            } else {
                "already running"
            }
        };
        [
            format!(
                "PostgreSQL {} ({})",
                ops::redact_url(&self.database_url("")).trim_end_matches('/'),
                whose(self.private_postgres.is_some())
            ),
            format!(
                "NATS       {} ({})",
                ops::redact_url(&self.nats_url),
                whose(self.private_nats.is_some())
            ),
        ]
    }
}

/// Host and port of a `scheme://[user[:password]@]host[:port][/…]` URL.
/// `url` with `sslmode=disable` when it names a loopback host and chooses no `sslmode` itself: the
/// bench's processes and PostgreSQL share one machine, where TLS only spends CPU (on this 2-core
/// machine, a tenth of PostgreSQL's share in the pipeline benchmark went to TLS: `perf`,
/// docs/benchmarks.md). A URL that asks for TLS keeps it.
pub(crate) fn without_tls_on_loopback(url: &str) -> String {
    let (host, _) = host_port(url, 5432);
    let loopback = matches!(host.as_str(), "localhost" | "127.0.0.1" | "[::1]" | "::1");
    if !loopback || url.contains("sslmode=") {
        return url.to_owned();
    }
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}sslmode=disable")
}

/// Whether a server's `major.minor.patch` version is at least `minimum` (an unreadable one is not).
fn version_at_least(version: &str, minimum: (u64, u64)) -> bool {
    let mut parts = version
        .trim_start_matches('v')
        .split(['.', '-'])
        .map(|part| part.parse::<u64>().ok());
    match (parts.next().flatten(), parts.next().flatten()) {
        (Some(major), Some(minor)) => (major, minor) >= minimum,
        _ => false,
    }
}

fn host_port(url: &str, default_port: u16) -> (String, u16) {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let authority = rest.split(['/', '?']).next().unwrap_or("");
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, hp)| hp);
    match host_port.rsplit_once(':') {
        Some((host, port)) => (host.to_owned(), port.parse().unwrap_or(default_port)),
        None => (host_port.to_owned(), default_port),
    }
}

/// `waybill services`.
#[derive(Debug, clap::Args)]
pub(crate) struct ServicesArgs {
    /// NATS server URL to check.
    #[arg(
        long,
        env = "NATS_URL",
        default_value = "nats://127.0.0.1:4222",
        hide_env_values = true
    )]
    pub nats_url: String,
    /// Also write the exports to this file (written last, so it can be waited for).
    #[arg(long, value_name = "FILE")]
    pub env_file: Option<std::path::PathBuf>,
}

/// `waybill services`: private PostgreSQL and NATS where the configured ones do not answer, their
/// URLs printed as shell exports, kept until SIGTERM/Ctrl-C.
pub(crate) async fn serve(database_url: &str, args: ServicesArgs) -> anyhow::Result<()> {
    let services = Services::ensure(database_url, &args.nats_url)?;
    // The database's name as PostgreSQL reads it (a `?sslmode=…` after it is no part of the name).
    let options = ops::database::connect_options(database_url).context("reading --database-url")?;
    let database = options.get_database().unwrap_or("waybill").to_owned();
    let exports = format!(
        "export DATABASE_URL='{}'\nexport NATS_URL='{}'\n",
        services.database_url(&database),
        services.nats_url
    );
    for line in services.describe() {
        eprintln!("{line}");
    }
    print!("{exports}");
    if let Some(file) = &args.env_file {
        std::fs::write(file, &exports).with_context(|| format!("writing {}", file.display()))?;
    }
    ops::shutdown_signal().await;
    drop(services);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_and_ports_come_out_of_urls() {
        assert_eq!(
            host_port("postgres://u:p@db.local:6543/x", 5432),
            ("db.local".into(), 6543)
        );
        assert_eq!(
            host_port("postgres://127.0.0.1/waybill", 5432),
            ("127.0.0.1".into(), 5432)
        );
        assert_eq!(
            host_port("nats://127.0.0.1:4222", 4222),
            ("127.0.0.1".into(), 4222)
        );
    }

    #[test]
    fn tls_is_turned_off_only_on_loopback_and_only_when_the_url_does_not_choose() {
        assert_eq!(
            without_tls_on_loopback("postgres://postgres@127.0.0.1:5432/test"),
            "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
        );
        assert_eq!(
            without_tls_on_loopback("postgres://localhost/x?application_name=a"),
            "postgres://localhost/x?application_name=a&sslmode=disable"
        );
        for kept in [
            "postgres://127.0.0.1/x?sslmode=require",
            "postgres://db.example:5432/x",
        ] {
            assert_eq!(without_tls_on_loopback(kept), kept);
        }
    }

    #[test]
    fn server_versions_compare_by_major_and_minor() {
        assert!(version_at_least("2.15.1", (2, 11)));
        assert!(version_at_least("2.11.0", (2, 11)));
        assert!(version_at_least("3.0.0-beta", (2, 11)));
        assert!(!version_at_least("2.9.10", (2, 11)));
        assert!(!version_at_least("garbage", (2, 11)));
    }
}
