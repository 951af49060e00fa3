//! The service's own errors as the errors clients get ([`ApiError`], built from the
//! reason table): why admission gave a request no slot, why a run, tunnel or command
//! could not start.

use iop_proto::ErrorCode;

use super::admission::{AdmitError, RETRY_AFTER_SECS};
use crate::canonical::ApiError;
use crate::session::NodeSession;

/// Why a run, tunnel or command could not be started or failed before it began.
#[derive(Debug, Clone, thiserror::Error)]
pub enum SubmitError {
    #[error("no node is connected and ready")]
    NoReadyNode,
    #[error("several nodes are ready ({}); say which one with `node`", .0.join(", "))]
    AmbiguousNode(Vec<String>),
    #[error("node `{0}` is not configured")]
    UnknownNode(String),
    #[error("node `{0}` is not connected and ready")]
    NodeNotReady(String),
    #[error("node `{node}` has no adapter `{adapter}` (its providers: {known})")]
    UnknownAdapter {
        node: String,
        adapter: String,
        known: String,
    },
    #[error("could not send the request to node `{node}`: {reason}")]
    SendFailed { node: String, reason: String },
    /// The node, or the provider behind it, failed the request before it began.
    #[error("{message}")]
    Failed { code: ErrorCode, message: String },
    #[error(transparent)]
    Admission(#[from] AdmitError),
}

impl SubmitError {
    /// A request that could not reach `session`'s node, and why.
    pub fn send_failed(session: &NodeSession, reason: impl ToString) -> Self {
        SubmitError::SendFailed {
            node: session.node_id.clone(),
            reason: reason.to_string(),
        }
    }

    /// The typed reason.
    pub fn code(&self) -> ErrorCode {
        match self {
            SubmitError::NoReadyNode | SubmitError::NodeNotReady(_) => ErrorCode::NodeUnavailable,
            SubmitError::AmbiguousNode(_) => ErrorCode::BadRequest,
            SubmitError::UnknownNode(_) | SubmitError::UnknownAdapter { .. } => ErrorCode::NotFound,
            SubmitError::SendFailed { .. } => ErrorCode::NodeDisconnected,
            SubmitError::Failed { code, .. } => *code,
            SubmitError::Admission(e) => e.code(),
        }
    }
}

impl From<AdmitError> for ApiError {
    fn from(err: AdmitError) -> Self {
        let code = err.code();
        let e = ApiError::of(code, err.to_string());
        match code {
            ErrorCode::QueueFull | ErrorCode::QueueTimeout => e.with_retry_after(RETRY_AFTER_SECS),
            _ => e,
        }
    }
}

impl From<SubmitError> for ApiError {
    fn from(err: SubmitError) -> Self {
        let message = err.to_string();
        match err {
            SubmitError::Admission(e) => e.into(),
            SubmitError::UnknownNode(_) => ApiError::not_found("node_not_found", message),
            SubmitError::UnknownAdapter { .. } => {
                ApiError::not_found("unknown_adapter", message).with_param("adapter")
            }
            SubmitError::AmbiguousNode(_) => ApiError::bad_request("node_required", message),
            other => ApiError::of(other.code(), message),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_errors_keep_their_reasons() {
        let e = ApiError::from(AdmitError::QueueFull {
            group: "g".into(),
            max_waiting: 1,
        });
        assert_eq!((e.status.as_u16(), e.retry_after), (429, Some(1)));
        let e = ApiError::from(SubmitError::UnknownAdapter {
            node: "n".into(),
            adapter: "a".into(),
            known: "b".into(),
        });
        assert_eq!((e.status.as_u16(), e.code()), (404, "unknown_adapter"));
    }
}
