//! `/healthz` (the process answers), `/readyz` (projections have caught up with the
//! log as it was at start-up), `/metrics` (Prometheus text).

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::error::ApiError;
use crate::AppState;

pub async fn healthz() -> Json<serde_json::Value> {
    Json(json!({"status": "ok"}))
}

pub async fn readyz(State(state): State<AppState>) -> Response {
    if state.engine.is_ready() {
        Json(json!({"status": "ready"})).into_response()
    } else {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "not_ready",
            "projections are still catching up with the log",
        )
        .into_response()
    }
}

pub async fn metrics(State(state): State<AppState>) -> Response {
    let positions = state.engine.positions().await;
    let body = state
        .engine
        .metrics
        .render(&positions, state.engine.log().kind());
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], body).into_response()
}
