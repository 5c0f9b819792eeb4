//! Revenue per currency and UTC day: what was paid that day, what was refunded that day (a paid
//! order cancelled), and the difference. The README's "Add a projection" walks through this file.

use std::collections::BTreeMap;

use domain::OrderEvent;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use sqlx::{PgConnection, PgPool};

use crate::decode::Decoded;
use crate::kit::ReadModel;

/// The model (a unit struct: it keeps nothing in memory; its state is in its schema).
#[derive(Debug, Clone, Copy)]
pub struct Revenue;

/// What it remembers of each order: its currency, and what was paid for it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Order {
    currency: String,
    paid_cents: i64,
}

impl ReadModel for Revenue {
    const NAME: &'static str = "revenue";
    const ABOUT: &'static str =
        "revenue per currency and UTC day: paid, refunded (paid orders cancelled) and net";
    const AGGREGATES: &'static [&'static str] = &["order"];
    const TABLES: &'static str = "
        CREATE TABLE IF NOT EXISTS revenue (
            currency       TEXT   NOT NULL,
            day            DATE   NOT NULL,
            paid_cents     BIGINT NOT NULL DEFAULT 0,
            refunded_cents BIGINT NOT NULL DEFAULT 0,
            PRIMARY KEY (currency, day)
        );";
    type Event = OrderEvent;
    type State = Order;

    async fn apply(
        &self,
        tx: &mut PgConnection,
        order: &mut Order,
        event: &Decoded<OrderEvent>,
    ) -> sqlx::Result<()> {
        let (paid, refunded) = match &event.event {
            OrderEvent::Placed(placed) => {
                order.currency = placed.currency.to_string();
                return Ok(());
            }
            OrderEvent::Paid(paid) => {
                order.paid_cents = paid.amount_cents.get();
                (order.paid_cents, 0)
            }
            // A cancelled paid order is a refund of what was paid, on the day of the cancel.
            OrderEvent::Cancelled(_) if order.paid_cents > 0 => (0, order.paid_cents),
            OrderEvent::Cancelled(_) | OrderEvent::Shipped(_) => return Ok(()),
        };
        sqlx::query(
            "INSERT INTO revenue (currency, day, paid_cents, refunded_cents)
             VALUES ($1, ($2 AT TIME ZONE 'UTC')::date, $3, $4)
             ON CONFLICT (currency, day) DO UPDATE
                 SET paid_cents = revenue.paid_cents + EXCLUDED.paid_cents,
                     refunded_cents = revenue.refunded_cents + EXCLUDED.refunded_cents",
        )
        .bind(&order.currency)
        .bind(event.occurred_at)
        .bind(paid)
        .bind(refunded)
        .execute(&mut *tx)
        .await?;
        Ok(())
    }

    async fn read(&self, db: &PgPool) -> sqlx::Result<Value> {
        let rows: Vec<(String, chrono::NaiveDate, i64, i64)> = sqlx::query_as(
            "SELECT currency, day, paid_cents, refunded_cents FROM revenue ORDER BY currency, day",
        )
        .fetch_all(db)
        .await?;
        Ok(document(rows.into_iter().map(|(c, d, p, r)| ((c, d), (p, r)))))
    }

    fn expected(&self, events: &[Decoded<OrderEvent>]) -> Value {
        let mut orders: BTreeMap<uuid::Uuid, Order> = BTreeMap::new();
        let mut days: BTreeMap<(String, chrono::NaiveDate), (i64, i64)> = BTreeMap::new();
        for event in events {
            let order = orders.entry(event.aggregate_id).or_default();
            let day = (order.currency.clone(), event.occurred_at.date_naive());
            match &event.event {
                OrderEvent::Placed(placed) => order.currency = placed.currency.to_string(),
                OrderEvent::Paid(paid) => {
                    order.paid_cents = paid.amount_cents.get();
                    days.entry(day).or_default().0 += order.paid_cents;
                }
                OrderEvent::Cancelled(_) if order.paid_cents > 0 => {
                    days.entry(day).or_default().1 += order.paid_cents;
                }
                OrderEvent::Cancelled(_) | OrderEvent::Shipped(_) => {}
            }
        }
        document(days)
    }
}

/// The read model as JSON: one row per currency and day, in that order.
fn document(
    rows: impl IntoIterator<Item = ((String, chrono::NaiveDate), (i64, i64))>,
) -> Value {
    Value::Array(
        rows.into_iter()
            .map(|((currency, day), (paid, refunded))| {
                json!({
                    "currency": currency,
                    "day": day.to_string(),
                    "paid_cents": paid,
                    "refunded_cents": refunded,
                    "net_cents": paid - refunded,
                })
            })
            .collect(),
    )
}

crate::register_model!(Revenue);
