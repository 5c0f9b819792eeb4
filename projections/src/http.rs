//! What the three read APIs share: RFC 9457 problems (`application/problem+json`) for every error, input
//! checks that answer 400 before anything reaches PostgreSQL (which refuses NUL in text), pages of at
//! most [`MAX_LIMIT`] items with a cursor, and a log line for every 5xx.

use axum::Json;
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::json;

/// Items per page unless asked otherwise.
pub const DEFAULT_LIMIT: i64 = 100;
/// Items per page at most.
pub const MAX_LIMIT: i64 = 500;

/// An error as the read APIs answer it.
#[derive(Debug)]
pub struct Problem {
    status: StatusCode,
    title: &'static str,
    detail: String,
}

impl Problem {
    /// 400: the request itself is wrong.
    pub fn bad_request(detail: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            title: "Bad request",
            detail: detail.into(),
        }
    }

    /// 404.
    pub fn not_found(detail: impl Into<String>) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            title: "Not found",
            detail: detail.into(),
        }
    }

    /// 409: the operator's request was refused as things stand (nothing changed).
    pub fn conflict(detail: impl Into<String>) -> Self {
        Self {
            status: StatusCode::CONFLICT,
            title: "Conflict",
            detail: detail.into(),
        }
    }

    /// 403 or 401: the operator API is off, or the request did not carry its token.
    pub fn denied(denied: ops::operator::Denied) -> Self {
        Self {
            status: denied.status(),
            title: if denied == ops::operator::Denied::Disabled {
                "Forbidden"
            } else {
                "Unauthorized"
            },
            detail: denied.detail().to_owned(),
        }
    }

    /// 503: the projection's database failed; logged with the error and its causes, which the client
    /// does not see.
    pub fn unavailable(what: &str, error: &(dyn std::error::Error + 'static)) -> Self {
        tracing::error!(error = %ops::error_chain(error), what, "read API failed");
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            title: "Service unavailable",
            detail: format!("{what} failed; the error is logged"),
        }
    }

    /// The status.
    pub fn status(&self) -> StatusCode {
        self.status
    }
}

impl From<PathRejection> for Problem {
    fn from(rejection: PathRejection) -> Self {
        Self::bad_request(rejection.body_text())
    }
}

impl From<QueryRejection> for Problem {
    fn from(rejection: QueryRejection) -> Self {
        Self::bad_request(rejection.body_text())
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let body = json!({
            "type": "about:blank",
            "title": self.title,
            "status": self.status.as_u16(),
            "detail": self.detail,
        });
        let mut response = (self.status, Json(body)).into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"waybill projection\""),
            );
        }
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        response
    }
}

/// Text from a path or query must be printable: control characters (NUL above all, which PostgreSQL
/// text cannot hold) are refused, and so is anything longer than 200 characters.
pub fn checked<'a>(name: &str, value: &'a str) -> Result<&'a str, Problem> {
    if value.chars().any(char::is_control) {
        return Err(Problem::bad_request(format!(
            "{name} contains a control character"
        )));
    }
    if value.chars().count() > 200 {
        return Err(Problem::bad_request(format!(
            "{name} is longer than 200 characters"
        )));
    }
    Ok(value)
}

/// `?limit=N&cursor=C`, shared by every list.
#[derive(Debug, Default, Deserialize)]
pub struct PageParams {
    /// 1..=[`MAX_LIMIT`], default [`DEFAULT_LIMIT`].
    pub limit: Option<i64>,
    /// The `next_cursor` of the previous page.
    pub cursor: Option<String>,
}

impl PageParams {
    /// The limit, checked.
    pub fn limit(&self) -> Result<i64, Problem> {
        let limit = self.limit.unwrap_or(DEFAULT_LIMIT);
        if !(1..=MAX_LIMIT).contains(&limit) {
            return Err(Problem::bad_request(format!(
                "limit must be between 1 and {MAX_LIMIT}, not {limit}"
            )));
        }
        Ok(limit)
    }

    /// The cursor, checked.
    pub fn cursor(&self) -> Result<Option<&str>, Problem> {
        self.cursor
            .as_deref()
            .map(|c| checked("cursor", c))
            .transpose()
    }
}

/// One page of a list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Page<T> {
    /// The items.
    pub items: Vec<T>,
    /// Pass as `cursor` for the next page; absent on the last page.
    pub next_cursor: Option<String>,
}

impl<T> Page<T> {
    /// A page from `limit + 1` fetched rows: the extra row only tells that there is a next page, whose
    /// cursor `cursor_of` makes from the last item kept.
    pub fn from_rows(mut rows: Vec<T>, limit: i64, cursor_of: impl Fn(&T) -> String) -> Self {
        let keep = usize::try_from(limit).unwrap_or(0);
        let more = rows.len() > keep;
        rows.truncate(keep);
        let next_cursor = if more {
            rows.last().map(cursor_of)
        } else {
            None
        };
        Self {
            items: rows,
            next_cursor,
        }
    }
}

/// Unknown paths and methods answer with a problem too.
pub fn with_fallbacks(router: axum::Router) -> axum::Router {
    router
        .fallback(|| async { Problem::not_found("no such resource") })
        .method_not_allowed_fallback(|| async {
            Problem {
                status: StatusCode::METHOD_NOT_ALLOWED,
                title: "Method not allowed",
                detail: "this resource does not answer that method (the read API answers GET, \
                         the operator API POST)"
                    .into(),
            }
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nul_and_other_control_characters_are_refused() {
        assert!(checked("sku", "MUG").is_ok());
        for bad in ["MU\0G", "a\nb", "\u{7f}"] {
            let problem = checked("sku", bad).expect_err(bad);
            assert_eq!(problem.status(), StatusCode::BAD_REQUEST);
        }
        assert!(checked("q", &"x".repeat(201)).is_err());
    }

    #[test]
    fn a_page_has_a_cursor_only_when_more_follow() {
        let page = Page::from_rows(vec![1, 2, 3], 2, |n| n.to_string());
        assert_eq!(page.items, vec![1, 2]);
        assert_eq!(page.next_cursor.as_deref(), Some("2"));
        let last = Page::from_rows(vec![1, 2], 2, |n| n.to_string());
        assert_eq!(last.next_cursor, None);
    }

    #[test]
    fn limits_outside_the_range_are_refused() {
        for (limit, ok) in [
            (None, true),
            (Some(1), true),
            (Some(500), true),
            (Some(0), false),
            (Some(501), false),
        ] {
            let params = PageParams {
                limit,
                cursor: None,
            };
            assert_eq!(params.limit().is_ok(), ok, "{limit:?}");
        }
    }
}
