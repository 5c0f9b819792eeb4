//! The console's state-changing actions and their guard. They exist only when `waybill serve` has an
//! operator token (`--operator-token`, `WAYBILL_OPERATOR_TOKEN`): without one every action answers
//! 403; with one, a request must carry `Authorization: Bearer <token>` (compared in constant time) or
//! it is answered 401. A bearer header is never sent by a browser on its own, so a page elsewhere
//! cannot make a viewer's browser act (no cookies, no CSRF).
//!
//! Only the outbox's dead rows can be replayed from here (`relay::admin::replay_dead`, the same as
//! `waybill outbox dead replay`). Redriving, discarding and releasing in a projection need that
//! projection's own runner and its NATS consumer, which this service does not link: the console
//! shows the exact command to run instead.

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;

use super::Shared;

/// The operator token, kept as bytes for the constant-time comparison and never printed.
pub struct Token(Vec<u8>);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(***)")
    }
}

impl Token {
    pub fn new(token: String) -> Self {
        Self(token.into_bytes())
    }

    /// Whether `headers` carry `Authorization: Bearer <this token>`. The comparison takes the same
    /// time wherever the first difference is, so response times do not reveal the token.
    fn admits(&self, headers: &HeaderMap) -> bool {
        let Some(given) = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            // The scheme is case-insensitive (RFC 9110, section 11.1); the token is not.
            .and_then(|v| v.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("Bearer"))
            .map(|(_, token)| token)
        else {
            return false;
        };
        constant_time_eq(given.trim().as_bytes(), &self.0)
    }
}

/// Equality whose time depends only on the lengths.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut difference = a.len() ^ b.len();
    for i in 0..a.len().max(b.len()) {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        difference |= usize::from(x ^ y);
    }
    std::hint::black_box(difference) == 0
}

/// The refusal of a request, unless actions are on and it carries the token.
fn refused(console: &Shared, headers: &HeaderMap) -> Option<Response> {
    match &console.token {
        None => Some(refusal(
            StatusCode::FORBIDDEN,
            "actions-disabled",
            "this service was started without an operator token (--operator-token or \
             WAYBILL_OPERATOR_TOKEN), so the console changes nothing",
        )),
        Some(token) if token.admits(headers) => None,
        Some(_) => {
            let mut response = refusal(
                StatusCode::UNAUTHORIZED,
                "operator-token-required",
                "send the operator token as Authorization: Bearer <token>",
            );
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                axum::http::HeaderValue::from_static("Bearer realm=\"waybill console\""),
            );
            Some(response)
        }
    }
}

fn refusal(status: StatusCode, kind: &str, detail: &str) -> Response {
    let mut response = (
        status,
        Json(json!({
            "type": format!("urn:waybill:problem:{kind}"),
            "title": status.canonical_reason().unwrap_or("error"),
            "status": status.as_u16(),
            "detail": detail,
        })),
    )
        .into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        axum::http::HeaderValue::from_static("application/problem+json"),
    );
    response
}

/// `POST /console/api/outbox/dead/replay` with `{"target": "all" | "<outbox id>" | "<event id>"}`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplayRequest {
    target: String,
}

pub async fn replay_dead(
    State(console): State<Shared>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    if let Some(refused) = refused(&console, &headers) {
        tracing::warn!(action = "dead replay", "console action refused");
        return refused;
    }
    let request: ReplayRequest = match serde_json::from_slice(&body) {
        Ok(request) => request,
        Err(error) => {
            return refusal(
                StatusCode::BAD_REQUEST,
                "invalid-body",
                &format!("expected {{\"target\": \"all\" | outbox id | event id}}: {error}"),
            );
        }
    };
    let target = if request.target == "all" {
        relay::admin::ReplayTarget::All
    } else {
        match relay::admin::ReplayTarget::parse(&request.target) {
            Ok(target) => target,
            Err(reason) => return refusal(StatusCode::BAD_REQUEST, "invalid-target", &reason),
        }
    };
    match relay::admin::replay_dead(&console.pool, &target).await {
        Ok(replayed) => {
            tracing::info!(action = "dead replay", target = ?target, replayed, "console action done");
            Json(json!({"replayed": replayed})).into_response()
        }
        Err(error) => {
            tracing::error!(action = "dead replay", %error, "console action failed");
            refusal(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                "the replay could not be written; retry later",
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_exact_bearer_token_is_admitted() {
        let token = Token::new("s3cret".to_owned());
        let with = |value: &str| {
            let mut headers = HeaderMap::new();
            headers.insert(header::AUTHORIZATION, value.parse().expect("header"));
            headers
        };
        assert!(token.admits(&with("Bearer s3cret")));
        assert!(!token.admits(&with("Bearer s3cre")));
        assert!(!token.admits(&with("Bearer s3cret2")));
        assert!(!token.admits(&with("Basic s3cret")));
        assert!(!token.admits(&HeaderMap::new()));
        assert_eq!(format!("{token:?}"), "Token(***)");
    }
}
