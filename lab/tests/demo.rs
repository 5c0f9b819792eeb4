//! `waybill demo` end to end, on the server of `DATABASE_URL` and a private nats-server: it must finish
//! on its own and exit 0, and what it tells about the crash window and the duplicate must be true of the
//! database and the stream it leaves behind — read back here, not taken from its narration.

use std::time::{Duration, Instant};

use async_nats::jetstream::stream::RawMessageErrorKind;
use chrono::{DateTime, Utc};
use projections::{Inventory, Points, Projection, Search};
use sqlx::PgPool;
use uuid::Uuid;

/// The demo's own stream and subject prefix (fixed in the lab's `demo` module).
const STREAM: &str = "WAYBILL_DEMO";
const PREFIX: &str = "waybill.demo";

#[tokio::test]
async fn the_demo_runs_green_and_its_projections_agree_with_the_event_store() {
    let nats = testkit::NatsServer::start().expect("nats-server");
    let url = std::env::var("DATABASE_URL").expect("DATABASE_URL");
    let database = format!("waybill_demo_test_{}", uuid::Uuid::now_v7().simple());
    let started = Instant::now();
    let mut demo = tokio::process::Command::new(env!("CARGO_BIN_EXE_waybill-lab"));
    demo.args([
        "demo",
        "--orders",
        "24",
        "--database-name",
        &database,
        "--nats-url",
        &nats.url(),
    ])
    .env("DATABASE_URL", &url)
    // A demo that hangs is killed when the bound below drops it.
    .kill_on_drop(true);
    // Finishing on its own is what is tested, not how fast: the bound is five times the minute it once
    // had to beat, so it only tells a hang from a run slowed by a loaded 2-core machine.
    let finished = tokio::time::timeout(Duration::from_secs(300), demo.output()).await;
    let took = started.elapsed();
    let output = finished.map(|output| output.expect("waybill demo runs"));
    let (stdout, stderr) = match &output {
        Ok(output) => (
            String::from_utf8_lossy(&output.stdout).into_owned(),
            String::from_utf8_lossy(&output.stderr).into_owned(),
        ),
        Err(_) => Default::default(),
    };

    // Checked before asserting anything, so the database is dropped whatever the outcome.
    let facts = match ops::database::connect(
        &ops::database::with_database(&url, &database),
        "waybill-test",
        2,
    )
    .await
    {
        Ok(pool) => {
            let facts = demo_facts(&pool, &nats.url()).await;
            pool.close().await;
            facts
        }
        Err(error) => Err(format!("connecting to the demo's database: {error}")),
    };
    let admin = ops::database::connect(&url, "waybill-test", 1)
        .await
        .expect("connect");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS \"{database}\" WITH (FORCE)"
    )))
    .execute(&admin)
    .await
    .expect("drop");

    let Ok(output) = output else {
        panic!("the demo did not finish on its own within {took:?}");
    };
    assert!(
        output.status.success(),
        "exit after {took:?}: {stdout}\n{stderr}"
    );
    // The verdict's own figures: exit 0 already means no disagreement, this shows which one if not.
    assert!(!stdout.contains("DIFFERS"), "{stdout}");
    // Every read model of the registry ran beside the built-in projections and has its line in
    // the verdict: its document agreed with its fold of the event store.
    assert!(
        !projections::registry::MODELS.is_empty(),
        "the registry has no read model to check"
    );
    for model in projections::registry::MODELS {
        let line = format!("  {:<12} ok", model.name());
        assert!(
            stdout.lines().any(|l| l == line),
            "no verdict line {line:?} for the read model {}:\n{stdout}",
            model.name()
        );
    }
    if let Err(fact) = facts {
        panic!("{fact}\n\nthe demo said:\n{stdout}");
    }
}

/// One stored copy of the crash-window event.
#[derive(Debug)]
struct Copy {
    sequence: u64,
    msg_id: Option<String>,
    stored_at_ns: i128,
}

/// What the demo claims, checked against the database and stream it left.
async fn demo_facts(pool: &PgPool, nats_url: &str) -> Result<(), String> {
    // The crash window is played with the first event the demo writes.
    let (event_id, aggregate_type, order): (Uuid, String, Uuid) = sqlx::query_as(
        "SELECT event_id, aggregate_type, aggregate_id FROM events ORDER BY position LIMIT 1",
    )
    .fetch_one(pool)
    .await
    .map_err(failed("reading the first event"))?;
    let (status, claimed_by, claimed_at, stream_seq): (
        String,
        Option<String>,
        Option<DateTime<Utc>>,
        Option<i64>,
    ) = sqlx::query_as(
        "SELECT status, claimed_by, claimed_at, stream_seq FROM outbox WHERE event_id = $1",
    )
    .bind(event_id)
    .fetch_one(pool)
    .await
    .map_err(failed("reading its outbox row"))?;
    let unsent: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox WHERE status <> 'sent'")
        .fetch_one(pool)
        .await
        .map_err(failed("counting unsent rows"))?;
    if unsent != 0 {
        return Err(format!("{unsent} outbox row(s) were never sent"));
    }
    if status != "sent" || claimed_by.as_deref() != Some("demo-relay") {
        return Err(format!(
            "event {event_id}'s outbox row is {status}, settled by {claimed_by:?}: the relay started after the crash should have sent it"
        ));
    }

    let copies = copies(
        nats_url,
        &format!("{PREFIX}.{aggregate_type}.{order}"),
        event_id,
    )
    .await?;
    let [relayed, duplicate] = copies.as_slice() else {
        return Err(format!(
            "event {event_id} should be in the stream exactly twice (relayed once despite two publishes, plus the deliberate duplicate), found {copies:?}"
        ));
    };
    let own = Some(event_id.to_string());
    if relayed.msg_id != own || duplicate.msg_id == own {
        return Err(format!(
            "one copy should carry the event id as Nats-Msg-Id and the other another id, found {copies:?}"
        ));
    }
    // The crash window, after the fact: the copy under the event id was stored before the surviving
    // relay claimed the row, so the crashed relay published it; the surviving relay's PubAck named that
    // same sequence, so JetStream answered its publish as a duplicate instead of storing another copy.
    if stream_seq != i64::try_from(relayed.sequence).ok() {
        return Err(format!(
            "the outbox row names stream sequence {stream_seq:?}, the relayed copy is {}",
            relayed.sequence
        ));
    }
    let claimed_at_ns = claimed_at
        .and_then(|t| t.timestamp_nanos_opt())
        .map(i128::from)
        .ok_or("the outbox row has no claim time")?;
    if relayed.stored_at_ns >= claimed_at_ns {
        return Err(format!(
            "the relayed copy was stored after the surviving relay claimed the row ({} ns ≥ {claimed_at_ns} ns): no crashed relay published it first",
            relayed.stored_at_ns
        ));
    }

    // The projections counted the duplicate once: each parked it instead of applying it — the read
    // models that read orders too.
    let models = projections::registry::MODELS
        .iter()
        .filter(|model| model.aggregates().contains(&"order"))
        .map(|model| model.name());
    for schema in [Inventory::NAME, Points::NAME, Search::NAME]
        .into_iter()
        .chain(models)
    {
        let parked: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FROM \"{schema}\".parked WHERE stream_sequence = $1"
        )))
        .bind(i64::try_from(duplicate.sequence).unwrap_or(-1))
        .fetch_one(pool)
        .await
        .map_err(failed(&format!("reading {schema}'s parked messages")))?;
        if parked != 1 {
            return Err(format!(
                "{schema} parked the duplicate (sequence {}) {parked} time(s), not once",
                duplicate.sequence
            ));
        }
    }

    // The legacy import: a stored v1 `order.placed`, then paid.
    let legacy_paid: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM events placed JOIN events paid USING (aggregate_id)
         WHERE placed.event_type = 'order.placed' AND placed.event_version = 1
           AND paid.event_type = 'order.paid'",
    )
    .fetch_one(pool)
    .await
    .map_err(failed("looking for the legacy order"))?;
    if legacy_paid != 1 {
        return Err(format!(
            "expected one paid order placed by a v1 event, found {legacy_paid}"
        ));
    }
    Ok(())
}

/// Turns a database error into what the test was doing when it happened.
fn failed(what: &str) -> impl FnOnce(sqlx::Error) -> String {
    let what = what.to_owned();
    move |error| format!("{what}: {error}")
}

/// Every copy of `event_id` on `subject` in the demo's stream.
async fn copies(nats_url: &str, subject: &str, event_id: Uuid) -> Result<Vec<Copy>, String> {
    let client = async_nats::connect(nats_url)
        .await
        .map_err(|e| format!("connecting to NATS: {e}"))?;
    let stream = async_nats::jetstream::new(client)
        .get_stream_no_info(STREAM)
        .await
        .map_err(|e| format!("opening {STREAM}: {e}"))?;
    let mut found = Vec::new();
    let mut from = 1;
    loop {
        match stream.get_first_raw_message_by_subject(subject, from).await {
            Ok(message) => {
                from = message.sequence + 1;
                let envelope = domain::EventEnvelope::from_json(&message.payload);
                if envelope.is_ok_and(|e| e.event_id == event_id) {
                    found.push(Copy {
                        sequence: message.sequence,
                        msg_id: message
                            .headers
                            .get(domain::wire::MSG_ID)
                            .map(|v| v.as_str().to_owned()),
                        stored_at_ns: message.time.unix_timestamp_nanos(),
                    });
                }
            }
            Err(e) if e.kind() == RawMessageErrorKind::NoMessageFound => return Ok(found),
            Err(e) => return Err(format!("reading {subject}: {e}")),
        }
    }
}
