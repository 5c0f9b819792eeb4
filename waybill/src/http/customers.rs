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
use utoipa::ToSchema;

use super::body::Body;
use super::headers::{ChangeHeaders, CreateHeaders, context, if_match, with_etag};
use super::problem::{PROBLEM_JSON, Problem, ProblemBody, command_problem, load_problem};
use super::schemas::{BodyRefused, CustomerView, Faults, Replayed};
use super::{created, respond};

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = RegisterCustomerRequest)]
pub(crate) struct RegisterRequest {
    #[schema(pattern = "^[A-Za-z0-9._:-]{1,64}$")]
    customer_id: String,
    #[schema(min_length = 1, max_length = 200)]
    name: String,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = RenameCustomerRequest)]
pub(crate) struct RenameRequest {
    #[schema(min_length = 1, max_length = 200)]
    name: String,
}

/// The customer's handle in a path.
#[derive(utoipa::IntoParams)]
#[into_params(parameter_in = Path)]
#[allow(
    dead_code,
    reason = "a parameter for the document: the handlers take Path<String>"
)]
pub(crate) struct Handle {
    #[param(pattern = "^[A-Za-z0-9._:-]{1,64}$")]
    customer_id: String,
}

#[utoipa::path(
    post,
    path = "/customers",
    operation_id = "registerCustomer",
    summary = "Register a customer under a handle (the customer_id its orders carry)",
    params(CreateHeaders),
    request_body = RegisterRequest,
    responses(
        (status = 201, description = "The registered customer (also the answer to a retry with the same Idempotency-Key)", body = CustomerView, headers(
            ("ETag" = String, description = "The customer's version as a strong entity tag (\"3\"), for If-Match"),
            ("Location" = String, description = "The registered customer: /customers/{customer_id}"),
            ("Event-Id" = Uuid, description = "The first event the command recorded (for a replay, the one the first request recorded)"),
            ("Idempotent-Replayed" = inline(Replayed), description = "Present, as true, only on the answer to a retry with an Idempotency-Key already used for the same request; nothing was written"),
        )),
        (status = 400, description = "Malformed body, Idempotency-Key or X-Correlation-Id", body = ProblemBody, content_type = PROBLEM_JSON),
        (status = 409, description = "The handle is registered already", body = ProblemBody, content_type = PROBLEM_JSON),
        BodyRefused,
        (status = 422, description = "An invalid handle or a blank name, or an Idempotency-Key reused for another request", body = ProblemBody, content_type = PROBLEM_JSON),
        Faults,
    )
)]
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

#[utoipa::path(
    post,
    path = "/customers/{customer_id}/rename",
    operation_id = "renameCustomer",
    summary = "Give a customer a new name",
    params(Handle, ChangeHeaders),
    request_body = RenameRequest,
    responses(
        (status = 200, description = "The customer after the rename", body = CustomerView, headers(
            ("ETag" = String, description = "The customer's version as a strong entity tag (\"3\"), for If-Match"),
            ("Event-Id" = Uuid, description = "The first event the command recorded (for a replay, the one the first request recorded)"),
            ("Idempotent-Replayed" = inline(Replayed), description = "Present, as true, only on the answer to a retry with an Idempotency-Key already used for the same request; nothing was written"),
        )),
        (status = 400, description = "Malformed body, handle or If-Match", body = ProblemBody, content_type = PROBLEM_JSON),
        (status = 404, description = "No customer has this handle", body = ProblemBody, content_type = PROBLEM_JSON),
        (status = 409, description = "The customer has that name already, or a race lost too often", body = ProblemBody, content_type = PROBLEM_JSON),
        (status = 412, description = "If-Match names a version the customer is no longer at", body = ProblemBody, content_type = PROBLEM_JSON),
        BodyRefused,
        (status = 422, description = "A blank name", body = ProblemBody, content_type = PROBLEM_JSON),
        Faults,
    )
)]
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

#[utoipa::path(
    get,
    path = "/customers/{customer_id}",
    operation_id = "getCustomer",
    summary = "Read a customer as folded from its events",
    params(Handle),
    responses(
        (status = 200, description = "The customer", body = CustomerView, headers(
            ("ETag" = String, description = "The customer's version as a strong entity tag (\"3\"), for If-Match"),
        )),
        (status = 400, description = "Malformed handle", body = ProblemBody, content_type = PROBLEM_JSON),
        (status = 404, description = "No customer has this handle", body = ProblemBody, content_type = PROBLEM_JSON),
        Faults,
    )
)]
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
