//! The lab's one HTTP client. Every tool — the demo's story and its checks, the bench's load, chaos's
//! lifecycles, the fleets' health checks — talks to the order service, the console, the projections'
//! read APIs and `/health` through [`Http`], and sends the order service's commands through
//! [`Orders`]: one place that knows the API's paths, bodies and answer headers, and one client whose
//! timeouts make a frozen process a timeout, never a hang.

use std::time::Duration;

use anyhow::Context;
use reqwest::{Client, StatusCode};
use serde_json::{Value, json};
use uuid::Uuid;

/// How long one request may take unless a tool says otherwise: long enough for a loaded machine's
/// slowest honest answer, short enough that a frozen service is noticed.
pub(crate) const TIMEOUT: Duration = Duration::from_secs(10);
/// How long connecting may take: a service that is down refuses at once, a frozen one never answers.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// An HTTP client with the lab's timeouts; clones share its connections.
#[derive(Debug, Clone)]
pub(crate) struct Http {
    client: Client,
}

impl Default for Http {
    fn default() -> Self {
        Self::with_timeout(TIMEOUT)
    }
}

impl Http {
    /// A client whose requests give up after `timeout`.
    pub(crate) fn with_timeout(timeout: Duration) -> Self {
        let client = Client::builder()
            .timeout(timeout)
            .connect_timeout(CONNECT_TIMEOUT.min(timeout))
            .build()
            .expect("a client without TLS or proxies builds");
        Self { client }
    }

    /// `GET url` answering 2xx, its body as JSON.
    pub(crate) async fn get_json(&self, url: &str) -> anyhow::Result<Value> {
        let response = self
            .client
            .get(url)
            .send()
            .await
            .and_then(reqwest::Response::error_for_status)
            .with_context(|| format!("GET {url}"))?;
        response
            .json()
            .await
            .with_context(|| format!("GET {url}: the answer is not JSON"))
    }

    /// True when `GET url` answers 2xx now.
    pub(crate) async fn answers(&self, url: &str) -> bool {
        self.client
            .get(url)
            .send()
            .await
            .is_ok_and(|r| r.status().is_success())
    }

    /// `POST url` with a JSON body (and an `Idempotency-Key` when given); the answer read whole.
    /// `Err` only when no answer came (refused, timed out, cut off).
    pub(crate) async fn post(
        &self,
        url: &str,
        body: &Value,
        idempotency_key: Option<&str>,
    ) -> Result<Answer, reqwest::Error> {
        let mut request = self.client.post(url).json(body);
        if let Some(key) = idempotency_key {
            request = request.header("Idempotency-Key", key);
        }
        let response = request.send().await?;
        let header = |name: &str| {
            response
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        let event_id = header("event-id").and_then(|v| Uuid::parse_str(&v).ok());
        let replayed = header("idempotent-replayed").is_some_and(|v| v == "true");
        let status = response.status();
        // An answer cut off mid-body reads as `null`: the caller sees a success it cannot use and
        // asks again under the same key.
        let body = response.json().await.unwrap_or(Value::Null);
        Ok(Answer {
            status,
            event_id,
            replayed,
            body,
        })
    }
}

/// What the order service answered to a command.
#[derive(Debug, Clone)]
pub(crate) struct Answer {
    pub status: StatusCode,
    /// The `Event-Id` header: the event the command appended (or, replayed, had appended).
    pub event_id: Option<Uuid>,
    /// `Idempotent-Replayed: true`: the answer of an earlier request under the same key.
    pub replayed: bool,
    /// The body as JSON (`null` when it was not JSON or did not arrive whole).
    pub body: Value,
}

impl Answer {
    /// The order the answer is about (`order_id` of its body).
    pub(crate) fn order_id(&self) -> Option<Uuid> {
        self.body["order_id"]
            .as_str()
            .and_then(|v| Uuid::parse_str(v).ok())
    }
}

/// The order service's commands, at `base` (`http://host:port`).
#[derive(Debug, Clone)]
pub(crate) struct Orders {
    http: Http,
    base: String,
}

impl Orders {
    /// The service at `base`, called through `http`.
    pub(crate) fn new(base: &str, http: Http) -> Self {
        Self {
            http,
            base: base.trim_end_matches('/').to_owned(),
        }
    }

    /// `POST path` (e.g. `/orders`, `/orders/{id}/pay`) with `body`.
    pub(crate) async fn post(
        &self,
        path: &str,
        body: &Value,
        idempotency_key: Option<&str>,
    ) -> Result<Answer, reqwest::Error> {
        self.http
            .post(&format!("{}{path}", self.base), body, idempotency_key)
            .await
    }

    /// Places an order (201 expected) and returns its id.
    pub(crate) async fn place(
        &self,
        customer: &str,
        lines: Value,
        idempotency_key: Option<&str>,
    ) -> anyhow::Result<Uuid> {
        let answer = self
            .post("/orders", &place(customer, lines), idempotency_key)
            .await
            .context("POST /orders")?;
        anyhow::ensure!(
            answer.status == StatusCode::CREATED,
            "placing an order answered {}: {}",
            answer.status,
            answer.body
        );
        answer
            .order_id()
            .with_context(|| format!("a placed order's answer has no order_id: {}", answer.body))
    }

    /// `POST path` that must answer `wanted`; its body.
    pub(crate) async fn expect(
        &self,
        path: &str,
        body: &Value,
        wanted: StatusCode,
    ) -> anyhow::Result<Value> {
        let answer = self
            .post(path, body, None)
            .await
            .with_context(|| format!("POST {path}"))?;
        anyhow::ensure!(
            answer.status == wanted,
            "POST {path} answered {}, expected {wanted}: {}",
            answer.status,
            answer.body
        );
        Ok(answer.body)
    }
}

/// The body of `POST /orders`: `customer` buys `lines` (`[{sku, quantity, unit_price_cents}]`) in
/// euros.
pub(crate) fn place(customer: &str, lines: Value) -> Value {
    json!({"customer_id": customer, "currency": "EUR", "lines": lines})
}

/// One line of an order.
pub(crate) fn line(sku: &str, quantity: i64, unit_price_cents: i64) -> Value {
    json!({"sku": sku, "quantity": quantity, "unit_price_cents": unit_price_cents})
}

/// The body of `POST /orders/{id}/pay`.
pub(crate) fn pay(amount_cents: i64, payment_ref: &str) -> Value {
    json!({"amount_cents": amount_cents, "payment_ref": payment_ref})
}

/// The body of `POST /orders/{id}/ship`.
pub(crate) fn ship(carrier: &str, tracking_number: &str) -> Value {
    json!({"carrier": carrier, "tracking_number": tracking_number})
}

/// The body of `POST /orders/{id}/cancel`.
pub(crate) fn cancel(reason: &str) -> Value {
    json!({"reason": reason})
}
