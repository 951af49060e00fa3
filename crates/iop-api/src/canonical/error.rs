//! An error as the edge hands it to a client, before any API's shape: its typed reason
//! ([`ErrorCode`]: status, fault and the `x-iop-error` header come from the reason table
//! in the wire crate), a message that says what to do, and — for a refused request — the
//! exact problem and the field it is about. Every surface renders it in its own shape
//! (OpenAI's `{"error": {…}}`, Anthropic's, Ollama's `{"error": "…"}`).
//!
//! Errors are built only from an [`ErrorCode`]; two things may refine what the reason
//! says: a `detail` (OpenAI's `code`: `missing_messages`, or the code a provider's own
//! error answer carried) and, for a provider's 4xx answer, the provider's status.
//!
//! Pure: no I/O.

use http::StatusCode;
use iop_proto::{ErrorCode, pb};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// The typed reason.
    pub reason: ErrorCode,
    /// The status the client gets: the reason's, or a provider's own 4xx.
    pub status: StatusCode,
    pub message: String,
    /// What exactly went wrong, when the reason's name says too little (OpenAI's `code`).
    pub detail: Option<String>,
    /// The request field the error is about (OpenAI's `param`).
    pub param: Option<String>,
    /// `Retry-After`, in seconds.
    pub retry_after: Option<u64>,
    /// Attempts the edge made at serving the request, once it reached a member.
    pub attempts: Option<u32>,
}

impl ApiError {
    /// An error of reason `reason`.
    pub fn of(reason: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            reason,
            status: StatusCode::from_u16(reason.status())
                .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            message: message.into(),
            detail: None,
            param: None,
            retry_after: None,
            attempts: None,
        }
    }

    /// OpenAI's `code`: the detail, or the reason's name.
    pub fn code(&self) -> &str {
        self.detail.as_deref().unwrap_or(self.reason.as_str())
    }

    /// Says exactly what went wrong (OpenAI's `code`).
    pub fn with_detail(mut self, detail: impl Into<String>) -> Self {
        self.detail = Some(detail.into());
        self
    }

    /// Names the request field the error is about.
    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    pub fn with_retry_after(mut self, secs: u64) -> Self {
        self.retry_after = Some(secs);
        self
    }

    /// Says how many attempts the request took.
    pub fn with_attempts(mut self, attempts: u32) -> Self {
        if attempts > 0 {
            self.attempts = Some(attempts);
        }
        self
    }

    /// A request the edge refuses; `detail` says exactly why.
    pub fn bad_request(detail: &str, message: impl Into<String>) -> Self {
        Self::of(ErrorCode::BadRequest, message).with_detail(detail)
    }

    /// A field of the request that is not what the edge accepts.
    pub fn invalid_param(param: &str, message: impl Into<String>) -> Self {
        Self::bad_request("invalid_value", message).with_param(param)
    }

    /// Something the client named does not exist; `detail` says what.
    pub fn not_found(detail: &str, message: impl Into<String>) -> Self {
        Self::of(ErrorCode::NotFound, message).with_detail(detail)
    }

    /// A model group that does not exist or that the key may not use (the same answer
    /// for both).
    pub fn model_not_found(message: impl Into<String>) -> Self {
        Self::of(ErrorCode::ModelNotFound, message)
    }

    /// The key may not do this.
    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::of(ErrorCode::InsufficientPermissions, message)
    }

    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::of(ErrorCode::InvalidApiKey, message)
    }

    /// An error a node or provider reported by its string code only, or one the edge names
    /// for what it read of a provider's answer: the reason the code names
    /// (`provider_error` for names the table lacks), the code kept as the detail.
    pub fn upstream(code: &str, message: &str) -> Self {
        let reason = match ErrorCode::from_wire(0, code) {
            ErrorCode::Unspecified => ErrorCode::ProviderError,
            known => known,
        };
        let e = Self::of(reason, message);
        if code.is_empty() || code == reason.as_str() {
            e
        } else {
            e.with_detail(code)
        }
    }

    /// A provider's own error answer: the reason its status stands for, the provider's
    /// status (translated or passed through, a client sees what the provider said; a
    /// status that is not an error is the edge's 502), and the provider's code when it
    /// sent one.
    pub fn provider_answer(status: u16, code: Option<String>, message: String) -> Self {
        let reason = ErrorCode::from_provider_status(status).unwrap_or(ErrorCode::ProviderError);
        let mut e = Self::of(reason, message);
        if let Ok(s) = StatusCode::from_u16(status)
            && (s.is_client_error() || s.is_server_error())
        {
            e.status = s;
        }
        e.detail = code.filter(|c| c != reason.as_str());
        e
    }

    /// An error a node reported (a run's error terminal, a tunnel error).
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reason_decides_unless_refined() {
        let e = ApiError::of(ErrorCode::QueueFull, "full");
        assert_eq!((e.status.as_u16(), e.code()), (429, "queue_full"));
        let e = ApiError::bad_request("missing_messages", "x").with_attempts(0);
        assert_eq!(
            (e.reason, e.code(), e.attempts),
            (ErrorCode::BadRequest, "missing_messages", None)
        );
        // A provider's error keeps its status.
        let e = ApiError::provider_answer(422, Some("bad_field".into()), "no".into());
        assert_eq!(
            (e.status.as_u16(), e.reason, e.code()),
            (422, ErrorCode::BadRequest, "bad_field")
        );
        let e = ApiError::provider_answer(500, None, "boom".into());
        assert_eq!((e.status.as_u16(), e.code()), (500, "provider_error"));
        let e = ApiError::provider_answer(200, None, "an error in a stream".into());
        assert_eq!(e.status.as_u16(), 502);
        let e = ApiError::provider_answer(503, None, "busy".into());
        assert_eq!((e.status.as_u16(), e.code()), (503, "provider_overloaded"));
        // A string code names its reason; an unknown one is the provider's error.
        let e = ApiError::upstream("provider_rate_limited", "busy");
        assert_eq!((e.status.as_u16(), e.detail), (429, None));
        let e = ApiError::upstream("weird", "?");
        assert_eq!((e.reason, e.code()), (ErrorCode::ProviderError, "weird"));
    }
}
