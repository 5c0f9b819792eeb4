//! Inventory: per SKU, units `reserved` by placed or paid orders not yet shipped or cancelled, units
//! `shipped`, and units `released` by cancelled orders.
//!
//! Shipped and cancelled events do not repeat the order's lines, so the projection keeps each order's
//! lines and status from its `order.placed`.

use std::collections::{BTreeMap, HashMap};

use domain::OrderEvent;
use serde::Serialize;
use sqlx::{PgConnection, PgPool, Row};
use uuid::Uuid;

use crate::decode::Decoded;
use crate::projection::Projection;

/// The inventory projection.
#[derive(Debug, Clone, Copy, Default)]
pub struct Inventory;

/// One SKU's counters.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Stock {
    /// The SKU.
    pub sku: String,
    /// Units in placed or paid orders not yet shipped or cancelled.
    pub reserved: i64,
    /// Units shipped.
    pub shipped: i64,
    /// Units released by cancelled orders.
    pub released: i64,
}

/// What the projection remembers of an order.
#[derive(Debug, Clone)]
struct OrderLines {
    status: &'static str,
    lines: Vec<(String, i64)>,
}

impl Projection for Inventory {
    const NAME: &'static str = "inventory";

    const TABLES: &'static str = "
        CREATE TABLE IF NOT EXISTS stock (
            sku        TEXT        PRIMARY KEY,
            reserved   BIGINT      NOT NULL DEFAULT 0,
            shipped    BIGINT      NOT NULL DEFAULT 0,
            released   BIGINT      NOT NULL DEFAULT 0,
            updated_at TIMESTAMPTZ NOT NULL DEFAULT now()
        );
        CREATE TABLE IF NOT EXISTS orders (
            order_id UUID  PRIMARY KEY,
            status   TEXT  NOT NULL,
            lines    JSONB NOT NULL
        );";

    async fn apply(&self, tx: &mut PgConnection, events: &[Decoded]) -> sqlx::Result<()> {
        let mut orders = load_orders(tx, events).await?;
        // Sorted by SKU, so concurrent writers always lock stock rows in the same order.
        let mut deltas: BTreeMap<String, [i64; 3]> = BTreeMap::new();
        let mut changed: Vec<Uuid> = Vec::new();
        for decoded in events {
            let id = decoded.order_id.as_uuid();
            let order = orders.get_mut(&id);
            let new_status = match (&decoded.event, order) {
                (OrderEvent::Placed(placed), _) => {
                    let lines: Vec<(String, i64)> = placed
                        .lines
                        .iter()
                        .map(|l| (l.sku.to_string(), i64::from(l.quantity.get())))
                        .collect();
                    for (sku, quantity) in &lines {
                        deltas.entry(sku.clone()).or_default()[0] += quantity;
                    }
                    orders.insert(
                        id,
                        OrderLines {
                            status: "placed",
                            lines,
                        },
                    );
                    changed.push(id);
                    continue;
                }
                (OrderEvent::Paid(_), Some(order)) => {
                    order.status = "paid";
                    "paid"
                }
                (OrderEvent::Cancelled(_), Some(order)) if is_open(order.status) => {
                    for (sku, quantity) in &order.lines {
                        let delta = deltas.entry(sku.clone()).or_default();
                        delta[0] -= quantity;
                        delta[2] += quantity;
                    }
                    order.status = "cancelled";
                    "cancelled"
                }
                (OrderEvent::Shipped(_), Some(order)) if is_open(order.status) => {
                    for (sku, quantity) in &order.lines {
                        let delta = deltas.entry(sku.clone()).or_default();
                        delta[0] -= quantity;
                        delta[1] += quantity;
                    }
                    order.status = "shipped";
                    "shipped"
                }
                (event, order) => {
                    // Version order makes this unreachable for histories the domain can produce.
                    tracing::warn!(
                        order_id = %id,
                        event_type = event.event_type(),
                        known = order.is_some(),
                        "event does not change inventory in the order's state"
                    );
                    continue;
                }
            };
            tracing::trace!(order_id = %id, status = new_status, "inventory order updated");
            changed.push(id);
        }
        changed.sort();
        changed.dedup();
        save_orders(tx, &orders, &changed).await?;
        save_deltas(tx, &deltas).await
    }
}

fn is_open(status: &str) -> bool {
    matches!(status, "placed" | "paid")
}

async fn load_orders(
    tx: &mut PgConnection,
    events: &[Decoded],
) -> sqlx::Result<HashMap<Uuid, OrderLines>> {
    let ids: Vec<Uuid> = events.iter().map(|e| e.order_id.as_uuid()).collect();
    let rows = sqlx::query("SELECT order_id, status, lines FROM orders WHERE order_id = ANY($1)")
        .bind(&ids)
        .fetch_all(&mut *tx)
        .await?;
    rows.iter()
        .map(|row| {
            let lines: Vec<(String, i64)> =
                serde_json::from_value(row.try_get("lines")?).unwrap_or_default();
            let status: String = row.try_get("status")?;
            Ok((
                row.try_get("order_id")?,
                OrderLines {
                    status: intern(&status),
                    lines,
                },
            ))
        })
        .collect()
}

fn intern(status: &str) -> &'static str {
    match status {
        "placed" => "placed",
        "paid" => "paid",
        "shipped" => "shipped",
        _ => "cancelled",
    }
}

async fn save_orders(
    tx: &mut PgConnection,
    orders: &HashMap<Uuid, OrderLines>,
    changed: &[Uuid],
) -> sqlx::Result<()> {
    if changed.is_empty() {
        return Ok(());
    }
    let rows: Vec<&OrderLines> = changed.iter().filter_map(|id| orders.get(id)).collect();
    sqlx::query(
        "INSERT INTO orders (order_id, status, lines)
         SELECT * FROM UNNEST($1::uuid[], $2::text[], $3::jsonb[])
         ON CONFLICT (order_id) DO UPDATE SET status = EXCLUDED.status, lines = EXCLUDED.lines",
    )
    .bind(changed)
    .bind(rows.iter().map(|o| o.status).collect::<Vec<_>>())
    .bind(
        rows.iter()
            .map(|o| serde_json::json!(o.lines))
            .collect::<Vec<_>>(),
    )
    .execute(&mut *tx)
    .await?;
    Ok(())
}

async fn save_deltas(
    tx: &mut PgConnection,
    deltas: &BTreeMap<String, [i64; 3]>,
) -> sqlx::Result<()> {
    if deltas.is_empty() {
        return Ok(());
    }
    sqlx::query(
        "INSERT INTO stock (sku, reserved, shipped, released)
         SELECT * FROM UNNEST($1::text[], $2::int8[], $3::int8[], $4::int8[])
         ON CONFLICT (sku) DO UPDATE SET
             reserved = stock.reserved + EXCLUDED.reserved,
             shipped = stock.shipped + EXCLUDED.shipped,
             released = stock.released + EXCLUDED.released,
             updated_at = now()",
    )
    .bind(deltas.keys().collect::<Vec<_>>())
    .bind(deltas.values().map(|d| d[0]).collect::<Vec<_>>())
    .bind(deltas.values().map(|d| d[1]).collect::<Vec<_>>())
    .bind(deltas.values().map(|d| d[2]).collect::<Vec<_>>())
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// Every SKU's counters, or one SKU's.
pub async fn stock(pool: &PgPool, sku: Option<&str>) -> sqlx::Result<Vec<Stock>> {
    let rows = sqlx::query(
        "SELECT sku, reserved, shipped, released FROM stock WHERE $1::text IS NULL OR sku = $1 ORDER BY sku",
    )
    .bind(sku)
    .fetch_all(pool)
    .await?;
    rows.iter()
        .map(|r| {
            Ok(Stock {
                sku: r.try_get("sku")?,
                reserved: r.try_get("reserved")?,
                shipped: r.try_get("shipped")?,
                released: r.try_get("released")?,
            })
        })
        .collect()
}

/// The read API: `GET /stock` (every SKU) and `GET /stock/{sku}`.
pub fn routes(pool: PgPool) -> axum::Router {
    use axum::extract::{Path, State};
    use axum::http::StatusCode;
    use axum::routing::get;
    async fn all(State(pool): State<PgPool>) -> Result<axum::Json<Vec<Stock>>, StatusCode> {
        stock(&pool, None)
            .await
            .map(axum::Json)
            .map_err(|_| StatusCode::SERVICE_UNAVAILABLE)
    }
    async fn one(
        State(pool): State<PgPool>,
        Path(sku): Path<String>,
    ) -> Result<axum::Json<Stock>, StatusCode> {
        let mut found = stock(&pool, Some(&sku))
            .await
            .map_err(|_| StatusCode::SERVICE_UNAVAILABLE)?;
        found.pop().map(axum::Json).ok_or(StatusCode::NOT_FOUND)
    }
    axum::Router::new()
        .route("/stock", get(all))
        .route("/stock/{sku}", get(one))
        .with_state(pool)
}
