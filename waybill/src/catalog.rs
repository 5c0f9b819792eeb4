//! `waybill schema`: the event catalog — every payload's JSON Schema, and an AsyncAPI document of the
//! stream's subjects, headers and messages; `tool` runs the command and its subcommands (`show`,
//! `diff`), `diff` compares two versions of a payload.

pub(crate) mod diff;
pub(crate) mod tool;

use domain::catalog::{PayloadSchema, payload_schemas};
use domain::wire;
use serde_json::{Map, Value, json};

/// Every payload schema, as `{event_type: {version: schema}}`.
pub(crate) fn schemas() -> Value {
    let mut by_type = Map::new();
    for PayloadSchema {
        event_type,
        event_version,
        schema,
    } in payload_schemas()
    {
        let versions = by_type.entry(event_type).or_insert_with(|| json!({}));
        versions[event_version.to_string()] = schema;
    }
    Value::Object(by_type)
}

/// The AsyncAPI 2.6 document of the stream `stream` under `prefix`: one channel per aggregate type.
pub(crate) fn asyncapi(stream: &str, prefix: &str) -> Value {
    let mut channels = Map::new();
    let mut messages = Map::new();
    let mut payloads = Map::new();
    let all = payload_schemas();
    // Every event of an aggregate goes on the aggregate's own subject, whatever its type (the type is
    // in a header): one channel per aggregate type, whose messages are its (type, version) pairs.
    for kind in domain::AGGREGATES {
        let mut refs = Vec::new();
        for entry in all.iter().filter(|e| {
            domain::aggregate::aggregate_of_event(e.event_type).map(|k| k.name) == Some(kind.name)
        }) {
            let name = format!("{}.v{}", entry.event_type, entry.event_version);
            payloads.insert(name.clone(), entry.schema.clone());
            messages.insert(name.clone(), message(entry, kind.name, &name));
            refs.push(json!({"$ref": format!("#/components/messages/{name}")}));
        }
        let aggregate = kind.name;
        channels.insert(
            format!("{prefix}.{aggregate}.{{aggregateId}}"),
            json!({
                "description": format!(
                    "Every event of one {aggregate}, in aggregate_version order, each published with \
                     Nats-Expected-Last-Subject-Sequence = the stream sequence of its previous event. \
                     Subscribe to `{prefix}.{aggregate}.*` for every {aggregate}; route by the {} header.",
                    wire::EVENT_TYPE
                ),
                "parameters": {"aggregateId": {"description": format!("The {aggregate}'s id"), "schema": {"type": "string", "format": "uuid"}}},
                "subscribe": {"summary": format!("{aggregate} events, published by waybill-relay"), "message": {"oneOf": refs}},
            }),
        );
    }
    json!({
        "asyncapi": "2.6.0",
        "id": "urn:waybill:events",
        "info": {
            "title": "waybill events",
            "version": env!("CARGO_PKG_VERSION"),
            "description": format!(
                "Events of every aggregate type, relayed from the transactional outbox into the JetStream stream {stream} (subjects {}). \
                 Delivery is at least once: JetStream drops duplicates with the same Nats-Msg-Id (the event id) within \
                 its dedupe window, and consumers must be idempotent beyond it. Per aggregate, events are published in \
                 aggregate_version order.",
                wire::all_subjects(prefix)
            ),
        },
        "servers": {"local": {"url": "127.0.0.1:4222", "protocol": "nats", "description": "A local NATS server with JetStream"}},
        "defaultContentType": "application/json",
        "channels": channels,
        "components": {"messages": messages, "schemas": payloads, "messageTraits": {}},
    })
}

fn message(entry: &PayloadSchema, aggregate_type: &str, name: &str) -> Value {
    let constant = |v: Value| json!({"const": v});
    json!({
        // Generators name their types after it; unique across the document.
        "messageId": name,
        "name": name,
        "title": format!("{} version {}", entry.event_type, entry.event_version),
        "contentType": "application/json",
        "headers": {
            "type": "object",
            "required": [wire::MSG_ID, wire::EVENT_TYPE, wire::EVENT_VERSION, wire::AGGREGATE_ID, wire::AGGREGATE_VERSION],
            "properties": {
                wire::MSG_ID: {"type": "string", "format": "uuid", "description": "The event id; JetStream's dedupe key"},
                wire::EVENT_TYPE: constant(json!(entry.event_type)),
                wire::EVENT_VERSION: constant(json!(entry.event_version.to_string())),
                wire::AGGREGATE_ID: {"type": "string", "format": "uuid"},
                wire::AGGREGATE_VERSION: {"type": "string", "pattern": "^[1-9][0-9]*$", "description": "Position in the aggregate's stream: the order key"},
                "Nats-Expected-Last-Subject-Sequence": {"type": "string", "pattern": "^[0-9]+$", "description": "The fence: the stream sequence of the aggregate's previous event (0 for its first); JetStream refuses the message otherwise"},
                wire::TRACEPARENT: {"type": "string", "description": "W3C trace context, when the command carried one"},
            },
        },
        "payload": {
            "type": "object",
            "description": "The event envelope",
            "required": ["event_id", "event_type", "event_version", "aggregate_type", "aggregate_id", "aggregate_version", "occurred_at", "payload"],
            "properties": {
                "event_id": {"type": "string", "format": "uuid"},
                "event_type": constant(json!(entry.event_type)),
                "event_version": constant(json!(entry.event_version)),
                "aggregate_type": constant(json!(aggregate_type)),
                "aggregate_id": {"type": "string", "format": "uuid"},
                "aggregate_version": {"type": "integer", "minimum": 1},
                "occurred_at": {"type": "string", "format": "date-time"},
                "correlation_id": {"type": ["string", "null"], "format": "uuid"},
                "causation_id": {"type": ["string", "null"], "format": "uuid"},
                "payload": {"$ref": format!("#/components/schemas/{name}")},
            },
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_payload_version_is_a_message_on_its_aggregates_channel() {
        let document = asyncapi("WAYBILL_EVENTS", "waybill.events");
        let channels = document["channels"].as_object().expect("channels");
        assert_eq!(
            channels.keys().collect::<Vec<_>>(),
            [
                "waybill.events.customer.{aggregateId}",
                "waybill.events.order.{aggregateId}"
            ],
            "one subject per aggregate, whatever the event type"
        );
        let mut refs: Vec<String> = Vec::new();
        for channel in channels.values() {
            refs.extend(
                channel["subscribe"]["message"]["oneOf"]
                    .as_array()
                    .expect("oneOf")
                    .iter()
                    .filter_map(|r| r["$ref"].as_str().map(str::to_owned)),
            );
            let description = channel["description"].as_str().expect("description");
            assert!(!description.contains("  "), "{description:?}");
        }
        refs.sort();
        let mut expected: Vec<String> = payload_schemas()
            .iter()
            .map(|s| {
                format!(
                    "#/components/messages/{}.v{}",
                    s.event_type, s.event_version
                )
            })
            .collect();
        expected.sort();
        assert_eq!(refs, expected);
        let order = &document["channels"]["waybill.events.order.{aggregateId}"];
        assert!(
            order["subscribe"]["message"]["oneOf"]
                .as_array()
                .expect("oneOf")
                .iter()
                .all(|r| r["$ref"].as_str().is_some_and(|r| r.contains("/order.")))
        );
        assert_eq!(
            document["components"]["messages"]["customer.registered.v1"]["payload"]["properties"]["aggregate_type"]
                ["const"],
            "customer"
        );
        assert_eq!(schemas()["order.placed"]["2"]["title"], "order.placed v2");
        for (name, message) in document["components"]["messages"]
            .as_object()
            .expect("messages")
        {
            assert_eq!(
                message["messageId"],
                name.as_str(),
                "every message has its id"
            );
        }
    }
}
