//! `/v1/customers`.

use axum::extract::State;
use axum::{Extension, Json};
use serde_json::Value;
use tally_domain::customer::{CustomerInput, Patch};
use tally_engine::Scope;

use crate::error::ApiResult;
use crate::extract::{page_request, Fields, JsonObject, PathId, QueryParams};
use crate::openapi as doc;
use crate::{wire, AppState};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

/// The routes of this resource and their documentation (merged into the API by
/// `crate::api_router`).
pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(list, create))
        .routes(routes!(get, update))
}

fn customer_input(
    body: &serde_json::Map<String, Value>,
) -> Result<CustomerInput, tally_domain::FieldError> {
    let fields = Fields::new(body);
    Ok(CustomerInput {
        email: fields.patch_string("email")?,
        name: fields.patch_string("name")?,
        country: fields.patch_string("country")?,
        metadata: fields.patch_metadata("metadata")?,
        external_id: fields.patch_string("external_id")?,
    })
}

#[utoipa::path(
    post,
    path = "/v1/customers",
    operation_id = "customers_create",
    tag = "customers",
    summary = "Create a customer",
    request_body(content = doc::CustomerCreate, content_type = "application/json", example = json!({"email": "ada@example.com", "name": "Ada Lovelace", "country": "GB", "external_id": "user-42", "metadata": {"plan": "pro"}})),
    responses((status = 200, description = "Create a customer", body = doc::Customer), (status = 409, description = "external_id_taken", body = doc::ErrorBody))
)]
pub async fn create(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let mut input = customer_input(&body)?;
    // On create, an explicit null is the same as leaving a field out.
    for patch in [&mut input.name, &mut input.country, &mut input.external_id] {
        if *patch == Patch::Clear {
            *patch = Patch::Keep;
        }
    }
    if input.metadata == Patch::Clear {
        input.metadata = Patch::Keep;
    }
    let customer = state
        .engine
        .directory()
        .create_customer(&scope, &input)
        .await?;
    Ok(Json(wire::customer(&customer)))
}

#[utoipa::path(
    post,
    path = "/v1/customers/{id}",
    operation_id = "customers_update",
    tag = "customers",
    summary = "Update a customer",
    params(doc::IdParam),
    request_body(content = doc::CustomerUpdate, content_type = "application/json"),
    responses((status = 200, description = "Update a customer", body = doc::Customer), (status = 409, description = "external_id_taken", body = doc::ErrorBody))
)]
pub async fn update(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let input = customer_input(&body)?;
    let customer = state
        .engine
        .directory()
        .update_customer(&scope, &id, &input)
        .await?;
    Ok(Json(wire::customer(&customer)))
}

#[utoipa::path(
    get,
    path = "/v1/customers/{id}",
    operation_id = "customers_get",
    tag = "customers",
    summary = "Get a customer",
    params(doc::IdParam),
    responses((status = 200, description = "Get a customer", body = doc::Customer))
)]
pub async fn get(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
) -> ApiResult<Json<Value>> {
    Ok(Json(wire::customer(
        &state.engine.directory().get_customer(&scope, &id)?,
    )))
}

/// Lists customers newest first; `external_id=` narrows to the one holding it.
#[utoipa::path(
    get,
    path = "/v1/customers",
    operation_id = "customers_list",
    tag = "customers",
    summary = "List customers, newest first",
    params(doc::CursorParams, ("external_id" = Option<String>, Query, description = "only the customer holding this external id (a list of zero or one)")),
    responses((status = 200, description = "List customers, newest first", body = doc::List<doc::Customer>))
)]
pub async fn list(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    query: QueryParams,
) -> ApiResult<Json<Value>> {
    let page = page_request(&query)?;
    if let Some(external) = query.get("external_id") {
        let normalized = tally_domain::customer::normalize_external_id(external)?;
        let found = match state
            .engine
            .directory()
            .customer_id_by_external(&scope, &normalized)?
        {
            Some(id) => vec![state.engine.directory().get_customer(&scope, &id)?],
            None => Vec::new(),
        };
        let page = tally_engine::pagination::Page {
            data: found,
            has_more: false,
        };
        return Ok(Json(wire::list(&page, wire::customer)));
    }
    let page = state.engine.directory().list_customers(&scope, &page)?;
    Ok(Json(wire::list(&page, wire::customer)))
}
