//! Reading an aggregate's history back: rows to envelopes, upcast, decoded and folded.

use chrono::{DateTime, Utc};
use domain::{Aggregate, AggregateId, DecodeError, EventEnvelope, Order, OrderId, Upcasters};
use serde_json::Value;
use sqlx::PgExecutor;
use uuid::Uuid;

/// Why an order's history could not be read.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The database failed.
    #[error("reading events failed")]
    Database(#[from] sqlx::Error),
    /// A stored event cannot be brought to the current shape: a missing upcaster or a corrupt row.
    #[error("event {event_id} (version {aggregate_version} of {aggregate_id}) cannot be decoded")]
    Undecodable {
        /// The bad event.
        event_id: Uuid,
        /// Its order.
        aggregate_id: Uuid,
        /// Its position in the order's stream.
        aggregate_version: i64,
        /// Why.
        source: DecodeError,
    },
    /// Versions are not 1, 2, 3, ...: the log was tampered with.
    #[error("{aggregate_id} history has a gap: expected version {expected}, found {found}")]
    Gap {
        /// The order.
        aggregate_id: Uuid,
        /// The version that should come next.
        expected: i64,
        /// The version found instead.
        found: i64,
    },
}

/// The `events` columns that make an [`EnvelopeRow`]; `envelope_columns!("e.")` qualifies them with a
/// table alias.
#[macro_export]
macro_rules! envelope_columns {
    () => {
        $crate::envelope_columns!("")
    };
    ($p:literal) => {
        concat!(
            $p,
            "event_id, ",
            $p,
            "event_type, ",
            $p,
            "event_version, ",
            $p,
            "aggregate_type, ",
            $p,
            "aggregate_id, ",
            $p,
            "aggregate_version, ",
            $p,
            "occurred_at, ",
            $p,
            "correlation_id, ",
            $p,
            "causation_id, ",
            $p,
            "payload"
        )
    };
}

/// An `events` row selected with [`envelope_columns!`]. The domain's [`EventEnvelope`] knows no
/// database, so the row is read here and converted with `into()`.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct EnvelopeRow {
    event_id: Uuid,
    event_type: String,
    event_version: i32,
    aggregate_type: String,
    aggregate_id: Uuid,
    aggregate_version: i64,
    occurred_at: DateTime<Utc>,
    correlation_id: Option<Uuid>,
    causation_id: Option<Uuid>,
    payload: Value,
}

impl From<EnvelopeRow> for EventEnvelope {
    fn from(row: EnvelopeRow) -> Self {
        Self {
            event_id: row.event_id,
            event_type: row.event_type,
            event_version: row.event_version,
            aggregate_type: row.aggregate_type,
            aggregate_id: row.aggregate_id,
            aggregate_version: row.aggregate_version,
            occurred_at: row.occurred_at,
            correlation_id: row.correlation_id,
            causation_id: row.causation_id,
            payload: row.payload,
        }
    }
}

/// Every stored envelope of one aggregate, oldest first, as written (not upcast).
pub async fn load_envelopes(
    db: impl PgExecutor<'_>,
    aggregate_id: Uuid,
) -> sqlx::Result<Vec<EventEnvelope>> {
    let rows: Vec<EnvelopeRow> = sqlx::query_as(concat!(
        "SELECT ",
        envelope_columns!(),
        " FROM events WHERE aggregate_id = $1 ORDER BY aggregate_version"
    ))
    .bind(aggregate_id)
    .fetch_all(db)
    .await?;
    Ok(rows.into_iter().map(EventEnvelope::from).collect())
}

/// Loads, upcasts and folds one order. An unknown id gives an order with status `new` and version 0.
pub async fn load_order(
    db: impl PgExecutor<'_>,
    order_id: OrderId,
    upcasters: &Upcasters,
) -> Result<Order, LoadError> {
    load_aggregate::<Order>(db, order_id, upcasters).await
}

/// Loads, upcasts and folds one aggregate of type `A`. An unknown id — or one that belongs to an
/// aggregate of another type — gives the aggregate with no history (version 0).
pub async fn load_aggregate<A: Aggregate>(
    db: impl PgExecutor<'_>,
    id: A::Id,
    upcasters: &Upcasters,
) -> Result<A, LoadError> {
    let rows: Vec<EnvelopeRow> = sqlx::query_as(concat!(
        "SELECT ",
        envelope_columns!(),
        " FROM events WHERE aggregate_id = $1 AND aggregate_type = $2 ORDER BY aggregate_version"
    ))
    .bind(id.as_uuid())
    .bind(A::TYPE)
    .fetch_all(db)
    .await?;
    let mut events: Vec<A::Event> = Vec::with_capacity(rows.len());
    for (index, row) in rows.into_iter().enumerate() {
        let envelope = EventEnvelope::from(row);
        let expected = i64::try_from(index).unwrap_or(i64::MAX).saturating_add(1);
        if envelope.aggregate_version != expected {
            return Err(LoadError::Gap {
                aggregate_id: envelope.aggregate_id,
                expected,
                found: envelope.aggregate_version,
            });
        }
        let event =
            envelope
                .decode_for::<A>(upcasters)
                .map_err(|source| LoadError::Undecodable {
                    event_id: envelope.event_id,
                    aggregate_id: envelope.aggregate_id,
                    aggregate_version: envelope.aggregate_version,
                    source,
                })?;
        events.push(event);
    }
    Ok(A::fold(id, &events))
}
