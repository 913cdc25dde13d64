//! `/healthz` (the process answers), `/readyz` (projections have caught up with the
//! log as it was at start-up), `/metrics` (Prometheus text), `/v1/openapi.json`
//! (the API's OpenAPI document).

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::error::ApiError;
use crate::openapi as doc;
use crate::AppState;

#[utoipa::path(
    get,
    path = "/healthz",
    operation_id = "healthz",
    tag = "health",
    summary = "The process is up",
    responses((status = 200, description = "The process is up", body = doc::Health))
)]
pub async fn healthz() -> Json<serde_json::Value> {
    Json(json!({"status": "ok"}))
}

#[utoipa::path(
    get,
    path = "/readyz",
    operation_id = "readyz",
    tag = "health",
    summary = "Ready to serve (503 with the reason's code while not)",
    responses((status = 200, description = "Ready to serve (503 with the reason's code while not)", body = doc::Health), (status = 503, description = "not_ready, projector_failed, log_unavailable", body = doc::ErrorBody))
)]
pub async fn readyz(State(state): State<AppState>) -> Response {
    match state.engine.check_writable() {
        Ok(()) => Json(json!({"status": "ready"})).into_response(),
        // Lagging: reads are served and writes resume by themselves; say so.
        Err(tally_engine::EngineError::Unavailable {
            code: "projection_lagging",
            ..
        }) => Json(json!({
            "status": "ready",
            "lagging": true,
            "apply_lag_ms": state.engine.apply_lag().as_millis() as u64,
        }))
        .into_response(),
        Err(error) => {
            let mut error = ApiError::from(error);
            error.status = StatusCode::SERVICE_UNAVAILABLE;
            error.into_response()
        }
    }
}

#[utoipa::path(
    get,
    path = "/metrics",
    operation_id = "metrics",
    tag = "health",
    summary = "Prometheus metrics",
    responses((status = 200, description = "Prometheus text format", content_type = "text/plain"))
)]
pub async fn metrics(State(state): State<AppState>) -> Response {
    let gauges = match state.engine.gauges().await {
        Ok(gauges) => gauges,
        Err(error) => return ApiError::from(error).into_response(),
    };
    let body = state.engine.metrics().render(&gauges);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], body).into_response()
}

/// The document is built once per process: it only changes with the code.
static OPENAPI_JSON: std::sync::OnceLock<String> = std::sync::OnceLock::new();

#[utoipa::path(
    get,
    path = "/v1/openapi.json",
    operation_id = "openapi_json",
    tag = "health",
    summary = "This API's OpenAPI 3.1 document (no key needed)",
    responses((status = 200, description = "The OpenAPI document", content_type = "application/json"))
)]
pub async fn openapi_json() -> Response {
    let body = OPENAPI_JSON.get_or_init(doc::document_json).clone();
    ([(header::CONTENT_TYPE, "application/json")], body).into_response()
}
