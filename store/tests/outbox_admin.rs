//! `store::outbox`'s reads and fixtures against a real PostgreSQL: the table is read and changed here
//! with SQL of its own, to check the module rather than through it.

use sqlx::{Connection, PgPool};
use store::outbox::admin::{StatusCounts, counts, row_of_event, timeline};
use store::outbox::{Status, fixtures};
use store::{CommandContext, EventStore};
use uuid::Uuid;

/// Places an order through the store (its event and outbox row in one transaction); returns the
/// order and the event id.
async fn placed(store: &EventStore) -> (Uuid, Uuid) {
    let order = domain::OrderId::from_uuid(Uuid::now_v7());
    let command = testkit::place("alice", &["MUG-BLUE:1:1250"]);
    let outcome = store
        .execute(order, &command, &CommandContext::default())
        .await
        .expect("place");
    (order.as_uuid(), outcome.event_ids[0])
}

/// Settles a row by hand, as a relay step would have.
async fn settle(pool: &PgPool, event_id: Uuid, status: &str) {
    sqlx::query(
        "UPDATE outbox SET status = $2, claimed_by = 'relay-t', claimed_at = now(),
             stream_seq = CASE WHEN $2 = 'sent' THEN 7 END,
             sent_at = CASE WHEN $2 = 'sent' THEN now() - interval '1 minute' END
         WHERE event_id = $1",
    )
    .bind(event_id)
    .bind(status)
    .execute(pool)
    .await
    .expect("settle");
}

/// The enum's words are exactly those the table's check constraint allows.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn the_status_enum_is_the_tables_check(pool: PgPool) {
    let check: String = sqlx::query_scalar(
        "SELECT pg_get_constraintdef(oid) FROM pg_constraint
         WHERE conrelid = 'outbox'::regclass AND contype = 'c' AND pg_get_constraintdef(oid) LIKE '%status%'",
    )
    .fetch_one(&pool)
    .await
    .expect("the status check");
    let mut allowed: Vec<&str> = check.split('\'').skip(1).step_by(2).collect();
    allowed.sort_unstable();
    let mut ours: Vec<&str> = Status::ALL.iter().map(|s| s.as_str()).collect();
    ours.sort_unstable();
    assert_eq!(ours, allowed, "{check}");
    for status in Status::ALL {
        assert_eq!(status.as_str().parse::<Status>(), Ok(status));
    }
    assert!("processing".parse::<Status>().is_err());

    let columns: Vec<String> = sqlx::query_scalar(
        "SELECT attname::text FROM pg_attribute
         WHERE attrelid = 'outbox'::regclass AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
    )
    .fetch_all(&pool)
    .await
    .expect("columns");
    assert_eq!(columns, store::outbox::COLUMNS);
    let journal: Vec<String> = sqlx::query_scalar(
        "SELECT attname::text FROM pg_attribute
         WHERE attrelid = 'outbox_inflight'::regclass AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
    )
    .fetch_all(&pool)
    .await
    .expect("journal columns");
    assert_eq!(journal, store::outbox::JOURNAL_COLUMNS);
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn counts_and_an_event_row_say_what_the_table_holds(pool: PgPool) {
    let store = EventStore::new(pool.clone());
    let (_, pending) = placed(&store).await;
    let (sent, failed, dead) = (
        placed(&store).await.1,
        placed(&store).await.1,
        placed(&store).await.1,
    );
    settle(&pool, sent, "sent").await;
    settle(&pool, failed, "failed").await;
    settle(&pool, dead, "dead").await;

    let by_sql: Vec<(String, i64)> =
        sqlx::query_as("SELECT status, count(*) FROM outbox GROUP BY status ORDER BY status")
            .fetch_all(&pool)
            .await
            .expect("count");
    let mut counted: Vec<(String, i64)> = counts(&pool, true)
        .await
        .expect("counts")
        .by_status()
        .into_iter()
        .map(|(status, n)| (status.to_string(), n))
        .collect();
    counted.sort();
    assert_eq!(counted, by_sql);
    let mut fixture: Vec<(String, i64)> = fixtures::counts_by_status(&pool)
        .await
        .expect("counts by status")
        .into_iter()
        .map(|(status, n)| (status.to_string(), n))
        .collect();
    fixture.sort();
    assert_eq!(fixture, by_sql);

    let unsent = counts(&pool, false).await.expect("counts");
    assert_eq!(
        unsent,
        StatusCounts {
            pending: 1,
            failed: 1,
            dead: 1,
            sent: None
        }
    );
    assert_eq!((unsent.in_progress(), unsent.unsent()), (2, 3));

    let row = row_of_event(&pool, sent)
        .await
        .expect("row")
        .expect("the sent event has a row");
    assert_eq!(
        (
            row.event_id,
            row.status,
            row.claimed_by.as_deref(),
            row.stream_seq
        ),
        (sent, Status::Sent, Some("relay-t"), Some(7))
    );
    let row = row_of_event(&pool, pending).await.expect("row");
    assert_eq!(row.map(|r| r.status), Some(Status::Pending));
    assert_eq!(
        row_of_event(&pool, Uuid::now_v7()).await.expect("row"),
        None
    );
}

/// The timeline shows each event with its row, and an event whose row is gone without one.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn the_timeline_joins_each_event_with_its_row(pool: PgPool) {
    let store = EventStore::new(pool.clone());
    let order = testkit::place_order(&store, "alice", &["MUG-BLUE:1:1250"]).await;
    testkit::pay_order(&store, order).await;
    let events: Vec<Uuid> = sqlx::query_scalar(
        "SELECT event_id FROM events WHERE aggregate_id = $1 ORDER BY aggregate_version",
    )
    .bind(order.as_uuid())
    .fetch_all(&pool)
    .await
    .expect("events");
    settle(&pool, events[0], "sent").await;
    sqlx::query("DELETE FROM outbox WHERE event_id = $1")
        .bind(events[1])
        .execute(&pool)
        .await
        .expect("purge");

    let rows = timeline(&pool, order.as_uuid(), 10)
        .await
        .expect("timeline");
    assert_eq!(rows.iter().map(|r| r.event_id).collect::<Vec<_>>(), events);
    let first = rows[0].row.as_ref().expect("the first event's row");
    assert_eq!((first.status, first.stream_seq), (Status::Sent, Some(7)));
    assert!(rows[1].row.is_none(), "{:?}", rows[1]);
    assert_eq!(
        timeline(&pool, order.as_uuid(), 1)
            .await
            .expect("cut")
            .len(),
        1
    );
}

/// The lab's and the test kit's fixtures do what their names say.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn the_fixtures_read_and_forget_rows(pool: PgPool) {
    let store = EventStore::new(pool.clone());
    let order = testkit::place_order(&store, "alice", &["MUG-BLUE:1:1250"]).await;
    testkit::pay_order(&store, order).await;
    let newest_placed = fixtures::newest_body(&pool, "order.placed")
        .await
        .expect("newest body")
        .expect("a placed order");
    assert!(
        newest_placed.contains(&order.as_uuid().to_string()),
        "{newest_placed}"
    );
    assert_eq!(
        fixtures::newest_body(&pool, "order.shipped")
            .await
            .expect("newest body"),
        None
    );

    // Only an aggregate whose last event is one of the given types, sent long enough ago, counts.
    let paid: Uuid = sqlx::query_scalar(
        "SELECT event_id FROM outbox WHERE aggregate_id = $1 AND aggregate_version = 2",
    )
    .bind(order.as_uuid())
    .fetch_one(&pool)
    .await
    .expect("paid row");
    assert_eq!(
        fixtures::first_body_of_finished(&pool, &["order.paid"], 7.0)
            .await
            .expect("finished"),
        None,
        "not sent yet"
    );
    settle(&pool, paid, "sent").await;
    assert_eq!(
        fixtures::first_body_of_finished(&pool, &["order.paid"], 7.0)
            .await
            .expect("finished"),
        Some(newest_placed),
        "sent a minute ago"
    );
    assert_eq!(
        fixtures::first_body_of_finished(&pool, &["order.paid"], 120.0)
            .await
            .expect("finished"),
        None,
        "not two minutes ago"
    );
    assert_eq!(
        fixtures::relayed(&pool).await.expect("relayed").0,
        1,
        "one row with a stream sequence"
    );

    let mut tx = pool.begin().await.expect("begin");
    let forgotten = fixtures::forget_after(&mut tx, order.as_uuid(), 1)
        .await
        .expect("forget");
    tx.commit().await.expect("commit");
    assert_eq!(forgotten, 1);
    let left: Vec<i64> = sqlx::query_scalar(
        "SELECT aggregate_version FROM outbox WHERE aggregate_id = $1 ORDER BY aggregate_version",
    )
    .bind(order.as_uuid())
    .fetch_all(&pool)
    .await
    .expect("left");
    assert_eq!(left, vec![1]);
}

/// The slot reader's marks are told by its session's `application_name` (prefix and relay id, cut
/// at 63 bytes as PostgreSQL cuts it) and by how recent they are; other relays' marks do not count.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_readers_recent_marks_are_told_from_other_relays_and_old_ones(pool: PgPool) {
    use std::time::Duration;
    use store::outbox::relaying::marked_by_slot_reader_within;
    let store = EventStore::new(pool.clone());
    let (_, event) = placed(&store).await;
    let mark = |by: &'static str, ago: &'static str| {
        let pool = pool.clone();
        async move {
            sqlx::query(
                "UPDATE outbox SET status = 'sent', claimed_by = $2,
                     sent_at = clock_timestamp() - $3::interval WHERE event_id = $1",
            )
            .bind(event)
            .bind(by)
            .bind(ago)
            .execute(&pool)
            .await
            .expect("marked");
        }
    };
    // A session standing in for the reader's walsender, named as the relay names its sessions.
    let long_id = "relay-with-a-name-longer-than-postgresql-keeps-of-it-in-full";
    let mut reader = sqlx::postgres::PgConnection::connect_with(
        &pool
            .connect_options()
            .as_ref()
            .clone()
            .application_name(&format!("waybill-relay {long_id}")),
    )
    .await
    .expect("a reader's session");
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut reader)
        .await
        .expect("its pid");
    let lately =
        || marked_by_slot_reader_within(&pool, pid, "waybill-relay ", Duration::from_secs(3));

    mark(long_id, "0 seconds").await;
    assert!(
        lately().await.expect("look"),
        "the reader's own mark, just now"
    );
    mark(long_id, "10 seconds").await;
    assert!(!lately().await.expect("look"), "the reader's mark, too old");
    mark("standby-2", "0 seconds").await;
    assert!(!lately().await.expect("look"), "another relay's mark");
    // Another session's pid (this pool's) is no reader of ours.
    mark(long_id, "0 seconds").await;
    let other: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&pool)
        .await
        .expect("a pid");
    assert!(
        !marked_by_slot_reader_within(&pool, other, "waybill-relay ", Duration::from_secs(3))
            .await
            .expect("look")
    );
    drop(reader);
}
