//! The edge's HTTP server: the OpenAI-compatible surface, the native runs API and the
//! admin endpoints on one listener, with optional bearer-key auth, a body size limit and
//! optional TLS.

pub mod admin;
pub mod error;
pub mod openai;
pub mod passthrough;
pub mod render;
pub mod request;
pub mod runs;
pub mod tls;
pub mod trust;

use std::sync::Arc;

use axum::Router;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::serve::ListenerExt;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use tokio::net::TcpListener;

use crate::service::Edge;
use error::ApiError;

/// The whole HTTP application.
pub fn router(edge: Arc<Edge>) -> Router {
    let protected = openai::routes()
        .merge(runs::routes())
        .merge(admin::protected_routes())
        .route_layer(middleware::from_fn_with_state(
            edge.clone(),
            require_api_key,
        ));
    Router::new()
        .merge(protected)
        .merge(admin::open_routes())
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(edge.config().limits.max_body_bytes))
        .with_state(edge)
}

/// Serves HTTP on `listener` until the edge shuts down; HTTPS with `tls`.
pub async fn serve_http(
    edge: Arc<Edge>,
    listener: TcpListener,
    tls: Option<Arc<tls::HttpTls>>,
) -> std::io::Result<()> {
    let shutdown = edge.shutdown_token().clone();
    if let Some(tls) = tls {
        return axum::serve(tls::TlsListener::new(listener, tls), router(edge))
            .with_graceful_shutdown(async move { shutdown.cancelled().await })
            .await;
    }
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, router(edge))
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await
}

async fn require_api_key(State(edge): State<Arc<Edge>>, request: Request, next: Next) -> Response {
    let keys = edge.api_keys();
    if keys.is_empty() {
        return next.run(request).await;
    }
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
        });
    let Some(presented) = presented else {
        return ApiError::unauthorized("missing API key: send it as `Authorization: Bearer <key>`")
            .into_response();
    };
    let digest: [u8; 32] = Sha256::digest(presented.trim().as_bytes()).into();
    let mut ok = false;
    for key in keys.iter() {
        ok |= bool::from(key.ct_eq(&digest));
    }
    if !ok {
        return ApiError::unauthorized("incorrect API key provided").into_response();
    }
    next.run(request).await
}

async fn not_found(request: Request) -> Response {
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

/// A body that could not be read: too large (413) or broken.
pub(crate) fn body_error(rejection: BytesRejection, edge: &Edge) -> ApiError {
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
