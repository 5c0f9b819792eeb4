//! The order's events in their current shape, and their public JSON payloads.
//!
//! Field names are a public schema read by other services: they never change within a version. A change
//! of shape is a new version plus an upcaster (see [`crate::upcast`]); this enum only knows the newest.
//!
//! Every payload type is `#[non_exhaustive]` and built by its constructor beside it, so a field added
//! with a default is set here alone (`docs/guides/new-event-version.md`). Outside this crate a literal
//! does not compile:
//!
//! ```compile_fail
//! let note = domain::Note::parse("DHL").expect("a note");
//! let shipped = domain::OrderShipped { carrier: note.clone(), tracking_number: note };
//! ```

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::order::{CancelOrder, PayOrder, PlaceOrder, ShipOrder};
use crate::values::{Cents, Channel, Currency, CustomerId, Note, OrderLine};

/// `order.placed`, version 3: who ordered what, in which currency, for how much, through which sales
/// channel. (v2 had no channel; v1 was the legacy `{order_no, amount_cents}`.)
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct OrderPlaced {
    /// The customer who placed the order.
    pub customer_id: CustomerId,
    /// The currency of every amount in the order.
    pub currency: Currency,
    /// The ordered lines (empty only for orders upcast from the legacy v1 shape).
    pub lines: Vec<OrderLine>,
    /// Sum of quantity × unit price over the lines.
    pub total_cents: i64,
    /// Where the order was placed.
    pub channel: Channel,
}

impl OrderPlaced {
    /// The event an accepted place command records, its total already checked. The one place an
    /// `OrderPlaced` is built: a new field with a default (one the command does not carry) is set
    /// here alone.
    pub fn from_command(place: &PlaceOrder, total_cents: i64) -> Self {
        Self {
            customer_id: place.customer_id.clone(),
            currency: place.currency.clone(),
            lines: place.lines.clone(),
            total_cents,
            channel: place.channel,
        }
    }
}

/// `order.paid`, version 1: the order total was paid.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct OrderPaid {
    /// The amount paid; always the order total.
    pub amount_cents: Cents,
    /// The payment provider's reference, if one was given (else `null`).
    pub payment_ref: Option<Note>,
}

impl OrderPaid {
    /// The event an accepted pay command records, its amount already checked against the total.
    /// The one place an `OrderPaid` is built.
    pub fn from_command(pay: &PayOrder) -> Self {
        Self {
            amount_cents: pay.amount_cents,
            payment_ref: pay.payment_ref.clone(),
        }
    }
}

/// `order.cancelled`, version 1: the order will not ship (a refund if it was paid).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct OrderCancelled {
    /// Why, in the words of whoever cancelled.
    pub reason: Note,
}

impl OrderCancelled {
    /// The event an accepted cancel command records. The one place an `OrderCancelled` is built.
    pub fn from_command(cancel: &CancelOrder) -> Self {
        Self {
            reason: cancel.reason.clone(),
        }
    }
}

/// `order.shipped`, version 1: the order left the warehouse.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct OrderShipped {
    /// Who carries it.
    pub carrier: Note,
    /// The carrier's tracking number.
    pub tracking_number: Note,
}

impl OrderShipped {
    /// The event an accepted ship command records. The one place an `OrderShipped` is built.
    pub fn from_command(ship: &ShipOrder) -> Self {
        Self {
            carrier: ship.carrier.clone(),
            tracking_number: ship.tracking_number.clone(),
        }
    }
}

/// Something that happened to an order, in the current shape of its type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OrderEvent {
    /// See [`OrderPlaced`].
    Placed(OrderPlaced),
    /// See [`OrderPaid`].
    Paid(OrderPaid),
    /// See [`OrderCancelled`].
    Cancelled(OrderCancelled),
    /// See [`OrderShipped`].
    Shipped(OrderShipped),
}

/// The aggregate type every order event belongs to.
pub const AGGREGATE_TYPE: &str = "order";

/// Every event type with its current payload version. Adding a version means bumping it here, adding an
/// upcaster from the previous version and a golden fixture for the new one.
pub const CURRENT_VERSIONS: &[(&str, i32)] = &[
    (OrderEvent::PLACED, 3),
    (OrderEvent::PAID, 1),
    (OrderEvent::CANCELLED, 1),
    (OrderEvent::SHIPPED, 1),
];

/// Why a current-version payload could not become an [`OrderEvent`].
#[derive(Debug, thiserror::Error)]
pub enum PayloadError {
    /// The event type is not one of ours.
    #[error("unknown event type {0:?}")]
    UnknownType(String),
    /// The JSON does not have the shape (or the valid values) of the current version.
    #[error("{event_type} payload does not match its schema")]
    Shape {
        /// The event type whose schema was violated.
        event_type: String,
        /// What serde found wrong.
        source: serde_json::Error,
    },
}

impl OrderEvent {
    /// Event type name of [`OrderPlaced`].
    pub const PLACED: &'static str = "order.placed";
    /// Event type name of [`OrderPaid`].
    pub const PAID: &'static str = "order.paid";
    /// Event type name of [`OrderCancelled`].
    pub const CANCELLED: &'static str = "order.cancelled";
    /// Event type name of [`OrderShipped`].
    pub const SHIPPED: &'static str = "order.shipped";

    /// The dotted event type, e.g. `order.placed`.
    pub fn event_type(&self) -> &'static str {
        match self {
            Self::Placed(_) => Self::PLACED,
            Self::Paid(_) => Self::PAID,
            Self::Cancelled(_) => Self::CANCELLED,
            Self::Shipped(_) => Self::SHIPPED,
        }
    }

    /// The payload version this code writes for the event's type.
    pub fn event_version(&self) -> i32 {
        current_version(self.event_type())
            .expect("CURRENT_VERSIONS lists every OrderEvent type (see the tests of this module)")
    }

    /// The JSON payload in the current version's shape.
    pub fn to_payload(&self) -> Value {
        let encoded = match self {
            Self::Placed(e) => serde_json::to_value(e),
            Self::Paid(e) => serde_json::to_value(e),
            Self::Cancelled(e) => serde_json::to_value(e),
            Self::Shipped(e) => serde_json::to_value(e),
        };
        encoded.expect(
            "event payloads are structs of strings, integers and lists of them; \
             serializing them into a `Value` cannot fail",
        )
    }

    /// Decodes a payload that is already in the current version's shape (upcast it first).
    pub fn from_payload(event_type: &str, payload: Value) -> Result<Self, PayloadError> {
        let shape = |source| PayloadError::Shape {
            event_type: event_type.to_owned(),
            source,
        };
        match event_type {
            Self::PLACED => serde_json::from_value(payload).map(Self::Placed),
            Self::PAID => serde_json::from_value(payload).map(Self::Paid),
            Self::CANCELLED => serde_json::from_value(payload).map(Self::Cancelled),
            Self::SHIPPED => serde_json::from_value(payload).map(Self::Shipped),
            other => return Err(PayloadError::UnknownType(other.to_owned())),
        }
        .map_err(shape)
    }
}

impl crate::aggregate::DomainEvent for OrderEvent {
    const CURRENT_VERSIONS: &'static [(&'static str, i32)] = CURRENT_VERSIONS;

    fn event_type(&self) -> &'static str {
        OrderEvent::event_type(self)
    }

    fn to_payload(&self) -> Value {
        OrderEvent::to_payload(self)
    }

    fn from_payload(event_type: &str, payload: Value) -> Result<Self, PayloadError> {
        OrderEvent::from_payload(event_type, payload)
    }
}

/// The current payload version of `event_type`, or `None` for a type this code does not know.
pub fn current_version(event_type: &str) -> Option<i32> {
    CURRENT_VERSIONS
        .iter()
        .find(|(t, _)| *t == event_type)
        .map(|(_, v)| *v)
}
