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

pub async fn metrics(State(state): State<AppState>) -> Response {
    let positions = state.engine.positions().await;
    let body = state
        .engine
        .metrics()
        .render(&positions, state.engine.log().kind());
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], body).into_response()
}
