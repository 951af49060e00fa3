//! The edge's HTTP server: plumbing around the service. One listener ([`server`], HTTPS
//! when `http_tls` is set: [`tls`]) with connection deadlines ([`deadlines`]); in front of
//! the routes ([`front`]) every response gets the request's `x-request-id`
//! ([`request_id`]), browsers get CORS when it is configured ([`cors`]) and bodies are
//! bounded. Then:
//!
//! - [`auth`]: the bearer key (`x-api-key` too on Anthropic's route) becomes the request's
//!   caller; wrong keys are throttled per address;
//! - [`model`]: the one handler of every model endpoint of every API (decode, admit,
//!   serve, render: `surfaces` and `service` do the work), with [`answer`] rendering
//!   canonical answers and [`passthrough`] relaying a provider's own bytes;
//! - [`runs`]: the native runs API; [`models`] and [`ollama`]: the model catalogs;
//! - [`admin`]: status, metrics, usage, node credentials, node commands, and
//!   [`ollama_models`]: Ollama's model management across the fleet (admin keys only);
//!   and the open probes and status page.
//!
//! On an edge without keys every route is open. Errors render in the shape of the API a
//! request was for ([`error`]).

pub mod admin;
pub mod answer;
pub mod auth;
pub mod body;
pub mod client_addr;
pub mod connection_table;
pub mod cors;
pub mod count_tokens;
pub mod deadlines;
pub mod decode;
pub mod error;
pub mod forward;
pub mod front;
pub mod model;
pub mod models;
pub mod ollama;
pub mod ollama_models;
pub mod passthrough;
pub mod request_id;
pub mod runs;
pub mod server;
pub mod tls;

use std::sync::Arc;

use axum::Router;
use axum::extract::Request;
use axum::middleware;
use axum::response::Response;

use crate::canonical::ApiError;
use crate::service::Edge;
use crate::surfaces::ErrorShape;
pub use front::App;
pub use server::serve_http;

/// The routes of the HTTP application ([`front::App`] puts them behind the request id,
/// CORS and the body limit).
pub fn router(edge: Arc<Edge>) -> Router {
    let admin = admin::admin_routes()
        .merge(ollama_models::routes())
        .route_layer(middleware::from_fn(auth::require_admin));
    // One count of large bodies for every endpoint that reads a request body to decode.
    let large = decode::LargeBodies::new(&edge.config().limits.http);
    let authenticated = model::routes(large.clone())
        .merge(count_tokens::routes(large.clone()))
        .merge(models::routes())
        .merge(ollama::routes())
        .merge(runs::routes(large))
        .merge(admin)
        .route_layer(middleware::from_fn_with_state(
            edge.clone(),
            auth::authenticate,
        ));
    Router::new()
        .merge(authenticated)
        .merge(admin::open_routes())
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(edge)
}

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

async fn not_found(request: Request) -> Response {
    let path = request.uri().path();
    let e = ApiError::not_found(
        "unknown_url",
        format!("unknown endpoint: {} {path}", request.method()),
    );
    error::response(shape_of(path), e)
}

/// A known path asked with a method it does not serve: 405 in its API's error shape.
async fn method_not_allowed(request: Request) -> Response {
    let path = request.uri().path();
    let mut e = ApiError::bad_request(
        "method_not_allowed",
        format!("{path} does not take {} requests", request.method()),
    );
    e.status = axum::http::StatusCode::METHOD_NOT_ALLOWED;
    error::response(shape_of(path), e)
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
        // Clients check the endpoint with `HEAD /` before their first request.
        assert_eq!(status_of(KEYS, "HEAD", "/", None).await, 200);
        assert_eq!(status_of(KEYS, "GET", "/", None).await, 200);
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
