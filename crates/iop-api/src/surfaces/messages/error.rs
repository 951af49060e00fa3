//! Errors in the Anthropic Messages API's shape:
//! `{"type": "error", "error": {"type": "invalid_request_error", "message": "…"}}`, the
//! error type following the HTTP status as Anthropic's API pairs them. Used for every
//! answer of `/v1/messages`, authentication failures included, and as the stream's
//! `error` event.
//!
//! Pure.

use http::StatusCode;
use serde_json::{Value, json};

use crate::canonical::ApiError;
use crate::surfaces::sse::SseEvent;

/// Anthropic's error type for an HTTP status.
pub fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        s if s >= 500 => "api_error",
        _ => "invalid_request_error",
    }
}

/// The error body.
pub fn body(error: &ApiError) -> Value {
    json!({"type": "error", "error": {"type": error_type(error.status), "message": error.message}})
}

/// The stream's `error` event.
pub fn event(error: &ApiError) -> SseEvent {
    SseEvent::new("error", body(error))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_pair_with_anthropic_error_types() {
        for (status, kind) in [
            (400, "invalid_request_error"),
            (415, "invalid_request_error"),
            (401, "authentication_error"),
            (403, "permission_error"),
            (404, "not_found_error"),
            (413, "request_too_large"),
            (429, "rate_limit_error"),
            (500, "api_error"),
            (502, "api_error"),
            (503, "overloaded_error"),
        ] {
            assert_eq!(error_type(StatusCode::from_u16(status).unwrap()), kind);
        }
        let e = ApiError::bad_request("x", "`max_tokens` is required");
        assert_eq!(
            body(&e),
            json!({"type": "error", "error": {"type": "invalid_request_error",
                   "message": "`max_tokens` is required"}})
        );
    }
}
