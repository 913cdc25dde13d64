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
use crate::{wire, AppState};

pub fn router() -> axum::Router<AppState> {
    use axum::routing;
    axum::Router::new()
        .route("/v1/subscriptions", routing::get(list_subscriptions))
        .route(
            "/v1/subscriptions/{id}/upgrade",
            routing::post(upgrade_subscription),
        )
        .route(
            "/v1/subscriptions/{id}/cancel",
            routing::post(cancel_subscription),
        )
        .route(
            "/v1/subscriptions/{id}/pause",
            routing::post(pause_subscription),
        )
        .route(
            "/v1/subscriptions/{id}/resume",
            routing::post(resume_subscription),
        )
        .route(
            "/v1/subscriptions/{id}/upcoming",
            routing::get(upcoming_charge),
        )
        .route(
            "/v1/store/settings",
            routing::get(get_store_settings).post(set_store_settings),
        )
        .route("/v1/test-clock", routing::get(get_test_clock))
        .route("/v1/test-clock/advance", routing::post(advance_test_clock))
}

/// `GET /v1/subscriptions?customer_id=&status=`: newest first, a cursor list.
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
    Ok(Json(wire::list(&page, |s| {
        wire::subscription(s, None, None)
    })))
}

async fn answer(state: &AppState, scope: &Scope, id: &str) -> ApiResult<Json<Value>> {
    crate::routes::billing::subscription_body(state, scope, id).map(Json)
}

/// `POST /v1/subscriptions/{id} {items?, update_behavior?, metadata?}`.
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

pub async fn pause_subscription(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
) -> ApiResult<Json<Value>> {
    state
        .engine
        .billing()
        .pause_subscription(&scope, &id)
        .await?;
    answer(&state, &scope, &id).await
}

pub async fn resume_subscription(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
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
pub async fn get_store_settings(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
) -> ApiResult<Json<Value>> {
    Ok(Json(settings(
        &state.engine.billing().store_settings(&scope)?,
    )))
}

/// `POST /v1/store/settings {default_cancel_mode?, late_usage_grace_seconds?}`.
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
pub async fn get_test_clock(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
) -> ApiResult<Json<Value>> {
    Ok(Json(clock(state.engine.billing().test_clock(&scope)?)))
}

/// `POST /v1/test-clock/advance {to}`: answers once everything due until `to` ran.
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
