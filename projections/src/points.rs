//! Loyalty points: paying an order earns one point per 100 cents paid; cancelling a paid order takes
//! those points back. A ledger keyed by event id records every change, and each balance is the sum of
//! its ledger — a ledger row that already exists changes nothing, a second line of idempotency.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use domain::OrderEvent;
use serde::Serialize;
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use crate::decode::Decoded;
use crate::http::{Page, PageParams, Problem, checked};
use crate::projection::{Projection, orders_to_load};

/// Cents per point.
pub const CENTS_PER_POINT: i64 = 100;

/// The points projection.
#[derive(Debug, Clone, Copy, Default)]
pub struct Points;

/// One ledger entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize, sqlx::FromRow)]
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

/// A customer's balance (without the ledger), as lists show it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize, sqlx::FromRow)]
pub struct Balance {
    /// The customer.
    pub customer_id: String,
    /// Current balance.
    pub balance: i64,
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
    fn new(
        decoded: &Decoded<OrderEvent>,
        customer_id: &str,
        points: i64,
        reason: &'static str,
    ) -> Self {
        Self {
            event_id: decoded.event_id,
            customer_id: customer_id.to_owned(),
            order_id: decoded.aggregate_id,
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

    const AGGREGATES: &'static [&'static str] = &["order"];

    type Event = OrderEvent;

    async fn apply(
        &self,
        tx: &mut PgConnection,
        events: &[Decoded<OrderEvent>],
    ) -> sqlx::Result<()> {
        let mut orders = load_orders(tx, events).await?;
        let mut ledger: Vec<NewEntry> = Vec::new();
        let mut changed: Vec<Uuid> = Vec::new();
        for decoded in events {
            let id = decoded.aggregate_id;
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

#[derive(Debug, sqlx::FromRow)]
struct OrderRow {
    order_id: Uuid,
    customer_id: String,
    earned: i64,
}

async fn load_orders(
    tx: &mut PgConnection,
    events: &[Decoded<OrderEvent>],
) -> sqlx::Result<HashMap<Uuid, OrderPoints>> {
    let ids = orders_to_load(events);
    if ids.is_empty() {
        return Ok(HashMap::new());
    }
    let rows: Vec<OrderRow> =
        sqlx::query_as("SELECT order_id, customer_id, earned FROM orders WHERE order_id = ANY($1)")
            .bind(&ids)
            .fetch_all(&mut *tx)
            .await?;
    Ok(rows
        .into_iter()
        .map(|r| {
            (
                r.order_id,
                OrderPoints {
                    customer_id: r.customer_id,
                    earned: r.earned,
                },
            )
        })
        .collect())
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
    let balances: Vec<Balance> = sqlx::query_as(
        "SELECT customer_id, balance FROM balances WHERE $1::text IS NULL OR customer_id = $1 ORDER BY customer_id",
    )
    .bind(customer)
    .fetch_all(pool)
    .await?;
    #[derive(sqlx::FromRow)]
    struct Row {
        customer_id: String,
        #[sqlx(flatten)]
        entry: LedgerEntry,
    }
    let entries: Vec<Row> = sqlx::query_as(
        "SELECT customer_id, event_id, order_id, points, reason, occurred_at FROM ledger
         WHERE $1::text IS NULL OR customer_id = $1 ORDER BY customer_id, occurred_at, event_id",
    )
    .bind(customer)
    .fetch_all(pool)
    .await?;
    let mut ledgers: HashMap<String, Vec<LedgerEntry>> = HashMap::new();
    for row in entries {
        ledgers.entry(row.customer_id).or_default().push(row.entry);
    }
    Ok(balances
        .into_iter()
        .map(|b| Account {
            ledger: ledgers.remove(&b.customer_id).unwrap_or_default(),
            balance: b.balance,
            customer_id: b.customer_id,
        })
        .collect())
}

/// One page of balances in customer order, after `after`.
pub async fn balance_page(
    pool: &PgPool,
    limit: i64,
    after: Option<&str>,
) -> sqlx::Result<Page<Balance>> {
    let rows: Vec<Balance> = sqlx::query_as(
        "SELECT customer_id, balance FROM balances WHERE $2::text IS NULL OR customer_id > $2
         ORDER BY customer_id LIMIT $1",
    )
    .bind(limit + 1)
    .bind(after)
    .fetch_all(pool)
    .await?;
    Ok(Page::from_rows(rows, limit, |b| b.customer_id.clone()))
}

/// One customer's balance and one page of its ledger (oldest first; the cursor is the last entry's
/// event id).
pub async fn account_page(
    pool: &PgPool,
    customer: &str,
    limit: i64,
    after: Option<Uuid>,
) -> sqlx::Result<Option<(Balance, Page<LedgerEntry>)>> {
    let balance: Option<Balance> =
        sqlx::query_as("SELECT customer_id, balance FROM balances WHERE customer_id = $1")
            .bind(customer)
            .fetch_optional(pool)
            .await?;
    let Some(balance) = balance else {
        return Ok(None);
    };
    let rows: Vec<LedgerEntry> = sqlx::query_as(
        "SELECT event_id, order_id, points, reason, occurred_at FROM ledger
         WHERE customer_id = $1
           AND ($3::uuid IS NULL OR (occurred_at, event_id) >
                (SELECT occurred_at, event_id FROM ledger WHERE event_id = $3))
         ORDER BY occurred_at, event_id LIMIT $2",
    )
    .bind(customer)
    .bind(limit + 1)
    .bind(after)
    .fetch_all(pool)
    .await?;
    Ok(Some((
        balance,
        Page::from_rows(rows, limit, |e| e.event_id.to_string()),
    )))
}

/// The read API: `GET /customers[?limit=N&cursor=C]` (a page of balances) and
/// `GET /customers/{id}[?limit=N&cursor=C]` (the balance and a page of the ledger).
pub fn routes(pool: PgPool) -> axum::Router {
    use axum::extract::rejection::{PathRejection, QueryRejection};
    use axum::extract::{Path, Query, State};
    use axum::routing::get;
    #[derive(Serialize)]
    struct AccountPage {
        customer_id: String,
        balance: i64,
        ledger: Page<LedgerEntry>,
    }
    async fn all(
        State(pool): State<PgPool>,
        params: Result<Query<PageParams>, QueryRejection>,
    ) -> Result<axum::Json<Page<Balance>>, Problem> {
        let Query(params) = params?;
        balance_page(&pool, params.limit()?, params.cursor()?)
            .await
            .map(axum::Json)
            .map_err(|e| Problem::unavailable("reading balances", &e))
    }
    async fn one(
        State(pool): State<PgPool>,
        id: Result<Path<String>, PathRejection>,
        params: Result<Query<PageParams>, QueryRejection>,
    ) -> Result<axum::Json<AccountPage>, Problem> {
        let Path(id) = id?;
        let Query(params) = params?;
        let after = params
            .cursor()?
            .map(|c| {
                Uuid::parse_str(c).map_err(|_| {
                    Problem::bad_request(format!("cursor {c:?} is not a ledger cursor"))
                })
            })
            .transpose()?;
        let found = account_page(&pool, checked("customer id", &id)?, params.limit()?, after)
            .await
            .map_err(|e| Problem::unavailable("reading an account", &e))?;
        let (balance, ledger) =
            found.ok_or_else(|| Problem::not_found(format!("no account for customer {id:?}")))?;
        Ok(axum::Json(AccountPage {
            customer_id: balance.customer_id,
            balance: balance.balance,
            ledger,
        }))
    }
    crate::http::with_fallbacks(
        axum::Router::new()
            .route("/customers", get(all))
            .route("/customers/{id}", get(one))
            .with_state(pool),
    )
}
