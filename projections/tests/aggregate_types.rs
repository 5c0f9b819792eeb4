//! A projection reads only the aggregate types it declares: customers' events, published beside real
//! orders through the real command path and the relay, are acknowledged unread by every order
//! projection — never parked, never held — and every order is still applied; a catch-up from the
//! event store reads only the declared types too.

mod common;

use common::*;
use domain::{CustomerCommand, CustomerId, CustomerKey, Note, RegisterCustomer};
use projections::{Inventory, Points, Projection, Search};
use sqlx::PgPool;
use store::{CommandContext, EventStore};

async fn register(store: &EventStore, handle: &str) {
    let customer_id = CustomerId::parse(handle).expect("handle");
    let command = CustomerCommand::Register(RegisterCustomer {
        name: Note::required("name", handle).expect("name"),
        customer_id: customer_id.clone(),
    });
    store
        .execute(
            CustomerKey::of(&customer_id),
            &command,
            &CommandContext::default(),
        )
        .await
        .expect("register");
}

/// Relays everything in the outbox to the test's stream.
async fn relay_all(h: &Harness) {
    let config = relay::RelayConfig {
        stream: relay::StreamSettings {
            name: STREAM.into(),
            subject_prefix: PREFIX.into(),
            ..relay::StreamSettings::default()
        },
        ..relay::RelayConfig::default()
    };
    relay::Relay::connect(&h.url, &h.nats.url(), config)
        .await
        .expect("relay")
        .drain()
        .await
        .expect("drain");
}

async fn count(pool: &PgPool, sql: &'static str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .fetch_one(pool)
        .await
        .expect(sql)
}

async fn check<P: Projection>(h: &Harness, pool: &PgPool, projection: P, orders: u64) {
    let tally = h.consume(projection).await;
    assert_eq!(
        (tally.other_types, tally.from_store),
        (3, 0),
        "{}: {tally:?}",
        P::NAME
    );
    assert_eq!(
        (tally.parked, tally.held, tally.applied),
        (0, 0, orders),
        "{}: {tally:?}",
        P::NAME
    );
    for table in ["parked", "held"] {
        let sql = format!("SELECT count(*) FROM {}.{table}", P::NAME);
        let rows: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
            .fetch_one(pool)
            .await
            .expect("count");
        assert_eq!(rows, 0, "{}.{table}", P::NAME);
    }
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn events_of_a_type_no_projection_reads_are_never_parked_or_held(pool: PgPool) {
    let h = Harness::new(&pool).await;
    let store = EventStore::new(pool.clone());
    // The consumers exist first, so every event below comes from the stream, not a catch-up.
    h.consume(Inventory).await;
    h.consume(Points).await;
    h.consume(Search).await;
    register(&store, "alice").await;
    let first = testkit::place_order(&store, "alice", &["MUG:2:500"]).await;
    register(&store, "bob").await;
    testkit::pay_order(&store, first).await;
    let second = testkit::place_order(&store, "bob", &["TEA:1:300"]).await;
    register(&store, "carol").await;
    let _ = second;
    relay_all(&h).await;
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM events WHERE aggregate_type = 'customer'"
        )
        .await,
        3
    );

    check(&h, &pool, Inventory, 3).await;
    check(&h, &pool, Points, 3).await;
    check(&h, &pool, Search, 3).await;
    assert_eq!(stock_of(&pool, "MUG").await, Some((2, 0, 0)));
    assert_eq!(balance_of(&pool, "alice").await, Some(10));
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_catch_up_from_the_store_reads_only_the_declared_types(pool: PgPool) {
    let h = Harness::new(&pool).await;
    let store = EventStore::new(pool.clone());
    register(&store, "alice").await;
    let order = testkit::place_order(&store, "alice", &["MUG:1:500"]).await;
    testkit::pay_order(&store, order).await;
    register(&store, "bob").await;
    relay_all(&h).await;
    // A first start catches up from the store (the consumer does not exist yet).
    let tally = h.consume(Inventory).await;
    assert_eq!((tally.parked, tally.held), (0, 0), "{tally:?}");
    assert_eq!(
        tally.from_store, 2,
        "only the order's two events: {tally:?}"
    );
    assert_eq!(stock_of(&pool, "MUG").await, Some((1, 0, 0)));
}
