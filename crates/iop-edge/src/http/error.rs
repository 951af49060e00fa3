//! Errors as clients see them: OpenAI's `{"error": {"message", "type", "param", "code"}}`
//! with the status that says who is at fault (4xx the client, 5xx us or upstream).
//!
//! Every error has a typed reason ([`ErrorCode`]): its status and fault come from the
//! reason table in the wire crate, it is the `x-iop-error` response header and the
//! `outcome` the metrics count, and it is OpenAI's `code` — except for request validation
//! errors, whose `code` names the exact problem (`missing_messages`, `invalid_value`)
//! while their reason is `bad_request`.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use iop_proto::{ErrorCode, Fault, pb};
use serde_json::json;

use crate::service::admission::{AdmitError, RETRY_AFTER_SECS};
use crate::service::command::CommandError;
use crate::service::run::SubmitError;

/// The response header naming an error's reason.
pub const ERROR_HEADER: &str = "x-iop-error";
/// The response header saying how many attempts a request took.
pub const ATTEMPTS_HEADER: &str = "x-iop-attempts";

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`.
    pub kind: &'static str,
    /// OpenAI's `code`.
    pub code: String,
    /// The typed reason.
    pub reason: ErrorCode,
    /// The request field the error is about (OpenAI's `param`).
    pub param: Option<String>,
    pub retry_after: Option<u64>,
    /// Attempts the edge made at serving the request, once it reached a member.
    pub attempts: Option<u32>,
    /// The request reached the dispatcher, whose meter counts it in the metrics: the
    /// surface must not count it again.
    pub metered: bool,
}

/// OpenAI's `type` for a status and fault.
fn openai_type(status: StatusCode, fault: Fault) -> &'static str {
    match status.as_u16() {
        403 => "permission_error",
        429 => "rate_limit_error",
        400..=499 => "invalid_request_error",
        _ if fault == Fault::Provider => "upstream_error",
        _ => "server_error",
    }
}

impl ApiError {
    /// An error of reason `reason`: status, type and code from the reason table.
    pub fn of(reason: ErrorCode, message: impl Into<String>) -> Self {
        let status =
            StatusCode::from_u16(reason.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        Self {
            status,
            message: message.into(),
            kind: openai_type(status, reason.fault()),
            code: reason.as_str().to_string(),
            reason,
            param: None,
            retry_after: None,
            attempts: None,
            metered: false,
        }
    }

    /// An error a node or provider reported by its string code only, or one the edge names
    /// for what it read of a provider's answer: status and type from the reason the code
    /// names (`provider_error` for names the table lacks), the code as given.
    pub fn upstream(code: &str, message: &str) -> Self {
        let reason = match ErrorCode::from_wire(0, code) {
            ErrorCode::Unspecified => ErrorCode::ProviderError,
            known => known,
        };
        let mut e = Self::of(reason, message);
        if !code.is_empty() {
            e.code = code.to_string();
        }
        e
    }

    /// An error with an explicit status, type and code; its reason is the code's if the
    /// code names one, else the client's (4xx) or the edge's (5xx) generic one.
    pub fn new(
        status: StatusCode,
        kind: &'static str,
        code: &str,
        message: impl Into<String>,
    ) -> Self {
        let reason = ErrorCode::from_name(code).unwrap_or(if status.is_client_error() {
            ErrorCode::BadRequest
        } else {
            ErrorCode::Internal
        });
        Self {
            status,
            message: message.into(),
            kind,
            code: code.to_string(),
            reason,
            param: None,
            retry_after: None,
            attempts: None,
            metered: false,
        }
    }

    /// Names the request field the error is about.
    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    /// Marks an error of a request the dispatcher already counted (see [`Self::metered`]).
    pub fn metered(mut self) -> Self {
        self.metered = true;
        self
    }

    /// Says how many attempts the request took.
    pub fn with_attempts(mut self, attempts: u32) -> Self {
        if attempts > 0 {
            self.attempts = Some(attempts);
        }
        self
    }

    /// A field of the request that is not what the edge accepts.
    pub fn invalid_param(param: &str, message: impl Into<String>) -> Self {
        Self::bad_request("invalid_value", message).with_param(param)
    }

    /// The key may not use this surface.
    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::of(ErrorCode::InsufficientPermissions, message)
    }

    /// A request the edge refuses; `code` says exactly why (its reason is `bad_request`).
    pub fn bad_request(code: &str, message: impl Into<String>) -> Self {
        Self {
            code: code.to_string(),
            ..Self::of(ErrorCode::BadRequest, message)
        }
    }

    /// Something the client named does not exist; `code` says what.
    pub fn not_found(code: &str, message: impl Into<String>) -> Self {
        let reason = match code {
            "model_not_found" => ErrorCode::ModelNotFound,
            _ => ErrorCode::NotFound,
        };
        Self {
            code: code.to_string(),
            ..Self::of(reason, message)
        }
    }

    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::of(ErrorCode::InvalidApiKey, message)
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

    /// An error a node reported (a run's error terminal, a tunnel error).
    pub fn from_wire(reason: ErrorCode, message: &str) -> Self {
        Self::of(reason, message)
    }

    pub fn from_tunnel_error(error: &pb::TunnelError) -> Self {
        Self::of(error.error_code(), error.message.clone())
    }

    pub fn from_run_error(error: Option<&pb::RunError>) -> Self {
        match error {
            Some(e) => Self::of(e.error_code(), e.message.clone()),
            None => Self::of(ErrorCode::ProviderError, "the run failed without a reason"),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        let headers = response.headers_mut();
        if let Some(secs) = self.retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        headers.insert(ERROR_HEADER, HeaderValue::from_static(self.reason.as_str()));
        if let Some(attempts) = self.attempts {
            headers.insert(ATTEMPTS_HEADER, HeaderValue::from(attempts));
        }
        response
    }
}

impl From<AdmitError> for ApiError {
    fn from(err: AdmitError) -> Self {
        let code = err.code();
        let e = ApiError::of(code, err.to_string());
        match code {
            ErrorCode::QueueFull | ErrorCode::QueueTimeout => ApiError {
                retry_after: Some(RETRY_AFTER_SECS),
                ..e
            },
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

impl From<CommandError> for ApiError {
    fn from(err: CommandError) -> Self {
        let message = err.to_string();
        match err {
            CommandError::Submit(e) => e.into(),
            CommandError::UnknownRun(_) => ApiError::not_found("run_not_found", message),
            CommandError::Timeout => ApiError::of(ErrorCode::NodeTimeout, message),
            CommandError::Failed { code, message } => {
                let mut e = ApiError::of(code, message);
                if code == ErrorCode::NotSupported {
                    e.status = StatusCode::NOT_IMPLEMENTED;
                }
                e
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_names_its_reason_and_keeps_provider_addresses_out() {
        let e = ApiError::of(ErrorCode::ProviderUnreachable, "provider a is unreachable");
        assert_eq!(e.status, 502);
        assert_eq!(
            (e.kind, e.code.as_str()),
            ("upstream_error", "provider_unreachable")
        );
        let response = e.into_response();
        assert_eq!(response.headers()[ERROR_HEADER], "provider_unreachable");
        let e = ApiError::from(AdmitError::QueueFull {
            group: "g".into(),
            max_waiting: 1,
        })
        .with_attempts(0);
        assert_eq!((e.status.as_u16(), e.kind), (429, "rate_limit_error"));
        let response = e.into_response();
        assert_eq!(response.headers()[header::RETRY_AFTER], "1");
        assert!(response.headers().get(ATTEMPTS_HEADER).is_none());
        // Validation errors keep their exact code, under the `bad_request` reason.
        let e = ApiError::bad_request("missing_messages", "x").with_attempts(2);
        assert_eq!(
            (e.code.as_str(), e.reason),
            ("missing_messages", ErrorCode::BadRequest)
        );
        let response = e.into_response();
        assert_eq!(response.headers()[ERROR_HEADER], "bad_request");
        assert_eq!(response.headers()[ATTEMPTS_HEADER], "2");
        let e = ApiError::of(ErrorCode::ProviderRateLimited, "busy");
        assert_eq!((e.status.as_u16(), e.kind), (429, "rate_limit_error"));
        let e = ApiError::of(ErrorCode::NodeTimeout, "slow");
        assert_eq!((e.status.as_u16(), e.kind), (504, "server_error"));
    }
}
