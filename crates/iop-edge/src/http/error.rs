//! Errors as responses: an [`ApiError`] in the shape of the API the request was for
//! ([`ErrorShape`]: OpenAI's, Anthropic's, Ollama's), with `Retry-After` when it has one,
//! `x-iop-error` naming its reason and `x-iop-attempts` the attempts it took.

use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};

use crate::canonical::ApiError;
use crate::service::command::CommandError;
use crate::surfaces::ErrorShape;

/// The response header naming an error's reason.
pub const ERROR_HEADER: &str = "x-iop-error";
/// The response header saying how many attempts a request took.
pub const ATTEMPTS_HEADER: &str = "x-iop-attempts";

/// The error shape of the API a path belongs to.
pub fn shape_of(path: &str) -> ErrorShape {
    if crate::surfaces::ollama::error::is_ollama_path(path) {
        ErrorShape::Ollama
    } else if path.starts_with("/v1/messages") {
        ErrorShape::Anthropic
    } else {
        ErrorShape::OpenAi
    }
}

/// The response for `error` in `shape`.
pub fn response(shape: ErrorShape, error: ApiError) -> Response {
    let mut response = (error.status, axum::Json(shape.body(&error))).into_response();
    let headers = response.headers_mut();
    if let Some(secs) = error.retry_after {
        headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
    }
    headers.insert(
        ERROR_HEADER,
        HeaderValue::from_static(error.reason.as_str()),
    );
    if let Some(attempts) = error.attempts {
        headers.insert(ATTEMPTS_HEADER, HeaderValue::from(attempts));
    }
    response
}

/// The response with `x-iop-attempts`.
pub fn with_attempts(mut response: Response, attempts: u32) -> Response {
    response
        .headers_mut()
        .insert(ATTEMPTS_HEADER, HeaderValue::from(attempts));
    response
}

/// An error a handler or extractor answers with, in OpenAI's shape (the OpenAI API, the
/// runs API, admin endpoints): [`ApiError`] lives in the pure API crate, which knows no
/// HTTP server, so this is what makes it a response.
#[derive(Debug)]
pub struct HttpError(pub ApiError);

impl From<ApiError> for HttpError {
    fn from(error: ApiError) -> Self {
        Self(error)
    }
}

impl From<CommandError> for HttpError {
    fn from(error: CommandError) -> Self {
        Self(error.into())
    }
}

impl IntoResponse for HttpError {
    fn into_response(self) -> Response {
        response(ErrorShape::OpenAi, self.0)
    }
}

#[cfg(test)]
mod tests {
    use iop_proto::ErrorCode;

    use super::*;

    #[test]
    fn every_error_names_its_reason_in_every_shape() {
        let e = ApiError::of(ErrorCode::QueueFull, "full")
            .with_retry_after(1)
            .with_attempts(0);
        let r = response(ErrorShape::Anthropic, e);
        assert_eq!(r.status(), 429);
        assert_eq!(r.headers()[header::RETRY_AFTER], "1");
        assert_eq!(r.headers()[ERROR_HEADER], "queue_full");
        assert!(r.headers().get(ATTEMPTS_HEADER).is_none());
        // Validation errors keep their exact code, under the `bad_request` reason.
        let e = ApiError::bad_request("missing_messages", "x").with_attempts(2);
        let r = HttpError(e).into_response();
        assert_eq!(r.headers()[ERROR_HEADER], "bad_request");
        assert_eq!(r.headers()[ATTEMPTS_HEADER], "2");
        let r = response(
            ErrorShape::Ollama,
            ApiError::of(ErrorCode::RequestsPerMinuteExceeded, "slow down"),
        );
        assert_eq!(r.headers()[ERROR_HEADER], "requests_per_minute_exceeded");
    }
}
