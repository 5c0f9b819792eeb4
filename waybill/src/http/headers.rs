//! What a request says in its headers — `If-Match`, `Idempotency-Key`, `X-Correlation-Id`,
//! `traceparent` — and the `ETag` an answer carries.

use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::Response;
use domain::OrderId;
use store::CommandContext;
use utoipa::IntoParams;
use uuid::Uuid;

use super::problem::Problem;

/// The headers a command that creates an aggregate reads, for the OpenAPI document ([`context`]
/// reads them).
#[derive(IntoParams)]
#[into_params(parameter_in = Header)]
#[allow(
    dead_code,
    reason = "parameters for the document: the handlers read a HeaderMap"
)]
pub(crate) struct CreateHeaders {
    /// A retry with the same key and body returns the first result
    #[param(
        rename = "Idempotency-Key",
        nullable = false,
        min_length = 1,
        max_length = 200
    )]
    idempotency_key: Option<String>,
    #[param(rename = "X-Correlation-Id", nullable = false)]
    correlation_id: Option<Uuid>,
}

/// The headers a command to an existing aggregate reads ([`if_match`] and [`context`]).
#[derive(IntoParams)]
#[into_params(parameter_in = Header)]
#[allow(
    dead_code,
    reason = "parameters for the document: the handlers read a HeaderMap"
)]
pub(crate) struct ChangeHeaders {
    /// Apply only at this version (the ETag of a read)
    #[param(rename = "If-Match", nullable = false)]
    if_match: Option<String>,
    /// A retry with the same key and body returns the first result
    #[param(
        rename = "Idempotency-Key",
        nullable = false,
        min_length = 1,
        max_length = 200
    )]
    idempotency_key: Option<String>,
    #[param(rename = "X-Correlation-Id", nullable = false)]
    correlation_id: Option<Uuid>,
}

pub(crate) fn with_etag(mut response: Response, version: i64) -> Response {
    if let Ok(value) = HeaderValue::from_str(&format!("\"{version}\"")) {
        response.headers_mut().insert(header::ETAG, value);
    }
    response
}

pub(crate) fn order_id(text: &str) -> Result<OrderId, Problem> {
    OrderId::parse(text)
        .map_err(|e| Problem::new(StatusCode::BAD_REQUEST, "malformed-order-id", e.to_string()))
}

/// The version an `If-Match` header requires; `*` or no header require none.
///
/// Only a strong tag of this service (`"3"`) is accepted. `If-Match` compares strongly (RFC 9110
/// §13.1.1), so a weak tag (`W/"3"`) can never match: 412. Anything that is not an entity tag (an
/// unbalanced quote, a bare number, a list) is malformed: 400.
pub(crate) fn if_match(headers: &HeaderMap) -> Result<Option<i64>, Problem> {
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
pub(crate) fn context(
    headers: &HeaderMap,
    expected_version: Option<i64>,
) -> Result<CommandContext, Problem> {
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
