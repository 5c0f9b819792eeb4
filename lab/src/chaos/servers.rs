//! The private servers of a chaos run: a durable PostgreSQL and NATS (one server, or with `--cluster`
//! a three-node cluster holding the stream in three replicas), each on free ports with its own
//! directory, which the faults crash, restart and freeze.

use std::sync::{Arc, Mutex as BlockingMutex};
use std::time::Duration;

use anyhow::Context;
use testkit::{NatsCluster, NatsServer, PostgresServer};

/// Nodes of the `--cluster` NATS cluster; the stream has as many replicas.
const CLUSTER_NODES: usize = 3;

/// The private NATS: one server, or a cluster.
#[derive(Debug)]
enum Nats {
    Single(NatsServer),
    Cluster(NatsCluster),
}

impl Nats {
    fn pids(&self) -> Vec<u32> {
        match self {
            Self::Single(server) => server.pid().into_iter().collect(),
            Self::Cluster(cluster) => cluster_pids(cluster),
        }
    }
}

fn cluster_pids(cluster: &NatsCluster) -> Vec<u32> {
    (0..cluster.size())
        .filter_map(|i| cluster.node(i).pid())
        .collect()
}

/// The private servers; clones share them (the last one dropped stops and deletes them).
#[derive(Debug, Clone)]
pub(super) struct Servers {
    /// The event store's database (the projections keep their schemas in it too).
    pub database_url: String,
    /// Where the private NATS listens: nats://127.0.0.1:port, or every node's URL comma-separated.
    pub nats_url: String,
    postgres: Arc<BlockingMutex<PostgresServer>>,
    nats: Arc<BlockingMutex<Nats>>,
    /// The nats-server pids (fewer while one is down), readable without waiting for a restart in
    /// progress.
    nats_pids: Arc<BlockingMutex<Vec<u32>>>,
    /// Nodes of the NATS cluster (1: a single server).
    pub nats_nodes: usize,
}

impl Servers {
    /// Starts a durable PostgreSQL (no acknowledged commit is lost to an immediate-mode stop) and a
    /// NATS server with JetStream — with `cluster`, a three-node cluster — each on free ports with its
    /// own directory.
    pub(super) async fn start(database: &str, cluster: bool) -> anyhow::Result<Self> {
        let (postgres, nats) = tokio::task::spawn_blocking(move || {
            let postgres = PostgresServer::start_with(true)?;
            let nats = if cluster {
                Nats::Cluster(NatsCluster::start(CLUSTER_NODES)?)
            } else {
                Nats::Single(NatsServer::start()?)
            };
            anyhow::Ok((postgres, nats))
        })
        .await??;
        let (nats_url, nats_nodes) = match &nats {
            Nats::Single(server) => (server.url(), 1),
            Nats::Cluster(cluster) => (cluster.urls(), cluster.size()),
        };
        Ok(Self {
            database_url: postgres.url(database),
            nats_url,
            nats_nodes,
            nats_pids: Arc::new(BlockingMutex::new(nats.pids())),
            postgres: Arc::new(BlockingMutex::new(postgres)),
            nats: Arc::new(BlockingMutex::new(nats)),
        })
    }

    /// Another handle on the same servers.
    pub(super) fn clone_handles(&self) -> Self {
        self.clone()
    }

    /// A small pool on the event store's database for the harness's own queries; its sessions are
    /// named `waybill-chaos`, so `pg_terminate` spares them.
    pub(super) async fn pool(&self) -> anyhow::Result<sqlx::PgPool> {
        let options: sqlx::postgres::PgConnectOptions = self.database_url.parse()?;
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(4)
            .acquire_timeout(Duration::from_secs(5))
            .connect_with(options.application_name("waybill-chaos"))
            .await
            .context("connecting to the private PostgreSQL")
    }

    /// Refuses the WAL source on a server that cannot decode its WAL, and otherwise returns its
    /// `wal_sender_timeout` (how long a frozen reader holds the slot). The private servers run with
    /// `wal_level = logical` (testkit), so this refuses only if that ever changes: better refused
    /// here with the reason than two relays failing their replication sessions for the whole run.
    pub(super) async fn check_logical_decoding(&self) -> anyhow::Result<Duration> {
        use sqlx::Connection;
        // The server's own database: the run's is made later, by `waybill migrate`.
        let url = self
            .postgres
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .url("postgres");
        let mut connection = sqlx::PgConnection::connect(&url)
            .await
            .context("connecting to the private PostgreSQL")?;
        let (wal_level, wal_sender_timeout_ms): (String, i64) = sqlx::query_as(
            "SELECT current_setting('wal_level'),
                    (SELECT setting::int8 FROM pg_settings WHERE name = 'wal_sender_timeout')",
        )
        .fetch_one(&mut connection)
        .await
        .context("reading wal_level and wal_sender_timeout")?;
        connection.close().await?;
        if wal_level != "logical" {
            return Err(ops::Refused::new(format!(
                "--relay-source wal needs wal_level = logical; the private PostgreSQL has \
                 {wal_level}"
            ))
            .into());
        }
        Ok(Duration::from_millis(
            u64::try_from(wal_sender_timeout_ms).unwrap_or_default(),
        ))
    }

    /// Crashes PostgreSQL (immediate-mode stop), waits `down`, and starts it again.
    pub(super) async fn restart_postgres(&self, down: Duration) -> anyhow::Result<()> {
        let server = self.postgres.clone();
        tokio::task::spawn_blocking(move || {
            let mut server = server.lock().unwrap_or_else(|e| e.into_inner());
            server.crash();
            std::thread::sleep(down);
            server.resume()
        })
        .await?
    }

    /// Kills nats-server (SIGKILL) — every node of a cluster at once — waits `down`, and starts it
    /// again on the same store.
    pub(super) async fn restart_nats(&self, down: Duration) -> anyhow::Result<()> {
        let (nats, pids) = (self.nats.clone(), self.nats_pids.clone());
        tokio::task::spawn_blocking(move || {
            let mut nats = nats.lock().unwrap_or_else(|e| e.into_inner());
            let set_pids = |nats: &Nats| {
                *pids.lock().unwrap_or_else(|e| e.into_inner()) = nats.pids();
            };
            match &mut *nats {
                Nats::Single(server) => server.stop(),
                Nats::Cluster(cluster) => (0..cluster.size()).for_each(|i| cluster.kill(i)),
            }
            set_pids(&nats);
            std::thread::sleep(down);
            let resumed = match &mut *nats {
                Nats::Single(server) => server.resume(),
                Nats::Cluster(cluster) => cluster.restart_all(),
            };
            set_pids(&nats);
            resumed
        })
        .await?
    }

    /// With a cluster: SIGKILLs node `index` (modulo the node count), waits `down`, starts it again
    /// on its store and waits until it has rejoined; returns the node's name.
    pub(super) async fn kill_nats_node(
        &self,
        index: usize,
        down: Duration,
    ) -> anyhow::Result<String> {
        let (nats, pids) = (self.nats.clone(), self.nats_pids.clone());
        tokio::task::spawn_blocking(move || {
            let mut nats = nats.lock().unwrap_or_else(|e| e.into_inner());
            let Nats::Cluster(cluster) = &mut *nats else {
                anyhow::bail!("nats_node_kill needs --cluster");
            };
            let index = index % cluster.size();
            let name = format!(
                "{} (port {})",
                cluster.name(index),
                cluster.node(index).port()
            );
            cluster.kill(index);
            *pids.lock().unwrap_or_else(|e| e.into_inner()) = cluster_pids(cluster);
            std::thread::sleep(down);
            let restarted = cluster.restart(index);
            *pids.lock().unwrap_or_else(|e| e.into_inner()) = cluster_pids(cluster);
            restarted.map(|()| name)
        })
        .await?
    }

    /// SIGSTOPs node `index` of the NATS cluster for `frozen`, then SIGCONTs it; returns its name.
    pub(super) async fn freeze_nats_node(
        &self,
        index: usize,
        frozen: Duration,
    ) -> anyhow::Result<String> {
        let nats = self.nats.clone();
        tokio::task::spawn_blocking(move || {
            let nats = nats.lock().unwrap_or_else(|e| e.into_inner());
            let Nats::Cluster(cluster) = &*nats else {
                anyhow::bail!("nats_node_freeze needs --cluster");
            };
            let index = index % cluster.size();
            let name = format!(
                "{} (port {})",
                cluster.name(index),
                cluster.node(index).port()
            );
            cluster.freeze(index)?;
            std::thread::sleep(frozen);
            cluster.thaw(index)?;
            Ok(name)
        })
        .await?
    }

    /// The nats-server process ids, of those that run.
    pub(super) fn nats_pids(&self) -> Vec<u32> {
        self.nats_pids
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}
