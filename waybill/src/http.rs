//! The HTTP order service (`waybill serve`): place, pay, cancel, ship and read orders over JSON, with
//! `Idempotency-Key` retries, `ETag`/`If-Match` optimistic locking, and RFC 9457 problem details.

use std::net::SocketAddr;
use std::time::Instant;

use axum::extract::{DefaultBodyLimit, FromRequest, MatchedPath, Path, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use domain::{
    CancelOrder, Cents, Currency, CustomerId, Note, Order, OrderCommand, OrderError, OrderId,
    OrderLine, OrderStatus, PayOrder, PlaceOrder, Quantity, ShipOrder, Sku, ValueError,
};
use serde::Deserialize;
use serde_json::json;
use store::{CommandContext, CommandError, CommandOutcome, EventStore};
use uuid::Uuid;

/// Request bodies larger than this are refused with 413 (500 lines fit in about 40 KiB).
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// The service's routes, with the telemetry routes of `telemetry` merged in.
pub fn router(store: EventStore, telemetry: Router) -> Router {
    Router::new()
        .route("/orders", post(place))
        .route("/orders/{id}", get(show))
        .route("/orders/{id}/pay", post(pay))
        .route("/orders/{id}/cancel", post(cancel))
        .route("/orders/{id}/ship", post(ship))
        .route(
            "/openapi.json",
            get(|| async { Json(crate::openapi::document()) }),
        )
        .fallback(|| async { Problem::new(StatusCode::NOT_FOUND, "not-found", "no such route") })
        .method_not_allowed_fallback(|| async {
            Problem::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "method-not-allowed",
                "this route does not take that method",
            )
        })
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(store)
        .merge(telemetry)
        .layer(middleware::from_fn(observe))
}

/// Serves `router` on `listen` until `shutdown` resolves.
pub async fn serve(
    listen: SocketAddr,
    router: Router,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(listen).await?;
    tracing::info!(address = %listener.local_addr()?, "order service listening");
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown)
        .await?;
    Ok(())
}

/// An RFC 9457 problem: `application/problem+json` with a type, a title, the status and a detail.
#[derive(Debug)]
pub struct Problem {
    status: StatusCode,
    kind: &'static str,
    detail: String,
}

impl Problem {
    fn new(status: StatusCode, kind: &'static str, detail: impl Into<String>) -> Self {
        Self {
            status,
            kind,
            detail: detail.into(),
        }
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let body = json!({
            "type": format!("urn:waybill:problem:{}", self.kind),
            "title": self.status.canonical_reason().unwrap_or("error"),
            "status": self.status.as_u16(),
            "detail": self.detail,
        });
        let mut response = (self.status, Json(body)).into_response();
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        response
    }
}

impl From<ValueError> for Problem {
    fn from(error: ValueError) -> Self {
        Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid-value",
            error.to_string(),
        )
    }
}

impl From<CommandError> for Problem {
    fn from(error: CommandError) -> Self {
        let detail = error.to_string();
        match error {
            CommandError::Refused(OrderError::NotFound(_)) => {
                Problem::new(StatusCode::NOT_FOUND, "order-not-found", detail)
            }
            CommandError::Refused(
                OrderError::IllegalTransition { .. }
                | OrderError::AlreadyPaid(_)
                | OrderError::AlreadyPlaced(_),
            ) => Problem::new(StatusCode::CONFLICT, "illegal-transition", detail),
            CommandError::Refused(_) => {
                Problem::new(StatusCode::UNPROCESSABLE_ENTITY, "rule-refused", detail)
            }
            CommandError::StaleVersion { .. } => {
                Problem::new(StatusCode::PRECONDITION_FAILED, "stale-version", detail)
            }
            CommandError::Conflict { .. } => {
                Problem::new(StatusCode::CONFLICT, "version-conflict", detail)
            }
            CommandError::KeyReused(_) => Problem::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "idempotency-key-reused",
                detail,
            ),
            CommandError::InvalidKey => {
                Problem::new(StatusCode::BAD_REQUEST, "invalid-idempotency-key", detail)
            }
            other => {
                tracing::error!(error = %other, "command failed");
                Problem::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal",
                    "the command could not be completed; retry later",
                )
            }
        }
    }
}

/// `Json<T>` whose rejections are problems: 400 for a body that is not the expected JSON, 413 for one
/// too large, 415 without a JSON content type.
pub struct Body<T>(T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned> FromRequest<S> for Body<T> {
    type Rejection = Problem;

    async fn from_request(request: Request, state: &S) -> Result<Self, Problem> {
        match Json::<T>::from_request(request, state).await {
            Ok(Json(value)) => Ok(Body(value)),
            Err(rejection) => Err(match rejection.status() {
                StatusCode::PAYLOAD_TOO_LARGE => Problem::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "body-too-large",
                    format!("the request body is larger than {MAX_BODY_BYTES} bytes"),
                ),
                StatusCode::UNSUPPORTED_MEDIA_TYPE => Problem::new(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "not-json",
                    "send the body as application/json",
                ),
                _ => Problem::new(
                    StatusCode::BAD_REQUEST,
                    "malformed-body",
                    rejection.body_text(),
                ),
            }),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PlaceRequest {
    customer_id: String,
    currency: String,
    lines: Vec<LineRequest>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LineRequest {
    sku: String,
    quantity: i64,
    unit_price_cents: i64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PayRequest {
    amount_cents: i64,
    #[serde(default)]
    payment_ref: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct CancelRequest {
    #[serde(default)]
    reason: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ShipRequest {
    carrier: String,
    tracking_number: String,
}

async fn place(
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
    });
    let id = OrderId::from_uuid(Uuid::now_v7());
    let outcome = store
        .execute(id, &command, &context(&headers, None)?)
        .await?;
    let location = format!("/orders/{}", outcome.order_id);
    let mut response = respond(StatusCode::CREATED, &outcome);
    if let Ok(value) = HeaderValue::from_str(&location) {
        response.headers_mut().insert(header::LOCATION, value);
    }
    Ok(response)
}

async fn show(
    State(store): State<EventStore>,
    Path(id): Path<String>,
) -> Result<Response, Problem> {
    let id = order_id(&id)?;
    let order = store.load(id).await.map_err(|error| {
        tracing::error!(%error, "loading an order failed");
        Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "the order could not be read",
        )
    })?;
    if order.status == OrderStatus::New {
        return Err(Problem::from(CommandError::Refused(OrderError::NotFound(
            id,
        ))));
    }
    Ok(with_etag(
        (StatusCode::OK, Json(&order)).into_response(),
        order.version,
    ))
}

async fn pay(
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

/// The body is optional here: an empty one cancels without a reason.
async fn cancel(
    store: State<EventStore>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Result<axum::body::Bytes, axum::extract::rejection::BytesRejection>,
) -> Result<Response, Problem> {
    let body = body.map_err(|rejection| match rejection.status() {
        StatusCode::PAYLOAD_TOO_LARGE => Problem::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body-too-large",
            format!("the request body is larger than {MAX_BODY_BYTES} bytes"),
        ),
        status => Problem::new(status, "malformed-body", rejection.body_text()),
    })?;
    let request: CancelRequest = if body.iter().all(u8::is_ascii_whitespace) {
        CancelRequest::default()
    } else {
        serde_json::from_slice(&body)
            .map_err(|e| Problem::new(StatusCode::BAD_REQUEST, "malformed-body", e.to_string()))?
    };
    let reason = request
        .reason
        .unwrap_or_else(|| "no reason given".to_owned());
    let command = OrderCommand::Cancel(CancelOrder {
        reason: Note::parse(&reason)?,
    });
    change(store, &id, &headers, command).await
}

async fn ship(
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
        .await?;
    Ok(respond(StatusCode::OK, &outcome))
}

fn respond(status: StatusCode, outcome: &CommandOutcome) -> Response {
    let order: &Order = &outcome.order;
    // The ETag describes the body: for a replayed request that is the order as it is now.
    let mut response = with_etag((status, Json(order)).into_response(), order.version);
    if let Some(event_id) = outcome
        .event_ids
        .first()
        .and_then(|e| HeaderValue::from_str(&e.to_string()).ok())
    {
        response.headers_mut().insert("event-id", event_id);
    }
    if outcome.replayed {
        response
            .headers_mut()
            .insert("idempotent-replayed", HeaderValue::from_static("true"));
    }
    response
}

fn with_etag(mut response: Response, version: i64) -> Response {
    if let Ok(value) = HeaderValue::from_str(&format!("\"{version}\"")) {
        response.headers_mut().insert(header::ETAG, value);
    }
    response
}

fn order_id(text: &str) -> Result<OrderId, Problem> {
    OrderId::parse(text)
        .map_err(|e| Problem::new(StatusCode::BAD_REQUEST, "malformed-order-id", e.to_string()))
}

/// The version an `If-Match` header requires (`"3"` or `W/"3"`); `*` or no header require none.
fn if_match(headers: &HeaderMap) -> Result<Option<i64>, Problem> {
    let Some(value) = headers.get(header::IF_MATCH) else {
        return Ok(None);
    };
    let text = value.to_str().unwrap_or("").trim();
    if text == "*" {
        return Ok(None);
    }
    text.trim_start_matches("W/")
        .trim_matches('"')
        .parse::<i64>()
        .map(Some)
        .map_err(|_| {
            Problem::new(
                StatusCode::BAD_REQUEST,
                "malformed-if-match",
                format!("If-Match {text:?} is not an ETag of this service, like \"3\""),
            )
        })
}

/// Idempotency key, correlation id and trace context from the request headers.
fn context(headers: &HeaderMap, expected_version: Option<i64>) -> Result<CommandContext, Problem> {
    // A header that is present but not visible ASCII is refused, not ignored: dropping an
    // Idempotency-Key would turn a retry into a second order.
    let text = |name: &'static str| -> Result<Option<String>, Problem> {
        match headers.get(name) {
            None => Ok(None),
            Some(value) => value.to_str().map(|v| Some(v.to_owned())).map_err(|_| {
                Problem::new(
                    StatusCode::BAD_REQUEST,
                    "malformed-header",
                    format!("header {name} must be visible ASCII"),
                )
            }),
        }
    };
    let correlation_id = match text("x-correlation-id")? {
        Some(value) => Some(Uuid::parse_str(&value).map_err(|_| {
            Problem::new(
                StatusCode::BAD_REQUEST,
                "malformed-correlation-id",
                "X-Correlation-Id must be a UUID",
            )
        })?),
        None => None,
    };
    Ok(CommandContext {
        idempotency_key: text("idempotency-key")?,
        expected_version,
        correlation_id,
        traceparent: text("traceparent")?.filter(|t| is_traceparent(t)),
    })
}

/// W3C trace context: `00-<32 hex>-<16 hex>-<2 hex>`.
fn is_traceparent(text: &str) -> bool {
    let parts: Vec<&str> = text.split('-').collect();
    parts.len() == 4
        && [2, 32, 16, 2]
            .iter()
            .zip(&parts)
            .all(|(len, part)| part.len() == *len && part.chars().all(|c| c.is_ascii_hexdigit()))
}

/// Logs every request and counts it by route and status.
async fn observe(request: Request, next: Next) -> Response {
    let started = Instant::now();
    let method = request.method().clone();
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_owned(), |p| p.as_str().to_owned());
    let response = next.run(request).await;
    let status = response.status().as_u16();
    metrics::counter!("waybill_http_requests_total", "method" => method.to_string(), "route" => route.clone(), "status" => status.to_string())
        .increment(1);
    metrics::histogram!("waybill_http_request_seconds", "route" => route.clone())
        .record(started.elapsed().as_secs_f64());
    tracing::info!(%method, %route, status, elapsed_ms = started.elapsed().as_millis() as u64, "request");
    response
}
