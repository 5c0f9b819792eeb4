//! Relays that stop without dying, as real processes: frozen with SIGSTOP (a VM stall, a swapped-out
//! process, a debugger) while holding a claim, then resumed after the dedupe window. The stream must
//! still hold each event once, in version order, fenced on its predecessor; and a frozen relay's rows
//! must be claimable by another relay within the claim timeout, wherever it froze.

mod common;

use std::process::Stdio;
use std::time::Duration;

use common::{Harness, PREFIX, STREAM, seed, wait_until};
use rustix::process::Signal;
use sqlx::PgPool;
use tokio::process::{Child, Command};

const CLAIM_TIMEOUT: &str = "3s";
const WINDOW: &str = "2s";

/// `waybill-relay … run --once` against the harness, with the short claim timeout and window.
fn relay_once(h: &Harness, relay_id: &str, extra: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_waybill-relay"))
        .args(["--database-url", &h.url, "--nats-url", &h.nats.url()])
        .args(["--stream", STREAM, "--subject-prefix", PREFIX])
        .args(["--duplicate-window", WINDOW, "--json"])
        .args(["run", "--once", "--relay-id", relay_id])
        .args(["--claim-idle-timeout", CLAIM_TIMEOUT])
        .args(extra)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("waybill-relay starts")
}

fn signal(child: &Child, signal: Signal) {
    testkit::send_signal(child.id(), signal);
}

/// Waits for a `--once --json` relay to exit 0 and returns its summary.
async fn finished(child: Child) -> serde_json::Value {
    let output = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
        .await
        .expect("the relay ends")
        .expect("output");
    assert!(output.status.success(), "relay exit: {:?}", output.status);
    let line = String::from_utf8_lossy(&output.stdout);
    let document: serde_json::Value = serde_json::from_str(line.trim()).expect("--json summary");
    document["summary"].clone()
}

async fn provision(h: &Harness) {
    let mut config = h.config("provisioner");
    config.stream.duplicate_window = Duration::from_secs(2);
    h.relay(config).await;
}

async fn unsent(h: &Harness) -> i64 {
    h.count("SELECT count(*) FROM outbox WHERE status <> 'sent'")
        .await
}

async fn assert_stream_is_whole(h: &Harness, events: usize) {
    let stream = h.stream().await;
    let check = testkit::check_stream(&stream, PREFIX);
    assert_eq!(check.messages, events, "each event exactly once: {check:?}");
    assert!(check.holds(), "{check:?}");
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_relay_frozen_with_its_claim_open_adds_no_copy_when_it_resumes(pool: PgPool) {
    let h = Harness::new(pool).await;
    provision(&h).await;
    seed(&h.pool, 3000, 3).await;

    let frozen = relay_once(
        &h,
        "relay-frozen",
        &["--lanes", "1", "--batch-size", "2000", "--max-rows", "8000"],
    );
    // Freeze it the moment its claim is journaled: the claim is open, publishing is about to start.
    wait_until(
        Duration::from_secs(20),
        "relay-frozen to journal a claim",
        || async {
            h.count("SELECT count(*) FROM outbox_inflight WHERE relay = 'relay-frozen'")
                .await
                > 0
        },
    )
    .await;
    signal(&frozen, Signal::STOP);

    tokio::time::sleep(Duration::from_secs(4)).await;
    let rescuer = finished(relay_once(&h, "relay-rescuer", &[])).await;
    assert_eq!(
        unsent(&h).await,
        0,
        "the rescuer left nothing unsent: {rescuer}"
    );

    // Resume the frozen relay after the dedupe window has passed: whatever it still had in flight
    // reaches the broker now, fenced on stale sequences.
    tokio::time::sleep(Duration::from_secs(3)).await;
    signal(&frozen, Signal::CONT);
    let zombie = finished(frozen).await;
    assert_eq!(unsent(&h).await, 0);
    assert_stream_is_whole(&h, 9000).await;
    eprintln!("frozen relay after resuming: {zombie}");
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_relay_frozen_while_reading_a_large_claim_releases_it_within_the_claim_timeout(
    pool: PgPool,
) {
    let h = Harness::new(pool).await;
    provision(&h).await;
    seed(&h.pool, 4000, 1).await;
    // Bodies of 16 KiB: a claim of 4000 rows is ~64 MiB, far beyond the socket buffers, so PostgreSQL
    // is still sending it (backend active, ClientWrite) when the relay freezes.
    sqlx::query("UPDATE outbox SET body = jsonb_set(body::jsonb, '{payload,note}', to_jsonb(repeat('x', 16384)))::text")
        .execute(&h.pool)
        .await
        .expect("fatten bodies");

    // Freeze the relay while PostgreSQL is still sending its claim. The moment is a race: when the
    // freeze lands after the whole result was read, the claim is merely idle (the other case), so try
    // again with a fresh relay until the backend is caught writing.
    let mut frozen = None;
    for attempt in 0..5 {
        let name = format!("waybill-relay relay-frozen-{attempt}");
        let relay = relay_once(
            &h,
            &format!("relay-frozen-{attempt}"),
            &["--lanes", "1", "--batch-size", "4000", "--max-rows", "4000"],
        );
        let sessions = |condition: &'static str| {
            let (pool, name) = (h.pool.clone(), name.clone());
            async move {
                let sql = format!(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND {condition}"
                );
                sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql))
                    .bind(name)
                    .fetch_one(&pool)
                    .await
                    .expect("pg_stat_activity")
            }
        };
        wait_until(
            Duration::from_secs(20),
            "the relay's claim to be running",
            || {
                let sessions = &sessions;
                async move {
                    sessions("state = 'active' AND query LIKE '%FOR UPDATE OF o SKIP LOCKED%'")
                        .await
                        > 0
                }
            },
        )
        .await;
        signal(&relay, Signal::STOP);
        tokio::time::sleep(Duration::from_millis(300)).await;
        if sessions("state = 'active' AND wait_event = 'ClientWrite'").await == 1 {
            frozen = Some(relay);
            break;
        }
        // Missed: the whole result was read before the freeze. End this relay and its sessions.
        signal(&relay, Signal::KILL);
        let _ = relay.wait_with_output().await;
        sqlx::query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
        )
        .bind(&name)
        .execute(&h.pool)
        .await
        .expect("terminate");
        wait_until(
            Duration::from_secs(10),
            "the killed relay's sessions to end",
            || {
                let sessions = &sessions;
                async move { sessions("true").await == 0 }
            },
        )
        .await;
    }
    let frozen = frozen.expect("caught the frozen relay's backend writing its claim");

    // The rescuer's own reaper ends the frozen claim (no wall-clock bound: a loaded machine is slow, and
    // the count below is what proves it did not wait for the frozen relay).
    let rescuer = finished(relay_once(&h, "relay-rescuer", &[])).await;
    assert_eq!(unsent(&h).await, 0, "every row sent: {rescuer}");
    assert!(
        rescuer["stale_claims_ended"].as_u64() >= Some(1),
        "the rescuer ended the frozen claim: {rescuer}"
    );

    signal(&frozen, Signal::CONT);
    finished(frozen).await;
    assert_stream_is_whole(&h, 4000).await;
}
