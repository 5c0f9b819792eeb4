//! A bounded outbox: a running relay deletes sent rows past its retention, in batches, and never an
//! unsent one; an order whose earlier rows are gone is still published in order, fenced on the stream.

mod common;

use std::time::Duration;

use common::{Harness, PREFIX, Running, wait_until};
use relay::admin;
use sqlx::PgPool;

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn sent_rows_past_the_retention_leave_and_unsent_ones_stay(pool: PgPool) {
    let h = Harness::new(pool.clone()).await;
    let mut orders = Vec::new();
    for i in 0..5 {
        orders.push(testkit::place_order(&h.store, &format!("c{i}"), &["MUG:1:100"]).await);
    }
    // One row the relay has given up on: retention is about sent rows only.
    let dead_order = orders[4];
    sqlx::query("UPDATE outbox SET status = 'dead', dead_at = now(), dead_reason = 'test' WHERE aggregate_id = $1")
        .bind(dead_order.as_uuid())
        .execute(&pool)
        .await
        .expect("a dead row");

    let relay = h
        .relay(relay::RelayConfig {
            retention: Some(Duration::from_secs(1)),
            // Small batches: the sweep must go on until nothing past the retention is left.
            retention_batch: 2,
            ..h.config("sweeping-relay")
        })
        .await;
    let running = Running::start(&relay);

    // The four live orders are sent, then deleted once a second old (the sweep runs every 10 s).
    wait_until(
        Duration::from_secs(40),
        "only the dead row left in the outbox",
        || async {
            sqlx::query_as::<_, (String,)>("SELECT status FROM outbox")
                .fetch_all(&pool)
                .await
                .is_ok_and(|rows| rows == [("dead".to_owned(),)])
        },
    )
    .await;
    assert_eq!(
        h.count("SELECT count(*) FROM events").await,
        5,
        "events are never touched"
    );

    // A later event of a purged order: published after its predecessor, fenced on the stream.
    testkit::pay_order(&h.store, orders[0]).await;
    h.wait_for_messages(5).await;
    let stream = h.stream().await;
    let check = testkit::check_stream(&stream, PREFIX);
    assert!(check.holds(), "{check:?}");
    assert_eq!(check.messages, 5, "four placed and one paid");

    let summary = running.stop().await;
    assert_eq!(summary.published, 5, "{summary:?}");
}

/// The vacuum gauges see a transaction that holds a snapshot: the one that keeps dead outbox rows
/// from being reclaimed.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn an_old_snapshot_shows_in_the_vacuum_gauge(pool: PgPool) {
    let before = admin::vacuum_state(&pool).await.expect("vacuum state");
    assert!(
        before.oldest_transaction_seconds < 1.0,
        "nothing old is open yet: {before:?}"
    );
    let mut holder = pool.begin().await.expect("a transaction");
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut *holder)
        .await
        .expect("isolation");
    // The first statement takes the snapshot, kept until the transaction ends.
    sqlx::query("SELECT count(*) FROM outbox")
        .execute(&mut *holder)
        .await
        .expect("a snapshot");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let held = admin::vacuum_state(&pool).await.expect("vacuum state");
    assert!(
        held.oldest_transaction_seconds >= 1.0,
        "the open snapshot is seen: {held:?}"
    );
    holder.rollback().await.expect("rollback");
}
