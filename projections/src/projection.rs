//! What a projection is: a name (its schema and its durable consumer), its tables, and how it applies a
//! batch of events. Everything else — consuming, ordering, deduplicating, checkpointing, parking — is
//! the runner's, shared by all projections.

use std::future::Future;

use sqlx::PgConnection;

use crate::decode::Decoded;

/// A read model built from the order events.
pub trait Projection: Send + Sync + 'static {
    /// The schema its tables live in and the name of its durable consumer, e.g. `inventory`.
    const NAME: &'static str;

    /// Idempotent DDL for its own tables, run with `search_path` set to its schema.
    const TABLES: &'static str;

    /// Applies `events` inside the runner's transaction. Each event is exactly the next version of its
    /// order (duplicates and gaps were filtered out), and an order's events come in version order.
    fn apply(
        &self,
        tx: &mut PgConnection,
        events: &[Decoded],
    ) -> impl Future<Output = sqlx::Result<()>> + Send;
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
