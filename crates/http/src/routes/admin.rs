//! The admin API (docs/api.md): `POST /admin/v1/stores` with
//! `Authorization: Bearer $TALLY_ADMIN_TOKEN`. Without the token configured it does
//! not exist (404).

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::Json;
use serde_json::{json, Value};

use crate::error::{ApiError, ApiResult};
use crate::extract::{Fields, JsonObject};
use crate::middleware::constant_time_eq;
use crate::openapi as doc;
use crate::AppState;

/// Checks `Authorization: Bearer <admin token>` (constant time); 404 when no token
/// is configured (the admin API does not exist then).
fn check_admin(state: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(token) = state.config.admin_token.as_deref() else {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "route_not_found",
            "no such route",
        ));
    };
    // Trimmed, as HTTP/1 parsers deliver a header (HTTP/2 keeps the spaces).
    let presented = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().strip_prefix("Bearer "))
        .map_or("", str::trim);
    if !constant_time_eq(presented.as_bytes(), token.as_bytes()) {
        return Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "admin_token_invalid",
            "send `Authorization: Bearer <TALLY_ADMIN_TOKEN>`",
        ));
    }
    Ok(())
}

#[utoipa::path(
    post,
    path = "/admin/v1/stores",
    operation_id = "create_store",
    tag = "admin",
    summary = "Create a store and its first two keys",
    request_body(content = doc::StoreCreate, content_type = "application/json"),
    responses((status = 200, description = "Create a store and its first two keys", body = doc::Store))
)]
pub async fn create_store(
    State(state): State<AppState>,
    headers: HeaderMap,
    JsonObject(body): JsonObject,
) -> ApiResult<axum::response::Response> {
    check_admin(&state, &headers)?;
    let name = Fields::new(&body).required_string("name")?;
    let seed = idempotency_seed(&state, &headers)?;
    let (store, replayed) = state
        .engine
        .directory()
        .create_store_from(&name, seed.as_deref())
        .await?;
    let mut response = Json(json!({
        "id": store.store_id,
        "object": "store",
        "name": store.name,
        "api_keys": {"test": store.test_key, "prod": store.prod_key},
        "api_key_ids": {
            "test": tally_engine::directory_access::key_id_of(&tally_engine::stores::key_digest(&store.test_key)),
            "prod": tally_engine::directory_access::key_id_of(&tally_engine::stores::key_digest(&store.prod_key)),
        },
        "created_at": tally_domain::time::format_iso8601_ms(store.created_at_ms),
    }))
    .into_response();
    if replayed {
        response.headers_mut().insert(
            "idempotent-replayed",
            axum::http::HeaderValue::from_static("true"),
        );
    }
    Ok(response)
}

/// The secret an idempotent store creation derives its id and keys from:
/// HMAC-SHA256 of the `idempotency-key` under the admin token. A retry with the
/// same key (through any node holding the token) rebuilds the same answer, and the
/// log holds key digests only, as for every store (docs/api.md, "Servers,
/// environments, keys").
fn idempotency_seed(state: &AppState, headers: &HeaderMap) -> Result<Option<Vec<u8>>, ApiError> {
    use hmac::{Hmac, Mac};
    let Some(value) = headers.get(crate::middleware::IDEMPOTENCY_HEADER) else {
        return Ok(None);
    };
    let key = value
        .to_str()
        .ok()
        .filter(|k| {
            !k.trim().is_empty()
                && k.chars().count() <= crate::middleware::MAX_IDEMPOTENCY_KEY_CHARS
        })
        .ok_or_else(|| {
            ApiError::invalid_param(
                crate::middleware::IDEMPOTENCY_HEADER,
                format!(
                    "`idempotency-key` must be 1 to {} visible ASCII characters",
                    crate::middleware::MAX_IDEMPOTENCY_KEY_CHARS
                ),
            )
        })?;
    let token = state.config.admin_token.as_deref().unwrap_or_default();
    let mut mac = Hmac::<sha2::Sha256>::new_from_slice(token.as_bytes())
        .map_err(|_| ApiError::internal("internal error; it has been logged"))?;
    mac.update(b"tally admin store\0");
    mac.update(key.as_bytes());
    Ok(Some(mac.finalize().into_bytes().to_vec()))
}

/// `POST /admin/v1/stores/{id}/keys {mode, permissions}`: a restricted key, shown
/// once.
#[utoipa::path(
    post,
    path = "/admin/v1/stores/{id}/keys",
    operation_id = "create_key",
    tag = "admin",
    summary = "Create a restricted key",
    params(doc::IdParam),
    request_body(content = doc::KeyCreate, content_type = "application/json"),
    responses((status = 200, description = "Create a restricted key", body = doc::ApiKey))
)]
pub async fn create_key(
    State(state): State<AppState>,
    headers: HeaderMap,
    axum::extract::Path(store_id): axum::extract::Path<String>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    check_admin(&state, &headers)?;
    let fields = Fields::new(&body);
    let mode = match fields.required_string("mode")?.as_str() {
        "test" => tally_domain::Mode::Test,
        "prod" => tally_domain::Mode::Prod,
        _ => {
            return Err(
                tally_domain::FieldError::invalid("mode", "`mode` is `test` or `prod`").into(),
            )
        }
    };
    let permissions = fields
        .strings("permissions")?
        .ok_or_else(|| tally_domain::FieldError::missing("permissions"))?;
    let key = state
        .engine
        .directory()
        .create_key(&store_id, mode, &permissions)
        .await?;
    Ok(Json(json!({
        "id": key.id,
        "object": "api_key",
        "key": key.key,
        "mode": key.mode.as_str(),
        "permissions": key.permissions,
    })))
}

/// `DELETE /admin/v1/stores/{id}/keys/{key_id}`: refused from now on.
#[utoipa::path(
    delete,
    path = "/admin/v1/stores/{id}/keys/{key_id}",
    operation_id = "revoke_key",
    tag = "admin",
    summary = "Revoke a key",
    params(("id" = String, Path, description = "the store id"), ("key_id" = String, Path, description = "the key id")),
    responses((status = 200, description = "Revoke a key", body = doc::RevokedKey), (status = 409, description = "api_key_revoked", body = doc::ErrorBody))
)]
pub async fn revoke_key(
    State(state): State<AppState>,
    headers: HeaderMap,
    axum::extract::Path((store_id, key_id)): axum::extract::Path<(String, String)>,
) -> ApiResult<Json<Value>> {
    check_admin(&state, &headers)?;
    state
        .engine
        .directory()
        .revoke_key(&store_id, &key_id)
        .await?;
    Ok(Json(
        json!({"id": key_id, "object": "api_key", "revoked": true}),
    ))
}
