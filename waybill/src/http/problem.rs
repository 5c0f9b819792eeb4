//! RFC 9457 problem details: every refusal and failure of the service as `application/problem+json`,
//! with the status a command's outcome maps to (by the domain's [`Refusal`] kind, for every aggregate
//! type alike).

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use domain::{Aggregate, DecodeError, DomainError, Order, Refusal, UpcastError, ValueError};
use serde::Serialize;
use store::{AppendError, CommandError, LoadError};
use utoipa::ToSchema;

/// The media type of every problem.
pub(crate) const PROBLEM_JSON: &str = "application/problem+json";

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
    pub(crate) fn new(status: StatusCode, kind: &'static str, detail: impl Into<String>) -> Self {
        Self {
            status,
            kind,
            detail: detail.into(),
            retry_after: None,
        }
    }

    pub(crate) fn retry_after(mut self, seconds: u32) -> Self {
        self.retry_after = Some(seconds);
        self
    }
}

// The body of a `Problem`, as sent and as the OpenAPI document describes it (a comment: utoipa would
// make a doc comment the schema's description).
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = Problem)]
pub(crate) struct ProblemBody {
    /// `urn:waybill:problem:` and the kind, e.g. `urn:waybill:problem:order-not-found`.
    #[serde(rename = "type")]
    kind: String,
    /// The status's reason phrase.
    title: &'static str,
    #[schema(minimum = 400, maximum = 599)]
    status: u16,
    /// What went wrong, in words.
    detail: String,
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let body = ProblemBody {
            kind: format!("urn:waybill:problem:{}", self.kind),
            title: self.status.canonical_reason().unwrap_or("error"),
            status: self.status.as_u16(),
            detail: self.detail,
        };
        let mut response = (self.status, Json(body)).into_response();
        response
            .headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
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

/// The problem for a command to an aggregate of type `A` that did not complete.
pub(crate) fn command_problem<A: Aggregate>(error: CommandError<A::Error>) -> Problem {
    let detail = error.to_string();
    match error {
        CommandError::Refused(ref refused) => match refused.refusal() {
            Refusal::NotFound => {
                Problem::new(StatusCode::NOT_FOUND, not_found_kind(A::TYPE), detail)
            }
            Refusal::Conflict => Problem::new(StatusCode::CONFLICT, "illegal-transition", detail),
            Refusal::Invalid => {
                Problem::new(StatusCode::UNPROCESSABLE_ENTITY, "rule-refused", detail)
            }
        },
        CommandError::StaleVersion { .. } => {
            Problem::new(StatusCode::PRECONDITION_FAILED, "stale-version", detail)
        }
        CommandError::Conflict { .. } => {
            Problem::new(StatusCode::CONFLICT, "version-conflict", detail)
        }
        // Another session holds the aggregate: only its commands waited, and a retry once that
        // session ends succeeds. When it ends is unknown (another writer of it commits in
        // milliseconds; a frozen one is ended by its idle timeout or an operator), so the hint is
        // short.
        CommandError::Locked {
            aggregate_type,
            aggregate_id,
        } => {
            tracing::warn!(aggregate_type, %aggregate_id, "aggregate locked by another transaction; answered 503");
            let kind = if aggregate_type == Order::TYPE {
                "order-locked"
            } else {
                "locked"
            };
            Problem::new(StatusCode::SERVICE_UNAVAILABLE, kind, detail).retry_after(1)
        }
        CommandError::Append(AppendError::OutcomeUnknown { aggregate_id, .. }) => {
            tracing::error!(error = %ops::error_chain(&error), "command outcome unknown");
            Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "outcome-unknown",
                format!(
                    "the database connection broke while {} {aggregate_id} was being written, and \
                     whether it was cannot be told yet: read it back before sending the command again",
                    A::TYPE
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

/// The problem type of an unknown aggregate: `order-not-found`, `customer-not-found`.
pub(crate) fn not_found_kind(aggregate_type: &str) -> &'static str {
    match aggregate_type {
        "order" => "order-not-found",
        "customer" => "customer-not-found",
        _ => "not-found",
    }
}

/// The problem for a read of an aggregate that failed.
pub(crate) fn load_problem(error: &LoadError, what: &'static str) -> Problem {
    if written_by_newer_code(error).is_some() {
        return upgrade_required(error);
    }
    tracing::error!(error = %ops::error_chain(error), "loading {what} failed");
    Problem::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "internal",
        format!("the {what} could not be read"),
    )
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

/// 503: the aggregate has an event written by a newer version of the service (a rolling upgrade is
/// under way, or this instance was left behind). Retrying here cannot help; upgrading does.
fn upgrade_required(error: &LoadError) -> Problem {
    let what = written_by_newer_code(error).map_or_else(String::new, |e| format!(": {e}"));
    tracing::warn!(error = %ops::error_chain(error), "an aggregate holds an event newer than this code");
    Problem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "upgrade-required",
        format!(
            "this was written by a newer version of waybill than this service{what}; \
             upgrade this service (or send the request to an upgraded one)"
        ),
    )
}
