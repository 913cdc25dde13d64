//! Validation failures as values: a machine code, a human message and the parameter
//! (an indexed path such as `events[3].timestamp`) the caller has to fix.

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct FieldError {
    pub code: &'static str,
    pub message: String,
    pub param: String,
}

impl FieldError {
    pub fn new(code: &'static str, param: impl Into<String>, message: impl Into<String>) -> Self {
        FieldError {
            code,
            message: message.into(),
            param: param.into(),
        }
    }

    /// The generic code for a field that is missing, of the wrong type or out of range.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        FieldError::new("parameter_invalid", param, message)
    }

    pub fn missing(param: impl Into<String>) -> Self {
        let param = param.into();
        let message = format!("`{param}` is required");
        FieldError::new("parameter_missing", param, message)
    }

    /// Prefixes the parameter with a path, e.g. `name` becomes `events[2].name`.
    pub fn under(mut self, prefix: &str) -> Self {
        self.param = if self.param.is_empty() {
            prefix.to_string()
        } else {
            format!("{prefix}.{}", self.param)
        };
        self
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = code;
        self
    }
}
