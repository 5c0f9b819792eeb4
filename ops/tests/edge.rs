//! The HTTP edge over real sockets: slow or idle clients are dropped on time, the connection cap holds,
//! slow requests end in a 503 problem, bare error statuses become problems, shutdown stays graceful.
//!
//! These run on a loaded 2-core machine next to other suites, so no test bounds how fast the server is.
//! Where a deadline is the behaviour under test, a lower bound shows the server waited for it (timers
//! never fire early, so that bound is exact) and the upper bound is only several times the deadline,
//! short of whatever other limit would also close the connection.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::get;
use ops::EdgeConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{Notify, oneshot};

fn loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

fn app() -> Router {
    Router::new()
        .route("/hello", get(|| async { "hello" }))
        .route(
            "/slow",
            get(|| async {
                tokio::time::sleep(Duration::from_secs(3)).await;
                "late"
            }),
        )
}

/// Starts `app()` with `edge`; dropping the sender stops it.
async fn start(edge: EdgeConfig) -> (SocketAddr, oneshot::Sender<()>, ops::Served) {
    start_router(app(), edge).await
}

/// Starts `router` with `edge`; dropping the sender stops it.
async fn start_router(
    router: Router,
    edge: EdgeConfig,
) -> (SocketAddr, oneshot::Sender<()>, ops::Served) {
    let (stop, stopped) = oneshot::channel::<()>();
    let served = ops::serve_with(
        loopback(),
        router,
        async move {
            let _ = stopped.await;
        },
        edge,
    )
    .await
    .expect("serves");
    (served.address, stop, served)
}

/// Reads until the server closes the connection; true if it did within `within`.
async fn closed_within(stream: &mut TcpStream, within: Duration) -> bool {
    closed_before(stream, Instant::now() + within).await
}

/// Reads until the server closes the connection; true if it did before `deadline`.
async fn closed_before(stream: &mut TcpStream, deadline: Instant) -> bool {
    let mut buf = [0u8; 1024];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, stream.read(&mut buf)).await {
            Ok(Ok(0) | Err(_)) => return true,
            Ok(Ok(_)) => continue,
            Err(_) => return false,
        }
    }
}

#[tokio::test]
async fn five_hundred_half_request_lines_are_dropped_after_the_header_timeout() {
    let header_read_timeout = Duration::from_secs(1);
    let edge = EdgeConfig {
        header_read_timeout,
        // The idle watchdog would close them too: out of the way, so only the header timeout can.
        keep_alive_idle: Duration::from_secs(60),
        ..EdgeConfig::default()
    };
    let (address, _stop, _served) = start(edge).await;
    let mut streams = Vec::new();
    for _ in 0..500 {
        // Taken before connecting: the server's clock starts at accept, later, so a close is never
        // seen sooner than `header_read_timeout` after this.
        let opened = Instant::now();
        let mut stream = TcpStream::connect(address).await.expect("connect");
        stream.write_all(b"GET /hel").await.expect("half a line");
        streams.push((opened, stream));
    }
    // Several times the timeout past the last connection: only a server that keeps a slow client
    // (the bug this guards against) runs into it, not a slow machine firing 500 timers.
    let deadline = Instant::now() + header_read_timeout * 10;
    let checks = streams.into_iter().map(|(opened, mut stream)| async move {
        closed_before(&mut stream, deadline)
            .await
            .then(|| opened.elapsed())
    });
    let lifetimes = futures_join_all(checks).await;
    let kept = lifetimes.iter().filter(|l| l.is_none()).count();
    assert_eq!(kept, 0, "{kept} of 500 slow connections were still open");
    // Dropped because their headers were late, not refused or cut off early.
    let shortest = lifetimes.iter().flatten().min().expect("500 lifetimes");
    assert!(
        *shortest >= header_read_timeout,
        "a slow connection was closed after {shortest:?}, before the header-read timeout"
    );
    // And the server still answers.
    let body = reqwest::get(format!("http://{address}/hello"))
        .await
        .expect("get")
        .text()
        .await
        .expect("text");
    assert_eq!(body, "hello");
}

#[tokio::test]
async fn an_idle_kept_alive_connection_is_closed_after_the_idle_timeout() {
    let edge = EdgeConfig {
        header_read_timeout: Duration::from_secs(30),
        keep_alive_idle: Duration::from_millis(500),
        ..EdgeConfig::default()
    };
    let (address, _stop, _served) = start(edge).await;
    let mut stream = TcpStream::connect(address).await.expect("connect");
    // Taken before the request's last byte leaves: the server's idle clock restarts no sooner than
    // that byte arrives, so the close cannot be seen sooner than `keep_alive_idle` after this.
    let sent = Instant::now();
    stream
        .write_all(b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .expect("request");
    let mut buf = [0u8; 1024];
    let n = stream.read(&mut buf).await.expect("response");
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    // The header-read timeout (30 s, whose clock also runs while idle) would close it too: a close
    // within a third of it can only be the idle watchdog's, and that is still 20 times the idle limit.
    assert!(
        closed_within(&mut stream, Duration::from_secs(10)).await,
        "a kept-alive connection idle for 10 s is still open"
    );
    let lifetime = sent.elapsed();
    assert!(
        lifetime >= Duration::from_millis(500),
        "closed {lifetime:?} after the request, before the idle timeout"
    );
}

#[tokio::test]
async fn connections_over_the_cap_wait_until_one_closes() {
    let edge = EdgeConfig {
        max_connections: 2,
        header_read_timeout: Duration::from_secs(30),
        keep_alive_idle: Duration::from_secs(30),
        ..EdgeConfig::default()
    };
    let (address, _stop, _served) = start(edge).await;
    let mut first = TcpStream::connect(address).await.expect("connect");
    first.write_all(b"GET").await.expect("partial");
    let mut second = TcpStream::connect(address).await.expect("connect");
    second.write_all(b"GET").await.expect("partial");
    // The kernel completes the handshake and queues the third; the server must not take it yet. The
    // accept queue is first in, first out, so the two above hold the slots however slow the server.
    let mut third = TcpStream::connect(address).await.expect("connect");
    third
        .write_all(b"GET /hello HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .expect("request");
    let mut buf = [0u8; 1024];
    // A slow server can only make this wait come out the same way, so a short one proves enough.
    assert!(
        tokio::time::timeout(Duration::from_secs(1), third.read(&mut buf))
            .await
            .is_err(),
        "a third connection is not served while two are open"
    );
    drop(first);
    // The same connection, still waiting, is served once a slot frees: it was queued, not refused.
    let mut response = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), third.read_to_end(&mut response))
        .await
        .expect("served once a slot frees")
        .expect("a response");
    let response = String::from_utf8_lossy(&response);
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    assert!(response.ends_with("hello"), "{response}");
    drop(second);
}

#[tokio::test]
async fn a_request_over_the_request_timeout_is_a_503_problem() {
    let edge = EdgeConfig {
        request_timeout: Duration::from_millis(300),
        ..EdgeConfig::default()
    };
    let (address, _stop, _served) = start(edge).await;
    let response = reqwest::get(format!("http://{address}/slow"))
        .await
        .expect("get");
    assert_eq!(response.status(), 503);
    assert_eq!(
        response.headers()["content-type"],
        "application/problem+json"
    );
    let body: serde_json::Value = response.json().await.expect("json");
    assert!(
        body["detail"]
            .as_str()
            .is_some_and(|d| d.contains("request timeout")),
        "{body}"
    );
}

#[tokio::test]
async fn bare_error_statuses_become_problems() {
    let (address, _stop, _served) = start(EdgeConfig::default()).await;
    let client = reqwest::Client::new();
    let missing = client
        .get(format!("http://{address}/nowhere"))
        .send()
        .await
        .expect("get");
    assert_eq!(missing.status(), 404);
    assert_eq!(
        missing.headers()["content-type"],
        "application/problem+json"
    );
    let wrong = client
        .delete(format!("http://{address}/hello"))
        .send()
        .await
        .expect("delete");
    assert_eq!(wrong.status(), 405);
    assert_eq!(wrong.headers()["content-type"], "application/problem+json");
    assert!(wrong.headers().contains_key("allow"));
}

#[tokio::test]
async fn shutdown_lets_a_request_in_flight_finish() {
    // The handler says when it runs: shutdown must start while the request is in flight, which a
    // fixed sleep before stopping does not ensure on a loaded machine.
    let entered = Arc::new(Notify::new());
    let router = Router::new().route(
        "/slow",
        get({
            let entered = entered.clone();
            move || async move {
                entered.notify_one();
                tokio::time::sleep(Duration::from_secs(1)).await;
                "late"
            }
        }),
    );
    let (address, stop, served) = start_router(router, EdgeConfig::default()).await;
    let slow = tokio::spawn(reqwest::get(format!("http://{address}/slow")));
    entered.notified().await;
    drop(stop);
    let response = slow.await.expect("task").expect("answered");
    assert_eq!(response.text().await.expect("body"), "late");
    // Only a guard against a server that never stops: graceful shutdown has nothing left to wait for.
    tokio::time::timeout(Duration::from_secs(30), served.stopped())
        .await
        .expect("the server stops once idle");
    assert!(
        TcpStream::connect(address).await.is_err(),
        "no longer accepting"
    );
}

#[test]
fn zero_limits_are_refused() {
    let edge = EdgeConfig {
        max_connections: 0,
        ..EdgeConfig::default()
    };
    assert!(edge.validate().is_err());
    assert!(EdgeConfig::default().validate().is_ok());
}

/// `futures::future::join_all` without the dependency: one task per future.
async fn futures_join_all<F>(futures: impl IntoIterator<Item = F>) -> Vec<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    let handles: Vec<_> = futures.into_iter().map(tokio::spawn).collect();
    let mut out = Vec::new();
    for handle in handles {
        out.push(handle.await.expect("task"));
    }
    out
}
