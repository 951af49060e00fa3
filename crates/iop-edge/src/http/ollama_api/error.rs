//! Errors in Ollama's shape: `{"error": "message"}` with the status that says who is at
//! fault, `Retry-After` kept. The edge's own errors ([`ApiError`]) keep their status and
//! message; the field they are about is named in the message, since Ollama's shape has no
//! `param`.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::http::error::ApiError;

/// Whether a path belongs to the Ollama API (its errors take Ollama's shape).
pub fn is_ollama_path(path: &str) -> bool {
    path == "/api" || path.starts_with("/api/")
}

/// The message a client sees: the error's, with the field it is about when the message
/// does not name it already.
pub fn message(error: &ApiError) -> String {
    match &error.param {
        Some(param) if !error.message.contains(param.as_str()) => {
            format!("{} (field `{param}`)", error.message)
        }
        _ => error.message.clone(),
    }
}

/// The response for an error on the Ollama API.
pub fn response(error: ApiError) -> Response {
    let mut response =
        (error.status, axum::Json(json!({"error": message(&error)}))).into_response();
    if let Some(secs) = error.retry_after {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(secs));
    }
    response
}

/// A model the key cannot use, or that does not exist (the same answer for both).
pub fn model_not_found(model: &str) -> ApiError {
    ApiError::not_found(
        "model_not_found",
        format!("model \"{model}\" not found; GET /api/tags lists the models you can use"),
    )
}

/// Endpoints of Ollama's that manage a local model store, which iop has none of.
pub fn not_supported(path: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_IMPLEMENTED,
        "invalid_request_error",
        "not_supported",
        format!(
            "{path} is not served here: this Ollama API is served by iop, whose models are the \
             model groups its nodes serve; manage models on the nodes' own servers"
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_render_as_one_message_with_the_field() {
        let e = ApiError::invalid_param("options.seed", "must be an integer");
        assert_eq!(message(&e), "must be an integer (field `options.seed`)");
        let e = ApiError::invalid_param("think", "`think` must be true");
        assert_eq!(message(&e), "`think` must be true");
        let mut e = ApiError::upstream("provider_rate_limited", "busy");
        e.retry_after = Some(2);
        let r = response(e);
        assert_eq!(r.status(), 429);
        assert_eq!(r.headers()[header::RETRY_AFTER], "2");
        assert!(is_ollama_path("/api/chat") && is_ollama_path("/api"));
        assert!(!is_ollama_path("/apix") && !is_ollama_path("/v1/models"));
    }
}
