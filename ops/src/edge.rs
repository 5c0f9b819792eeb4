//! The hardened HTTP edge every server of the project shares: a cap on open connections, a deadline
//! for a request's headers, a keep-alive idle timeout, a deadline for a whole request, and graceful
//! shutdown — so idle or slow clients cannot exhaust a server.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::Semaphore;
use tokio::time::Instant;

/// Limits of the HTTP edge. The defaults suit a service behind a load balancer or used directly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EdgeConfig {
    /// Time a client has to send a request's headers, counted from when the connection opens or
    /// falls idle after a response (hyper starts its clock there), so it also bounds a slowloris.
    pub header_read_timeout: Duration,
    /// Time a request may take from its headers to its response, body upload included.
    pub request_timeout: Duration,
    /// A kept-alive connection with no request in flight and no byte received for this long is
    /// closed. It can never be longer than `header_read_timeout` (whose clock also runs while idle).
    pub keep_alive_idle: Duration,
    /// Open connections at most; further clients wait in the kernel's accept queue.
    pub max_connections: usize,
}

impl Default for EdgeConfig {
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(30),
            keep_alive_idle: Duration::from_secs(5),
            max_connections: 1024,
        }
    }
}

impl EdgeConfig {
    /// Refuses zero durations and a zero connection cap, naming the setting.
    pub fn validate(&self) -> anyhow::Result<()> {
        for (name, value) in [
            ("header read timeout", self.header_read_timeout),
            ("request timeout", self.request_timeout),
            ("keep-alive idle timeout", self.keep_alive_idle),
        ] {
            anyhow::ensure!(!value.is_zero(), "the {name} must be longer than zero");
        }
        anyhow::ensure!(
            self.max_connections > 0,
            "the connection cap must be at least 1"
        );
        Ok(())
    }
}

/// A running server: its bound address and the task that ends after graceful shutdown.
#[derive(Debug)]
pub struct Served {
    /// Where it listens (useful with port 0).
    pub address: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Served {
    /// Waits until `shutdown` resolved and every open connection finished.
    pub async fn stopped(self) {
        let _ = self.task.await;
    }
}

/// Serves `router` on `listen` within the limits of `edge` until `shutdown` resolves; then stops
/// accepting, lets requests in flight finish, and closes the connections.
pub async fn serve_with(
    listen: SocketAddr,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
    edge: EdgeConfig,
) -> anyhow::Result<Served> {
    edge.validate()?;
    let listener = tokio::net::TcpListener::bind(listen).await?;
    let address = listener.local_addr()?;
    let router = router
        .layer(middleware::from_fn_with_state(
            edge.request_timeout,
            deadline,
        ))
        .layer(middleware::from_fn(problems));
    let task = tokio::spawn(accept_loop(listener, router, shutdown, edge));
    Ok(Served { address, task })
}

async fn accept_loop(
    listener: tokio::net::TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
    edge: EdgeConfig,
) {
    let permits = Arc::new(Semaphore::new(edge.max_connections));
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        // The permit is taken before accepting: over the cap, clients wait in the accept queue
        // instead of costing a task and buffers each.
        let permit = tokio::select! {
            () = &mut shutdown => break,
            permit = permits.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => break,
            },
        };
        let (stream, peer) = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let activity = Arc::new(Activity::new());
        let io = TokioIo::new(Watched {
            inner: stream,
            activity: activity.clone(),
        });
        let service = Dispatch {
            router: router.clone(),
            activity: activity.clone(),
        };
        let connection = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(edge.header_read_timeout)
            .serve_connection(io, service);
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            tokio::select! {
                result = connection => {
                    if let Err(error) = result {
                        tracing::debug!(%peer, %error, "connection ended with an error");
                    }
                }
                () = idle(&activity, edge.keep_alive_idle) => {
                    tracing::debug!(%peer, "closing an idle connection");
                }
            }
            drop(permit);
        });
    }
    drop(listener);
    graceful.shutdown().await;
}

/// What a connection is doing: requests in flight and the last time a byte arrived or a response
/// was produced.
#[derive(Debug)]
struct Activity {
    in_flight: AtomicUsize,
    last: Mutex<Instant>,
}

impl Activity {
    fn new() -> Self {
        Self {
            in_flight: AtomicUsize::new(0),
            last: Mutex::new(Instant::now()),
        }
    }

    fn touch(&self) {
        if let Ok(mut last) = self.last.lock() {
            *last = Instant::now();
        }
    }

    fn last(&self) -> Instant {
        self.last.lock().map_or_else(|_| Instant::now(), |l| *l)
    }
}

/// Resolves once the connection has had no request in flight and received nothing for `limit`.
async fn idle(activity: &Activity, limit: Duration) {
    loop {
        let quiet_until = activity.last() + limit;
        if activity.in_flight.load(Ordering::Acquire) == 0 && Instant::now() >= quiet_until {
            return;
        }
        // A request in flight is the request timeout's business; look again later.
        tokio::time::sleep_until(quiet_until.max(Instant::now() + limit / 4)).await;
    }
}

/// The socket, noting every byte that arrives.
struct Watched {
    inner: tokio::net::TcpStream,
    activity: Arc<Activity>,
}

impl AsyncRead for Watched {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let poll = std::pin::Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.touch();
        }
        poll
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// Hands each request to the router, counting it as in flight until its response is ready.
#[derive(Clone)]
struct Dispatch {
    router: Router,
    activity: Arc<Activity>,
}

/// Ends a request's in-flight count even if the connection drops the request's future.
struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
        self.0.touch();
    }
}

impl hyper::service::Service<hyper::Request<hyper::body::Incoming>> for Dispatch {
    type Response = Response;
    type Error = std::convert::Infallible;
    type Future =
        std::pin::Pin<Box<dyn Future<Output = Result<Response, std::convert::Infallible>> + Send>>;

    fn call(&self, request: hyper::Request<hyper::body::Incoming>) -> Self::Future {
        self.activity.in_flight.fetch_add(1, Ordering::AcqRel);
        let guard = InFlight(self.activity.clone());
        let mut router = self.router.clone();
        Box::pin(async move {
            let response =
                tower_service::Service::call(&mut router, request.map(axum::body::Body::new)).await;
            drop(guard);
            response
        })
    }
}

/// Gives an error response without a body of its own (axum's default 404 and 405, a bare status from
/// a handler) an RFC 9457 problem body, so every server of the project answers errors alike.
async fn problems(request: Request, next: Next) -> Response {
    let response = next.run(request).await;
    let status = response.status();
    if !(status.is_client_error() || status.is_server_error())
        || response.headers().contains_key(header::CONTENT_TYPE)
    {
        return response;
    }
    let (parts, _) = response.into_parts();
    let detail = match status {
        StatusCode::NOT_FOUND => "no such route".to_owned(),
        StatusCode::METHOD_NOT_ALLOWED => "this route does not take that method".to_owned(),
        other => format!("the request failed with status {}", other.as_u16()),
    };
    let mut problem = problem(status, "http-error", &detail);
    for (name, value) in &parts.headers {
        // Keep what the status needs (`Allow` on 405) without the old body's length.
        if name != header::CONTENT_LENGTH {
            problem.headers_mut().insert(name.clone(), value.clone());
        }
    }
    problem
}

/// An `application/problem+json` response.
fn problem(status: StatusCode, kind: &str, detail: &str) -> Response {
    let body = serde_json::json!({
        "type": format!("urn:waybill:problem:{kind}"),
        "title": status.canonical_reason().unwrap_or("error"),
        "status": status.as_u16(),
        "detail": detail,
    });
    let mut response = (status, axum::Json(body)).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    response
}

/// Ends a request that outlives the request timeout with a 503 problem.
async fn deadline(State(limit): State<Duration>, request: Request, next: Next) -> Response {
    match tokio::time::timeout(limit, next.run(request)).await {
        Ok(response) => response,
        Err(_) => problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "request-timeout",
            &format!(
                "the request was not completed within the request timeout of {} s",
                limit.as_secs_f64()
            ),
        ),
    }
}
