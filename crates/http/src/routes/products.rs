//! `/v1/products`: create, read, list, update, archive, unarchive.

use axum::extract::State;
use axum::{Extension, Json};
use serde_json::{Map, Value};
use tally_domain::customer::Patch;
use tally_domain::product::{
    CustomFieldInput, FeatureInput, ProductInput, ProductStatus, UsagePriceInput,
};
use tally_domain::FieldError;
use tally_engine::products::ProductStatusFilter;
use tally_engine::Scope;

use crate::error::ApiResult;
use crate::extract::{page_request, wrong_type, Fields, JsonObject, PathId, QueryParams};
use crate::{wire, AppState};

/// The routes of this resource (merged into the API by `crate::router`).
pub fn router() -> axum::Router<AppState> {
    use axum::routing;
    axum::Router::new()
        .route("/v1/products", routing::get(list).post(create))
        .route("/v1/products/{id}", routing::get(get).post(update))
        .route("/v1/products/{id}/archive", routing::post(archive))
        .route("/v1/products/{id}/unarchive", routing::post(unarchive))
}

/// A number field as its exact text (money and quantities never pass through a
/// float). Decimal quantities may also be sent as decimal strings, as credits are.
fn patch_number(
    map: &Map<String, Value>,
    name: &str,
    param: &str,
    strings: bool,
) -> Result<Patch<String>, FieldError> {
    match map.get(name) {
        None => Ok(Patch::Keep),
        Some(Value::Null) => Ok(Patch::Clear),
        Some(Value::Number(n)) => Ok(Patch::Set(n.to_string())),
        Some(Value::String(s)) if strings => Ok(Patch::Set(s.clone())),
        Some(other) => Err(wrong_type(param, "a number", other)),
    }
}

fn number(map: &Map<String, Value>, name: &str, param: &str) -> Result<Option<String>, FieldError> {
    Ok(match patch_number(map, name, param, true)? {
        Patch::Set(text) => Some(text),
        _ => None,
    })
}

fn string(map: &Map<String, Value>, name: &str, param: &str) -> Result<Option<String>, FieldError> {
    match map.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(other) => Err(wrong_type(param, "a string", other)),
    }
}

fn boolean(map: &Map<String, Value>, name: &str, param: &str) -> Result<Option<bool>, FieldError> {
    match map.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(other) => Err(wrong_type(param, "a boolean", other)),
    }
}

fn small_int(map: &Map<String, Value>, name: &str, param: &str) -> Result<Option<u32>, FieldError> {
    match map.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => n.to_string().parse::<u32>().map(Some).map_err(|_| {
            FieldError::invalid(param, format!("`{param}` must be a non-negative integer"))
        }),
        Some(other) => Err(wrong_type(param, "a number", other)),
    }
}

/// An array of objects, each read by `read` with its indexed path.
fn patch_objects<T>(
    body: &Map<String, Value>,
    name: &str,
    read: impl Fn(&Map<String, Value>, &str) -> Result<T, FieldError>,
) -> Result<Patch<Vec<T>>, FieldError> {
    match body.get(name) {
        None => Ok(Patch::Keep),
        Some(Value::Null) => Ok(Patch::Clear),
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, item)| {
                let path = format!("{name}[{i}]");
                match item {
                    Value::Object(map) => read(map, &path),
                    other => Err(wrong_type(&path, "an object", other)),
                }
            })
            .collect::<Result<Vec<T>, _>>()
            .map(Patch::Set),
        Some(other) => Err(wrong_type(name, "an array", other)),
    }
}

fn feature(map: &Map<String, Value>, path: &str) -> Result<FeatureInput, FieldError> {
    let at = |field: &str| format!("{path}.{field}");
    let mut input = FeatureInput {
        feature_type: string(map, "type", &at("type"))?,
        description: string(map, "description", &at("description"))?,
        ..FeatureInput::default()
    };
    match map.get("customer_credits") {
        None | Some(Value::Null) => {}
        Some(Value::Object(credits)) => {
            let at = |field: &str| format!("{path}.customer_credits.{field}");
            input.has_credits = true;
            input.credits_amount = number(credits, "amount", &at("amount"))?;
            input.credits_unit_label = string(credits, "unit_label", &at("unit_label"))?;
            input.credits_bucket_name = string(credits, "bucket_name", &at("bucket_name"))?;
        }
        Some(other) => return Err(wrong_type(&at("customer_credits"), "an object", other)),
    }
    Ok(input)
}

fn usage_price(map: &Map<String, Value>, path: &str) -> Result<UsagePriceInput, FieldError> {
    let at = |field: &str| format!("{path}.{field}");
    Ok(UsagePriceInput {
        meter_id: string(map, "meter_id", &at("meter_id"))?,
        unit_price: number(map, "unit_price", &at("unit_price"))?,
        free_allowance: number(map, "free_allowance", &at("free_allowance"))?,
        cap: number(map, "cap", &at("cap"))?,
        settlement_mode: string(map, "settlement_mode", &at("settlement_mode"))?,
        target_account: string(map, "target_account", &at("target_account"))?,
        target_account_name: string(map, "target_account_name", &at("target_account_name"))?,
        trial_usage_mode: string(map, "trial_usage_mode", &at("trial_usage_mode"))?,
    })
}

fn custom_field(map: &Map<String, Value>, path: &str) -> Result<CustomFieldInput, FieldError> {
    let at = |field: &str| format!("{path}.{field}");
    let mut input = CustomFieldInput {
        field_type: string(map, "type", &at("type"))?,
        key: string(map, "key", &at("key"))?,
        label: string(map, "label", &at("label"))?,
        optional: boolean(map, "optional", &at("optional"))?,
        ..CustomFieldInput::default()
    };
    match map.get("text") {
        None | Some(Value::Null) => {}
        Some(Value::Object(text)) => {
            input.min_length = small_int(text, "minimum_length", &at("text.minimum_length"))?;
            input.max_length = small_int(text, "max_length", &at("text.max_length"))?;
        }
        Some(other) => return Err(wrong_type(&at("text"), "an object", other)),
    }
    match map.get("checkbox") {
        None | Some(Value::Null) => {}
        Some(Value::Object(checkbox)) => {
            input.checkbox_label = string(checkbox, "label", &at("checkbox.label"))?;
        }
        Some(other) => return Err(wrong_type(&at("checkbox"), "an object", other)),
    }
    Ok(input)
}

fn product_input(body: &Map<String, Value>) -> Result<ProductInput, FieldError> {
    let fields = Fields::new(body);
    let image_urls = match body.get("image_urls") {
        None => Patch::Keep,
        Some(Value::Null) => Patch::Clear,
        Some(Value::Array(items)) => Patch::Set(
            items
                .iter()
                .enumerate()
                .map(|(i, item)| match item {
                    Value::String(s) => Ok(s.clone()),
                    other => Err(wrong_type(&format!("image_urls[{i}]"), "a string", other)),
                })
                .collect::<Result<_, _>>()?,
        ),
        Some(other) => return Err(wrong_type("image_urls", "an array", other)),
    };
    let business_net_pricing = match body.get("business_net_pricing") {
        None => Patch::Keep,
        Some(Value::Null) => Patch::Clear,
        Some(Value::Bool(b)) => Patch::Set(*b),
        Some(other) => return Err(wrong_type("business_net_pricing", "a boolean", other)),
    };
    Ok(ProductInput {
        name: fields.patch_string("name")?,
        description: fields.patch_string("description")?,
        price: patch_number(body, "price", "price", false)?,
        currency: fields.patch_string("currency")?,
        billing_type: fields.patch_string("billing_type")?,
        billing_period: fields.patch_string("billing_period")?,
        status: fields.patch_string("status")?,
        tax_mode: fields.patch_string("tax_mode")?,
        tax_category: fields.patch_string("tax_category")?,
        image_url: fields.patch_string("image_url")?,
        image_urls,
        features: patch_objects(body, "features", feature)?,
        usage_prices: patch_objects(body, "usage_prices", usage_price)?,
        trial_period_days: patch_number(body, "trial_period_days", "trial_period_days", false)?,
        trial_price: patch_number(body, "trial_price", "trial_price", false)?,
        business_net_pricing,
        product_url: fields.patch_string("product_url")?,
        default_success_url: fields.patch_string("default_success_url")?,
        custom_fields: patch_objects(body, "custom_fields", custom_field)?,
    })
}

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

pub async fn get(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
) -> ApiResult<Json<Value>> {
    Ok(Json(wire::product(
        &state.engine.billing().get_product(&scope, &id)?,
    )))
}

pub async fn archive(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
) -> ApiResult<Json<Value>> {
    let product = state
        .engine
        .billing()
        .set_product_status(&scope, &id, ProductStatus::Archived)
        .await?;
    Ok(Json(wire::product(&product)))
}

pub async fn unarchive(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
) -> ApiResult<Json<Value>> {
    let product = state
        .engine
        .billing()
        .set_product_status(&scope, &id, ProductStatus::Active)
        .await?;
    Ok(Json(wire::product(&product)))
}

/// Lists products newest first; `status=active|archived|all` (default `active`).
pub async fn list(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    query: QueryParams,
) -> ApiResult<Json<Value>> {
    let status = match query.get("status") {
        None | Some("active") => ProductStatusFilter::Active,
        Some("archived") => ProductStatusFilter::Archived,
        Some("all") => ProductStatusFilter::All,
        Some(_) => {
            return Err(
                FieldError::invalid("status", "`status` must be active, archived or all").into(),
            )
        }
    };
    let page = state
        .engine
        .billing()
        .list_products(&scope, status, &page_request(&query)?)?;
    Ok(Json(wire::list(&page, wire::product)))
}
