//! A private three-node (or n-node) NATS cluster with JetStream on loopback: each node a nats-server
//! process with its own client port, route port, server name (`n1`, `n2`, …) and store directory, all
//! routed to each other under one cluster name. A node can be killed (SIGKILL, as a crash would) and
//! restarted on the same ports and store, so tests and the chaos harness can check that a replicated
//! stream and its clients ride out the loss of a node.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use crate::local_nats::{NatsServer, free_ports};

/// The cluster's name (`--cluster_name`).
pub const CLUSTER_NAME: &str = "waybill";

/// A running cluster; every node is killed and its directory removed on drop.
#[derive(Debug)]
pub struct NatsCluster {
    nodes: Vec<NatsServer>,
}

impl NatsCluster {
    /// Starts `size` nodes (at least 1; 3 for a stream with three replicas) and waits until JetStream
    /// has elected a metadata leader, i.e. streams can be created.
    pub fn start(size: usize) -> anyhow::Result<Self> {
        anyhow::ensure!(size >= 1, "a cluster needs at least one node");
        // Client and route ports chosen at once, so that no two are the same.
        let ports = free_ports(2 * size)?;
        let (client_ports, route_ports) = ports.split_at(size);
        let mut nodes = Vec::with_capacity(size);
        for (i, &port) in client_ports.iter().enumerate() {
            let routes: Vec<String> = route_ports
                .iter()
                .enumerate()
                .filter(|&(j, _)| j != i)
                .map(|(_, p)| format!("nats://127.0.0.1:{p}"))
                .collect();
            let mut args = vec![
                "-n".to_owned(),
                node_name(i),
                "--cluster_name".to_owned(),
                CLUSTER_NAME.to_owned(),
                "--cluster".to_owned(),
                format!("nats://127.0.0.1:{}", route_ports[i]),
            ];
            if !routes.is_empty() {
                args.extend(["--routes".to_owned(), routes.join(",")]);
            }
            nodes.push(NatsServer::prepared(port, args)?);
        }
        let mut cluster = Self { nodes };
        for node in &mut cluster.nodes {
            node.resume()?;
        }
        cluster.wait_for_leader(Duration::from_secs(30))?;
        Ok(cluster)
    }

    /// How many nodes it has.
    pub fn size(&self) -> usize {
        self.nodes.len()
    }

    /// Every node's client URL, comma-separated: what `NATS_URL` takes for a cluster.
    pub fn urls(&self) -> String {
        self.node_urls().join(",")
    }

    /// Each node's client URL.
    pub fn node_urls(&self) -> Vec<String> {
        self.nodes.iter().map(NatsServer::url).collect()
    }

    /// Node `index` (0-based; its server name is `n<index + 1>`).
    pub fn node(&self, index: usize) -> &NatsServer {
        &self.nodes[index]
    }

    /// Node `index`'s server name, e.g. `n1`.
    pub fn name(&self, index: usize) -> String {
        node_name(index)
    }

    /// Whether node `index` runs.
    pub fn is_running(&self, index: usize) -> bool {
        self.nodes[index].pid().is_some()
    }

    /// Kills node `index` with SIGKILL; its store survives for [`NatsCluster::restart`].
    pub fn kill(&mut self, index: usize) {
        self.nodes[index].stop();
    }

    /// Freezes node `index` with SIGSTOP (a VM pause, a stalled process): it keeps its sockets and
    /// its state but answers nothing until [`NatsCluster::thaw`].
    pub fn freeze(&self, index: usize) -> anyhow::Result<()> {
        self.signal(index, rustix::process::Signal::STOP)
    }

    /// Resumes a node frozen by [`NatsCluster::freeze`] with SIGCONT.
    pub fn thaw(&self, index: usize) -> anyhow::Result<()> {
        self.signal(index, rustix::process::Signal::CONT)
    }

    fn signal(&self, index: usize, signal: rustix::process::Signal) -> anyhow::Result<()> {
        let pid = self.nodes[index]
            .pid()
            .and_then(|pid| i32::try_from(pid).ok())
            .and_then(rustix::process::Pid::from_raw)
            .ok_or_else(|| anyhow::anyhow!("node {} is not running", node_name(index)))?;
        rustix::process::kill_process(pid, signal)?;
        Ok(())
    }

    /// Starts node `index` again on its ports and store, and waits until it is ready and has heard
    /// of a metadata leader (it has rejoined the cluster's JetStream).
    pub fn restart(&mut self, index: usize) -> anyhow::Result<()> {
        self.nodes[index].resume()?;
        wait_for_log(
            &self.nodes[index],
            "metadata leader",
            Duration::from_secs(30),
        )
    }

    /// Starts every node that is down (after a whole-cluster outage) and waits until JetStream has a
    /// metadata leader again: the nodes are started first and waited for together, since none can
    /// elect a leader alone.
    pub fn restart_all(&mut self) -> anyhow::Result<()> {
        for node in &mut self.nodes {
            node.resume()?;
        }
        self.wait_for_leader(Duration::from_secs(30))
    }

    /// Waits until some node logs that JetStream has a metadata leader.
    pub fn wait_for_leader(&self, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if self
                .nodes
                .iter()
                .any(|node| logged(node, "metadata leader"))
            {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        bail!("the NATS cluster elected no JetStream metadata leader within {timeout:?}")
    }
}

fn node_name(index: usize) -> String {
    format!("n{}", index + 1)
}

fn logged(node: &NatsServer, text: &str) -> bool {
    std::fs::read_to_string(node.log_path()).is_ok_and(|log| log.contains(text))
}

fn wait_for_log(node: &NatsServer, text: &str, timeout: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if logged(node, text) {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let log = std::fs::read_to_string(node.log_path())
        .with_context(|| format!("reading {}", node.log_path().display()))?;
    bail!(
        "nats-server on port {} did not log {text:?} within {timeout:?}; its log:\n{log}",
        node.port()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use async_nats::jetstream;

    #[tokio::test]
    async fn a_replicated_stream_survives_a_killed_node_and_the_node_rejoins() {
        let mut cluster = tokio::task::spawn_blocking(|| NatsCluster::start(3))
            .await
            .expect("join")
            .expect("cluster");
        assert_eq!(cluster.size(), 3);
        assert_eq!(cluster.urls().split(',').count(), 3);
        let client = async_nats::connect(cluster.node_urls())
            .await
            .expect("connect");
        let js = jetstream::new(client);
        // A node whose JetStream the meta leader has not heard from yet is "offline" for placement
        // (seen on a loaded machine right after the cluster formed): give it a few seconds.
        let config = jetstream::stream::Config {
            name: "R3".into(),
            subjects: vec!["r3.>".into()],
            num_replicas: 3,
            ..Default::default()
        };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
        loop {
            match js.create_stream(config.clone()).await {
                Ok(_) => break,
                Err(error) if std::time::Instant::now() < deadline => {
                    eprintln!("R3 stream not placed yet ({error}); retrying");
                    tokio::time::sleep(std::time::Duration::from_millis(250)).await;
                }
                Err(error) => panic!("R3 stream: {error:?}"),
            }
        }
        // A node may not know the stream for a moment after it was placed (seen in CI on a loaded
        // machine: StreamNotFound on the first publish): retry within the same few seconds.
        loop {
            match js.publish("r3.a", "1".into()).await.expect("publish").await {
                Ok(_) => break,
                Err(error) if std::time::Instant::now() < deadline => {
                    eprintln!("first publish to R3 not acknowledged yet ({error}); retrying");
                    tokio::time::sleep(std::time::Duration::from_millis(250)).await;
                }
                Err(error) => panic!("first publish to R3: {error:?}"),
            }
        }

        // Kill a node: the stream keeps taking writes on the other two.
        cluster.kill(0);
        assert!(!cluster.is_running(0));
        let mut stored = 1;
        let deadline = Instant::now() + Duration::from_secs(20);
        while stored < 5 && Instant::now() < deadline {
            let acked = match js.publish("r3.a", "x".into()).await {
                Ok(ack) => ack.await.is_ok(),
                Err(_) => false,
            };
            if acked {
                stored += 1;
            } else {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        assert_eq!(stored, 5, "writes go on with one node down");

        let cluster = tokio::task::spawn_blocking(move || {
            cluster.restart(0)?;
            anyhow::Ok(cluster)
        })
        .await
        .expect("join")
        .expect("restart");
        assert!(cluster.is_running(0));
        // The restarted node catches up: a client of it alone reads all five messages.
        let client = async_nats::connect(cluster.node(0).url())
            .await
            .expect("connect to the restarted node");
        let js = jetstream::new(client);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let messages = match js.get_stream("R3").await {
                Ok(mut stream) => stream.info().await.map(|i| i.state.messages).unwrap_or(0),
                Err(_) => 0,
            };
            if messages == 5 {
                break;
            }
            assert!(Instant::now() < deadline, "{messages} messages seen");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}
