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
use uuid::Uuid;

use super::body::{Body, is_json, not_json, parse_json, read_body};
use super::headers::{context, if_match, order_id, with_etag};
use super::problem::{Problem, command_problem, load_problem};
use super::{created, respond};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct PlaceRequest {
    customer_id: String,
    currency: String,
    lines: Vec<LineRequest>,
    /// `web` when absent.
    #[serde(default)]
    channel: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct LineRequest {
    sku: String,
    quantity: i64,
    unit_price_cents: i64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct PayRequest {
    amount_cents: i64,
    #[serde(default)]
    payment_ref: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct CancelRequest {
    #[serde(default)]
    reason: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ShipRequest {
    carrier: String,
    tracking_number: String,
}

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
