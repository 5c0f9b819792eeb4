//! The HTTP order service against a running `waybill serve` on a real PostgreSQL: every status it
//! promises, idempotency keys, ETag/If-Match, problem details, and an OpenAPI document that matches
//! the routes.

use std::time::Duration;

use reqwest::{Response, StatusCode};
use serde_json::{Value, json};
use sqlx::PgPool;
use uuid::Uuid;

mod common;

use common::Service;

impl Service {
    async fn start(pool: &PgPool) -> Self {
        Self::start_with(pool, &[]).await
    }

    async fn scrape(&self) -> String {
        self.client
            .get(format!("{}/metrics", self.metrics))
            .send()
            .await
            .expect("scrape")
            .text()
            .await
            .expect("text")
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    async fn post(&self, path: &str, body: Value) -> Response {
        self.client
            .post(self.url(path))
            .json(&body)
            .send()
            .await
            .expect("request")
    }

    async fn place(&self, lines: Value) -> (String, Response) {
        let response = self
            .post(
                "/orders",
                json!({"customer_id": "alice", "currency": "EUR", "lines": lines}),
            )
            .await;
        assert_eq!(response.status(), StatusCode::CREATED);
        let body: Value = response.json().await.expect("json");
        let id = body["order_id"].as_str().expect("order_id").to_owned();
        let again = self
            .client
            .get(self.url(&format!("/orders/{id}")))
            .send()
            .await
            .expect("get");
        (id, again)
    }
}

async fn problem(response: Response, status: StatusCode, needle: &str) -> Value {
    assert_eq!(response.status(), status, "{:?}", response.headers());
    let content_type = response
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap_or("").to_owned());
    assert_eq!(content_type.as_deref(), Some("application/problem+json"));
    let body: Value = response.json().await.expect("problem json");
    assert_eq!(body["status"], status.as_u16());
    let detail = body["detail"].as_str().unwrap_or("").to_owned();
    assert!(
        detail.contains(needle),
        "detail {detail:?} should mention {needle:?}"
    );
    body
}

async fn events(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM events")
        .fetch_one(pool)
        .await
        .expect("count")
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn an_order_is_placed_read_and_moved_through_its_lifecycle(pool: PgPool) {
    let s = Service::start(&pool).await;
    let placed = s.post("/orders", json!({"customer_id": "alice", "currency": "EUR", "lines": [{"sku": "MUG", "quantity": 2, "unit_price_cents": 1250}]})).await;
    assert_eq!(placed.status(), StatusCode::CREATED);
    assert_eq!(placed.headers()["etag"], "\"1\"");
    let location = placed.headers()["location"]
        .to_str()
        .expect("location")
        .to_owned();
    let body: Value = placed.json().await.expect("json");
    assert_eq!(
        location,
        format!("/orders/{}", body["order_id"].as_str().expect("id"))
    );
    assert_eq!(
        (body["status"].as_str(), body["total_cents"].as_i64()),
        (Some("placed"), Some(2500))
    );

    let read = s.client.get(s.url(&location)).send().await.expect("get");
    assert_eq!(read.status(), StatusCode::OK);
    assert_eq!(read.headers()["etag"], "\"1\"");

    let paid = s
        .post(
            &format!("{location}/pay"),
            json!({"amount_cents": 2500, "payment_ref": "psp-1"}),
        )
        .await;
    assert_eq!(paid.status(), StatusCode::OK);
    assert_eq!(paid.headers()["etag"], "\"2\"");
    let shipped = s
        .post(
            &format!("{location}/ship"),
            json!({"carrier": "DHL", "tracking_number": "JD1"}),
        )
        .await;
    let body: Value = shipped.json().await.expect("json");
    assert_eq!(
        (body["status"].as_str(), body["version"].as_i64()),
        (Some("shipped"), Some(3))
    );
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_repeated_idempotency_key_returns_the_original_order(pool: PgPool) {
    let s = Service::start(&pool).await;
    let body = json!({"customer_id": "alice", "currency": "EUR", "lines": [{"sku": "MUG", "quantity": 1, "unit_price_cents": 100}]});
    let send = |body: Value| {
        s.client
            .post(s.url("/orders"))
            .header("Idempotency-Key", "checkout-7")
            .json(&body)
            .send()
    };
    let first = send(body.clone()).await.expect("first");
    assert_eq!(first.status(), StatusCode::CREATED);
    assert!(first.headers().get("idempotent-replayed").is_none());
    let first: Value = first.json().await.expect("json");
    let retry = send(body.clone()).await.expect("retry");
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    let retry: Value = retry.json().await.expect("json");
    assert_eq!(first["order_id"], retry["order_id"]);
    assert_eq!(events(&pool).await, 1);

    let mut other = body;
    other["lines"][0]["quantity"] = json!(5);
    problem(
        send(other).await.expect("reuse"),
        StatusCode::UNPROCESSABLE_ENTITY,
        "already used",
    )
    .await;
    assert_eq!(events(&pool).await, 1);
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn malformed_requests_are_400_413_415_and_change_nothing(pool: PgPool) {
    let s = Service::start(&pool).await;
    let raw = |body: &'static str| {
        s.client
            .post(s.url("/orders"))
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    problem(
        raw("{\"customer_id\": \"alice\",").await.expect("send"),
        StatusCode::BAD_REQUEST,
        "",
    )
    .await;
    problem(
        raw("{\"customer_id\": 5, \"currency\": \"EUR\", \"lines\": []}")
            .await
            .expect("send"),
        StatusCode::BAD_REQUEST,
        "customer_id",
    )
    .await;
    problem(
        raw("{\"customer_id\": \"a\", \"currency\": \"EUR\", \"lines\": [], \"extra\": 1}")
            .await
            .expect("send"),
        StatusCode::BAD_REQUEST,
        "extra",
    )
    .await;
    let plain = s
        .client
        .post(s.url("/orders"))
        .body("{}")
        .send()
        .await
        .expect("send");
    problem(
        plain,
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "application/json",
    )
    .await;
    let huge = format!(
        "{{\"customer_id\": \"alice\", \"currency\": \"EUR\", \"lines\": [], \"pad\": \"{}\"}}",
        "x".repeat(200_000)
    );
    let huge = s
        .client
        .post(s.url("/orders"))
        .header("content-type", "application/json")
        .body(huge)
        .send()
        .await
        .expect("send");
    problem(huge, StatusCode::PAYLOAD_TOO_LARGE, "larger than").await;
    problem(
        s.client
            .get(s.url("/orders/not-a-uuid"))
            .send()
            .await
            .expect("send"),
        StatusCode::BAD_REQUEST,
        "UUID",
    )
    .await;
    let (id, _) = s
        .place(json!([{"sku": "MUG", "quantity": 1, "unit_price_cents": 100}]))
        .await;
    let bad_if_match = s
        .client
        .post(s.url(&format!("/orders/{id}/pay")))
        .header("If-Match", "yesterday")
        .json(&json!({"amount_cents": 100}))
        .send()
        .await
        .expect("send");
    problem(bad_if_match, StatusCode::BAD_REQUEST, "If-Match").await;
    assert_eq!(events(&pool).await, 1, "only the valid order was written");
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn refused_rules_are_422_unknown_orders_404_illegal_transitions_409(pool: PgPool) {
    let s = Service::start(&pool).await;
    let place = |lines: Value| {
        s.post(
            "/orders",
            json!({"customer_id": "alice", "currency": "EUR", "lines": lines}),
        )
    };
    problem(
        place(json!([{"sku": "MUG", "quantity": -2, "unit_price_cents": 100}])).await,
        StatusCode::UNPROCESSABLE_ENTITY,
        "quantity",
    )
    .await;
    problem(
        place(json!([{"sku": "mug blue", "quantity": 1, "unit_price_cents": 100}])).await,
        StatusCode::UNPROCESSABLE_ENTITY,
        "sku",
    )
    .await;
    problem(
        place(json!([{"sku": "MUG", "quantity": 1, "unit_price_cents": 0}])).await,
        StatusCode::UNPROCESSABLE_ENTITY,
        "positive",
    )
    .await;
    problem(
        place(json!([])).await,
        StatusCode::UNPROCESSABLE_ENTITY,
        "at least one line",
    )
    .await;

    let unknown = Uuid::now_v7();
    problem(
        s.client
            .get(s.url(&format!("/orders/{unknown}")))
            .send()
            .await
            .expect("get"),
        StatusCode::NOT_FOUND,
        "not found",
    )
    .await;
    problem(
        s.post(
            &format!("/orders/{unknown}/pay"),
            json!({"amount_cents": 100}),
        )
        .await,
        StatusCode::NOT_FOUND,
        "not found",
    )
    .await;

    let (id, _) = s
        .place(json!([{"sku": "MUG", "quantity": 1, "unit_price_cents": 700}]))
        .await;
    problem(
        s.post(&format!("/orders/{id}/pay"), json!({"amount_cents": 1}))
            .await,
        StatusCode::UNPROCESSABLE_ENTITY,
        "does not match",
    )
    .await;
    problem(
        s.post(
            &format!("/orders/{id}/ship"),
            json!({"carrier": "DHL", "tracking_number": "T"}),
        )
        .await,
        StatusCode::CONFLICT,
        "it is placed",
    )
    .await;
    assert_eq!(
        s.post(&format!("/orders/{id}/pay"), json!({"amount_cents": 700}))
            .await
            .status(),
        StatusCode::OK
    );
    problem(
        s.post(&format!("/orders/{id}/pay"), json!({"amount_cents": 700}))
            .await,
        StatusCode::CONFLICT,
        "already paid",
    )
    .await;
    assert_eq!(events(&pool).await, 2, "refusals wrote nothing");
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn if_match_turns_a_stale_write_into_412(pool: PgPool) {
    let s = Service::start(&pool).await;
    let (id, read) = s
        .place(json!([{"sku": "MUG", "quantity": 1, "unit_price_cents": 700}]))
        .await;
    let etag = read.headers()["etag"].to_str().expect("etag").to_owned();
    let pay = |tag: &str| {
        s.client
            .post(s.url(&format!("/orders/{id}/pay")))
            .header("If-Match", tag)
            .json(&json!({"amount_cents": 700}))
            .send()
    };
    let stale = s
        .client
        .post(s.url(&format!("/orders/{id}/cancel")))
        .header("If-Match", "\"7\"")
        .json(&json!({"reason": "x"}))
        .send()
        .await
        .expect("send");
    problem(stale, StatusCode::PRECONDITION_FAILED, "not the expected 7").await;
    let ok = pay(&etag).await.expect("pay");
    assert_eq!(ok.status(), StatusCode::OK);
    problem(
        pay(&etag).await.expect("pay again"),
        StatusCode::PRECONDITION_FAILED,
        "version",
    )
    .await;
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn the_openapi_document_matches_the_routes(pool: PgPool) {
    let s = Service::start(&pool).await;
    let doc: Value = s
        .client
        .get(s.url("/openapi.json"))
        .send()
        .await
        .expect("get")
        .json()
        .await
        .expect("json");
    assert_eq!(doc["openapi"], "3.1.0");
    let (id, _) = s
        .place(json!([{"sku": "MUG", "quantity": 1, "unit_price_cents": 700}]))
        .await;
    let paths = doc["paths"].as_object().expect("paths");
    let mut documented = 0;
    for (path, operations) in paths {
        let operations = operations.as_object().expect("operations");
        let url = s.url(&path.replace("{id}", &id));
        for method in ["get", "post", "put", "patch", "delete"] {
            let request = match method {
                "get" => s.client.get(&url),
                "post" => s.client.post(&url).json(&json!({})),
                "put" => s.client.put(&url),
                "patch" => s.client.patch(&url),
                _ => s.client.delete(&url),
            };
            let response = request.send().await.expect("send");
            // A method the document does not list on a route it does is not served either.
            if !operations.contains_key(method) {
                problem(response, StatusCode::METHOD_NOT_ALLOWED, "method").await;
                continue;
            }
            documented += 1;
            assert_ne!(
                response.status(),
                StatusCode::METHOD_NOT_ALLOWED,
                "{method} {path}"
            );
            if response.status() == StatusCode::NOT_FOUND {
                let body: Value = response.json().await.expect("problem");
                assert_ne!(
                    body["type"], "urn:waybill:problem:not-found",
                    "{method} {path} is documented but not routed"
                );
            }
        }
    }
    assert!(documented >= 6);
    // And an undocumented route is not served.
    let stray = s
        .client
        .delete(s.url(&format!("/orders/{id}")))
        .send()
        .await
        .expect("send");
    problem(stray, StatusCode::METHOD_NOT_ALLOWED, "method").await;
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn headers_that_cannot_be_read_are_refused_not_ignored(pool: PgPool) {
    let s = Service::start(&pool).await;
    let body = json!({"customer_id": "alice", "currency": "EUR", "lines": [{"sku": "MUG", "quantity": 1, "unit_price_cents": 100}]});
    let key = reqwest::header::HeaderValue::from_bytes(b"cl\xe9-7").expect("opaque header value");
    let response = s
        .client
        .post(s.url("/orders"))
        .header("Idempotency-Key", key)
        .json(&body)
        .send()
        .await
        .expect("send");
    problem(response, StatusCode::BAD_REQUEST, "Idempotency-Key").await;
    let wrong_method = s
        .client
        .delete(s.url("/orders"))
        .send()
        .await
        .expect("send");
    problem(wrong_method, StatusCode::METHOD_NOT_ALLOWED, "method").await;
    assert_eq!(events(&pool).await, 0);
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_replayed_place_describes_the_order_as_it_is_now(pool: PgPool) {
    let s = Service::start(&pool).await;
    let body = json!({"customer_id": "alice", "currency": "EUR", "lines": [{"sku": "MUG", "quantity": 1, "unit_price_cents": 100}]});
    let send = || {
        s.client
            .post(s.url("/orders"))
            .header("Idempotency-Key", "k-etag")
            .json(&body)
            .send()
    };
    let first: Value = send().await.expect("first").json().await.expect("json");
    let id = first["order_id"].as_str().expect("id").to_owned();
    assert_eq!(
        s.post(&format!("/orders/{id}/pay"), json!({"amount_cents": 100}))
            .await
            .status(),
        StatusCode::OK
    );
    let replay = send().await.expect("replay");
    assert_eq!(
        replay.headers()["etag"],
        "\"2\"",
        "the ETag matches the body, which is the paid order"
    );
    let body: Value = replay.json().await.expect("json");
    assert_eq!(body["status"], "paid");
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn an_unpayable_total_and_an_unknown_currency_are_422_at_place(pool: PgPool) {
    let s = Service::start(&pool).await;
    let unpayable = s
        .post(
            "/orders",
            json!({"customer_id": "alice", "currency": "EUR", "lines": [{"sku": "GOLD", "quantity": 2, "unit_price_cents": 1_000_000_000_000_i64}]}),
        )
        .await;
    problem(unpayable, StatusCode::UNPROCESSABLE_ENTITY, "order total").await;
    let made_up = s
        .post(
            "/orders",
            json!({"customer_id": "alice", "currency": "ZZZ", "lines": [{"sku": "MUG", "quantity": 1, "unit_price_cents": 100}]}),
        )
        .await;
    problem(made_up, StatusCode::UNPROCESSABLE_ENTITY, "ISO 4217").await;
    assert_eq!(events(&pool).await, 0);
    // The largest total accepted is one a payment can settle.
    let (id, _) = s
        .place(json!([{"sku": "GOLD", "quantity": 1, "unit_price_cents": 1_000_000_000_000_i64}]))
        .await;
    let paid = s
        .post(
            &format!("/orders/{id}/pay"),
            json!({"amount_cents": 1_000_000_000_000_i64}),
        )
        .await;
    assert_eq!(paid.status(), StatusCode::OK);
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_utf8_idempotency_key_is_400_not_a_second_order(pool: PgPool) {
    let s = Service::start(&pool).await;
    let body = json!({"customer_id": "alice", "currency": "EUR", "lines": [{"sku": "MUG", "quantity": 1, "unit_price_cents": 100}]});
    for _ in 0..2 {
        let key = reqwest::header::HeaderValue::from_bytes("schlüssel-1".as_bytes())
            .expect("opaque header value");
        let response = s
            .client
            .post(s.url("/orders"))
            .header("Idempotency-Key", key)
            .json(&body)
            .send()
            .await
            .expect("send");
        problem(response, StatusCode::BAD_REQUEST, "Idempotency-Key").await;
    }
    assert_eq!(events(&pool).await, 0);
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn every_error_status_is_a_problem_naming_the_field_never_a_rust_type(pool: PgPool) {
    let s = Service::start(&pool).await;
    let raw = |body: &'static str| {
        s.client
            .post(s.url("/orders"))
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    for (body, needle) in [
        ("\"hello\"", "the body must be a JSON object"),
        ("[]", "the body must be a JSON object"),
        (
            "{\"currency\": \"EUR\", \"lines\": []}",
            "field `customer_id` is required",
        ),
        (
            "{\"customer_id\": \"a\", \"currency\": \"EUR\", \"lines\": [{\"sku\": \"MUG\", \"quantity\": \"two\", \"unit_price_cents\": 1}]}",
            "field `lines[0].quantity` must be a whole number",
        ),
        (
            "{\"customer_id\": \"a\", \"currency\": \"EUR\", \"lines\": {}}",
            "field `lines` must be an array",
        ),
        (
            "{\"customer_id\": \"a\", \"currency\": \"EUR\", \"lines\": []} x",
            "not well-formed JSON",
        ),
    ] {
        let body = problem(
            raw(body).await.expect("send"),
            StatusCode::BAD_REQUEST,
            needle,
        )
        .await;
        let detail = body["detail"].as_str().unwrap_or("");
        for rust in ["struct", "PlaceRequest", "LineRequest", "i64", "u32", "Vec"] {
            assert!(!detail.contains(rust), "{detail:?} shows a Rust type");
        }
    }
    problem(
        s.client.get(s.url("/nowhere")).send().await.expect("send"),
        StatusCode::NOT_FOUND,
        "no such route",
    )
    .await;
    problem(
        s.client.put(s.url("/orders")).send().await.expect("send"),
        StatusCode::METHOD_NOT_ALLOWED,
        "method",
    )
    .await;
    let (id, _) = s
        .place(json!([{"sku": "MUG", "quantity": 1, "unit_price_cents": 100}]))
        .await;
    let plain_cancel = s
        .client
        .post(s.url(&format!("/orders/{id}/cancel")))
        .header("content-type", "text/plain")
        .body("{\"reason\": \"changed my mind\"}")
        .send()
        .await
        .expect("send");
    problem(
        plain_cancel,
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "application/json",
    )
    .await;
    let huge_cancel = s
        .client
        .post(s.url(&format!("/orders/{id}/cancel")))
        .header("content-type", "application/json")
        .body(format!("{{\"reason\": \"{}\"}}", "x".repeat(100_000)))
        .send()
        .await
        .expect("send");
    problem(huge_cancel, StatusCode::PAYLOAD_TOO_LARGE, "larger than").await;
    assert_eq!(events(&pool).await, 1, "only the valid order was written");
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn if_match_takes_only_a_well_formed_strong_tag(pool: PgPool) {
    let s = Service::start(&pool).await;
    let (id, _) = s
        .place(json!([{"sku": "MUG", "quantity": 1, "unit_price_cents": 100}]))
        .await;
    let pay = |if_match: &'static str| {
        s.client
            .post(s.url(&format!("/orders/{id}/pay")))
            .header("If-Match", if_match)
            .json(&json!({"amount_cents": 100}))
            .send()
    };
    problem(
        pay("W/\"1\"").await.expect("send"),
        StatusCode::PRECONDITION_FAILED,
        "weak",
    )
    .await;
    for malformed in ["\"1", "1\"", "1", "\"\"", "\"1\", \"2\"", "\"-1\""] {
        problem(
            pay(malformed).await.expect("send"),
            StatusCode::BAD_REQUEST,
            "If-Match",
        )
        .await;
    }
    assert_eq!(events(&pool).await, 1, "nothing was paid");
    let paid = pay("\"1\"").await.expect("send");
    assert_eq!(paid.status(), StatusCode::OK);
    assert_eq!(paid.headers()["etag"], "\"2\"");
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn metrics_live_apart_and_made_up_methods_leave_no_trace(pool: PgPool) {
    let s = Service::start(&pool).await;
    // Not on the public API.
    problem(
        s.client.get(s.url("/metrics")).send().await.expect("send"),
        StatusCode::NOT_FOUND,
        "no such route",
    )
    .await;
    problem(
        s.client.get(s.url("/health")).send().await.expect("send"),
        StatusCode::NOT_FOUND,
        "no such route",
    )
    .await;
    let before = s.scrape().await.len();
    let mut made_up = Vec::new();
    for i in 0..200 {
        let name = format!("MADEUP{i}X{}", Uuid::now_v7().simple()).to_uppercase();
        let method = reqwest::Method::from_bytes(name.as_bytes()).expect("token");
        let path = if i % 2 == 0 {
            "/orders"
        } else {
            "/no/such/path"
        };
        let response = s
            .client
            .request(method, s.url(path))
            .send()
            .await
            .expect("send");
        assert!(
            response.status() == StatusCode::METHOD_NOT_ALLOWED
                || response.status() == StatusCode::NOT_FOUND,
            "{}",
            response.status()
        );
        made_up.push(name);
    }
    let metrics = s.scrape().await;
    for name in &made_up {
        assert!(!metrics.contains(name.as_str()), "{name} is in /metrics");
        assert!(!metrics.contains("/no/such/path"), "a raw path is a label");
    }
    assert!(metrics.contains("method=\"other\""), "{metrics}");
    // Two hundred requests add a handful of series, not two hundred.
    assert!(
        metrics.len() < before + 8_000,
        "/metrics grew from {before} to {} bytes",
        metrics.len()
    );
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn five_hundred_half_request_lines_are_dropped_with_the_default_limits(pool: PgPool) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // The defaults a silent half-request meets: the keep-alive idle watchdog (5 s, no byte and no
    // request in flight) and, behind it, the header-read timeout (10 s).
    let (keep_alive_idle, header_read_timeout) = (Duration::from_secs(5), Duration::from_secs(10));
    let s = Service::start(&pool).await;
    let address = s.base.trim_start_matches("http://").to_owned();
    let mut tasks = Vec::new();
    for _ in 0..500 {
        // Taken before connecting: the server's clocks start at accept and restart on the last byte
        // received, both later, so no close is seen sooner than `keep_alive_idle` after this.
        let opened = std::time::Instant::now();
        let mut stream = tokio::net::TcpStream::connect(&address)
            .await
            .expect("connect");
        stream.write_all(b"POST /ord").await.expect("half a line");
        tasks.push(tokio::spawn(async move {
            let mut buf = [0u8; 256];
            // Several times the header-read timeout: only a server that keeps a slow client for
            // good runs into it, not a loaded machine.
            let deadline = tokio::time::Instant::now() + header_read_timeout * 6;
            loop {
                match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
                    Ok(Ok(0) | Err(_)) => return Some(opened.elapsed()),
                    Ok(Ok(_)) => continue,
                    Err(_) => return None,
                }
            }
        }));
    }
    // While they hang, the service still answers.
    let health = s
        .client
        .get(format!("{}/health", s.metrics))
        .send()
        .await
        .expect("health");
    assert!(health.status().is_success());
    assert_eq!(
        s.client
            .get(s.url("/openapi.json"))
            .send()
            .await
            .expect("get")
            .status(),
        StatusCode::OK
    );
    for task in tasks {
        let lifetime = task
            .await
            .expect("task")
            .expect("every slow connection is closed by the server");
        // Dropped by a limit, not refused or cut off at once.
        assert!(
            lifetime >= keep_alive_idle,
            "a slow connection was closed after {lifetime:?}, before any default limit ran out"
        );
    }
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn the_edge_limits_are_flags(pool: PgPool) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let s = Service::start_with(
        &pool,
        &[
            "--header-read-timeout",
            "1s",
            "--keep-alive-idle",
            "300ms",
            "--max-connections",
            "8",
        ],
    )
    .await;
    let address = s.base.trim_start_matches("http://").to_owned();
    let mut slow = tokio::net::TcpStream::connect(&address)
        .await
        .expect("connect");
    // Taken before the last byte leaves: the server's idle clock restarts no sooner than it arrives.
    let sent = std::time::Instant::now();
    slow.write_all(b"GET /open").await.expect("partial");
    // The flags close it after 300 ms (idle) or 1 s (headers); the defaults would wait 5 s (idle) at
    // the least. A close seen before 4 s, 13 times the idle flag, can only be the flags' doing.
    let mut buf = [0u8; 64];
    let read = tokio::time::timeout(Duration::from_secs(4), slow.read(&mut buf))
        .await
        .expect("closed within 4 s, before the 5 s default idle timeout could close it");
    assert!(
        matches!(read, Ok(0) | Err(_)),
        "closed without an answer: {read:?}"
    );
    let lifetime = sent.elapsed();
    assert!(
        lifetime >= Duration::from_millis(300),
        "closed {lifetime:?} after its last byte, before --keep-alive-idle ran out"
    );
    let url = testkit::database_url(&pool).await;
    let refused = tokio::process::Command::new(env!("CARGO_BIN_EXE_waybill"))
        .args(["serve", "--database-url", &url, "--request-timeout", "0s"])
        .output()
        .await
        .expect("runs");
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("longer than zero"));
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_writer_frozen_mid_transaction_stalls_only_its_own_orders(pool: PgPool) {
    // Another writer froze with version 2 of two orders written and not committed. Paying either waits
    // for it, alone, off group commit's path, so a new order is served meanwhile; the lock timeout
    // gives up on it (503 order-locked with Retry-After; nothing written).
    let s = Service::start(&pool).await;
    let line = json!([{"sku": "MUG", "quantity": 1, "unit_price_cents": 900}]);
    let (first, _) = s.place(line.clone()).await;
    let (second, _) = s.place(line.clone()).await;
    let mut frozen = pool.begin().await.expect("begin");
    for id in [&first, &second] {
        sqlx::query(
            "INSERT INTO events (event_id, event_type, event_version, aggregate_type, aggregate_id,
                                 aggregate_version, occurred_at, payload)
             VALUES (gen_random_uuid(), 'order.cancelled', 1, 'order', $1::uuid, 2, now(), '{}')",
        )
        .bind(id)
        .execute(&mut *frozen)
        .await
        .expect("the frozen writer's row");
    }
    let pay = |id: String| {
        let (client, url) = (s.client.clone(), s.url(&format!("/orders/{id}/pay")));
        tokio::spawn(async move {
            let response = client
                .post(url)
                .json(&json!({"amount_cents": 900}))
                .send()
                .await
                .expect("pay");
            (
                response.status(),
                response.headers().contains_key("retry-after"),
            )
        })
    };
    let payments = [pay(first), pay(second)];
    tokio::time::sleep(Duration::from_millis(300)).await;

    let placed = tokio::time::timeout(
        Duration::from_secs(20),
        s.post(
            "/orders",
            json!({"customer_id": "bob", "currency": "EUR", "lines": line}),
        ),
    )
    .await
    .expect("a new order is not held behind the frozen writer");
    assert_eq!(placed.status(), StatusCode::CREATED);
    for payment in payments {
        let (status, retry_after) = tokio::time::timeout(Duration::from_secs(30), payment)
            .await
            .expect("the payments give up")
            .expect("task");
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(retry_after, "503 order-locked says when to retry");
    }
    frozen.rollback().await.expect("rollback");
    assert_eq!(events(&pool).await, 3, "the payments wrote nothing");
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn customers_are_a_second_aggregate_beside_orders(pool: PgPool) {
    let service = Service::start(&pool).await;
    let created = service
        .post(
            "/customers",
            json!({"customer_id": "alice", "name": "Alice Liddell"}),
        )
        .await;
    assert_eq!(created.status(), StatusCode::CREATED);
    assert_eq!(
        created
            .headers()
            .get("location")
            .and_then(|v| v.to_str().ok()),
        Some("/customers/alice")
    );
    let body: Value = created.json().await.expect("json");
    assert_eq!(
        (body["version"].clone(), body["name"].clone()),
        (json!(1), json!("Alice Liddell"))
    );
    let key = body["key"].as_str().expect("key").to_owned();

    // The same handle again: 409, nothing written.
    let taken = service
        .post(
            "/customers",
            json!({"customer_id": "alice", "name": "Other"}),
        )
        .await;
    problem(taken, StatusCode::CONFLICT, "already registered").await;
    let renamed = service
        .post("/customers/alice/rename", json!({"name": "Alice L."}))
        .await;
    assert_eq!(renamed.status(), StatusCode::OK);
    let shown: Value = service
        .client
        .get(service.url("/customers/alice"))
        .send()
        .await
        .expect("get")
        .json()
        .await
        .expect("json");
    assert_eq!(
        (shown["version"].clone(), shown["name"].clone()),
        (json!(2), json!("Alice L."))
    );

    // Unknown customers, bad handles and bad bodies are refused.
    let unknown = service
        .client
        .get(service.url("/customers/bob"))
        .send()
        .await
        .expect("get");
    let body = problem(unknown, StatusCode::NOT_FOUND, "not found").await;
    assert_eq!(body["type"], "urn:waybill:problem:customer-not-found");
    let rename_unknown = service
        .post("/customers/bob/rename", json!({"name": "Bob"}))
        .await;
    problem(rename_unknown, StatusCode::NOT_FOUND, "not found").await;
    let blank = service
        .post("/customers", json!({"customer_id": "carol", "name": "  "}))
        .await;
    problem(blank, StatusCode::UNPROCESSABLE_ENTITY, "name").await;
    let bad_handle = service
        .post(
            "/customers",
            json!({"customer_id": "no spaces", "name": "x"}),
        )
        .await;
    problem(bad_handle, StatusCode::UNPROCESSABLE_ENTITY, "customer id").await;

    // A customer's id is no order: 404 on the order routes, and nothing written.
    let before: i64 = sqlx::query_scalar("SELECT count(*) FROM events")
        .fetch_one(&pool)
        .await
        .expect("count");
    let as_order = service
        .client
        .get(service.url(&format!("/orders/{key}")))
        .send()
        .await
        .expect("get");
    problem(as_order, StatusCode::NOT_FOUND, "not found").await;
    let pay = service
        .post(&format!("/orders/{key}/pay"), json!({"amount_cents": 100}))
        .await;
    problem(pay, StatusCode::NOT_FOUND, "not found").await;
    let after: i64 = sqlx::query_scalar("SELECT count(*) FROM events")
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(before, after);
    let types: Vec<String> =
        sqlx::query_scalar("SELECT DISTINCT aggregate_type FROM outbox ORDER BY 1")
            .fetch_all(&pool)
            .await
            .expect("types");
    assert_eq!(
        types,
        ["customer"],
        "the customer's events go through the outbox"
    );
}
