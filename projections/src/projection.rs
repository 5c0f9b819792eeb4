//! What a projection is: a name (its schema and its durable consumer), its tables, the aggregate types
//! it reads, and how it applies a batch of their events. Everything else — consuming, ordering,
//! deduplicating, checkpointing, parking — is the runner's, shared by all projections. A read model
//! that applies one event at a time with per-aggregate state is simpler still ([`crate::kit`]).

use std::collections::HashSet;
use std::future::Future;

use domain::OrderEvent;
use sqlx::PgConnection;
use uuid::Uuid;

use crate::decode::{Decoded, ProjectionEvent};

/// A read model built from the events of the aggregate types it declares.
pub trait Projection: Send + Sync + 'static {
    /// The schema its tables live in and the name of its durable consumer, e.g. `inventory`.
    const NAME: &'static str;

    /// Idempotent DDL for its own tables, run with `search_path` set to its schema.
    const TABLES: &'static str;

    /// The aggregate types whose events it reads, e.g. `["order"]`. Every other type's message is
    /// acknowledged without being decoded: never parked, never held (`Tally::other_types`), and a
    /// catch-up from the event store reads only these types.
    const AGGREGATES: &'static [&'static str];

    /// Its events: `domain::OrderEvent` when it reads orders alone, `domain::AnyEvent` for several
    /// types.
    type Event: ProjectionEvent;

    /// Applies `events` inside the runner's transaction. Each event is exactly the next version of its
    /// aggregate (duplicates and gaps were filtered out), and an aggregate's events come in version
    /// order.
    fn apply(
        &self,
        tx: &mut PgConnection,
        events: &[Decoded<Self::Event>],
    ) -> impl Future<Output = sqlx::Result<()>> + Send;
}

/// Whether `P` reads events of `aggregate_type`.
pub fn reads<P: Projection>(aggregate_type: &str) -> bool {
    P::AGGREGATES.contains(&aggregate_type)
}

/// The orders of `events` whose stored rows a batch must read: those whose first event in the batch is
/// not their `order.placed`. A placement starts its order afresh in every projection, so a batch of new
/// orders reads nothing — a round trip less per batch in the common case.
pub fn orders_to_load(events: &[Decoded<OrderEvent>]) -> Vec<Uuid> {
    let mut seen = HashSet::new();
    events
        .iter()
        .filter(|e| seen.insert(e.aggregate_id) && !matches!(e.event, OrderEvent::Placed(_)))
        .map(|e| e.aggregate_id)
        .collect()
}

/// The status a projection stored with [`domain::OrderStatus`]'s `Display`, read back. Anything else is
/// an error: a corrupt row must not turn into a believable status.
pub fn parse_status(text: &str) -> Result<domain::OrderStatus, sqlx::Error> {
    use domain::OrderStatus;
    [
        OrderStatus::Placed,
        OrderStatus::Paid,
        OrderStatus::Shipped,
        OrderStatus::Cancelled,
    ]
    .into_iter()
    .find(|status| status.to_string() == text)
    .ok_or_else(|| {
        sqlx::Error::Decode(format!("unknown order status {text:?} in the projection").into())
    })
}

#[cfg(test)]
mod tests {
    use domain::{Cents, OrderPaid, OrderPlaced, PayOrder};

    use super::*;

    fn event(order: Uuid, version: i64, event: OrderEvent) -> Decoded<OrderEvent> {
        Decoded {
            event_id: Uuid::now_v7(),
            aggregate_id: order,
            aggregate_version: version,
            occurred_at: chrono::Utc::now(),
            event,
        }
    }

    fn placed() -> OrderEvent {
        let domain::OrderCommand::Place(place) = testkit::place("c-1", &["MUG:1:500"]) else {
            unreachable!("testkit::place builds a place command")
        };
        OrderEvent::Placed(OrderPlaced::from_command(&place, 500))
    }

    fn paid() -> OrderEvent {
        let amount_cents = Cents::new(500).expect("a valid amount");
        OrderEvent::Paid(OrderPaid::from_command(&PayOrder {
            amount_cents,
            payment_ref: None,
        }))
    }

    #[test]
    fn only_orders_that_do_not_start_in_the_batch_are_loaded() {
        let (new, old, later) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
        let events = [
            event(new, 1, placed()),
            event(old, 2, paid()),
            event(new, 2, paid()),
            event(old, 3, paid()),
            event(later, 5, paid()),
        ];
        assert_eq!(orders_to_load(&events), vec![old, later]);
        assert!(
            orders_to_load(&[event(new, 1, placed()), event(new, 2, paid())]).is_empty(),
            "a batch of new orders reads nothing"
        );
    }

    #[test]
    fn an_order_placed_after_other_events_of_it_is_still_loaded() {
        // Not a valid history, but the projection must then see what it stored, as it always did.
        let order = Uuid::now_v7();
        let events = [event(order, 2, paid()), event(order, 3, placed())];
        assert_eq!(orders_to_load(&events), vec![order]);
    }
}
