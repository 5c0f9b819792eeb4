//! The operator's window into a running service: Prometheus metrics at `/metrics` and a health check at
//! `/health`, served on their own address so they stay reachable whatever the service is busy with.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// Answers whether the service is healthy, with a JSON body explaining why.
pub type HealthCheck =
    Arc<dyn Fn() -> Pin<Box<dyn Future<Output = (bool, serde_json::Value)> + Send>> + Send + Sync>;

/// Installs the global Prometheus recorder (once per process) and returns its handle.
pub fn install_metrics_recorder() -> anyhow::Result<PrometheusHandle> {
    use std::sync::OnceLock;
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    if let Some(handle) = HANDLE.get() {
        return Ok(handle.clone());
    }
    let handle = PrometheusBuilder::new()
        // Latency buckets from 100 µs to 10 s: covers a pipelined PubAck and a timed-out one.
        .set_buckets(&[
            0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
            2.5, 5.0, 10.0,
        ])?
        .install_recorder()?;
    Ok(HANDLE.get_or_init(|| handle).clone())
}

#[derive(Clone)]
struct Telemetry {
    metrics: PrometheusHandle,
    health: HealthCheck,
}

/// The `/metrics` and `/health` routes, to serve alone or merge into a service's own router.
pub fn telemetry_routes(metrics: PrometheusHandle, health: HealthCheck) -> Router {
    Router::new()
        .route("/metrics", get(render_metrics))
        .route("/health", get(check_health))
        .with_state(Telemetry { metrics, health })
}

/// Serves `router` on `listen` behind the default HTTP edge (see [`crate::EdgeConfig`]) until
/// `shutdown` resolves; returns the bound address (useful with port 0).
pub async fn serve(
    listen: SocketAddr,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<SocketAddr> {
    let served =
        crate::edge::serve_with(listen, router, shutdown, crate::EdgeConfig::default()).await?;
    tracing::info!(bound = %served.address, "serving HTTP");
    Ok(served.address)
}

async fn render_metrics(State(t): State<Telemetry>) -> Response {
    t.metrics.run_upkeep();
    (
        [("content-type", "text/plain; version=0.0.4")],
        t.metrics.render(),
    )
        .into_response()
}

async fn check_health(State(t): State<Telemetry>) -> Response {
    let (healthy, details) = (t.health)().await;
    let status = if healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, axum::Json(details)).into_response()
}
