//! The customer's routes: register a customer under a handle, rename it, read it. A customer's path
//! names its handle (`/customers/alice`); its aggregate id is derived from it.

use axum::Json;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use domain::{
    Aggregate, Customer, CustomerCommand, CustomerError, CustomerId, CustomerKey, Note,
    RegisterCustomer, RenameCustomer,
};
use serde::Deserialize;
use store::{CommandError, EventStore};

use super::body::Body;
use super::headers::{context, if_match, with_etag};
use super::problem::{Problem, command_problem, load_problem};
use super::{created, respond};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RegisterRequest {
    customer_id: String,
    name: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RenameRequest {
    name: String,
}

/// `POST /customers`: 201 with the customer, or 409 when the handle is taken.
pub(crate) async fn register(
    State(store): State<EventStore>,
    headers: HeaderMap,
    Body(body): Body<RegisterRequest>,
) -> Result<Response, Problem> {
    let customer_id = CustomerId::parse(&body.customer_id)?;
    let key = CustomerKey::of(&customer_id);
    let command = CustomerCommand::Register(RegisterCustomer {
        customer_id: customer_id.clone(),
        name: Note::required("name", &body.name)?,
    });
    let outcome = store
        .execute(key, &command, &context(&headers, None)?)
        .await
        .map_err(command_problem::<Customer>)?;
    Ok(created(
        &format!("/customers/{customer_id}"),
        respond(StatusCode::CREATED, &outcome),
    ))
}

/// `POST /customers/{customer_id}/rename`.
pub(crate) async fn rename(
    State(store): State<EventStore>,
    Path(customer_id): Path<String>,
    headers: HeaderMap,
    Body(body): Body<RenameRequest>,
) -> Result<Response, Problem> {
    let key = key(&customer_id)?;
    let command = CustomerCommand::Rename(RenameCustomer {
        name: Note::required("name", &body.name)?,
    });
    let outcome = store
        .execute(key, &command, &context(&headers, if_match(&headers)?)?)
        .await
        .map_err(command_problem::<Customer>)?;
    Ok(respond(StatusCode::OK, &outcome))
}

/// `GET /customers/{customer_id}`: 404 for a handle never registered.
pub(crate) async fn show(
    State(store): State<EventStore>,
    Path(customer_id): Path<String>,
) -> Result<Response, Problem> {
    let key = key(&customer_id)?;
    let customer = store
        .load_as::<Customer>(key)
        .await
        .map_err(|error| load_problem(&error, "customer"))?;
    if customer.version() == 0 {
        return Err(command_problem::<Customer>(CommandError::Refused(
            CustomerError::NotFound(key),
        )));
    }
    Ok(with_etag(
        (StatusCode::OK, Json(&customer)).into_response(),
        customer.version,
    ))
}

fn key(customer_id: &str) -> Result<CustomerKey, Problem> {
    CustomerId::parse(customer_id)
        .map(|handle| CustomerKey::of(&handle))
        .map_err(|e| {
            Problem::new(
                StatusCode::BAD_REQUEST,
                "malformed-customer-id",
                e.to_string(),
            )
        })
}
