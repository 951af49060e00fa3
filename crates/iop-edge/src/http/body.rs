//! Reading a request's body: its `Content-Type` must be JSON (a body without one is read
//! as JSON; on Ollama's API any is, as Ollama's own server does), and a body that could
//! not be read is a 413 (over `limits.max_body_bytes`), a 408 (too slow) or a 400.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{FromRequest, Request};
use axum::http::{HeaderMap, StatusCode, header};
use iop_proto::ErrorCode;

use super::deadlines;
use crate::canonical::ApiError;
use crate::http::error::HttpError;
use crate::service::Edge;

/// Refuses a body whose `Content-Type` is not JSON (`application/json` or `…+json`) with
/// 415. A request without a `Content-Type` is read as JSON.
pub fn require_json(headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(value) = headers.get(header::CONTENT_TYPE) else {
        return Ok(());
    };
    let essence = value
        .to_str()
        .unwrap_or("")
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    if essence == "application/json"
        || (essence.starts_with("application/") && essence.ends_with("+json"))
    {
        return Ok(());
    }
    Err(ApiError::of(
        ErrorCode::UnsupportedMediaType,
        format!(
            "the request body must be JSON, sent with `Content-Type: application/json` (got {:?})",
            value.to_str().unwrap_or("(not text)")
        ),
    ))
}

/// A body that could not be read: too large (413), too slow (408) or broken.
pub fn body_error(rejection: BytesRejection, edge: &Edge) -> ApiError {
    if let Some(timeout) = find_cause::<deadlines::BodyError>(&rejection)
        .filter(|e| matches!(e, deadlines::BodyError::Timeout(_)))
    {
        return ApiError::of(ErrorCode::RequestTimeout, timeout.to_string());
    }
    if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
        ApiError::of(
            ErrorCode::RequestTooLarge,
            format!(
                "the request body is larger than this edge's limit of {} bytes (limits.max_body_bytes)",
                edge.config().limits.max_body_bytes
            ),
        )
    } else {
        ApiError::bad_request(
            "invalid_body",
            format!("could not read the request body: {rejection}"),
        )
    }
}

/// The first error of type `E` in `error`'s chain of sources.
fn find_cause<'a, E: std::error::Error + 'static>(
    error: &'a (dyn std::error::Error + 'static),
) -> Option<&'a E> {
    let mut current = Some(error);
    while let Some(e) = current {
        if let Some(found) = e.downcast_ref::<E>() {
            return Some(found);
        }
        current = e.source();
    }
    None
}

/// The body of a JSON request, read whole within the limits. As an extractor it is
/// taken as `Result<JsonBody, HttpError>`, so that each endpoint answers a refusal in its
/// own API's error shape.
#[derive(Debug)]
pub struct JsonBody(pub Bytes);

impl JsonBody {
    /// Reads `request`'s body within the limits; with `any_content_type` (Ollama's API,
    /// whose own server reads a JSON body whatever its `Content-Type` says, as `curl -d`
    /// sends it) without looking at the `Content-Type`.
    pub async fn read(
        request: Request,
        edge: &Arc<Edge>,
        any_content_type: bool,
    ) -> Result<Self, ApiError> {
        if !any_content_type {
            require_json(request.headers())?;
        }
        let bytes = Bytes::from_request(request, edge)
            .await
            .map_err(|r| body_error(r, edge))?;
        Ok(JsonBody(bytes))
    }
}

impl FromRequest<Arc<Edge>> for JsonBody {
    type Rejection = HttpError;

    async fn from_request(request: Request, edge: &Arc<Edge>) -> Result<Self, HttpError> {
        Ok(Self::read(request, edge, false).await?)
    }
}

/// The body of a request to Ollama's API: JSON whatever its `Content-Type`.
#[derive(Debug)]
pub struct OllamaBody(pub Bytes);

impl FromRequest<Arc<Edge>> for OllamaBody {
    type Rejection = HttpError;

    async fn from_request(request: Request, edge: &Arc<Edge>) -> Result<Self, HttpError> {
        Ok(OllamaBody(JsonBody::read(request, edge, true).await?.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_json_content_types_are_accepted() {
        let with = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert(header::CONTENT_TYPE, v.parse().unwrap());
            require_json(&h)
        };
        assert!(with("application/json").is_ok());
        assert!(with("Application/JSON; charset=utf-8").is_ok());
        assert!(with("application/vnd.api+json").is_ok());
        assert!(require_json(&HeaderMap::new()).is_ok());
        for bad in [
            "text/plain",
            "application/x-www-form-urlencoded",
            "multipart/form-data",
        ] {
            assert_eq!(with(bad).unwrap_err().status, 415, "{bad}");
        }
    }
}
