//! Every request logged and counted by method, matched route and status.

use std::time::Instant;

use axum::extract::{MatchedPath, Request};
use axum::middleware::Next;
use axum::response::Response;

/// Registers the HELP text of the metrics [`observe`] records, so a scrape explains every family. It
/// goes to the recorder installed at the time (`waybill serve` installs it before building the router);
/// without one it does nothing.
pub(crate) fn describe_metrics() {
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
pub(crate) async fn observe(request: Request, next: Next) -> Response {
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
    tracing::info!(%method, %route, status, elapsed_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX), "request");
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
