//! A bounded stream: `provision --max-age` sets, checks and changes the stream's age limit like its
//! other settings, refuses limits too short for the fence, and a relay keeps publishing an order
//! whose earlier messages are gone from the stream.

mod common;

use std::time::Duration;

use common::{Harness, PREFIX, STREAM};
use serde_json::Value;
use sqlx::PgPool;

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

async fn provision(h: &Harness, args: &[&str]) -> Run {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_waybill-relay"))
        .args(["--database-url", &h.url, "--nats-url", &h.nats.url()])
        .args(["--stream", STREAM, "--subject-prefix", PREFIX])
        .args(["--json", "provision"])
        .args(args)
        .env("RUST_LOG", "warn")
        .env_remove("WAYBILL_STREAM_MAX_AGE")
        .output()
        .await
        .expect("waybill-relay runs");
    Run {
        code: output.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

fn json(run: &Run) -> Value {
    serde_json::from_str(&run.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}{}", run.stdout, run.stderr))
}

async fn max_age(h: &Harness) -> Duration {
    let mut stream = h.jetstream.get_stream(STREAM).await.expect("stream");
    stream.info().await.expect("info").config.max_age
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn max_age_is_provisioned_checked_and_changed_like_the_other_settings(pool: PgPool) {
    let h = Harness::new(pool).await;
    let week = 7 * 24 * 3600;

    let created = provision(&h, &["--max-age", "7d"]).await;
    assert_eq!(created.code, 0, "{}{}", created.stdout, created.stderr);
    assert_eq!(json(&created)["max_age_s"], week as f64);
    assert_eq!(max_age(&h).await, Duration::from_secs(week));

    // Not told: an existing stream keeps its limit (a relay started without the flag works on).
    let untold = provision(&h, &[]).await;
    assert_eq!(untold.code, 0, "{}{}", untold.stdout, untold.stderr);
    assert_eq!(max_age(&h).await, Duration::from_secs(week));

    let other = provision(&h, &["--max-age", "2d"]).await;
    assert_eq!(other.code, 1, "{}{}", other.stdout, other.stderr);
    let message = json(&other)["error"]["message"].to_string();
    assert!(
        message.contains("max_age is 7days, needs 2days") && message.contains("--update"),
        "{message}"
    );
    assert_eq!(max_age(&h).await, Duration::from_secs(week), "unchanged");

    let updated = provision(&h, &["--max-age", "2d", "--update"]).await;
    assert_eq!(updated.code, 0, "{}{}", updated.stdout, updated.stderr);
    assert_eq!(max_age(&h).await, Duration::from_secs(2 * 24 * 3600));
    let off = provision(&h, &["--max-age", "off", "--update"]).await;
    assert_eq!(off.code, 0, "{}{}", off.stdout, off.stderr);
    assert_eq!(json(&off)["max_age_s"], Value::Null);
    assert_eq!(max_age(&h).await, Duration::ZERO, "no limit again");

    for (flag, says) in [
        ("30m", "under 1h"),
        ("0s", "spelled `off`"),
        ("soon", "is not a duration"),
    ] {
        let refused = provision(&h, &["--max-age", flag]).await;
        assert_eq!(
            refused.code, 2,
            "{flag}: {}{}",
            refused.stdout, refused.stderr
        );
        let printed = format!("{}{}", refused.stdout, refused.stderr);
        assert!(printed.contains(says), "{flag}: {printed}");
    }
    assert_eq!(max_age(&h).await, Duration::ZERO, "refusals change nothing");
}

/// The fence names the stream sequence of an order's previous message; once that message aged out
/// of the stream the subject is empty, the broker refuses the expectation, and the relay fences on
/// what the stream holds (nothing) instead: the order's next event is published once.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn an_order_whose_earlier_messages_aged_out_is_still_published(pool: PgPool) {
    let h = Harness::new(pool).await;
    let relay = h.relay(h.config("relay-a")).await;
    let order = testkit::place_order(&h.store, "alice", &["MUG:1:100"]).await;
    relay.drain().await.expect("drain");
    let stream = h.jetstream.get_stream(STREAM).await.expect("stream");
    stream.purge().await.expect("purge");

    testkit::pay_order(&h.store, order).await;
    let summary = relay.drain().await.expect("drain");
    assert_eq!(summary.marked_sent, 1, "{summary:?}");
    let events = h.stream().await;
    assert_eq!(events.len(), 1, "only the payment is left in the stream");
    assert_eq!(events[0].envelope.aggregate_version, 2);
    let counts = testkit::outbox_counts(&h.pool).await;
    assert_eq!(counts.get("sent"), Some(&2), "{counts:?}");
}
