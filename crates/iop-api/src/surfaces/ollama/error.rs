//! Errors in Ollama's shape: `{"error": "message"}` with the status that says who is at
//! fault. The edge's own errors keep their status and message; the field they are about
//! is named in the message, since Ollama's shape has no `param`.
//!
//! Pure.

use serde_json::{Value, json};

use crate::canonical::ApiError;

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

/// The error body.
pub fn body(error: &ApiError) -> Value {
    json!({"error": message(error)})
}

/// A model the key cannot use, or that does not exist (the same answer for both).
pub fn model_not_found(model: &str) -> ApiError {
    ApiError::model_not_found(format!(
        "model \"{model}\" not found; GET /api/tags lists the models you can use"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_render_as_one_message_with_the_field() {
        let e = ApiError::invalid_param("options.seed", "must be an integer");
        assert_eq!(message(&e), "must be an integer (field `options.seed`)");
        let e = ApiError::invalid_param("think", "`think` must be true");
        assert_eq!(body(&e), json!({"error": "`think` must be true"}));
        assert!(is_ollama_path("/api/chat") && is_ollama_path("/api"));
        assert!(!is_ollama_path("/apix") && !is_ollama_path("/v1/models"));
    }
}
