//! Customers with their orders: each customer's name (from the customer's own events) beside how many
//! orders it placed and paid and what it paid (from the orders') — a read model of two aggregate
//! types. Orders and customers are independent streams, so either may arrive first: a customer's
//! row is made by whichever comes.

use std::collections::BTreeMap;

use domain::{AnyEvent, CustomerEvent, OrderEvent};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use sqlx::{PgConnection, PgPool};

use crate::decode::Decoded;
use crate::kit::ReadModel;

/// The model.
#[derive(Debug, Clone, Copy)]
pub struct Customers;

/// What it remembers of each aggregate: for an order, whose it is and what was paid; for a
/// customer, its handle.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Remembered {
    customer_id: String,
    paid_cents: i64,
}

/// One customer's row.
#[derive(Debug, Clone, Default, PartialEq)]
struct Row {
    name: Option<String>,
    orders: i64,
    paid_orders: i64,
    paid_cents: i64,
}

/// What one event changes in its customer's row, as deltas (and the name, when it says one).
#[derive(Debug, Default)]
struct Change {
    name: Option<String>,
    orders: i64,
    paid_orders: i64,
    paid_cents: i64,
}

/// The change an event makes, updating what is remembered of its aggregate; `None`: nothing.
fn change(remembered: &mut Remembered, event: &AnyEvent) -> Option<Change> {
    Some(match event {
        AnyEvent::Customer(CustomerEvent::Registered(registered)) => {
            remembered.customer_id = registered.customer_id.to_string();
            Change {
                name: Some(registered.name.to_string()),
                ..Change::default()
            }
        }
        AnyEvent::Customer(CustomerEvent::Renamed(renamed)) => Change {
            name: Some(renamed.name.to_string()),
            ..Change::default()
        },
        AnyEvent::Order(OrderEvent::Placed(placed)) => {
            remembered.customer_id = placed.customer_id.to_string();
            Change {
                orders: 1,
                ..Change::default()
            }
        }
        AnyEvent::Order(OrderEvent::Paid(paid)) => {
            remembered.paid_cents = paid.amount_cents.get();
            Change {
                paid_orders: 1,
                paid_cents: remembered.paid_cents,
                ..Change::default()
            }
        }
        // A refund: the order no longer counts as paid.
        AnyEvent::Order(OrderEvent::Cancelled(_)) if remembered.paid_cents > 0 => Change {
            paid_orders: -1,
            paid_cents: -remembered.paid_cents,
            ..Change::default()
        },
        AnyEvent::Order(OrderEvent::Cancelled(_) | OrderEvent::Shipped(_)) => return None,
    })
}

impl ReadModel for Customers {
    const NAME: &'static str = "customers";
    const ABOUT: &'static str =
        "each customer's name with the orders it placed and paid and what it paid";
    const AGGREGATES: &'static [&'static str] = &["customer", "order"];
    const TABLES: &'static str = "
        CREATE TABLE IF NOT EXISTS customers (
            customer_id TEXT   PRIMARY KEY,
            name        TEXT,
            orders      BIGINT NOT NULL DEFAULT 0,
            paid_orders BIGINT NOT NULL DEFAULT 0,
            paid_cents  BIGINT NOT NULL DEFAULT 0
        );";
    type Event = AnyEvent;
    type State = Remembered;

    async fn apply(
        &self,
        tx: &mut PgConnection,
        remembered: &mut Remembered,
        event: &Decoded<AnyEvent>,
    ) -> sqlx::Result<()> {
        let Some(change) = change(remembered, &event.event) else {
            return Ok(());
        };
        sqlx::query(
            "INSERT INTO customers (customer_id, name, orders, paid_orders, paid_cents)
             VALUES ($1, $2, $3, $4, $5)
             ON CONFLICT (customer_id) DO UPDATE
                 SET name = coalesce(EXCLUDED.name, customers.name),
                     orders = customers.orders + EXCLUDED.orders,
                     paid_orders = customers.paid_orders + EXCLUDED.paid_orders,
                     paid_cents = customers.paid_cents + EXCLUDED.paid_cents",
        )
        .bind(&remembered.customer_id)
        .bind(change.name)
        .bind(change.orders)
        .bind(change.paid_orders)
        .bind(change.paid_cents)
        .execute(&mut *tx)
        .await?;
        Ok(())
    }

    async fn read(&self, db: &PgPool) -> sqlx::Result<Value> {
        let rows: Vec<(String, Option<String>, i64, i64, i64)> = sqlx::query_as(
            "SELECT customer_id, name, orders, paid_orders, paid_cents FROM customers
             ORDER BY customer_id",
        )
        .fetch_all(db)
        .await?;
        Ok(document(rows.into_iter().map(|(id, name, orders, paid_orders, paid_cents)| {
            (
                id,
                Row {
                    name,
                    orders,
                    paid_orders,
                    paid_cents,
                },
            )
        })))
    }

    fn expected(&self, events: &[Decoded<AnyEvent>]) -> Value {
        let mut remembered: BTreeMap<uuid::Uuid, Remembered> = BTreeMap::new();
        let mut rows: BTreeMap<String, Row> = BTreeMap::new();
        for event in events {
            let state = remembered.entry(event.aggregate_id).or_default();
            if let Some(change) = change(state, &event.event) {
                let row = rows.entry(state.customer_id.clone()).or_default();
                row.name = change.name.or(row.name.take());
                row.orders += change.orders;
                row.paid_orders += change.paid_orders;
                row.paid_cents += change.paid_cents;
            }
        }
        document(rows)
    }
}

/// The read model as JSON: one object per customer handle, in handle order.
fn document(rows: impl IntoIterator<Item = (String, Row)>) -> Value {
    Value::Array(
        rows.into_iter()
            .map(|(customer_id, row)| {
                json!({
                    "customer_id": customer_id,
                    "name": row.name,
                    "orders": row.orders,
                    "paid_orders": row.paid_orders,
                    "paid_cents": row.paid_cents,
                })
            })
            .collect(),
    )
}

crate::register_model!(Customers);
