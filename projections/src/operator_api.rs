//! The operator's side of `run --listen`: what `redrive`, `parked discard` and `held release` do on
//! the command line, over HTTP, so that the console (or a script) can do it without a shell on the
//! projection's host. Off unless the projection runs with an operator token; then every call needs
//! `Authorization: Bearer <token>` ([`ops::operator`]). Each call goes through the same runner
//! methods as the command line, so it is recorded in the operator log with who and why.
//!
//! - `POST /operator/redrive?limit=N` with `{"by", "reason"}` — re-applies open parked messages,
//!   oldest first, at most `limit` (default 200, at most 1000: a call must end well within the
//!   request timeout); answers what happened to each and how many are still open.
//! - `POST /operator/parked/{id}/discard` with `{"by", "reason"}`.
//! - `POST /operator/held/{order}/release` with `{"by", "reason"}`.

use std::sync::Arc;

use axum::extract::rejection::{JsonRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::json;
use uuid::Uuid;

use crate::actions::{DiscardError, RedriveRequest, ReleaseError};
use crate::http::{Problem, checked};
use crate::projection::Projection;
use crate::runner::Runner;

/// What the routes share.
struct Operator<P: Projection> {
    runner: Arc<Runner<P>>,
    token: Option<ops::OperatorToken>,
}

/// The operator routes, to be merged into the read API's router.
pub fn routes<P: Projection>(runner: Arc<Runner<P>>, token: Option<ops::OperatorToken>) -> Router {
    Router::new()
        .route("/operator/redrive", post(redrive::<P>))
        .route("/operator/parked/{id}/discard", post(discard::<P>))
        .route("/operator/held/{order}/release", post(release::<P>))
        .with_state(Arc::new(Operator { runner, token }))
}

/// Who acts and why, for the operator log.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Decision {
    /// Who is acting.
    pub by: String,
    /// Why.
    pub reason: String,
}

impl Decision {
    fn checked(body: Result<Json<Self>, JsonRejection>) -> Result<Self, Problem> {
        let Json(decision) = body.map_err(|rejection| {
            Problem::bad_request(format!(
                "expected {{\"by\": \"who\", \"reason\": \"why\"}}: {}",
                rejection.body_text()
            ))
        })?;
        for (name, value) in [("by", &decision.by), ("reason", &decision.reason)] {
            if checked(name, value)?.trim().is_empty() {
                return Err(Problem::bad_request(format!("{name} must not be empty")));
            }
        }
        Ok(decision)
    }
}

fn admit<P: Projection>(operator: &Operator<P>, headers: &HeaderMap) -> Result<(), Problem> {
    ops::operator::authorize(operator.token.as_ref(), headers).map_err(|denied| {
        tracing::warn!(projection = P::NAME, ?denied, "operator call refused");
        Problem::denied(denied)
    })
}

/// Messages one redrive call takes by default and at most.
const REDRIVE_DEFAULT: i64 = 200;
const REDRIVE_MAX: i64 = 1000;

/// `?limit=N` of a redrive.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RedriveParams {
    limit: Option<i64>,
}

async fn redrive<P: Projection>(
    State(operator): State<Arc<Operator<P>>>,
    headers: HeaderMap,
    params: Result<Query<RedriveParams>, QueryRejection>,
    body: Result<Json<Decision>, JsonRejection>,
) -> Result<Response, Problem> {
    admit(&operator, &headers)?;
    let Query(params) = params?;
    let limit = params.limit.unwrap_or(REDRIVE_DEFAULT);
    if !(1..=REDRIVE_MAX).contains(&limit) {
        return Err(Problem::bad_request(format!(
            "limit must be between 1 and {REDRIVE_MAX}, not {limit}"
        )));
    }
    let decision = Decision::checked(body)?;
    let request = RedriveRequest {
        actor: &decision.by,
        reason: &decision.reason,
        limit: Some(limit),
    };
    let report = operator
        .runner
        .redrive(&request)
        .await
        .map_err(|error| Problem::unavailable("the redrive", &error))?;
    let open = crate::park::open_count(operator.runner.pool())
        .await
        .map_err(|error| Problem::unavailable("counting parked messages", &error))?;
    tracing::info!(
        projection = P::NAME,
        messages = report.len(),
        open,
        by = %decision.by,
        "redrive done over the operator API"
    );
    Ok(Json(json!({"projection": P::NAME, "redriven": report, "open": open})).into_response())
}

async fn discard<P: Projection>(
    State(operator): State<Arc<Operator<P>>>,
    headers: HeaderMap,
    id: Result<Path<i64>, axum::extract::rejection::PathRejection>,
    body: Result<Json<Decision>, JsonRejection>,
) -> Result<Response, Problem> {
    admit(&operator, &headers)?;
    let Path(id) = id?;
    let decision = Decision::checked(body)?;
    match operator
        .runner
        .discard(id, &decision.by, &decision.reason)
        .await
    {
        Ok(done) => Ok(Json(done).into_response()),
        Err(error @ DiscardError::Refused { .. }) => {
            Err(Problem::conflict(ops::error_chain(&error)))
        }
        Err(error) => Err(Problem::unavailable("the discard", &error)),
    }
}

async fn release<P: Projection>(
    State(operator): State<Arc<Operator<P>>>,
    headers: HeaderMap,
    order: Result<Path<Uuid>, axum::extract::rejection::PathRejection>,
    body: Result<Json<Decision>, JsonRejection>,
) -> Result<Response, Problem> {
    admit(&operator, &headers)?;
    let Path(order) = order?;
    let decision = Decision::checked(body)?;
    match operator
        .runner
        .release(order, &decision.by, &decision.reason)
        .await
    {
        Ok(done) => Ok(Json(done).into_response()),
        Err(error @ ReleaseError::Refused { .. }) => {
            Err(Problem::conflict(ops::error_chain(&error)))
        }
        Err(error) => Err(Problem::unavailable("the release", &error)),
    }
}
