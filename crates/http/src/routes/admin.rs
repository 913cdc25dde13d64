//! The admin API (docs/api.md): `POST /admin/v1/stores` with
//! `Authorization: Bearer $TALLY_ADMIN_TOKEN`. Without the token configured it does
//! not exist (404).

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use serde_json::{json, Value};

use crate::error::{ApiError, ApiResult};
use crate::extract::{Fields, JsonObject};
use crate::AppState;

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

pub async fn create_store(
    State(state): State<AppState>,
    headers: HeaderMap,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let Some(token) = state.config.admin_token.as_deref() else {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "route_not_found",
            "no such route",
        ));
    };
    let presented = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if !constant_time_eq(presented.as_bytes(), token.as_bytes()) {
        return Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "admin_token_invalid",
            "send `Authorization: Bearer <TALLY_ADMIN_TOKEN>`",
        ));
    }
    let name = Fields::new(&body).required_string("name")?;
    let store = state.engine.directory().create_store(&name).await?;
    Ok(Json(json!({
        "id": store.store_id,
        "object": "store",
        "name": store.name,
        "api_keys": {"test": store.test_key, "prod": store.prod_key},
        "created_at": tally_domain::time::format_iso8601_ms(store.created_at_ms),
    })))
}
