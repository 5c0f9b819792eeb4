//! Group commit against a real PostgreSQL: commands that arrive together share a statement and a
//! commit, and every caller still gets the answer it would have had alone — written, conflicting or
//! refused — when two of the group are for one order or another writer took a version under it.

use domain::{
    CancelOrder, Currency, CustomerId, Note, OrderCommand, OrderError, OrderId, OrderLine,
    OrderStatus, PlaceOrder,
};
use futures::future::join_all;
use sqlx::PgPool;
use store::{CommandContext, CommandError, EventStore, GroupCommit};
use uuid::Uuid;

fn place_command() -> OrderCommand {
    OrderCommand::Place(PlaceOrder {
        customer_id: CustomerId::parse("alice").expect("customer"),
        currency: Currency::parse("EUR").expect("currency"),
        channel: domain::Channel::Web,
        lines: vec![OrderLine::parse("MUG-BLUE:2:1250").expect("line")],
    })
}

fn cancel_command() -> OrderCommand {
    OrderCommand::Cancel(CancelOrder {
        reason: Note::parse("test").expect("reason"),
    })
}

fn grouped(pool: &PgPool) -> EventStore {
    EventStore::new(pool.clone()).with_group_commit(GroupCommit::spawn(pool.clone(), 2))
}

/// Runs `command` on every order at once through `store`; the answers in the orders' order.
async fn run_all(
    store: &EventStore,
    ids: &[OrderId],
    command: &OrderCommand,
) -> Vec<Result<store::CommandOutcome, CommandError>> {
    join_all(ids.iter().map(|&id| {
        let store = store.clone();
        async move { store.execute(id, command, &CommandContext::default()).await }
    }))
    .await
}

async fn scalar(pool: &PgPool, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql)
        .fetch_one(pool)
        .await
        .expect("query")
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn orders_placed_together_share_commits_and_each_is_answered(pool: PgPool) {
    let store = grouped(&pool);
    let ids: Vec<OrderId> = (0..200)
        .map(|_| OrderId::from_uuid(Uuid::now_v7()))
        .collect();
    let results = run_all(&store, &ids, &place_command()).await;

    for (id, result) in ids.iter().zip(&results) {
        let outcome = result.as_ref().expect("placed");
        assert_eq!((outcome.order_id, outcome.aggregate_version), (*id, 1));
        let stored: Vec<Uuid> =
            sqlx::query_scalar("SELECT event_id FROM outbox WHERE aggregate_id = $1")
                .bind(id.as_uuid())
                .fetch_all(&pool)
                .await
                .expect("outbox");
        assert_eq!(stored, outcome.event_ids, "each answer names its own event");
    }
    assert_eq!(scalar(&pool, "SELECT count(*) FROM events").await, 200);
    assert_eq!(scalar(&pool, "SELECT count(*) FROM outbox").await, 200);
    // Rows written by one transaction share its id: far fewer transactions than commands.
    let transactions = scalar(&pool, "SELECT count(DISTINCT xmin::text) FROM events").await;
    assert!(
        transactions < 50,
        "200 commands arriving together took {transactions} transactions"
    );
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn racing_commands_on_one_order_in_one_group_are_decided_again(pool: PgPool) {
    // Four cancels of one order arrive together: the group writes one, the other three wait for it,
    // conflict, are decided again against the cancelled order, and are refused.
    let store = grouped(&pool);
    let id = OrderId::from_uuid(Uuid::now_v7());
    store
        .execute(id, &place_command(), &CommandContext::default())
        .await
        .expect("place");
    let results = run_all(&store, &[id; 4], &cancel_command()).await;
    let refused = |r: &Result<_, CommandError>| {
        matches!(
            r,
            Err(CommandError::Refused(OrderError::IllegalTransition { .. }))
        )
    };
    let (won, lost) = (
        results.iter().filter(|r| r.is_ok()).count(),
        results.iter().filter(|r| refused(r)).count(),
    );
    assert_eq!((won, lost), (1, 3), "{results:?}");
    assert_eq!(scalar(&pool, "SELECT count(*) FROM events").await, 2);
    assert_eq!(
        store.load(id).await.expect("load").status,
        OrderStatus::Cancelled
    );
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_group_that_collides_with_another_writer_answers_each_command_alone(pool: PgPool) {
    // Another writer (no group commit) placed `taken` already; a group that places it again with
    // twenty new orders fails on the unique version as a whole, and is written one by one: twenty
    // orders placed, the twenty-first refused, nothing else changed.
    let taken = OrderId::from_uuid(Uuid::now_v7());
    EventStore::new(pool.clone())
        .execute(taken, &place_command(), &CommandContext::default())
        .await
        .expect("place");
    let store = grouped(&pool);
    let mut ids: Vec<OrderId> = (0..20)
        .map(|_| OrderId::from_uuid(Uuid::now_v7()))
        .collect();
    ids.insert(10, taken);
    let results = run_all(&store, &ids, &place_command()).await;

    for (id, result) in ids.iter().zip(&results) {
        if *id == taken {
            assert!(
                matches!(
                    result,
                    Err(CommandError::Refused(OrderError::AlreadyPlaced(_)))
                ),
                "{result:?}"
            );
        } else {
            assert_eq!(result.as_ref().expect("placed").aggregate_version, 1);
        }
    }
    assert_eq!(scalar(&pool, "SELECT count(*) FROM events").await, 21);
    assert_eq!(scalar(&pool, "SELECT count(*) FROM outbox").await, 21);
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_command_whose_caller_has_gone_is_not_written(pool: PgPool) {
    // One writer task, held up: another transaction wrote version 1 of `held` and has not committed,
    // so the statement placing `held` waits for it. Meanwhile `gone` is queued and its caller gives up
    // (a request timed out): it was told nothing, so nothing may be written for it.
    let store =
        EventStore::new(pool.clone()).with_group_commit(GroupCommit::spawn(pool.clone(), 1));
    let (held, gone, after) = (
        OrderId::from_uuid(Uuid::now_v7()),
        OrderId::from_uuid(Uuid::now_v7()),
        OrderId::from_uuid(Uuid::now_v7()),
    );
    let mut other = pool.begin().await.expect("begin");
    sqlx::query(
        "INSERT INTO events (event_id, event_type, event_version, aggregate_type, aggregate_id,
                             aggregate_version, occurred_at, payload)
         VALUES (gen_random_uuid(), 'order.placed', 1, 'order', $1, 1, now(), '{}')",
    )
    .bind(held.as_uuid())
    .execute(&mut *other)
    .await
    .expect("the other transaction's row");
    let placing_held = tokio::spawn({
        let store = store.clone();
        async move {
            store
                .execute(held, &place_command(), &CommandContext::default())
                .await
        }
    });
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let gave_up = tokio::time::timeout(
        std::time::Duration::from_millis(300),
        store.execute(gone, &place_command(), &CommandContext::default()),
    )
    .await;
    assert!(
        gave_up.is_err(),
        "queued behind the held statement: {gave_up:?}"
    );
    other.rollback().await.expect("rollback");
    let placed = placing_held
        .await
        .expect("joins")
        .expect("placed once the row is gone");
    assert_eq!(placed.aggregate_version, 1);
    // The writer takes appends in arrival order: once `after` is answered, `gone` was dealt with.
    store
        .execute(after, &place_command(), &CommandContext::default())
        .await
        .expect("placed");
    let written: Vec<Uuid> = sqlx::query_scalar("SELECT DISTINCT aggregate_id FROM events")
        .fetch_all(&pool)
        .await
        .expect("events");
    assert!(
        !written.contains(&gone.as_uuid()),
        "a command nobody waits for was written"
    );
    assert_eq!(written.len(), 2, "{written:?}");
}
