//! The demo's script, played against the order service over HTTP: orders placed, paid, shipped and
//! cancelled by a handful of customers, a refused command, an idempotent retry — deterministic, so every
//! run tells the same story.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use anyhow::Context;
use futures::StreamExt;
use reqwest::{Client, StatusCode};
use serde_json::{Value, json};
use uuid::Uuid;

const CUSTOMERS: [&str; 5] = ["alice", "bob", "carol", "dave", "erin"];
const SKUS: [(&str, i64); 5] = [
    ("MUG-BLUE", 1250),
    ("MUG-RED", 1250),
    ("TEA-GREEN", 500),
    ("LAMP", 4900),
    ("BOOK", 1999),
];

/// What the script did, for the summary.
#[derive(Debug, Default)]
pub(crate) struct Played {
    /// Orders placed.
    pub placed: AtomicUsize,
    /// Orders paid.
    pub paid: AtomicUsize,
    /// Orders shipped.
    pub shipped: AtomicUsize,
    /// Orders cancelled (placed or paid).
    pub cancelled: AtomicUsize,
    /// Commands the service refused as the domain requires.
    pub refused: AtomicUsize,
}

/// Talks to the order service.
#[derive(Debug, Clone)]
pub(crate) struct Api {
    client: Client,
    base: String,
}

impl Api {
    /// A client of the service at `base`.
    pub(crate) fn new(base: &str) -> Self {
        Self {
            client: Client::new(),
            base: base.to_owned(),
        }
    }

    /// `POST path` with a JSON body; returns status and body.
    pub(crate) async fn post(
        &self,
        path: &str,
        body: Value,
        idempotency_key: Option<&str>,
    ) -> anyhow::Result<(StatusCode, Value)> {
        let mut request = self.client.post(format!("{}{path}", self.base)).json(&body);
        if let Some(key) = idempotency_key {
            request = request.header("Idempotency-Key", key);
        }
        let response = request
            .send()
            .await
            .with_context(|| format!("POST {path}"))?;
        let status = response.status();
        Ok((status, response.json().await.unwrap_or(Value::Null)))
    }

    /// Places an order and returns its id.
    pub(crate) async fn place(
        &self,
        customer: &str,
        lines: Value,
        idempotency_key: Option<&str>,
    ) -> anyhow::Result<Uuid> {
        let (status, body) = self
            .post(
                "/orders",
                json!({"customer_id": customer, "currency": "EUR", "lines": lines}),
                idempotency_key,
            )
            .await?;
        anyhow::ensure!(
            status == StatusCode::CREATED,
            "placing an order answered {status}: {body}"
        );
        Ok(serde_json::from_value(body["order_id"].clone())?)
    }

    async fn expect(&self, path: &str, body: Value, wanted: StatusCode) -> anyhow::Result<Value> {
        let (status, answer) = self.post(path, body, None).await?;
        anyhow::ensure!(
            status == wanted,
            "POST {path} answered {status}, expected {wanted}: {answer}"
        );
        Ok(answer)
    }
}

/// A deterministic generator, so every demo run places the same orders.
fn mix(i: usize, salt: usize) -> usize {
    (i.wrapping_mul(2_654_435_761) ^ salt.wrapping_mul(40_503)) % 1_000_003
}

/// Plays order `i`'s lifecycle: placed, then (three in four) paid and shipped or cancelled, or (one in
/// four) left placed or cancelled unpaid, with a refused command on the way.
pub(crate) async fn play_one(api: &Api, i: usize, played: &Played) -> anyhow::Result<()> {
    let customer = CUSTOMERS[mix(i, 1) % CUSTOMERS.len()];
    let line_count = 1 + mix(i, 2) % 3;
    let lines: Vec<Value> = (0..line_count)
        .map(|k| {
            let (sku, price) = SKUS[(mix(i, 3) + k) % SKUS.len()];
            json!({"sku": sku, "quantity": 1 + mix(i, 4 + k) % 4, "unit_price_cents": price})
        })
        .collect();
    let total: i64 = lines
        .iter()
        .map(|l| l["quantity"].as_i64().unwrap_or(0) * l["unit_price_cents"].as_i64().unwrap_or(0))
        .sum();
    let id = api.place(customer, json!(lines), None).await?;
    played.placed.fetch_add(1, Ordering::Relaxed);
    let order = format!("/orders/{id}");
    if i % 4 == 3 {
        if i % 8 == 7 {
            api.expect(
                &format!("{order}/cancel"),
                json!({"reason": "found it cheaper"}),
                StatusCode::OK,
            )
            .await?;
            played.cancelled.fetch_add(1, Ordering::Relaxed);
        } else {
            // Shipping an unpaid order is refused, and changes nothing.
            api.expect(
                &format!("{order}/ship"),
                json!({"carrier": "DHL", "tracking_number": "X"}),
                StatusCode::CONFLICT,
            )
            .await?;
            played.refused.fetch_add(1, Ordering::Relaxed);
        }
        return Ok(());
    }
    api.expect(
        &format!("{order}/pay"),
        json!({"amount_cents": total, "payment_ref": format!("psp-{i}")}),
        StatusCode::OK,
    )
    .await?;
    played.paid.fetch_add(1, Ordering::Relaxed);
    if i.is_multiple_of(3) {
        api.expect(
            &format!("{order}/ship"),
            json!({"carrier": "DHL", "tracking_number": format!("JD{i:06}")}),
            StatusCode::OK,
        )
        .await?;
        played.shipped.fetch_add(1, Ordering::Relaxed);
    } else if i % 5 == 1 {
        api.expect(
            &format!("{order}/cancel"),
            json!({"reason": "refund requested"}),
            StatusCode::OK,
        )
        .await?;
        played.cancelled.fetch_add(1, Ordering::Relaxed);
    }
    Ok(())
}

/// Plays `orders` lifecycles, eight at a time.
pub(crate) async fn play(api: &Api, orders: usize, played: Arc<Played>) -> anyhow::Result<()> {
    let results: Vec<anyhow::Result<()>> = futures::stream::iter(0..orders)
        .map(|i| {
            let (api, played) = (api.clone(), played.clone());
            async move { play_one(&api, i, &played).await }
        })
        .buffer_unordered(8)
        .collect()
        .await;
    results.into_iter().collect()
}

/// A client retries a checkout with the same Idempotency-Key: the service answers with the first order.
pub(crate) async fn idempotent_retry(api: &Api) -> anyhow::Result<(Uuid, Uuid)> {
    let key = format!("demo-checkout-{}", Uuid::now_v7());
    let lines = json!([{"sku": "BOOK", "quantity": 1, "unit_price_cents": 1999}]);
    let first = api.place("carol", lines.clone(), Some(&key)).await?;
    let retry = api.place("carol", lines, Some(&key)).await?;
    Ok((first, retry))
}
