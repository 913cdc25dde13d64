//! The billing API besides products: discounts, checkouts (with test cards),
//! transactions, refunds, disputes, subscriptions as read, and tax rates
//! (docs/api.md, "Discounts", "Checkouts", "Transactions").

use axum::extract::State;
use axum::{Extension, Json};
use serde_json::{json, Map, Value};
use tally_domain::billing::{CardInput, DiscountInput, DiscountUpdate};
use tally_domain::FieldError;
use tally_engine::billing::checkouts::CheckoutInput;
use tally_engine::billing::payments::{PaymentFilter, RefundInput};
use tally_engine::Scope;

use crate::error::ApiResult;
use crate::extract::{page_request, Fields, JsonObject, PathId, QueryParams};
use crate::{wire, AppState};

/// The routes of these resources (merged into the API by `crate::router`).
pub fn router() -> axum::Router<AppState> {
    use axum::routing;
    axum::Router::new()
        .route(
            "/v1/discounts",
            routing::get(find_discount).post(create_discount),
        )
        .route(
            "/v1/discounts/{id}",
            routing::get(get_discount)
                .post(update_discount)
                .delete(delete_discount),
        )
        .route(
            "/v1/checkouts",
            routing::post(create_checkout).get(list_checkouts),
        )
        .route("/v1/checkouts/{id}", routing::get(get_checkout))
        .route(
            "/v1/checkouts/{id}/complete",
            routing::post(complete_checkout),
        )
        .route("/v1/transactions", routing::get(list_transactions))
        .route("/v1/transactions/{id}", routing::get(get_transaction))
        .route("/v1/refunds", routing::post(create_refund))
        .route("/v1/disputes", routing::post(open_dispute))
        .route(
            "/v1/subscriptions/{id}",
            routing::get(get_subscription).post(crate::routes::subscriptions::update_subscription),
        )
        .route(
            "/v1/tax-rates",
            routing::post(set_tax_rate).get(list_tax_rates),
        )
}

/// The scope's business time: discount statuses follow a test store's test clock.
fn now(state: &AppState, scope: &Scope) -> i64 {
    state.engine.journal().now_in(scope)
}

fn discount_input(body: &Map<String, Value>) -> Result<DiscountInput, FieldError> {
    let fields = Fields::new(body);
    Ok(DiscountInput {
        name: fields.string("name")?,
        code: fields.string("code")?,
        discount_type: fields.string("type")?,
        amount: fields.quantity("amount")?,
        percentage: fields.quantity("percentage")?,
        currency: fields.string("currency")?,
        status: fields.string("status")?,
        starts_at: fields.string("starts_at")?,
        expiry_date: fields.string("expiry_date")?,
        max_redemptions: fields.number("max_redemptions", false)?,
        duration: fields.string("duration")?,
        duration_in_months: fields.number("duration_in_months", false)?,
        applies_to_products: fields.strings("applies_to_products")?,
    })
}

pub async fn create_discount(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let input = discount_input(&body)?;
    let discount = state
        .engine
        .billing()
        .create_discount(&scope, &input)
        .await?;
    Ok(Json(wire::discount(&discount, now(&state, &scope))))
}

/// `GET /v1/discounts?discount_id=` or `?discount_code=`: exactly one of them.
pub async fn find_discount(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    query: QueryParams,
) -> ApiResult<Json<Value>> {
    let billing = state.engine.billing();
    let discount = match (query.get("discount_id"), query.get("discount_code")) {
        (Some(id), None) => billing.get_discount(&scope, id)?,
        (None, Some(code)) => billing.discount_by_code(&scope, code, "discount_code")?,
        (Some(_), Some(_)) => {
            return Err(FieldError::invalid(
                "discount_code",
                "give `discount_id` or `discount_code`, not both",
            )
            .into())
        }
        (None, None) => {
            return Err(FieldError::new(
                "parameter_missing",
                "discount_id",
                "give `discount_id` or `discount_code`",
            )
            .into())
        }
    };
    Ok(Json(wire::discount(&discount, now(&state, &scope))))
}

pub async fn get_discount(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
) -> ApiResult<Json<Value>> {
    let discount = state.engine.billing().get_discount(&scope, &id)?;
    Ok(Json(wire::discount(&discount, now(&state, &scope))))
}

pub async fn update_discount(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let fields = Fields::new(&body);
    for immutable in [
        "code",
        "type",
        "amount",
        "percentage",
        "currency",
        "duration",
    ] {
        if fields.has(immutable) {
            return Err(FieldError::new(
                "discount_field_immutable",
                immutable,
                format!("`{immutable}` cannot change after creation; create another discount"),
            )
            .into());
        }
    }
    let update = DiscountUpdate {
        name: fields.patch_string("name")?,
        status: fields.patch_string("status")?,
        expiry_date: fields.patch_string("expiry_date")?,
        max_redemptions: fields.patch_number("max_redemptions", false)?,
    };
    let discount = state
        .engine
        .billing()
        .update_discount(&scope, &id, &update)
        .await?;
    Ok(Json(wire::discount(&discount, now(&state, &scope))))
}

pub async fn delete_discount(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
) -> ApiResult<Json<Value>> {
    let discount = state.engine.billing().delete_discount(&scope, &id).await?;
    Ok(Json(wire::discount(&discount, now(&state, &scope))))
}

pub async fn create_checkout(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let fields = Fields::new(&body);
    let customer_email = match fields.object("customer")? {
        Some(customer) => Some(
            customer
                .required_string("email")
                .map_err(|e| e.under("customer"))?,
        ),
        None => None,
    };
    let input = CheckoutInput {
        product_id: fields.string("product_id")?,
        customer_id: fields.string("customer_id")?,
        customer_email,
        units: fields.number("units", false)?,
        discount_code: fields.string("discount_code")?,
        affiliate_code: fields.string("affiliate_code")?,
        success_url: fields.string("success_url")?,
        metadata: fields.metadata("metadata")?,
    };
    let checkout = state
        .engine
        .billing()
        .create_checkout(&scope, &input)
        .await?;
    Ok(Json(wire::checkout(&checkout)))
}

/// `GET /v1/checkouts`: newest first, a cursor list.
pub async fn list_checkouts(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    query: QueryParams,
) -> ApiResult<Json<Value>> {
    let page = state
        .engine
        .billing()
        .list_checkouts(&scope, &page_request(&query)?)?;
    Ok(Json(wire::list(&page, wire::checkout)))
}

pub async fn get_checkout(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
) -> ApiResult<Json<Value>> {
    let billing = state.engine.billing();
    let checkout = billing.get_checkout(&scope, &id)?;
    let totals = billing.settlement_totals(&scope, &checkout.id)?;
    Ok(Json(wire::with_usage_settlement(
        wire::checkout(&checkout),
        &totals,
    )))
}

pub async fn complete_checkout(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let fields = Fields::new(&body);
    let card = CardInput {
        number: fields.number("card_number", true)?,
        cvc: fields.number("cvc", true)?,
        exp: fields.string("exp")?,
    };
    let checkout = state
        .engine
        .billing()
        .complete_checkout(&scope, &id, &card)
        .await?;
    Ok(Json(wire::checkout(&checkout)))
}

pub async fn get_transaction(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
) -> ApiResult<Json<Value>> {
    Ok(Json(wire::transaction(
        &state.engine.billing().get_payment(&scope, &id)?,
    )))
}

/// Transactions newest first: all, or one customer's (`customer_id`) or one
/// subscription's (`subscription_id`), not both.
pub async fn list_transactions(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    query: QueryParams,
) -> ApiResult<Json<Value>> {
    let filter = match (query.get("customer_id"), query.get("subscription_id")) {
        (Some(_), Some(_)) => {
            return Err(FieldError::invalid(
                "subscription_id",
                "filter by `customer_id` or `subscription_id`, not both",
            )
            .into())
        }
        (Some(customer), None) => {
            crate::routes::known_customer(&state, &scope, Some(customer), "customer_id")?;
            PaymentFilter::Customer(customer.to_string())
        }
        (None, Some(subscription)) => PaymentFilter::Subscription(subscription.to_string()),
        (None, None) => PaymentFilter::All,
    };
    let page = state
        .engine
        .billing()
        .list_payments(&scope, &filter, &page_request(&query)?)?;
    Ok(Json(wire::list(&page, wire::transaction)))
}

fn refund_input(body: &Map<String, Value>) -> Result<RefundInput, FieldError> {
    let fields = Fields::new(body);
    Ok(RefundInput {
        transaction_id: fields.string("transaction_id")?,
        amount: fields.number("amount", false)?,
        reason: fields.string("reason")?,
    })
}

pub async fn create_refund(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let input = refund_input(&body)?;
    let refund = state.engine.billing().create_refund(&scope, &input).await?;
    Ok(Json(wire::transaction(&refund)))
}

pub async fn open_dispute(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let input = refund_input(&body)?;
    let dispute = state.engine.billing().open_dispute(&scope, &input).await?;
    Ok(Json(wire::dispute(&dispute)))
}

pub async fn get_subscription(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
) -> ApiResult<Json<Value>> {
    subscription_body(&state, &scope, &id).map(Json)
}

/// A subscription as `GET /v1/subscriptions/{id}` shows it: the customer and the
/// last transaction embedded, the settlement of its `credits` usage prices.
pub fn subscription_body(state: &AppState, scope: &Scope, id: &str) -> ApiResult<Value> {
    let billing = state.engine.billing();
    let subscription = billing.get_subscription(scope, id)?;
    let customer = state
        .engine
        .directory()
        .get_customer(scope, &subscription.customer_id)
        .ok();
    let last = match &subscription.last_transaction_id {
        Some(id) => Some(billing.get_payment(scope, id)?),
        None => None,
    };
    let totals = billing.settlement_totals(scope, &subscription.id)?;
    Ok(wire::with_usage_settlement(
        wire::subscription(&subscription, customer.as_ref(), last.as_ref()),
        &totals,
    ))
}

/// `GET /v1/tax-rates`: the store's rates by country (not paginated: one per
/// country at most).
pub async fn list_tax_rates(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
) -> ApiResult<Json<Value>> {
    let rates = state.engine.billing().list_tax_rates(&scope)?;
    let data: Vec<Value> = rates
        .iter()
        .map(|(country, rate)| tax_rate(country, *rate))
        .collect();
    Ok(Json(
        json!({"object": "list", "data": data, "has_more": false}),
    ))
}

fn tax_rate(country: &str, rate: rust_decimal::Decimal) -> Value {
    json!({
        "object": "tax_rate",
        "country": country,
        "rate": tally_domain::usage::canonical_decimal(rate),
    })
}

/// `POST /v1/tax-rates {country, rate}`: the store's rate (percent) for a country.
pub async fn set_tax_rate(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let fields = Fields::new(&body);
    let country = fields.string("country")?;
    let rate = fields.quantity("rate")?;
    let (country, rate) = state
        .engine
        .billing()
        .set_tax_rate(&scope, country.as_deref(), rate.as_deref())
        .await?;
    Ok(Json(tax_rate(&country, rate)))
}
