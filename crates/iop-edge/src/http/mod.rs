//! The edge's HTTP server: the OpenAI-compatible surface, the Anthropic Messages API, the
//! Ollama API, the native runs API and the admin endpoints on one listener ([`server`],
//! HTTPS when `http_tls` is set: [`tls`]), with bearer-key auth and roles ([`auth`]),
//! connection deadlines ([`deadlines`]) and a body size limit. Every response carries the
//! request's `x-request-id` ([`request_id`]); browsers get CORS when it is configured
//! ([`cors`]); both, and the body limit, are applied in front of the routes ([`front`]).
//!
//! Routes come in three kinds: the probes and the status page ([`ui`], which holds no data
//! and reads the admin endpoints with a key it asks for) are open; the OpenAI (chat, completions,
//! embeddings, Responses), Anthropic Messages ([`apis`]), Ollama ([`ollama_api`]) and runs
//! APIs take any key; `/admin/*` (node credentials too: [`trust`]), `/metrics` and node
//! commands take admin keys only. On an edge without keys every route is open.

pub mod admin;
pub mod apis;
pub mod auth;
pub mod chat_input;
pub mod cors;
pub mod deadlines;
pub mod error;
pub mod forward;
pub mod front;
pub mod model_dispatch;
pub mod models;
pub mod ollama_api;
pub mod openai;
pub mod passthrough;
pub mod render;
pub mod request;
pub mod request_id;
pub mod runs;
pub mod server;
pub mod stream_usage;
pub mod tls;
pub mod trust;
pub mod ui;
pub mod usage;

use std::sync::Arc;

use axum::Router;
use axum::extract::Request;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use axum::middleware;
use axum::response::{IntoResponse, Response};

use crate::service::Edge;
use error::ApiError;
pub use front::App;
pub use server::serve_http;

/// The routes of the HTTP application ([`front::App`] puts them behind the request id,
/// CORS and the body limit).
pub fn router(edge: Arc<Edge>) -> Router {
    let admin = admin::admin_routes()
        .merge(runs::admin_routes())
        .merge(usage::routes())
        .route_layer(middleware::from_fn(auth::require_admin));
    let authenticated = openai::routes()
        .merge(apis::responses_routes())
        .merge(models::routes())
        .merge(ollama_api::routes())
        .merge(runs::routes())
        .merge(admin)
        .route_layer(middleware::from_fn_with_state(
            edge.clone(),
            auth::authenticate,
        ));
    // Anthropic's clients send their key as `x-api-key` and read errors in their shape.
    let anthropic = apis::messages_routes().route_layer(middleware::from_fn_with_state(
        edge.clone(),
        auth::authenticate_anthropic,
    ));
    Router::new()
        .merge(authenticated)
        .merge(anthropic)
        .merge(admin::open_routes())
        .merge(ui::routes())
        .fallback(not_found)
        .with_state(edge)
}

async fn not_found(request: Request) -> Response {
    let path = request.uri().path();
    if ollama_api::is_ollama_path(path) {
        return ollama_api::error::response(ApiError::not_found(
            "unknown_url",
            format!("unknown endpoint: {} {path}", request.method()),
        ));
    }
    ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        "unknown_url",
        format!(
            "unknown endpoint: {} {}",
            request.method(),
            request.uri().path()
        ),
    )
    .into_response()
}

/// A body that could not be read: too large (413), too slow (408) or broken.
pub(crate) fn body_error(rejection: BytesRejection, edge: &Edge) -> ApiError {
    if let Some(timeout) = find_cause::<deadlines::BodyError>(&rejection)
        .filter(|e| matches!(e, deadlines::BodyError::Timeout(_)))
    {
        return ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            "request_timeout",
            timeout.to_string(),
        );
    }
    if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            "request_too_large",
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

#[cfg(test)]
mod tests {
    use axum::body::Body;
    use axum::http::{Request, StatusCode};
    use tower_service::Service;

    use crate::EdgeConfig;
    use crate::service::Edge;

    const KEYS: &str = r#"
auth:
  keys:
    - {name: ops, role: admin, key: admin-key-0123456789}
    - {name: alice, role: client, key: alice-key-0123456789}
"#;

    async fn status_of(yaml: &str, method: &str, path: &str, key: Option<&str>) -> StatusCode {
        let edge = Edge::new(EdgeConfig::from_yaml(yaml, "test").unwrap());
        let mut router = super::router(edge);
        let mut request = Request::builder().method(method).uri(path);
        if let Some(key) = key {
            request = request.header("authorization", format!("Bearer {key}"));
        }
        let request = request.body(Body::empty()).unwrap();
        router.call(request).await.unwrap().status()
    }

    #[tokio::test]
    async fn routes_answer_by_role() {
        let admin = Some("admin-key-0123456789");
        let alice = Some("alice-key-0123456789");
        for path in ["/admin/status", "/metrics", "/v1/nodes/n1/commands/usage"] {
            assert_eq!(status_of(KEYS, "GET", path, alice).await, 403, "{path}");
            assert_eq!(status_of(KEYS, "GET", path, None).await, 401, "{path}");
            assert_eq!(
                status_of(KEYS, "GET", path, Some("wrong-key-0123456789")).await,
                401,
                "{path}"
            );
        }
        // The node credential endpoints are admin-only too.
        for (method, path) in [
            ("GET", "/admin/join-tokens"),
            ("POST", "/admin/join-tokens"),
            ("DELETE", "/admin/join-tokens/0123456789abcdef"),
            ("POST", "/admin/nodes/n1/revoke"),
        ] {
            assert_eq!(status_of(KEYS, method, path, alice).await, 403, "{path}");
            assert_eq!(status_of(KEYS, method, path, None).await, 401, "{path}");
            let as_admin = status_of(KEYS, method, path, admin).await;
            assert!(
                as_admin != 401 && as_admin != 403,
                "{method} {path}: {as_admin}"
            );
        }
        assert_eq!(status_of(KEYS, "GET", "/admin/status", admin).await, 200);
        assert_eq!(status_of(KEYS, "GET", "/metrics", admin).await, 200);
        assert_eq!(status_of(KEYS, "GET", "/v1/models", alice).await, 200);
        assert_eq!(status_of(KEYS, "GET", "/healthz", None).await, 200);
        // The status page holds no data: it is open, its data is not.
        assert_eq!(status_of(KEYS, "GET", "/ui", None).await, 200);
        assert_eq!(
            status_of(KEYS, "POST", "/v1/runs/nope/cancel", alice).await,
            404
        );
        // Without keys everything is open.
        assert_eq!(status_of("{}", "GET", "/admin/status", None).await, 200);
        assert_eq!(status_of("{}", "GET", "/metrics", None).await, 200);
    }
}
