//! The served `/openapi.json` against the running `waybill serve`: every status, header and body the
//! service really sends must be in the document, and everything the document promises must be sent.
//! The document is generated from the handlers, but the statuses and headers each one declares are
//! its author's word: this is what holds them to what the service does.

use std::collections::{BTreeMap, BTreeSet};

use reqwest::RequestBuilder;
use reqwest::header::HeaderMap;
use serde_json::{Value, json};
use sqlx::PgPool;
use uuid::Uuid;

/// The response headers the contract covers: the set plus `ETag`, which the service also sends
/// and documents. `Content-Type` is not among them: OpenAPI documents it
/// as the media type keys of `content` (a `Content-Type` entry under `headers` must be ignored), and
/// [`Contract::check`] checks it there.
const HEADERS: &[&str] = &["Location", "Idempotent-Replayed", "Event-Id", "ETag"];

/// Documented statuses this test does not provoke, as `(operationId, status, why)`. Every other
/// documented status must be observed, so a status documented but never sent fails the test; and
/// one listed here that is observed fails it too, so the list cannot go stale.
const NOT_PROVOKED: &[(&str, &str, &str)] = &[(
    "getHealth",
    "503",
    "needs the database to refuse the service's connections while it runs",
)];

mod common;

use common::Service;

impl Service {
    async fn start(pool: &PgPool, extra: &[&str]) -> Self {
        Self::start_with(pool, extra).await
    }

    fn get(&self, path: &str) -> RequestBuilder {
        self.client.get(format!("{}{path}", self.base))
    }

    fn post(&self, path: &str) -> RequestBuilder {
        self.client.post(format!("{}{path}", self.base))
    }
}

/// What one real response looked like, for the test to go on with.
struct Seen {
    status: u16,
    headers: HeaderMap,
    body: Value,
}

/// The document, and what the service was seen to send for each of its operations.
struct Contract {
    document: Value,
    /// operationId → status → the covered headers seen with it.
    seen: BTreeMap<String, BTreeMap<String, BTreeSet<String>>>,
}

impl Contract {
    /// `route` is a key of `paths`, or the name of a path item in `components.pathItems`.
    fn operation(&self, method: &str, route: &str) -> &Value {
        let item = self.document["paths"]
            .get(route)
            .or_else(|| self.document["components"]["pathItems"].get(route))
            .unwrap_or_else(|| panic!("{route} is neither a path nor a path item of the document"));
        item.get(method)
            .unwrap_or_else(|| panic!("{method} {route} is not in the document"))
    }

    /// Sends `request` for the operation `method route` and checks the answer against the document:
    /// its status must be listed, each covered header it carries must be documented (and each
    /// documented required one carried), its media type must be a key of `content`, and its body
    /// must validate against that schema. Looking every real response up in the document is what makes
    /// an undocumented status or header, or one removed from the document, fail.
    async fn check(&mut self, method: &str, route: &str, request: RequestBuilder) -> Seen {
        let response = request.send().await.expect("request");
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let bytes = response.bytes().await.expect("body");
        let operation = self.operation(method, route);
        let id = operation["operationId"]
            .as_str()
            .unwrap_or_else(|| panic!("{method} {route} has no operationId"))
            .to_owned();
        let what = format!("{method} {route} ({id}) answered {status}");
        let documented = operation["responses"]
            .get(status.to_string())
            .map(|r| resolve(&self.document, r))
            .unwrap_or_else(|| panic!("{what}, a status the document does not list"));

        let mut carried = BTreeSet::new();
        let documented_headers = documented["headers"].as_object();
        for name in HEADERS {
            let entry = documented_headers
                .into_iter()
                .flatten()
                .find(|(key, _)| key.eq_ignore_ascii_case(name))
                .map(|(_, header)| resolve(&self.document, header));
            match (headers.get(*name), entry) {
                (Some(value), Some(header)) => {
                    let value = Value::String(value.to_str().expect("ASCII header").to_owned());
                    let errors = validate(&self.document, &header["schema"], &value, name);
                    assert!(errors.is_empty(), "{what}: header {name}: {errors:?}");
                    carried.insert((*name).to_owned());
                }
                (Some(value), None) => {
                    panic!("{what} with header {name}: {value:?}, which the document does not list")
                }
                (None, Some(header)) => assert!(
                    header["required"] != json!(true),
                    "{what} without header {name}, which the document says is always sent"
                ),
                (None, None) => {}
            }
        }

        let body = if bytes.is_empty() {
            assert!(
                documented.get("content").is_none(),
                "{what} with no body, but the document describes one"
            );
            Value::Null
        } else {
            let content_type = headers
                .get("content-type")
                .and_then(|v| v.to_str().ok())
                .unwrap_or_else(|| panic!("{what} with a body and no Content-Type"));
            let essence = content_type.split(';').next().unwrap_or("").trim();
            let media = documented["content"].get(essence).unwrap_or_else(|| {
                panic!("{what} with Content-Type {content_type}, which the document does not list")
            });
            let body = if essence.ends_with("json") {
                serde_json::from_slice(&bytes).unwrap_or_else(|e| {
                    panic!("{what} with a {essence} body that is not JSON: {e}")
                })
            } else {
                Value::String(String::from_utf8_lossy(&bytes).into_owned())
            };
            let errors = validate(&self.document, &media["schema"], &body, "body");
            assert!(errors.is_empty(), "{what}: {errors:?}\n{body:#}");
            body
        };

        self.seen
            .entry(id)
            .or_default()
            .entry(status.to_string())
            .or_default()
            .extend(carried);
        Seen {
            status,
            headers,
            body,
        }
    }

    /// The other direction: every documented status was seen (or is in [`NOT_PROVOKED`], and was not
    /// seen), and every documented header of a seen status was seen with it at least once.
    fn assert_covered(&self) {
        let items = self.document["paths"]
            .as_object()
            .into_iter()
            .chain(self.document["components"]["pathItems"].as_object())
            .flatten();
        let mut missing = Vec::new();
        for (_, item) in items {
            for (method, operation) in item.as_object().expect("path item") {
                let Some(id) = operation.get("operationId").and_then(Value::as_str) else {
                    assert!(method == "servers", "{method} has no operationId");
                    continue;
                };
                let seen = self.seen.get(id);
                for (status, response) in operation["responses"].as_object().expect("responses") {
                    let excused = NOT_PROVOKED.iter().any(|(o, s, _)| *o == id && s == status);
                    let headers = seen.and_then(|s| s.get(status));
                    match (headers, excused) {
                        (Some(_), true) => missing
                            .push(format!("{id} {status} was seen: drop it from NOT_PROVOKED")),
                        (None, false) => missing.push(format!("{id} {status} was never sent")),
                        (None, true) => {}
                        (Some(headers), false) => {
                            let response = resolve(&self.document, response);
                            for name in response["headers"]
                                .as_object()
                                .into_iter()
                                .flatten()
                                .map(|(k, _)| k)
                            {
                                if !headers.iter().any(|h| h.eq_ignore_ascii_case(name)) {
                                    missing.push(format!("{id} {status} never carried {name}"));
                                }
                            }
                        }
                    }
                }
            }
        }
        assert!(
            missing.is_empty(),
            "the document promises more than the service sends: {missing:#?}"
        );
    }
}

/// Follows `$ref`s (only local ones, `#/...`, are used) to the object they name.
fn resolve<'a>(document: &'a Value, mut value: &'a Value) -> &'a Value {
    while let Some(reference) = value.get("$ref").and_then(Value::as_str) {
        let pointer = reference
            .strip_prefix('#')
            .unwrap_or_else(|| panic!("{reference} is not a local reference"));
        value = document
            .pointer(pointer)
            .unwrap_or_else(|| panic!("{reference} names nothing in the document"));
    }
    value
}

/// The errors of `value` against `schema`, a schema of the served document (OpenAPI 3.1's schemas are
/// JSON Schema draft 2020-12), its `$ref`s resolved within the document. Formats are asserted and an
/// unknown one is an error, so a typo cannot disable a check; OpenAPI's own `int32` and `int64` name
/// the width of an integer, which `type` and the bounds check.
fn validate(document: &Value, schema: &Value, value: &Value, at: &str) -> Vec<String> {
    let mut root = schema.clone();
    root["components"] = document["components"].clone();
    let validator = jsonschema::options()
        .with_draft(jsonschema::Draft::Draft202012)
        .should_validate_formats(true)
        .should_ignore_unknown_formats(false)
        .with_format("int32", |_: &str| true)
        .with_format("int64", |_: &str| true)
        .build(&root)
        .unwrap_or_else(|e| panic!("{at}: the schema {schema} does not compile: {e}"));
    validator
        .iter_errors(value)
        .map(|error| format!("{at}{}: {error}", error.instance_path().as_str()))
        .collect()
}

impl Contract {
    /// [`Contract::check`], and the status this request is meant to provoke.
    async fn expect(
        &mut self,
        status: u16,
        method: &str,
        route: &str,
        request: RequestBuilder,
    ) -> Seen {
        let seen = self.check(method, route, request).await;
        assert_eq!(seen.status, status, "{method} {route}: {}", seen.body);
        seen
    }
}

/// A JSON body over the service's 64 KiB limit.
fn too_large() -> String {
    format!("{{\"pad\": \"{}\"}}", "x".repeat(100_000))
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn every_response_the_service_sends_is_documented(pool: PgPool) {
    // A short request timeout, so that a request held up by a table lock below ends in the edge's 503
    // within a second.
    let s = Service::start(&pool, &["--request-timeout", "1s"]).await;
    let document: Value = s
        .get("/openapi.json")
        .send()
        .await
        .expect("get")
        .json()
        .await
        .expect("json");
    let mut c = Contract {
        document,
        seen: BTreeMap::new(),
    };
    let json_type = ("content-type", "application/json");
    let unknown = format!("/orders/{}", Uuid::now_v7());

    // The document describes itself too.
    c.expect(200, "get", "/openapi.json", s.get("/openapi.json"))
        .await;

    // placeOrder.
    let place = "/orders";
    let order = |quantity: i64| json!({"customer_id": "alice", "currency": "EUR", "lines": [{"sku": "MUG-BLUE", "quantity": quantity, "unit_price_cents": 1250}]});
    let keyed = |key: &str, body: &Value| s.post(place).header("Idempotency-Key", key).json(body);
    let first = c
        .expect(201, "post", place, keyed("place-1", &order(2)))
        .await;
    let a = first.body["order_id"]
        .as_str()
        .expect("order_id")
        .to_owned();
    let replay = c
        .expect(201, "post", place, keyed("place-1", &order(2)))
        .await;
    assert_eq!(replay.headers["idempotent-replayed"], "true");
    c.expect(422, "post", place, keyed("place-1", &order(5)))
        .await;
    c.expect(422, "post", place, s.post(place).json(&order(-2)))
        .await;
    c.expect(400, "post", place, keyed("", &order(1))).await;
    let correlation = s
        .post(place)
        .header("X-Correlation-Id", "nope")
        .json(&order(1));
    c.expect(400, "post", place, correlation).await;
    let malformed = s
        .post(place)
        .header(json_type.0, json_type.1)
        .body("{\"customer_id\":");
    c.expect(400, "post", place, malformed).await;
    let large = s
        .post(place)
        .header(json_type.0, json_type.1)
        .body(too_large());
    c.expect(413, "post", place, large).await;
    let text = s
        .post(place)
        .header("content-type", "text/plain")
        .body(order(1).to_string());
    c.expect(415, "post", place, text).await;
    let b = c
        .expect(201, "post", place, s.post(place).json(&order(1)))
        .await
        .body["order_id"]
        .as_str()
        .expect("order_id")
        .to_owned();
    let cancelled = c
        .expect(201, "post", place, s.post(place).json(&order(1)))
        .await
        .body["order_id"]
        .as_str()
        .expect("order_id")
        .to_owned();
    let (a, b, cancelled) = (
        format!("/orders/{a}"),
        format!("/orders/{b}"),
        format!("/orders/{cancelled}"),
    );

    // getOrder.
    let show = "/orders/{id}";
    c.expect(200, "get", show, s.get(&a)).await;
    c.expect(400, "get", show, s.get("/orders/not-a-uuid"))
        .await;
    c.expect(404, "get", show, s.get(&unknown)).await;

    // The commands, each through every refusal before it succeeds, is replayed, and then conflicts.
    // `valid` is a body the command accepts on order `on`; `invalid` one a domain rule refuses.
    let commands = [
        (
            "pay",
            &a,
            json!({"amount_cents": 2500, "payment_ref": "psp-1"}),
            json!({"amount_cents": 1}),
        ),
        (
            "ship",
            &a,
            json!({"carrier": "DHL", "tracking_number": "JD1"}),
            json!({"carrier": "", "tracking_number": "JD1"}),
        ),
        (
            "cancel",
            &cancelled,
            json!({"reason": "changed my mind"}),
            json!({"reason": "x".repeat(201)}),
        ),
    ];
    for (verb, on, valid, invalid) in &commands {
        let route = format!("/orders/{{id}}/{verb}");
        let route = route.as_str();
        let at = format!("{on}/{verb}");
        let post = || s.post(&at);
        let not_json = post()
            .header("content-type", "text/plain")
            .body(valid.to_string());
        c.expect(415, "post", route, not_json).await;
        let malformed = post().header(json_type.0, json_type.1).body("{");
        c.expect(400, "post", route, malformed).await;
        let bad_tag = post().header("If-Match", "yesterday").json(valid);
        c.expect(400, "post", route, bad_tag).await;
        c.expect(
            404,
            "post",
            route,
            s.post(&format!("{unknown}/{verb}")).json(valid),
        )
        .await;
        c.expect(422, "post", route, post().json(invalid)).await;
        c.expect(
            412,
            "post",
            route,
            post().header("If-Match", "\"7\"").json(valid),
        )
        .await;
        let large = post().header(json_type.0, json_type.1).body(too_large());
        c.expect(413, "post", route, large).await;
        let key = format!("{verb}-1");
        let done = c
            .expect(
                200,
                "post",
                route,
                post().header("Idempotency-Key", &key).json(valid),
            )
            .await;
        assert!(done.headers.get("idempotent-replayed").is_none());
        let replay = c
            .expect(
                200,
                "post",
                route,
                post().header("Idempotency-Key", &key).json(valid),
            )
            .await;
        assert_eq!(replay.headers["idempotent-replayed"], "true");
        assert_eq!(replay.headers["event-id"], done.headers["event-id"]);
        c.expect(409, "post", route, post().json(valid)).await;
    }
    // Shipping an order that is only placed is an illegal transition too.
    let ship_placed = s.post(&format!("{b}/ship")).json(&commands[1].2);
    c.expect(409, "post", "/orders/{id}/ship", ship_placed)
        .await;
    // Cancel takes an empty body (no reason).
    c.expect(
        200,
        "post",
        "/orders/{id}/cancel",
        s.post(&format!("{b}/cancel")),
    )
    .await;

    // The customer's operations.
    let register = "/customers";
    let customer = |handle: &str, name: &str| json!({"customer_id": handle, "name": name});
    let keyed_customer =
        |key: &str, body: &Value| s.post(register).header("Idempotency-Key", key).json(body);
    c.expect(
        201,
        "post",
        register,
        keyed_customer("reg-1", &customer("alice", "Alice")),
    )
    .await;
    let replay = c
        .expect(
            201,
            "post",
            register,
            keyed_customer("reg-1", &customer("alice", "Alice")),
        )
        .await;
    assert_eq!(replay.headers["idempotent-replayed"], "true");
    c.expect(
        409,
        "post",
        register,
        s.post(register).json(&customer("alice", "Other")),
    )
    .await;
    c.expect(
        422,
        "post",
        register,
        s.post(register).json(&customer("alice", " ")),
    )
    .await;
    c.expect(
        400,
        "post",
        register,
        keyed_customer("", &customer("bob", "Bob")),
    )
    .await;
    let large = s
        .post(register)
        .header(json_type.0, json_type.1)
        .body(too_large());
    c.expect(413, "post", register, large).await;
    let text = s
        .post(register)
        .header("content-type", "text/plain")
        .body(customer("bob", "Bob").to_string());
    c.expect(415, "post", register, text).await;
    let show_customer = "/customers/{customer_id}";
    c.expect(200, "get", show_customer, s.get("/customers/alice"))
        .await;
    c.expect(400, "get", show_customer, s.get("/customers/no%20spaces"))
        .await;
    c.expect(404, "get", show_customer, s.get("/customers/nobody"))
        .await;
    let rename = "/customers/{customer_id}/rename";
    let rename_at = |handle: &str| s.post(&format!("/customers/{handle}/rename"));
    let not_json = rename_at("alice")
        .header("content-type", "text/plain")
        .body("{}");
    c.expect(415, "post", rename, not_json).await;
    let malformed = rename_at("alice")
        .header(json_type.0, json_type.1)
        .body("{");
    c.expect(400, "post", rename, malformed).await;
    c.expect(
        404,
        "post",
        rename,
        rename_at("nobody").json(&json!({"name": "N"})),
    )
    .await;
    c.expect(
        422,
        "post",
        rename,
        rename_at("alice").json(&json!({"name": ""})),
    )
    .await;
    c.expect(
        412,
        "post",
        rename,
        rename_at("alice")
            .header("If-Match", "\"7\"")
            .json(&json!({"name": "Al"})),
    )
    .await;
    let large = rename_at("alice")
        .header(json_type.0, json_type.1)
        .body(too_large());
    c.expect(413, "post", rename, large).await;
    let done = c
        .expect(
            200,
            "post",
            rename,
            rename_at("alice")
                .header("Idempotency-Key", "rename-1")
                .json(&json!({"name": "Al"})),
        )
        .await;
    let replay = c
        .expect(
            200,
            "post",
            rename,
            rename_at("alice")
                .header("Idempotency-Key", "rename-1")
                .json(&json!({"name": "Al"})),
        )
        .await;
    assert_eq!(replay.headers["event-id"], done.headers["event-id"]);
    c.expect(
        409,
        "post",
        rename,
        rename_at("alice").json(&json!({"name": "Al"})),
    )
    .await;

    // The telemetry listener.
    c.expect(
        200,
        "get",
        "Health",
        s.client.get(format!("{}/health", s.metrics)),
    )
    .await;
    c.expect(
        200,
        "get",
        "Metrics",
        s.client.get(format!("{}/metrics", s.metrics)),
    )
    .await;

    // 503: every operation waits for the events table, locked here past the request timeout.
    let operations: [(&str, &str, RequestBuilder); 8] = [
        (
            "post",
            register,
            s.post(register).json(&customer("carol", "Carol")),
        ),
        ("get", show_customer, s.get("/customers/alice")),
        (
            "post",
            rename,
            rename_at("alice").json(&json!({"name": "Alice again"})),
        ),
        ("post", place, s.post(place).json(&order(1))),
        ("get", show, s.get(&a)),
        (
            "post",
            "/orders/{id}/pay",
            s.post(&format!("{a}/pay")).json(&commands[0].2),
        ),
        (
            "post",
            "/orders/{id}/ship",
            s.post(&format!("{a}/ship")).json(&commands[1].2),
        ),
        (
            "post",
            "/orders/{id}/cancel",
            s.post(&format!("{a}/cancel")),
        ),
    ];
    let mut lock = pool.begin().await.expect("begin");
    sqlx::query("LOCK TABLE events IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *lock)
        .await
        .expect("lock");
    for (method, route, request) in operations
        .iter()
        .map(|(m, r, q)| (m, r, q.try_clone().expect("clone")))
    {
        c.expect(503, method, route, request).await;
    }
    lock.rollback().await.expect("unlock");

    // 500: the same operations once the events table is gone (the service's connections survive).
    sqlx::query("ALTER TABLE events RENAME TO events_elsewhere")
        .execute(&pool)
        .await
        .expect("rename");
    for (method, route, request) in operations {
        c.expect(500, method, route, request).await;
    }

    c.assert_covered();
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn every_metric_family_of_the_service_has_help_text(pool: PgPool) {
    let s = Service::start(&pool, &[]).await;
    // One request, so that the HTTP families have a series to show, and one order, written through
    // group commit, so that its families have one too.
    s.get("/openapi.json").send().await.expect("get");
    let order = json!({"customer_id": "alice", "currency": "EUR",
                       "lines": [{"sku": "MUG-BLUE", "quantity": 1, "unit_price_cents": 1250}]});
    let placed = s.post("/orders").json(&order).send().await.expect("place");
    assert_eq!(placed.status(), 201);
    let text = s
        .client
        .get(format!("{}/metrics", s.metrics))
        .send()
        .await
        .expect("scrape")
        .text()
        .await
        .expect("text");
    let families: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    for family in [
        "waybill_http_requests_total",
        "waybill_http_request_seconds",
        "waybill_group_commit_appends",
    ] {
        assert!(
            families.contains(&family),
            "{family} is not exposed:\n{text}"
        );
    }
    for family in families {
        assert!(
            text.lines()
                .any(|l| l.starts_with(&format!("# HELP {family} "))),
            "{family} has no HELP text:\n{text}"
        );
    }
}
