//! The HTTP service (`waybill serve`): the commands and reads of every aggregate type over JSON —
//! orders (place, pay, cancel, ship) and customers (register, rename) — with `Idempotency-Key`
//! retries, `ETag`/`If-Match` optimistic locking, and RFC 9457 problem details.
//!
//! One module a job: `problem` (refusals and failures as problems), `body` (JSON bodies),
//! `headers` (what a request says in its headers), `observe` (logs and metrics), and one module
//! of routes per aggregate type (`orders`, `customers`).

mod body;
mod customers;
mod headers;
mod observe;
mod orders;
mod problem;

use axum::extract::DefaultBodyLimit;
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use domain::Aggregate;
use store::{CommandOutcome, EventStore};

pub use body::Body;
pub use problem::Problem;

/// Request bodies larger than this are refused with 413 (500 lines fit in about 40 KiB).
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// The service's routes. `/metrics` and `/health` are not among them: they are served on their own
/// listener (`--metrics-listen`), apart from the public API.
pub fn router(store: EventStore) -> Router {
    observe::describe_metrics();
    Router::new()
        .route("/orders", post(orders::place))
        .route("/orders/{id}", get(orders::show))
        .route("/orders/{id}/pay", post(orders::pay))
        .route("/orders/{id}/cancel", post(orders::cancel))
        .route("/orders/{id}/ship", post(orders::ship))
        .route("/customers", post(customers::register))
        .route("/customers/{customer_id}", get(customers::show))
        .route("/customers/{customer_id}/rename", post(customers::rename))
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
        .layer(middleware::from_fn(observe::observe))
}

/// The answer to a command: the aggregate's state, its `ETag`, the first event's id, and whether it
/// was a replay of an earlier request with the same `Idempotency-Key`.
fn respond<A: Aggregate>(status: StatusCode, outcome: &CommandOutcome<A>) -> Response {
    // The ETag describes the body: for a replayed request that is the aggregate as it is now.
    let mut response = headers::with_etag(
        (status, Json(&outcome.state)).into_response(),
        outcome.state.version(),
    );
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

/// `response` with a `Location` header naming what was created.
fn created(location: &str, mut response: Response) -> Response {
    if let Ok(value) = HeaderValue::from_str(location) {
        response.headers_mut().insert(header::LOCATION, value);
    }
    response
}
