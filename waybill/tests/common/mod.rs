//! What the HTTP test files share: a real `waybill serve` on free loopback ports.

use std::path::PathBuf;
use std::time::Duration;

use reqwest::Client;
use sqlx::PgPool;

/// A running `waybill serve` (killed when dropped) and a client for it.
pub(crate) struct Service {
    /// The API's base URL.
    pub base: String,
    /// The metrics listener's base URL.
    pub metrics: String,
    child: tokio::process::Child,
    /// A client to talk to it with.
    pub client: Client,
}

impl Service {
    /// `waybill serve` on the test's database with the API and its metrics listener on free loopback
    /// ports, plus `extra` flags; returns once its health check answers.
    pub(crate) async fn start_with(pool: &PgPool, extra: &[&str]) -> Self {
        let url = testkit::database_url(pool).await;
        let ports = testkit::free_ports(2).expect("free ports");
        let (port, metrics_port) = (ports[0], ports[1]);
        let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_waybill"))
            .args([
                "serve",
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--metrics-listen",
                &format!("127.0.0.1:{metrics_port}"),
                "--database-url",
                &url,
            ])
            .args(extra)
            .env("RUST_LOG", "warn")
            .kill_on_drop(true)
            .spawn()
            .expect("waybill serve starts");
        let service = Self {
            base: format!("http://127.0.0.1:{port}"),
            metrics: format!("http://127.0.0.1:{metrics_port}"),
            child,
            client: Client::new(),
        };
        for _ in 0..200 {
            if let Ok(r) = service
                .client
                .get(format!("{}/health", service.metrics))
                .send()
                .await
                && r.status().is_success()
            {
                return service;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("waybill serve did not become healthy");
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

/// Another crate's binary (`waybill-relay`, `waybill-inventory`), built now if needed; it lands
/// beside `waybill` in the same target directory.
#[allow(
    dead_code,
    reason = "not every test file that shares this module starts other binaries"
)]
pub(crate) fn workspace_binary(name: &str) -> PathBuf {
    testkit::workspace_binary(
        env!("CARGO_MANIFEST_DIR"),
        env!("CARGO_BIN_EXE_waybill"),
        name,
    )
}
