//! The native runs API: submit a run to an adapter on a node and stream its `RunEvent`s
//! as SSE (one `event:` per RunEvent, ending with exactly one terminal), cancel a run,
//! terminate a logical session, and run node commands.

use std::collections::HashMap;
use std::sync::Arc;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use futures::stream;
use iop_proto::pb;
use serde::Deserialize;
use serde_json::{Value, json};

use super::error::ApiError;
use crate::service::run::kind_name;
use crate::service::{Edge, RunSpec};

pub fn routes() -> Router<Arc<Edge>> {
    Router::new()
        .route("/v1/runs", post(submit))
        .route("/v1/runs/{run_id}/cancel", post(cancel))
        .route(
            "/v1/sessions/{node}/{adapter}/{target}/{session_id}",
            delete(terminate_session),
        )
        .route("/v1/nodes/{node}/commands/{name}", get(command))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RunBody {
    adapter: String,
    #[serde(default)]
    target: String,
    #[serde(default)]
    input: String,
    #[serde(default)]
    messages: Vec<MessageBody>,
    #[serde(default)]
    node: Option<String>,
    #[serde(default)]
    session_id: Option<String>,
    #[serde(default)]
    background: bool,
    #[serde(default)]
    max_tokens: Option<u32>,
    #[serde(default)]
    temperature: Option<f32>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct MessageBody {
    role: String,
    content: String,
}

async fn submit(
    State(edge): State<Arc<Edge>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body.map_err(|r| super::body_error(r, &edge))?;
    let request: RunBody = serde_json::from_slice(&body).map_err(|e| {
        ApiError::bad_request("invalid_request", format!("invalid run request: {e}"))
    })?;
    if request.adapter.is_empty() {
        return Err(ApiError::bad_request(
            "missing_adapter",
            "`adapter` must name an adapter of the node",
        ));
    }
    if request.input.is_empty() && request.messages.is_empty() {
        return Err(ApiError::bad_request(
            "missing_input",
            "give `input` or `messages`",
        ));
    }
    let spec = RunSpec {
        adapter: request.adapter,
        target: request.target,
        input: request.input,
        messages: request
            .messages
            .into_iter()
            .map(|m| pb::ChatMessage {
                role: m.role,
                content: m.content,
            })
            .collect(),
        options: Some(pb::GenerationOptions {
            max_tokens: request.max_tokens,
            temperature: request.temperature,
            ..Default::default()
        }),
        session_id: request.session_id.unwrap_or_default(),
        background: request.background,
    };
    let run = edge.submit_run(request.node.as_deref(), spec).await?;
    let run_id = run.run_id().to_string();
    let node_id = run.node_id().to_string();
    let body = stream::unfold(run, |mut run| async move {
        let event = run.next().await?;
        Some((Ok::<_, std::io::Error>(sse_event(&event)), run))
    });
    let mut response = (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(body),
    )
        .into_response();
    let headers = response.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&run_id) {
        headers.insert("x-iop-run-id", v);
    }
    if let Ok(v) = HeaderValue::from_str(&node_id) {
        headers.insert("x-iop-node", v);
    }
    Ok(response)
}

/// A RunEvent as JSON.
pub fn event_json(e: &pb::RunEvent) -> Value {
    let mut v = json!({"run_id": e.run_id, "seq": e.seq, "kind": kind_name(e.kind())});
    if !e.text.is_empty() {
        v["text"] = json!(e.text);
    }
    if !e.model.is_empty() {
        v["model"] = json!(e.model);
    }
    if !e.finish_reason.is_empty() {
        v["finish_reason"] = json!(e.finish_reason);
    }
    if let Some(u) = &e.usage {
        let mut usage = json!({"input_tokens": u.input_tokens, "output_tokens": u.output_tokens});
        if let Some(r) = u.reasoning_tokens {
            usage["reasoning_tokens"] = json!(r);
        }
        if let Some(c) = u.cached_input_tokens {
            usage["cached_input_tokens"] = json!(c);
        }
        v["usage"] = usage;
    }
    if let Some(err) = &e.error {
        v["error"] = json!({"code": err.code, "message": err.message});
    }
    v
}

fn sse_event(e: &pb::RunEvent) -> Bytes {
    Bytes::from(format!(
        "event: {}\ndata: {}\n\n",
        kind_name(e.kind()),
        event_json(e)
    ))
}

async fn cancel(
    State(edge): State<Arc<Edge>>,
    Path(run_id): Path<String>,
) -> Result<Response, ApiError> {
    edge.cancel_run(&run_id).await?;
    Ok(axum::Json(json!({"run_id": run_id, "cancelled": true})).into_response())
}

async fn terminate_session(
    State(edge): State<Arc<Edge>>,
    Path((node, adapter, target, session_id)): Path<(String, String, String, String)>,
) -> Result<Response, ApiError> {
    edge.terminate_session(&node, &adapter, &target, &session_id)
        .await?;
    Ok(axum::Json(json!({
        "node": node, "adapter": adapter, "target": target, "session_id": session_id, "terminated": true
    }))
    .into_response())
}

async fn command(
    State(edge): State<Arc<Edge>>,
    Path((node, name)): Path<(String, String)>,
    Query(mut args): Query<HashMap<String, String>>,
) -> Result<Response, ApiError> {
    let adapter = args.remove("adapter").unwrap_or_default();
    let result = edge.node_command(&node, &name, &adapter, args).await?;
    Ok(axum::Json(result).into_response())
}
