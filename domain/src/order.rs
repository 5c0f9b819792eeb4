//! The order aggregate: commands are decided against the folded state, events are applied to it.
//!
//! `decide` holds every business rule and never mutates; `apply` only records facts and never refuses
//! (history is what happened, even if today's rules would not allow it).

use std::collections::HashSet;
use std::fmt;

use serde::Serialize;

use crate::aggregate::{Aggregate, DomainError, Refusal};
use crate::catalog::PayloadSchema;
use crate::event::{OrderCancelled, OrderEvent, OrderPaid, OrderPlaced, OrderShipped};
use crate::upcast::Upcasters;
use crate::values::{Cents, Channel, Currency, CustomerId, Note, OrderId, OrderLine, ValueError};

/// Place a new order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PlaceOrder {
    /// Who orders.
    pub customer_id: CustomerId,
    /// Currency of the prices.
    pub currency: Currency,
    /// One or more lines, each SKU at most once.
    pub lines: Vec<OrderLine>,
    /// Where it is placed.
    pub channel: Channel,
}

/// Pay a placed order in full.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PayOrder {
    /// Must equal the order total.
    pub amount_cents: Cents,
    /// The payment provider's reference, if any.
    pub payment_ref: Option<Note>,
}

/// Cancel a placed or paid order (the latter is a refund).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CancelOrder {
    /// Why the order is cancelled, as the customer or operator gave it.
    pub reason: Note,
}

/// Ship a paid order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ShipOrder {
    /// Who carries it.
    pub carrier: Note,
    /// The carrier's tracking number.
    pub tracking_number: Note,
}

/// Something a caller asks an order to do. Serializes as `{"command": "pay", ...fields}`, which the
/// store keeps to recognise a retried request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "command", rename_all = "snake_case")]
pub enum OrderCommand {
    /// See [`PlaceOrder`].
    Place(PlaceOrder),
    /// See [`PayOrder`].
    Pay(PayOrder),
    /// See [`CancelOrder`].
    Cancel(CancelOrder),
    /// See [`ShipOrder`].
    Ship(ShipOrder),
}

impl OrderCommand {
    /// A short verb for messages and logs: `place`, `pay`, `cancel`, `ship`.
    pub fn verb(&self) -> &'static str {
        match self {
            Self::Place(_) => "place",
            Self::Pay(_) => "pay",
            Self::Cancel(_) => "cancel",
            Self::Ship(_) => "ship",
        }
    }
}

/// Where an order is in its lifecycle: placed → paid → shipped; placed → cancelled; paid → cancelled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OrderStatus {
    /// No event yet: the order does not exist.
    New,
    /// Placed, awaiting payment.
    Placed,
    /// Paid, awaiting shipment.
    Paid,
    /// Shipped (final).
    Shipped,
    /// Cancelled (final).
    Cancelled,
}

impl fmt::Display for OrderStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::New => "new",
            Self::Placed => "placed",
            Self::Paid => "paid",
            Self::Shipped => "shipped",
            Self::Cancelled => "cancelled",
        })
    }
}

/// Why a command was refused. Every message names the order or value and the rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OrderError {
    /// A command other than place was sent to an order with no events.
    #[error("order {0} not found")]
    NotFound(OrderId),
    /// Place was sent to an order that already exists.
    #[error("order {0} already exists")]
    AlreadyPlaced(OrderId),
    /// Place without lines.
    #[error("an order needs at least one line")]
    NoLines,
    /// The same SKU on two lines; one line per SKU keeps totals and inventory unambiguous.
    #[error("sku {0} appears on more than one line; put its whole quantity on one line")]
    DuplicateSku(String),
    /// More lines than one order may carry.
    #[error("an order may have at most {max} lines, this one has {got}")]
    TooManyLines {
        /// The limit.
        max: usize,
        /// What was sent.
        got: usize,
    },
    /// A payment that is not exactly the order total.
    #[error(
        "order {id} totals {total_cents} cents; a payment of {paid_cents} cents does not match"
    )]
    WrongAmount {
        /// The order.
        id: OrderId,
        /// What it costs.
        total_cents: i64,
        /// What was offered.
        paid_cents: i64,
    },
    /// Paying an order that is already paid.
    #[error("order {0} is already paid")]
    AlreadyPaid(OrderId),
    /// A command the order's current status does not allow.
    #[error("cannot {action} order {id}: it is {status}")]
    IllegalTransition {
        /// The order.
        id: OrderId,
        /// The refused command's verb.
        action: &'static str,
        /// Where the order is.
        status: OrderStatus,
    },
    /// A value inside the command was invalid.
    #[error(transparent)]
    InvalidValue(#[from] ValueError),
}

/// The folded state of one order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Order {
    /// Its identity.
    pub order_id: OrderId,
    /// How many events have been applied (the aggregate version; 0 for a new order).
    pub version: i64,
    /// Where it is in the lifecycle.
    pub status: OrderStatus,
    /// Who placed it (`None` until placed).
    pub customer_id: Option<CustomerId>,
    /// Its currency (`None` until placed).
    pub currency: Option<Currency>,
    /// What was ordered.
    pub lines: Vec<OrderLine>,
    /// What it costs.
    pub total_cents: i64,
    /// Where it was placed (`None` until placed).
    pub channel: Option<Channel>,
    /// What was paid (0 until paid; it stays set after a refunding cancel, as the record of payment).
    pub paid_cents: i64,
    /// The payment reference, when paid with one.
    pub payment_ref: Option<Note>,
    /// Why it was cancelled.
    pub cancel_reason: Option<Note>,
    /// Carrier, once shipped.
    pub carrier: Option<Note>,
    /// Tracking number, once shipped.
    pub tracking_number: Option<Note>,
}

impl Order {
    /// The most lines one order may have: a bound on event size, far above any real basket.
    pub const MAX_LINES: usize = 500;

    /// An order with no history.
    pub fn new(order_id: OrderId) -> Self {
        Self {
            order_id,
            version: 0,
            status: OrderStatus::New,
            customer_id: None,
            currency: None,
            lines: Vec::new(),
            total_cents: 0,
            channel: None,
            paid_cents: 0,
            payment_ref: None,
            cancel_reason: None,
            carrier: None,
            tracking_number: None,
        }
    }

    /// Folds a history, oldest first, into the current state.
    pub fn fold<'a>(order_id: OrderId, events: impl IntoIterator<Item = &'a OrderEvent>) -> Self {
        events.into_iter().fold(Self::new(order_id), Self::apply)
    }

    /// Decides what `command` means for this order: the events to record, or why it is refused.
    pub fn decide(&self, command: &OrderCommand) -> Result<Vec<OrderEvent>, OrderError> {
        let id = self.order_id;
        let illegal = |action| OrderError::IllegalTransition {
            id,
            action,
            status: self.status,
        };
        if self.status == OrderStatus::New && !matches!(command, OrderCommand::Place(_)) {
            return Err(OrderError::NotFound(id));
        }
        let event = match command {
            OrderCommand::Place(place) => {
                if self.status != OrderStatus::New {
                    return Err(OrderError::AlreadyPlaced(id));
                }
                OrderEvent::Placed(decide_place(place)?)
            }
            OrderCommand::Pay(pay) => {
                match self.status {
                    OrderStatus::Placed => {}
                    OrderStatus::Paid => return Err(OrderError::AlreadyPaid(id)),
                    _ => return Err(illegal("pay")),
                }
                if pay.amount_cents.get() != self.total_cents {
                    return Err(OrderError::WrongAmount {
                        id,
                        total_cents: self.total_cents,
                        paid_cents: pay.amount_cents.get(),
                    });
                }
                OrderEvent::Paid(OrderPaid::from_command(pay))
            }
            OrderCommand::Cancel(cancel) => match self.status {
                OrderStatus::Placed | OrderStatus::Paid => {
                    OrderEvent::Cancelled(OrderCancelled::from_command(cancel))
                }
                _ => return Err(illegal("cancel")),
            },
            OrderCommand::Ship(ship) => match self.status {
                OrderStatus::Paid => OrderEvent::Shipped(OrderShipped::from_command(ship)),
                _ => return Err(illegal("ship")),
            },
        };
        Ok(vec![event])
    }

    /// Records one event. Never refuses: the event already happened.
    pub fn apply(mut self, event: &OrderEvent) -> Self {
        self.version += 1;
        match event {
            OrderEvent::Placed(placed) => {
                self.status = OrderStatus::Placed;
                self.customer_id = Some(placed.customer_id.clone());
                self.currency = Some(placed.currency.clone());
                self.lines = placed.lines.clone();
                self.total_cents = placed.total_cents;
                self.channel = Some(placed.channel);
            }
            OrderEvent::Paid(paid) => {
                self.status = OrderStatus::Paid;
                self.paid_cents = paid.amount_cents.get();
                self.payment_ref = paid.payment_ref.clone();
            }
            OrderEvent::Cancelled(cancelled) => {
                self.status = OrderStatus::Cancelled;
                self.cancel_reason = Some(cancelled.reason.clone());
            }
            OrderEvent::Shipped(shipped) => {
                self.status = OrderStatus::Shipped;
                self.carrier = Some(shipped.carrier.clone());
                self.tracking_number = Some(shipped.tracking_number.clone());
            }
        }
        self
    }
}

impl crate::aggregate::Command for OrderCommand {
    type Aggregate = Order;

    fn verb(&self) -> &'static str {
        OrderCommand::verb(self)
    }

    fn creates(&self) -> bool {
        matches!(self, Self::Place(_))
    }
}

impl DomainError for OrderError {
    fn refusal(&self) -> Refusal {
        match self {
            Self::NotFound(_) => Refusal::NotFound,
            Self::AlreadyPlaced(_) | Self::AlreadyPaid(_) | Self::IllegalTransition { .. } => {
                Refusal::Conflict
            }
            Self::NoLines
            | Self::DuplicateSku(_)
            | Self::TooManyLines { .. }
            | Self::WrongAmount { .. }
            | Self::InvalidValue(_) => Refusal::Invalid,
        }
    }
}

/// The order is the reference aggregate: every other type follows its shape.
impl Aggregate for Order {
    const TYPE: &'static str = crate::event::AGGREGATE_TYPE;
    type Id = OrderId;
    type Event = OrderEvent;
    type Command = OrderCommand;
    type Error = OrderError;

    fn new(id: OrderId) -> Self {
        Order::new(id)
    }

    fn id(&self) -> OrderId {
        self.order_id
    }

    fn version(&self) -> i64 {
        self.version
    }

    fn decide(&self, command: &OrderCommand) -> Result<Vec<OrderEvent>, OrderError> {
        Order::decide(self, command)
    }

    fn apply(self, event: &OrderEvent) -> Self {
        Order::apply(self, event)
    }

    fn not_found(id: OrderId) -> OrderError {
        OrderError::NotFound(id)
    }

    /// Every version of the order's events ever written: the steps up to the current shape (the
    /// functions live in `crate::upcast`) and the downcasters writers hold back with in a rollout.
    /// Every aggregate registers its steps in its own `upcasters()`.
    fn upcasters() -> Upcasters {
        use crate::upcast::{order_placed_v1_to_v2, order_placed_v2_to_v3, order_placed_v3_to_v2};
        Upcasters::for_events::<OrderEvent>()
            .with_named_step(
                OrderEvent::PLACED,
                1,
                "domain::upcast::order_placed_v1_to_v2",
                order_placed_v1_to_v2,
            )
            .with_named_step(
                OrderEvent::PLACED,
                2,
                "domain::upcast::order_placed_v2_to_v3",
                order_placed_v2_to_v3,
            )
            .with_downcast(OrderEvent::PLACED, 3, order_placed_v3_to_v2)
    }

    fn schemas() -> Vec<PayloadSchema> {
        crate::catalog::order_schemas()
    }
}

/// The rules of a new order: at least one line, each SKU once, a bounded number of lines.
fn decide_place(place: &PlaceOrder) -> Result<OrderPlaced, OrderError> {
    if place.lines.is_empty() {
        return Err(OrderError::NoLines);
    }
    if place.lines.len() > Order::MAX_LINES {
        return Err(OrderError::TooManyLines {
            max: Order::MAX_LINES,
            got: place.lines.len(),
        });
    }
    let mut seen = HashSet::new();
    for line in &place.lines {
        if !seen.insert(&line.sku) {
            return Err(OrderError::DuplicateSku(line.sku.to_string()));
        }
    }
    // The value bounds keep each subtotal at or below 10^18 cents, but ten such lines already exceed
    // i64: checked arithmetic turns that into a refusal instead of a wrapped total, and a total above
    // Cents::MAX is refused like an unpayable one.
    let total_cents = place
        .lines
        .iter()
        .try_fold(0i64, |sum, line| sum.checked_add(line.subtotal_cents()?));
    // The same bound as a payment: an order whose total no payment may carry could be placed but
    // never paid.
    let total_cents = match total_cents {
        Some(total) if total <= Cents::MAX => total,
        total => {
            return Err(OrderError::InvalidValue(ValueError {
                field: "order total",
                value: total.map_or_else(
                    || "more than 9.2e18 cents".to_owned(),
                    |t| format!("{t} cents"),
                ),
                rule: "it must be at most 10^12 cents, the largest payment accepted",
            }));
        }
    };
    Ok(OrderPlaced::from_command(place, total_cents))
}

#[cfg(test)]
mod tests {
    //! Given/when/then: given a history, when a command arrives, then these events or this refusal.

    use super::*;
    use uuid::Uuid;

    fn id() -> OrderId {
        OrderId::from_uuid(Uuid::from_u128(0x0190_0000_0000_7000_8000_0000_0000_0001))
    }

    fn line(sku: &str, qty: i64, price: i64) -> OrderLine {
        OrderLine {
            sku: Sku::parse(sku).expect("sku"),
            quantity: Quantity::new(qty).expect("qty"),
            unit_price_cents: Cents::new(price).expect("price"),
        }
    }

    use crate::values::{Quantity, Sku};

    fn place(lines: Vec<OrderLine>) -> OrderCommand {
        OrderCommand::Place(PlaceOrder {
            customer_id: CustomerId::parse("alice").expect("customer"),
            currency: Currency::parse("EUR").expect("currency"),
            lines,
            channel: Channel::Store,
        })
    }

    fn pay(cents: i64) -> OrderCommand {
        OrderCommand::Pay(PayOrder {
            amount_cents: Cents::new(cents).expect("cents"),
            payment_ref: Some(Note::parse("psp-1").expect("ref")),
        })
    }

    fn cancel() -> OrderCommand {
        OrderCommand::Cancel(CancelOrder {
            reason: Note::parse("changed my mind").expect("reason"),
        })
    }

    fn ship() -> OrderCommand {
        OrderCommand::Ship(ShipOrder {
            carrier: Note::parse("DHL").expect("carrier"),
            tracking_number: Note::parse("JD0001").expect("tracking"),
        })
    }

    /// Runs the commands in order against a fresh order, each of which must be accepted.
    fn given(commands: &[OrderCommand]) -> Order {
        commands.iter().fold(Order::new(id()), |order, command| {
            let events = order.decide(command).expect("given commands are accepted");
            events.iter().fold(order, |o, e| o.apply(e))
        })
    }

    fn placed() -> Order {
        given(&[place(vec![line("MUG", 2, 1250), line("TEA", 1, 500)])])
    }

    #[test]
    fn placing_an_order_records_its_lines_and_total() {
        let events = Order::new(id())
            .decide(&place(vec![line("MUG", 2, 1250), line("TEA", 1, 500)]))
            .expect("accepted");
        let [OrderEvent::Placed(placed)] = &events[..] else {
            panic!("expected one order.placed, got {events:?}");
        };
        assert_eq!(placed.total_cents, 3000);
        assert_eq!(placed.lines.len(), 2);
        assert_eq!(placed.customer_id.as_str(), "alice");
    }

    #[test]
    fn placing_an_order_without_lines_is_rejected() {
        assert_eq!(
            Order::new(id()).decide(&place(vec![])),
            Err(OrderError::NoLines)
        );
    }

    #[test]
    fn placing_the_same_sku_twice_is_rejected() {
        let err = Order::new(id())
            .decide(&place(vec![line("MUG", 1, 100), line("MUG", 2, 100)]))
            .expect_err("duplicate sku");
        assert_eq!(err, OrderError::DuplicateSku("MUG".into()));
        assert!(err.to_string().contains("MUG"));
    }

    #[test]
    fn placing_too_many_lines_is_rejected() {
        let lines = (0..=Order::MAX_LINES)
            .map(|i| line(&format!("SKU-{i}"), 1, 1))
            .collect();
        assert!(matches!(
            Order::new(id()).decide(&place(lines)),
            Err(OrderError::TooManyLines { .. })
        ));
    }

    #[test]
    fn placing_an_order_whose_total_overflows_is_rejected() {
        let lines = (0..10)
            .map(|i| line(&format!("GOLD-{i}"), Quantity::MAX.into(), Cents::MAX))
            .collect();
        let err = Order::new(id())
            .decide(&place(lines))
            .expect_err("overflow");
        assert!(err.to_string().contains("order total"), "{err}");
    }

    #[test]
    fn an_order_that_no_payment_could_settle_is_refused_at_place() {
        // Two lines, each within the price bound, together 2 × 10^12 cents.
        let lines = vec![line("GOLD", 2, Cents::MAX), line("SILVER", 1, 1)];
        let err = Order::new(id())
            .decide(&place(lines))
            .expect_err("unpayable");
        assert!(err.to_string().contains("order total"), "{err}");
        assert!(err.to_string().contains("10^12"), "{err}");
        // The largest total that is accepted can be paid.
        let order = Order::new(id());
        let events = order
            .decide(&place(vec![line("GOLD", 1, Cents::MAX)]))
            .expect("at the bound");
        let order = events.iter().fold(order, |o, e| o.apply(e));
        assert!(order.decide(&pay(Cents::MAX)).is_ok());
    }

    #[test]
    fn placing_an_existing_order_is_rejected() {
        assert_eq!(
            placed().decide(&place(vec![line("MUG", 1, 1)])),
            Err(OrderError::AlreadyPlaced(id()))
        );
    }

    #[test]
    fn paying_the_exact_total_marks_the_order_paid() {
        let order = placed();
        let events = order.decide(&pay(3000)).expect("accepted");
        let order = events.iter().fold(order, |o, e| o.apply(e));
        assert_eq!(order.status, OrderStatus::Paid);
        assert_eq!(order.paid_cents, 3000);
        assert_eq!(order.version, 2);
    }

    #[test]
    fn paying_a_wrong_amount_is_rejected() {
        let err = placed().decide(&pay(2999)).expect_err("wrong amount");
        assert!(matches!(
            err,
            OrderError::WrongAmount {
                total_cents: 3000,
                paid_cents: 2999,
                ..
            }
        ));
        assert!(err.to_string().contains("3000"), "{err}");
    }

    #[test]
    fn paying_twice_is_rejected() {
        let order = given(&[place(vec![line("MUG", 1, 700)]), pay(700)]);
        assert_eq!(order.decide(&pay(700)), Err(OrderError::AlreadyPaid(id())));
    }

    #[test]
    fn paying_a_cancelled_order_is_rejected() {
        let order = given(&[place(vec![line("MUG", 1, 700)]), cancel()]);
        assert!(matches!(
            order.decide(&pay(700)),
            Err(OrderError::IllegalTransition {
                action: "pay",
                status: OrderStatus::Cancelled,
                ..
            })
        ));
    }

    #[test]
    fn paying_a_shipped_order_is_rejected() {
        let order = given(&[place(vec![line("MUG", 1, 700)]), pay(700), ship()]);
        assert!(matches!(
            order.decide(&pay(700)),
            Err(OrderError::IllegalTransition {
                action: "pay",
                status: OrderStatus::Shipped,
                ..
            })
        ));
    }

    #[test]
    fn cancelling_a_placed_order_is_accepted() {
        let order = given(&[place(vec![line("MUG", 1, 700)]), cancel()]);
        assert_eq!(order.status, OrderStatus::Cancelled);
        assert_eq!(
            order.cancel_reason.as_ref().map(Note::as_str),
            Some("changed my mind")
        );
    }

    #[test]
    fn cancelling_a_paid_order_is_a_refund_and_is_accepted() {
        let order = given(&[place(vec![line("MUG", 1, 700)]), pay(700), cancel()]);
        assert_eq!(order.status, OrderStatus::Cancelled);
        assert_eq!(order.paid_cents, 700, "the payment stays on record");
    }

    #[test]
    fn cancelling_a_shipped_order_is_rejected() {
        let order = given(&[place(vec![line("MUG", 1, 700)]), pay(700), ship()]);
        let err = order.decide(&cancel()).expect_err("shipped is final");
        assert!(err.to_string().contains("it is shipped"), "{err}");
    }

    #[test]
    fn cancelling_a_cancelled_order_is_rejected() {
        let order = given(&[place(vec![line("MUG", 1, 700)]), cancel()]);
        assert!(matches!(
            order.decide(&cancel()),
            Err(OrderError::IllegalTransition {
                action: "cancel",
                ..
            })
        ));
    }

    #[test]
    fn shipping_a_paid_order_is_accepted() {
        let order = given(&[place(vec![line("MUG", 1, 700)]), pay(700), ship()]);
        assert_eq!(order.status, OrderStatus::Shipped);
        assert_eq!(order.version, 3);
        assert_eq!(order.carrier.as_ref().map(Note::as_str), Some("DHL"));
    }

    #[test]
    fn shipping_an_unpaid_order_is_rejected() {
        let err = placed().decide(&ship()).expect_err("unpaid");
        assert_eq!(
            err,
            OrderError::IllegalTransition {
                id: id(),
                action: "ship",
                status: OrderStatus::Placed
            }
        );
        assert_eq!(
            err.to_string(),
            format!("cannot ship order {}: it is placed", id())
        );
    }

    #[test]
    fn shipping_a_cancelled_order_is_rejected() {
        let order = given(&[place(vec![line("MUG", 1, 700)]), pay(700), cancel()]);
        assert!(order.decide(&ship()).is_err());
    }

    #[test]
    fn shipping_twice_is_rejected() {
        let order = given(&[place(vec![line("MUG", 1, 700)]), pay(700), ship()]);
        assert!(order.decide(&ship()).is_err());
    }

    #[test]
    fn any_command_but_place_on_an_unknown_order_is_rejected_as_not_found() {
        for command in [pay(1), cancel(), ship()] {
            let err = Order::new(id())
                .decide(&command)
                .expect_err("unknown order");
            assert_eq!(err, OrderError::NotFound(id()));
            assert!(err.to_string().contains("not found"));
        }
    }
}
