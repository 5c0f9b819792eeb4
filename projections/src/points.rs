//! Loyalty points: paying an order earns one point per 100 cents paid; cancelling a paid order takes
//! those points back. A ledger keyed by event id records every change, and each balance is the sum of
//! its ledger — a ledger row that already exists changes nothing, a second line of idempotency.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use domain::OrderEvent;
use serde::Serialize;
use sqlx::{PgConnection, PgPool, Row};
use uuid::Uuid;

use crate::decode::Decoded;
use crate::projection::Projection;

/// Cents per point.
pub const CENTS_PER_POINT: i64 = 100;

/// The points projection.
#[derive(Debug, Clone, Copy, Default)]
pub struct Points;

/// One ledger entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LedgerEntry {
    /// The event that caused it.
    pub event_id: Uuid,
    /// The order.
    pub order_id: Uuid,
    /// Points earned (positive) or taken back (negative).
    pub points: i64,
    /// Why.
    pub reason: String,
    /// When the event happened.
    pub occurred_at: DateTime<Utc>,
}

/// A customer's balance and ledger.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Account {
    /// The customer.
    pub customer_id: String,
    /// Current balance.
    pub balance: i64,
    /// Every change, oldest first.
    pub ledger: Vec<LedgerEntry>,
}

/// A ledger entry about to be written.
struct NewEntry {
    event_id: Uuid,
    customer_id: String,
    order_id: Uuid,
    points: i64,
    reason: &'static str,
    occurred_at: DateTime<Utc>,
}

impl NewEntry {
    fn new(decoded: &Decoded, customer_id: &str, points: i64, reason: &'static str) -> Self {
        Self {
            event_id: decoded.event_id,
            customer_id: customer_id.to_owned(),
            order_id: decoded.order_id.as_uuid(),
            points,
            reason,
            occurred_at: decoded.occurred_at,
        }
    }
}

/// What the projection remembers of an order: whose it is and the points it earned.
#[derive(Debug, Clone)]
struct OrderPoints {
    customer_id: String,
    earned: i64,
}

impl Projection for Points {
    const NAME: &'static str = "points";

    const TABLES: &'static str = "
        CREATE TABLE IF NOT EXISTS balances (
            customer_id TEXT        PRIMARY KEY,
            balance     BIGINT      NOT NULL DEFAULT 0,
            updated_at  TIMESTAMPTZ NOT NULL DEFAULT now()
        );
        CREATE TABLE IF NOT EXISTS ledger (
            event_id    UUID        PRIMARY KEY,
            customer_id TEXT        NOT NULL,
            order_id    UUID        NOT NULL,
            points      BIGINT      NOT NULL,
            reason      TEXT        NOT NULL,
            occurred_at TIMESTAMPTZ NOT NULL
        );
        CREATE INDEX IF NOT EXISTS ledger_by_customer ON ledger (customer_id, occurred_at);
        CREATE TABLE IF NOT EXISTS orders (
            order_id    UUID   PRIMARY KEY,
            customer_id TEXT   NOT NULL,
            earned      BIGINT NOT NULL DEFAULT 0
        );";

    async fn apply(&self, tx: &mut PgConnection, events: &[Decoded]) -> sqlx::Result<()> {
        let mut orders = load_orders(tx, events).await?;
        let mut ledger: Vec<NewEntry> = Vec::new();
        let mut changed: Vec<Uuid> = Vec::new();
        for decoded in events {
            let id = decoded.order_id.as_uuid();
            match &decoded.event {
                OrderEvent::Placed(placed) => {
                    orders.insert(
                        id,
                        OrderPoints {
                            customer_id: placed.customer_id.to_string(),
                            earned: 0,
                        },
                    );
                }
                OrderEvent::Paid(paid) => {
                    let Some(order) = orders.get_mut(&id) else {
                        continue;
                    };
                    let points = paid.amount_cents.get() / CENTS_PER_POINT;
                    order.earned = points;
                    if points != 0 {
                        ledger.push(NewEntry::new(
                            decoded,
                            &order.customer_id,
                            points,
                            "order paid",
                        ));
                    }
                }
                OrderEvent::Cancelled(_) => {
                    let Some(order) = orders.get_mut(&id) else {
                        continue;
                    };
                    if order.earned != 0 {
                        ledger.push(NewEntry::new(
                            decoded,
                            &order.customer_id,
                            -order.earned,
                            "paid order cancelled",
                        ));
                        order.earned = 0;
                    }
                }
                OrderEvent::Shipped(_) => continue,
            }
            changed.push(id);
        }
        changed.sort();
        changed.dedup();
        save_orders(tx, &orders, &changed).await?;
        if ledger.is_empty() {
            return Ok(());
        }
        // Balances move only by the ledger rows this statement actually inserted.
        sqlx::query(
            "WITH inserted AS (
                INSERT INTO ledger (event_id, customer_id, order_id, points, reason, occurred_at)
                SELECT * FROM UNNEST($1::uuid[], $2::text[], $3::uuid[], $4::int8[], $5::text[], $6::timestamptz[])
                ON CONFLICT (event_id) DO NOTHING
                RETURNING customer_id, points
            )
            INSERT INTO balances (customer_id, balance)
            SELECT customer_id, sum(points) FROM inserted GROUP BY customer_id ORDER BY customer_id
            ON CONFLICT (customer_id) DO UPDATE SET balance = balances.balance + EXCLUDED.balance, updated_at = now()",
        )
        .bind(ledger.iter().map(|l| l.event_id).collect::<Vec<_>>())
        .bind(ledger.iter().map(|l| l.customer_id.as_str()).collect::<Vec<_>>())
        .bind(ledger.iter().map(|l| l.order_id).collect::<Vec<_>>())
        .bind(ledger.iter().map(|l| l.points).collect::<Vec<_>>())
        .bind(ledger.iter().map(|l| l.reason).collect::<Vec<_>>())
        .bind(ledger.iter().map(|l| l.occurred_at).collect::<Vec<_>>())
        .execute(&mut *tx)
        .await?;
        Ok(())
    }
}

async fn load_orders(
    tx: &mut PgConnection,
    events: &[Decoded],
) -> sqlx::Result<HashMap<Uuid, OrderPoints>> {
    let ids: Vec<Uuid> = events.iter().map(|e| e.order_id.as_uuid()).collect();
    let rows =
        sqlx::query("SELECT order_id, customer_id, earned FROM orders WHERE order_id = ANY($1)")
            .bind(&ids)
            .fetch_all(&mut *tx)
            .await?;
    rows.iter()
        .map(|r| {
            Ok((
                r.try_get("order_id")?,
                OrderPoints {
                    customer_id: r.try_get("customer_id")?,
                    earned: r.try_get("earned")?,
                },
            ))
        })
        .collect()
}

async fn save_orders(
    tx: &mut PgConnection,
    orders: &HashMap<Uuid, OrderPoints>,
    changed: &[Uuid],
) -> sqlx::Result<()> {
    if changed.is_empty() {
        return Ok(());
    }
    let rows: Vec<&OrderPoints> = changed.iter().filter_map(|id| orders.get(id)).collect();
    sqlx::query(
        "INSERT INTO orders (order_id, customer_id, earned)
         SELECT * FROM UNNEST($1::uuid[], $2::text[], $3::int8[])
         ON CONFLICT (order_id) DO UPDATE SET earned = EXCLUDED.earned",
    )
    .bind(changed)
    .bind(
        rows.iter()
            .map(|o| o.customer_id.as_str())
            .collect::<Vec<_>>(),
    )
    .bind(rows.iter().map(|o| o.earned).collect::<Vec<_>>())
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// Every customer's account (or one customer's), with the ledger.
pub async fn accounts(pool: &PgPool, customer: Option<&str>) -> sqlx::Result<Vec<Account>> {
    let balances = sqlx::query(
        "SELECT customer_id, balance FROM balances WHERE $1::text IS NULL OR customer_id = $1 ORDER BY customer_id",
    )
    .bind(customer)
    .fetch_all(pool)
    .await?;
    let entries = sqlx::query(
        "SELECT customer_id, event_id, order_id, points, reason, occurred_at FROM ledger
         WHERE $1::text IS NULL OR customer_id = $1 ORDER BY customer_id, occurred_at, event_id",
    )
    .bind(customer)
    .fetch_all(pool)
    .await?;
    let mut ledgers: HashMap<String, Vec<LedgerEntry>> = HashMap::new();
    for row in &entries {
        ledgers
            .entry(row.try_get("customer_id")?)
            .or_default()
            .push(LedgerEntry {
                event_id: row.try_get("event_id")?,
                order_id: row.try_get("order_id")?,
                points: row.try_get("points")?,
                reason: row.try_get("reason")?,
                occurred_at: row.try_get("occurred_at")?,
            });
    }
    balances
        .iter()
        .map(|row| {
            let customer_id: String = row.try_get("customer_id")?;
            Ok(Account {
                ledger: ledgers.remove(&customer_id).unwrap_or_default(),
                balance: row.try_get("balance")?,
                customer_id,
            })
        })
        .collect()
}

/// The read API: `GET /customers` (every account) and `GET /customers/{id}` (balance and ledger).
pub fn routes(pool: PgPool) -> axum::Router {
    use axum::extract::{Path, State};
    use axum::http::StatusCode;
    use axum::routing::get;
    async fn all(State(pool): State<PgPool>) -> Result<axum::Json<Vec<Account>>, StatusCode> {
        accounts(&pool, None)
            .await
            .map(axum::Json)
            .map_err(|_| StatusCode::SERVICE_UNAVAILABLE)
    }
    async fn one(
        State(pool): State<PgPool>,
        Path(id): Path<String>,
    ) -> Result<axum::Json<Account>, StatusCode> {
        let mut found = accounts(&pool, Some(&id))
            .await
            .map_err(|_| StatusCode::SERVICE_UNAVAILABLE)?;
        found.pop().map(axum::Json).ok_or(StatusCode::NOT_FOUND)
    }
    axum::Router::new()
        .route("/customers", get(all))
        .route("/customers/{id}", get(one))
        .with_state(pool)
}
