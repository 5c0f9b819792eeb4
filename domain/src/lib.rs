//! The domain: pure, synchronous, no I/O, no clock and no randomness.
//!
//! Each aggregate type ([`Aggregate`]: the [`Order`], the reference, and the [`Customer`]) decides
//! its commands against its folded state; the resulting events are wrapped in a versioned
//! [`EventEnvelope`] by the caller, who supplies ids and time. Stored payloads of any version come
//! back to the current shape through [`Upcasters`].

pub mod aggregate;
pub mod catalog;
pub mod customer;
pub mod envelope;
pub mod event;
pub mod order;
pub mod upcast;
pub mod values;
pub mod wire;

pub use aggregate::{
    AGGREGATES, Aggregate, AggregateId, AggregateKind, AnyEvent, Command, DomainError, DomainEvent,
    Refusal,
};
pub use customer::{
    Customer, CustomerCommand, CustomerError, CustomerEvent, CustomerKey, CustomerRegistered,
    CustomerRenamed, RegisterCustomer, RenameCustomer,
};
pub use envelope::{DecodeError, EventEnvelope, EventMeta};
pub use event::{
    AGGREGATE_TYPE, CURRENT_VERSIONS, OrderCancelled, OrderEvent, OrderPaid, OrderPlaced,
    OrderShipped, PayloadError,
};
pub use order::{
    CancelOrder, Order, OrderCommand, OrderError, OrderStatus, PayOrder, PlaceOrder, ShipOrder,
};
pub use upcast::{DowncastError, UpcastError, Upcasters, WriteVersions};
pub use values::{
    Cents, Channel, Currency, CustomerId, Note, OrderId, OrderLine, Quantity, Sku, ValueError,
};
