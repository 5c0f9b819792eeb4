//! What an aggregate is, for everything downstream of the domain: a type name (its subject token and
//! `aggregate_type`), an id, its events in their current shape, its commands, a pure `decide` and
//! `apply`, and the upcasters and schemas of its events. The store, the envelope, the relay and the
//! projections' runner are written against these traits; the order is the reference implementation,
//! the customer a second one.

use std::fmt;

use serde::Serialize;
use serde_json::Value;
use uuid::Uuid;

use crate::catalog::PayloadSchema;
use crate::event::PayloadError;
use crate::upcast::Upcasters;

/// An aggregate's identity: a UUID under a type of its own.
pub trait AggregateId: Copy + Eq + fmt::Debug + fmt::Display + Send + Sync + 'static {
    /// Wraps a stored or routed id.
    fn from_uuid(id: Uuid) -> Self;
    /// The id as stored (`aggregate_id`) and as the subject's last token.
    fn as_uuid(&self) -> Uuid;
}

/// An aggregate's events in their current shape: every type knows its name, its current version and
/// its JSON payload.
pub trait DomainEvent: Clone + fmt::Debug + PartialEq + Send + Sync + 'static {
    /// Every event type of the aggregate with the payload version this code writes.
    const CURRENT_VERSIONS: &'static [(&'static str, i32)];

    /// The dotted event type, e.g. `order.placed`.
    fn event_type(&self) -> &'static str;

    /// The JSON payload in the current version's shape.
    fn to_payload(&self) -> Value;

    /// Decodes a payload already in the current version's shape (upcast it first).
    fn from_payload(event_type: &str, payload: Value) -> Result<Self, PayloadError>;

    /// The payload version this code writes for the event's type.
    fn event_version(&self) -> i32 {
        current_version::<Self>(self.event_type())
            .expect("CURRENT_VERSIONS lists every event type of the enum (checked by its tests)")
    }
}

/// The current version of `event_type` among `E`'s types.
pub fn current_version<E: DomainEvent>(event_type: &str) -> Option<i32> {
    E::CURRENT_VERSIONS
        .iter()
        .find(|(t, _)| *t == event_type)
        .map(|(_, v)| *v)
}

/// Something a caller asks an aggregate to do. Serialized (with its verb) to recognise a retried
/// request under the same idempotency key.
pub trait Command: Serialize + fmt::Debug + Send + Sync + 'static {
    /// The aggregate it is decided by.
    type Aggregate: Aggregate<Command = Self>;

    /// A short verb for messages and logs, e.g. `pay`.
    fn verb(&self) -> &'static str;

    /// True when the command creates its aggregate: it is decided against an empty history without
    /// reading one (the unique version then catches an id that exists).
    fn creates(&self) -> bool;
}

/// Why a command was refused, in the terms every caller needs: an unknown aggregate (404), an
/// illegal state (409), or bad input (422).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The aggregate does not exist.
    NotFound,
    /// The aggregate exists but its state does not allow the command (or it exists already).
    Conflict,
    /// A value in the command breaks a rule.
    Invalid,
}

/// A refusal the domain gives, with its kind.
pub trait DomainError: std::error::Error + Clone + Send + Sync + 'static {
    /// What kind of refusal it is.
    fn refusal(&self) -> Refusal;
}

/// A consistency boundary with its own history: decided and folded purely, stored as an event stream
/// keyed by `(aggregate_id, aggregate_version)`.
pub trait Aggregate: Clone + fmt::Debug + Serialize + Send + Sync + 'static {
    /// Its `aggregate_type`, one subject token, e.g. `order`.
    const TYPE: &'static str;
    /// Its id.
    type Id: AggregateId;
    /// Its events in their current shape.
    type Event: DomainEvent;
    /// Its commands.
    type Command: Command<Aggregate = Self>;
    /// Why its commands are refused.
    type Error: DomainError;

    /// The aggregate with no history.
    fn new(id: Self::Id) -> Self;

    /// Its id.
    fn id(&self) -> Self::Id;

    /// How many events it has applied (its aggregate version; 0 when it does not exist).
    fn version(&self) -> i64;

    /// What `command` means for it now: the events to record, or why it is refused.
    fn decide(&self, command: &Self::Command) -> Result<Vec<Self::Event>, Self::Error>;

    /// Records one event. Never refuses: the event already happened.
    fn apply(self, event: &Self::Event) -> Self;

    /// The refusal for a command to an aggregate that does not exist.
    fn not_found(id: Self::Id) -> Self::Error;

    /// The registry bringing every stored version of its events to the current shape.
    fn upcasters() -> Upcasters;

    /// The JSON Schema of every payload version of its events that can exist in storage.
    fn schemas() -> Vec<PayloadSchema>;

    /// Folds a history, oldest first.
    fn fold<'a>(id: Self::Id, events: impl IntoIterator<Item = &'a Self::Event>) -> Self {
        events.into_iter().fold(Self::new(id), Self::apply)
    }
}

/// What the catalog, the AsyncAPI document and the projections need to know of an aggregate type
/// without its Rust types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AggregateKind {
    /// Its `aggregate_type`.
    pub name: &'static str,
    /// Its event types with their current versions.
    pub events: &'static [(&'static str, i32)],
}

impl AggregateKind {
    /// The kind of `A`.
    pub const fn of<A: Aggregate>() -> Self {
        Self {
            name: A::TYPE,
            events: <A::Event as DomainEvent>::CURRENT_VERSIONS,
        }
    }
}

/// Every aggregate type this code knows, the reference first.
pub const AGGREGATES: &[AggregateKind] = &[
    AggregateKind::of::<crate::order::Order>(),
    AggregateKind::of::<crate::customer::Customer>(),
];

/// The aggregate type an event type belongs to (its first dotted token names it).
pub fn aggregate_of_event(event_type: &str) -> Option<&'static AggregateKind> {
    AGGREGATES
        .iter()
        .find(|kind| kind.events.iter().any(|(t, _)| *t == event_type))
}

/// The current version of `event_type`, whichever aggregate type it belongs to.
pub fn current_version_of(event_type: &str) -> Option<i32> {
    aggregate_of_event(event_type)?
        .events
        .iter()
        .find(|(t, _)| *t == event_type)
        .map(|(_, version)| *version)
}

/// An event of any aggregate type this code knows, for readers that take more than one (the
/// catalog's checks, a projection that reads orders and customers). One variant per entry of
/// [`AGGREGATES`].
#[derive(Debug, Clone, PartialEq)]
pub enum AnyEvent {
    /// An order's event.
    Order(crate::event::OrderEvent),
    /// A customer's event.
    Customer(crate::customer::CustomerEvent),
}

impl AnyEvent {
    /// Its aggregate type.
    pub fn aggregate_type(&self) -> &'static str {
        match self {
            Self::Order(_) => crate::order::Order::TYPE,
            Self::Customer(_) => crate::customer::Customer::TYPE,
        }
    }

    /// The dotted event type.
    pub fn event_type(&self) -> &'static str {
        match self {
            Self::Order(event) => event.event_type(),
            Self::Customer(event) => DomainEvent::event_type(event),
        }
    }

    /// The payload version this code writes for it.
    pub fn event_version(&self) -> i32 {
        match self {
            Self::Order(event) => event.event_version(),
            Self::Customer(event) => DomainEvent::event_version(event),
        }
    }

    /// The JSON payload in the current version's shape.
    pub fn to_payload(&self) -> Value {
        match self {
            Self::Order(event) => event.to_payload(),
            Self::Customer(event) => DomainEvent::to_payload(event),
        }
    }
}

impl crate::envelope::EventEnvelope {
    /// Upcasts and decodes an event of whichever known aggregate type the envelope names.
    pub fn decode_any(
        &self,
        upcasters: &Upcasters,
    ) -> Result<AnyEvent, crate::envelope::DecodeError> {
        use crate::customer::Customer;
        use crate::order::Order;
        match self.aggregate_type.as_str() {
            Customer::TYPE => self
                .decode_for::<Customer>(upcasters)
                .map(AnyEvent::Customer),
            Order::TYPE => self.decode_for::<Order>(upcasters).map(AnyEvent::Order),
            other => Err(crate::envelope::DecodeError::AggregateType {
                found: other.to_owned(),
                expected: "a known aggregate type (order, customer)",
            }),
        }
    }
}
