//! The demo's script, played against the order service over HTTP: orders placed, paid, shipped and
//! cancelled by a handful of customers, a refused command, an idempotent retry — deterministic, so every
//! run tells the same story.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use futures::StreamExt;
use reqwest::StatusCode;
use serde_json::{Value, json};
use uuid::Uuid;

use crate::http::{self, Orders};

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

/// A deterministic generator, so every demo run places the same orders.
fn mix(i: usize, salt: usize) -> usize {
    (i.wrapping_mul(2_654_435_761) ^ salt.wrapping_mul(40_503)) % 1_000_003
}

/// Plays order `i`'s lifecycle: placed, then (three in four) paid and shipped or cancelled, or (one in
/// four) left placed or cancelled unpaid, with a refused command on the way.
pub(crate) async fn play_one(api: &Orders, i: usize, played: &Played) -> anyhow::Result<()> {
    let customer = CUSTOMERS[mix(i, 1) % CUSTOMERS.len()];
    let line_count = 1 + mix(i, 2) % 3;
    let lines: Vec<Value> = (0..line_count)
        .map(|k| {
            let (sku, price) = SKUS[(mix(i, 3) + k) % SKUS.len()];
            let quantity = i64::try_from(1 + mix(i, 4 + k) % 4).expect("at most 4");
            http::line(sku, quantity, price)
        })
        .collect();
    let total: i64 = lines
        .iter()
        .map(|l| l["quantity"].as_i64().unwrap_or(0) * l["unit_price_cents"].as_i64().unwrap_or(0))
        .sum();
    let id = api.place(customer, Value::Array(lines), None).await?;
    played.placed.fetch_add(1, Ordering::Relaxed);
    let order = format!("/orders/{id}");
    if i % 4 == 3 {
        if i % 8 == 7 {
            api.expect(
                &format!("{order}/cancel"),
                &http::cancel("found it cheaper"),
                StatusCode::OK,
            )
            .await?;
            played.cancelled.fetch_add(1, Ordering::Relaxed);
        } else {
            // Shipping an unpaid order is refused, and changes nothing.
            api.expect(
                &format!("{order}/ship"),
                &http::ship("DHL", "X"),
                StatusCode::CONFLICT,
            )
            .await?;
            played.refused.fetch_add(1, Ordering::Relaxed);
        }
        return Ok(());
    }
    api.expect(
        &format!("{order}/pay"),
        &http::pay(total, &format!("psp-{i}")),
        StatusCode::OK,
    )
    .await?;
    played.paid.fetch_add(1, Ordering::Relaxed);
    if i.is_multiple_of(3) {
        api.expect(
            &format!("{order}/ship"),
            &http::ship("DHL", &format!("JD{i:06}")),
            StatusCode::OK,
        )
        .await?;
        played.shipped.fetch_add(1, Ordering::Relaxed);
    } else if i % 5 == 1 {
        api.expect(
            &format!("{order}/cancel"),
            &http::cancel("refund requested"),
            StatusCode::OK,
        )
        .await?;
        played.cancelled.fetch_add(1, Ordering::Relaxed);
    }
    Ok(())
}

/// Plays `orders` lifecycles, eight at a time.
pub(crate) async fn play(api: &Orders, orders: usize, played: Arc<Played>) -> anyhow::Result<()> {
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
pub(crate) async fn idempotent_retry(api: &Orders) -> anyhow::Result<(Uuid, Uuid)> {
    let key = format!("demo-checkout-{}", Uuid::now_v7());
    let lines = json!([http::line("BOOK", 1, 1999)]);
    let first = api.place("carol", lines.clone(), Some(&key)).await?;
    let retry = api.place("carol", lines, Some(&key)).await?;
    Ok((first, retry))
}
