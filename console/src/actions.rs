//! The console's state-changing actions. They exist only when `waybill-console` has an operator token
//! (`--operator-token`, `WAYBILL_OPERATOR_TOKEN`), and then require it ([`ops::operator`]).
//!
//! Dead outbox rows are replayed here (`relay::admin::replay_dead`, as `waybill outbox dead replay`),
//! through the console's one writing session, which exists only with the token. Redriving,
//! discarding and releasing in a projection need that projection's runner and NATS consumer, which
//! the console does not link: it calls the projection's own operator API (`--projection-api
//! NAME=URL`) with its token, and answers what the projection answered.

use std::time::Duration;

use axum::Json;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;
use uuid::Uuid;

use crate::upstream::{self, Call, Endpoint};
use crate::{Shared, readside};

/// The refusal of a request, unless actions are on and it carries the token.
fn refused(console: &Shared, headers: &HeaderMap) -> Option<Response> {
    let denied = ops::operator::authorize(console.token.as_ref(), headers).err()?;
    let mut response = refusal(denied.status(), denied.kind(), denied.detail());
    if denied == ops::operator::Denied::Unauthorized {
        response.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            axum::http::HeaderValue::from_static("Bearer realm=\"waybill console\""),
        );
    }
    Some(response)
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
pub(crate) struct ReplayRequest {
    target: String,
}

pub(crate) async fn replay_dead(
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
    let Some(writes) = &console.writes else {
        // A token without the writing session: a library caller's `Database` without actions.
        tracing::error!(
            action = "dead replay",
            "console has an operator token but no writing session"
        );
        return refusal(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "this console was set up without a session for its actions",
        );
    };
    match relay::admin::replay_dead(writes, &target).await {
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

/// A projection's operator API (`waybill-<name> run --listen ADDR --operator-token …`), given to
/// `waybill-console run --projection-api NAME=URL`: the console's redrive, discard and release buttons call
/// it with the console's own operator token, so both must be started with the same one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProjectionApi {
    pub name: &'static str,
    pub endpoint: Endpoint,
}

impl ProjectionApi {
    /// Reads `NAME=http://host:port`.
    pub fn parse(text: &str) -> Result<Self, String> {
        let (name, url) = text.split_once('=').ok_or_else(|| {
            format!("{text:?} is not NAME=URL (e.g. inventory=http://127.0.0.1:8081)")
        })?;
        let name = readside::known(name.trim()).ok_or_else(|| {
            format!(
                "{name:?} is not a projection; there are {}",
                readside::names().join(", ")
            )
        })?;
        Ok(Self {
            name,
            endpoint: Endpoint::parse(url)?,
        })
    }
}

/// How long a forwarded operator call may take. A redrive call takes a bounded batch, well within
/// the projection's own request timeout (30 s), which this stays under so that the projection's
/// answer, not a cut-off, comes back.
const OPERATOR_CALL_TIMEOUT: Duration = Duration::from_secs(25);

/// What a console action asks a projection to do.
#[derive(Debug)]
enum ProjectionAction {
    Redrive,
    Discard(i64),
    Release(Uuid),
}

/// `POST /console/api/projections/{name}/redrive` with `{"by", "reason"}`: one call of the
/// projection's redrive (its default batch; the answer says how many are still open).
pub(crate) async fn redrive(
    State(console): State<Shared>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    forward(
        &console,
        &name,
        &headers,
        ProjectionAction::Redrive,
        Some(body),
    )
    .await
}

/// `POST /console/api/projections/{name}/parked/{id}/discard` with `{"by", "reason"}`.
pub(crate) async fn discard(
    State(console): State<Shared>,
    Path((name, id)): Path<(String, String)>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let Ok(id) = id.parse::<i64>() else {
        return refusal(
            StatusCode::BAD_REQUEST,
            "invalid-target",
            "a parked message's id is a number",
        );
    };
    forward(
        &console,
        &name,
        &headers,
        ProjectionAction::Discard(id),
        Some(body),
    )
    .await
}

/// `POST /console/api/projections/{name}/held/{order}/release` with `{"by", "reason"}`.
pub(crate) async fn release(
    State(console): State<Shared>,
    Path((name, order)): Path<(String, String)>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let Ok(order) = Uuid::parse_str(&order) else {
        return refusal(
            StatusCode::BAD_REQUEST,
            "invalid-target",
            "an order id is a UUID",
        );
    };
    forward(
        &console,
        &name,
        &headers,
        ProjectionAction::Release(order),
        Some(body),
    )
    .await
}

/// Who acts and why, checked here before anything is sent on.
#[derive(Debug, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
struct Decision {
    by: String,
    reason: String,
}

/// Checks the console's token and the request, then calls the projection's operator API with the
/// console's token and answers what it answered.
async fn forward(
    console: &Shared,
    name: &str,
    headers: &HeaderMap,
    action: ProjectionAction,
    body: Option<axum::body::Bytes>,
) -> Response {
    if let Some(refused) = refused(console, headers) {
        tracing::warn!(action = ?action, projection = name, "console action refused");
        return refused;
    }
    let Some(name) = readside::known(name) else {
        return refusal(
            StatusCode::NOT_FOUND,
            "unknown-projection",
            &format!("there are {}", readside::names().join(", ")),
        );
    };
    let Some(api) = console.projection_apis.iter().find(|api| api.name == name) else {
        return refusal(
            StatusCode::CONFLICT,
            "no-projection-api",
            &format!(
                "this console does not know the {name} projection's operator API: start it with \
                 --projection-api {name}=http://<its --listen address>, or run waybill-{name} on \
                 the command line"
            ),
        );
    };
    let json = match body {
        None => None,
        Some(body) => match serde_json::from_slice::<Decision>(&body) {
            Ok(decision) if decision.by.trim().is_empty() || decision.reason.trim().is_empty() => {
                return refusal(
                    StatusCode::BAD_REQUEST,
                    "invalid-body",
                    "say who acts (by) and why (reason)",
                );
            }
            Ok(decision) => {
                Some(serde_json::to_vec(&decision).expect("two strings always serialize"))
            }
            Err(error) => {
                return refusal(
                    StatusCode::BAD_REQUEST,
                    "invalid-body",
                    &format!("expected {{\"by\": \"who\", \"reason\": \"why\"}}: {error}"),
                );
            }
        },
    };
    let path = match action {
        ProjectionAction::Redrive => "/operator/redrive".to_owned(),
        ProjectionAction::Discard(id) => format!("/operator/parked/{id}/discard"),
        ProjectionAction::Release(order) => format!("/operator/held/{order}/release"),
    };
    let call = Call {
        method: Method::POST,
        path: &path,
        authorization: console.token.as_ref().map(ops::OperatorToken::bearer),
        json,
        timeout: OPERATOR_CALL_TIMEOUT,
    };
    match upstream::send(&api.endpoint, call).await {
        Ok(answer)
            if matches!(
                answer.status,
                StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN
            ) =>
        {
            tracing::error!(action = ?action, projection = name, status = %answer.status, "a projection refused the console's token");
            refusal(
                StatusCode::BAD_GATEWAY,
                "projection-refused-token",
                &format!(
                    "the {name} projection refused the console's operator token ({}): start it \
                     with the same --operator-token (or WAYBILL_OPERATOR_TOKEN) as this console",
                    answer.status
                ),
            )
        }
        Ok(answer) => {
            tracing::info!(action = ?action, projection = name, status = %answer.status, "console action forwarded");
            let mut response = (answer.status, answer.body).into_response();
            let kind = if answer.status.is_success() {
                "application/json"
            } else {
                "application/problem+json"
            };
            response
                .headers_mut()
                .insert(header::CONTENT_TYPE, HeaderValue::from_static(kind));
            response
        }
        Err(error) => {
            tracing::error!(action = ?action, projection = name, endpoint = %api.endpoint, %error, "console action failed");
            refusal(
                StatusCode::BAD_GATEWAY,
                "projection-unreachable",
                &format!(
                    "the {name} projection's operator API at {} did not answer: {error}",
                    api.endpoint
                ),
            )
        }
    }
}
