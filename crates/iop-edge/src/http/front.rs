//! The front of the HTTP application: what every request goes through before its route,
//! applied once around the router: its request id ([`super::request_id`]), CORS
//! ([`super::cors`]), the body limit, and the drain ([`crate::drain`]: client requests
//! counted while in progress, new ones refused once the edge drains). As axum layers on
//! the router they would wrap every route instead, each layer costing a boxed service
//! cloned and a boxed future per request.

use std::convert::Infallible;
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::{DefaultBodyLimit, Request};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use tower_service::Service;
use tracing::Instrument;

use super::cors::{self, Decision};
use super::deadlines::Holding;
use super::request_id::{self, X_REQUEST_ID};
use crate::canonical::ApiError;
use crate::service::Edge;

/// The HTTP application: the routes behind the front.
#[derive(Clone)]
pub struct App {
    edge: Arc<Edge>,
    router: Router,
    body_limit: DefaultBodyLimit,
}

impl App {
    pub fn new(edge: Arc<Edge>) -> Self {
        let body_limit = DefaultBodyLimit::max(edge.config().limits.max_body_bytes);
        Self {
            router: super::routes::router(edge.clone()),
            edge,
            body_limit,
        }
    }

    /// Answers one request; every response carries the request's `x-request-id`. A client
    /// request counts as in progress until its response body ends; once a drain refuses new
    /// requests it is refused instead, and while the edge drains every response closes
    /// its connection.
    pub async fn serve(&self, mut request: Request) -> Response {
        let (id, span) = request_id::assign(&mut request);
        let path = request.uri().path();
        let mut response = if !crate::drain::counts(path) {
            self.route(request).instrument(span).await
        } else if self.edge.drain.is_refusing() && crate::drain::starts_work(request.method(), path)
        {
            draining(path)
        } else {
            let in_progress = self.edge.drain.started();
            let response = self.route(request).instrument(span).await;
            response.map(|body| Body::new(Holding::new(body, in_progress)))
        };
        response.headers_mut().insert(X_REQUEST_ID, id);
        if self.edge.drain.is_draining() {
            // The client's next request goes through a new connection: to another edge.
            response.headers_mut().insert(
                http::header::CONNECTION,
                http::HeaderValue::from_static("close"),
            );
        }
        response
    }

    async fn route(&self, mut request: Request) -> Response {
        let cors = cors::decide(
            &self.edge.config().http.cors,
            request.method(),
            request.headers(),
        );
        if let Decision::Preflight(headers) = cors {
            return (StatusCode::NO_CONTENT, headers).into_response();
        }
        self.body_limit.apply(&mut request);
        let mut router = self.router.clone();
        let result: Result<Response, Infallible> = router.call(request).await;
        let mut response = result.unwrap_or_else(|never| match never {});
        if let Decision::Decorate(headers) = cors {
            cors::decorate(headers, &mut response);
        }
        response
    }
}

/// The answer to a client request that arrives while the edge drains: 503 in its API's
/// shape, to be sent again (to another edge, or to this one once it is back).
fn draining(path: &str) -> Response {
    let e = ApiError::of(
        iop_proto::ErrorCode::Unavailable,
        "this edge is shutting down and takes no new requests: send it again (to another \
         edge, or to this one once it is back)",
    )
    .with_detail("edge_draining")
    .with_retry_after(1);
    super::error::response(super::error::shape_of(path), e)
}
