//! Turns Nagle's algorithm off on every pooled PostgreSQL connection over TCP.
//!
//! sqlx 0.9.0 opens its sockets without `TCP_NODELAY` (a regression of that release; the fix is
//! merged upstream but not yet released). A statement whose parameters do not fit in one write (a
//! batch of a few hundred rows, about 16 KiB and up) then sends its last segment only once the
//! server acknowledges the first, and the server delays that acknowledgement by 40 ms: measured
//! here, the points projection's ledger statement took 48 ms instead of 3 ms, and its apply rate
//! tripled with the option set.
//!
//! sqlx gives no access to its socket, so after a connection is opened the server is asked which
//! client port it sees, the process's own socket with that port is found among its descriptors, and
//! the option is set on a duplicate of it (`pidfd_getfd` on this very process: safe code, and the
//! duplicate keeps the socket alive while it is inspected). Connections over a Unix socket, or
//! through a proxy whose port differs, are left as they are; nothing here can fail a connection.
//! Delete this module once sqlx sets the option itself.

use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::sync::Once;

use rustix::net::{getpeername, getsockname, sockopt};
use rustix::process::{PidfdFlags, PidfdGetfdFlags, getpid, pidfd_getfd, pidfd_open};
use sqlx::PgConnection;

/// Sets `TCP_NODELAY` on `connection`'s socket when it is a TCP connection of this process.
pub(crate) async fn disable_nagle(connection: &mut PgConnection) -> sqlx::Result<()> {
    let ports: sqlx::Result<(Option<i32>, Option<i32>)> =
        sqlx::query_as("SELECT inet_client_port(), inet_server_port()")
            .fetch_one(connection)
            .await;
    // A server that cannot say (a proxy or another engine speaking the protocol) keeps the option.
    let Ok((client_port, server_port)) = ports.inspect_err(|error| {
        tracing::debug!(%error, "the server did not name the client port; TCP_NODELAY not set");
    }) else {
        return Ok(());
    };
    // NULL over a Unix socket, where there is no Nagle's algorithm to turn off.
    let (Some(client_port), Some(server_port)) = (client_port, server_port) else {
        return Ok(());
    };
    let (Ok(client_port), Ok(server_port)) =
        (u16::try_from(client_port), u16::try_from(server_port))
    else {
        return Ok(());
    };
    match set_on_socket(client_port, server_port) {
        Ok(true) => {}
        Ok(false) => tracing::debug!(
            client_port,
            "no socket of this process has the port the server reports (a proxy?); TCP_NODELAY not set"
        ),
        Err(error) => {
            static WARNED: Once = Once::new();
            WARNED.call_once(|| {
                tracing::warn!(
                    %error,
                    "could not set TCP_NODELAY on PostgreSQL connections: statements with large \
                     parameters may wait 40 ms for the server's delayed acknowledgement"
                );
            });
        }
    }
    Ok(())
}

/// Finds this process's TCP socket from `local_port` to a server on `peer_port` and sets
/// `TCP_NODELAY` on it; false when there is none.
fn set_on_socket(local_port: u16, peer_port: u16) -> std::io::Result<bool> {
    match find_socket(local_port, peer_port)? {
        Some(socket) => {
            sockopt::set_tcp_nodelay(&socket, true)?;
            Ok(true)
        }
        None => Ok(false),
    }
}

/// A duplicate of this process's TCP socket from `local_port` to a server on `peer_port`.
fn find_socket(local_port: u16, peer_port: u16) -> std::io::Result<Option<OwnedFd>> {
    let this_process = pidfd_open(getpid(), PidfdFlags::empty())?;
    let port = |address: Option<rustix::net::SocketAddrAny>| {
        address
            .and_then(|a| SocketAddr::try_from(a).ok())
            .map(|a| a.port())
    };
    for entry in std::fs::read_dir("/proc/self/fd")? {
        let Ok(entry) = entry else { continue };
        let Some(fd) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        // Closed meanwhile, or not a socket.
        let Ok(target) = std::fs::read_link(entry.path()) else {
            continue;
        };
        if !target.to_string_lossy().starts_with("socket:") {
            continue;
        }
        let Ok(socket) = pidfd_getfd(&this_process, fd, PidfdGetfdFlags::empty()) else {
            continue;
        };
        if port(getsockname(&socket).ok()) == Some(local_port)
            && port(getpeername(&socket).ok().flatten()) == Some(peer_port)
        {
            return Ok(Some(socket));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pool's connection to PostgreSQL over TCP has Nagle's algorithm off; without the pool's
    /// `after_connect` hook, sqlx 0.9.0 leaves it on.
    #[tokio::test]
    async fn pooled_tcp_connections_have_nagle_off() {
        let url = std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
        let pool = crate::database::connect(&url, "waybill-nodelay-test", 1)
            .await
            .expect("connects");
        let (client_port, server_port): (Option<i32>, Option<i32>) =
            sqlx::query_as("SELECT inet_client_port(), inet_server_port()")
                .fetch_one(&pool)
                .await
                .expect("asks");
        let (Some(client_port), Some(server_port)) = (client_port, server_port) else {
            panic!("DATABASE_URL {url} is not a TCP address: this test needs one");
        };
        let port = |p: i32| u16::try_from(p).expect("a TCP port");
        let socket = find_socket(port(client_port), port(server_port))
            .expect("reads this process's sockets")
            .expect("finds the connection's socket");
        assert!(sockopt::tcp_nodelay(&socket).expect("reads the option"));
    }
}
