//! Fleet model jobs for admins: `POST /admin/models/pull` (`{"model", "node"?,
//! "provider"?}`) starts a pull on the selected Ollama providers and answers 202 with the
//! job at once; `GET /admin/jobs` lists the running and recent jobs, `GET
//! /admin/jobs/{id}` one, and `GET /admin/jobs/{id}/events` follows it as SSE — one
//! `progress` event per new progress line or target end (Ollama's NDJSON objects, naming
//! `node` and `provider`), then an `end` event with the outcome. `GET /admin/models`
//! lists the models each Ollama provider holds, as the edge last asked.

use std::sync::Arc;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::StreamExt;
use serde::Deserialize;
use serde_json::json;

use crate::canonical::ApiError;
use crate::http::error::HttpError;
use crate::http::ollama_models::{Selector, targets};
use crate::service::Edge;
use crate::service::model_jobs::job_lines;

pub fn routes() -> Router<Arc<Edge>> {
    Router::new()
        .route("/admin/models", get(models))
        .route("/admin/models/pull", post(pull))
        .route("/admin/jobs", get(list))
        .route("/admin/jobs/{id}", get(one))
        .route("/admin/jobs/{id}/events", get(events))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PullBody {
    model: String,
    #[serde(default)]
    node: Option<String>,
    #[serde(default)]
    provider: Option<String>,
}

async fn pull(
    State(edge): State<Arc<Edge>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, HttpError> {
    let body = body.map_err(|r| crate::http::body::body_error(r, &edge))?;
    let request: PullBody = serde_json::from_slice(&body).map_err(|e| {
        ApiError::bad_request("invalid_request", format!("invalid pull request: {e}"))
    })?;
    let selector = Selector {
        node: request.node,
        provider: request.provider,
    };
    let targets = targets(&edge, selector, &headers)?;
    let job = edge.start_pull_job(&request.model, targets);
    let job = job.borrow().clone();
    Ok((StatusCode::ACCEPTED, axum::Json(json!({"job": job}))).into_response())
}

async fn list(State(edge): State<Arc<Edge>>) -> Response {
    axum::Json(json!({"jobs": edge.provider_models.jobs.list()})).into_response()
}

fn unknown(id: &str) -> ApiError {
    ApiError::not_found(
        "job_not_found",
        format!("no model job {id:?} (the edge keeps the running ones and the last ended ones)"),
    )
}

async fn one(State(edge): State<Arc<Edge>>, Path(id): Path<String>) -> Result<Response, HttpError> {
    let job = edge
        .provider_models
        .jobs
        .watch(&id)
        .ok_or_else(|| unknown(&id))?;
    let job = job.borrow().clone();
    Ok(axum::Json(json!({"job": job})).into_response())
}

async fn events(
    State(edge): State<Arc<Edge>>,
    Path(id): Path<String>,
) -> Result<Response, HttpError> {
    let job = edge
        .provider_models
        .jobs
        .watch(&id)
        .ok_or_else(|| unknown(&id))?;
    let body = job_lines(job).map(|line| {
        let name = if line.get("node").is_some() {
            "progress"
        } else {
            "end"
        };
        Ok::<_, std::convert::Infallible>(Bytes::from(format!("event: {name}\ndata: {line}\n\n")))
    });
    Ok((
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(body),
    )
        .into_response())
}

async fn models(State(edge): State<Arc<Edge>>) -> Response {
    axum::Json(json!({"providers": edge.ollama_models()})).into_response()
}
