//! Group commit against a real PostgreSQL: commands that arrive together share a statement and a
//! commit, and every caller still gets the answer it would have had alone — written, conflicting or
//! refused — when two of the group are for one order or another writer took a version under it; a
//! lock held elsewhere holds up only its own order's commands; and a statement whose connection
//! breaks is answered with what it really did.

use domain::{
    CancelOrder, Currency, CustomerId, Note, OrderCommand, OrderError, OrderId, OrderLine,
    OrderStatus, PlaceOrder,
};
use std::time::{Duration, Instant};

use futures::future::join_all;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use store::{CommandContext, CommandError, EventStore, GroupCommit, GroupCommitSettings};
use testkit::CutProxy;
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
        assert_eq!((outcome.id, outcome.aggregate_version), (*id, 1));
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
    // so the statement placing `held` waits for it (a long group lock wait, to keep the writer
    // there). Meanwhile `gone` is queued and its caller gives up (a request timed out): it was told
    // nothing, so nothing may be written for it.
    let settings = GroupCommitSettings {
        writers: 1,
        lock_wait: Duration::from_secs(60),
    };
    let store = EventStore::new(pool.clone())
        .with_group_commit(GroupCommit::spawn_with(pool.clone(), settings));
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
    tokio::time::sleep(Duration::from_millis(300)).await;
    let gave_up = tokio::time::timeout(
        Duration::from_millis(300),
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

/// A pool on `pool`'s database whose sessions wait `lock_timeout` for another transaction's lock,
/// through `proxy` when one is given.
async fn pool_with(pool: &PgPool, lock_timeout: &str, proxy: Option<&CutProxy>) -> PgPool {
    let mut options = pool
        .connect_options()
        .as_ref()
        .clone()
        .options([("lock_timeout", lock_timeout)]);
    if let Some(proxy) = proxy {
        options = options.host("127.0.0.1").port(proxy.port());
    }
    PgPoolOptions::new()
        .max_connections(8)
        .connect_with(options)
        .await
        .expect("pool")
}

/// A proxy in front of the test's PostgreSQL.
async fn proxy_for(pool: &PgPool) -> CutProxy {
    let options = pool.connect_options();
    let upstream = tokio::net::lookup_host((options.get_host(), options.get_port()))
        .await
        .expect("the server's address")
        .next()
        .expect("an address");
    CutProxy::start(upstream).await.expect("proxy")
}

/// Another transaction writes version 1 of `order` and holds it uncommitted: placing `order`
/// waits for it.
async fn hold(pool: &PgPool, order: OrderId) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut other = pool.begin().await.expect("begin");
    sqlx::query(
        "INSERT INTO events (event_id, event_type, event_version, aggregate_type, aggregate_id,
                             aggregate_version, occurred_at, payload)
         VALUES (gen_random_uuid(), 'order.placed', 1, 'order', $1, 1, now(), '{}')",
    )
    .bind(order.as_uuid())
    .execute(&mut *other)
    .await
    .expect("the other transaction's row");
    other
}

/// The client port (as the server sees it) of the statement that has waited on a lock for longer
/// than `for_at_least`.
async fn waiting_on_a_lock(pool: &PgPool, for_at_least: Duration) -> u16 {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let port: Option<i32> = sqlx::query_scalar(
            "SELECT client_port FROM pg_stat_activity
             WHERE datname = current_database() AND wait_event_type = 'Lock'
               AND now() - query_start > make_interval(secs => $1)",
        )
        .bind(for_at_least.as_secs_f64())
        .fetch_optional(pool)
        .await
        .expect("pg_stat_activity");
        if let Some(port) = port {
            return u16::try_from(port).expect("a port");
        }
        assert!(Instant::now() < deadline, "no statement waits on a lock");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Waits until no other session of the database runs a statement: a backend the client lost has
/// committed or given up by then.
async fn quiet(pool: &PgPool) {
    testkit::wait_until(Duration::from_secs(20), "no statement running", || async {
        scalar(
            pool,
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND state = 'active' AND pid <> pg_backend_pid()",
        )
        .await
            == 0
    })
    .await;
}

async fn events_of(pool: &PgPool, order: OrderId) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM events WHERE aggregate_id = $1")
        .bind(order.as_uuid())
        .fetch_one(pool)
        .await
        .expect("count")
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_locked_order_holds_up_only_its_own_commands(pool: PgPool) {
    // Another transaction holds `held`. Its commands wait for it (2 s, the pool's lock timeout)
    // and are told it is locked; every other order is placed meanwhile without waiting for them.
    let writes = pool_with(&pool, "2s", None).await;
    let store = EventStore::new(writes.clone()).with_group_commit(GroupCommit::spawn(writes, 1));
    let held = OrderId::from_uuid(Uuid::now_v7());
    let other = hold(&pool, held).await;
    let started = Instant::now();
    let placing_held = [0, 1].map(|_| {
        let store = store.clone();
        tokio::spawn(async move {
            let answer = store
                .execute(held, &place_command(), &CommandContext::default())
                .await;
            (answer, started.elapsed())
        })
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let others = Instant::now();
    for _ in 0..20 {
        store
            .execute(
                OrderId::from_uuid(Uuid::now_v7()),
                &place_command(),
                &CommandContext::default(),
            )
            .await
            .expect("placed");
    }
    let others = others.elapsed();
    // Held behind the lock, they would take at least the lock timeout.
    assert!(
        others < Duration::from_secs(2),
        "20 other orders, one after another, took {others:?} while one order was locked"
    );
    for placing in placing_held {
        let (answer, after) = placing.await.expect("joins");
        assert!(
            matches!(answer, Err(CommandError::Locked { aggregate_id, .. }) if aggregate_id == held.as_uuid()),
            "{answer:?}"
        );
        assert!(after < Duration::from_secs(3), "answered after {after:?}");
    }
    other.rollback().await.expect("rollback");
    assert_eq!(scalar(&pool, "SELECT count(*) FROM events").await, 20);
    assert_eq!(events_of(&pool, held).await, 0);
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_group_cut_off_while_it_waits_on_a_lock_is_settled_by_the_truth(pool: PgPool) {
    // The group's statement waits on `held`'s lock when its connection breaks on the client's
    // side; its backend goes on waiting. Were the rows read at once, they would say "not written"
    // and a second write would race the first for the same events once the lock goes. Ending the
    // backend first makes "not written" true: the command is then written once, and answered so.
    let proxy = proxy_for(&pool).await;
    let writes = pool_with(&pool, "30s", Some(&proxy)).await;
    let settings = GroupCommitSettings {
        writers: 1,
        lock_wait: Duration::from_secs(60),
    };
    let store = EventStore::new(writes.clone())
        .with_group_commit(GroupCommit::spawn_with(writes, settings));
    let held = OrderId::from_uuid(Uuid::now_v7());
    let other = hold(&pool, held).await;
    let placing = tokio::spawn({
        let store = store.clone();
        async move {
            store
                .execute(held, &place_command(), &CommandContext::default())
                .await
        }
    });
    let port = waiting_on_a_lock(&pool, Duration::from_millis(300)).await;
    assert!(proxy.cut(port), "the group's connection is cut");
    // Time to settle the group and hand it to its lane, then the lock goes.
    tokio::time::sleep(Duration::from_secs(1)).await;
    other.rollback().await.expect("rollback");
    let answer = tokio::time::timeout(Duration::from_secs(20), placing)
        .await
        .expect("answered")
        .expect("joins");
    quiet(&pool).await;
    let outcome = answer.expect("placed: the cut statement never committed, the lone write did");
    assert_eq!(outcome.aggregate_version, 1);
    assert_eq!(events_of(&pool, held).await, 1);
    assert_eq!(scalar(&pool, "SELECT count(*) FROM outbox").await, 1);
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_lone_write_cut_off_while_it_waits_on_a_lock_is_answered_with_the_truth(pool: PgPool) {
    // The group gives up on `held`'s lock at once and hands it to its lane; the lane's lone write
    // waits on the lock when its connection breaks on the client's side. Its backend goes on
    // waiting and would commit once the lock goes: the caller must not be told "failed" for that.
    let proxy = proxy_for(&pool).await;
    let writes = pool_with(&pool, "30s", Some(&proxy)).await;
    let settings = GroupCommitSettings {
        writers: 1,
        lock_wait: Duration::from_millis(1),
    };
    let store = EventStore::new(writes.clone())
        .with_group_commit(GroupCommit::spawn_with(writes, settings));
    let held = OrderId::from_uuid(Uuid::now_v7());
    let other = hold(&pool, held).await;
    let placing = tokio::spawn({
        let store = store.clone();
        async move {
            store
                .execute(held, &place_command(), &CommandContext::default())
                .await
        }
    });
    // The group's statement gave up after 1 ms: a statement waiting longer is the lone write's.
    let port = waiting_on_a_lock(&pool, Duration::from_millis(300)).await;
    assert!(proxy.cut(port), "the lone write's connection is cut");
    let answer = tokio::time::timeout(Duration::from_secs(20), placing)
        .await
        .expect("answered")
        .expect("joins");
    // The lock goes only once the caller has its answer: a backend still alive would commit now.
    other.rollback().await.expect("rollback");
    quiet(&pool).await;
    let stored = events_of(&pool, held).await;
    match &answer {
        Ok(outcome) => assert_eq!((outcome.aggregate_version, stored), (1, 1)),
        Err(error) => assert_eq!(stored, 0, "told {error} for a command that was written"),
    }
    assert_eq!(scalar(&pool, "SELECT count(*) FROM outbox").await, stored);
}
