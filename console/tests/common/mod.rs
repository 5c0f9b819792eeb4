//! What the console's test files share: a real `waybill-console run` on a free loopback port, and
//! the pipeline's other binaries.

use std::path::PathBuf;
use std::time::Duration;

use reqwest::Client;
use sqlx::PgPool;

/// A running `waybill-console` (killed when dropped) and a client for it.
pub(crate) struct Console {
    /// Its base URL (the pages are under `/console`).
    pub base: String,
    child: tokio::process::Child,
    /// A client to talk to it with.
    pub client: Client,
}

impl Console {
    /// `waybill-console run` on the test's database, on a free loopback port, plus `extra` flags;
    /// returns once its health check answers.
    #[allow(
        dead_code,
        reason = "not every test file that shares this module starts it as the test's own user"
    )]
    pub(crate) async fn start_with(pool: &PgPool, extra: &[&str]) -> Self {
        Self::start_as(&testkit::database_url(pool).await, extra).await
    }

    /// `waybill-console run` on `database_url` (a login of a role under test), plus `extra` flags.
    pub(crate) async fn start_as(database_url: &str, extra: &[&str]) -> Self {
        let port = testkit::free_port().expect("a free port");
        let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_waybill-console"))
            .args(["run", "--listen", &format!("127.0.0.1:{port}")])
            .args(extra)
            // By the environment, as an operator would give it (and so never shown in `ps`).
            .env("DATABASE_URL", database_url)
            .env("RUST_LOG", "warn")
            .kill_on_drop(true)
            .spawn()
            .expect("waybill-console starts");
        let mut console = Self {
            base: format!("http://127.0.0.1:{port}"),
            child,
            client: Client::new(),
        };
        for _ in 0..200 {
            if let Ok(r) = console
                .client
                .get(format!("{}/health", console.base))
                .send()
                .await
                && r.status().is_success()
            {
                return console;
            }
            if let Ok(Some(status)) = console.child.try_wait() {
                panic!("waybill-console exited with {status}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("waybill-console did not become healthy");
    }

    /// `GET {base}{path}`, answered with JSON.
    pub(crate) async fn json(&self, path: &str) -> serde_json::Value {
        self.client
            .get(format!("{}{path}", self.base))
            .send()
            .await
            .expect("answers")
            .json()
            .await
            .expect("JSON")
    }

    /// `POST /console/api/outbox/dead/replay` of every dead row, with `authorization` if given.
    pub(crate) async fn replay_all(&self, authorization: Option<&str>) -> reqwest::Response {
        let mut request = self
            .client
            .post(format!("{}/console/api/outbox/dead/replay", self.base))
            .json(&serde_json::json!({"target": "all"}));
        if let Some(authorization) = authorization {
            request = request.header("Authorization", authorization);
        }
        request.send().await.expect("answers")
    }

    /// Replays every dead row as an operator would, after checking that a request without the
    /// token and one with a wrong token are refused (401); returns how many rows were replayed.
    #[allow(
        dead_code,
        reason = "not every test file that shares this module replays"
    )]
    pub(crate) async fn replay_with_the_token_only(&self, token: &str) -> u64 {
        assert_eq!(self.replay_all(None).await.status(), 401);
        let wrong = format!("Bearer {}x", &token[..token.len() - 1]);
        assert_eq!(self.replay_all(Some(&wrong)).await.status(), 401);
        let done = self.replay_all(Some(&format!("Bearer {token}"))).await;
        assert_eq!(done.status(), 200);
        let answer: serde_json::Value = done.json().await.expect("JSON");
        answer["replayed"].as_u64().expect("a count")
    }

    /// The status of `GET {base}{path}`.
    #[allow(
        dead_code,
        reason = "not every test file that shares this module checks bare statuses"
    )]
    pub(crate) async fn status(&self, path: &str) -> u16 {
        self.client
            .get(format!("{}{path}", self.base))
            .send()
            .await
            .expect("answers")
            .status()
            .as_u16()
    }
}

impl Drop for Console {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

/// Another crate's binary (`waybill-relay`, `waybill-inventory`, `waybill`), built now if needed;
/// it lands beside `waybill-console` in the same target directory.
#[allow(
    dead_code,
    reason = "not every test file that shares this module starts other binaries"
)]
pub(crate) fn workspace_binary(name: &str) -> PathBuf {
    testkit::workspace_binary(
        env!("CARGO_MANIFEST_DIR"),
        env!("CARGO_BIN_EXE_waybill-console"),
        name,
    )
}

/// Lets each projection's runner apply everything in `stream` (under `prefix`), as a login of
/// `database_url`, then returns: the built-in ones, then every read model of the registry through
/// its own command line (`waybill-projection <name> run --once`, run in this process).
pub(crate) async fn project_all(database_url: &str, nats: &str, stream: (&str, &str)) {
    use projections::{Inventory, Points, Search};
    project(Inventory, database_url, nats, stream).await;
    project(Points, database_url, nats, stream).await;
    project(Search, database_url, nats, stream).await;
    for model in projections::registry::MODELS {
        let args = [
            &format!("waybill-projection {}", model.name()),
            "--database-url",
            database_url,
            "--nats-url",
            nats,
            "--stream",
            stream.0,
            "--subject-prefix",
            stream.1,
            "run",
            "--once",
        ];
        let code = model
            .main(args.iter().map(|a| (*a).to_owned()).collect())
            .await;
        assert_eq!(
            code,
            std::process::ExitCode::SUCCESS,
            "waybill-projection {} run --once failed",
            model.name()
        );
    }
}

async fn project<P: projections::Projection>(
    projection: P,
    database_url: &str,
    nats: &str,
    (stream, prefix): (&str, &str),
) {
    let config = projections::RunnerConfig {
        stream: stream.into(),
        subject_prefix: prefix.into(),
        ..projections::RunnerConfig::default()
    };
    projections::Runner::connect(projection, database_url, nats, config)
        .await
        .expect("runner")
        .run(std::future::pending(), true, |_| {})
        .await
        .expect("projection runs");
}
