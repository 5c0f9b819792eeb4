//! The OpenAPI 3.1 document of the order service, served at `/openapi.json`. A test checks that every
//! operation it lists is routed and that every route is listed.

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
    ("get", "/openapi.json"),
];

fn problem(description: &str) -> Value {
    json!({"description": description, "content": {"application/problem+json": {"schema": {"$ref": "#/components/schemas/Problem"}}}})
}

fn order(description: &str) -> Value {
    json!({
        "description": description,
        "headers": {
            "ETag": {"description": "The order's version, for If-Match", "schema": {"type": "string"}},
            "Event-Id": {"description": "The event the command recorded", "schema": {"type": "string", "format": "uuid"}}
        },
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Order"}}}
    })
}

fn command(summary: &str, body: &str, extra: &[(&str, Value)]) -> Value {
    let mut responses = json!({
        "200": order("The order after the command"),
        "400": problem("Malformed body, order id, If-Match or header"),
        "404": problem("Unknown order"),
        "409": problem("Illegal transition, or a race lost too often"),
        "412": problem("If-Match names a version the order is no longer at, or is a weak tag"),
        "413": problem("Body too large"),
        "415": problem("Body is not application/json"),
        "422": problem("A refused domain rule or invalid value"),
    });
    for (status, response) in extra {
        responses[*status] = response.clone();
    }
    json!({
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

/// What the order view looks like.
fn order_example() -> Value {
    json!({
        "order_id": "0190a0b1-0000-7000-8000-00000000a002", "version": 2, "status": "paid",
        "customer_id": "alice", "currency": "EUR",
        "lines": [{"sku": "MUG-BLUE", "quantity": 2, "unit_price_cents": 1250}],
        "total_cents": 2500, "paid_cents": 2500, "payment_ref": "psp-1",
        "cancel_reason": null, "carrier": null, "tracking_number": null
    })
}

/// The document.
pub fn document() -> Value {
    let string = |pattern: &str| json!({"type": "string", "pattern": pattern});
    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "waybill order service",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "Commands write events and their outbox rows in one transaction; the relay publishes them to NATS JetStream. Errors are RFC 9457 problem details, including 404 for an unknown route, 405 for a method a route does not take and 503 for a request over the request timeout. /metrics and /health are served on the separate --metrics-listen address."
        },
        "paths": {
            "/orders": {"post": {
                "summary": "Place an order",
                "parameters": [{"$ref": "#/components/parameters/IdempotencyKey"}, {"$ref": "#/components/parameters/CorrelationId"}],
                "requestBody": {"required": true, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/PlaceRequest"}}}},
                "responses": {
                    "201": order("The placed order (also the answer to a retry with the same Idempotency-Key, marked Idempotent-Replayed: true)"),
                    "400": problem("Malformed body"),
                    "413": problem("Body too large"),
                    "415": problem("Body is not application/json"),
                    "422": problem("A refused domain rule or invalid value, or an Idempotency-Key reused for another request")
                }
            }},
            "/orders/{id}": {"get": {
                "summary": "Read an order as folded from its events",
                "parameters": [{"$ref": "#/components/parameters/OrderId"}],
                "responses": {"200": order("The order"), "400": problem("Malformed order id"), "404": problem("Unknown order")}
            }},
            "/orders/{id}/pay": {"post": command("Pay an order; the amount must equal the total", "PayRequest", &[])},
            "/orders/{id}/cancel": {"post": command("Cancel a placed or paid order (a refund if paid)", "CancelRequest", &[])},
            "/orders/{id}/ship": {"post": command("Ship a paid order", "ShipRequest", &[])},
            "/openapi.json": {"get": {"summary": "This document", "responses": {"200": {"description": "OpenAPI 3.1"}}}}
        },
        "components": {
            "parameters": {
                "OrderId": {"name": "id", "in": "path", "required": true, "schema": {"type": "string", "format": "uuid"}},
                "IfMatch": {"name": "If-Match", "in": "header", "required": false, "description": "Apply only at this version (the ETag of a read)", "schema": {"type": "string"}},
                "IdempotencyKey": {"name": "Idempotency-Key", "in": "header", "required": false, "description": "A retry with the same key and body returns the first result", "schema": {"type": "string", "minLength": 1, "maxLength": 200}},
                "CorrelationId": {"name": "X-Correlation-Id", "in": "header", "required": false, "schema": {"type": "string", "format": "uuid"}}
            },
            "schemas": {
                "Line": {"type": "object", "additionalProperties": false, "required": ["sku", "quantity", "unit_price_cents"], "properties": {
                    "sku": string("^[A-Z0-9_-]{1,32}$"),
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 1_000_000},
                    "unit_price_cents": {"type": "integer", "minimum": 1, "maximum": 1_000_000_000_000_i64}
                }},
                "PlaceRequest": {"type": "object", "additionalProperties": false, "required": ["customer_id", "currency", "lines"], "properties": {
                    "customer_id": string("^[A-Za-z0-9._:-]{1,64}$"),
                    "currency": string("^[A-Z]{3}$"),
                    "lines": {"type": "array", "minItems": 1, "maxItems": 500, "items": {"$ref": "#/components/schemas/Line"}}
                }},
                "PayRequest": {"type": "object", "additionalProperties": false, "required": ["amount_cents"], "properties": {
                    "amount_cents": {"type": "integer", "minimum": 1}, "payment_ref": {"type": ["string", "null"], "maxLength": 200}
                }},
                "CancelRequest": {"type": "object", "additionalProperties": false, "properties": {"reason": {"type": ["string", "null"], "maxLength": 200}}},
                "ShipRequest": {"type": "object", "additionalProperties": false, "required": ["carrier", "tracking_number"], "properties": {
                    "carrier": {"type": "string", "minLength": 1, "maxLength": 200}, "tracking_number": {"type": "string", "minLength": 1, "maxLength": 200}
                }},
                "Order": {"type": "object", "required": ["order_id", "version", "status", "lines", "total_cents"], "properties": {
                    "order_id": {"type": "string", "format": "uuid"},
                    "version": {"type": "integer"},
                    "status": {"type": "string", "enum": ["placed", "paid", "shipped", "cancelled"]},
                    "customer_id": {"type": ["string", "null"]},
                    "currency": {"type": ["string", "null"]},
                    "lines": {"type": "array", "items": {"$ref": "#/components/schemas/Line"}},
                    "total_cents": {"type": "integer"},
                    "paid_cents": {"type": "integer"},
                    "payment_ref": {"type": ["string", "null"]},
                    "cancel_reason": {"type": ["string", "null"]},
                    "carrier": {"type": ["string", "null"]},
                    "tracking_number": {"type": ["string", "null"]}
                }, "examples": [order_example()]},
                "Problem": {"type": "object", "required": ["type", "title", "status", "detail"], "properties": {
                    "type": {"type": "string"}, "title": {"type": "string"}, "status": {"type": "integer"}, "detail": {"type": "string"}
                }}
            }
        }
    })
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
}
