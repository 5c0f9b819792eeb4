//! The HTTP edge over real sockets: slow or idle clients are dropped on time, the connection cap holds,
//! slow requests end in a 503 problem, bare error statuses become problems, shutdown stays graceful.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::get;
use ops::EdgeConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::oneshot;

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
    let (stop, stopped) = oneshot::channel::<()>();
    let served = ops::serve_with(
        loopback(),
        app(),
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
    let mut buf = [0u8; 1024];
    let deadline = Instant::now() + within;
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
async fn five_hundred_half_request_lines_are_dropped_within_the_header_timeout() {
    let edge = EdgeConfig {
        header_read_timeout: Duration::from_secs(1),
        ..EdgeConfig::default()
    };
    let (address, _stop, _served) = start(edge).await;
    let started = Instant::now();
    let mut streams = Vec::new();
    for _ in 0..500 {
        let mut stream = TcpStream::connect(address).await.expect("connect");
        stream.write_all(b"GET /hel").await.expect("half a line");
        streams.push(stream);
    }
    let checks = streams
        .into_iter()
        .map(|mut stream| async move { closed_within(&mut stream, Duration::from_secs(5)).await });
    let closed = futures_join_all(checks).await;
    assert!(closed.iter().all(|c| *c), "every slow connection is closed");
    let elapsed = started.elapsed();
    assert!(elapsed < Duration::from_secs(5), "took {elapsed:?}");
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
    stream
        .write_all(b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .expect("request");
    let mut buf = [0u8; 1024];
    let n = stream.read(&mut buf).await.expect("response");
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    let idle_since = Instant::now();
    assert!(closed_within(&mut stream, Duration::from_secs(5)).await);
    let idle = idle_since.elapsed();
    assert!(
        idle >= Duration::from_millis(400) && idle < Duration::from_secs(3),
        "closed after {idle:?}"
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
    tokio::time::sleep(Duration::from_millis(200)).await;
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(1))
        .build()
        .expect("client");
    let url = format!("http://{address}/hello");
    assert!(
        client.get(&url).send().await.is_err(),
        "a third connection is not served while two are open"
    );
    drop(first);
    let response = client
        .get(&url)
        .send()
        .await
        .expect("served once a slot frees");
    assert_eq!(response.status(), 200);
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
    let (address, stop, served) = start(EdgeConfig::default()).await;
    let slow = tokio::spawn(reqwest::get(format!("http://{address}/slow")));
    tokio::time::sleep(Duration::from_millis(300)).await;
    drop(stop);
    let response = slow.await.expect("task").expect("answered");
    assert_eq!(response.text().await.expect("body"), "late");
    tokio::time::timeout(Duration::from_secs(5), served.stopped())
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
