//! `/v1/customer-credits`: accounts, credit/debit, reversal, transactions, entries,
//! grants, reservations.

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use rust_decimal::Decimal;
use serde_json::{json, Map, Value};
use tally_domain::customer::Patch;
use tally_domain::grant::{Grant, GrantStatus};
use tally_domain::ledger::{parse_amount, Account, AutoRecharge, RechargePrice, TransactionKind};
use tally_domain::product::parse_recharge_price;
use tally_domain::reservation::Reservation;
use tally_domain::time::format_iso8601_ms;
use tally_domain::usage::canonical_decimal;
use tally_engine::codec::StoredEntry;
use tally_engine::ledger::{
    AccountInput, GrantInput, MovementInput, ReservationInput, TransactionView,
};
use tally_engine::Scope;

use crate::error::{ApiError, ApiResult};
use crate::extract::{page_request, parse_instant, Fields, JsonObject, PathId, QueryParams};
use crate::openapi as doc;
use crate::{wire, AppState};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

/// The routes of this resource and their documentation (merged into the API by
/// `crate::api_router`).
pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(list_accounts, create_account))
        .routes(routes!(get_account, update_account))
        .routes(routes!(freeze))
        .routes(routes!(unfreeze))
        .routes(routes!(close))
        .routes(routes!(credit))
        .routes(routes!(debit))
        .routes(routes!(entries))
        .routes(routes!(get_transaction))
        .routes(routes!(reverse))
        .routes(routes!(list_grants, create_grant))
        .routes(routes!(get_grant))
        .routes(routes!(void_grant))
        .routes(routes!(reserve))
        .routes(routes!(get_reservation))
        .routes(routes!(commit_reservation))
        .routes(routes!(release_reservation))
}

/// An account as the API shows it: with `available_balance`, the balance less
/// what its live reservations hold (`held`).
fn account_view(account: &Account, balance: Decimal, held: Decimal) -> Value {
    let mut value = account_json(account, balance);
    value["available_balance"] = json!(canonical_decimal(tally_domain::reservation::available(
        balance, held
    )));
    value
}

/// `account_view` now.
fn current_account(
    state: &AppState,
    scope: &Scope,
    account: &Account,
    balance: Decimal,
) -> ApiResult<Value> {
    let held = state.engine.ledger().held(scope, &account.id)?;
    Ok(account_view(account, balance, held))
}

pub fn reservation_json(r: &Reservation) -> Value {
    json!({
        "id": r.id,
        "object": "credit_reservation",
        "mode": r.mode.as_str(),
        "account_id": r.account_id,
        "amount": canonical_decimal(r.amount),
        "status": r.status.as_str(),
        "idempotency_key": r.idempotency_key,
        "expires_at": format_iso8601_ms(r.expires_at_ms),
        "transaction_id": r.transaction_id,
        "committed_amount": r.committed_amount.map(canonical_decimal),
        "created_at": format_iso8601_ms(r.created_at_ms),
        "updated_at": format_iso8601_ms(r.updated_at_ms),
    })
}

pub fn account_json(account: &Account, balance: Decimal) -> Value {
    json!({
        "id": account.id,
        "object": "customer_credits_account",
        "mode": account.mode.as_str(),
        "store_id": account.store_id,
        "customer_id": account.customer_id,
        "name": account.name,
        "unit_label": account.unit_label,
        "status": account.status.as_str(),
        "balance": canonical_decimal(balance),
        "low_balance_threshold": account.low_balance_threshold.map(canonical_decimal),
        "auto_recharge": account.auto_recharge.as_ref().map(|r| json!({
            "threshold": canonical_decimal(r.threshold),
            "amount": canonical_decimal(r.amount),
            "price": r.price.as_ref().map(|p| p.amount),
            "currency": r.price.as_ref().map(|p| p.currency.as_str()),
        })),
        "created_at": format_iso8601_ms(account.created_at_ms),
        "updated_at": format_iso8601_ms(account.updated_at_ms),
    })
}

/// A transaction as the API answers it, serialized straight from the view: a
/// debit's answer is the hottest body the API writes, and building a `Value`
/// first (a map insert and a `String` per field) cost ~6% of the request workers'
/// time under one hot account (docs/benchmarks.md, "A debit's answer written
/// without a Value"). `transaction_json` is the same body as a `Value`.
#[derive(serde::Serialize)]
pub struct TransactionBody<'a> {
    id: &'a str,
    object: &'static str,
    mode: &'static str,
    #[serde(rename = "type")]
    kind: &'static str,
    account_id: &'a str,
    amount: String,
    description: &'a Option<String>,
    metadata: &'a std::collections::BTreeMap<String, String>,
    idempotency_key: &'a Option<String>,
    reverses: Option<&'a str>,
    reversed_by: &'a Option<String>,
    entries: Vec<EntryBody<'a>>,
    created_at: String,
}

/// One entry of a `TransactionBody`.
#[derive(serde::Serialize)]
struct EntryBody<'a> {
    id: &'a str,
    object: &'static str,
    transaction_id: &'a str,
    account_id: &'a str,
    amount: String,
    grant_id: Option<&'a str>,
    created_at: String,
}

impl<'a> TransactionBody<'a> {
    pub fn new(view: &'a TransactionView) -> TransactionBody<'a> {
        let tx = &view.transaction;
        let created_at = format_iso8601_ms(tx.created_at_ms);
        TransactionBody {
            id: tx.id.as_str(),
            object: "customer_credits_transaction",
            mode: tx.mode.as_str(),
            kind: tx.kind.as_str(),
            account_id: tx.account_id.as_str(),
            amount: canonical_decimal(tx.amount),
            description: &tx.description,
            metadata: &tx.metadata,
            idempotency_key: &tx.idempotency_key,
            reverses: tx.reverses.as_ref().map(|r| r.as_str()),
            reversed_by: &view.reversed_by,
            entries: tx
                .entries
                .iter()
                .map(|e| EntryBody {
                    id: &e.id,
                    object: "customer_credits_entry",
                    transaction_id: tx.id.as_str(),
                    account_id: e.account_id.as_str(),
                    amount: canonical_decimal(e.amount),
                    grant_id: e.grant_id.as_ref().map(|g| g.as_str()),
                    created_at: created_at.clone(),
                })
                .collect(),
            created_at,
        }
    }
}

/// A transaction's answer: `TransactionBody` written straight into the body.
fn transaction_response(view: &TransactionView) -> Response {
    Json(&TransactionBody::new(view)).into_response()
}

pub fn transaction_json(view: &TransactionView) -> Value {
    // Plain fields and string maps: serializing them to a `Value` cannot fail.
    serde_json::to_value(TransactionBody::new(view)).unwrap_or(Value::Null)
}

fn entry_json(entry: &StoredEntry) -> Value {
    json!({
        "id": entry.id,
        "object": "customer_credits_entry",
        "transaction_id": entry.transaction_id,
        "account_id": entry.account_id,
        "amount": canonical_decimal(entry.amount),
        "balance_after": canonical_decimal(entry.balance_after),
        "grant_id": entry.grant_id,
        "created_at": format_iso8601_ms(entry.created_at_ms),
    })
}

pub fn grant_json(g: &Grant) -> Value {
    json!({
        "id": g.id,
        "object": "credit_grant",
        "mode": g.mode.as_str(),
        "account_id": g.account_id,
        "amount": canonical_decimal(g.amount),
        "remaining": canonical_decimal(g.remaining),
        "priority": g.terms.priority,
        "expires_at": g.terms.expires_at_ms.map(format_iso8601_ms),
        "status": g.status.as_str(),
        "transaction_id": g.transaction_id,
        "description": g.description,
        "metadata": g.metadata,
        "created_at": format_iso8601_ms(g.created_at_ms),
        "updated_at": format_iso8601_ms(g.updated_at_ms),
    })
}

/// `low_balance_threshold` and `auto_recharge` of an account create or update:
/// absent keeps, `null` clears (docs/api.md, "Thresholds and auto-recharge").
fn threshold_fields(
    fields: &Fields<'_>,
) -> Result<(Patch<Decimal>, Patch<AutoRecharge>), ApiError> {
    let amount =
        |param: &str, value: Option<&Value>, allow_zero: bool| -> Result<Decimal, ApiError> {
            match value {
                Some(Value::String(text)) => Ok(parse_amount(param, text, allow_zero)?),
                Some(_) => Err(ApiError::invalid_param(
                    param,
                    format!("`{param}` must be a decimal string, e.g. \"12.5\""),
                )),
                None => Err(tally_domain::FieldError::missing(param).into()),
            }
        };
    let threshold = match fields.map.get("low_balance_threshold") {
        None => Patch::Keep,
        Some(Value::Null) => Patch::Clear,
        value => Patch::Set(amount("low_balance_threshold", value, true)?),
    };
    let recharge = match fields.map.get("auto_recharge") {
        None => Patch::Keep,
        Some(Value::Null) => Patch::Clear,
        Some(Value::Object(object)) => Patch::Set(AutoRecharge {
            threshold: amount("auto_recharge.threshold", object.get("threshold"), true)?,
            amount: amount("auto_recharge.amount", object.get("amount"), false)?,
            price: recharge_price(object)?,
        }),
        Some(_) => {
            return Err(ApiError::invalid_param(
                "auto_recharge",
                "`auto_recharge` must be an object {\"threshold\", \"amount\", \"price\"?, \"currency\"?} or null",
            ))
        }
    };
    Ok((threshold, recharge))
}

/// `auto_recharge.price` (integer minor units) and `auto_recharge.currency`: what a
/// recharge costs; absent or null, it is a free grant.
fn recharge_price(
    object: &serde_json::Map<String, Value>,
) -> Result<Option<RechargePrice>, ApiError> {
    let currency = match object.get("currency") {
        None | Some(Value::Null) => None,
        Some(Value::String(text)) => Some(text.as_str()),
        Some(_) => {
            return Err(ApiError::invalid_param(
                "auto_recharge.currency",
                "`auto_recharge.currency` must be a three-letter ISO 4217 code, e.g. USD",
            ))
        }
    };
    match object.get("price") {
        None | Some(Value::Null) if currency.is_some() => {
            Err(tally_domain::FieldError::missing("auto_recharge.price").into())
        }
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(number)) => Ok(Some(parse_recharge_price(
            &crate::extract::number_text(number),
            currency,
        )?)),
        Some(_) => Err(ApiError::invalid_param(
            "auto_recharge.price",
            "`auto_recharge.price` must be an integer of minor units, e.g. 1000",
        )),
    }
}

/// Amounts must be JSON strings: a JSON number would have passed through a float in
/// many clients.
fn decimal_string(fields: &Fields<'_>, name: &str) -> Result<Option<String>, ApiError> {
    match fields.map.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(ApiError::invalid_param(
            name,
            format!("`{name}` must be a decimal string, e.g. \"12.5\""),
        )),
    }
}

#[utoipa::path(
    post,
    path = "/v1/customer-credits/accounts",
    operation_id = "create_account",
    tag = "customer-credits",
    summary = "Create a credit account",
    request_body(content = doc::AccountCreate, content_type = "application/json", example = json!({"customer_id": "cus_4fJ2b8XkQ1", "name": "default", "unit_label": "credits", "initial_balance": "100"})),
    responses((status = 200, description = "Create a credit account", body = doc::CreditAccount), (status = 404, description = "resource_missing (param `customer_id`)", body = doc::ErrorBody), (status = 409, description = "account_name_taken, amount_out_of_range", body = doc::ErrorBody))
)]
pub async fn create_account(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let fields = Fields::new(&body);
    let (low_balance_threshold, auto_recharge) = threshold_fields(&fields)?;
    let input = AccountInput {
        customer_id: fields.string("customer_id")?,
        name: fields.string("name")?,
        unit_label: fields.string("unit_label")?,
        initial_balance: decimal_string(&fields, "initial_balance")?,
        low_balance_threshold: low_balance_threshold.into_option(),
        auto_recharge: auto_recharge.into_option(),
    };
    let (account, balance) = state.engine.ledger().create_account(&scope, &input).await?;
    Ok(Json(account_view(&account, balance, Decimal::ZERO)))
}

#[utoipa::path(
    get,
    path = "/v1/customer-credits/accounts",
    operation_id = "list_accounts",
    tag = "customer-credits",
    summary = "List credit accounts",
    params(doc::CursorParams, ("customer_id" = Option<String>, Query, description = "one customer's accounts")),
    responses((status = 200, description = "List credit accounts", body = doc::List<doc::CreditAccount>), (status = 404, description = "resource_missing: the customer named by `customer_id` or `external_customer_id`", body = doc::ErrorBody))
)]
pub async fn list_accounts(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    query: QueryParams,
) -> ApiResult<Json<Value>> {
    let page = page_request(&query)?;
    crate::routes::known_customer(&state, &scope, query.get("customer_id"), "customer_id")?;
    let page = state
        .engine
        .ledger()
        .list_accounts(&scope, query.get("customer_id"), &page)?;
    let mut held = std::collections::HashMap::new();
    for (account, _) in &page.data {
        held.insert(
            account.id.clone(),
            state.engine.ledger().held(&scope, &account.id)?,
        );
    }
    Ok(Json(wire::list(&page, |(a, b)| {
        account_view(a, *b, held.get(&a.id).copied().unwrap_or_default())
    })))
}

#[utoipa::path(
    get,
    path = "/v1/customer-credits/accounts/{id}",
    operation_id = "get_account",
    tag = "customer-credits",
    summary = "Get a credit account (its balance, or its balance at an instant)",
    params(doc::IdParam, ("at" = Option<String>, Query, description = "ISO 8601: the balance right after the last entry at or before it")),
    responses((status = 200, description = "Get a credit account (its balance, or its balance at an instant)", body = doc::CreditAccount))
)]
pub async fn get_account(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
    query: QueryParams,
) -> ApiResult<Json<Value>> {
    let account = state.engine.ledger().get_account(&scope, &id)?;
    match query.get("at") {
        // Holds are not kept as history: at an instant, all of the balance.
        Some(at) => {
            let balance =
                state
                    .engine
                    .ledger()
                    .balance_at(&scope, &id, parse_instant("at", at)?)?;
            Ok(Json(account_view(&account, balance, Decimal::ZERO)))
        }
        None => {
            let balance = state.engine.ledger().balance(&scope, &id)?;
            Ok(Json(current_account(&state, &scope, &account, balance)?))
        }
    }
}

#[utoipa::path(
    post,
    path = "/v1/customer-credits/accounts/{id}/freeze",
    operation_id = "credits_freeze",
    tag = "customer-credits",
    summary = "Freeze an account",
    params(doc::IdParam),
    request_body(content = doc::NoBody, content_type = "application/json"),
    responses((status = 200, description = "Freeze an account", body = doc::CreditAccount), (status = 409, description = "account_closed", body = doc::ErrorBody))
)]
pub async fn freeze(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
    JsonObject(_): JsonObject,
) -> ApiResult<Json<Value>> {
    let (account, balance) = state
        .engine
        .ledger()
        .set_account_frozen(&scope, &id, true)
        .await?;
    Ok(Json(current_account(&state, &scope, &account, balance)?))
}

#[utoipa::path(
    post,
    path = "/v1/customer-credits/accounts/{id}/unfreeze",
    operation_id = "credits_unfreeze",
    tag = "customer-credits",
    summary = "Unfreeze an account",
    params(doc::IdParam),
    request_body(content = doc::NoBody, content_type = "application/json"),
    responses((status = 200, description = "Unfreeze an account", body = doc::CreditAccount), (status = 409, description = "account_closed", body = doc::ErrorBody))
)]
pub async fn unfreeze(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
    JsonObject(_): JsonObject,
) -> ApiResult<Json<Value>> {
    let (account, balance) = state
        .engine
        .ledger()
        .set_account_frozen(&scope, &id, false)
        .await?;
    Ok(Json(current_account(&state, &scope, &account, balance)?))
}

#[utoipa::path(
    post,
    path = "/v1/customer-credits/accounts/{id}/close",
    operation_id = "credits_close",
    tag = "customer-credits",
    summary = "Close an account (final; the balance is forfeited)",
    params(doc::IdParam),
    request_body(content = doc::NoBody, content_type = "application/json"),
    responses((status = 200, description = "Close an account (final; the balance is forfeited)", body = doc::CreditAccount), (status = 409, description = "account_balance_changed", body = doc::ErrorBody))
)]
pub async fn close(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
    JsonObject(_): JsonObject,
) -> ApiResult<Json<Value>> {
    let (account, balance) = state.engine.ledger().close_account(&scope, &id).await?;
    Ok(Json(current_account(&state, &scope, &account, balance)?))
}

fn movement(body: &Map<String, Value>) -> Result<MovementInput, ApiError> {
    let fields = Fields::new(body);
    Ok(MovementInput {
        amount: decimal_string(&fields, "amount")?,
        idempotency_key: fields.string("idempotency_key")?,
        description: fields.string("description")?,
        metadata: match fields.patch_metadata("metadata")? {
            Patch::Set(m) => m,
            _ => Default::default(),
        },
    })
}

#[utoipa::path(
    post,
    path = "/v1/customer-credits/accounts/{id}/credit",
    operation_id = "credits_credit",
    tag = "customer-credits",
    summary = "Credit an account",
    params(doc::IdParam),
    request_body(content = doc::Movement, content_type = "application/json", example = json!({"amount": "2.5", "idempotency_key": "order-1001", "description": "API usage", "metadata": {"order": "1001"}})),
    responses((status = 200, description = "Credit an account", body = doc::CreditTransaction), (status = 409, description = "account_frozen, account_closed, amount_out_of_range, idempotency_key_reused", body = doc::ErrorBody))
)]
pub async fn credit(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
    JsonObject(body): JsonObject,
) -> ApiResult<Response> {
    let view = state
        .engine
        .ledger()
        .move_credits(&scope, &id, TransactionKind::Credit, &movement(&body)?)
        .await?;
    Ok(transaction_response(&view))
}

#[utoipa::path(
    post,
    path = "/v1/customer-credits/accounts/{id}/debit",
    operation_id = "credits_debit",
    tag = "customer-credits",
    summary = "Debit an account",
    params(doc::IdParam),
    request_body(content = doc::Movement, content_type = "application/json", example = json!({"amount": "2.5", "idempotency_key": "order-1001", "description": "API usage", "metadata": {"order": "1001"}})),
    responses((status = 200, description = "Debit an account", body = doc::CreditTransaction), (status = 409, description = "insufficient_balance, account_frozen, account_closed, amount_out_of_range, idempotency_key_reused", body = doc::ErrorBody))
)]
pub async fn debit(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
    JsonObject(body): JsonObject,
) -> ApiResult<Response> {
    let view = state
        .engine
        .ledger()
        .move_credits(&scope, &id, TransactionKind::Debit, &movement(&body)?)
        .await?;
    Ok(transaction_response(&view))
}

#[utoipa::path(
    get,
    path = "/v1/customer-credits/accounts/{id}/entries",
    operation_id = "credits_entries",
    tag = "customer-credits",
    summary = "List an account's entries, newest first",
    params(doc::IdParam, doc::CursorParams),
    responses((status = 200, description = "List an account's entries, newest first", body = doc::List<doc::CreditEntry>))
)]
pub async fn entries(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
    query: QueryParams,
) -> ApiResult<Json<Value>> {
    let page = page_request(&query)?;
    let page = state.engine.ledger().list_entries(&scope, &id, &page)?;
    Ok(Json(wire::list(&page, entry_json)))
}

#[utoipa::path(
    get,
    path = "/v1/customer-credits/transactions/{id}",
    operation_id = "credits_get_transaction",
    tag = "customer-credits",
    summary = "Get a credits transaction with its entries",
    params(doc::IdParam),
    responses((status = 200, description = "Get a credits transaction with its entries", body = doc::CreditTransaction))
)]
pub async fn get_transaction(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
) -> ApiResult<Response> {
    Ok(transaction_response(
        &state.engine.ledger().get_transaction(&scope, &id)?,
    ))
}

#[utoipa::path(
    post,
    path = "/v1/customer-credits/transactions/{id}/reverse",
    operation_id = "credits_reverse",
    tag = "customer-credits",
    summary = "Reverse a transaction",
    params(doc::IdParam),
    request_body(content = doc::NoBody, content_type = "application/json"),
    responses((status = 200, description = "Reverse a transaction", body = doc::CreditTransaction), (status = 409, description = "transaction_already_reversed, transaction_not_reversible, insufficient_balance, account_frozen, account_closed", body = doc::ErrorBody))
)]
pub async fn reverse(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
    JsonObject(_): JsonObject,
) -> ApiResult<Response> {
    Ok(transaction_response(
        &state
            .engine
            .ledger()
            .reverse_transaction(&scope, &id)
            .await?,
    ))
}

#[utoipa::path(
    post,
    path = "/v1/customer-credits/accounts/{id}/reservations",
    operation_id = "credits_reserve",
    tag = "customer-credits",
    summary = "Hold credits until a commit, a release or the expiry",
    params(doc::IdParam),
    request_body(content = doc::ReservationCreate, content_type = "application/json", example = json!({"amount": "25", "idempotency_key": "job-77", "expires_in_seconds": 600})),
    responses((status = 200, description = "The reservation, held (or the one this idempotency_key made)", body = doc::CreditReservation), (status = 409, description = "insufficient_balance, account_frozen, account_closed, idempotency_key_reused, too_many_reservations", body = doc::ErrorBody))
)]
pub async fn reserve(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let fields = Fields::new(&body);
    let input = ReservationInput {
        amount: decimal_string(&fields, "amount")?,
        idempotency_key: fields.string("idempotency_key")?,
        expires_in_seconds: fields.small_uint("expires_in_seconds")?.map(i64::from),
    };
    let reservation = state.engine.ledger().reserve(&scope, &id, &input).await?;
    Ok(Json(reservation_json(&reservation)))
}

#[utoipa::path(
    get,
    path = "/v1/customer-credits/reservations/{id}",
    operation_id = "credits_get_reservation",
    tag = "customer-credits",
    summary = "Get a credit reservation",
    params(doc::IdParam),
    responses((status = 200, description = "Get a credit reservation", body = doc::CreditReservation))
)]
pub async fn get_reservation(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
) -> ApiResult<Json<Value>> {
    Ok(Json(reservation_json(
        &state.engine.ledger().get_reservation(&scope, &id)?,
    )))
}

#[utoipa::path(
    post,
    path = "/v1/customer-credits/reservations/{id}/commit",
    operation_id = "credits_commit_reservation",
    tag = "customer-credits",
    summary = "Debit what a reservation holds (or part of it) and release the rest",
    params(doc::IdParam),
    request_body(content = doc::ReservationCommit, content_type = "application/json", example = json!({"amount": "20"})),
    responses((status = 200, description = "The reservation, committed, with the debit's transaction_id (committing again returns the same)", body = doc::CreditReservation), (status = 409, description = "reservation_expired, reservation_released, account_frozen, account_closed", body = doc::ErrorBody))
)]
pub async fn commit_reservation(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let amount = decimal_string(&Fields::new(&body), "amount")?;
    let reservation = state
        .engine
        .ledger()
        .commit_reservation(&scope, &id, amount.as_deref())
        .await?;
    Ok(Json(reservation_json(&reservation)))
}

#[utoipa::path(
    post,
    path = "/v1/customer-credits/reservations/{id}/release",
    operation_id = "credits_release_reservation",
    tag = "customer-credits",
    summary = "Release a reservation without a debit",
    params(doc::IdParam),
    request_body(content = doc::NoBody, content_type = "application/json"),
    responses((status = 200, description = "The reservation, released (an expired or released one as it is)", body = doc::CreditReservation), (status = 409, description = "reservation_committed", body = doc::ErrorBody))
)]
pub async fn release_reservation(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
    JsonObject(_): JsonObject,
) -> ApiResult<Json<Value>> {
    let reservation = state
        .engine
        .ledger()
        .release_reservation(&scope, &id)
        .await?;
    Ok(Json(reservation_json(&reservation)))
}

#[utoipa::path(
    post,
    path = "/v1/customer-credits/accounts/{id}/grants",
    operation_id = "credits_create_grant",
    tag = "customer-credits",
    summary = "Credit an account through a grant with a priority and an expiry",
    params(doc::IdParam),
    request_body(content = doc::GrantCreate, content_type = "application/json", example = json!({"amount": "100", "idempotency_key": "promo-2026-11", "expires_at": "2026-12-31T23:59:59Z", "priority": 10, "description": "November promotion"})),
    responses((status = 200, description = "The grant (or the one this idempotency_key made)", body = doc::CreditGrant), (status = 409, description = "account_frozen, account_closed, amount_out_of_range, idempotency_key_reused, too_many_grants", body = doc::ErrorBody))
)]
pub async fn create_grant(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let fields = Fields::new(&body);
    let priority = fields.small_uint("priority")?.map(i64::from);
    let expires_at_ms = match fields.string("expires_at")? {
        None => None,
        Some(text) => Some(parse_instant("expires_at", &text)?),
    };
    let input = GrantInput {
        movement: movement(&body)?,
        priority,
        expires_at_ms,
    };
    let grant = state
        .engine
        .ledger()
        .create_grant(&scope, &id, &input)
        .await?;
    Ok(Json(grant_json(&grant)))
}

#[utoipa::path(
    get,
    path = "/v1/customer-credits/accounts/{id}/grants",
    operation_id = "credits_list_grants",
    tag = "customer-credits",
    summary = "List an account's grants, newest first",
    params(doc::IdParam, doc::CursorParams, ("status" = Option<String>, Query, description = "active, consumed, expired or voided")),
    responses((status = 200, description = "List an account's grants, newest first", body = doc::List<doc::CreditGrant>))
)]
pub async fn list_grants(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
    query: QueryParams,
) -> ApiResult<Json<Value>> {
    let page = page_request(&query)?;
    let status = match query.get("status") {
        None => None,
        Some(text) => Some(GrantStatus::parse(text).ok_or_else(|| {
            ApiError::invalid_param(
                "status",
                "`status` must be one of active, consumed, expired, voided",
            )
        })?),
    };
    let page = state
        .engine
        .ledger()
        .list_grants(&scope, &id, status, &page)?;
    Ok(Json(wire::list(&page, grant_json)))
}

#[utoipa::path(
    get,
    path = "/v1/customer-credits/grants/{id}",
    operation_id = "credits_get_grant",
    tag = "customer-credits",
    summary = "Get a credit grant",
    params(doc::IdParam),
    responses((status = 200, description = "Get a credit grant", body = doc::CreditGrant))
)]
pub async fn get_grant(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
) -> ApiResult<Json<Value>> {
    Ok(Json(grant_json(
        &state.engine.ledger().get_grant(&scope, &id)?,
    )))
}

#[utoipa::path(
    post,
    path = "/v1/customer-credits/grants/{id}/void",
    operation_id = "credits_void_grant",
    tag = "customer-credits",
    summary = "Void a grant: what it has left moves to forfeit now",
    params(doc::IdParam),
    request_body(content = doc::NoBody, content_type = "application/json"),
    responses((status = 200, description = "The grant, voided", body = doc::CreditGrant), (status = 409, description = "grant_not_active, account_frozen, account_closed, resource_changed", body = doc::ErrorBody))
)]
pub async fn void_grant(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
    JsonObject(_): JsonObject,
) -> ApiResult<Json<Value>> {
    Ok(Json(grant_json(
        &state.engine.ledger().void_grant(&scope, &id).await?,
    )))
}

#[utoipa::path(
    post,
    path = "/v1/customer-credits/accounts/{id}",
    operation_id = "credits_update_account",
    tag = "customer-credits",
    summary = "Set or clear an account's low-balance threshold and auto-recharge",
    params(doc::IdParam),
    request_body(content = doc::AccountUpdate, content_type = "application/json", example = json!({"low_balance_threshold": "20", "auto_recharge": {"threshold": "10", "amount": "100"}})),
    responses((status = 200, description = "The account", body = doc::CreditAccount), (status = 409, description = "account_closed", body = doc::ErrorBody))
)]
pub async fn update_account(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let (threshold, recharge) = threshold_fields(&Fields::new(&body))?;
    let (account, balance) = state
        .engine
        .ledger()
        .update_thresholds(&scope, &id, threshold, recharge)
        .await?;
    Ok(Json(current_account(&state, &scope, &account, balance)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use tally_domain::ids::{AccountId, GrantId, StoreId, TransactionId};
    use tally_domain::ledger::{Entry, Transaction};
    use tally_domain::Mode;

    /// The body as the handlers built it before `TransactionBody`, field by field:
    /// the reference the typed body must equal byte for byte.
    fn reference_json(view: &TransactionView) -> Value {
        let tx = &view.transaction;
        json!({
            "id": tx.id.as_str(),
            "object": "customer_credits_transaction",
            "mode": tx.mode.as_str(),
            "type": tx.kind.as_str(),
            "account_id": tx.account_id.as_str(),
            "amount": canonical_decimal(tx.amount),
            "description": tx.description,
            "metadata": tx.metadata,
            "idempotency_key": tx.idempotency_key,
            "reverses": tx.reverses.as_ref().map(|r| r.as_str()),
            "reversed_by": view.reversed_by,
            "entries": tx.entries.iter().map(|e| json!({
                "id": e.id,
                "object": "customer_credits_entry",
                "transaction_id": tx.id.as_str(),
                "account_id": e.account_id.as_str(),
                "amount": canonical_decimal(e.amount),
                "grant_id": e.grant_id.as_ref().map(|g| g.as_str()),
                "created_at": format_iso8601_ms(tx.created_at_ms),
            })).collect::<Vec<_>>(),
            "created_at": format_iso8601_ms(tx.created_at_ms),
        })
    }

    fn text() -> impl Strategy<Value = String> {
        // Quotes, backslashes, control and non-ASCII characters: what escaping sees.
        "[a-z0-9_\"\\\\\u{1}\n é☃]{0,12}"
    }

    fn amount() -> impl Strategy<Value = Decimal> {
        (any::<i64>(), 0u32..=8).prop_map(|(mantissa, scale)| Decimal::new(mantissa, scale))
    }

    prop_compose! {
        fn views()(
            id in text(),
            account in text(),
            amount in amount(),
            kind in prop::sample::select(vec![TransactionKind::Credit, TransactionKind::Debit, TransactionKind::Reversal]),
            test_mode in any::<bool>(),
            description in prop::option::of(text()),
            metadata in prop::collection::btree_map(text(), text(), 0..4),
            idempotency_key in prop::option::of(text()),
            reverses in prop::option::of(text()),
            reversed_by in prop::option::of(text()),
            entries in prop::collection::vec((text(), text(), amount(), prop::option::of(text())), 0..4),
            created_at_ms in 0i64..4_102_444_800_000,
        ) -> TransactionView {
            TransactionView {
                transaction: Transaction {
                    id: TransactionId::new(id),
                    store_id: StoreId::new("sto_x"),
                    mode: if test_mode { Mode::Test } else { Mode::Prod },
                    kind,
                    account_id: AccountId::new(account),
                    amount,
                    entries: entries
                        .into_iter()
                        .map(|(id, account, amount, grant)| Entry {
                            id,
                            account_id: AccountId::new(account),
                            amount,
                            grant_id: grant.map(GrantId::new),
                        })
                        .collect(),
                    idempotency_key,
                    description,
                    metadata,
                    reverses: reverses.map(TransactionId::new),
                    created_at_ms,
                    grant_terms: None,
                },
                reversed_by,
            }
        }
    }

    proptest! {
        #[test]
        fn the_typed_body_is_the_reference_body(view in views()) {
            let reference = serde_json::to_vec(&reference_json(&view)).unwrap();
            prop_assert_eq!(
                String::from_utf8(serde_json::to_vec(&TransactionBody::new(&view)).unwrap()).unwrap(),
                String::from_utf8(reference.clone()).unwrap()
            );
            prop_assert_eq!(serde_json::to_vec(&transaction_json(&view)).unwrap(), reference);
        }
    }
}
