//! Relays sharing an outbox: each holds a seat while it lives, a relay claims its share of the
//! aggregates first, and the share of a relay that holds its seat but does nothing (frozen) still moves.

mod common;

use std::time::Duration;

use common::{Harness, Running, seed, wait_until};
use relay::peers::{Peers, Seat};
use sqlx::PgPool;

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn relays_take_seats_and_give_them_up(pool: PgPool) {
    let first = Peers::join(&pool, 1).await;
    let second = Peers::join(&pool, 2).await;
    // The second read the holders after taking its slot; the first sees it at its next refresh.
    assert_eq!(
        second.seat(),
        Some(Seat {
            offset: 1,
            total: 3,
            relays: 2
        })
    );
    wait_until(
        Duration::from_secs(5),
        "the first relay sees the second",
        || {
            let seat = first.seat();
            async move { seat.is_some_and(|s| s.relays == 2) }
        },
    )
    .await;
    assert_eq!(
        first.seat(),
        Some(Seat {
            offset: 0,
            total: 3,
            relays: 2
        })
    );

    // A relay that goes away frees its slot at once (its session ends); a newcomer takes it.
    drop(first);
    wait_until(Duration::from_secs(5), "the second relay alone", || {
        let seat = second.seat();
        async move { seat == Some(Seat::alone(2)) }
    })
    .await;
    let third = Peers::join(&pool, 1).await;
    assert_eq!(
        third.seat(),
        Some(Seat {
            offset: 0,
            total: 3,
            relays: 2
        }),
        "the freed first slot, before the second relay's"
    );
}

/// Whether the seeded aggregate (its id ends in its number) falls in share `k` of 2.
fn in_share(event: &testkit::StoredEvent, k: u8) -> bool {
    event.envelope.aggregate_id.as_bytes()[15] % 2 == k
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_drain_takes_its_share_first_and_leaves_nothing_behind(pool: PgPool) {
    let h = Harness::new(pool).await;
    // Another relay holds the first slot and never claims (frozen, or busy elsewhere).
    let frozen = Peers::join(&h.pool, 1).await;
    seed(&h.pool, 40, 1).await;
    let relay = h
        .relay(relay::RelayConfig {
            lanes: 1,
            batch_size: 8,
            max_rows: 8,
            ..h.config("second")
        })
        .await;
    let summary = relay.drain().await.expect("drain");
    assert_eq!(summary.published, 40, "{summary:?}");
    let stream = h.stream().await;
    assert_eq!(stream.len(), 40);
    // The second slot's share (odd aggregates) went first, in claims of its own; the frozen relay's
    // share followed once that was empty.
    assert!(
        stream[..20].iter().all(|e| in_share(e, 1)),
        "{:?}",
        stream
            .iter()
            .map(|e| e.envelope.aggregate_id.to_string())
            .collect::<Vec<_>>()
    );
    drop(frozen);
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_running_relay_moves_a_frozen_relays_share(pool: PgPool) {
    let h = Harness::new(pool).await;
    let frozen = Peers::join(&h.pool, 1).await;
    let relay = h
        .relay(relay::RelayConfig {
            lanes: 1,
            ..h.config("second")
        })
        .await;
    let running = Running::start(&relay);
    wait_until(Duration::from_secs(5), "the relay takes its seat", || {
        let seat = frozen.seat();
        async move { seat.is_some_and(|s| s.relays == 2) }
    })
    .await;
    // Written while the relay runs split: half of it is the frozen relay's share.
    seed(&h.pool, 40, 2).await;
    h.wait_for_messages(80).await;
    let stream = h.stream().await;
    assert!(stream.iter().any(|e| in_share(e, 0)));
    let summary = running.stop().await;
    assert_eq!(summary.published, 80, "{summary:?}");
    drop(frozen);
}
