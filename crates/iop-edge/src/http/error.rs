//! Errors as clients see them: OpenAI's `{"error": {"message", "type", "param", "code"}}`
//! with the status that says who is at fault (4xx the client, 5xx us or upstream).

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use iop_proto::pb;
use serde_json::json;

use crate::service::admission::{AdmitError, RETRY_AFTER_SECS};
use crate::service::command::CommandError;
use crate::service::run::SubmitError;

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub code: String,
    /// The request field the error is about (OpenAI's `param`).
    pub param: Option<String>,
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn new(
        status: StatusCode,
        kind: &'static str,
        code: &str,
        message: impl Into<String>,
    ) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            code: code.to_string(),
            param: None,
            retry_after: None,
        }
    }

    /// Names the request field the error is about.
    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    /// A field of the request that is not what the edge accepts.
    pub fn invalid_param(param: &str, message: impl Into<String>) -> Self {
        Self::bad_request("invalid_value", message).with_param(param)
    }

    /// The key may not use this surface.
    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::FORBIDDEN,
            "permission_error",
            "insufficient_permissions",
            message,
        )
    }

    pub fn bad_request(code: &str, message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            code,
            message,
        )
    }

    pub fn not_found(code: &str, message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            code,
            message,
        )
    }

    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            "invalid_api_key",
            message,
        )
    }

    /// The JSON body, also used for SSE error events once a stream has begun.
    pub fn body(&self) -> serde_json::Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }

    /// An error reported by a node or provider (a run's error terminal, a tunnel error).
    pub fn upstream(code: &str, message: &str) -> Self {
        let status = match code {
            "provider_timeout" => StatusCode::GATEWAY_TIMEOUT,
            "capacity" => StatusCode::TOO_MANY_REQUESTS,
            "bad_request" | "unknown_adapter" | "unknown_target" | "not_supported" => {
                StatusCode::BAD_REQUEST
            }
            "not_found" => StatusCode::NOT_FOUND,
            "node_disconnected" | "node_shutdown" => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::BAD_GATEWAY,
        };
        let kind = if status.is_client_error() {
            "invalid_request_error"
        } else {
            "upstream_error"
        };
        let code = if code.is_empty() {
            "upstream_error"
        } else {
            code
        };
        Self::new(status, kind, code, message)
    }

    pub fn from_run_error(error: Option<&pb::RunError>) -> Self {
        match error {
            Some(e) => Self::upstream(&e.code, &e.message),
            None => Self::upstream("upstream_error", "the run failed without a reason"),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if let Some(secs) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}

impl From<AdmitError> for ApiError {
    fn from(err: AdmitError) -> Self {
        let message = err.to_string();
        match err {
            AdmitError::UnknownGroup(_) => ApiError::not_found("model_not_found", message),
            AdmitError::NoCapacityInLane { .. } => {
                ApiError::bad_request("context_length_exceeded", message)
            }
            AdmitError::QueueFull { .. } => ApiError {
                retry_after: Some(RETRY_AFTER_SECS),
                ..ApiError::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    "rate_limit_error",
                    "queue_full",
                    message,
                )
            },
            AdmitError::Timeout { .. } => ApiError {
                retry_after: Some(RETRY_AFTER_SECS),
                ..ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "server_error",
                    "queue_timeout",
                    message,
                )
            },
            AdmitError::Unavailable { .. } | AdmitError::Offline { .. } => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "model_unavailable",
                message,
            ),
        }
    }
}

impl From<SubmitError> for ApiError {
    fn from(err: SubmitError) -> Self {
        let message = err.to_string();
        match err {
            SubmitError::Admission(e) => e.into(),
            SubmitError::UnknownNode(_) => ApiError::not_found("node_not_found", message),
            SubmitError::AmbiguousNode(_) => ApiError::bad_request("node_required", message),
            SubmitError::NoReadyNode | SubmitError::NodeNotReady(_) => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "node_unavailable",
                message,
            ),
            SubmitError::SendFailed { .. } => ApiError::new(
                StatusCode::BAD_GATEWAY,
                "server_error",
                "node_unavailable",
                message,
            ),
        }
    }
}

impl From<CommandError> for ApiError {
    fn from(err: CommandError) -> Self {
        let message = err.to_string();
        match err {
            CommandError::Submit(e) => e.into(),
            CommandError::UnknownRun(_) => ApiError::not_found("run_not_found", message),
            CommandError::Timeout => ApiError::new(
                StatusCode::GATEWAY_TIMEOUT,
                "server_error",
                "node_timeout",
                message,
            ),
            CommandError::Failed { code, message } => {
                let mut e = ApiError::upstream(&code, &message);
                if code == "not_supported" {
                    e.status = StatusCode::NOT_IMPLEMENTED;
                }
                e
            }
        }
    }
}
