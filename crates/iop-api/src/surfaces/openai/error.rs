//! Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`, the
//! `type` following the status and who is at fault (4xx the client, 5xx the edge or the
//! provider behind it). Also the stream's error event once a stream has begun.
//!
//! Pure.

use http::StatusCode;
use iop_proto::Fault;
use serde_json::{Value, json};

use crate::canonical::ApiError;

/// OpenAI's `type` for a status and fault.
pub fn openai_type(status: StatusCode, fault: Fault) -> &'static str {
    match status.as_u16() {
        403 => "permission_error",
        429 => "rate_limit_error",
        400..=499 => "invalid_request_error",
        _ if fault == Fault::Provider => "upstream_error",
        _ => "server_error",
    }
}

/// The error body.
pub fn body(error: &ApiError) -> Value {
    json!({
        "error": {
            "message": error.message,
            "type": openai_type(error.status, error.reason.fault()),
            "param": error.param,
            "code": error.code(),
        }
    })
}

/// The event that ends an OpenAI stream with `error`.
pub fn event(error: &ApiError) -> Vec<u8> {
    format!("data: {}\n\n", body(error)).into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;
    use iop_proto::ErrorCode;

    #[test]
    fn the_type_follows_status_and_fault() {
        let e = ApiError::of(ErrorCode::ProviderUnreachable, "provider a is unreachable");
        assert_eq!(
            body(&e)["error"],
            json!({"message": "provider a is unreachable", "type": "upstream_error",
                   "param": null, "code": "provider_unreachable"})
        );
        for (code, kind) in [
            (ErrorCode::QueueFull, "rate_limit_error"),
            (ErrorCode::RequestsPerMinuteExceeded, "rate_limit_error"),
            (ErrorCode::InsufficientPermissions, "permission_error"),
            (ErrorCode::ModelNotFound, "invalid_request_error"),
            (ErrorCode::NodeTimeout, "server_error"),
            (ErrorCode::ProviderError, "upstream_error"),
        ] {
            assert_eq!(
                body(&ApiError::of(code, "x"))["error"]["type"],
                kind,
                "{code:?}"
            );
        }
        let e = ApiError::invalid_param("messages[0].role", "no");
        assert_eq!(body(&e)["error"]["param"], "messages[0].role");
        assert_eq!(body(&e)["error"]["code"], "invalid_value");
        assert!(event(&e).starts_with(b"data: {\"error\""));
    }
}
