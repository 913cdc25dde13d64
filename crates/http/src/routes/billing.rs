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
use crate::openapi as doc;
use crate::{wire, AppState};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

/// The routes of this resource and their documentation (merged into the API by
/// `crate::api_router`).
pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(find_discount, create_discount))
        .routes(routes!(get_discount, update_discount, delete_discount))
        .routes(routes!(create_checkout, list_checkouts))
        .routes(routes!(get_checkout))
        .routes(routes!(complete_checkout))
        .routes(routes!(list_transactions))
        .routes(routes!(get_transaction))
        .routes(routes!(create_refund))
        .routes(routes!(open_dispute))
        .routes(routes!(set_tax_rate, list_tax_rates))
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

#[utoipa::path(
    post,
    path = "/v1/discounts",
    operation_id = "create_discount",
    tag = "discounts",
    summary = "Create a discount",
    request_body(content = doc::DiscountCreate, content_type = "application/json"),
    responses((status = 200, description = "Create a discount", body = doc::Discount), (status = 404, description = "resource_missing (param `applies_to_products[N]`)", body = doc::ErrorBody), (status = 409, description = "discount_code_taken", body = doc::ErrorBody))
)]
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
#[utoipa::path(
    get,
    path = "/v1/discounts",
    operation_id = "find_discount",
    tag = "discounts",
    summary = "Find one discount by id or code",
    params(("discount_id" = Option<String>, Query, description = "exactly one of `discount_id` and `discount_code`"), ("discount_code" = Option<String>, Query, description = "exactly one of `discount_id` and `discount_code`")),
    responses((status = 200, description = "Find one discount by id or code", body = doc::Discount), (status = 404, description = "resource_missing", body = doc::ErrorBody))
)]
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

#[utoipa::path(
    get,
    path = "/v1/discounts/{id}",
    operation_id = "get_discount",
    tag = "discounts",
    summary = "Get a discount",
    params(doc::IdParam),
    responses((status = 200, description = "Get a discount", body = doc::Discount))
)]
pub async fn get_discount(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
) -> ApiResult<Json<Value>> {
    let discount = state.engine.billing().get_discount(&scope, &id)?;
    Ok(Json(wire::discount(&discount, now(&state, &scope))))
}

#[utoipa::path(
    post,
    path = "/v1/discounts/{id}",
    operation_id = "update_discount",
    tag = "discounts",
    summary = "Update a discount",
    params(doc::IdParam),
    request_body(content = doc::DiscountInput, content_type = "application/json"),
    responses((status = 200, description = "Update a discount", body = doc::Discount), (status = 400, description = "discount_field_immutable, parameter_invalid", body = doc::ErrorBody))
)]
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

#[utoipa::path(
    delete,
    path = "/v1/discounts/{id}",
    operation_id = "delete_discount",
    tag = "discounts",
    summary = "Delete a discount (status `deleted`)",
    params(doc::IdParam),
    responses((status = 200, description = "Delete a discount (status `deleted`)", body = doc::Discount))
)]
pub async fn delete_discount(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
) -> ApiResult<Json<Value>> {
    let discount = state.engine.billing().delete_discount(&scope, &id).await?;
    Ok(Json(wire::discount(&discount, now(&state, &scope))))
}

#[utoipa::path(
    post,
    path = "/v1/checkouts",
    operation_id = "create_checkout",
    tag = "checkouts",
    summary = "Create a checkout",
    request_body(content = doc::CheckoutCreate, content_type = "application/json", example = json!({"product_id": "prod_7Hk2", "customer_id": "cus_4fJ2b8XkQ1", "units": 1, "discount_code": "LAUNCH10"})),
    responses((status = 200, description = "Create a checkout", body = doc::Checkout), (status = 400, description = "product_not_active, discount_not_active, discount_expired, discount_exhausted, discount_not_applicable, discount_currency_mismatch", body = doc::ErrorBody), (status = 404, description = "resource_missing (param `product_id`, `customer_id`, `discount_code` or `affiliate_code`)", body = doc::ErrorBody))
)]
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
#[utoipa::path(
    get,
    path = "/v1/checkouts",
    operation_id = "list_checkouts",
    tag = "checkouts",
    summary = "List checkouts",
    params(doc::CursorParams),
    responses((status = 200, description = "List checkouts", body = doc::List<doc::Checkout>))
)]
pub async fn list_checkouts(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    query: QueryParams,
) -> ApiResult<Json<Value>> {
    let page = state
        .engine
        .billing()
        .list_checkouts(&scope, &page_request(&query)?)?;
    wire::try_list(&page, |checkout| checkout_json(&state, &scope, checkout)).map(Json)
}

/// A checkout as every answer shows it, in a list too: with the usage settlement
/// of a one-time purchase.
fn checkout_json(
    state: &AppState,
    scope: &Scope,
    checkout: &tally_domain::billing::Checkout,
) -> ApiResult<Value> {
    let totals = state
        .engine
        .billing()
        .settlement_totals(scope, &checkout.id)?;
    Ok(wire::with_usage_settlement(
        wire::checkout(checkout),
        &totals,
    ))
}

#[utoipa::path(
    get,
    path = "/v1/checkouts/{id}",
    operation_id = "get_checkout",
    tag = "checkouts",
    summary = "Get a checkout",
    params(doc::IdParam),
    responses((status = 200, description = "Get a checkout", body = doc::Checkout))
)]
pub async fn get_checkout(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
) -> ApiResult<Json<Value>> {
    let checkout = state.engine.billing().get_checkout(&scope, &id)?;
    checkout_json(&state, &scope, &checkout).map(Json)
}

#[utoipa::path(
    post,
    path = "/v1/checkouts/{id}/complete",
    operation_id = "complete_checkout",
    tag = "checkouts",
    summary = "Pay a checkout with a test card",
    params(doc::IdParam),
    request_body(content = doc::CardPayment, content_type = "application/json", example = json!({"card_number": "4242424242424242", "cvc": "123", "exp": "12/30"})),
    responses((status = 200, description = "Pay a checkout with a test card", body = doc::Checkout), (status = 400, description = "payment_provider_not_configured, discount_* (param `discount_code`), product_not_active", body = doc::ErrorBody), (status = 402, description = "card_error: card_declined, insufficient_funds, incorrect_cvc", body = doc::ErrorBody))
)]
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

#[utoipa::path(
    get,
    path = "/v1/transactions/{id}",
    operation_id = "get_transaction",
    tag = "transactions",
    summary = "Get a transaction",
    params(doc::IdParam),
    responses((status = 200, description = "Get a transaction", body = doc::Transaction))
)]
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
#[utoipa::path(
    get,
    path = "/v1/transactions",
    operation_id = "list_transactions",
    tag = "transactions",
    summary = "List transactions",
    params(doc::CursorParams, ("customer_id" = Option<String>, Query, description = "one customer's"), ("subscription_id" = Option<String>, Query, description = "one subscription's")),
    responses((status = 200, description = "List transactions", body = doc::List<doc::Transaction>), (status = 404, description = "resource_missing (param `customer_id` or `subscription_id`)", body = doc::ErrorBody))
)]
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

#[utoipa::path(
    post,
    path = "/v1/refunds",
    operation_id = "create_refund",
    tag = "transactions",
    summary = "Refund a payment",
    request_body(content = doc::RefundCreate, content_type = "application/json"),
    responses((status = 200, description = "Refund a payment", body = doc::Transaction), (status = 400, description = "refund_exceeds_remaining, transaction_not_refundable", body = doc::ErrorBody), (status = 404, description = "resource_missing (param `transaction_id`)", body = doc::ErrorBody))
)]
pub async fn create_refund(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let input = refund_input(&body)?;
    let refund = state.engine.billing().create_refund(&scope, &input).await?;
    Ok(Json(wire::transaction(&refund)))
}

#[utoipa::path(
    post,
    path = "/v1/disputes",
    operation_id = "open_dispute",
    tag = "transactions",
    summary = "Open a dispute (test mode)",
    request_body(content = doc::DisputeCreate, content_type = "application/json"),
    responses((status = 200, description = "Open a dispute (test mode)", body = doc::Dispute), (status = 400, description = "test_mode_only", body = doc::ErrorBody), (status = 404, description = "resource_missing (param `transaction_id`)", body = doc::ErrorBody), (status = 409, description = "dispute_exists", body = doc::ErrorBody))
)]
pub async fn open_dispute(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let input = refund_input(&body)?;
    let dispute = state.engine.billing().open_dispute(&scope, &input).await?;
    Ok(Json(wire::dispute(&dispute)))
}

#[utoipa::path(
    get,
    path = "/v1/subscriptions/{id}",
    operation_id = "get_subscription",
    tag = "subscriptions",
    summary = "Get a subscription",
    params(doc::IdParam),
    responses((status = 200, description = "Get a subscription", body = doc::Subscription))
)]
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
    let subscription = state.engine.billing().get_subscription(scope, id)?;
    subscription_json(state, scope, &subscription)
}

/// A subscription as every answer shows it, in a list too: its customer and last
/// transaction embedded (the contract's `customer` and `last_transaction`).
pub fn subscription_json(
    state: &AppState,
    scope: &Scope,
    subscription: &tally_domain::billing::Subscription,
) -> ApiResult<Value> {
    let billing = state.engine.billing();
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
        wire::subscription(subscription, customer.as_ref(), last.as_ref()),
        &totals,
    ))
}

/// `GET /v1/tax-rates`: the store's rates by country (not paginated: one per
/// country at most).
#[utoipa::path(
    get,
    path = "/v1/tax-rates",
    operation_id = "list_tax_rates",
    tag = "transactions",
    summary = "List the store's tax rates by country",
    responses((status = 200, description = "List the store's tax rates by country", body = doc::List<doc::TaxRate>))
)]
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
#[utoipa::path(
    post,
    path = "/v1/tax-rates",
    operation_id = "set_tax_rate",
    tag = "transactions",
    summary = "Set the tax rate of a country",
    request_body(content = doc::TaxRateSet, content_type = "application/json"),
    responses((status = 200, description = "Set the tax rate of a country", body = doc::TaxRate))
)]
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
