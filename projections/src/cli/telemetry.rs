//! `run --metrics-listen`: the metrics recorder, `/metrics` and `/health`, and the lag, held and
//! parked gauges refreshed while the projection runs.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;

use crate::held;
use crate::park;
use crate::projection::Projection;
use crate::runner::Runner;

/// Why `run --metrics-listen` could not serve metrics.
#[derive(Debug, thiserror::Error)]
pub(super) enum TelemetryError {
    #[error("installing the metrics recorder")]
    Recorder(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("serving metrics on {listen}")]
    Serve {
        listen: SocketAddr,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

pub(super) async fn serve_telemetry<P: Projection>(
    runner: &Arc<Runner<P>>,
    listen: SocketAddr,
) -> Result<(), TelemetryError> {
    let metrics = ops::install_metrics_recorder()
        .map_err(|source| TelemetryError::Recorder(source.into()))?;
    crate::metrics::describe();
    if !runner.config().share {
        crate::metrics::record_owned(P::NAME, &runner.config().partitions);
    }
    let health_runner = runner.clone();
    let health: ops::HealthCheck = Arc::new(move || {
        let runner = health_runner.clone();
        Box::pin(async move {
            let database = sqlx::query("SELECT 1").execute(runner.pool()).await.is_ok();
            let nats =
                runner.client().connection_state() == async_nats::connection::State::Connected;
            let config = runner.config();
            (
                database && nats,
                json!({"projection": P::NAME, "database": database, "nats": nats,
                       "instance": runner.instance(),
                       "partitions": {"count": config.partitions.count(),
                                      "owned": runner.owned_partitions(),
                                      "shared": config.share}}),
            )
        })
    });
    let router = ops::telemetry_routes(metrics, health);
    let bound = ops::serve(listen, router, ops::shutdown_signal())
        .await
        .map_err(|source| TelemetryError::Serve {
            listen,
            source: source.into(),
        })?;
    tracing::info!(%bound, projection = P::NAME, "metrics at http://{bound}/metrics");
    Ok(())
}

/// Refreshes the lag, held and parked gauges every 5 s.
pub(super) async fn refresh_gauges<P: Projection>(runner: Arc<Runner<P>>) {
    loop {
        let partitions = &runner.config().partitions;
        let mut total = Some((0, 0));
        for partition in runner.owned_partitions() {
            match runner.lag_of(&runner.partition_consumer(partition)).await {
                Ok((pending, ack_pending)) => {
                    if !partitions.is_single() {
                        crate::metrics::record_partition_lag(
                            P::NAME,
                            partitions.label(partition),
                            pending,
                            ack_pending,
                        );
                    }
                    total = total.map(|(p, a)| (p + pending, a + ack_pending));
                }
                Err(_) => total = None,
            }
        }
        if let Some((pending, ack_pending)) = total {
            crate::metrics::record_lag(P::NAME, pending, ack_pending);
        }
        if let (Ok(held), Ok(parked)) = (
            held::stats(runner.pool()).await,
            park::open_count(runner.pool()).await,
        ) {
            crate::metrics::record_backlog(P::NAME, &held, parked);
        }
        tokio::time::sleep(Duration::from_secs(5)).await;
    }
}
