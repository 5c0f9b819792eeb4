//! Search: one document per order — customer, SKUs, status and total — full-text searchable with
//! PostgreSQL's `simple` configuration (no stemming: customer ids and SKUs are tokens, not words).

use std::collections::HashMap;

use domain::OrderEvent;
use serde::Serialize;
use sqlx::{PgConnection, PgPool, Row};
use uuid::Uuid;

use crate::decode::Decoded;
use crate::projection::Projection;

/// The search projection.
#[derive(Debug, Clone, Copy, Default)]
pub struct Search;

/// One order as the search index knows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct OrderDocument {
    /// The order.
    pub order_id: Uuid,
    /// Who placed it.
    pub customer_id: String,
    /// What was ordered.
    pub skus: Vec<String>,
    /// Where it is in its lifecycle.
    pub status: String,
    /// What it costs.
    pub total_cents: i64,
    /// In which currency.
    pub currency: String,
}

impl Projection for Search {
    const NAME: &'static str = "search";

    // The document is generated from the columns, so it can never disagree with them.
    const TABLES: &'static str = "
        CREATE TABLE IF NOT EXISTS orders (
            order_id    UUID        PRIMARY KEY,
            customer_id TEXT        NOT NULL,
            skus        TEXT        NOT NULL,
            status      TEXT        NOT NULL,
            total_cents BIGINT      NOT NULL,
            currency    TEXT        NOT NULL,
            updated_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
            document    TSVECTOR GENERATED ALWAYS AS
                (to_tsvector('simple', customer_id || ' ' || skus || ' ' || status)) STORED
        );
        CREATE INDEX IF NOT EXISTS orders_document ON orders USING GIN (document);";

    async fn apply(&self, tx: &mut PgConnection, events: &[Decoded]) -> sqlx::Result<()> {
        let ids: Vec<Uuid> = events.iter().map(|e| e.order_id.as_uuid()).collect();
        let mut documents = load(tx, &ids).await?;
        let mut changed: Vec<Uuid> = Vec::new();
        for decoded in events {
            let id = decoded.order_id.as_uuid();
            let status = match &decoded.event {
                OrderEvent::Placed(placed) => {
                    documents.insert(
                        id,
                        OrderDocument {
                            order_id: id,
                            customer_id: placed.customer_id.to_string(),
                            skus: placed.lines.iter().map(|l| l.sku.to_string()).collect(),
                            status: "placed".into(),
                            total_cents: placed.total_cents,
                            currency: placed.currency.to_string(),
                        },
                    );
                    changed.push(id);
                    continue;
                }
                OrderEvent::Paid(_) => "paid",
                OrderEvent::Cancelled(_) => "cancelled",
                OrderEvent::Shipped(_) => "shipped",
            };
            if let Some(document) = documents.get_mut(&id) {
                document.status = status.to_owned();
                changed.push(id);
            }
        }
        changed.sort();
        changed.dedup();
        let rows: Vec<&OrderDocument> = changed.iter().filter_map(|id| documents.get(id)).collect();
        if rows.is_empty() {
            return Ok(());
        }
        sqlx::query(
            "INSERT INTO orders (order_id, customer_id, skus, status, total_cents, currency)
             SELECT * FROM UNNEST($1::uuid[], $2::text[], $3::text[], $4::text[], $5::int8[], $6::text[])
             ON CONFLICT (order_id) DO UPDATE SET
                 customer_id = EXCLUDED.customer_id, skus = EXCLUDED.skus, status = EXCLUDED.status,
                 total_cents = EXCLUDED.total_cents, currency = EXCLUDED.currency, updated_at = now()",
        )
        .bind(rows.iter().map(|d| d.order_id).collect::<Vec<_>>())
        .bind(rows.iter().map(|d| d.customer_id.as_str()).collect::<Vec<_>>())
        .bind(rows.iter().map(|d| d.skus.join(" ")).collect::<Vec<_>>())
        .bind(rows.iter().map(|d| d.status.as_str()).collect::<Vec<_>>())
        .bind(rows.iter().map(|d| d.total_cents).collect::<Vec<_>>())
        .bind(rows.iter().map(|d| d.currency.as_str()).collect::<Vec<_>>())
        .execute(&mut *tx)
        .await?;
        Ok(())
    }
}

fn document(row: &sqlx::postgres::PgRow) -> sqlx::Result<OrderDocument> {
    let skus: String = row.try_get("skus")?;
    Ok(OrderDocument {
        order_id: row.try_get("order_id")?,
        customer_id: row.try_get("customer_id")?,
        skus: skus.split_whitespace().map(str::to_owned).collect(),
        status: row.try_get("status")?,
        total_cents: row.try_get("total_cents")?,
        currency: row.try_get("currency")?,
    })
}

async fn load(tx: &mut PgConnection, ids: &[Uuid]) -> sqlx::Result<HashMap<Uuid, OrderDocument>> {
    let rows = sqlx::query(
        "SELECT order_id, customer_id, skus, status, total_cents, currency FROM orders WHERE order_id = ANY($1)",
    )
    .bind(ids)
    .fetch_all(&mut *tx)
    .await?;
    rows.iter()
        .map(|r| Ok((r.try_get("order_id")?, document(r)?)))
        .collect()
}

/// Orders matching `text` (web-search syntax: words, "quoted phrases", `-excluded`, `or`), best first.
pub async fn query(
    pool: &PgPool,
    text: &str,
    limit: i64,
    offset: i64,
) -> sqlx::Result<Vec<OrderDocument>> {
    let rows = sqlx::query(
        "SELECT order_id, customer_id, skus, status, total_cents, currency
         FROM orders, websearch_to_tsquery('simple', $1) AS q
         WHERE document @@ q
         ORDER BY ts_rank(document, q) DESC, updated_at DESC, order_id
         LIMIT $2 OFFSET $3",
    )
    .bind(text)
    .bind(limit)
    .bind(offset.max(0))
    .fetch_all(pool)
    .await?;
    rows.iter().map(document).collect()
}

/// The read API: `GET /search?q=TEXT[&limit=N][&offset=M]` (at most 500 per page).
pub fn routes(pool: PgPool) -> axum::Router {
    use axum::extract::{Query, State};
    use axum::http::StatusCode;
    use axum::routing::get;
    #[derive(serde::Deserialize)]
    struct Params {
        q: String,
        limit: Option<i64>,
        offset: Option<i64>,
    }
    async fn find(
        State(pool): State<PgPool>,
        Query(params): Query<Params>,
    ) -> Result<axum::Json<Vec<OrderDocument>>, StatusCode> {
        let limit = params.limit.unwrap_or(50).clamp(1, 500);
        query(&pool, &params.q, limit, params.offset.unwrap_or(0))
            .await
            .map(axum::Json)
            .map_err(|_| StatusCode::SERVICE_UNAVAILABLE)
    }
    axum::Router::new()
        .route("/search", get(find))
        .with_state(pool)
}
