//! The HTTP service (`waybill serve`): the commands and reads of every aggregate type over JSON —
//! orders (place, pay, cancel, ship) and customers (register, rename) — with `Idempotency-Key`
//! retries, `ETag`/`If-Match` optimistic locking, and RFC 9457 problem details.
//!
//! One module a job: `problem` (refusals and failures as problems), `body` (JSON bodies),
//! `headers` (what a request says in its headers), `observe` (logs and metrics), `schemas` (the
//! document's schemas of bodies other crates build), and one module of routes per aggregate type
//! (`orders`, `customers`). Each handler carries its OpenAPI operation; `routes` collects them.

mod body;
mod customers;
mod headers;
mod observe;
pub mod openapi;
mod orders;
mod problem;
mod schemas;

use axum::extract::DefaultBodyLimit;
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use domain::Aggregate;
use store::{CommandOutcome, EventStore};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

pub use body::Body;
pub use problem::Problem;

/// Request bodies larger than this are refused with 413 (500 lines fit in about 40 KiB).
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// The service's routes. `/metrics` and `/health` are not among them: they are served on their own
/// listener (`--metrics-listen`), apart from the public API.
pub fn router(store: EventStore) -> Router {
    observe::describe_metrics();
    let (router, _) = routes().split_for_parts();
    router
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

/// Every route with its operation: the router and the OpenAPI document's `paths` come from this one
/// list, so a route cannot be served undocumented nor documented unserved.
pub(crate) fn routes() -> OpenApiRouter<EventStore> {
    OpenApiRouter::new()
        .routes(routes!(orders::place))
        .routes(routes!(orders::show))
        .routes(routes!(orders::pay))
        .routes(routes!(orders::cancel))
        .routes(routes!(orders::ship))
        .routes(routes!(customers::register))
        .routes(routes!(customers::show))
        .routes(routes!(customers::rename))
        .routes(routes!(openapi_document))
}

#[utoipa::path(
    get,
    path = "/openapi.json",
    operation_id = "getOpenApiDocument",
    summary = "This document",
    responses((status = 200, description = "OpenAPI 3.1", body = inline(openapi::DocumentShape))),
)]
async fn openapi_document() -> Json<&'static serde_json::Value> {
    Json(openapi::document())
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
