//! The crash window, end to end: `cargo run -p relay --example crash_window`
//!
//! Reproduces the seed article's scenario on real services. An order is created; the first relay
//! claims its outbox row, publishes it, gets the PubAck — and "crashes" before marking it sent. Then a
//! second relay pass runs. The outbox promises at-least-once, so the event is published twice; JetStream
//! drops the second copy because the `Nats-Msg-Id` is the event id (nats-server 2.9) or because the
//! publish's expected subject sequence is stale (2.10 and later check that first).
//!
//! Reads the server from `DATABASE_URL` (default `postgres://127.0.0.1:5432/...`) and uses its own
//! database there (`WAYBILL_EXAMPLE_DATABASE`, default `waybill_example_crash_window`), and `NATS_URL`
//! (default `nats://127.0.0.1:4222`) with its own stream (`WAYBILL_EXAMPLE_STREAM`, default
//! `CRASH_WINDOW`, subjects `<stream in lower case>.events.>`); both are recreated on every run, so
//! nothing else is touched, and two runs with different names cannot collide.

use std::time::Duration;

use anyhow::Context;
use async_nats::jetstream;
use relay::admin::{OutboxRow, RowStatus};
use relay::{FailPoint, Relay, RelayConfig, StreamSettings};
use store::{CommandContext, EventStore};

/// This example's database and stream unless the environment names others.
const DATABASE: &str = "waybill_example_crash_window";
const STREAM: &str = "CRASH_WINDOW";

/// A name from the environment, checked to be safe to splice into SQL and NATS subjects.
fn name_from_env(variable: &str, default: &str) -> anyhow::Result<String> {
    let name = std::env::var(variable).unwrap_or_else(|_| default.to_owned());
    anyhow::ensure!(
        !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
        "{variable} may only use letters, digits and '_': {name:?}"
    );
    Ok(name)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let server_url =
        std::env::var("DATABASE_URL").unwrap_or_else(|_| ops::DEFAULT_DATABASE_URL.to_owned());
    let database = name_from_env("WAYBILL_EXAMPLE_DATABASE", DATABASE)?;
    let stream_name = name_from_env("WAYBILL_EXAMPLE_STREAM", STREAM)?;
    let prefix = format!(
        "{}.events",
        stream_name.to_ascii_lowercase().replace('_', "")
    );
    let database_url = ops::database::with_database(&server_url, &database);
    let nats_url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned());

    let admin = ops::database::connect(
        &ops::database::with_database(&server_url, "postgres"),
        "crash-window-example",
        1,
    )
    .await?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS \"{database}\" WITH (FORCE)"
    )))
    .execute(&admin)
    .await?;
    admin.close().await;
    ops::database::ensure_database(&database_url)
        .await
        .context("creating the database")?;
    let pool = ops::database::connect(&database_url, "crash-window-example", 4).await?;
    store::migrate(&pool).await?;
    let nats = async_nats::connect(&nats_url)
        .await
        .context("connecting to NATS")?;
    let js = jetstream::new(nats);
    let _ = js.delete_stream(&stream_name).await; // a clean stream every run

    // 1. A command writes the order and its outbox row in one transaction. Nothing is published.
    let store = EventStore::new(pool.clone());
    let order_id = domain::OrderId::from_uuid(uuid::Uuid::now_v7());
    let placed = store
        .execute(order_id, &place_command()?, &CommandContext::default())
        .await?;
    let event_id = placed.event_ids[0];
    let outbox_id = outbox_row(&pool, event_id).await?.id;
    println!("order_id={order_id} event_id={event_id} outbox_message_id={outbox_id}");

    let config = RelayConfig {
        stream: StreamSettings {
            name: stream_name.clone(),
            subject_prefix: prefix.clone(),
            duplicate_window: Duration::from_secs(120),
        },
        batch_size: 1,
        publish_timeout: Duration::from_secs(5),
        ..RelayConfig::default()
    };

    // 2. The first relay publishes, receives the PubAck, and dies before marking the row sent.
    let first = Relay::connect(
        &database_url,
        &nats_url,
        RelayConfig {
            relay_id: "first_relay".into(),
            ..config.clone()
        },
    )
    .await?
    .with_fail_point(FailPoint::AbandonAfterPublish);
    first.provision(false).await?;
    let crash = first.step().await?;
    println!(
        "first_relay claimed={} published={} marked_sent={} simulated_crash={}",
        crash.claimed, crash.published, crash.marked_sent, crash.simulated_crash
    );
    let status = outbox_row(&pool, event_id).await?.status;
    let in_stream = stream_copies(&js, &stream_name, event_id).await?;
    println!(
        "published_after_crash={} stream_messages_for_event={in_stream} outbox_status={status}",
        crash.published
    );

    // 3. Recovery: there is nothing to sweep. The claim was a row lock held by the crashed relay's
    //    transaction; PostgreSQL rolled it back and released the lock when the session ended.
    println!(
        "recovered_processing=0 (no lease to expire: the row lock went with the session; the row is {status})"
    );

    // 4. The second relay pass publishes again. JetStream recognises the Nats-Msg-Id.
    let second = Relay::connect(
        &database_url,
        &nats_url,
        RelayConfig {
            relay_id: "second_relay".into(),
            ..config
        },
    )
    .await?;
    let retry = second.step().await?;
    println!(
        "second_relay claimed={} published={} duplicate_acks={} fenced={} marked_sent={}",
        retry.claimed, retry.published, retry.duplicates, retry.fenced, retry.marked_sent
    );
    let publishes = crash.published + retry.published;
    let in_stream = stream_copies(&js, &stream_name, event_id).await?;
    let status = outbox_row(&pool, event_id).await?.status;
    println!(
        "published_after_retry={publishes} stream_messages_for_event={in_stream} outbox_status={status}"
    );
    // Which guard stops the second copy depends on the server: nats-server 2.9 checks the message id
    // first (a duplicate PubAck); 2.10 and later check the expected subject sequence first, and the
    // relay's fence then finds this very event at the row's version.
    let recognised_by = if retry.duplicates == 1 {
        "the second PubAck was a duplicate (duplicate=true: the Nats-Msg-Id is the event id)"
    } else if retry.fenced == 1 {
        "the per-order fence refused it (wrong last subject sequence) and the relay found this very \
         event there"
    } else {
        "nothing recognised it"
    };
    println!(
        "=> at-least-once: the event was published {publishes} times; JetStream stored it {in_stream} \
         time(s) because {recognised_by}."
    );

    anyhow::ensure!(
        in_stream == 1 && retry.duplicates + retry.fenced == 1 && status == RowStatus::Sent,
        "the crash window was not closed"
    );
    Ok(())
}

/// Alice orders two mugs.
fn place_command() -> anyhow::Result<domain::OrderCommand> {
    Ok(domain::OrderCommand::Place(domain::PlaceOrder {
        customer_id: domain::CustomerId::parse("alice")?,
        currency: domain::Currency::parse("EUR")?,
        lines: vec![domain::OrderLine::parse("MUG-BLUE:2:1250")?],
        channel: domain::Channel::Web,
    }))
}

async fn outbox_row(pool: &sqlx::PgPool, event_id: uuid::Uuid) -> anyhow::Result<OutboxRow> {
    relay::admin::row_of_event(pool, event_id)
        .await?
        .with_context(|| format!("event {event_id} has no outbox row"))
}

/// How many messages in the stream carry this event.
async fn stream_copies(
    js: &jetstream::Context,
    stream: &str,
    event_id: uuid::Uuid,
) -> anyhow::Result<u64> {
    let mut stream = js.get_stream(stream).await?;
    let info = stream.info().await?.clone();
    let mut copies = 0;
    for sequence in info.state.first_sequence..=info.state.last_sequence {
        if info.state.messages == 0 {
            break;
        }
        if let Ok(message) = stream.get_raw_message(sequence).await
            && message.headers.get("Nats-Msg-Id").map(|v| v.as_str())
                == Some(event_id.to_string().as_str())
        {
            copies += 1;
        }
    }
    Ok(copies)
}
