//! The one place errors become HTTP: every failure, from any crate, is rendered as
//! the body of docs/api.md ("Errors, request ids, limits"):
//! `{"error": {"type", "code", "message", "param", "details"?, "request_id"}, "trace_id"}`.
//!
//! Handlers return [`ApiError`]; its `IntoResponse` stashes it in the response
//! extensions, and the request-id middleware renders the body with the request id.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};
use tally_domain::FieldError;

use tally_engine::EngineError;

/// How much of an unknown id a 404's message repeats: every id Tally issues, and
/// every id a caller chooses (external ids, event ids), is at most 255 characters,
/// so a longer one is no id at all and echoing all of it (up to a whole request
/// line) would only amplify the request.
pub const MAX_ECHOED_ID_CHARS: usize = 255;

/// `id` as a 404's message repeats it: cut at [`MAX_ECHOED_ID_CHARS`] characters.
fn echoed_id(id: &str) -> String {
    match id.char_indices().nth(MAX_ECHOED_ID_CHARS) {
        Some((cut, _)) => format!("{}…", &id[..cut]),
        None => id.to_string(),
    }
}

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub error_type: &'static str,
    pub code: Option<String>,
    pub message: String,
    pub param: Option<String>,
    pub details: Option<Map<String, Value>>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &str, message: impl Into<String>) -> ApiError {
        let error_type = match status.as_u16() {
            401 => "authentication_error",
            402 => "card_error",
            403 => "permission_error",
            429 => "rate_limit_error",
            500..=599 => "api_error",
            _ => "invalid_request_error",
        };
        ApiError {
            status,
            error_type,
            code: Some(code.to_string()),
            message: message.into(),
            param: None,
            details: None,
        }
    }

    pub fn bad_request(code: &str, message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, code, message)
    }

    pub fn invalid_param(param: &str, message: impl Into<String>) -> ApiError {
        ApiError::bad_request("parameter_invalid", message).with_param(param)
    }

    pub fn with_param(mut self, param: impl Into<String>) -> ApiError {
        self.param = Some(param.into());
        self
    }

    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal_error", message)
    }

    /// The JSON body for this error.
    pub fn body(&self, request_id: &str) -> Value {
        let mut error = json!({
            "type": self.error_type,
            "code": self.code,
            "message": self.message,
            "param": self.param,
            "request_id": request_id,
        });
        if let Some(details) = &self.details {
            if !details.is_empty() {
                error["details"] = Value::Object(details.clone());
            }
        }
        json!({ "error": error, "trace_id": request_id })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = self.status.into_response();
        response.extensions_mut().insert(self);
        response
    }
}

impl From<FieldError> for ApiError {
    fn from(e: FieldError) -> Self {
        ApiError::bad_request(e.code, e.message).with_param(e.param)
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::Invalid(field) => field.into(),
            EngineError::NotFound {
                resource,
                id,
                param,
            } => {
                let mut error = ApiError::new(
                    StatusCode::NOT_FOUND,
                    "resource_missing",
                    format!("No such {resource}: '{}'", echoed_id(&id)),
                );
                error.param = param.or(Some("id".to_string()));
                error
            }
            EngineError::Conflict {
                code,
                message,
                param,
                archived_holder_id,
            } => {
                let status = if tally_engine::outcome::INVALID_REQUEST_OUTCOMES.contains(&code) {
                    StatusCode::BAD_REQUEST
                } else if tally_engine::outcome::NOT_FOUND_OUTCOMES.contains(&code) {
                    StatusCode::NOT_FOUND
                } else {
                    StatusCode::CONFLICT
                };
                let mut error = ApiError::new(status, code, message);
                error.param = param;
                if let Some(holder) = archived_holder_id {
                    let mut details = Map::new();
                    details.insert("archived_holder".into(), Value::Bool(true));
                    details.insert("archived_holder_id".into(), Value::String(holder));
                    error.details = Some(details);
                }
                error
            }
            EngineError::CardDeclined {
                code,
                message,
                param,
            } => ApiError::new(StatusCode::PAYMENT_REQUIRED, code, message).with_param(param),
            EngineError::LogUnavailable(tally_log::LogError::RecordTooLarge(bytes)) => {
                ApiError::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "record_too_large",
                    format!(
                        "the request makes a log record of {bytes} bytes, more than the {} allowed; send fewer or smaller events per request. Nothing was written",
                        tally_log::MAX_RECORD_BYTES
                    ),
                )
            }
            EngineError::LogUnavailable(inner) if inner.outcome_unknown() => {
                tracing::error!(error = %inner, "log append failed with an unknown outcome");
                ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "outcome_unknown",
                    "the write may or may not have been appended to the log; retry with the same idempotency key to learn its outcome",
                )
            }
            EngineError::LogUnavailable(inner) => {
                tracing::error!(error = %inner, "log append failed");
                ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "log_unavailable",
                    "the event log is unavailable; nothing was written, retry later",
                )
            }
            EngineError::Unavailable { code, message } => {
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, code, message)
            }
            EngineError::ApplyTimeout
            | EngineError::NotYetProjected
            | EngineError::RecordsNeeded(_) => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "outcome_pending",
                "the write is durable but its outcome is not decided yet; retry with the same idempotency-key (or the same idempotency_key for credits) to get it, never without",
            ),
            EngineError::Store(inner) => {
                tracing::error!(error = %inner, "projection store failure");
                ApiError::internal("internal error; it has been logged")
            }
            EngineError::Corrupt(inner) | EngineError::Runtime(inner) => {
                tracing::error!(error = %inner, "corrupt data");
                ApiError::internal("internal error; it has been logged")
            }
        }
    }
}

pub type ApiResult<T> = Result<T, ApiError>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_404_repeats_at_most_the_longest_id_there_can_be() {
        let fits = "é".repeat(MAX_ECHOED_ID_CHARS);
        assert_eq!(echoed_id(&fits), fits);
        let long = format!("{fits}x");
        assert_eq!(echoed_id(&long), format!("{fits}…"));
        let error = ApiError::from(EngineError::not_found("customer", &"y".repeat(100_000)));
        assert!(
            error.message.chars().count() < MAX_ECHOED_ID_CHARS + 40,
            "{}",
            error.message
        );
    }
}
