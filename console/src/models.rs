//! A read model's document: what a model of `projections/src/models/` answers, read as the model
//! itself reads it (`projections::kit::Model::read_from`) through the console's read-only sessions,
//! beside what it is (its `about`, the aggregate types it reads). Every model of the registry has
//! this page with no edit here; the built-in projections have their own read APIs instead.

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use maud::html;
use serde_json::{Value, json};

use crate::Shared;
use crate::html::{self, Section};
use crate::readside;

/// A model's document, or why it could not be read.
async fn document(
    console: &Shared,
    model: &'static dyn projections::kit::Model,
) -> Result<Value, String> {
    if !readside::state(&console.pool, model.name()).await.found {
        return Err(format!(
            "its schema is not in this database (not started yet, or it keeps its state in another \
             database): run `waybill-projection {} run`",
            model.name()
        ));
    }
    model.read_from(&console.pool).await.map_err(|error| {
        tracing::warn!(model = model.name(), error = %ops::error_chain(&*error), "console cannot read a model's document");
        ops::error_chain(&*error)
    })
}

/// The registry's model `name`, or the names there are.
fn model(name: &str) -> Result<&'static dyn projections::kit::Model, String> {
    projections::registry::model(name).ok_or_else(|| {
        let models: Vec<&str> = projections::registry::MODELS
            .iter()
            .map(|m| m.name())
            .collect();
        format!(
            "{name:?} is not a read model; there are {}",
            if models.is_empty() {
                "none".to_owned()
            } else {
                models.join(", ")
            }
        )
    })
}

/// `GET /console/projections/{name}/document`.
pub(crate) async fn page(State(console): State<Shared>, Path(name): Path<String>) -> Response {
    console.viewed();
    let operator = console.operator();
    let model = match model(&name) {
        Ok(model) => model,
        Err(detail) => {
            return html::error_page(
                StatusCode::NOT_FOUND,
                "No such read model",
                &detail,
                operator,
            );
        }
    };
    let read = document(&console, model).await;
    let body = html! {
        h1 { "Read model " (model.name()) }
        p.lead data-testid="about" { (html::text(model.about())) }
        p {
            "Reads the events of " (model.aggregates().join(", ")) ". Its document as "
            code { "waybill-projection " (model.name()) " show" } " prints it (and its "
            code { "GET /state" } " serves it), read now from its schema; as JSON at "
            a href={ "/console/api/projections/" (model.name()) "/document" } {
                "/console/api/projections/" (model.name()) "/document"
            } ". " code { "waybill-projection " (model.name()) " check" }
            " compares it with the model's fold of the event store."
        }
        @match &read {
            Ok(document) => { pre.json data-testid="document" { (html::json_block(document)) } }
            Err(error) => { p.error { "The document could not be read: " (html::text(error)) } }
        }
        p.small {
            a href={ "/console/projections/" (model.name()) "/parked" } { "parked" } " · "
            a href={ "/console/projections/" (model.name()) "/held" } { "held" }
        }
    };
    html::respond(
        StatusCode::OK,
        html::page(
            &format!("Read model {}", model.name()),
            Section::Lists,
            operator,
            body,
        ),
    )
}

/// `GET /console/api/projections/{name}/document`: `{name, about, reads, document}`, 404 for a name
/// that is no model, 503 when the document cannot be read.
pub(crate) async fn api(State(console): State<Shared>, Path(name): Path<String>) -> Response {
    console.viewed();
    let model = match model(&name) {
        Ok(model) => model,
        Err(detail) => {
            return (StatusCode::NOT_FOUND, Json(json!({"error": detail}))).into_response();
        }
    };
    match document(&console, model).await {
        Ok(document) => Json(json!({
            "name": model.name(),
            "about": model.about(),
            "reads": model.aggregates(),
            "document": document,
        }))
        .into_response(),
        Err(error) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"name": model.name(), "error": error})),
        )
            .into_response(),
    }
}
