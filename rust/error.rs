//! The one error type of the core. The Python layer maps each variant to an exception class.

use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum StrataError {
    /// A model folder that is not a supported model: names the file and the field or tensor.
    #[error("{file}: {detail}")]
    ModelLoad { file: String, detail: String },
    /// Bad input from a caller: names the field and the reason.
    #[error("{field}: {reason}")]
    InvalidRequest { field: String, reason: String },
    /// A request longer than the engine can ever hold.
    #[error("{0}")]
    ContextOverflow(String),
    /// The queue of waiting requests is full; retry later.
    #[error("{0}")]
    EngineBusy(String),
    /// The requested device does not exist or cannot be used.
    #[error("{0}")]
    DeviceUnavailable(String),
    /// The engine loop has stopped; no more requests are taken.
    #[error("{0}")]
    EngineStopped(String),
    /// A fault inside the engine that is nobody's input: a bug or an OS failure.
    #[error("{0}")]
    Internal(String),
}

pub type Result<T> = std::result::Result<T, StrataError>;

impl StrataError {
    pub fn model_load(file: impl AsRef<Path>, detail: impl Into<String>) -> Self {
        StrataError::ModelLoad {
            file: file.as_ref().display().to_string(),
            detail: detail.into(),
        }
    }

    pub fn invalid(field: impl Into<String>, reason: impl Into<String>) -> Self {
        StrataError::InvalidRequest {
            field: field.into(),
            reason: reason.into(),
        }
    }
}
