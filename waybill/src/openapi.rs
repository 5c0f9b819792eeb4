//! The OpenAPI 3.1 document of the order service, served at `/openapi.json`. A test checks that every
//! operation it lists is routed and that every route is listed; `tests/openapi_contract.rs` checks
//! every status, header and body the running service sends against it.

use serde_json::{Value, json};

/// The operations, as `(method, path)`: what the document must list, checked by the unit test below
/// (and the routes it lists are checked against the running service by `tests/http.rs`).
#[cfg(test)]
const OPERATIONS: &[(&str, &str)] = &[
    ("post", "/orders"),
    ("get", "/orders/{id}"),
    ("post", "/orders/{id}/pay"),
    ("post", "/orders/{id}/cancel"),
    ("post", "/orders/{id}/ship"),
    ("post", "/customers"),
    ("get", "/customers/{customer_id}"),
    ("post", "/customers/{customer_id}/rename"),
    ("get", "/openapi.json"),
];

fn problem(description: &str) -> Value {
    json!({"description": description, "content": {"application/problem+json": {"schema": {"$ref": "#/components/schemas/Problem"}}}})
}

/// The problems every order operation can answer besides its own: a fault on the database's side
/// (500), the edge's request timeout (503, `ops::edge`), an order holding an event written by a
/// newer version of the service (503, type `urn:waybill:problem:upgrade-required`), and an order
/// locked by another database session (503 with `Retry-After`, type
/// `urn:waybill:problem:order-locked`).
fn faults(responses: &mut Value) {
    responses["500"] =
        problem("The request could not be completed (a database fault); retry later");
    responses["503"] = problem(
        "The request was not completed within the request timeout, or the order holds an event \
         written by a newer version of waybill (upgrade-required: upgrade this service), or \
         another database session holds the order locked (order-locked, with Retry-After: \
         nothing was written; retry then)",
    );
}

/// An order in the body, with exactly the `headers` (names in `components.headers`) the service sends.
fn order(description: &str, headers: &[&str]) -> Value {
    let headers: serde_json::Map<String, Value> = headers
        .iter()
        .map(|name| {
            let key = name.replace('-', "");
            (
                (*name).to_owned(),
                json!({"$ref": format!("#/components/headers/{key}")}),
            )
        })
        .collect();
    json!({
        "description": description,
        "headers": headers,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Order"}}}
    })
}

/// The headers of an answer to a command: what `http::respond` sets.
const CHANGED: &[&str] = &["ETag", "Event-Id", "Idempotent-Replayed"];

fn command(operation_id: &str, summary: &str, body: &str) -> Value {
    let mut responses = json!({
        "200": order("The order after the command (also the answer to a retry with the same Idempotency-Key, marked Idempotent-Replayed: true)", CHANGED),
        "400": problem("Malformed body, order id, If-Match, Idempotency-Key or X-Correlation-Id"),
        "404": problem("Unknown order"),
        "409": problem("Illegal transition, or a race lost too often"),
        "412": problem("If-Match names a version the order is no longer at, or is a weak tag"),
        "413": problem("Body too large"),
        "415": problem("Body is not application/json"),
        "422": problem("A refused domain rule or invalid value, or an Idempotency-Key reused for another request"),
    });
    faults(&mut responses);
    json!({
        "operationId": operation_id,
        "summary": summary,
        "parameters": [
            {"$ref": "#/components/parameters/OrderId"},
            {"$ref": "#/components/parameters/IfMatch"},
            {"$ref": "#/components/parameters/IdempotencyKey"},
            {"$ref": "#/components/parameters/CorrelationId"}
        ],
        "requestBody": {"required": body != "CancelRequest", "content": {"application/json": {"schema": {"$ref": format!("#/components/schemas/{body}")}}}},
        "responses": responses
    })
}

/// A customer in the body, with `headers`.
fn customer(description: &str, headers: &[&str]) -> Value {
    let mut response = order(description, headers);
    response["content"]["application/json"]["schema"]["$ref"] =
        json!("#/components/schemas/Customer");
    response
}

/// The customer's operations: the second aggregate type, beside the order.
fn customer_paths() -> Value {
    let mut register = json!({
        "201": customer("The registered customer (also the answer to a retry with the same Idempotency-Key)", &["ETag", "Location", "Event-Id", "Idempotent-Replayed"]),
        "400": problem("Malformed body, Idempotency-Key or X-Correlation-Id"),
        "409": problem("The handle is registered already"),
        "413": problem("Body too large"),
        "415": problem("Body is not application/json"),
        "422": problem("An invalid handle or a blank name, or an Idempotency-Key reused for another request")
    });
    faults(&mut register);
    let mut show = json!({"200": customer("The customer", &["ETag"]), "400": problem("Malformed handle"), "404": problem("No customer has this handle")});
    faults(&mut show);
    let mut rename = json!({
        "200": customer("The customer after the rename", CHANGED),
        "400": problem("Malformed body, handle or If-Match"),
        "404": problem("No customer has this handle"),
        "409": problem("The customer has that name already, or a race lost too often"),
        "412": problem("If-Match names a version the customer is no longer at"),
        "413": problem("Body too large"),
        "415": problem("Body is not application/json"),
        "422": problem("A blank name")
    });
    faults(&mut rename);
    let handle = json!({"$ref": "#/components/parameters/CustomerHandle"});
    json!({
        "/customers": {"post": {
            "operationId": "registerCustomer",
            "summary": "Register a customer under a handle (the customer_id its orders carry)",
            "parameters": [{"$ref": "#/components/parameters/IdempotencyKey"}, {"$ref": "#/components/parameters/CorrelationId"}],
            "requestBody": {"required": true, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/RegisterCustomerRequest"}}}},
            "responses": register
        }},
        "/customers/{customer_id}": {"get": {
            "operationId": "getCustomer",
            "summary": "Read a customer as folded from its events",
            "parameters": [handle],
            "responses": show
        }},
        "/customers/{customer_id}/rename": {"post": {
            "operationId": "renameCustomer",
            "summary": "Give a customer a new name",
            "parameters": [handle, {"$ref": "#/components/parameters/IfMatch"}, {"$ref": "#/components/parameters/IdempotencyKey"}, {"$ref": "#/components/parameters/CorrelationId"}],
            "requestBody": {"required": true, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/RenameCustomerRequest"}}}},
            "responses": rename
        }}
    })
}

/// What the order view looks like.
fn order_example() -> Value {
    json!({
        "order_id": "0190a0b1-0000-7000-8000-00000000a002", "version": 2, "status": "paid",
        "customer_id": "alice", "currency": "EUR",
        "lines": [{"sku": "MUG-BLUE", "quantity": 2, "unit_price_cents": 1250}],
        "total_cents": 2500, "channel": "web", "paid_cents": 2500, "payment_ref": "psp-1",
        "cancel_reason": null, "carrier": null, "tracking_number": null
    })
}

/// `/health` and `/metrics` (`ops::telemetry_routes`). They are served on the `--metrics-listen`
/// address, not on the API's, so they are reusable path items in `components.pathItems` with their
/// own `servers` rather than entries of `paths`: every entry of `paths` is a route of this listener.
fn telemetry() -> Value {
    let servers = json!([{
        "url": "http://{metricsListen}",
        "description": "The --metrics-listen address",
        "variables": {"metricsListen": {"default": "127.0.0.1:9463"}}
    }]);
    let health = |description: &str| json!({"description": description, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Health"}}}});
    json!({
        "Health": {"servers": servers, "get": {
            "operationId": "getHealth",
            "summary": "Whether the service can reach its database",
            "responses": {"200": health("Healthy"), "503": health("The database does not answer")}
        }},
        "Metrics": {"servers": servers, "get": {
            "operationId": "getMetrics",
            "summary": "Prometheus metrics in the text exposition format (version 0.0.4)",
            "responses": {"200": {"description": "The metrics", "content": {"text/plain": {"schema": {"type": "string"}}}}}
        }}
    })
}

/// The OpenAPI 3.1 document of the order service, as `/openapi.json` serves it.
pub fn document() -> Value {
    let string = |pattern: &str| json!({"type": "string", "pattern": pattern});
    // Integers held in an i64 by the service; `int64` tells generated clients not to use 32 bits.
    let int64 = |minimum: Option<i64>, maximum: Option<i64>| {
        let mut schema = json!({"type": "integer", "format": "int64"});
        if let Some(minimum) = minimum {
            schema["minimum"] = json!(minimum);
        }
        if let Some(maximum) = maximum {
            schema["maximum"] = json!(maximum);
        }
        schema
    };
    let mut place = json!({
        "201": order("The placed order (also the answer to a retry with the same Idempotency-Key, marked Idempotent-Replayed: true)", &["ETag", "Location", "Event-Id", "Idempotent-Replayed"]),
        "400": problem("Malformed body, Idempotency-Key or X-Correlation-Id"),
        "413": problem("Body too large"),
        "415": problem("Body is not application/json"),
        "422": problem("A refused domain rule or invalid value, or an Idempotency-Key reused for another request")
    });
    faults(&mut place);
    let mut show = json!({"200": order("The order", &["ETag"]), "400": problem("Malformed order id"), "404": problem("Unknown order")});
    faults(&mut show);
    let mut document = json!({
        "openapi": "3.1.0",
        "info": {
            "title": "waybill order service",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "Commands write events and their outbox rows in one transaction; the relay publishes them to NATS JetStream. Errors are RFC 9457 problem details, including 404 for an unknown route, 405 for a method a route does not take and 503 for a request over the request timeout. /metrics and /health are served on the separate --metrics-listen address (components.pathItems Health and Metrics)."
        },
        "servers": [{"url": "/"}],
        "paths": {
            "/orders": {"post": {
                "operationId": "placeOrder",
                "summary": "Place an order",
                "parameters": [{"$ref": "#/components/parameters/IdempotencyKey"}, {"$ref": "#/components/parameters/CorrelationId"}],
                "requestBody": {"required": true, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/PlaceRequest"}}}},
                "responses": place
            }},
            "/orders/{id}": {"get": {
                "operationId": "getOrder",
                "summary": "Read an order as folded from its events",
                "parameters": [{"$ref": "#/components/parameters/OrderId"}],
                "responses": show
            }},
            "/orders/{id}/pay": {"post": command("payOrder", "Pay an order; the amount must equal the total", "PayRequest")},
            "/orders/{id}/cancel": {"post": command("cancelOrder", "Cancel a placed or paid order (a refund if paid)", "CancelRequest")},
            "/orders/{id}/ship": {"post": command("shipOrder", "Ship a paid order", "ShipRequest")},
            "/openapi.json": {"get": {
                "operationId": "getOpenApiDocument",
                "summary": "This document",
                "responses": {"200": {"description": "OpenAPI 3.1", "content": {"application/json": {"schema": {"type": "object", "required": ["openapi", "info", "paths"]}}}}}
            }}
        },
        "components": {
            "pathItems": telemetry(),
            "headers": {
                "ETag": {"description": "The order's version as a strong entity tag (\"3\"), for If-Match", "required": true, "schema": {"type": "string"}},
                "Location": {"description": "The placed order: /orders/{id}", "required": true, "schema": {"type": "string"}},
                "EventId": {"description": "The first event the command recorded (for a replay, the one the first request recorded)", "required": true, "schema": {"type": "string", "format": "uuid"}},
                "IdempotentReplayed": {"description": "Present, as true, only on the answer to a retry with an Idempotency-Key already used for the same request; nothing was written", "required": false, "schema": {"type": "string", "enum": ["true"]}}
            },
            "parameters": {
                "OrderId": {"name": "id", "in": "path", "required": true, "schema": {"type": "string", "format": "uuid"}},
                "IfMatch": {"name": "If-Match", "in": "header", "required": false, "description": "Apply only at this version (the ETag of a read)", "schema": {"type": "string"}},
                "IdempotencyKey": {"name": "Idempotency-Key", "in": "header", "required": false, "description": "A retry with the same key and body returns the first result", "schema": {"type": "string", "minLength": 1, "maxLength": 200}},
                "CorrelationId": {"name": "X-Correlation-Id", "in": "header", "required": false, "schema": {"type": "string", "format": "uuid"}}
            },
            "schemas": {
                "Line": {"type": "object", "additionalProperties": false, "required": ["sku", "quantity", "unit_price_cents"], "properties": {
                    "sku": string("^[A-Z0-9_-]{1,32}$"),
                    "quantity": int64(Some(1), Some(1_000_000)),
                    "unit_price_cents": int64(Some(1), Some(1_000_000_000_000))
                }},
                "PlaceRequest": {"type": "object", "additionalProperties": false, "required": ["customer_id", "currency", "lines"], "properties": {
                    "customer_id": string("^[A-Za-z0-9._:-]{1,64}$"),
                    "currency": string("^[A-Z]{3}$"),
                    "lines": {"type": "array", "minItems": 1, "maxItems": 500, "items": {"$ref": "#/components/schemas/Line"}},
                    "channel": {"type": "string", "enum": domain::Channel::ALL.map(domain::Channel::as_str), "default": "web",
                        "description": "Where the order is placed (order.placed v3). A service started with --write-version order.placed=2 refuses every channel but web with 422: v2 cannot carry it."}
                }},
                "PayRequest": {"type": "object", "additionalProperties": false, "required": ["amount_cents"], "properties": {
                    "amount_cents": int64(Some(1), None), "payment_ref": {"type": ["string", "null"], "maxLength": 200}
                }},
                "CancelRequest": {"type": "object", "additionalProperties": false, "properties": {"reason": {"type": ["string", "null"], "maxLength": 200}}},
                "ShipRequest": {"type": "object", "additionalProperties": false, "required": ["carrier", "tracking_number"], "properties": {
                    "carrier": {"type": "string", "minLength": 1, "maxLength": 200}, "tracking_number": {"type": "string", "minLength": 1, "maxLength": 200}
                }},
                // Every field is always serialized (domain::Order has no skip_serializing_if); the
                // nullable ones say so in their type instead of being optional.
                "Order": {"type": "object", "additionalProperties": false, "required": [
                    "order_id", "version", "status", "customer_id", "currency", "lines", "total_cents",
                    "channel", "paid_cents", "payment_ref", "cancel_reason", "carrier", "tracking_number"
                ], "properties": {
                    "order_id": {"type": "string", "format": "uuid"},
                    "version": int64(Some(1), None),
                    "status": {"type": "string", "enum": ["placed", "paid", "shipped", "cancelled"]},
                    "customer_id": {"type": ["string", "null"]},
                    "currency": {"type": ["string", "null"]},
                    "lines": {"type": "array", "items": {"$ref": "#/components/schemas/Line"}},
                    "total_cents": int64(Some(0), None),
                    "channel": {"type": ["string", "null"], "enum": [null, "web", "app", "store", "phone", "marketplace"]},
                    "paid_cents": int64(Some(0), None),
                    "payment_ref": {"type": ["string", "null"]},
                    "cancel_reason": {"type": ["string", "null"]},
                    "carrier": {"type": ["string", "null"]},
                    "tracking_number": {"type": ["string", "null"]}
                }, "examples": [order_example()]},
                "Problem": {"type": "object", "required": ["type", "title", "status", "detail"], "properties": {
                    "type": {"type": "string"}, "title": {"type": "string"}, "status": {"type": "integer", "minimum": 400, "maximum": 599}, "detail": {"type": "string"}
                }},
                "Health": {"type": "object", "required": ["database"], "properties": {
                    "database": {"type": "boolean", "description": "Whether SELECT 1 succeeded"}
                }},
                "RegisterCustomerRequest": {"type": "object", "additionalProperties": false, "required": ["customer_id", "name"], "properties": {
                    "customer_id": string("^[A-Za-z0-9._:-]{1,64}$"),
                    "name": {"type": "string", "minLength": 1, "maxLength": 200}
                }},
                "RenameCustomerRequest": {"type": "object", "additionalProperties": false, "required": ["name"], "properties": {
                    "name": {"type": "string", "minLength": 1, "maxLength": 200}
                }},
                "Customer": {"type": "object", "additionalProperties": false, "required": ["key", "version", "customer_id", "name"], "properties": {
                    "key": {"type": "string", "format": "uuid", "description": "The customer's aggregate id: UUID v5 of its handle"},
                    "version": int64(Some(1), None),
                    "customer_id": {"type": ["string", "null"]},
                    "name": {"type": ["string", "null"]}
                }}
            }
        }
    });
    if let (Some(paths), Value::Object(customers)) =
        (document["paths"].as_object_mut(), customer_paths())
    {
        paths.extend(customers);
    }
    document["components"]["parameters"]["CustomerHandle"] = json!({
        "name": "customer_id", "in": "path", "required": true,
        "schema": {"type": "string", "pattern": "^[A-Za-z0-9._:-]{1,64}$"}
    });
    document
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_document_lists_exactly_the_operations() {
        let document = document();
        let mut listed: Vec<(String, String)> = document["paths"]
            .as_object()
            .into_iter()
            .flatten()
            .flat_map(|(path, ops)| {
                ops.as_object()
                    .into_iter()
                    .flatten()
                    .map(move |(m, _)| (m.clone(), path.clone()))
            })
            .collect();
        listed.sort();
        let mut expected: Vec<(String, String)> = OPERATIONS
            .iter()
            .map(|(m, p)| (m.to_string(), p.to_string()))
            .collect();
        expected.sort();
        assert_eq!(listed, expected);
    }

    /// Generated clients name their methods after `operationId`: each must exist and be unique, in
    /// `paths` and in the telemetry path items alike.
    #[test]
    fn every_operation_has_its_own_operation_id() {
        let document = document();
        let items = document["paths"]
            .as_object()
            .into_iter()
            .chain(document["components"]["pathItems"].as_object())
            .flatten();
        let mut ids = Vec::new();
        for (name, item) in items {
            for method in ["get", "post", "put", "patch", "delete"] {
                if let Some(operation) = item.get(method) {
                    let id = operation["operationId"].as_str();
                    assert!(id.is_some(), "{method} {name} has no operationId");
                    ids.extend(id);
                }
            }
        }
        let count = ids.len();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), count, "duplicate operationId in {ids:?}");
    }
}
