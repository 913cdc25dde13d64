//! The engine's errors: what a request can fail with, as values the HTTP layer maps
//! to status codes (see `tally-http`'s error.rs).

use tally_domain::FieldError;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// Bad input: 400 naming the parameter.
    #[error(transparent)]
    Invalid(#[from] FieldError),
    /// 404.
    #[error("no such {resource}: '{id}'")]
    NotFound {
        resource: &'static str,
        id: String,
        param: Option<String>,
    },
    /// 409 with a machine code.
    #[error("{message}")]
    Conflict {
        code: &'static str,
        message: String,
        param: Option<String>,
        archived_holder_id: Option<String>,
    },
    /// The card was declined (402, type `card_error`): nothing was charged or written.
    /// `param` names the card field that made the decline.
    #[error("{message}")]
    CardDeclined {
        code: &'static str,
        message: String,
        param: &'static str,
    },
    /// The log refused or failed the append: nothing was written (503).
    #[error("the log is unavailable: {0}")]
    LogUnavailable(#[from] tally_log::LogError),
    /// Projection store I/O failure (500).
    #[error("projection store failure: {0}")]
    Store(#[from] tally_projection::StoreError),
    /// A stored value or record did not decode: a bug or a corrupted store (500).
    #[error("corrupt data: {0}")]
    Corrupt(String),
    /// Writes are not taken now; nothing was written (503 with this code).
    #[error("{message}")]
    Unavailable {
        code: &'static str,
        message: &'static str,
    },
    /// The write was appended but the projector did not apply it in time (503).
    #[error("timed out waiting for the projection to apply the write")]
    ApplyTimeout,
    /// The projector is waiting for a record of another partition (Kafka mode).
    #[error("a meter referenced by a usage record is not projected yet")]
    NotYetProjected,
    /// Apply needs log records (by partition and offset) it was not given: the
    /// projector fetches them and applies the chunk again (projector.rs).
    #[error("apply needs {} more log records", .0.len())]
    RecordsNeeded(Vec<(u32, u64)>),
    /// The projection runtime stopped a replay (a log or store failure, or a record
    /// that could not be applied).
    #[error("replay failed: {0}")]
    Runtime(String),
}

impl EngineError {
    pub fn not_found(resource: &'static str, id: &str) -> Self {
        EngineError::NotFound {
            resource,
            id: id.to_string(),
            param: None,
        }
    }

    /// A not-found naming the request parameter that held the unknown id (other
    /// errors pass unchanged).
    pub fn for_param(self, param: &str) -> Self {
        match self {
            EngineError::NotFound { resource, id, .. } => EngineError::NotFound {
                resource,
                id,
                param: Some(param.to_string()),
            },
            other => other,
        }
    }

    pub fn conflict(code: &'static str, message: impl Into<String>) -> Self {
        EngineError::Conflict {
            code,
            message: message.into(),
            param: None,
            archived_holder_id: None,
        }
    }
}

impl From<tally_runtime::RuntimeError> for EngineError {
    fn from(error: tally_runtime::RuntimeError) -> Self {
        match error {
            tally_runtime::RuntimeError::Log(error) => EngineError::LogUnavailable(error),
            tally_runtime::RuntimeError::Store(error) => EngineError::Store(error),
            tally_runtime::RuntimeError::Projection(why) => EngineError::Runtime(why),
        }
    }
}
