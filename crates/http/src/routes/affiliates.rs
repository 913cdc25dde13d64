//! Affiliates and their invitations (docs/api.md, "Affiliates"): page-based lists,
//! invitations and their acceptance, status changes, clicks.

use axum::extract::State;
use axum::{Extension, Json};
use serde_json::{json, Value};
use tally_domain::affiliate::{Affiliate, AffiliateInvite};
use tally_domain::time::format_iso8601_ms;
use tally_domain::FieldError;
use tally_engine::pagination::PageBased;
use tally_engine::Scope;

use crate::error::ApiResult;
use crate::extract::{Fields, JsonObject, PathId, QueryParams};
use crate::openapi as doc;
use crate::AppState;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

/// Page sizes a page-based list takes (docs/api.md, "Lists").
pub const MAX_PAGE_SIZE: usize = 100;
pub const DEFAULT_PAGE_SIZE: usize = 10;
/// Highest `page`: a page past a list's end is empty, but a number beyond this is a
/// client bug (no store has a million pages of affiliates) and is refused (400).
pub const MAX_PAGE_NUMBER: usize = 1_000_000;

/// The routes of this resource and their documentation (merged into the API by
/// `crate::api_router`).
pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(list_affiliates))
        .routes(routes!(record_click))
        .routes(routes!(list_invites, create_invite))
        .routes(routes!(accept_invite))
        .routes(routes!(get_affiliate, update_affiliate))
}

/// `page` (1-based, default 1, at most `MAX_PAGE_NUMBER`) and `page_size` (1..=100,
/// default 10).
fn page_params(query: &QueryParams) -> Result<(usize, usize), FieldError> {
    let read = |name: &str, default: usize, max: usize| match query.get(name) {
        None => Ok(default),
        Some(text) => text
            .parse::<usize>()
            .ok()
            .filter(|n| (1..=max).contains(n))
            .ok_or_else(|| {
                FieldError::invalid(name, format!("`{name}` must be an integer from 1 to {max}"))
            }),
    };
    Ok((
        read("page", 1, MAX_PAGE_NUMBER)?,
        read("page_size", DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)?,
    ))
}

fn page_body<T>(page: &PageBased<T>, item: impl Fn(&T) -> Value) -> Value {
    let pages = page.total_pages();
    json!({
        "items": page.items.iter().map(item).collect::<Vec<_>>(),
        "pagination": {
            "total_records": page.total_records,
            "total_pages": pages,
            "current_page": page.page,
            "next_page": (page.page < pages).then_some(page.page + 1),
            "prev_page": (page.page > 1).then(|| (page.page - 1).min(pages.max(1))),
        }
    })
}

fn invite(i: &AffiliateInvite) -> Value {
    json!({
        "id": i.id,
        "object": "affiliate-invite",
        "mode": i.mode.as_str(),
        "email": i.email,
        "name": i.name,
        "status": i.status.as_str(),
        "affiliate_id": i.affiliate_id,
        "created_at": i.created_at_ms,
    })
}

/// The affiliate's referral link: the store's `referral_base_url` with `ref=<code>`
/// added, or, while the store has set none, the query alone (`?ref=<code>`), to be
/// put after any page of the store's site (docs/api.md, "Affiliates"). Always a
/// string, so a client never has to tell "no link" from "no base URL yet".
/// The base URL was checked to be an http(s) URL when set; `url` puts the parameter
/// before any fragment and after any query of its own.
fn referral_link(base_url: Option<&str>, code: &str) -> String {
    match base_url.and_then(|base| url::Url::parse(base).ok()) {
        Some(mut link) => {
            link.query_pairs_mut().append_pair("ref", code);
            link.into()
        }
        None => format!("?ref={code}"),
    }
}

fn affiliate(a: &Affiliate, base_url: Option<&str>) -> Value {
    let link = referral_link(base_url, &a.referral_code);
    json!({
        "id": a.id,
        "object": "affiliate",
        "mode": a.mode.as_str(),
        "email": a.email,
        "name": a.name,
        "status": a.status.as_str(),
        "referral_code": a.referral_code,
        "referral_link": link,
        "clicks": a.clicks,
        "conversions": a.conversions,
        "earnings": a.earnings,
        "currency": a.currency,
        "created_at": format_iso8601_ms(a.created_at_ms),
    })
}

fn affiliate_body(state: &AppState, scope: &Scope, a: &Affiliate) -> ApiResult<Value> {
    let settings = state.engine.billing().store_settings(scope)?;
    Ok(affiliate(a, settings.referral_base_url.as_deref()))
}

#[utoipa::path(
    post,
    path = "/v1/affiliates/invites",
    operation_id = "create_invite",
    tag = "affiliates",
    summary = "Invite an affiliate",
    request_body(content = doc::InviteCreate, content_type = "application/json"),
    responses((status = 200, description = "Invite an affiliate", body = doc::AffiliateInvite), (status = 409, description = "affiliate_invite_exists", body = doc::ErrorBody))
)]
pub async fn create_invite(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let fields = Fields::new(&body);
    let email = fields.string("email")?;
    let name = fields.string("name")?;
    let created = state
        .engine
        .billing()
        .create_invite(&scope, email.as_deref(), name.as_deref())
        .await?;
    Ok(Json(invite(&created)))
}

#[utoipa::path(
    get,
    path = "/v1/affiliates/invites",
    operation_id = "list_invites",
    tag = "affiliates",
    summary = "List affiliate invitations",
    params(doc::PageParams),
    responses((status = 200, description = "List affiliate invitations", body = doc::Paged<doc::AffiliateInvite>))
)]
pub async fn list_invites(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    query: QueryParams,
) -> ApiResult<Json<Value>> {
    let (page, size) = page_params(&query)?;
    let listed = state.engine.billing().list_invites(&scope, page, size)?;
    Ok(Json(page_body(&listed, invite)))
}

#[utoipa::path(
    post,
    path = "/v1/affiliates/invites/{id}/accept",
    operation_id = "accept_invite",
    tag = "affiliates",
    summary = "Accept an invitation (the affiliate joins)",
    params(doc::IdParam),
    request_body(content = doc::NoBody, content_type = "application/json"),
    responses((status = 200, description = "Accept an invitation (the affiliate joins)", body = doc::Affiliate), (status = 409, description = "invalid_state_transition", body = doc::ErrorBody))
)]
pub async fn accept_invite(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
    JsonObject(_): JsonObject,
) -> ApiResult<Json<Value>> {
    let joined = state.engine.billing().accept_invite(&scope, &id).await?;
    Ok(Json(affiliate_body(&state, &scope, &joined)?))
}

#[utoipa::path(
    get,
    path = "/v1/affiliates",
    operation_id = "list_affiliates",
    tag = "affiliates",
    summary = "List affiliates",
    params(doc::PageParams),
    responses((status = 200, description = "List affiliates", body = doc::Paged<doc::Affiliate>))
)]
pub async fn list_affiliates(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    query: QueryParams,
) -> ApiResult<Json<Value>> {
    let (page, size) = page_params(&query)?;
    let billing = state.engine.billing();
    let listed = billing.list_affiliates(&scope, page, size)?;
    let base = billing.store_settings(&scope)?.referral_base_url;
    Ok(Json(page_body(&listed, |a| affiliate(a, base.as_deref()))))
}

#[utoipa::path(
    get,
    path = "/v1/affiliates/{id}",
    operation_id = "get_affiliate",
    tag = "affiliates",
    summary = "Get an affiliate",
    params(doc::IdParam),
    responses((status = 200, description = "Get an affiliate", body = doc::Affiliate))
)]
pub async fn get_affiliate(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
) -> ApiResult<Json<Value>> {
    let found = state.engine.billing().get_affiliate(&scope, &id)?;
    Ok(Json(affiliate_body(&state, &scope, &found)?))
}

/// `POST /v1/affiliates/{id} {status?, name?}`: suspend, reactivate, rename.
#[utoipa::path(
    post,
    path = "/v1/affiliates/{id}",
    operation_id = "update_affiliate",
    tag = "affiliates",
    summary = "Suspend, reactivate or rename an affiliate",
    params(doc::IdParam),
    request_body(content = doc::AffiliateUpdate, content_type = "application/json"),
    responses((status = 200, description = "Suspend, reactivate or rename an affiliate", body = doc::Affiliate))
)]
pub async fn update_affiliate(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let fields = Fields::new(&body);
    let status = fields.string("status")?;
    let name = fields.string("name")?;
    let updated = state
        .engine
        .billing()
        .update_affiliate(&scope, &id, status.as_deref(), name.as_deref())
        .await?;
    Ok(Json(affiliate_body(&state, &scope, &updated)?))
}

/// `POST /v1/affiliates/clicks {referral_code}`: one click on a referral link.
#[utoipa::path(
    post,
    path = "/v1/affiliates/clicks",
    operation_id = "record_click",
    tag = "affiliates",
    summary = "Count a referral click",
    request_body(content = doc::Click, content_type = "application/json"),
    responses((status = 200, description = "Count a referral click", body = doc::Affiliate), (status = 404, description = "resource_missing (param `referral_code`)", body = doc::ErrorBody))
)]
pub async fn record_click(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let code = Fields::new(&body).string("referral_code")?;
    let clicked = state
        .engine
        .billing()
        .record_click(&scope, code.as_deref())
        .await?;
    Ok(Json(affiliate_body(&state, &scope, &clicked)?))
}

#[cfg(test)]
mod tests {
    use super::referral_link;

    #[test]
    fn a_referral_link_adds_the_code_to_the_base_url_or_stands_alone() {
        assert_eq!(referral_link(None, "Ab12Cd34"), "?ref=Ab12Cd34");
        assert_eq!(
            referral_link(Some("https://shop.example/join"), "Ab12Cd34"),
            "https://shop.example/join?ref=Ab12Cd34"
        );
        assert_eq!(
            referral_link(Some("https://shop.example/join?lang=en"), "Ab12Cd34"),
            "https://shop.example/join?lang=en&ref=Ab12Cd34"
        );
        assert_eq!(
            referral_link(Some("https://shop.example/join#plans"), "Ab12Cd34"),
            "https://shop.example/join?ref=Ab12Cd34#plans"
        );
    }
}
