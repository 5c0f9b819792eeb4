//! Runs one shared command (`run`, `rebuild`, `redrive`, `parked …`, `held …`) for a projection:
//! connects its runner, checks its schema, and hands the work to the runner.

use std::sync::Arc;

use anyhow::Context;
use sqlx::PgPool;

use super::args::{Common, Connection};
use super::faults::Faults;
use super::summary::{Progress, print_summary};
use super::telemetry::{refresh_gauges, serve_telemetry};
use crate::projection::Projection;
use crate::runner::Runner;

/// Runs a shared command for projection `P`, with `faults` (none but in the faulty twin).
/// `read_routes` are served by `run --listen`.
pub async fn run_common<P: Projection>(
    projection: P,
    connection: &Connection,
    command: Common,
    json_output: bool,
    read_routes: impl FnOnce(PgPool) -> axum::Router,
    faults: Faults,
) -> anyhow::Result<()> {
    let mut config = connection.runner_config()?;
    #[cfg(feature = "fault-injection")]
    super::faults::apply_faults(P::NAME, &command, faults)?;
    config.fail_point = faults.fail_point;
    let runner = Arc::new(
        Runner::connect(
            projection,
            &connection.shared.database.url,
            connection.shared.nats.clone(),
            config,
        )
        .await?,
    );
    if !matches!(command, Common::Rebuild) {
        crate::schema::check_layout(runner.pool(), P::NAME).await?;
    }
    match command {
        Common::Run(args) => {
            if let Some(listen) = args.listen {
                let operator = args.operator_token.is_some();
                let routes = read_routes(runner.pool().clone()).merge(crate::operator_api::routes(
                    runner.clone(),
                    args.operator_token.clone(),
                ));
                let bound = ops::serve(listen, routes, ops::shutdown_signal())
                    .await
                    .with_context(|| format!("serving the read API on {listen}"))?;
                tracing::info!(%bound, projection = P::NAME, operator, "read API at http://{bound}");
            }
            if let Some(listen) = args.metrics_listen {
                serve_telemetry(&runner, listen).await?;
            }
            let lag = tokio::spawn(refresh_gauges(runner.clone()));
            tracing::info!(
                projection = P::NAME,
                once = args.once,
                partitions = %runner.config().partitions,
                "projection starting"
            );
            let mut progress = Progress::new(P::NAME);
            let tally = runner
                .run(ops::shutdown_signal(), args.once, |tally| {
                    progress.log(tally)
                })
                .await?;
            lag.abort();
            print_summary(&runner, "consumed", &tally, json_output).await?;
        }
        Common::Rebuild => {
            let total = runner.history_size().await;
            let bar =
                indicatif::ProgressBar::new(total).with_message(format!("rebuilding {}", P::NAME));
            bar.set_style(
                indicatif::ProgressStyle::with_template(
                    "{msg} [{bar:40}] {pos}/{len} events, {per_sec}, eta {eta}",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            let mut progress = Progress::new(P::NAME);
            let tally = runner
                .rebuild(|tally| {
                    bar.set_position(tally.messages);
                    if bar.is_hidden() {
                        progress.log(tally);
                    }
                })
                .await?;
            bar.finish_and_clear();
            print_summary(&runner, "rebuilt from", &tally, json_output).await?;
        }
        operator => super::operator::answer(&runner, operator, json_output).await?,
    }
    Ok(())
}
