//! Subscriptions after their checkout and the test clock (docs/api.md,
//! "Subscriptions", "Test clock"): the list, cancel, pause, resume; reading and
//! advancing a test store's time, which runs everything due until then.

use axum::extract::State;
use axum::{Extension, Json};
use serde_json::{json, Value};
use tally_domain::billing::SubscriptionStatus;
use tally_domain::time::format_iso8601_ms;
use tally_engine::billing::subscriptions::{
    ItemInput, SettingsInput, SubscriptionFilter, SubscriptionUpdate, MAX_SUBSCRIPTION_ITEMS,
};
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
        .routes(routes!(list_subscriptions))
        .routes(routes!(
            super::billing::get_subscription,
            update_subscription
        ))
        .routes(routes!(upgrade_subscription))
        .routes(routes!(cancel_subscription))
        .routes(routes!(pause_subscription))
        .routes(routes!(resume_subscription))
        .routes(routes!(upcoming_charge))
        .routes(routes!(get_store_settings, set_store_settings))
        .routes(routes!(get_test_clock))
        .routes(routes!(advance_test_clock))
}

/// `GET /v1/subscriptions?customer_id=&status=`: newest first, a cursor list.
#[utoipa::path(
    get,
    path = "/v1/subscriptions",
    operation_id = "list_subscriptions",
    tag = "subscriptions",
    summary = "List subscriptions",
    params(doc::CursorParams, ("customer_id" = Option<String>, Query, description = "one customer's"), ("status" = Option<String>, Query, description = "one status")),
    responses((status = 200, description = "List subscriptions", body = doc::List<doc::Subscription>), (status = 404, description = "resource_missing: the customer named by `customer_id` or `external_customer_id`", body = doc::ErrorBody))
)]
pub async fn list_subscriptions(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    query: QueryParams,
) -> ApiResult<Json<Value>> {
    let status = query
        .get("status")
        .map(|s| SubscriptionStatus::parse_field("status", s))
        .transpose()?;
    crate::routes::known_customer(&state, &scope, query.get("customer_id"), "customer_id")?;
    let filter = SubscriptionFilter {
        customer_id: query.get("customer_id").map(str::to_string),
        status,
    };
    let page =
        state
            .engine
            .billing()
            .list_subscriptions(&scope, &filter, &page_request(&query)?)?;
    wire::try_list(&page, |s| {
        crate::routes::billing::subscription_json(&state, &scope, s)
    })
    .map(Json)
}

async fn answer(state: &AppState, scope: &Scope, id: &str) -> ApiResult<Json<Value>> {
    crate::routes::billing::subscription_body(state, scope, id).map(Json)
}

/// `POST /v1/subscriptions/{id} {items?, update_behavior?, metadata?}`.
#[utoipa::path(
    post,
    path = "/v1/subscriptions/{id}",
    operation_id = "update_subscription",
    tag = "subscriptions",
    summary = "Change a subscription's items or metadata",
    params(doc::IdParam),
    request_body(content = doc::SubscriptionUpdate, content_type = "application/json"),
    responses((status = 200, description = "Change a subscription's items or metadata", body = doc::Subscription), (status = 402, description = "card_error: the proration charge was declined", body = doc::ErrorBody), (status = 409, description = "invalid_state_transition", body = doc::ErrorBody))
)]
pub async fn update_subscription(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let fields = Fields::new(&body);
    let items = match fields.patch_objects("items", |item| {
        let product_id = match item.string("product_id")? {
            Some(id) => Some(id),
            // The price of a product is the product (one price each).
            None => item.string("price_id")?,
        };
        Ok(ItemInput {
            id: item.string("id")?,
            product_id,
            units: item.small_uint("units")?,
        })
    })? {
        tally_domain::customer::Patch::Set(items) => items,
        _ => Vec::new(),
    };
    if items.len() > MAX_SUBSCRIPTION_ITEMS {
        return Err(tally_domain::FieldError::invalid(
            "items",
            format!("at most {MAX_SUBSCRIPTION_ITEMS} items"),
        )
        .into());
    }
    let input = SubscriptionUpdate {
        items,
        update_behavior: fields.string("update_behavior")?,
        metadata: fields
            .has("metadata")
            .then(|| fields.metadata("metadata"))
            .transpose()?,
    };
    state
        .engine
        .billing()
        .update_subscription(&scope, &id, &input)
        .await?;
    answer(&state, &scope, &id).await
}

/// `POST /v1/subscriptions/{id}/upgrade {product_id, update_behavior?}`.
#[utoipa::path(
    post,
    path = "/v1/subscriptions/{id}/upgrade",
    operation_id = "upgrade_subscription",
    tag = "subscriptions",
    summary = "Move the main item to another product",
    params(doc::IdParam),
    request_body(content = doc::SubscriptionUpgrade, content_type = "application/json"),
    responses((status = 200, description = "Move the main item to another product", body = doc::Subscription), (status = 402, description = "card_error: the proration charge was declined", body = doc::ErrorBody), (status = 409, description = "invalid_state_transition", body = doc::ErrorBody))
)]
pub async fn upgrade_subscription(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let fields = Fields::new(&body);
    let product_id = fields.string("product_id")?;
    let behavior = fields.string("update_behavior")?;
    state
        .engine
        .billing()
        .upgrade_subscription(&scope, &id, product_id.as_deref(), behavior.as_deref())
        .await?;
    answer(&state, &scope, &id).await
}

/// `POST /v1/subscriptions/{id}/cancel {mode?, onExecute?}`.
#[utoipa::path(
    post,
    path = "/v1/subscriptions/{id}/cancel",
    operation_id = "cancel_subscription",
    tag = "subscriptions",
    summary = "Cancel a subscription (scheduled or immediate)",
    params(doc::IdParam),
    request_body(content = doc::SubscriptionCancel, content_type = "application/json"),
    responses((status = 200, description = "Cancel a subscription (scheduled or immediate)", body = doc::Subscription), (status = 409, description = "invalid_state_transition", body = doc::ErrorBody))
)]
pub async fn cancel_subscription(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let fields = Fields::new(&body);
    let mode = fields.string("mode")?;
    let on_execute = fields.string("onExecute")?;
    state
        .engine
        .billing()
        .cancel_subscription(&scope, &id, mode.as_deref(), on_execute.as_deref())
        .await?;
    answer(&state, &scope, &id).await
}

#[utoipa::path(
    post,
    path = "/v1/subscriptions/{id}/pause",
    operation_id = "pause_subscription",
    tag = "subscriptions",
    summary = "Pause a subscription",
    params(doc::IdParam),
    request_body(content = doc::NoBody, content_type = "application/json"),
    responses((status = 200, description = "Pause a subscription", body = doc::Subscription), (status = 409, description = "invalid_state_transition", body = doc::ErrorBody))
)]
pub async fn pause_subscription(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
    JsonObject(_): JsonObject,
) -> ApiResult<Json<Value>> {
    state
        .engine
        .billing()
        .pause_subscription(&scope, &id)
        .await?;
    answer(&state, &scope, &id).await
}

#[utoipa::path(
    post,
    path = "/v1/subscriptions/{id}/resume",
    operation_id = "resume_subscription",
    tag = "subscriptions",
    summary = "Resume a paused subscription",
    params(doc::IdParam),
    request_body(content = doc::NoBody, content_type = "application/json"),
    responses((status = 200, description = "Resume a paused subscription", body = doc::Subscription), (status = 402, description = "card_error: the new period's charge was declined", body = doc::ErrorBody), (status = 409, description = "invalid_state_transition", body = doc::ErrorBody))
)]
pub async fn resume_subscription(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
    JsonObject(_): JsonObject,
) -> ApiResult<Json<Value>> {
    state
        .engine
        .billing()
        .resume_subscription(&scope, &id)
        .await?;
    answer(&state, &scope, &id).await
}

/// `GET /v1/subscriptions/{id}/upcoming`: the next charge as of now (usage to
/// date), writing nothing; 404 `resource_missing` when nothing is due ahead.
#[utoipa::path(
    get,
    path = "/v1/subscriptions/{id}/upcoming",
    operation_id = "upcoming_charge",
    tag = "subscriptions",
    summary = "Preview the next charge (or an upgrade)",
    params(doc::IdParam, ("product_id" = Option<String>, Query, description = "preview an upgrade to this product")),
    responses((status = 200, description = "Preview the next charge (or an upgrade)", body = doc::UpcomingTransaction), (status = 404, description = "resource_missing: the subscription, or nothing is due ahead", body = doc::ErrorBody))
)]
pub async fn upcoming_charge(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
    query: QueryParams,
) -> ApiResult<Json<Value>> {
    let billing = state.engine.billing();
    let upcoming = match query.get("product_id") {
        Some(product_id) => billing.preview_upgrade(&scope, &id, product_id)?,
        None => billing.upcoming(&scope, &id)?,
    }
    .ok_or_else(|| tally_engine::EngineError::not_found("upcoming charge", &id))?;
    Ok(Json(json!({
        "object": "upcoming_transaction",
        "subscription": id,
        "date": format_iso8601_ms(upcoming.at_ms),
        "period_start": upcoming.period.map(|p| p.0),
        "period_end": upcoming.period.map(|p| p.1),
        "currency": upcoming.currency,
        "amount": upcoming.charge.amount,
        "discount_amount": upcoming.charge.discount_amount,
        "tax_amount": upcoming.charge.tax_amount,
        "amount_paid": upcoming.charge.amount_paid,
        "lines": wire::lines(&upcoming.lines),
        "proration_now": upcoming
            .proration_now
            .as_ref()
            .map(|line| wire::lines(std::slice::from_ref(line))[0].clone()),
    })))
}

fn settings(s: &tally_domain::subscription::StoreSettings) -> Value {
    json!({
        "object": "store_settings",
        "default_cancel_mode": s.default_cancel_mode.as_str(),
        "late_usage_grace_seconds": s.late_usage_grace_ms / 1000,
        "affiliate_commission_percent":
            tally_domain::usage::canonical_decimal(s.affiliate_commission_percent),
        "referral_base_url": s.referral_base_url,
    })
}

/// `GET /v1/store/settings`: the store's billing settings in this environment.
#[utoipa::path(
    get,
    path = "/v1/store/settings",
    operation_id = "get_store_settings",
    tag = "store",
    summary = "Get the store's billing settings",
    responses((status = 200, description = "Get the store's billing settings", body = doc::StoreSettings))
)]
pub async fn get_store_settings(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
) -> ApiResult<Json<Value>> {
    Ok(Json(settings(
        &state.engine.billing().store_settings(&scope)?,
    )))
}

/// `POST /v1/store/settings {default_cancel_mode?, late_usage_grace_seconds?}`.
#[utoipa::path(
    post,
    path = "/v1/store/settings",
    operation_id = "set_store_settings",
    tag = "store",
    summary = "Change the store's billing settings",
    request_body(content = doc::StoreSettingsInput, content_type = "application/json"),
    responses((status = 200, description = "Change the store's billing settings", body = doc::StoreSettings))
)]
pub async fn set_store_settings(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let fields = Fields::new(&body);
    let input = SettingsInput {
        default_cancel_mode: fields.string("default_cancel_mode")?,
        late_usage_grace_seconds: fields.small_uint("late_usage_grace_seconds")?,
        affiliate_commission_percent: fields.quantity("affiliate_commission_percent")?,
        referral_base_url: fields.patch_string("referral_base_url")?,
    };
    let saved = state
        .engine
        .billing()
        .set_store_settings(&scope, &input)
        .await?;
    Ok(Json(settings(&saved)))
}

fn clock(now_ms: i64) -> Value {
    json!({"object": "test_clock", "now": format_iso8601_ms(now_ms)})
}

/// `GET /v1/test-clock`: the test store's time.
#[utoipa::path(
    get,
    path = "/v1/test-clock",
    operation_id = "get_test_clock",
    tag = "test-clock",
    summary = "Get the test clock (test mode)",
    responses((status = 200, description = "Get the test clock (test mode)", body = doc::TestClock), (status = 400, description = "test_mode_only", body = doc::ErrorBody))
)]
pub async fn get_test_clock(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
) -> ApiResult<Json<Value>> {
    Ok(Json(clock(state.engine.billing().test_clock(&scope)?)))
}

/// `POST /v1/test-clock/advance {to}`: answers once everything due until `to` ran.
#[utoipa::path(
    post,
    path = "/v1/test-clock/advance",
    operation_id = "advance_test_clock",
    tag = "test-clock",
    summary = "Advance the test clock and run what falls due",
    request_body(content = doc::ClockAdvance, content_type = "application/json"),
    responses((status = 200, description = "Advance the test clock and run what falls due", body = doc::TestClock), (status = 400, description = "test_mode_only, test_clock_backwards", body = doc::ErrorBody))
)]
pub async fn advance_test_clock(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let to = Fields::new(&body).string("to")?;
    let now = state
        .engine
        .billing()
        .advance_test_clock(&scope, to.as_deref())
        .await?;
    Ok(Json(clock(now)))
}
