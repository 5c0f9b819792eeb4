//! The OpenAPI schemas of what the service sends but does not define — the order and the customer as
//! `domain` folds them — and the answers every route shares (faults, refused bodies); each request
//! type carries its own schema beside its handler.

use domain::{Channel, OrderStatus};
use serde_json::Value;
use utoipa::openapi::schema::{Object, ObjectBuilder, Type};
use utoipa::{IntoResponses, ToSchema};

use super::orders::LineRequest;
use super::problem::ProblemBody;

// `domain::Order` as the service serializes it. A thin mirror, because `domain` knows nothing of
// HTTP: `tests/openapi_contract.rs` validates real answers against it (no field may be missing or
// undocumented), and `openapi`'s tests compare its fields with a serialized order. (Comments, not
// doc comments: utoipa would make those the schema's description.)
//
// Every field is always sent (`domain::Order` skips none); the nullable ones say so in their type
// and are required all the same. `deny_unknown_fields` is how utoipa is told
// `additionalProperties: false` (nothing deserializes these types).
#[derive(ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = Order, examples(order_example))]
#[allow(dead_code, reason = "a schema only: the body sent is domain::Order")]
pub(crate) struct OrderView {
    order_id: uuid::Uuid,
    /// How many events the order has (its `ETag`).
    #[schema(minimum = 1)]
    version: i64,
    #[schema(schema_with = order_status)]
    status: String,
    #[schema(required = true)]
    customer_id: Option<String>,
    #[schema(required = true)]
    currency: Option<String>,
    lines: Vec<LineRequest>,
    #[schema(minimum = 0)]
    total_cents: i64,
    #[schema(schema_with = channel_or_null, required = true)]
    channel: Option<String>,
    #[schema(minimum = 0)]
    paid_cents: i64,
    #[schema(required = true)]
    payment_ref: Option<String>,
    #[schema(required = true)]
    cancel_reason: Option<String>,
    #[schema(required = true)]
    carrier: Option<String>,
    #[schema(required = true)]
    tracking_number: Option<String>,
}

// `domain::Customer` as the service serializes it (a mirror, as `OrderView` is).
#[derive(ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = Customer)]
#[allow(dead_code, reason = "a schema only: the body sent is domain::Customer")]
pub(crate) struct CustomerView {
    /// The customer's aggregate id: UUID v5 of its handle
    key: uuid::Uuid,
    /// How many events the customer has (its `ETag`).
    #[schema(minimum = 1)]
    version: i64,
    #[schema(required = true)]
    customer_id: Option<String>,
    #[schema(required = true)]
    name: Option<String>,
}

/// What the order view looks like.
fn order_example() -> Value {
    serde_json::json!({
        "order_id": "0190a0b1-0000-7000-8000-00000000a002", "version": 2, "status": "paid",
        "customer_id": "alice", "currency": "EUR",
        "lines": [{"sku": "MUG-BLUE", "quantity": 2, "unit_price_cents": 1250}],
        "total_cents": 2500, "channel": "web", "paid_cents": 2500, "payment_ref": "psp-1",
        "cancel_reason": null, "carrier": null, "tracking_number": null
    })
}

/// The statuses an order is shown in, spelt as `domain` serializes them: every one but `new`, since
/// an order without events is not found. The match fails to compile when `domain` gains a status.
fn order_status() -> Object {
    let shown = |status: OrderStatus| match status {
        OrderStatus::New => None,
        OrderStatus::Placed | OrderStatus::Paid | OrderStatus::Shipped | OrderStatus::Cancelled => {
            serde_json::to_value(status).ok()
        }
    };
    let all = [
        OrderStatus::New,
        OrderStatus::Placed,
        OrderStatus::Paid,
        OrderStatus::Shipped,
        OrderStatus::Cancelled,
    ];
    ObjectBuilder::new()
        .schema_type(Type::String)
        .enum_values(Some(all.into_iter().filter_map(shown)))
        .build()
}

/// An order's channel: `null` before it is placed, then one of `domain::Channel::ALL`.
fn channel_or_null() -> Object {
    let names = Channel::ALL.map(|c| Value::from(c.as_str()));
    ObjectBuilder::new()
        .schema_type(
            [Type::String, Type::Null]
                .into_iter()
                .collect::<utoipa::openapi::schema::SchemaType>(),
        )
        .enum_values(Some(std::iter::once(Value::Null).chain(names)))
        .build()
}

/// The channel a place request may name, `web` when it names none.
pub(crate) fn channel() -> Object {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .enum_values(Some(Channel::ALL.map(Channel::as_str)))
        .default(Some(Value::from(Channel::default().as_str())))
        .description(Some(
            "Where the order is placed (order.placed v3). A service started with --write-version \
             order.placed=2 refuses every channel but web with 422: v2 cannot carry it.",
        ))
        .build()
}

/// The problems every route that reads or writes an aggregate can answer besides its own.
#[derive(IntoResponses)]
#[allow(
    dead_code,
    reason = "a list of responses for the document, never built"
)]
pub(crate) enum Faults {
    /// The request could not be completed (a database fault); retry later
    #[response(status = 500, content_type = "application/problem+json")]
    Internal(ProblemBody),
    #[response(
        status = 503,
        content_type = "application/problem+json",
        description = "The request was not completed within the request timeout, or the order \
                       holds an event written by a newer version of waybill (upgrade-required: \
                       upgrade this service), or another database session holds the order locked \
                       (order-locked, with Retry-After: nothing was written; retry then)"
    )]
    Unavailable(ProblemBody),
}

/// The refusals of a request body before it is parsed (`http::body`).
#[derive(IntoResponses)]
#[allow(
    dead_code,
    reason = "a list of responses for the document, never built"
)]
pub(crate) enum BodyRefused {
    /// Body too large
    #[response(status = 413, content_type = "application/problem+json")]
    TooLarge(ProblemBody),
    /// Body is not application/json
    #[response(status = 415, content_type = "application/problem+json")]
    NotJson(ProblemBody),
}

// `Idempotent-Replayed`: sent only as `true`.
#[derive(ToSchema)]
#[allow(
    dead_code,
    reason = "a schema only: the header is written as a static value"
)]
pub(crate) enum Replayed {
    #[serde(rename = "true")]
    True,
}
