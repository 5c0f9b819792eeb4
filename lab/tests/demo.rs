//! `waybill demo` end to end, on the server of `DATABASE_URL` and a private nats-server: it must finish
//! its story on its own, and what it tells about the crash window and the duplicate must be true of the
//! database and the stream it keeps with `--keep` — read back here while it waits, not taken from its
//! narration. After Ctrl-C (SIGTERM here), and at once without `--keep`, it removes both: each run has
//! a database and a stream of its own.

use std::process::Stdio;
use std::time::{Duration, Instant};

use async_nats::jetstream::stream::RawMessageErrorKind;
use chrono::{DateTime, Utc};
use projections::{Inventory, Points, Projection, Search};
use rustix::process::{Pid, Signal, kill_process};
use sqlx::PgPool;
use tokio::io::{AsyncBufReadExt, BufReader};
use uuid::Uuid;

/// Finishing on its own is what is tested, not how fast: the bound is five times the minute it once
/// had to beat, so it only tells a hang from a run slowed by a loaded 2-core machine.
const BOUND: Duration = Duration::from_secs(300);

/// `waybill-lab demo` with `args`, on `nats_url` and the server of `DATABASE_URL`, its standard output
/// piped. The crash window needs the relay's testing twin beside `waybill-lab`: built first.
fn demo(nats_url: &str, args: &[&str]) -> tokio::process::Child {
    testkit::build_workspace_binaries(env!("CARGO_MANIFEST_DIR"));
    let url = std::env::var("DATABASE_URL").expect("DATABASE_URL");
    tokio::process::Command::new(env!("CARGO_BIN_EXE_waybill-lab"))
        .arg("demo")
        .args(args)
        .args(["--nats-url", nats_url])
        .env("DATABASE_URL", &url)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // A demo that hangs is killed when the bound drops it.
        .kill_on_drop(true)
        .spawn()
        .expect("waybill-lab demo starts")
}

/// Whether database `name` exists on the server of `DATABASE_URL`.
async fn database_exists(name: &str) -> bool {
    let url = std::env::var("DATABASE_URL").expect("DATABASE_URL");
    let admin = ops::database::connect(&url, "waybill-test", 1)
        .await
        .expect("connect");
    let found: Option<i32> = sqlx::query_scalar("SELECT 1 FROM pg_database WHERE datname = $1")
        .bind(name)
        .fetch_optional(&admin)
        .await
        .expect("pg_database");
    admin.close().await;
    found.is_some()
}

/// Whether stream `name` exists on `nats_url`.
async fn stream_exists(nats_url: &str, name: &str) -> bool {
    let client = async_nats::connect(nats_url).await.expect("NATS");
    // `get_stream` asks the server for the stream's info (the `_no_info` variant asks nothing).
    async_nats::jetstream::new(client)
        .get_stream(name)
        .await
        .is_ok()
}

/// Drops database `name` if a failed run left it.
async fn drop_database(name: &str) {
    let url = std::env::var("DATABASE_URL").expect("DATABASE_URL");
    let admin = ops::database::connect(&url, "waybill-test", 1)
        .await
        .expect("connect");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"
    )))
    .execute(&admin)
    .await
    .expect("drop");
}

#[tokio::test]
async fn the_demo_runs_green_keeps_what_it_says_until_stopped_then_removes_it() {
    let nats = testkit::NatsServer::start().expect("nats-server");
    let url = std::env::var("DATABASE_URL").expect("DATABASE_URL");
    let run = Uuid::now_v7().simple().to_string();
    let database = format!("waybill_demo_test_{run}");
    let stream = format!("DEMO_TEST_{run}");
    let prefix = format!("demo_test_{run}");
    let started = Instant::now();
    // Named by flags, so that what is read back is named here (the defaults are tested below).
    let mut child = demo(
        &nats.url(),
        &[
            "--orders",
            "24",
            "--keep",
            "--database-name",
            &database,
            "--stream",
            &stream,
            "--subject-prefix",
            &prefix,
        ],
    );
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let mut stdout = String::new();
    let kept = tokio::time::timeout(BOUND, async {
        while let Ok(Some(line)) = lines.next_line().await {
            stdout.push_str(&line);
            stdout.push('\n');
            if line.starts_with("press Ctrl-C") {
                return true;
            }
        }
        false
    })
    .await;
    let waiting = matches!(kept, Ok(true));

    // Read while the demo waits, before asserting anything, so the database is dropped whatever the
    // outcome.
    let facts = if waiting {
        match ops::database::connect(
            &ops::database::with_database(&url, &database),
            "waybill-test",
            2,
        )
        .await
        {
            Ok(pool) => {
                let facts = demo_facts(&pool, &nats.url(), &stream, &prefix).await;
                pool.close().await;
                facts
            }
            Err(error) => Err(format!("connecting to the demo's database: {error}")),
        }
    } else {
        Err("the demo never said it was waiting".to_owned())
    };
    // Still running: --keep waits for a signal.
    let still_running = child.try_wait().expect("try_wait").is_none();
    let pid = child
        .id()
        .and_then(|id| Pid::from_raw(i32::try_from(id).ok()?));
    if let Some(pid) = pid {
        let _ = kill_process(pid, Signal::TERM);
    }
    let rest = tokio::time::timeout(Duration::from_secs(60), async {
        while let Ok(Some(line)) = lines.next_line().await {
            stdout.push_str(&line);
            stdout.push('\n');
        }
        child.wait_with_output().await
    })
    .await;
    let took = started.elapsed();
    let removed = !database_exists(&database).await;
    let stream_removed = !stream_exists(&nats.url(), &stream).await;
    drop_database(&database).await;

    let Ok(output) = rest else {
        panic!("the demo did not stop within a minute of SIGTERM: {stdout}");
    };
    let output = output.expect("waybill demo runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        waiting,
        "the demo did not finish its story within {took:?}: {stdout}\n{stderr}"
    );
    assert!(still_running, "--keep did not wait: {stdout}\n{stderr}");
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
    assert!(
        removed,
        "the database {database} is still there after SIGTERM: {stdout}"
    );
    assert!(
        stream_removed,
        "the stream {stream} is still there after SIGTERM: {stdout}"
    );
}

/// Without `--keep` the demo removes, as it ends, the database and the stream it made for this run
/// (named after its start time and process id, so runs cannot collide).
#[tokio::test]
async fn without_keep_the_demo_removes_the_database_and_stream_of_its_run() {
    let nats = testkit::NatsServer::start().expect("nats-server");
    let child = demo(&nats.url(), &["--orders", "3"]);
    let pid = child.id().expect("pid");
    let output = tokio::time::timeout(BOUND, child.wait_with_output())
        .await
        .expect("the demo finishes on its own")
        .expect("waybill demo runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    // "fresh database NAME migrated, fresh stream NAME (PREFIX.>)"
    let named = stdout
        .lines()
        .find_map(|line| {
            line.split_once("fresh database ")
                .map(|(_, rest)| rest.to_owned())
        })
        .and_then(|rest| {
            let (database, rest) = rest.split_once(" migrated, fresh stream ")?;
            let (stream, _) = rest.split_once(' ')?;
            Some((database.to_owned(), stream.to_owned()))
        });
    let Some((database, stream)) = named else {
        panic!("the demo did not name its database and stream: {stdout}\n{stderr}");
    };
    let gone = !database_exists(&database).await;
    let stream_gone = !stream_exists(&nats.url(), &stream).await;
    drop_database(&database).await;
    assert!(output.status.success(), "{stdout}\n{stderr}");
    for (name, base) in [(&database, "waybill_demo_"), (&stream, "WAYBILL_DEMO_")] {
        assert!(
            name.starts_with(base) && name.ends_with(&format!("_{pid}")),
            "{name} is not {base}<time>_{pid}: {stdout}"
        );
    }
    assert!(gone, "the database {database} is still there: {stdout}");
    assert!(stream_gone, "the stream {stream} is still there: {stdout}");
}

/// One stored copy of the crash-window event.
#[derive(Debug)]
struct Copy {
    sequence: u64,
    msg_id: Option<String>,
    stored_at_ns: i128,
}

/// What the demo claims, checked against the database and stream it left.
async fn demo_facts(
    pool: &PgPool,
    nats_url: &str,
    stream: &str,
    prefix: &str,
) -> Result<(), String> {
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
        stream,
        &format!("{prefix}.{aggregate_type}.{order}"),
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
async fn copies(
    nats_url: &str,
    stream: &str,
    subject: &str,
    event_id: Uuid,
) -> Result<Vec<Copy>, String> {
    let client = async_nats::connect(nats_url)
        .await
        .map_err(|e| format!("connecting to NATS: {e}"))?;
    let stream = async_nats::jetstream::new(client)
        .get_stream_no_info(stream)
        .await
        .map_err(|e| format!("opening {stream}: {e}"))?;
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
