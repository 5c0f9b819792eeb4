//! A database that fails for reasons that are not the message's — its session killed, a serialization
//! failure, a deadlock, a statement timeout, no resources left — never parks a valid message: it is
//! retried until it applies. What the read model really cannot store (a check constraint, a value out
//! of range) is still parked, alone. Real faults in a real PostgreSQL: a trigger in the projection's
//! schema that raises the SQLSTATE (or ends its own session) for the first few statements, counted
//! by a sequence, which no rollback undoes.

mod common;

use std::time::Duration;

use common::*;
use projections::{Inventory, Projection};
use sqlx::{AssertSqlSafe, PgPool};

/// Installs a statement trigger on the inventory's `stock` that does `fault` (a PL/pgSQL statement)
/// for the first `times` statements writing it.
async fn inject(pool: &PgPool, fault: &str, times: i64) {
    let schema = Inventory::NAME;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE SEQUENCE {schema}.injected_faults;
         CREATE FUNCTION {schema}.injected_fault() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF nextval('{schema}.injected_faults') <= {times} THEN
                 {fault};
             END IF;
             RETURN NULL;
         END $$;
         CREATE TRIGGER injected_fault BEFORE INSERT OR UPDATE ON {schema}.stock
             FOR EACH STATEMENT EXECUTE FUNCTION {schema}.injected_fault();"
    )))
    .execute(pool)
    .await
    .expect("fault installed");
}

/// How many faults were spent (the statements that met the trigger).
async fn spent(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT last_value FROM inventory.injected_faults")
        .fetch_one(pool)
        .await
        .expect("sequence")
}

async fn stock(pool: &PgPool, sku: &str) -> Option<(i64, i64, i64)> {
    sqlx::query_as("SELECT reserved, shipped, released FROM inventory.stock WHERE sku = $1")
        .bind(sku)
        .fetch_optional(pool)
        .await
        .expect("stock")
}

async fn parked(pool: &PgPool) -> Vec<(String, Option<i64>)> {
    sqlx::query_as("SELECT reason, aggregate_version FROM inventory.parked ORDER BY id")
        .fetch_all(pool)
        .await
        .expect("parked")
}

/// Publishes two orders (one placed and paid) and runs the inventory until both are applied, with
/// `fault` done `times` times: nothing may be parked, every event applied once.
async fn survive(pool: &PgPool, fault: &str, times: i64) {
    let h = Harness::new(pool).await;
    let runner = h.runner(Inventory, h.config()).await;
    inject(pool, fault, times).await;
    let (a, b) = (new_order(), new_order());
    h.publish(&envelope(a, 1, &placed("ann", &["MUG:2:500"])))
        .await;
    h.publish(&envelope(b, 1, &placed("bob", &["TEA:1:300"])))
        .await;
    h.publish(&envelope(a, 2, &paid(1000))).await;

    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(async move {
        runner
            .run(
                async {
                    let _ = stopped.await;
                },
                false,
                |_| {},
            )
            .await
    });
    testkit::wait_until(
        Duration::from_secs(90),
        "both orders applied (or one parked)",
        || async {
            let applied = stock(pool, "MUG").await == Some((2, 0, 0))
                && stock(pool, "TEA").await == Some((1, 0, 0));
            applied || !parked(pool).await.is_empty()
        },
    )
    .await;
    let _ = stop.send(());
    run.await.expect("joined").expect("run");
    assert!(
        spent(pool).await > times,
        "{fault}: the fault was met {times} times, then the statements went through"
    );
    assert_eq!(parked(pool).await, vec![], "{fault}: nothing parked");
    assert_eq!(stock(pool, "MUG").await, Some((2, 0, 0)), "{fault}");
    let versions: Vec<i64> =
        sqlx::query_scalar("SELECT version FROM inventory.checkpoints ORDER BY version")
            .fetch_all(pool)
            .await
            .expect("checkpoints");
    assert_eq!(versions, vec![1, 2], "{fault}: every event applied once");
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_session_killed_again_and_again_parks_nothing(pool: PgPool) {
    // The batch's own session is ended by the server, mid-statement, four times.
    survive(&pool, "PERFORM pg_terminate_backend(pg_backend_pid())", 4).await;
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn serialization_failures_park_nothing(pool: PgPool) {
    // More than the batch's own conflict retries (5) and the message-by-message attempts (2 × 5)
    // together.
    survive(
        &pool,
        "RAISE EXCEPTION 'injected' USING ERRCODE = 'serialization_failure'",
        16,
    )
    .await;
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn deadlocks_park_nothing(pool: PgPool) {
    survive(
        &pool,
        "RAISE EXCEPTION 'injected' USING ERRCODE = 'deadlock_detected'",
        16,
    )
    .await;
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn statement_timeouts_park_nothing(pool: PgPool) {
    survive(
        &pool,
        "RAISE EXCEPTION 'injected' USING ERRCODE = 'query_canceled'",
        4,
    )
    .await;
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_server_out_of_resources_or_shutting_down_parks_nothing(pool: PgPool) {
    survive(
        &pool,
        "RAISE EXCEPTION 'injected' USING ERRCODE = CASE WHEN currval('inventory.injected_faults') % 2 = 0 \
         THEN 'too_many_connections' ELSE 'admin_shutdown' END",
        4,
    )
    .await;
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_connection_failure_reported_by_the_server_parks_nothing(pool: PgPool) {
    survive(
        &pool,
        "RAISE EXCEPTION 'injected' USING ERRCODE = 'connection_failure'",
        4,
    )
    .await;
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_privilege_taken_away_for_a_while_parks_nothing(pool: PgPool) {
    // The projection's statements are its own: a refused privilege is an operator's slip to repair,
    // not something any message did.
    survive(
        &pool,
        "RAISE EXCEPTION 'injected' USING ERRCODE = 'insufficient_privilege'",
        4,
    )
    .await;
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn what_the_read_model_cannot_store_is_still_parked_alone(pool: PgPool) {
    let h = Harness::new(&pool).await;
    let runner = h.runner(Inventory, h.config()).await;
    // A check constraint (class 23) and a value out of range (class 22), each for one SKU.
    sqlx::raw_sql(
        "ALTER TABLE inventory.stock ADD CONSTRAINT no_bad_sku CHECK (sku <> 'BAD');
         CREATE FUNCTION inventory.too_big() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF NEW.sku = 'HUGE' THEN
                 RAISE EXCEPTION 'injected' USING ERRCODE = 'numeric_value_out_of_range';
             END IF;
             RETURN NEW;
         END $$;
         CREATE TRIGGER too_big BEFORE INSERT OR UPDATE ON inventory.stock
             FOR EACH ROW EXECUTE FUNCTION inventory.too_big();",
    )
    .execute(&pool)
    .await
    .expect("constraints");
    let (bad, huge, good) = (new_order(), new_order(), new_order());
    h.publish(&envelope(bad, 1, &placed("ann", &["BAD:1:100"])))
        .await;
    h.publish(&envelope(huge, 1, &placed("bob", &["HUGE:1:100"])))
        .await;
    h.publish(&envelope(good, 1, &placed("cy", &["MUG:1:100"])))
        .await;
    let tally = tokio::time::timeout(
        Duration::from_secs(60),
        runner.run(std::future::pending(), true, |_| {}),
    )
    .await
    .expect("--once ends")
    .expect("run");
    assert_eq!((tally.applied, tally.parked), (1, 2), "{tally:?}");
    assert_eq!(stock(&pool, "MUG").await, Some((1, 0, 0)));
    let reasons: Vec<String> = parked(&pool).await.into_iter().map(|(r, _)| r).collect();
    assert_eq!(reasons.len(), 2, "{reasons:?}");
    assert!(
        reasons.iter().any(|r| r.contains("no_bad_sku")),
        "{reasons:?}"
    );
    assert!(
        reasons.iter().any(|r| r.contains("injected")),
        "{reasons:?}"
    );
}
