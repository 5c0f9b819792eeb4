//! Search: one document per order — customer, SKUs, status and total — full-text searchable with
//! PostgreSQL's `simple` configuration (no stemming: customer ids and SKUs are tokens, not words).

use std::collections::HashMap;

use domain::{OrderEvent, OrderStatus};
use serde::Serialize;
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use crate::decode::Decoded;
use crate::http::{Page, PageParams, Problem, checked};
use crate::projection::{Projection, orders_to_load, parse_status};

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
    pub status: OrderStatus,
    /// What it costs.
    pub total_cents: i64,
    /// In which currency.
    pub currency: String,
}

impl Projection for Search {
    const NAME: &'static str = "search";

    // The document is generated from the columns, so it can never disagree with them. Its GIN index
    // takes each new document at once (`fastupdate = off`): with the default pending list, the insert
    // that found the list full merged all of it (4 MB, about 40,000 entries) into the index inside its
    // own transaction, and that batch's orders waited ~150 ms — the largest stalls of the pipeline
    // benchmark. Indexes created before are switched over (a no-op once done; a role that does not own
    // the index gets a warning, not a failure to start).
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
        CREATE INDEX IF NOT EXISTS orders_document ON orders USING GIN (document)
            WITH (fastupdate = off);
        DO $$ BEGIN
            IF NOT EXISTS (SELECT 1 FROM pg_class WHERE oid = to_regclass('orders_document')
                           AND 'fastupdate=off' = ANY (coalesce(reloptions, '{}'))) THEN
                ALTER INDEX orders_document SET (fastupdate = off);
            END IF;
        EXCEPTION WHEN insufficient_privilege THEN
            RAISE WARNING 'the search index keeps its pending list (occasional ~100 ms stalls): only its owner can run ALTER INDEX orders_document SET (fastupdate = off)';
        END $$;";

    const AGGREGATES: &'static [&'static str] = &["order"];

    type Event = OrderEvent;

    async fn apply(
        &self,
        tx: &mut PgConnection,
        events: &[Decoded<OrderEvent>],
    ) -> sqlx::Result<()> {
        let mut documents = load(tx, &orders_to_load(events)).await?;
        let mut changed: Vec<Uuid> = Vec::new();
        for decoded in events {
            let id = decoded.aggregate_id;
            let status = match &decoded.event {
                OrderEvent::Placed(placed) => {
                    documents.insert(
                        id,
                        OrderDocument {
                            order_id: id,
                            customer_id: placed.customer_id.to_string(),
                            skus: placed.lines.iter().map(|l| l.sku.to_string()).collect(),
                            status: OrderStatus::Placed,
                            total_cents: placed.total_cents,
                            currency: placed.currency.to_string(),
                        },
                    );
                    changed.push(id);
                    continue;
                }
                OrderEvent::Paid(_) => OrderStatus::Paid,
                OrderEvent::Cancelled(_) => OrderStatus::Cancelled,
                OrderEvent::Shipped(_) => OrderStatus::Shipped,
            };
            if let Some(document) = documents.get_mut(&id) {
                document.status = status;
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
        .bind(rows.iter().map(|d| d.status.to_string()).collect::<Vec<_>>())
        .bind(rows.iter().map(|d| d.total_cents).collect::<Vec<_>>())
        .bind(rows.iter().map(|d| d.currency.as_str()).collect::<Vec<_>>())
        .execute(&mut *tx)
        .await?;
        Ok(())
    }
}

#[derive(Debug, sqlx::FromRow)]
struct DocumentRow {
    order_id: Uuid,
    customer_id: String,
    skus: String,
    status: String,
    total_cents: i64,
    currency: String,
}

impl TryFrom<DocumentRow> for OrderDocument {
    type Error = sqlx::Error;
    fn try_from(row: DocumentRow) -> sqlx::Result<Self> {
        Ok(Self {
            order_id: row.order_id,
            customer_id: row.customer_id,
            skus: row.skus.split_whitespace().map(str::to_owned).collect(),
            status: parse_status(&row.status)?,
            total_cents: row.total_cents,
            currency: row.currency,
        })
    }
}

async fn load(tx: &mut PgConnection, ids: &[Uuid]) -> sqlx::Result<HashMap<Uuid, OrderDocument>> {
    if ids.is_empty() {
        return Ok(HashMap::new());
    }
    let rows: Vec<DocumentRow> = sqlx::query_as(
        "SELECT order_id, customer_id, skus, status, total_cents, currency FROM orders WHERE order_id = ANY($1)",
    )
    .bind(ids)
    .fetch_all(&mut *tx)
    .await?;
    rows.into_iter()
        .map(|r| Ok((r.order_id, OrderDocument::try_from(r)?)))
        .collect()
}

/// Orders matching `text` (web-search syntax: words, "quoted phrases", `-excluded`, `or`), best first.
pub async fn query(
    pool: &PgPool,
    text: &str,
    limit: i64,
    offset: i64,
) -> sqlx::Result<Vec<OrderDocument>> {
    let rows: Vec<DocumentRow> = sqlx::query_as(
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
    rows.into_iter().map(OrderDocument::try_from).collect()
}

/// The read API: `GET /search?q=TEXT[&limit=N][&cursor=C]`. Results are ranked, so the cursor carries
/// the position of the next page in the ranking; a document updated between two pages may move.
pub fn routes(pool: PgPool) -> axum::Router {
    use axum::extract::rejection::QueryRejection;
    use axum::extract::{Query, State};
    use axum::routing::get;
    #[derive(serde::Deserialize)]
    struct Params {
        q: Option<String>,
        // Not a flattened `PageParams`: serde_urlencoded cannot parse numbers inside a flatten.
        limit: Option<i64>,
        cursor: Option<String>,
    }
    async fn find(
        State(pool): State<PgPool>,
        params: Result<Query<Params>, QueryRejection>,
    ) -> Result<axum::Json<Page<OrderDocument>>, Problem> {
        let Query(params) = params?;
        let page = PageParams {
            limit: params.limit,
            cursor: params.cursor,
        };
        let text = checked("q", params.q.as_deref().unwrap_or_default())?;
        if text.trim().is_empty() {
            return Err(Problem::bad_request(
                "q, the text to search for, is missing or empty",
            ));
        }
        let limit = page.limit()?;
        let offset = match page.cursor()? {
            None => 0,
            Some(cursor) => cursor
                .parse::<i64>()
                .ok()
                .filter(|o| *o >= 0)
                .ok_or_else(|| {
                    Problem::bad_request(format!("cursor {cursor:?} is not a search cursor"))
                })?,
        };
        let rows = query(&pool, text, limit + 1, offset)
            .await
            .map_err(|e| Problem::unavailable("searching", &e))?;
        let mut found = Page::from_rows(rows, limit, |_| String::new());
        if found.next_cursor.is_some() {
            found.next_cursor = Some((offset + limit).to_string());
        }
        Ok(axum::Json(found))
    }
    crate::http::with_fallbacks(
        axum::Router::new()
            .route("/search", get(find))
            .with_state(pool),
    )
}
