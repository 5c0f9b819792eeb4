//! `waybill load`: a load generator that plays realistic order lifecycles (placed, then paid and
//! shipped or cancelled, some left unpaid) against the order service, with a progress bar and a summary.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::Context;
use futures::StreamExt;
use serde_json::json;
use store::{EventStore, GroupCommit, OutboxNotifier};

use crate::demo::scenario::{Played, play_one};
use crate::http::{Http, Orders};

/// `waybill load` options.
#[derive(Debug, clap::Args)]
pub(crate) struct LoadArgs {
    /// Print the summary as JSON on standard output.
    #[arg(long)]
    pub json: bool,

    /// Order lifecycles to play.
    #[arg(long, default_value_t = 1000)]
    pub orders: usize,

    /// Lifecycles in flight at once.
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,

    /// Start at most this many lifecycles per second (no limit when absent).
    #[arg(long)]
    pub rate: Option<f64>,

    /// The order service to load, e.g. http://127.0.0.1:8080. Without it, an order service is started
    /// in this process on DATABASE_URL.
    #[arg(long, value_name = "URL")]
    pub api: Option<String>,
}

/// Plays the lifecycles and prints the summary.
pub(crate) async fn run(database_url: &str, args: LoadArgs) -> anyhow::Result<()> {
    let json_output = args.json;
    let (stop, _) = tokio::sync::watch::channel(false);
    let base = match &args.api {
        Some(base) => base.trim_end_matches('/').to_owned(),
        None => {
            let pool = ops::database::connect(database_url, "waybill-load", 32)
                .await
                .context("connecting to PostgreSQL")?;
            let store = EventStore::new(pool.clone())
                .with_group_commit(GroupCommit::spawn(
                    pool.clone(),
                    GroupCommit::DEFAULT_WRITERS.into(),
                ))
                .with_notifier(OutboxNotifier::spawn(pool, Duration::from_millis(5)));
            let mut watcher = stop.subscribe();
            let address = ops::serve(
                SocketAddr::from(([127, 0, 0, 1], 0)),
                waybill::http::router(store),
                async move {
                    let _ = watcher.wait_for(|s| *s).await;
                },
            )
            .await?;
            format!("http://{address}")
        }
    };
    let api = Orders::new(&base, Http::default());
    let played = Arc::new(Played::default());
    let bar = indicatif::ProgressBar::new(args.orders as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {pos}/{len} lifecycles, {per_sec}, eta {eta}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    // A different slice of the deterministic story on every run, so repeated loads add new orders.
    let offset =
        usize::try_from(chrono::Utc::now().timestamp_millis().rem_euclid(1_000_000)).unwrap_or(0);
    let pacing = args.rate.filter(|r| *r > 0.0).map(|r| {
        let mut ticker = tokio::time::interval(Duration::from_secs_f64(1.0 / r));
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        Arc::new(tokio::sync::Mutex::new(ticker))
    });
    let started = Instant::now();
    let results: Vec<(u64, Result<(), String>)> = futures::stream::iter(0..args.orders)
        .map(|i| {
            let (api, played, pacing, bar) =
                (api.clone(), played.clone(), pacing.clone(), bar.clone());
            async move {
                if let Some(pacing) = pacing {
                    pacing.lock().await.tick().await;
                }
                let began = Instant::now();
                let outcome = play_one(&api, offset + i, &played)
                    .await
                    .map_err(|e| format!("{e:#}"));
                bar.inc(1);
                (
                    u64::try_from(began.elapsed().as_micros()).unwrap_or(u64::MAX),
                    outcome,
                )
            }
        })
        .buffer_unordered(args.concurrency.max(1))
        .collect()
        .await;
    bar.finish_and_clear();
    let _ = stop.send(true);

    let elapsed = started.elapsed().as_secs_f64();
    let errors: Vec<&String> = results
        .iter()
        .filter_map(|(_, r)| r.as_ref().err())
        .collect();
    let latency = testkit::stats::percentiles(results.iter().map(|(us, _)| *us).collect());
    let count = |c: &std::sync::atomic::AtomicUsize| c.load(Ordering::Relaxed);
    let commands = count(&played.placed)
        + count(&played.paid)
        + count(&played.shipped)
        + count(&played.cancelled)
        + count(&played.refused);
    let summary = json!({
        "lifecycles": args.orders,
        "placed": count(&played.placed),
        "paid": count(&played.paid),
        "shipped": count(&played.shipped),
        "cancelled": count(&played.cancelled),
        "refused_as_expected": count(&played.refused),
        "errors": errors.len(),
        "commands": commands,
        "seconds": elapsed,
        "commands_per_s": commands as f64 / elapsed,
        "lifecycle_ms": {"p50": latency.p50 as f64 / 1000.0, "p99": latency.p99 as f64 / 1000.0, "max": latency.max as f64 / 1000.0},
        "api": base,
    });
    if json_output {
        println!("{summary}");
    } else {
        println!(
            "{} lifecycles in {elapsed:.1} s against {base}: {} placed, {} paid, {} shipped, {} cancelled, {} refused as expected",
            args.orders,
            summary["placed"],
            summary["paid"],
            summary["shipped"],
            summary["cancelled"],
            summary["refused_as_expected"]
        );
        println!(
            "{commands} commands, {:.0} commands/s; lifecycle latency p50 {:.1} ms, p99 {:.1} ms; {} error(s)",
            commands as f64 / elapsed,
            latency.p50 as f64 / 1000.0,
            latency.p99 as f64 / 1000.0,
            errors.len()
        );
    }
    if let Some(first) = errors.first() {
        anyhow::bail!("{} lifecycle(s) failed; the first: {first}", errors.len());
    }
    Ok(())
}
