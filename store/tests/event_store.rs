//! The event store against a real PostgreSQL: atomic append, optimistic concurrency, idempotency and
//! loading legacy history. Each test gets its own freshly migrated database.

use chrono::Utc;
use domain::{
    CancelOrder, Cents, Currency, CustomerId, EventEnvelope, EventMeta, Note, OrderCommand,
    OrderError, OrderEvent, OrderId, OrderLine, OrderStatus, PayOrder, PlaceOrder,
};
use futures::future::join_all;
use serde_json::json;
use sqlx::PgPool;
use store::{AppendError, AppendOptions, CommandContext, CommandError, EventStore, append};
use uuid::Uuid;

fn place_command() -> OrderCommand {
    OrderCommand::Place(PlaceOrder {
        customer_id: CustomerId::parse("alice").expect("customer"),
        currency: Currency::parse("EUR").expect("currency"),
        channel: domain::Channel::Web,
        lines: vec![
            OrderLine::parse("MUG-BLUE:2:1250").expect("line"),
            OrderLine::parse("TEA:1:500").expect("line"),
        ],
    })
}

fn pay_command(cents: i64) -> OrderCommand {
    OrderCommand::Pay(PayOrder {
        amount_cents: Cents::new(cents).expect("cents"),
        payment_ref: None,
    })
}

fn cancel_command() -> OrderCommand {
    OrderCommand::Cancel(CancelOrder {
        reason: Note::parse("test").expect("reason"),
    })
}

fn new_order_id() -> OrderId {
    OrderId::from_uuid(Uuid::now_v7())
}

/// An envelope for `event` at `version` of `order_id`, as the command path would build it.
fn envelope(order_id: OrderId, version: i64, event: &OrderEvent) -> EventEnvelope {
    let meta = EventMeta {
        event_id: Uuid::now_v7(),
        occurred_at: Utc::now(),
        correlation_id: None,
        causation_id: None,
    };
    EventEnvelope::wrap(event, order_id, version, meta)
}

fn placed_event() -> OrderEvent {
    domain::Order::new(new_order_id())
        .decide(&place_command())
        .expect("valid")
        .remove(0)
}

async fn count(pool: &PgPool, table: &str) -> i64 {
    let sql = match table {
        "events" => "SELECT count(*) FROM events",
        "outbox" => "SELECT count(*) FROM outbox",
        "command_idempotency" => "SELECT count(*) FROM command_idempotency",
        other => panic!("no such table {other}"),
    };
    sqlx::query_scalar(sql)
        .fetch_one(pool)
        .await
        .expect("count")
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn an_append_writes_each_event_with_its_outbox_row(pool: PgPool) {
    let store = EventStore::new(pool.clone());
    let id = new_order_id();
    let placed = store
        .execute(id, &place_command(), &CommandContext::default())
        .await
        .expect("place");
    let paid = store
        .execute(id, &pay_command(3000), &CommandContext::default())
        .await
        .expect("pay");
    assert_eq!((placed.aggregate_version, paid.aggregate_version), (1, 2));

    let rows: Vec<(Uuid, String, i64, String)> = sqlx::query_as(
        "SELECT o.event_id, o.event_type, o.aggregate_version, o.status
         FROM outbox o JOIN events e USING (event_id) ORDER BY o.aggregate_version",
    )
    .fetch_all(&pool)
    .await
    .expect("outbox rows");
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0].0, placed.event_ids[0]);
    assert_eq!(
        (rows[1].1.as_str(), rows[1].2, rows[1].3.as_str()),
        ("order.paid", 2, "pending")
    );

    let order = store.load(id).await.expect("load");
    assert_eq!(order.status, OrderStatus::Paid);
    assert_eq!(order.version, 2);
    assert_eq!(order.total_cents, 3000);
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn concurrent_appends_at_the_same_version_let_exactly_one_win(pool: PgPool) {
    let id = new_order_id();
    let event = placed_event();
    let attempts = (0..8).map(|_| {
        let pool = pool.clone();
        let batch = vec![envelope(id, 1, &event)];
        async move { append(&pool, id.as_uuid(), 0, &batch, &AppendOptions::default()).await }
    });
    let results = join_all(attempts).await;

    let winners = results.iter().filter(|r| r.is_ok()).count();
    assert_eq!(winners, 1, "{results:?}");
    for result in results.iter().filter(|r| r.is_err()) {
        assert!(
            matches!(
                result,
                Err(AppendError::VersionConflict {
                    expected: 0,
                    actual: 1,
                    ..
                })
            ),
            "{result:?}"
        );
    }
    assert_eq!(count(&pool, "events").await, 1);
    assert_eq!(
        count(&pool, "outbox").await,
        1,
        "losers leave no outbox row behind"
    );
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_stale_expected_version_is_a_conflict_and_writes_nothing(pool: PgPool) {
    let store = EventStore::new(pool.clone());
    let id = new_order_id();
    store
        .execute(id, &place_command(), &CommandContext::default())
        .await
        .expect("place");
    let paid = OrderEvent::Paid(domain::OrderPaid::from_command(&PayOrder {
        amount_cents: Cents::new(3000).expect("c"),
        payment_ref: None,
    }));

    // Behind: version 1 is taken.
    let behind = append(
        &pool,
        id.as_uuid(),
        0,
        &[envelope(id, 1, &paid)],
        &AppendOptions::default(),
    )
    .await;
    assert!(
        matches!(
            behind,
            Err(AppendError::VersionConflict {
                expected: 0,
                actual: 1,
                ..
            })
        ),
        "{behind:?}"
    );
    // Ahead: version 5 would leave a gap after 1.
    let ahead = append(
        &pool,
        id.as_uuid(),
        5,
        &[envelope(id, 6, &paid)],
        &AppendOptions::default(),
    )
    .await;
    assert!(
        matches!(
            ahead,
            Err(AppendError::VersionConflict {
                expected: 5,
                actual: 1,
                ..
            })
        ),
        "{ahead:?}"
    );

    assert_eq!(count(&pool, "events").await, 1);
    assert_eq!(count(&pool, "outbox").await, 1);
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_failing_outbox_insert_leaves_no_event_behind(pool: PgPool) {
    // Sabotage: an outbox constraint that rejects every paid event.
    sqlx::query("ALTER TABLE outbox ADD CONSTRAINT sabotage CHECK (event_type <> 'order.paid')")
        .execute(&pool)
        .await
        .expect("sabotage");
    let store = EventStore::new(pool.clone());
    let id = new_order_id();
    store
        .execute(id, &place_command(), &CommandContext::default())
        .await
        .expect("place");

    let err = store
        .execute(id, &pay_command(3000), &CommandContext::default())
        .await
        .expect_err("rejected");
    // The message says what failed; the database's reason is further down the chain.
    let err = format!("{:#}", anyhow::Error::from(err));
    assert!(err.contains("sabotage"), "{err}");

    assert_eq!(
        count(&pool, "events").await,
        1,
        "the paid event must not exist without its outbox row"
    );
    assert_eq!(count(&pool, "outbox").await, 1);
    assert_eq!(
        store.load(id).await.expect("load").status,
        OrderStatus::Placed
    );
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_failed_append_does_not_keep_its_idempotency_key(pool: PgPool) {
    // The key is recorded first in the transaction; if the events then fail, the key must go too, or a
    // retry would be answered with events that do not exist.
    sqlx::query("ALTER TABLE outbox ADD CONSTRAINT sabotage CHECK (event_type <> 'order.placed')")
        .execute(&pool)
        .await
        .expect("sabotage");
    let store = EventStore::new(pool.clone());
    let context = CommandContext {
        idempotency_key: Some("k-broken".into()),
        ..Default::default()
    };
    store
        .execute(new_order_id(), &place_command(), &context)
        .await
        .expect_err("rejected");
    assert_eq!(count(&pool, "command_idempotency").await, 0);
    assert_eq!(count(&pool, "events").await, 0);
    assert_eq!(count(&pool, "outbox").await, 0);
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_retry_with_the_same_idempotency_key_returns_the_first_result(pool: PgPool) {
    let store = EventStore::new(pool.clone());
    let context = CommandContext {
        idempotency_key: Some("checkout-42".into()),
        ..Default::default()
    };
    let first = store
        .execute(new_order_id(), &place_command(), &context)
        .await
        .expect("first");
    // The retry arrives with a freshly generated order id, as a client's second attempt would.
    let retry = store
        .execute(new_order_id(), &place_command(), &context)
        .await
        .expect("retry");

    assert!(!first.replayed);
    assert!(retry.replayed);
    assert_eq!(retry.id, first.id);
    assert_eq!(retry.event_ids, first.event_ids);
    assert_eq!(retry.aggregate_version, 1);
    assert_eq!(count(&pool, "events").await, 1);
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn concurrent_requests_with_one_key_write_once(pool: PgPool) {
    let store = EventStore::new(pool.clone());
    let context = CommandContext {
        idempotency_key: Some("double-click".into()),
        ..Default::default()
    };
    let attempts = (0..6).map(|_| {
        let (store, context) = (store.clone(), context.clone());
        async move {
            store
                .execute(new_order_id(), &place_command(), &context)
                .await
        }
    });
    let results: Vec<_> = join_all(attempts)
        .await
        .into_iter()
        .map(|r| r.expect("each succeeds"))
        .collect();
    let first = results[0].id;
    assert!(results.iter().all(|r| r.id == first));
    assert_eq!(results.iter().filter(|r| !r.replayed).count(), 1);
    assert_eq!(count(&pool, "events").await, 1);
    assert_eq!(count(&pool, "command_idempotency").await, 1);
}

/// The chaos harness's review found this one: a client retries a payment whose first attempt is still
/// being written; the retry finds no record yet, then reads the order the first attempt left (paid)
/// and would be refused with 409 — for a request that succeeded. The retry is started a little later
/// each round, so that some land in that window.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_retry_racing_its_first_attempt_is_answered_not_refused(pool: PgPool) {
    let store = EventStore::new(pool.clone());
    for round in 0..150u64 {
        let placed = store
            .execute(new_order_id(), &place_command(), &CommandContext::default())
            .await
            .expect("place");
        let context = CommandContext {
            idempotency_key: Some(format!("pay-{round}")),
            ..Default::default()
        };
        let pay = pay_command(3000);
        let first = store.execute(placed.id, &pay, &context);
        let retry = async {
            tokio::time::sleep(std::time::Duration::from_micros(round % 30 * 100)).await;
            store.execute(placed.id, &pay, &context).await
        };
        let (first, retry) = tokio::join!(first, retry);
        first.expect("the first attempt succeeds");
        let retry = retry.unwrap_or_else(|e| panic!("round {round}: the retry was refused: {e}"));
        assert_eq!(retry.aggregate_version, 2);
    }
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn reusing_a_key_for_a_different_request_is_refused(pool: PgPool) {
    let store = EventStore::new(pool.clone());
    let context = CommandContext {
        idempotency_key: Some("k1".into()),
        ..Default::default()
    };
    let placed = store
        .execute(new_order_id(), &place_command(), &context)
        .await
        .expect("place");
    let err = store
        .execute(placed.id, &pay_command(3000), &context)
        .await
        .expect_err("reused");
    assert!(matches!(err, CommandError::KeyReused(_)), "{err}");
    assert!(err.is_refusal());
    assert_eq!(count(&pool, "events").await, 1);
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_refused_command_writes_nothing(pool: PgPool) {
    let store = EventStore::new(pool.clone());
    let id = new_order_id();
    store
        .execute(id, &place_command(), &CommandContext::default())
        .await
        .expect("place");
    let err = store
        .execute(id, &pay_command(1), &CommandContext::default())
        .await
        .expect_err("wrong amount");
    assert!(
        matches!(err, CommandError::Refused(OrderError::WrongAmount { .. })),
        "{err}"
    );
    let err = store
        .execute(
            new_order_id(),
            &cancel_command(),
            &CommandContext::default(),
        )
        .await
        .expect_err("unknown");
    assert!(
        matches!(err, CommandError::Refused(OrderError::NotFound(_))),
        "{err}"
    );
    assert_eq!(count(&pool, "events").await, 1);
    assert_eq!(count(&pool, "outbox").await, 1);
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn placing_an_existing_order_id_is_refused(pool: PgPool) {
    let store = EventStore::new(pool.clone());
    let id = new_order_id();
    store
        .execute(id, &place_command(), &CommandContext::default())
        .await
        .expect("place");
    let err = store
        .execute(id, &place_command(), &CommandContext::default())
        .await
        .expect_err("exists");
    assert!(
        matches!(err, CommandError::Refused(OrderError::AlreadyPlaced(_))),
        "{err}"
    );
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn racing_commands_are_re_decided_against_the_winner(pool: PgPool) {
    // Two cancels race; the loser must not write a second cancel, it must be refused after re-reading.
    let store = EventStore::new(pool.clone());
    let id = new_order_id();
    store
        .execute(id, &place_command(), &CommandContext::default())
        .await
        .expect("place");
    let races = (0..4).map(|_| {
        let store = store.clone();
        async move {
            store
                .execute(id, &cancel_command(), &CommandContext::default())
                .await
        }
    });
    let results = join_all(races).await;
    assert_eq!(
        results.iter().filter(|r| r.is_ok()).count(),
        1,
        "{results:?}"
    );
    for err in results.iter().filter_map(|r| r.as_ref().err()) {
        assert!(
            matches!(
                err,
                CommandError::Refused(OrderError::IllegalTransition { .. })
            ),
            "{err}"
        );
    }
    assert_eq!(count(&pool, "events").await, 2);
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn an_if_match_on_a_stale_version_is_a_conflict(pool: PgPool) {
    let store = EventStore::new(pool.clone());
    let id = new_order_id();
    store
        .execute(id, &place_command(), &CommandContext::default())
        .await
        .expect("place");
    let stale = CommandContext {
        expected_version: Some(0),
        ..Default::default()
    };
    let err = store
        .execute(id, &pay_command(3000), &stale)
        .await
        .expect_err("stale");
    assert!(
        matches!(
            err,
            CommandError::StaleVersion {
                expected: 0,
                actual: 1,
                ..
            }
        ),
        "{err}"
    );
    assert!(
        err.is_refusal(),
        "a failed precondition is the caller's to fix"
    );
    let fresh = CommandContext {
        expected_version: Some(1),
        ..Default::default()
    };
    store
        .execute(id, &pay_command(3000), &fresh)
        .await
        .expect("current version");
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_legacy_v1_row_loads_through_the_upcaster(pool: PgPool) {
    let id = new_order_id();
    sqlx::query(
        "INSERT INTO events (event_id, event_type, event_version, aggregate_type, aggregate_id,
                             aggregate_version, occurred_at, payload)
         VALUES ($1, 'order.placed', 1, 'order', $2, 1, now(), $3)",
    )
    .bind(Uuid::now_v7())
    .bind(id.as_uuid())
    .bind(json!({"order_no": "A-1001", "amount_cents": 4200}))
    .execute(&pool)
    .await
    .expect("legacy row");

    let store = EventStore::new(pool.clone());
    let order = store.load(id).await.expect("legacy history loads");
    assert_eq!(order.status, OrderStatus::Placed);
    assert_eq!(order.total_cents, 4200);
    // And it accepts commands like any other order.
    store
        .execute(id, &pay_command(4200), &CommandContext::default())
        .await
        .expect("pay legacy order");
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn an_undecodable_stored_event_is_a_named_error_not_a_panic(pool: PgPool) {
    let id = new_order_id();
    sqlx::query(
        "INSERT INTO events (event_id, event_type, event_version, aggregate_type, aggregate_id,
                             aggregate_version, occurred_at, payload)
         VALUES ($1, 'order.placed', 9, 'order', $2, 1, now(), '{}')",
    )
    .bind(Uuid::now_v7())
    .bind(id.as_uuid())
    .execute(&pool)
    .await
    .expect("future row");
    let err = EventStore::new(pool)
        .load(id)
        .await
        .expect_err("v9 is unknown");
    // The message names the event; why it cannot be decoded is further down the chain.
    let err = format!("{:#}", anyhow::Error::from(err));
    assert!(err.contains("cannot be decoded"), "{err}");
    assert!(err.contains("newer than this code knows"), "{err}");
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn events_cannot_be_updated_or_deleted(pool: PgPool) {
    let store = EventStore::new(pool.clone());
    store
        .execute(new_order_id(), &place_command(), &CommandContext::default())
        .await
        .expect("place");
    for statement in [
        "UPDATE events SET event_type = 'x'",
        "DELETE FROM events",
        "TRUNCATE events CASCADE",
    ] {
        let err = sqlx::query(statement)
            .execute(&pool)
            .await
            .expect_err(statement);
        assert!(err.to_string().contains("immutable"), "{statement}: {err}");
    }
    assert_eq!(count(&pool, "events").await, 1);
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn an_unknown_order_is_not_found_whatever_version_is_expected(pool: PgPool) {
    let store = EventStore::new(pool.clone());
    let context = CommandContext {
        expected_version: Some(3),
        ..Default::default()
    };
    let err = store
        .execute(new_order_id(), &pay_command(100), &context)
        .await
        .expect_err("unknown");
    assert!(
        matches!(err, CommandError::Refused(OrderError::NotFound(_))),
        "{err}"
    );
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_version_past_the_largest_is_a_bad_batch_and_writes_nothing(pool: PgPool) {
    let id = new_order_id();
    // The next version would be i64::MAX + 1: refused, not an overflow.
    let events = [envelope(id, i64::MAX, &placed_event())];
    let result = append(
        &pool,
        id.as_uuid(),
        i64::MAX,
        &events,
        &AppendOptions::default(),
    )
    .await;
    assert!(
        matches!(result, Err(AppendError::InvalidBatch(_))),
        "{result:?}"
    );
    assert_eq!(count(&pool, "events").await, 0);
    assert_eq!(count(&pool, "outbox").await, 0);
}
