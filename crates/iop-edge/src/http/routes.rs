//! The routes of the HTTP application: which endpoints exist, behind which checks (the
//! caller's key, the admin role), and the answers for an unknown path or a method a path
//! does not take, in the error shape of the API the path belongs to.

use std::sync::Arc;

use axum::Router;
use axum::extract::Request;
use axum::middleware;
use axum::response::Response;

use super::error::{self, shape_of};
use super::{admin, auth, count_tokens, decode, model, models, ollama, ollama_models, runs};
use crate::canonical::ApiError;
use crate::service::Edge;

/// The routes of the HTTP application ([`super::front::App`] puts them behind the request id,
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
