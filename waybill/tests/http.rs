//! The HTTP order service against a running `waybill serve` on a real PostgreSQL: every status it
//! promises, idempotency keys, ETag/If-Match, problem details, and an OpenAPI document that matches
//! the routes.

use std::time::Duration;

use reqwest::{Client, Response, StatusCode};
use serde_json::{Value, json};
use sqlx::PgPool;
use uuid::Uuid;

struct Service {
    base: String,
    child: tokio::process::Child,
    client: Client,
}

impl Service {
    async fn start(pool: &PgPool) -> Self {
        let url = testkit::database_url(pool).await;
        let port = ops::free_port().expect("free port");
        let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_waybill"))
            .args([
                "serve",
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--database-url",
                &url,
            ])
            .env("RUST_LOG", "warn")
            .kill_on_drop(true)
            .spawn()
            .expect("waybill serve starts");
        let service = Self {
            base: format!("http://127.0.0.1:{port}"),
            child,
            client: Client::new(),
        };
        for _ in 0..200 {
            if let Ok(r) = service
                .client
                .get(format!("{}/health", service.base))
                .send()
                .await
                && r.status().is_success()
            {
                return service;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("waybill serve did not become healthy");
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

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
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
        for (method, _) in operations.as_object().expect("operations") {
            documented += 1;
            let url = s.url(&path.replace("{id}", &id));
            let request = match method.as_str() {
                "get" => s.client.get(&url),
                "post" => s.client.post(&url).json(&json!({})),
                other => panic!("undocumented method {other}"),
            };
            let response = request.send().await.expect("send");
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
    assert!(documented >= 8);
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
