//! Inventory: per SKU, units `reserved` by placed or paid orders not yet shipped or cancelled, units
//! `shipped`, and units `released` by cancelled orders.
//!
//! Shipped and cancelled events do not repeat the order's lines, so the projection keeps each order's
//! lines and status from its `order.placed`.

use std::collections::{BTreeMap, HashMap};

use domain::{OrderEvent, OrderStatus};
use serde::{Deserialize, Serialize};
use sqlx::types::Json;
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use crate::decode::Decoded;
use crate::http::{Page, PageParams, Problem, checked};
use crate::projection::{Projection, orders_to_load, parse_status};

/// The inventory projection.
#[derive(Debug, Clone, Copy, Default)]
pub struct Inventory;

/// One SKU's counters.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, sqlx::FromRow)]
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
    status: OrderStatus,
    lines: Vec<(String, i64)>,
}

/// How one batch moves one SKU's counters.
#[derive(Debug, Clone, Copy, Default)]
struct Delta {
    reserved: i64,
    shipped: i64,
    released: i64,
}

#[derive(Debug, sqlx::FromRow)]
struct OrderRow {
    order_id: Uuid,
    status: String,
    lines: Json<Vec<(String, i64)>>,
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

    const AGGREGATES: &'static [&'static str] = &["order"];

    type Event = OrderEvent;

    async fn apply(
        &self,
        tx: &mut PgConnection,
        events: &[Decoded<OrderEvent>],
    ) -> sqlx::Result<()> {
        let mut orders = load_orders(tx, events).await?;
        // Sorted by SKU, so concurrent writers always lock stock rows in the same order.
        let mut deltas: BTreeMap<String, Delta> = BTreeMap::new();
        let mut changed: Vec<Uuid> = Vec::new();
        for decoded in events {
            let id = decoded.aggregate_id;
            let order = orders.get_mut(&id);
            let open = |o: &OrderLines| matches!(o.status, OrderStatus::Placed | OrderStatus::Paid);
            match (&decoded.event, order) {
                (OrderEvent::Placed(placed), _) => {
                    let lines: Vec<(String, i64)> = placed
                        .lines
                        .iter()
                        .map(|l| (l.sku.to_string(), i64::from(l.quantity.get())))
                        .collect();
                    for (sku, quantity) in &lines {
                        deltas.entry(sku.clone()).or_default().reserved += quantity;
                    }
                    orders.insert(
                        id,
                        OrderLines {
                            status: OrderStatus::Placed,
                            lines,
                        },
                    );
                }
                (OrderEvent::Paid(_), Some(order)) if order.status == OrderStatus::Placed => {
                    order.status = OrderStatus::Paid;
                }
                (OrderEvent::Cancelled(_), Some(order)) if open(order) => {
                    for (sku, quantity) in &order.lines {
                        let delta = deltas.entry(sku.clone()).or_default();
                        delta.reserved -= quantity;
                        delta.released += quantity;
                    }
                    order.status = OrderStatus::Cancelled;
                }
                (OrderEvent::Shipped(_), Some(order)) if open(order) => {
                    for (sku, quantity) in &order.lines {
                        let delta = deltas.entry(sku.clone()).or_default();
                        delta.reserved -= quantity;
                        delta.shipped += quantity;
                    }
                    order.status = OrderStatus::Shipped;
                }
                (event, order) => {
                    // Version order makes this unreachable for histories the domain can produce; an
                    // operator's `held release` past a missing version can lead here.
                    tracing::warn!(
                        order_id = %id,
                        event_type = event.event_type(),
                        status = ?order.map(|o| o.status),
                        "event does not change inventory in the order's state"
                    );
                    continue;
                }
            }
            changed.push(id);
        }
        changed.sort();
        changed.dedup();
        save_orders(tx, &orders, &changed).await?;
        save_deltas(tx, &deltas).await
    }
}

async fn load_orders(
    tx: &mut PgConnection,
    events: &[Decoded<OrderEvent>],
) -> sqlx::Result<HashMap<Uuid, OrderLines>> {
    let ids = orders_to_load(events);
    if ids.is_empty() {
        return Ok(HashMap::new());
    }
    let rows: Vec<OrderRow> =
        sqlx::query_as("SELECT order_id, status, lines FROM orders WHERE order_id = ANY($1)")
            .bind(&ids)
            .fetch_all(&mut *tx)
            .await?;
    rows.into_iter()
        .map(|row| {
            Ok((
                row.order_id,
                OrderLines {
                    status: parse_status(&row.status)?,
                    lines: row.lines.0,
                },
            ))
        })
        .collect()
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
    .bind(
        rows.iter()
            .map(|o| o.status.to_string())
            .collect::<Vec<_>>(),
    )
    .bind(
        rows.iter()
            .map(|o| serde_json::json!(o.lines))
            .collect::<Vec<_>>(),
    )
    .execute(&mut *tx)
    .await?;
    Ok(())
}

async fn save_deltas(tx: &mut PgConnection, deltas: &BTreeMap<String, Delta>) -> sqlx::Result<()> {
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
    .bind(deltas.values().map(|d| d.reserved).collect::<Vec<_>>())
    .bind(deltas.values().map(|d| d.shipped).collect::<Vec<_>>())
    .bind(deltas.values().map(|d| d.released).collect::<Vec<_>>())
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// Every SKU's counters, or one SKU's.
pub async fn stock(pool: &PgPool, sku: Option<&str>) -> sqlx::Result<Vec<Stock>> {
    sqlx::query_as(
        "SELECT sku, reserved, shipped, released FROM stock WHERE $1::text IS NULL OR sku = $1 ORDER BY sku",
    )
    .bind(sku)
    .fetch_all(pool)
    .await
}

/// One page of SKUs in SKU order, after `after`.
pub async fn stock_page(
    pool: &PgPool,
    limit: i64,
    after: Option<&str>,
) -> sqlx::Result<Page<Stock>> {
    let rows: Vec<Stock> = sqlx::query_as(
        "SELECT sku, reserved, shipped, released FROM stock WHERE $2::text IS NULL OR sku > $2
         ORDER BY sku LIMIT $1",
    )
    .bind(limit + 1)
    .bind(after)
    .fetch_all(pool)
    .await?;
    Ok(Page::from_rows(rows, limit, |s| s.sku.clone()))
}

/// The read API: `GET /stock[?limit=N&cursor=C]` (a page of SKUs) and `GET /stock/{sku}`.
pub fn routes(pool: PgPool) -> axum::Router {
    use axum::extract::rejection::{PathRejection, QueryRejection};
    use axum::extract::{Path, Query, State};
    use axum::routing::get;
    async fn all(
        State(pool): State<PgPool>,
        params: Result<Query<PageParams>, QueryRejection>,
    ) -> Result<axum::Json<Page<Stock>>, Problem> {
        let Query(params) = params?;
        stock_page(&pool, params.limit()?, params.cursor()?)
            .await
            .map(axum::Json)
            .map_err(|e| Problem::unavailable("reading stock", &e))
    }
    async fn one(
        State(pool): State<PgPool>,
        sku: Result<Path<String>, PathRejection>,
    ) -> Result<axum::Json<Stock>, Problem> {
        let Path(sku) = sku?;
        let mut found = stock(&pool, Some(checked("sku", &sku)?))
            .await
            .map_err(|e| Problem::unavailable("reading stock", &e))?;
        found
            .pop()
            .map(axum::Json)
            .ok_or_else(|| Problem::not_found(format!("no stock recorded for SKU {sku:?}")))
    }
    crate::http::with_fallbacks(
        axum::Router::new()
            .route("/stock", get(all))
            .route("/stock/{sku}", get(one))
            .with_state(pool),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_status_the_projection_stores_reads_back_and_nothing_else_does() {
        for status in [
            OrderStatus::Placed,
            OrderStatus::Paid,
            OrderStatus::Shipped,
            OrderStatus::Cancelled,
        ] {
            assert_eq!(
                parse_status(&status.to_string()).expect("stored status"),
                status
            );
        }
        for corrupt in ["", "Cancelled", "refunded", "paid "] {
            let error = parse_status(corrupt).expect_err("not a status");
            let printed = std::error::Error::source(&error)
                .map(ToString::to_string)
                .unwrap_or_default();
            assert!(
                printed.contains(&format!("{corrupt:?}")),
                "the corrupt value is named: {printed}"
            );
        }
    }
}
