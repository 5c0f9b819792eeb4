//! `waybill demo`: the whole system on one machine in about a minute. Migrates a database and
//! provisions a stream of its own for the run, starts the order service, the three projections,
//! every read model of `projections/src/models/` and (after reproducing the crash window) the relay,
//! plays a scripted story over HTTP, injects a legacy v1 event and a duplicate publish, waits for
//! everything to settle while showing progress, and compares what the projections say with what the
//! event store says. Exits 0 only when they agree. Then it removes the database and the stream (with
//! `--keep`, only after Ctrl-C).

mod facts;
pub(crate) mod fleet;
mod rollout;
pub(crate) mod scenario;
pub(crate) mod services;
mod verify;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::Context;
use async_nats::jetstream;
use serde_json::json;
use sqlx::PgPool;
use uuid::Uuid;

use facts::Watched;
use fleet::{Fleet, Wiring};
use scenario::Played;

use crate::http::{self, Http, Orders};
use services::Services;

/// The demo's database, stream and subject prefix by default: these, suffixed with the run's start
/// time and process id (`waybill_demo_20261204_191502_4242`), so that the story starts from nothing
/// and two runs on one server cannot collide; flags and the environment choose others.
const DATABASE: &str = "waybill_demo";
const STREAM: &str = "WAYBILL_DEMO";
const PREFIX: &str = "waybill.demo";

/// `waybill demo` options.
#[derive(Debug, clap::Args)]
pub(crate) struct DemoArgs {
    /// Run the order service, the relay and the projections as separate processes (the sibling
    /// binaries of this one) instead of tasks in this process.
    #[arg(long)]
    pub processes: bool,

    /// How many order lifecycles to play.
    #[arg(long, default_value_t = 60)]
    pub orders: usize,

    /// The database the demo recreates for itself on the PostgreSQL server of --database-url, and
    /// drops at the end (default: waybill_demo_TIME_PID, one per run; waybill_rollout, kept,
    /// with --rollout).
    #[arg(long, env = "WAYBILL_DEMO_DATABASE")]
    pub database_name: Option<String>,

    /// The JetStream stream the demo recreates for itself, and deletes at the end (default:
    /// WAYBILL_DEMO_TIME_PID; WAYBILL_ROLLOUT, kept, with --rollout).
    #[arg(long, env = "WAYBILL_DEMO_STREAM")]
    pub stream: Option<String>,

    /// Its subject prefix (default: waybill.demo_TIME_PID, or waybill.rollout with --rollout).
    #[arg(long, env = "WAYBILL_DEMO_SUBJECT_PREFIX")]
    pub subject_prefix: Option<String>,

    /// After the verdict (pass or fail), leave everything running — services, database, stream —
    /// and print where they are, for exploring; Ctrl-C (or SIGTERM) then stops and removes them.
    /// Without it they are removed at once. Not with --rollout, which leaves its database and
    /// stream behind.
    #[arg(long, conflicts_with = "rollout")]
    pub keep: bool,

    /// Tell the rolling upgrade of order.placed from v2 to v3 instead, over the real processes:
    /// projections started as old readers (--max-version order.placed=2) and the order service as
    /// an old writer (--write-version order.placed=2); then the writer moves to v3 too early, the
    /// old readers park v3 orders and hold what follows them; the readers are upgraded and redrive;
    /// the projections are compared with the event store. Needs every binary built.
    #[arg(long)]
    pub rollout: bool,

    /// NATS server URL (a private one is started when it does not answer).
    #[arg(
        long,
        env = "NATS_URL",
        default_value = "nats://127.0.0.1:4222",
        hide_env_values = true
    )]
    pub nats_url: String,
}

/// Runs the demo (or, with `--rollout`, the rollout story).
pub(crate) async fn run(database_url: &str, args: DemoArgs) -> anyhow::Result<()> {
    let started = Instant::now();
    let services = Services::ensure(database_url, &args.nats_url)?;
    step(started, "services");
    for line in services.describe() {
        println!("           {line}");
    }
    let (database, stream, prefix) = if args.rollout {
        let (database, stream, prefix) = rollout::NAMES;
        (database.to_owned(), stream.to_owned(), prefix.to_owned())
    } else {
        let run = format!(
            "{}_{}",
            chrono::Utc::now().format("%Y%m%d_%H%M%S"),
            std::process::id()
        );
        (
            format!("{DATABASE}_{run}"),
            format!("{STREAM}_{run}"),
            format!("{PREFIX}_{run}"),
        )
    };
    let database = args.database_name.clone().unwrap_or(database);
    let wiring = Wiring {
        database_url: services.database_url(&database),
        nats_url: services.nats_url.clone(),
        stream: args.stream.clone().unwrap_or(stream),
        subject_prefix: args.subject_prefix.clone().unwrap_or(prefix),
        log_filter: fleet::DEMO_LOG_FILTER,
        read_models: true,
    };
    let pool = fresh_database(&services, &database, &wiring.database_url).await?;
    let js = jetstream::new(
        async_nats::connect(&wiring.nats_url)
            .await
            .context("connecting to NATS")?,
    );
    let _ = js.delete_stream(&wiring.stream).await;
    let settings = relay::StreamSettings {
        name: wiring.stream.clone(),
        subject_prefix: wiring.subject_prefix.clone(),
        ..Default::default()
    };
    relay::ensure_stream(&js, &settings, false).await?;
    step(
        started,
        &format!(
            "fresh database {database} migrated, fresh stream {} ({}.>)",
            wiring.stream, wiring.subject_prefix
        ),
    );
    if args.rollout {
        let outcome = rollout::tell(&wiring, &pool, &js, started).await;
        drop(services);
        return outcome;
    }

    let mut fleet = Fleet::start(args.processes, wiring.clone()).await?;
    let shape = if args.processes {
        "separate processes"
    } else {
        "tasks in this process"
    };
    step(
        started,
        &format!(
            "order service at {}, console at {}/console and projections {} running as {shape}",
            fleet.api,
            fleet.console,
            projections::registry::names().join(", ")
        ),
    );
    let outcome = play_and_check(&mut fleet, &pool, &js, &args, started).await;
    if args.keep
        && let Err(error) = keep_until_stopped(&fleet, &database, &wiring, &outcome).await
    {
        eprintln!("demo: cannot keep the services running: {error:#}");
    }
    let logs = fleet.stop().await;
    if let Some(logs) = logs {
        println!("           service logs: {}", logs.display());
    }
    pool.close().await;
    match remove(&services, &database, &js, &wiring.stream).await {
        Ok(()) => println!(
            "           removed the database {database} and the stream {}{}",
            wiring.stream,
            if args.keep {
                ""
            } else {
                " (--keep leaves them, and the services, running)"
            }
        ),
        Err(error) => eprintln!(
            "demo: could not remove the database {database} or the stream {}: {error:#}",
            wiring.stream
        ),
    }
    drop(services);
    outcome
}

/// `--keep`: says where everything is and waits for SIGINT (Ctrl-C) or SIGTERM. The handlers are in
/// place before the line saying so is printed, so a signal sent on reading it is never missed.
async fn keep_until_stopped(
    fleet: &Fleet,
    database: &str,
    wiring: &Wiring,
    outcome: &anyhow::Result<()>,
) -> anyhow::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut interrupt = signal(SignalKind::interrupt()).context("listening for SIGINT")?;
    let mut terminate = signal(SignalKind::terminate()).context("listening for SIGTERM")?;
    let verdict = match outcome {
        Ok(()) => "passed".to_owned(),
        Err(error) => format!("failed ({error:#})"),
    };
    println!(
        "
the demo {verdict}; everything is kept running for exploring:"
    );
    println!("           order service  {}", fleet.api);
    println!("           console        {}/console", fleet.console);
    for (name, url) in &fleet.reads {
        println!("           {name:<14} {url}");
    }
    println!(
        "           database {database}, stream {} (subjects {}.>)",
        wiring.stream, wiring.subject_prefix
    );
    println!("press Ctrl-C to stop the services and remove the database and the stream");
    tokio::select! {
        _ = interrupt.recv() => {}
        _ = terminate.recv() => {}
    }
    Ok(())
}

/// Drops the demo's database and deletes its stream.
async fn remove(
    services: &Services,
    database: &str,
    js: &jetstream::Context,
    stream: &str,
) -> anyhow::Result<()> {
    drop_database(services, database).await?;
    js.delete_stream(stream)
        .await
        .with_context(|| format!("deleting the stream {stream}"))?;
    Ok(())
}

async fn play_and_check(
    fleet: &mut Fleet,
    pool: &PgPool,
    js: &jetstream::Context,
    args: &DemoArgs,
    started: Instant,
) -> anyhow::Result<()> {
    let api = Orders::new(&fleet.api, Http::default());

    // 1. The crash window, before any relay runs for real. Each fact is read back before it is told.
    let first = api
        .place("alice", json!([http::line("MUG-BLUE", 2, 1250)]), None)
        .await?;
    let wiring = fleet.wiring().clone();
    let watched =
        Watched::first_event_of(pool, first, &wiring.stream, &wiring.subject_prefix).await?;
    fleet.crash_a_relay().await?;
    let crash_copy = watched.crash_window(pool, js).await?;
    step(
        started,
        &format!(
            "crash window: a relay published order {first}'s event, got its PubAck and died before marking it (checked: one copy in the stream, sequence {crash_copy}; outbox row still pending)"
        ),
    );
    fleet.start_relay().await?;
    let row = watched
        .deduplicated(
            pool,
            js,
            crash_copy,
            fleet::RELAY_ID,
            Duration::from_secs(15),
        )
        .await?;
    step(
        started,
        &format!(
            "relay started: it published that row again and JetStream recognised it — by its dedupe window or, on 2.10 and later, by the per-order fence first (checked: still one copy in the stream; the row is {} with stream sequence {crash_copy})",
            row.status
        ),
    );

    // 2. The story, over HTTP, with live progress.
    let played = Arc::new(Played::default());
    let story = tokio::spawn({
        let (api, played, orders) = (api.clone(), played.clone(), args.orders);
        async move { scenario::play(&api, orders, played).await }
    });
    let progress = tokio::spawn(progress(
        pool.clone(),
        js.clone(),
        wiring.stream.clone(),
        played.clone(),
        args.orders,
        started,
    ));
    let played_ok = story.await.context("the scenario task")?;
    progress.abort();
    played_ok?;
    let (first_try, retry) = scenario::idempotent_retry(&api).await?;
    anyhow::ensure!(
        first_try == retry,
        "an idempotent retry created a second order"
    );
    step(
        started,
        &format!(
            "played {} orders: {} paid, {} shipped, {} cancelled, {} commands refused as they should be; an Idempotency-Key retry returned the same order",
            played.placed.load(Ordering::Relaxed),
            played.paid.load(Ordering::Relaxed),
            played.shipped.load(Ordering::Relaxed),
            played.cancelled.load(Ordering::Relaxed),
            played.refused.load(Ordering::Relaxed)
        ),
    );

    // 3. A legacy v1 event, as an import from the old system would write it, then paid over HTTP.
    let legacy = legacy_order(pool).await?;
    api.expect(
        &format!("/orders/{legacy}/pay"),
        &json!({"amount_cents": 4200}),
        reqwest::StatusCode::OK,
    )
    .await
    .with_context(|| format!("paying the legacy order {legacy}"))?;
    step(
        started,
        &format!(
            "legacy order.placed v1 {{order_no, amount_cents: 4200}} appended for order {legacy} and paid; every reader upcasts it (the verdict below counts it: its points and its search document)"
        ),
    );

    // 4. A duplicate publish JetStream cannot catch: same event, another message id. The projections
    //    refuse a message whose id is not its event id (they park it), so the order counts once.
    republish_with_new_id(js, &wiring.stream, crash_copy).await?;
    let duplicate = watched.duplicated(js, crash_copy).await?;
    step(
        started,
        &format!(
            "published order {first}'s first event again under another Nats-Msg-Id (checked: the stream holds it twice, sequences {crash_copy} and {duplicate}): the projections must count it once (they park a message whose id is not its event id)"
        ),
    );

    // 5. Everything settles.
    let settled = wait_for(
        || settled(pool, js, &wiring.stream, &projections::registry::NAMES),
        Duration::from_secs(40),
    )
    .await;
    anyhow::ensure!(
        settled,
        "the outbox and the projections did not settle within 40 s"
    );
    // Read again after settling: nothing may have published a third copy, and the duplicate must be
    // parked by each projection rather than applied.
    anyhow::ensure!(
        watched.duplicated(js, crash_copy).await? == duplicate,
        "the duplicate of order {first}'s first event moved in the stream while settling"
    );
    facts::parked_by_every_projection(pool, duplicate).await?;
    step(
        started,
        &format!(
            "settled: every outbox row sent, projections caught up; the crash-window event is in the stream 2 times (1 relayed + 1 deliberate duplicate), and {} each parked the duplicate (sequence {duplicate})",
            facts::reading_orders().join(", ")
        ),
    );

    let shown = facts::console_agrees(pool, &fleet.console).await?;
    step(
        started,
        &format!(
            "the console shows the same: {shown} events stored, and every projection ({}) has applied each event of the aggregate types it reads",
            projections::registry::names().join(", ")
        ),
    );

    // 6. The verdict.
    let expected = verify::expected(pool).await?;
    let projected = verify::projected(&fleet.reads).await?;
    let mut disagreements = verify::report(&expected, &projected);
    let models = verify::models(&wiring.database_url, &fleet.reads).await;
    disagreements += verify::report_models(&models);
    let elapsed = started.elapsed();
    if disagreements == 0 {
        println!(
            "\nall {} projections agree with the event store ({:.1} s)",
            projections::registry::names().len(),
            elapsed.as_secs_f64()
        );
        Ok(())
    } else {
        anyhow::bail!("{disagreements} disagreement(s) between the projections and the event store")
    }
}

fn step(started: Instant, text: &str) {
    println!("[{:>5.1}s] {text}", started.elapsed().as_secs_f64());
}

/// Drops the database `name` (at `url`) if it exists, creates it and migrates it.
pub(crate) async fn fresh_database(
    services: &Services,
    name: &str,
    url: &str,
) -> anyhow::Result<PgPool> {
    drop_database(services, name).await?;
    ops::database::ensure_database(url).await?;
    let pool = ops::database::connect(url, "waybill-demo", 4).await?;
    store::migrate(&pool).await?;
    Ok(pool)
}

/// Drops the database `name` if it exists, ending its sessions.
pub(crate) async fn drop_database(services: &Services, name: &str) -> anyhow::Result<()> {
    anyhow::ensure!(
        !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
        "a database name here may only use letters, digits and '_'"
    );
    let admin =
        ops::database::connect(&services.database_url("postgres"), "waybill-demo", 1).await?;
    let dropped = sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"
    )))
    .execute(&admin)
    .await;
    admin.close().await;
    dropped.with_context(|| format!("dropping the database {name}"))?;
    Ok(())
}

/// Appends an `order.placed` v1 (the legacy shape) through the store, as a migration from the old
/// system would: the event and its outbox row in one statement.
async fn legacy_order(pool: &PgPool) -> anyhow::Result<Uuid> {
    let order = Uuid::now_v7();
    let envelope = testkit::legacy_placed(order);
    store::append(
        pool,
        order,
        0,
        &[envelope],
        &store::AppendOptions::default(),
    )
    .await?;
    store::notify_now(pool).await?;
    Ok(order)
}

/// Publishes the stored message at `sequence` again under a new message id (as a misbehaving producer
/// would), so JetStream stores a second copy.
async fn republish_with_new_id(
    js: &jetstream::Context,
    stream: &str,
    sequence: u64,
) -> anyhow::Result<()> {
    let stream = js.get_stream_no_info(stream).await?;
    let message = stream
        .get_raw_message(sequence)
        .await
        .with_context(|| format!("reading stream sequence {sequence}"))?;
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(
        domain::wire::MSG_ID,
        format!("demo-duplicate-{}", Uuid::now_v7()).as_str(),
    );
    js.publish_with_headers(message.subject.to_string(), headers, message.payload)
        .await?
        .await?;
    Ok(())
}

/// True when no outbox row waits and each projection of `names` has applied everything.
async fn settled(pool: &PgPool, js: &jetstream::Context, stream: &str, names: &[&str]) -> bool {
    let unsent = relay::admin::counts(pool, false)
        .await
        .map_or(1, |counts| counts.unsent());
    unsent == 0
        && lag(js, stream, names)
            .await
            .is_some_and(|lags| lags.iter().all(|(_, lag)| *lag == 0))
}

/// The messages not yet applied (undelivered plus unacknowledged) of each projection consumer of
/// `names` (the demo's: the registry's, read models included).
async fn lag<'a>(
    js: &jetstream::Context,
    stream: &str,
    names: &[&'a str],
) -> Option<Vec<(&'a str, u64)>> {
    let stream = js.get_stream(stream).await.ok()?;
    let mut lags = Vec::new();
    for &name in names {
        let mut consumer: jetstream::consumer::PullConsumer =
            stream.get_consumer(name).await.ok()?;
        let info = consumer.info().await.ok()?;
        lags.push((name, info.num_pending + info.num_ack_pending as u64));
    }
    Some(lags)
}

/// A progress line every second while the story plays.
async fn progress(
    pool: PgPool,
    js: jetstream::Context,
    stream: String,
    played: Arc<Played>,
    orders: usize,
    started: Instant,
) {
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        // Sent rows included: the demo's table is small, and watching `sent` grow is the point.
        let counts = relay::admin::counts(&pool, true)
            .await
            .map(|counts| counts.by_status())
            .unwrap_or_default();
        let outbox: Vec<String> = counts
            .iter()
            .filter(|(_, n)| *n > 0)
            .map(|(s, n)| format!("{n} {s}"))
            .collect();
        let lags = lag(&js, &stream, &projections::registry::NAMES)
            .await
            .unwrap_or_default();
        let behind: Vec<String> = lags
            .iter()
            .map(|(name, lag)| format!("{name} {lag}"))
            .collect();
        println!(
            "[{:>5.1}s]   orders {}/{orders} | outbox: {} | projections behind: {}",
            started.elapsed().as_secs_f64(),
            played.placed.load(Ordering::Relaxed),
            outbox.join(", "),
            behind.join(", ")
        );
    }
}

async fn wait_for<F, Fut>(mut check: F, timeout: Duration) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if check().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    false
}
