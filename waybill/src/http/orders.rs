//! The order's routes: place, pay, cancel, ship and read orders.

use axum::Json;
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use domain::{
    CancelOrder, Cents, Channel, Currency, CustomerId, Note, Order, OrderCommand, OrderError,
    OrderId, OrderLine, OrderStatus, PayOrder, PlaceOrder, Quantity, ShipOrder, Sku, ValueError,
};
use serde::Deserialize;
use store::{CommandError, EventStore};
use utoipa::ToSchema;
use uuid::Uuid;

use super::body::{Body, is_json, not_json, parse_json, read_body};
use super::headers::{ChangeHeaders, CreateHeaders, context, if_match, order_id, with_etag};
use super::problem::{PROBLEM_JSON, Problem, ProblemBody, command_problem, load_problem};
use super::schemas::{BodyRefused, Faults, OrderView, Replayed};
use super::{created, respond};

// The schemas' bounds are the domain's (`Sku`, `Quantity`, `Cents`, `Currency`, `CustomerId`,
// `Note`, `Order::MAX_LINES`); `openapi`'s tests check the numbers against its constants.

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct PlaceRequest {
    #[schema(pattern = "^[A-Za-z0-9._:-]{1,64}$")]
    customer_id: String,
    #[schema(pattern = "^[A-Z]{3}$")]
    currency: String,
    #[schema(min_items = 1, max_items = 500)]
    lines: Vec<LineRequest>,
    /// `web` when absent.
    #[serde(default)]
    #[schema(schema_with = super::schemas::channel)]
    channel: Option<String>,
}

// One line of an order, in a request and in the order shown.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = Line)]
pub(crate) struct LineRequest {
    #[schema(pattern = "^[A-Z0-9_-]{1,32}$")]
    sku: String,
    #[schema(minimum = 1, maximum = 1_000_000)]
    quantity: i64,
    #[schema(minimum = 1, maximum = 1_000_000_000_000_i64)]
    unit_price_cents: i64,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct PayRequest {
    #[schema(minimum = 1)]
    amount_cents: i64,
    #[serde(default)]
    #[schema(max_length = 200)]
    payment_ref: Option<String>,
}

#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct CancelRequest {
    #[serde(default)]
    #[schema(max_length = 200)]
    reason: Option<String>,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct ShipRequest {
    #[schema(min_length = 1, max_length = 200)]
    carrier: String,
    #[schema(min_length = 1, max_length = 200)]
    tracking_number: String,
}

/// The 200 of pay, cancel and ship.
const CHANGED: &str = "The order after the command (also the answer to a retry with the same \
                       Idempotency-Key, marked Idempotent-Replayed: true)";

/// The answers of pay, cancel and ship besides the order.
#[derive(utoipa::IntoResponses)]
#[allow(
    dead_code,
    reason = "a list of responses for the document, never built"
)]
pub(crate) enum Refused {
    /// Malformed body, order id, If-Match, Idempotency-Key or X-Correlation-Id
    #[response(status = 400, content_type = "application/problem+json")]
    Malformed(ProblemBody),
    /// Unknown order
    #[response(status = 404, content_type = "application/problem+json")]
    NotFound(ProblemBody),
    /// Illegal transition, or a race lost too often
    #[response(status = 409, content_type = "application/problem+json")]
    Conflict(ProblemBody),
    /// If-Match names a version the order is no longer at, or is a weak tag
    #[response(status = 412, content_type = "application/problem+json")]
    Stale(ProblemBody),
    /// A refused domain rule or invalid value, or an Idempotency-Key reused for another request
    #[response(status = 422, content_type = "application/problem+json")]
    Invalid(ProblemBody),
}

#[utoipa::path(
    post,
    path = "/orders",
    operation_id = "placeOrder",
    summary = "Place an order",
    params(CreateHeaders),
    request_body = PlaceRequest,
    responses(
        (status = 201, description = "The placed order (also the answer to a retry with the same Idempotency-Key, marked Idempotent-Replayed: true)", body = OrderView, headers(
            ("ETag" = String, description = "The order's version as a strong entity tag (\"3\"), for If-Match"),
            ("Location" = String, description = "The placed order: /orders/{id}"),
            ("Event-Id" = Uuid, description = "The first event the command recorded (for a replay, the one the first request recorded)"),
            ("Idempotent-Replayed" = inline(Replayed), description = "Present, as true, only on the answer to a retry with an Idempotency-Key already used for the same request; nothing was written"),
        )),
        (status = 400, description = "Malformed body, Idempotency-Key or X-Correlation-Id", body = ProblemBody, content_type = PROBLEM_JSON),
        BodyRefused,
        (status = 422, description = "A refused domain rule or invalid value, or an Idempotency-Key reused for another request", body = ProblemBody, content_type = PROBLEM_JSON),
        Faults,
    )
)]
pub(crate) async fn place(
    State(store): State<EventStore>,
    headers: HeaderMap,
    Body(body): Body<PlaceRequest>,
) -> Result<Response, Problem> {
    let lines = body
        .lines
        .into_iter()
        .map(|l| {
            Ok(OrderLine {
                sku: Sku::parse(&l.sku)?,
                quantity: Quantity::new(l.quantity)?,
                unit_price_cents: Cents::new(l.unit_price_cents)?,
            })
        })
        .collect::<Result<Vec<_>, ValueError>>()?;
    let command = OrderCommand::Place(PlaceOrder {
        customer_id: CustomerId::parse(&body.customer_id)?,
        currency: Currency::parse(&body.currency)?,
        lines,
        channel: match body.channel.as_deref() {
            Some(channel) => Channel::parse(channel)?,
            None => Channel::default(),
        },
    });
    let id = OrderId::from_uuid(Uuid::now_v7());
    let outcome = store
        .execute(id, &command, &context(&headers, None)?)
        .await
        .map_err(command_problem::<Order>)?;
    Ok(created(
        &format!("/orders/{}", outcome.id),
        respond(StatusCode::CREATED, &outcome),
    ))
}

#[utoipa::path(
    get,
    path = "/orders/{id}",
    operation_id = "getOrder",
    summary = "Read an order as folded from its events",
    params(("id" = Uuid, Path)),
    responses(
        (status = 200, description = "The order", body = OrderView, headers(
            ("ETag" = String, description = "The order's version as a strong entity tag (\"3\"), for If-Match"),
        )),
        (status = 400, description = "Malformed order id", body = ProblemBody, content_type = PROBLEM_JSON),
        (status = 404, description = "Unknown order", body = ProblemBody, content_type = PROBLEM_JSON),
        Faults,
    )
)]
pub(crate) async fn show(
    State(store): State<EventStore>,
    Path(id): Path<String>,
) -> Result<Response, Problem> {
    let id = order_id(&id)?;
    let order = store
        .load(id)
        .await
        .map_err(|error| load_problem(&error, "order"))?;
    // Unknown, or the id of another aggregate type: the order does not exist.
    if order.status == OrderStatus::New {
        return Err(command_problem::<Order>(CommandError::Refused(
            OrderError::NotFound(id),
        )));
    }
    Ok(with_etag(
        (StatusCode::OK, Json(&order)).into_response(),
        order.version,
    ))
}

#[utoipa::path(
    post,
    path = "/orders/{id}/pay",
    operation_id = "payOrder",
    summary = "Pay an order; the amount must equal the total",
    params(("id" = Uuid, Path), ChangeHeaders),
    request_body = PayRequest,
    responses(
        (status = 200, description = CHANGED, body = OrderView, headers(
            ("ETag" = String, description = "The order's version as a strong entity tag (\"3\"), for If-Match"),
            ("Event-Id" = Uuid, description = "The first event the command recorded (for a replay, the one the first request recorded)"),
            ("Idempotent-Replayed" = inline(Replayed), description = "Present, as true, only on the answer to a retry with an Idempotency-Key already used for the same request; nothing was written"),
        )),
        Refused,
        BodyRefused,
        Faults,
    )
)]
pub(crate) async fn pay(
    store: State<EventStore>,
    Path(id): Path<String>,
    headers: HeaderMap,
    Body(body): Body<PayRequest>,
) -> Result<Response, Problem> {
    let command = OrderCommand::Pay(PayOrder {
        amount_cents: Cents::new(body.amount_cents)?,
        payment_ref: body.payment_ref.as_deref().map(Note::parse).transpose()?,
    });
    change(store, &id, &headers, command).await
}

#[utoipa::path(
    post,
    path = "/orders/{id}/cancel",
    operation_id = "cancelOrder",
    summary = "Cancel a placed or paid order (a refund if paid)",
    params(("id" = Uuid, Path), ChangeHeaders),
    request_body = Option<CancelRequest>,
    responses(
        (status = 200, description = CHANGED, body = OrderView, headers(
            ("ETag" = String, description = "The order's version as a strong entity tag (\"3\"), for If-Match"),
            ("Event-Id" = Uuid, description = "The first event the command recorded (for a replay, the one the first request recorded)"),
            ("Idempotent-Replayed" = inline(Replayed), description = "Present, as true, only on the answer to a retry with an Idempotency-Key already used for the same request; nothing was written"),
        )),
        Refused,
        BodyRefused,
        Faults,
    )
)]
/// The body is optional here: an empty one cancels without a reason; any other must be JSON.
pub(crate) async fn cancel(
    store: State<EventStore>,
    Path(id): Path<String>,
    headers: HeaderMap,
    request: Request,
) -> Result<Response, Problem> {
    let body = read_body(request, &()).await?;
    let request: CancelRequest = if body.iter().all(u8::is_ascii_whitespace) {
        CancelRequest::default()
    } else if !is_json(&headers) {
        return Err(not_json());
    } else {
        parse_json(&body)?
    };
    let reason = request
        .reason
        .unwrap_or_else(|| "no reason given".to_owned());
    let command = OrderCommand::Cancel(CancelOrder {
        reason: Note::parse(&reason)?,
    });
    change(store, &id, &headers, command).await
}

#[utoipa::path(
    post,
    path = "/orders/{id}/ship",
    operation_id = "shipOrder",
    summary = "Ship a paid order",
    params(("id" = Uuid, Path), ChangeHeaders),
    request_body = ShipRequest,
    responses(
        (status = 200, description = CHANGED, body = OrderView, headers(
            ("ETag" = String, description = "The order's version as a strong entity tag (\"3\"), for If-Match"),
            ("Event-Id" = Uuid, description = "The first event the command recorded (for a replay, the one the first request recorded)"),
            ("Idempotent-Replayed" = inline(Replayed), description = "Present, as true, only on the answer to a retry with an Idempotency-Key already used for the same request; nothing was written"),
        )),
        Refused,
        BodyRefused,
        Faults,
    )
)]
pub(crate) async fn ship(
    store: State<EventStore>,
    Path(id): Path<String>,
    headers: HeaderMap,
    Body(body): Body<ShipRequest>,
) -> Result<Response, Problem> {
    let command = OrderCommand::Ship(ShipOrder {
        carrier: Note::required("carrier", &body.carrier)?,
        tracking_number: Note::required("tracking number", &body.tracking_number)?,
    });
    change(store, &id, &headers, command).await
}

async fn change(
    State(store): State<EventStore>,
    id: &str,
    headers: &HeaderMap,
    command: OrderCommand,
) -> Result<Response, Problem> {
    let id = order_id(id)?;
    let expected = if_match(headers)?;
    let outcome = store
        .execute(id, &command, &context(headers, expected)?)
        .await
        .map_err(command_problem::<Order>)?;
    Ok(respond(StatusCode::OK, &outcome))
}
