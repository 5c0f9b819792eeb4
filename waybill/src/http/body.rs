//! Request bodies: JSON only, bounded in size, and every refusal a problem that names the field and
//! the rule in the API's words.

use axum::extract::{FromRequest, Request};
use axum::http::{HeaderMap, StatusCode, header};

use super::MAX_BODY_BYTES;
use super::problem::Problem;

/// A JSON body whose refusals are problems: 415 without a JSON content type, 413 for one too large,
/// 400 for one that is not the expected JSON, with a message that names the field and the rule.
#[derive(Debug)]
pub struct Body<T>(pub(crate) T);

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

pub(crate) fn not_json() -> Problem {
    Problem::new(
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "not-json",
        "send the body as application/json",
    )
}

/// `application/json` or an `application/…+json` type, parameters aside.
pub(crate) fn is_json(headers: &HeaderMap) -> bool {
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

pub(crate) async fn read_body<S: Send + Sync>(
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

pub(crate) fn parse_json<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, Problem> {
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
