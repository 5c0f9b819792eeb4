//! The versioned envelope: the JSON body of every NATS message and the columns of the `events` table.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use uuid::Uuid;

use crate::aggregate::{Aggregate, AggregateId, DomainEvent};
use crate::event::{OrderEvent, PayloadError};
use crate::order::Order;
use crate::upcast::{DowncastError, UpcastError, Upcasters, WriteVersions};
use crate::values::OrderId;

/// One stored or published event with its routing and tracing facts.
///
/// Unknown envelope fields are ignored on read, so a producer may add one without breaking consumers;
/// the payload, by contrast, is checked strictly against its versioned schema.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EventEnvelope {
    /// UUID v7, unique; also the `Nats-Msg-Id` header, so JetStream can drop duplicates.
    pub event_id: Uuid,
    /// Dotted name, e.g. `order.placed`.
    pub event_type: String,
    /// Schema version of `payload` (≥ 1).
    pub event_version: i32,
    /// The aggregate type, e.g. `order` or `customer`.
    pub aggregate_type: String,
    /// The aggregate's id.
    pub aggregate_id: Uuid,
    /// 1-based position in the aggregate's stream: the per-aggregate order key.
    pub aggregate_version: i64,
    /// When the command that caused it was decided (UTC).
    pub occurred_at: DateTime<Utc>,
    /// Shared by every event of one flow across services.
    pub correlation_id: Option<Uuid>,
    /// The command (or event) that directly caused this one.
    pub causation_id: Option<Uuid>,
    /// The event body, in the shape of `event_version`.
    pub payload: Value,
}

/// The facts about an event that the domain does not decide: ids, the clock and tracing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventMeta {
    /// The new event's id.
    pub event_id: Uuid,
    /// The time of the decision.
    pub occurred_at: DateTime<Utc>,
    /// The flow this belongs to.
    pub correlation_id: Option<Uuid>,
    /// The command that caused it.
    pub causation_id: Option<Uuid>,
}

/// Why an envelope could not become an aggregate's event.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// The bytes are not an envelope at all.
    #[error("not an event envelope")]
    Envelope(#[from] serde_json::Error),
    /// The envelope is about another aggregate type than the one asked for.
    #[error("aggregate type {found:?} is not {expected:?}")]
    AggregateType {
        /// The envelope's aggregate type.
        found: String,
        /// The type the reader decodes.
        expected: &'static str,
    },
    /// The `(event_type, event_version)` has no path to the current shape.
    #[error(transparent)]
    Upcast(#[from] UpcastError),
    /// The upcast payload does not fit the current schema.
    #[error(transparent)]
    Payload(#[from] PayloadError),
}

impl EventEnvelope {
    /// Wraps a freshly decided order event in its envelope at `aggregate_version`.
    pub fn wrap(
        event: &OrderEvent,
        order_id: OrderId,
        aggregate_version: i64,
        meta: EventMeta,
    ) -> Self {
        Self::wrap_event::<Order>(event, order_id, aggregate_version, meta)
    }

    /// Wraps a freshly decided event of aggregate type `A` in its envelope at `aggregate_version`.
    pub fn wrap_event<A: Aggregate>(
        event: &A::Event,
        id: A::Id,
        aggregate_version: i64,
        meta: EventMeta,
    ) -> Self {
        Self {
            event_id: meta.event_id,
            event_type: event.event_type().to_owned(),
            event_version: event.event_version(),
            aggregate_type: A::TYPE.to_owned(),
            aggregate_id: id.as_uuid(),
            aggregate_version,
            occurred_at: meta.occurred_at,
            correlation_id: meta.correlation_id,
            causation_id: meta.causation_id,
            payload: event.to_payload(),
        }
    }

    /// Like [`EventEnvelope::wrap_event`], but in the version `writes` asks for (downcast from the
    /// current one), or why the event cannot be written that way.
    pub fn wrap_as<A: Aggregate>(
        event: &A::Event,
        id: A::Id,
        aggregate_version: i64,
        meta: EventMeta,
        writes: &WriteVersions,
        upcasters: &Upcasters,
    ) -> Result<Self, DowncastError> {
        let mut envelope = Self::wrap_event::<A>(event, id, aggregate_version, meta);
        if let Some(version) = writes.get(&envelope.event_type)
            && version != envelope.event_version
        {
            envelope.payload = upcasters.downcast(
                &envelope.event_type,
                std::mem::take(&mut envelope.payload),
                version,
            )?;
            envelope.event_version = version;
        }
        Ok(envelope)
    }

    /// Parses a message body.
    pub fn from_json(bytes: &[u8]) -> Result<Self, DecodeError> {
        Ok(serde_json::from_slice(bytes)?)
    }

    /// The message body.
    pub fn to_json(&self) -> Vec<u8> {
        self.to_json_string().into_bytes()
    }

    /// The message body as text (what the outbox stores and the relay publishes verbatim).
    pub fn to_json_string(&self) -> String {
        serde_json::to_string(self).expect(
            "an envelope of strings, integers, UUIDs, a timestamp and a `Value` (whose keys are \
             strings and whose numbers are finite) always serializes",
        )
    }

    /// Upcasts the payload of an order event to the current version and decodes it.
    pub fn decode(&self, upcasters: &Upcasters) -> Result<OrderEvent, DecodeError> {
        self.decode_for::<Order>(upcasters)
    }

    /// Upcasts the payload of an event of aggregate type `A` to the current version and decodes it.
    pub fn decode_for<A: Aggregate>(&self, upcasters: &Upcasters) -> Result<A::Event, DecodeError> {
        if self.aggregate_type != A::TYPE {
            return Err(DecodeError::AggregateType {
                found: self.aggregate_type.clone(),
                expected: A::TYPE,
            });
        }
        let payload =
            upcasters.upcast(&self.event_type, self.event_version, self.payload.clone())?;
        Ok(A::Event::from_payload(&self.event_type, payload)?)
    }
}
