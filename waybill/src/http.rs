//! The HTTP order service (`waybill serve`): place, pay, cancel, ship and read orders over JSON, with
//! `Idempotency-Key` retries, `ETag`/`If-Match` optimistic locking, and RFC 9457 problem details.

use std::time::Instant;

use axum::extract::{DefaultBodyLimit, FromRequest, MatchedPath, Path, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use domain::{
    CancelOrder, Cents, Channel, Currency, CustomerId, DecodeError, Note, Order, OrderCommand,
    OrderError, OrderId, OrderLine, OrderStatus, PayOrder, PlaceOrder, Quantity, ShipOrder, Sku,
    UpcastError, ValueError,
};
use serde::Deserialize;
use serde_json::json;
use store::{AppendError, CommandContext, CommandError, CommandOutcome, EventStore, LoadError};
use uuid::Uuid;

/// Request bodies larger than this are refused with 413 (500 lines fit in about 40 KiB).
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// The service's routes. `/metrics` and `/health` are not among them: they are served on their own
/// listener (`--metrics-listen`), apart from the public API.
pub fn router(store: EventStore) -> Router {
    describe_metrics();
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
        .layer(middleware::from_fn(observe))
}

/// An RFC 9457 problem: `application/problem+json` with a type, a title, the status and a detail.
#[derive(Debug)]
pub struct Problem {
    status: StatusCode,
    kind: &'static str,
    detail: String,
    /// Seconds for `Retry-After`: the condition is expected to pass.
    retry_after: Option<u32>,
}

impl Problem {
    fn new(status: StatusCode, kind: &'static str, detail: impl Into<String>) -> Self {
        Self {
            status,
            kind,
            detail: detail.into(),
            retry_after: None,
        }
    }

    fn retry_after(mut self, seconds: u32) -> Self {
        self.retry_after = Some(seconds);
        self
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
        if let Some(seconds) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        if self.status == StatusCode::PAYLOAD_TOO_LARGE {
            // The rest of the body is never read, so the connection cannot carry another request;
            // saying so keeps a client from sending its next request into a closing socket.
            response
                .headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
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
            // Another session holds the order: only its commands waited, and a retry once that
            // session ends succeeds. When it ends is unknown (another writer of the order commits
            // in milliseconds; a frozen one is ended by its idle timeout or an operator), so the
            // hint is short.
            CommandError::Locked { order_id } => {
                tracing::warn!(%order_id, "order locked by another transaction; answered 503");
                Problem::new(StatusCode::SERVICE_UNAVAILABLE, "order-locked", detail).retry_after(1)
            }
            CommandError::Append(AppendError::OutcomeUnknown { aggregate_id, .. }) => {
                tracing::error!(error = %ops::error_chain(&error), "command outcome unknown");
                Problem::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "outcome-unknown",
                    format!(
                        "the database connection broke while order {aggregate_id} was being \
                         written, and whether it was cannot be told yet: read /orders/{aggregate_id} \
                         before sending the command again"
                    ),
                )
            }
            CommandError::KeyReused(_) => Problem::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "idempotency-key-reused",
                detail,
            ),
            CommandError::InvalidKey => {
                Problem::new(StatusCode::BAD_REQUEST, "invalid-idempotency-key", detail)
            }
            CommandError::Unrepresentable(ref downcast) => Problem::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "unrepresentable-in-written-version",
                downcast.to_string(),
            ),
            CommandError::Load(ref load) if written_by_newer_code(load).is_some() => {
                upgrade_required(load)
            }
            other => {
                tracing::error!(error = %ops::error_chain(&other), "command failed");
                Problem::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal",
                    "the command could not be completed; retry later",
                )
            }
        }
    }
}

/// The event of an order that this code is too old to read, if that is why loading it failed.
fn written_by_newer_code(error: &LoadError) -> Option<&UpcastError> {
    match error {
        LoadError::Undecodable {
            source: DecodeError::Upcast(too_new @ UpcastError::TooNew { .. }),
            ..
        } => Some(too_new),
        _ => None,
    }
}

/// 503: the order has an event written by a newer version of the service (a rolling upgrade is
/// under way, or this instance was left behind). Retrying here cannot help; upgrading does.
fn upgrade_required(error: &LoadError) -> Problem {
    let what = written_by_newer_code(error).map_or_else(String::new, |e| format!(": {e}"));
    tracing::warn!(error = %ops::error_chain(error), "an order holds an event newer than this code");
    Problem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "upgrade-required",
        format!(
            "this order was written by a newer version of waybill than this service{what}; \
             upgrade this service (or send the request to an upgraded one)"
        ),
    )
}

/// A JSON body whose refusals are problems: 415 without a JSON content type, 413 for one too large,
/// 400 for one that is not the expected JSON, with a message that names the field and the rule.
#[derive(Debug)]
pub struct Body<T>(T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned> FromRequest<S> for Body<T> {
    type Rejection = Problem;

    async fn from_request(request: Request, state: &S) -> Result<Self, Problem> {
        if !is_json(request.headers()) {
            return Err(not_json());
        }
        let bytes = read_body(request, state).await?;
        parse_json(&bytes).map(Body)
    }
}

fn not_json() -> Problem {
    Problem::new(
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "not-json",
        "send the body as application/json",
    )
}

/// `application/json` or an `application/…+json` type, parameters aside.
fn is_json(headers: &HeaderMap) -> bool {
    let Some(value) = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let essence = value
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    essence == "application/json"
        || (essence.starts_with("application/") && essence.ends_with("+json"))
}

async fn read_body<S: Send + Sync>(
    request: Request,
    state: &S,
) -> Result<axum::body::Bytes, Problem> {
    axum::body::Bytes::from_request(request, state)
        .await
        .map_err(|rejection| match rejection.status() {
            StatusCode::PAYLOAD_TOO_LARGE => Problem::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "body-too-large",
                format!("the request body is larger than {MAX_BODY_BYTES} bytes"),
            ),
            _ => Problem::new(
                StatusCode::BAD_REQUEST,
                "unreadable-body",
                "the request body could not be read",
            ),
        })
}

fn parse_json<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, Problem> {
    let mut deserializer = serde_json::Deserializer::from_slice(bytes);
    let value: T = serde_path_to_error::deserialize(&mut deserializer).map_err(|error| {
        Problem::new(StatusCode::BAD_REQUEST, "malformed-body", explain(&error))
    })?;
    // Trailing bytes after the object are as malformed as a missing brace.
    deserializer.end().map_err(|error| {
        Problem::new(
            StatusCode::BAD_REQUEST,
            "malformed-body",
            format!(
                "the body is not well-formed JSON: something follows the object (at line {} column {})",
                error.line(),
                error.column()
            ),
        )
    })?;
    Ok(value)
}

/// Says what is wrong with a body in the API's words: the JSON path of the field and the rule, never
/// serde's names for Rust types (`expected struct PlaceRequest`, `expected i64`).
fn explain(error: &serde_path_to_error::Error<serde_json::Error>) -> String {
    use serde_json::error::Category;
    let inner = error.inner();
    let at = format!("line {} column {}", inner.line(), inner.column());
    if !matches!(inner.classify(), Category::Data) {
        return format!("the body is not well-formed JSON (at {at})");
    }
    let path = error.path().to_string();
    let field = |name: &str| {
        if path == "." {
            format!("field `{name}`")
        } else if path.ends_with(name) {
            format!("field `{path}`")
        } else {
            format!("field `{path}.{name}`")
        }
    };
    let message = inner.to_string();
    let message = message
        .rsplit_once(" at line ")
        .map_or(message.as_str(), |(m, _)| m);
    if let Some(rest) = message.strip_prefix("missing field `") {
        let name = rest.split('`').next().unwrap_or(rest);
        return format!("{} is required", field(name));
    }
    if let Some(rest) = message.strip_prefix("unknown field `") {
        let name = rest.split('`').next().unwrap_or(rest);
        let allowed = rest
            .split_once("expected ")
            .map(|(_, a)| format!("; the fields here are {a}"))
            .unwrap_or_default();
        return format!("{} is not allowed{allowed}", field(name));
    }
    let what = if path == "." {
        "the body".to_owned()
    } else {
        format!("field `{path}`")
    };
    match message.split_once(", expected ") {
        Some((_, expected)) => format!("{what} must be {} (at {at})", in_words(expected)),
        None => format!("{what} has an invalid value (at {at})"),
    }
}

/// serde's description of an expected type, as a JSON type.
fn in_words(expected: &str) -> &'static str {
    match expected {
        e if e.starts_with("struct ") || e.contains("map") => "a JSON object",
        e if e.contains("sequence") => "an array",
        "i64" | "i32" | "u64" | "u32" | "i16" | "u16" | "i8" | "u8" => {
            "a whole number within 64 bits"
        }
        "f64" | "f32" => "a number",
        e if e.contains("string") => "a string",
        e if e.contains("boolean") => "true or false",
        _ => "of another JSON type",
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PlaceRequest {
    customer_id: String,
    currency: String,
    lines: Vec<LineRequest>,
    /// `web` when absent.
    #[serde(default)]
    channel: Option<String>,
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
        channel: match body.channel.as_deref() {
            Some(channel) => Channel::parse(channel)?,
            None => Channel::default(),
        },
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
        if written_by_newer_code(&error).is_some() {
            return upgrade_required(&error);
        }
        tracing::error!(error = %ops::error_chain(&error), "loading an order failed");
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

/// The body is optional here: an empty one cancels without a reason; any other must be JSON.
async fn cancel(
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

/// The version an `If-Match` header requires; `*` or no header require none.
///
/// Only a strong tag of this service (`"3"`) is accepted. `If-Match` compares strongly (RFC 9110
/// §13.1.1), so a weak tag (`W/"3"`) can never match: 412. Anything that is not an entity tag (an
/// unbalanced quote, a bare number, a list) is malformed: 400.
fn if_match(headers: &HeaderMap) -> Result<Option<i64>, Problem> {
    let Some(value) = headers.get(header::IF_MATCH) else {
        return Ok(None);
    };
    let malformed = |text: &str| {
        Problem::new(
            StatusCode::BAD_REQUEST,
            "malformed-if-match",
            format!(
                "header If-Match {text:?} is not one entity tag of this service: send the ETag as \
                 received, like \"3\", or *"
            ),
        )
    };
    let text = value.to_str().map_err(|_| malformed("(not ASCII)"))?.trim();
    if text == "*" {
        return Ok(None);
    }
    if let Some(weak) = text.strip_prefix("W/") {
        return Err(Problem::new(
            StatusCode::PRECONDITION_FAILED,
            "weak-if-match",
            format!(
                "header If-Match {text:?} is a weak tag, and If-Match only matches strong tags; \
                 send {weak}"
            ),
        ));
    }
    let digits = text
        .strip_prefix('"')
        .and_then(|t| t.strip_suffix('"'))
        .filter(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
        .ok_or_else(|| malformed(text))?;
    digits.parse::<i64>().map(Some).map_err(|_| malformed(text))
}

/// Idempotency key, correlation id and trace context from the request headers.
fn context(headers: &HeaderMap, expected_version: Option<i64>) -> Result<CommandContext, Problem> {
    // A header that is present but not visible ASCII is refused, not ignored: dropping an
    // Idempotency-Key would turn a retry into a second order.
    let text = |name: &'static str, shown: &'static str| -> Result<Option<String>, Problem> {
        match headers.get(name) {
            None => Ok(None),
            Some(value) => value.to_str().map(|v| Some(v.to_owned())).map_err(|_| {
                Problem::new(
                    StatusCode::BAD_REQUEST,
                    "malformed-header",
                    format!("header {shown} must be visible ASCII"),
                )
            }),
        }
    };
    let correlation_id = match text("x-correlation-id", "X-Correlation-Id")? {
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
        idempotency_key: text("idempotency-key", "Idempotency-Key")?,
        expected_version,
        correlation_id,
        traceparent: text("traceparent", "traceparent")?.filter(|t| is_traceparent(t)),
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

/// Registers the HELP text of the metrics [`observe`] records, so a scrape explains every family. It
/// goes to the recorder installed at the time (`waybill serve` installs it before building the router);
/// without one it does nothing.
fn describe_metrics() {
    metrics::describe_counter!(
        "waybill_http_requests_total",
        "HTTP requests answered by the order service, by method, matched route (or `unmatched`) and status."
    );
    metrics::describe_histogram!(
        "waybill_http_request_seconds",
        metrics::Unit::Seconds,
        "Time from receiving an HTTP request to having its response, by matched route."
    );
}

/// Logs every request and counts it by route and status.
async fn observe(request: Request, next: Next) -> Response {
    let started = Instant::now();
    // Labels take a bounded set of values: a made-up method would otherwise mint a new series (and a
    // log field) per request, forever.
    let method = method_label(request.method());
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_owned(), |p| p.as_str().to_owned());
    let response = next.run(request).await;
    let status = response.status().as_u16();
    metrics::counter!("waybill_http_requests_total", "method" => method, "route" => route.clone(), "status" => status.to_string())
        .increment(1);
    metrics::histogram!("waybill_http_request_seconds", "route" => route.clone())
        .record(started.elapsed().as_secs_f64());
    tracing::info!(%method, %route, status, elapsed_ms = started.elapsed().as_millis() as u64, "request");
    response
}

/// The standard methods by name; every other one is `other`.
fn method_label(method: &axum::http::Method) -> &'static str {
    use axum::http::Method;
    match *method {
        Method::GET => "GET",
        Method::HEAD => "HEAD",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::OPTIONS => "OPTIONS",
        Method::PATCH => "PATCH",
        Method::TRACE => "TRACE",
        Method::CONNECT => "CONNECT",
        _ => "other",
    }
}
