//! Relay throughput and latency, with the seed article's algorithm as the baseline, in one program.
//!
//! Run: `cargo bench -p relay --bench drain -- [--events 100000] [--history 1000000] [--rounds 3]`
//!
//! 1. Drain rate: a pre-filled outbox of `--events` events (aggregates of 3 versions, interleaved) with
//!    `--history` sent rows already in the table, drained by 1 and by 2 `waybill-relay run --once`
//!    processes; and by the baseline (claim 10 with one UPDATE per row, publish one at a time awaiting
//!    each ack, one UPDATE per mark-sent) on an identical table, for `--baseline-seconds`.
//! 2. Latency from commit to delivery at a steady `--rate` events/s with one long-running relay, and the
//!    relay's resident memory.
//!
//! Uses `DATABASE_URL`'s server (database `waybill_bench_relay`) and `NATS_URL` (default local).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use async_nats::jetstream;
use clap::Parser;
use futures::StreamExt;
use relay::StreamSettings;
use serde_json::json;
use sqlx::PgPool;
use store::{CommandContext, EventStore, OutboxNotifier};
use testkit::stats::{median, percentiles, resident_kib};
use uuid::Uuid;

const STREAM: &str = "BENCH_EVENTS";
const PREFIX: &str = "bench.events";

#[derive(Debug, Parser)]
struct Args {
    /// Events to drain per measurement.
    #[arg(long, default_value_t = 100_000)]
    events: i64,
    /// Sent rows kept in the outbox (and in the baseline's table) during every measurement.
    #[arg(long, default_value_t = 1_000_000)]
    history: i64,
    /// Rounds of each mode; medians are reported.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// How long each baseline measurement runs (it is too slow to drain everything).
    #[arg(long, default_value_t = 20.0)]
    baseline_seconds: f64,
    /// Steady write rate for the latency measurement (events/s).
    #[arg(long, default_value_t = 1000)]
    rate: u64,
    /// Seconds of steady writing.
    #[arg(long, default_value_t = 15)]
    steady_seconds: u64,
    /// Print one JSON document at the end.
    #[arg(long)]
    json: bool,
    /// Accepted for `cargo bench` compatibility.
    #[arg(long, hide = true)]
    bench: bool,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let base = std::env::var("DATABASE_URL").unwrap_or_else(|_| ops::DEFAULT_DATABASE_URL.into());
    let url = ops::database::with_database(&base, "waybill_bench_relay");
    let nats_url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    ops::database::ensure_database(&url).await?;
    let pool = ops::database::connect(&url, "waybill-bench", 8).await?;
    store::migrate(&pool).await?;
    let client = async_nats::connect(&nats_url).await?;
    let js = jetstream::new(client.clone());
    let settings = StreamSettings {
        name: STREAM.into(),
        subject_prefix: PREFIX.into(),
        ..StreamSettings::default()
    };
    relay::ensure_stream(&js, &settings, true).await?;

    prepare_history(&pool, args.history).await?;
    explain_claim(&pool).await?;

    let mut relay1 = Vec::new();
    let mut relay2 = Vec::new();
    let mut baseline = Vec::new();
    let mut rss = Vec::new();
    let mut cpu_one_relay = Vec::new();
    for round in 1..=args.rounds {
        for instances in [1, 2] {
            clear_pending(&pool, &js).await?;
            seed_pending(&pool, args.events, "outbox").await?;
            let (rate, peak_kib, cpu) =
                drain_with_relays(&url, &nats_url, instances, args.events, &pool).await?;
            let per_event = |seconds: f64| seconds * 1e6 / args.events as f64;
            eprintln!(
                "round {round}: {instances} relay(s) drained {} events at {rate:.0} events/s; \
                 CPU per event: relay {:.0} µs, its PostgreSQL sessions {:.0} µs, nats-server {:.0} µs",
                args.events,
                per_event(cpu.relay),
                per_event(cpu.postgres),
                per_event(cpu.nats)
            );
            if instances == 1 {
                relay1.push(rate);
                rss.push(peak_kib as f64);
                cpu_one_relay.push([
                    per_event(cpu.relay),
                    per_event(cpu.postgres),
                    per_event(cpu.nats),
                ]);
            } else {
                relay2.push(rate);
            }
        }
        clear_pending(&pool, &js).await?;
        seed_pending(&pool, args.events, "baseline_outbox").await?;
        let rate =
            drain_baseline(&pool, &js, Duration::from_secs_f64(args.baseline_seconds)).await?;
        eprintln!("round {round}: baseline relayed {rate:.0} events/s");
        baseline.push(rate);
    }
    clear_pending(&pool, &js).await?;

    let (latency, steady_rss_kib) = steady_latency(
        &pool,
        &url,
        &nats_url,
        &client,
        args.rate,
        args.steady_seconds,
    )
    .await?;
    clear_pending(&pool, &js).await?;

    let ratios1: Vec<f64> = relay1.iter().zip(&baseline).map(|(r, b)| r / b).collect();
    let ratios2: Vec<f64> = relay2.iter().zip(&baseline).map(|(r, b)| r / b).collect();
    let report = json!({
        "events": args.events,
        "history_sent_rows": args.history,
        "rounds": args.rounds,
        "one_relay_events_per_s": median(relay1.clone()),
        "two_relays_events_per_s": median(relay2.clone()),
        "baseline_events_per_s": median(baseline.clone()),
        "one_relay_vs_baseline": median(ratios1),
        "two_relays_vs_baseline": median(ratios2),
        "runs": {"one_relay": relay1, "two_relays": relay2, "baseline": baseline},
        "drain_relay_peak_rss_kib": median(rss),
        "one_relay_cpu_us_per_event": {
            "relay": median(cpu_one_relay.iter().map(|c| c[0]).collect()),
            "postgres": median(cpu_one_relay.iter().map(|c| c[1]).collect()),
            "nats": median(cpu_one_relay.iter().map(|c| c[2]).collect()),
        },
        "steady": {"rate_events_per_s": args.rate, "seconds": args.steady_seconds,
                   "commit_to_delivery_ms": latency, "relay_rss_kib": steady_rss_kib},
    });
    if args.json {
        println!("{report}");
    } else {
        println!(
            "drain of {} events with {} sent rows in the table (medians of {} rounds):",
            args.events, args.history, args.rounds
        );
        println!(
            "  one relay     {:>8.0} events/s  ({:.1}x baseline)",
            report["one_relay_events_per_s"]
                .as_f64()
                .unwrap_or_default(),
            report["one_relay_vs_baseline"].as_f64().unwrap_or_default()
        );
        println!(
            "  two relays    {:>8.0} events/s  ({:.1}x baseline)",
            report["two_relays_events_per_s"]
                .as_f64()
                .unwrap_or_default(),
            report["two_relays_vs_baseline"]
                .as_f64()
                .unwrap_or_default()
        );
        println!(
            "  baseline      {:>8.0} events/s  (seed article's algorithm)",
            report["baseline_events_per_s"].as_f64().unwrap_or_default()
        );
        println!(
            "  relay peak RSS while draining: {} KiB",
            report["drain_relay_peak_rss_kib"]
        );
        let cpu = &report["one_relay_cpu_us_per_event"];
        println!(
            "  CPU per event, one relay: relay {:.0} µs, its PostgreSQL sessions {:.0} µs, nats-server {:.0} µs",
            cpu["relay"].as_f64().unwrap_or_default(),
            cpu["postgres"].as_f64().unwrap_or_default(),
            cpu["nats"].as_f64().unwrap_or_default()
        );
        println!(
            "steady {} events/s for {} s: commit to delivery p50 {} ms, p99 {} ms, max {} ms \
             (the commands themselves: p50 {} ms, p99 {} ms); relay RSS {} KiB",
            args.rate,
            args.steady_seconds,
            latency["p50"],
            latency["p99"],
            latency["max"],
            latency["command_p50"],
            latency["command_p99"],
            steady_rss_kib
        );
    }
    Ok(())
}

/// Makes sure `history` sent rows sit in both outbox tables (created once, reused by later runs).
async fn prepare_history(pool: &PgPool, history: i64) -> anyhow::Result<()> {
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS baseline_outbox (
            id BIGSERIAL PRIMARY KEY,
            event_id UUID NOT NULL,
            aggregate_id UUID NOT NULL,
            topic TEXT NOT NULL,
            payload JSONB NOT NULL,
            status TEXT NOT NULL CHECK (status IN ('pending', 'processing', 'sent', 'failed')),
            attempts INTEGER NOT NULL DEFAULT 0,
            next_run_at TIMESTAMPTZ NOT NULL DEFAULT now(),
            locked_by TEXT, locked_at TIMESTAMPTZ, last_error TEXT,
            created_at TIMESTAMPTZ NOT NULL DEFAULT now(), sent_at TIMESTAMPTZ)",
    )
    .execute(pool)
    .await?;
    sqlx::query("CREATE INDEX IF NOT EXISTS baseline_outbox_ready_idx ON baseline_outbox (status, next_run_at, id)")
        .execute(pool)
        .await?;
    for table in ["outbox", "baseline_outbox"] {
        let sent: i64 = match table {
            "outbox" => sqlx::query_scalar("SELECT count(*) FROM outbox WHERE status = 'sent'"),
            _ => sqlx::query_scalar("SELECT count(*) FROM baseline_outbox WHERE status = 'sent'"),
        }
        .fetch_one(pool)
        .await?;
        let missing = history - sent;
        if missing > 0 {
            eprintln!("adding {missing} sent rows of history to {table} (once)");
            let started = Instant::now();
            for chunk_start in (0..missing).step_by(100_000) {
                let n = (missing - chunk_start).min(100_000);
                seed(pool, n, table, "sent").await?;
            }
            eprintln!("  done in {:.0?}", started.elapsed());
        }
    }
    sqlx::query("VACUUM ANALYZE outbox").execute(pool).await?;
    sqlx::query("VACUUM ANALYZE baseline_outbox")
        .execute(pool)
        .await?;
    Ok(())
}

/// Prints the plan of the relay's claim with the history in place: it must use the partial indexes.
async fn explain_claim(pool: &PgPool) -> anyhow::Result<()> {
    seed_pending(pool, 30_000, "outbox").await?;
    sqlx::query("ANALYZE outbox").execute(pool).await?;
    let plan: Vec<String> = sqlx::query_scalar(
        "EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY ON)
         SELECT o.id FROM outbox o
         WHERE o.status IN ('pending', 'failed') AND o.next_run_at <= now()
           AND NOT EXISTS (SELECT 1 FROM outbox p WHERE p.aggregate_id = o.aggregate_id
                           AND p.aggregate_version = o.aggregate_version - 1 AND p.status <> 'sent')
         ORDER BY o.next_run_at, o.id LIMIT 1000 FOR UPDATE OF o SKIP LOCKED",
    )
    .fetch_all(pool)
    .await?;
    eprintln!(
        "claim plan with the history in place:\n  {}",
        plan.join("\n  ")
    );
    sqlx::query("DELETE FROM outbox WHERE status = 'pending'")
        .execute(pool)
        .await?;
    Ok(())
}

/// Removes unsent rows and rows sent after the history was built, and empties the stream.
async fn clear_pending(pool: &PgPool, js: &jetstream::Context) -> anyhow::Result<()> {
    sqlx::query("DELETE FROM outbox WHERE status <> 'sent' OR stream_seq IS NOT NULL")
        .execute(pool)
        .await?;
    sqlx::query("DELETE FROM baseline_outbox WHERE status <> 'sent' OR sent_at IS NOT NULL")
        .execute(pool)
        .await?;
    sqlx::query("DELETE FROM outbox_inflight")
        .execute(pool)
        .await?;
    // Each measurement starts from a vacuumed table, as autovacuum leaves a production outbox between
    // bursts: without it a small table (`--history 0`) piled up every round's dead rows and the rounds
    // measured the pile (one relay 17.2k → 12.8k → 11.7k events/s).
    sqlx::query("VACUUM outbox, baseline_outbox")
        .execute(pool)
        .await?;
    js.get_stream(STREAM).await?.purge().await?;
    Ok(())
}

/// Seeds `events` pending rows and analyzes the table, so that the claim is planned for what the
/// table holds (an `ANALYZE` of the empty table would leave the planner expecting no rows).
async fn seed_pending(pool: &PgPool, events: i64, table: &str) -> anyhow::Result<()> {
    seed(pool, events, table, "pending").await?;
    match table {
        "outbox" => sqlx::query("ANALYZE outbox"),
        _ => sqlx::query("ANALYZE baseline_outbox"),
    }
    .execute(pool)
    .await?;
    Ok(())
}

/// The envelope of an `ev` row, as JSON text.
const BODY: &str = "jsonb_build_object('event_id', event_id, 'event_type', event_type, 'event_version', event_version,
    'aggregate_type', 'order', 'aggregate_id', aggregate_id, 'aggregate_version', aggregate_version,
    'occurred_at', occurred_at, 'correlation_id', null, 'causation_id', null, 'payload', payload)::text";

/// Inserts `events` events (aggregates of 3 versions, interleaved: every v1, then every v2, then v3)
/// into `events` and into `table` with `status`.
async fn seed(pool: &PgPool, events: i64, table: &str, status: &str) -> anyhow::Result<()> {
    let aggregates = (events + 2) / 3;
    let rows = "WITH aggs AS (SELECT a, gen_random_uuid() AS aggregate_id FROM generate_series(1, $1::int) a),
        rows AS (
            SELECT gen_random_uuid() AS event_id, aggregate_id, v AS aggregate_version,
                   (ARRAY['order.placed', 'order.paid', 'order.shipped'])[v] AS event_type,
                   (ARRAY[2, 1, 1])[v] AS event_version,
                   (ARRAY['{\"customer_id\": \"bench\", \"currency\": \"EUR\", \"lines\": [{\"sku\": \"MUG\", \"quantity\": 1, \"unit_price_cents\": 100}], \"total_cents\": 100}',
                          '{\"amount_cents\": 100, \"payment_ref\": null}',
                          '{\"carrier\": \"DHL\", \"tracking_number\": \"T\"}'])[v]::jsonb AS payload
            FROM generate_series(1, 3) v, aggs ORDER BY v, a LIMIT $2),
        ev AS (INSERT INTO events (event_id, event_type, event_version, aggregate_type, aggregate_id,
                                   aggregate_version, occurred_at, payload)
               SELECT event_id, event_type, event_version, 'order', aggregate_id, aggregate_version, now(), payload
               FROM rows RETURNING *)";
    let sql = match table {
        "outbox" => format!(
            "{rows} INSERT INTO outbox (event_id, event_type, event_version, aggregate_id, aggregate_version,
                                        body, status, sent_at)
             SELECT event_id, event_type, event_version, aggregate_id, aggregate_version, {BODY}, $3,
                    CASE WHEN $3 = 'sent' THEN now() END FROM ev ORDER BY position"
        ),
        _ => format!(
            "{rows} INSERT INTO baseline_outbox (event_id, aggregate_id, topic, payload, status)
             SELECT event_id, aggregate_id, event_type,
                    {BODY}::jsonb, $3 FROM ev ORDER BY position"
        ),
    };
    sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(aggregates)
        .bind(events)
        .bind(status)
        .execute(pool)
        .await?;
    Ok(())
}

/// CPU seconds spent while draining, by component.
#[derive(Debug, Default, Clone, Copy)]
struct CpuSplit {
    relay: f64,
    postgres: f64,
    nats: f64,
}

/// Runs `instances` relay processes with `--once` until all `events` rows are sent. Returns the
/// rate, the first relay's peak resident memory, and where the CPU went: the relay processes, their
/// PostgreSQL sessions, and every nats-server process on the machine.
async fn drain_with_relays(
    url: &str,
    nats_url: &str,
    instances: usize,
    events: i64,
    pool: &PgPool,
) -> anyhow::Result<(f64, u64, CpuSplit)> {
    let nats_pids = testkit::stats::pids_named("nats-server");
    let nats_before: f64 = nats_pids
        .iter()
        .filter_map(|p| testkit::stats::cpu_seconds(*p))
        .sum();
    let started = Instant::now();
    let mut children = Vec::new();
    for i in 0..instances {
        children.push(
            tokio::process::Command::new(env!("CARGO_BIN_EXE_waybill-relay"))
                .args([
                    "run",
                    "--once",
                    "--no-provision",
                    "--database-url",
                    url,
                    "--nats-url",
                    nats_url,
                ])
                .args([
                    "--stream",
                    STREAM,
                    "--subject-prefix",
                    PREFIX,
                    "--relay-id",
                    &format!("bench-{i}"),
                ])
                .env("RUST_LOG", "warn")
                .stdout(std::process::Stdio::null())
                .spawn()?,
        );
    }
    let pid = children[0].id();
    let relay_pids: Vec<u32> = children.iter().filter_map(|c| c.id()).collect();
    let sampling = Arc::new(AtomicBool::new(true));
    let sampler = tokio::spawn({
        let (sampling, pool) = (sampling.clone(), pool.clone());
        async move {
            let mut peak = 0;
            // Processes disappear when they exit: keep the last CPU reading of each.
            let mut last_cpu: HashMap<u32, f64> = HashMap::new();
            let mut backends: Vec<u32> = Vec::new();
            let mut ticks = 0u32;
            while sampling.load(Ordering::Relaxed) {
                peak = peak.max(resident_kib(pid));
                if ticks % 10 == 2 {
                    backends = sqlx::query_scalar::<_, i32>(
                        // Relays name their sessions `waybill-relay <relay id>`.
                        "SELECT pid FROM pg_stat_activity WHERE application_name LIKE 'waybill-relay bench-%'",
                    )
                    .fetch_all(&pool)
                    .await
                    .unwrap_or_default()
                    .into_iter()
                    .map(|p| p as u32)
                    .collect();
                }
                for p in relay_pids.iter().chain(&backends) {
                    if let Some(cpu) = testkit::stats::cpu_seconds(*p) {
                        last_cpu.insert(*p, cpu);
                    }
                }
                ticks += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let relay: f64 = relay_pids.iter().filter_map(|p| last_cpu.get(p)).sum();
            let postgres: f64 = last_cpu
                .iter()
                .filter(|(p, _)| !relay_pids.contains(p))
                .map(|(_, c)| c)
                .sum();
            (peak, relay, postgres)
        }
    });
    for mut child in children {
        let status = child.wait().await?;
        anyhow::ensure!(status.success(), "relay exited with {status}");
    }
    let elapsed = started.elapsed().as_secs_f64();
    sampling.store(false, Ordering::Relaxed);
    let (peak, relay, postgres) = sampler.await?;
    let nats_after: f64 = nats_pids
        .iter()
        .filter_map(|p| testkit::stats::cpu_seconds(*p))
        .sum();
    let cpu = CpuSplit {
        relay,
        postgres,
        nats: nats_after - nats_before,
    };
    let sent: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox WHERE stream_seq IS NOT NULL")
        .fetch_one(pool)
        .await?;
    anyhow::ensure!(sent == events, "only {sent} of {events} rows were sent");
    Ok((events as f64 / elapsed, peak, cpu))
}

/// A row the baseline relay claimed.
#[derive(sqlx::FromRow)]
struct BaselineRow {
    id: i64,
    topic: String,
    payload: String,
    event_id: Uuid,
}

/// The seed article's relay, transcribed: claim 10 rows (one UPDATE each to `processing`), publish one
/// at a time awaiting each PubAck, one UPDATE per mark-sent. Runs for `duration`; returns events/s.
async fn drain_baseline(
    pool: &PgPool,
    js: &jetstream::Context,
    duration: Duration,
) -> anyhow::Result<f64> {
    let started = Instant::now();
    let mut relayed = 0u64;
    while started.elapsed() < duration {
        let mut tx = pool.begin().await?;
        let rows: Vec<BaselineRow> = sqlx::query_as(
            "SELECT id, topic, payload::text AS payload, event_id FROM baseline_outbox
             WHERE status IN ('pending', 'failed') AND next_run_at <= now()
             ORDER BY id LIMIT 10 FOR UPDATE SKIP LOCKED",
        )
        .fetch_all(&mut *tx)
        .await?;
        if rows.is_empty() {
            break;
        }
        for row in &rows {
            sqlx::query("UPDATE baseline_outbox SET status = 'processing', attempts = attempts + 1, locked_by = 'baseline', locked_at = now() WHERE id = $1")
                .bind(row.id)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        for row in rows {
            let mut headers = HeaderMap::new();
            headers.insert("Nats-Msg-Id", row.event_id.to_string().as_str());
            js.publish_with_headers(
                format!("{PREFIX}.{}.baseline", row.topic),
                headers,
                row.payload.into(),
            )
            .await?
            .await?;
            sqlx::query("UPDATE baseline_outbox SET status = 'sent', sent_at = now(), locked_by = NULL, locked_at = NULL WHERE id = $1")
                .bind(row.id)
                .execute(pool)
                .await?;
            relayed += 1;
        }
    }
    Ok(relayed as f64 / started.elapsed().as_secs_f64())
}

/// Writes orders through the store at `rate` events/s while one `waybill-relay run` relays them, and
/// measures from the return of each command's commit to a subscriber's receipt of its event. Returns
/// the latency percentiles in ms (and the commands' own latency) and the relay's resident memory.
async fn steady_latency(
    pool: &PgPool,
    url: &str,
    nats_url: &str,
    client: &async_nats::Client,
    rate: u64,
    seconds: u64,
) -> anyhow::Result<(serde_json::Value, u64)> {
    let mut relay = tokio::process::Command::new(env!("CARGO_BIN_EXE_waybill-relay"))
        .args([
            "run",
            "--no-provision",
            "--database-url",
            url,
            "--nats-url",
            nats_url,
            "--stream",
            STREAM,
            "--subject-prefix",
            PREFIX,
        ])
        .env("RUST_LOG", "warn")
        .spawn()?;
    let relay_pid = relay.id();
    tokio::time::sleep(Duration::from_millis(500)).await;

    let mut subscriber = client.subscribe(format!("{PREFIX}.>")).await?;
    let collecting = tokio::spawn(async move {
        let mut delivered: HashMap<Uuid, Instant> = HashMap::new();
        while let Ok(Some(message)) =
            tokio::time::timeout(Duration::from_secs(3), subscriber.next()).await
        {
            if let Ok(envelope) = domain::EventEnvelope::from_json(&message.payload) {
                delivered
                    .entry(envelope.event_id)
                    .or_insert_with(Instant::now);
            }
        }
        delivered
    });

    let store = EventStore::new(pool.clone()).with_notifier(OutboxNotifier::spawn(
        pool.clone(),
        Duration::from_millis(5),
    ));
    let command = testkit::place("bench", &["MUG:1:100"]);
    let interval = Duration::from_secs_f64(1.0 / rate as f64);
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let total = rate * seconds;
    let mut writes = futures::stream::FuturesUnordered::new();
    let mut committed: HashMap<Uuid, Instant> = HashMap::new();
    let mut command_latencies = Vec::new();
    let mut note =
        |done: Result<anyhow::Result<(Uuid, Instant, Duration)>, tokio::task::JoinError>| {
            if let Ok(Ok((event_id, at, took))) = done {
                committed.insert(event_id, at);
                command_latencies.push(took.as_micros() as u64);
            }
        };
    for _ in 0..total {
        ticker.tick().await;
        let (store, command) = (store.clone(), command.clone());
        writes.push(tokio::spawn(async move {
            let started = Instant::now();
            let outcome = store
                .execute(
                    domain::OrderId::from_uuid(Uuid::now_v7()),
                    &command,
                    &CommandContext::default(),
                )
                .await?;
            anyhow::Ok((outcome.event_ids[0], Instant::now(), started.elapsed()))
        }));
        while writes.len() > 64 {
            if let Some(done) = writes.next().await {
                note(done);
            }
        }
    }
    while let Some(done) = writes.next().await {
        note(done);
    }
    let delivered = collecting.await?;
    let rss = resident_kib(relay_pid);
    if let Some(pid) = relay_pid
        && let Some(pid) = rustix::process::Pid::from_raw(pid as i32)
    {
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
    }
    relay.wait().await?;
    anyhow::ensure!(
        delivered.len() as u64 >= total,
        "only {} of {total} events were delivered",
        delivered.len()
    );
    // From the moment the command's commit returned to the moment a subscriber received the event.
    let latencies: Vec<u64> = committed
        .iter()
        .filter_map(|(id, at)| {
            delivered
                .get(id)
                .map(|d| d.saturating_duration_since(*at).as_micros() as u64)
        })
        .collect();
    let p = percentiles(latencies);
    let c = percentiles(command_latencies);
    let ms = |us: u64| (us as f64 / 100.0).round() / 10.0;
    Ok((
        json!({"p50": ms(p.p50), "p99": ms(p.p99), "max": ms(p.max), "count": p.count,
               "command_p50": ms(c.p50), "command_p99": ms(c.p99)}),
        rss,
    ))
}
