//! A TCP proxy whose connections a test can break on the client's side only, as a network fault
//! does: the client sees its connection close while the server's session goes on, unaware, with
//! whatever statement it was running. For the faults where "the connection broke" and "the server
//! stopped" are not the same thing.

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// A running proxy on a free loopback port; stops (and drops every connection) when dropped.
#[derive(Debug)]
pub struct CutProxy {
    address: SocketAddr,
    /// Each live connection's cut switch, by the local port of its server-side socket (what
    /// PostgreSQL shows as `client_port` in `pg_stat_activity`).
    switches: Arc<Mutex<HashMap<u16, oneshot::Sender<()>>>>,
    accept: JoinHandle<()>,
}

impl CutProxy {
    /// Listens on a free loopback port and forwards every connection to `upstream`.
    pub async fn start(upstream: SocketAddr) -> io::Result<Self> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let address = listener.local_addr()?;
        let switches = Arc::new(Mutex::new(HashMap::new()));
        let accept = tokio::spawn({
            let switches = switches.clone();
            async move {
                while let Ok((client, _)) = listener.accept().await {
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        continue;
                    };
                    let Ok(port) = server.local_addr().map(|a| a.port()) else {
                        continue;
                    };
                    let (cut, on_cut) = oneshot::channel();
                    switches.lock().expect("switches").insert(port, cut);
                    tokio::spawn(forward(client, server, on_cut));
                }
            }
        });
        Ok(Self {
            address,
            switches,
            accept,
        })
    }

    /// The port to connect to instead of the upstream's.
    pub fn port(&self) -> u16 {
        self.address.port()
    }

    /// Closes the client's side of the connection whose server-side socket has local port
    /// `server_side_port`, and keeps the server's side open, reading and discarding whatever the
    /// server sends. False when there is no such connection.
    pub fn cut(&self, server_side_port: u16) -> bool {
        let switch = self
            .switches
            .lock()
            .expect("switches")
            .remove(&server_side_port);
        switch.is_some_and(|cut| cut.send(()).is_ok())
    }
}

impl Drop for CutProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

async fn forward(client: TcpStream, server: TcpStream, on_cut: oneshot::Receiver<()>) {
    let (mut from_client, mut to_client) = client.into_split();
    let (mut from_server, mut to_server) = server.into_split();
    let both = async {
        tokio::join!(
            tokio::io::copy(&mut from_client, &mut to_server),
            tokio::io::copy(&mut from_server, &mut to_client)
        )
    };
    tokio::select! {
        _ = both => return,
        cut = on_cut => if cut.is_err() { return },
    }
    // The client's socket closes: the client learns at once that the connection is gone.
    drop((from_client, to_client));
    // The server's side stays open, as after a partition: its session goes on until it next
    // reads, and its answers are swallowed.
    let _ = tokio::io::copy(&mut from_server, &mut tokio::io::sink()).await;
    drop(to_server);
}
