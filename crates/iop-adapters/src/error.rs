//! A failed run or command, with its typed reason: the edge maps the code to a status and
//! decides on retries; the message is for humans and names a provider by id, never by
//! address.

use iop_proto::{ErrorCode, pb};

/// A failed run, with its typed reason (the edge maps it to a status and decides on
/// retries). The message is for humans: it names the provider by id, never by address.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct AdapterError {
    pub code: ErrorCode,
    pub message: String,
}

impl AdapterError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    pub fn not_supported(what: &str) -> Self {
        Self::new(ErrorCode::NotSupported, what)
    }

    /// The error as it goes on the wire.
    pub fn to_wire(&self) -> pb::RunError {
        pb::RunError::new(self.code, self.message.clone())
    }
}

impl From<crate::sink::SinkClosed> for AdapterError {
    fn from(_: crate::sink::SinkClosed) -> Self {
        AdapterError::new(ErrorCode::NodeDisconnected, "the run's stream closed")
    }
}
