//! The store and the stream disagree: a database restored behind its stream, a version missing from
//! the stream, a forged event. The relay never marks sent what it cannot show is in the stream, and
//! says so (report, metric, status); rows the stream does hold are still recognised and marked.

mod common;

use std::time::Duration;

use common::{Harness, PREFIX};
use domain::OrderId;
use relay::fence::DivergenceKind;
use sqlx::PgPool;

async fn row_state(
    pool: &PgPool,
    order: OrderId,
    version: i64,
) -> (String, Option<serde_json::Value>) {
    sqlx::query_as(
        "SELECT status, divergence FROM outbox WHERE aggregate_id = $1 AND aggregate_version = $2",
    )
    .bind(order.as_uuid())
    .bind(version)
    .fetch_one(pool)
    .await
    .expect("row")
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_store_restored_behind_its_stream_never_marks_a_new_version_sent(pool: PgPool) {
    let h = Harness::new(pool).await;
    let order = testkit::place_order(&h.store, "alice", &["MUG:1:100"]).await;
    testkit::pay_order(&h.store, order).await;
    testkit::ship_order(&h.store, order).await;
    let relay = h.relay(h.config("relay-a")).await;
    assert_eq!(relay.step().await.expect("v1-v3").marked_sent, 3);
    let before = h.stream().await;
    let old_v2 = before[1].envelope.event_id;

    // The database comes back from a backup that holds only version 1; the order is then cancelled:
    // a different version 2. Another order is placed beside it.
    testkit::restore_behind(&h.pool, order.as_uuid(), 1).await;
    let new_v2 = testkit::cancel_order(&h.store, order).await;
    let other = testkit::place_order(&h.store, "bob", &["TEA:1:100"]).await;

    let report = relay.step().await.expect("step");
    assert_eq!(report.divergences, 1, "{report:?}");
    assert_eq!(report.marked_sent, 1, "only the other order: {report:?}");
    let (status, divergence) = row_state(&h.pool, order, 2).await;
    assert_eq!(status, "failed", "never marked sent");
    let divergence = divergence.expect("the finding is kept on the row");
    assert_eq!(divergence["kind"], "other_event");
    assert_eq!(divergence["stream_msg_id"], old_v2.to_string());
    assert_eq!(divergence["stream_sequence"], before[1].sequence);

    let stream = h.stream().await;
    assert_eq!(stream.len(), 4, "the old three and the other order's v1");
    assert!(
        stream.iter().all(|m| m.envelope.event_id != new_v2),
        "the new version 2 was not added after the old version 3"
    );
    assert_eq!(
        testkit::outbox_counts(&h.pool).await.get("sent"),
        Some(&2),
        "v1 and the other order"
    );
    let _ = other;

    let status = relay::admin::status(&h.pool, false).await.expect("status");
    assert_eq!(status.diverged, 1, "{status:?}");
    let row = &status.divergences[0];
    assert_eq!(
        (row.aggregate_id, row.aggregate_version, row.event_id),
        (order.as_uuid(), 2, new_v2)
    );
    assert_eq!(row.divergence.kind, DivergenceKind::OtherEvent);
    assert_eq!(
        row.divergence.stream_msg_id.as_deref(),
        Some(old_v2.to_string().as_str())
    );

    // Retried later, it diverges again: it is never marked sent by a retry either.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let again = relay.step().await.expect("retry");
    assert_eq!((again.divergences, again.marked_sent), (1, 0), "{again:?}");
}

// Inside the dedupe window JetStream still remembers the deleted message's id and acknowledges the
// republish as a duplicate: the relay reads the acknowledged sequence back and finds it gone.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_version_missing_from_the_stream_is_a_divergence_inside_the_dedupe_window(pool: PgPool) {
    missing_version(pool, None).await;
}

// Past the window the fence refuses the republish (a later version is last) and the relay looks for
// the row's version where it should be.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_version_missing_from_the_stream_is_a_divergence_past_the_dedupe_window(pool: PgPool) {
    missing_version(pool, Some(Duration::from_secs(1))).await;
}

async fn missing_version(pool: PgPool, window: Option<Duration>) {
    let h = Harness::new(pool).await;
    let order = testkit::place_order(&h.store, "alice", &["MUG:1:100"]).await;
    testkit::pay_order(&h.store, order).await;
    testkit::ship_order(&h.store, order).await;
    let mut config = h.config("relay-a");
    if let Some(window) = window {
        config.stream.duplicate_window = window;
    }
    let relay = h.relay(config).await;
    relay.step().await.expect("v1-v3");
    let before = h.stream().await;
    // Version 2 goes from the stream (deleted by hand), and the store's marks of 2 and 3 are lost
    // (a backup taken before them).
    h.delete_message(before[1].sequence).await;
    sqlx::query(
        "UPDATE outbox SET status = 'pending', stream_seq = NULL, sent_at = NULL
         WHERE aggregate_version > 1",
    )
    .execute(&h.pool)
    .await
    .expect("unmark");
    if let Some(window) = window {
        tokio::time::sleep(window + Duration::from_millis(500)).await;
    }

    let report = relay.step().await.expect("step");
    assert_eq!(
        (report.divergences, report.marked_sent),
        (1, 0),
        "{report:?}"
    );
    let (status, divergence) = row_state(&h.pool, order, 2).await;
    assert_eq!(status, "failed");
    assert_eq!(divergence.expect("kept")["kind"], "missing");
    assert_eq!(
        row_state(&h.pool, order, 3).await.0,
        "pending",
        "version 3 waits behind it"
    );
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn rows_the_stream_holds_at_their_version_are_marked_sent_with_their_sequences(pool: PgPool) {
    let h = Harness::new(pool).await;
    let order = testkit::place_order(&h.store, "alice", &["MUG:1:100"]).await;
    testkit::pay_order(&h.store, order).await;
    testkit::ship_order(&h.store, order).await;
    let mut config = h.config("relay-a");
    config.stream.duplicate_window = Duration::from_secs(1);
    let relay = h.relay(config).await;
    relay.step().await.expect("v1-v3");
    let stream = h.stream().await;
    // A backup taken after the events but before their marks: the same events, unsent. JetStream
    // has forgotten their ids by the time the relay publishes them again.
    sqlx::query(
        "UPDATE outbox SET status = 'pending', stream_seq = NULL, sent_at = NULL
         WHERE aggregate_version > 1",
    )
    .execute(&h.pool)
    .await
    .expect("unmark");
    tokio::time::sleep(Duration::from_millis(1500)).await;

    let report = relay.step().await.expect("step");
    assert_eq!(
        (report.fenced, report.divergences, report.marked_sent),
        (2, 0, 2),
        "{report:?}"
    );
    let sequences: Vec<Option<i64>> = sqlx::query_scalar(
        "SELECT stream_seq FROM outbox WHERE aggregate_id = $1 ORDER BY aggregate_version",
    )
    .bind(order.as_uuid())
    .fetch_all(&h.pool)
    .await
    .expect("rows");
    let expected: Vec<Option<i64>> = stream
        .iter()
        .map(|m| Some(i64::try_from(m.sequence).expect("in range")))
        .collect();
    assert_eq!(sequences, expected, "each row records where its event is");
    let check = testkit::check_stream(&h.stream().await, PREFIX);
    assert_eq!(check.messages, 3, "no copy: {check:?}");
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn verify_names_what_differs_and_repair_makes_the_stream_match_the_store(pool: PgPool) {
    use relay::verify::{DifferenceKind, VerifyScope, verify};

    let h = Harness::new(pool).await;
    let order = testkit::place_order(&h.store, "alice", &["MUG:1:100"]).await;
    testkit::pay_order(&h.store, order).await;
    testkit::ship_order(&h.store, order).await;
    let fine = testkit::place_order(&h.store, "bob", &["TEA:1:100"]).await;
    let mut config = h.config("relay-a");
    config.stream.duplicate_window = Duration::from_secs(1);
    let relay = h.relay(config).await;
    relay.step().await.expect("publish all");
    let check = |scope: VerifyScope| {
        let (pool, js) = (h.pool.clone(), h.jetstream.clone());
        async move {
            verify(&pool, &js, common::STREAM, PREFIX, &scope, &|_, _| {})
                .await
                .expect("verify")
        }
    };
    let agreed = check(VerifyScope::default()).await;
    assert!(agreed.ok, "{agreed:?}");
    assert_eq!((agreed.store_events, agreed.stream_messages), (4, 4));

    testkit::restore_behind(&h.pool, order.as_uuid(), 1).await;
    let new_v2 = testkit::cancel_order(&h.store, order).await;
    relay.step().await.expect("diverges");

    for scope in [
        VerifyScope::default(),
        VerifyScope {
            aggregates: vec![order.as_uuid(), fine.as_uuid()],
            since: None,
        },
    ] {
        let report = check(scope).await;
        assert!(!report.ok);
        assert_eq!(
            report.differing.len(),
            1,
            "only the restored order: {report:?}"
        );
        let differing = &report.differing[0];
        assert_eq!(differing.aggregate_id, order.as_uuid());
        let kinds: Vec<DifferenceKind> = differing.differences.iter().map(|d| d.kind).collect();
        assert_eq!(
            kinds,
            vec![DifferenceKind::Diverged, DifferenceKind::NotInStore],
            "{differing:?}"
        );
        assert_eq!(differing.differences[0].store_event_id, Some(new_v2));
        assert_eq!(report.unsent, 1, "the new v2 is not sent");
    }

    // Repair, the store being the truth: the old v2 and v3 go from the stream, the new v2 is published.
    let stream = h
        .jetstream
        .get_stream(common::STREAM)
        .await
        .expect("stream");
    let plan = relay::repair::plan(&h.pool, &stream, PREFIX, order.as_uuid())
        .await
        .expect("plan");
    assert_eq!(plan.agreeing_versions, 1);
    assert_eq!(plan.delete.len(), 2, "{plan:?}");
    assert_eq!(plan.republish, vec![2]);
    relay::repair::apply(&h.pool, &stream, plan)
        .await
        .expect("apply");
    // JetStream remembers nothing of the new v2's id: it publishes at once, fenced on v1.
    let report = relay.step().await.expect("republish");
    assert_eq!(
        (report.marked_sent, report.divergences),
        (1, 0),
        "{report:?}"
    );
    let after = check(VerifyScope::default()).await;
    assert!(after.ok, "{after:?}");
    let again = relay::repair::plan(&h.pool, &stream, PREFIX, order.as_uuid())
        .await
        .expect("plan");
    assert!(
        again.delete.is_empty() && again.republish.is_empty(),
        "{again:?}"
    );
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_stream_the_server_splits_keeps_the_fence_the_divergence_check_and_verify(pool: PgPool) {
    let h = Harness::new(pool).await;
    let split = relay::StreamLimits {
        partitions: Some(2),
        ..relay::StreamLimits::default()
    };
    let mut config = h.config("relay-a");
    config.stream.duplicate_window = Duration::from_secs(1);
    relay::ensure_stream_with(&h.jetstream, &config.stream, &split, false)
        .await
        .expect("a stream split into 2 partitions");
    let mut orders = Vec::new();
    for customer in ["alice", "bob", "carol", "dave", "erin", "frank"] {
        let order = testkit::place_order(&h.store, customer, &["MUG:1:100"]).await;
        testkit::pay_order(&h.store, order).await;
        orders.push(order);
    }
    // A relay told nothing of partitions accepts the stream as split.
    let relay = h.relay(config.clone()).await;

    // Published, then "crashed" before marking; the retry comes after the dedupe window, so only the
    // fence, which reads the stored subject `<prefix>.<K>.order.<id>`, can recognise the copies.
    let crashed = relay
        .clone()
        .with_fail_point(relay::FailPoint::AbandonAfterPublish);
    assert!(crashed.step().await.expect("step").simulated_crash);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let report = relay.step().await.expect("step");
    assert_eq!(
        (report.published, report.fenced, report.divergences),
        (12, 12, 0),
        "{report:?}"
    );
    let stream = h.stream().await;
    let check = testkit::check_stream(&stream, PREFIX);
    assert!(check.holds() && check.messages == 12, "{check:?}");
    for message in &stream {
        let id = message.envelope.aggregate_id;
        let partition = domain::wire::stream_partition(id, 2);
        assert_eq!(message.subject, format!("{PREFIX}.{partition}.order.{id}"));
    }
    let verified = relay::verify::verify(
        &h.pool,
        &h.jetstream,
        common::STREAM,
        PREFIX,
        &relay::verify::VerifyScope::default(),
        &|_, _| {},
    )
    .await
    .expect("verify");
    assert!(
        verified.ok && verified.stream_messages == 12 && verified.foreign_subjects.is_empty(),
        "{verified:?}"
    );

    // A store restored behind its stream is still a divergence, found on the stored subject.
    let order = orders[0];
    testkit::restore_behind(&h.pool, order.as_uuid(), 1).await;
    testkit::cancel_order(&h.store, order).await;
    let report = relay.step().await.expect("step");
    assert_eq!(report.divergences, 1, "{report:?}");
    let (status, divergence) = row_state(&h.pool, order, 2).await;
    assert_ne!(status, "sent");
    assert!(divergence.is_some());

    // The split is fixed while the stream holds messages: another one is refused, naming why.
    let resplit = relay::StreamLimits {
        partitions: Some(4),
        ..relay::StreamLimits::default()
    };
    let refused = relay::ensure_stream_with(&h.jetstream, &config.stream, &resplit, true)
        .await
        .expect_err("a new split under stored messages");
    assert!(
        matches!(
            refused,
            relay::ProvisionError::Resplit {
                have: 2,
                want: 4,
                ..
            }
        ),
        "{refused}"
    );
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_wal_mark_leaves_a_row_that_a_repair_rewound_after_its_publish_unsent(pool: PgPool) {
    // Two orders' first versions published as a relay reading the WAL publishes them (no claim),
    // their PubAcks in hand and their mark not yet run.
    let h = Harness::new(pool).await;
    let relay = h.relay(h.config("relay-a")).await;
    let mut published = Vec::new();
    for customer in ["alice", "bob"] {
        let order = testkit::place_order(&h.store, customer, &["MUG:1:100"]).await;
        let (id, event_id, body): (i64, uuid::Uuid, String) = sqlx::query_as(
            "SELECT id, event_id, body FROM outbox WHERE aggregate_id = $1 AND aggregate_version = 1",
        )
        .bind(order.as_uuid())
        .fetch_one(&h.pool)
        .await
        .expect("the row");
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", event_id.to_string().as_str());
        let ack = h
            .jetstream
            .publish_with_headers(
                format!("{PREFIX}.order.{}", order.as_uuid()),
                headers,
                body.into(),
            )
            .await
            .expect("publish")
            .await
            .expect("PubAck");
        published.push((order, id, i64::try_from(ack.sequence).expect("a sequence")));
    }
    // Meanwhile an operator repairs alice's order: her message is deleted from the stream and her row
    // set pending again, as `outbox repair --apply` does for versions after the agreeing ones.
    let (alice, alice_row, alice_seq) = published[0];
    let (bob, bob_row, bob_seq) = published[1];
    h.delete_message(u64::try_from(alice_seq).expect("a sequence"))
        .await;
    let mut tx = h.pool.begin().await.expect("begin");
    store::outbox::relaying::rewind_after(&mut tx, alice.as_uuid(), 0)
        .await
        .expect("rewound");
    tx.commit().await.expect("commit");

    // The mark runs now: bob's row is sent, alice's is left to polling — marked, it would name a
    // message the stream no longer holds.
    let marked = store::outbox::relaying::mark_delivered(
        &h.pool,
        "relay-wal",
        &[alice_row, bob_row],
        &[alice_seq, bob_seq],
    )
    .await
    .expect("mark");
    assert_eq!((marked.marked, marked.unseen.len()), (1, 0), "{marked:?}");
    assert_eq!(row_state(&h.pool, bob, 1).await.0, "sent");
    assert_eq!(row_state(&h.pool, alice, 1).await.0, "pending");
    // And polling does not take the deleted copy for the row either: JetStream still remembers its
    // id, and a duplicate of a message the stream lacks is a divergence, not a delivery.
    let report = relay.step().await.expect("a step");
    assert_eq!(
        (report.marked_sent, report.divergences),
        (0, 1),
        "{report:?}"
    );
    assert_ne!(row_state(&h.pool, alice, 1).await.0, "sent");
}
