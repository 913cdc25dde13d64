//! `/v1/products`: create, read, list, update, archive, unarchive.

use axum::extract::State;
use axum::{Extension, Json};
use serde_json::{Map, Value};
use tally_domain::product::{
    CustomFieldInput, FeatureInput, ProductInput, ProductStatus, UsagePriceInput,
};
use tally_domain::FieldError;
use tally_engine::Scope;

use crate::error::ApiResult;
use crate::extract::{page_request, status_filter, Fields, JsonObject, PathId, QueryParams};
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
        .routes(routes!(archive))
        .routes(routes!(unarchive))
}

fn feature(fields: Fields<'_>) -> Result<FeatureInput, FieldError> {
    let mut input = FeatureInput {
        feature_type: fields.string("type")?,
        description: fields.string("description")?,
        ..FeatureInput::default()
    };
    if let Some(credits) = fields.object("customer_credits")? {
        let under = |e: FieldError| e.under("customer_credits");
        input.has_credits = true;
        input.credits_amount = credits.quantity("amount").map_err(under)?;
        input.credits_unit_label = credits.string("unit_label").map_err(under)?;
        input.credits_bucket_name = credits.string("bucket_name").map_err(under)?;
    }
    Ok(input)
}

fn usage_price(fields: Fields<'_>) -> Result<UsagePriceInput, FieldError> {
    Ok(UsagePriceInput {
        meter_id: fields.string("meter_id")?,
        unit_price: fields.quantity("unit_price")?,
        free_allowance: fields.quantity("free_allowance")?,
        cap: fields.quantity("cap")?,
        settlement_mode: fields.string("settlement_mode")?,
        target_account: fields.string("target_account")?,
        target_account_name: fields.string("target_account_name")?,
        trial_usage_mode: fields.string("trial_usage_mode")?,
    })
}

fn custom_field(fields: Fields<'_>) -> Result<CustomFieldInput, FieldError> {
    let mut input = CustomFieldInput {
        field_type: fields.string("type")?,
        key: fields.string("key")?,
        label: fields.string("label")?,
        optional: fields.boolean("optional")?,
        ..CustomFieldInput::default()
    };
    if let Some(text) = fields.object("text")? {
        let under = |e: FieldError| e.under("text");
        input.min_length = text.small_uint("minimum_length").map_err(under)?;
        input.max_length = text.small_uint("max_length").map_err(under)?;
    }
    if let Some(checkbox) = fields.object("checkbox")? {
        input.checkbox_label = checkbox.string("label").map_err(|e| e.under("checkbox"))?;
    }
    Ok(input)
}

fn product_input(body: &Map<String, Value>) -> Result<ProductInput, FieldError> {
    let fields = Fields::new(body);
    Ok(ProductInput {
        name: fields.patch_string("name")?,
        description: fields.patch_string("description")?,
        price: fields.patch_number("price", false)?,
        currency: fields.patch_string("currency")?,
        billing_type: fields.patch_string("billing_type")?,
        billing_period: fields.patch_string("billing_period")?,
        status: fields.patch_string("status")?,
        tax_mode: fields.patch_string("tax_mode")?,
        tax_category: fields.patch_string("tax_category")?,
        image_url: fields.patch_string("image_url")?,
        image_urls: fields.patch_strings("image_urls")?,
        features: fields.patch_objects("features", feature)?,
        usage_prices: fields.patch_objects("usage_prices", usage_price)?,
        trial_period_days: fields.patch_number("trial_period_days", false)?,
        trial_price: fields.patch_number("trial_price", false)?,
        business_net_pricing: fields.patch_boolean("business_net_pricing")?,
        product_url: fields.patch_string("product_url")?,
        default_success_url: fields.patch_string("default_success_url")?,
        custom_fields: fields.patch_objects("custom_fields", custom_field)?,
    })
}

#[utoipa::path(
    post,
    path = "/v1/products",
    operation_id = "products_create",
    tag = "products",
    summary = "Create a product",
    request_body(content = doc::ProductCreate, content_type = "application/json", example = json!({"name": "Pro", "price": 2900, "currency": "USD", "billing_type": "recurring", "billing_period": "every-month", "usage_prices": [{"meter_id": "mtr_9Lq3", "unit_price": "0.002", "free_allowance": 100000}], "features": [{"type": "customer_credits", "customer_credits": {"amount": "500"}}]})),
    responses((status = 200, description = "Create a product", body = doc::Product), (status = 404, description = "resource_missing (param `usage_prices[N].meter_id`)", body = doc::ErrorBody), (status = 409, description = "meter_not_active", body = doc::ErrorBody))
)]
pub async fn create(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let input = product_input(&body)?;
    let product = state
        .engine
        .billing()
        .create_product(&scope, &input)
        .await?;
    Ok(Json(wire::product(&product)))
}

#[utoipa::path(
    post,
    path = "/v1/products/{id}",
    operation_id = "products_update",
    tag = "products",
    summary = "Update a product",
    params(doc::IdParam),
    request_body(content = doc::ProductInput, content_type = "application/json", example = json!({"name": "Pro", "price": 2900, "currency": "USD", "billing_type": "recurring", "billing_period": "every-month", "usage_prices": [{"meter_id": "mtr_9Lq3", "unit_price": "0.002", "free_allowance": 100000}], "features": [{"type": "customer_credits", "customer_credits": {"amount": "500"}}]})),
    responses((status = 200, description = "Update a product", body = doc::Product), (status = 400, description = "product_field_immutable, parameter_invalid", body = doc::ErrorBody), (status = 409, description = "meter_not_active", body = doc::ErrorBody))
)]
pub async fn update(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let input = product_input(&body)?;
    let product = state
        .engine
        .billing()
        .update_product(&scope, &id, &input)
        .await?;
    Ok(Json(wire::product(&product)))
}

#[utoipa::path(
    get,
    path = "/v1/products/{id}",
    operation_id = "products_get",
    tag = "products",
    summary = "Get a product",
    params(doc::IdParam),
    responses((status = 200, description = "Get a product", body = doc::Product))
)]
pub async fn get(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
) -> ApiResult<Json<Value>> {
    Ok(Json(wire::product(
        &state.engine.billing().get_product(&scope, &id)?,
    )))
}

#[utoipa::path(
    post,
    path = "/v1/products/{id}/archive",
    operation_id = "products_archive",
    tag = "products",
    summary = "Archive a product",
    params(doc::IdParam),
    request_body(content = doc::NoBody, content_type = "application/json"),
    responses((status = 200, description = "Archive a product", body = doc::Product))
)]
pub async fn archive(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
    JsonObject(_): JsonObject,
) -> ApiResult<Json<Value>> {
    set_status(&state, &scope, &id, ProductStatus::Archived).await
}

#[utoipa::path(
    post,
    path = "/v1/products/{id}/unarchive",
    operation_id = "products_unarchive",
    tag = "products",
    summary = "Unarchive a product",
    params(doc::IdParam),
    request_body(content = doc::NoBody, content_type = "application/json"),
    responses((status = 200, description = "Unarchive a product", body = doc::Product), (status = 409, description = "meter_not_active", body = doc::ErrorBody))
)]
pub async fn unarchive(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
    JsonObject(_): JsonObject,
) -> ApiResult<Json<Value>> {
    set_status(&state, &scope, &id, ProductStatus::Active).await
}

async fn set_status(
    state: &AppState,
    scope: &Scope,
    id: &str,
    status: ProductStatus,
) -> ApiResult<Json<Value>> {
    let product = state
        .engine
        .billing()
        .set_product_status(scope, id, status)
        .await?;
    Ok(Json(wire::product(&product)))
}

/// Lists products newest first; `status=active|archived|all` (default `active`).
#[utoipa::path(
    get,
    path = "/v1/products",
    operation_id = "products_list",
    tag = "products",
    summary = "List products",
    params(doc::CursorParams, ("status" = Option<String>, Query, description = "`active` (default), `archived` or `all`")),
    responses((status = 200, description = "List products", body = doc::List<doc::Product>))
)]
pub async fn list(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    query: QueryParams,
) -> ApiResult<Json<Value>> {
    let page = state.engine.billing().list_products(
        &scope,
        status_filter(&query)?,
        &page_request(&query)?,
    )?;
    Ok(Json(wire::list(&page, wire::product)))
}
