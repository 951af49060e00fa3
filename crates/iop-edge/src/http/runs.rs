//! The native runs API: submit a run to an adapter on a node and stream its `RunEvent`s
//! as SSE (one `event:` per RunEvent, ending with exactly one terminal), cancel a run,
//! terminate a logical session, and run node commands (admin only).
//!
//! A client key's runs and sessions are its own: cancelling another key's run answers 404
//! as for a run that does not exist, and the session ids it names live in its own
//! namespace. A key with a model allowlist may run only the adapters of its model groups.

use std::collections::HashMap;
use std::sync::Arc;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{Extension, Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use futures::stream;
use iop_proto::pb;
use serde::Deserialize;
use serde_json::{Value, json};

use super::error::ApiError;
use super::openai::MAX_TOKENS_LIMIT;
use super::request::{parse_typed, require_json};
use crate::auth::Caller;
use crate::service::run::kind_name;
use crate::service::{Edge, RunSpec};

/// Routes any key may use, for its own runs and sessions.
pub fn routes() -> Router<Arc<Edge>> {
    Router::new()
        .route("/v1/runs", post(submit))
        .route("/v1/runs/{run_id}/cancel", post(cancel))
        .route(
            "/v1/sessions/{node}/{adapter}/{target}/{session_id}",
            delete(terminate_session),
        )
}

/// Node commands: admin keys only.
pub fn admin_routes() -> Router<Arc<Edge>> {
    Router::new().route("/v1/nodes/{node}/commands/{name}", get(command))
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
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    require_json(&headers)?;
    let body = body.map_err(|r| super::body_error(r, &edge))?;
    let request: RunBody = parse_typed(&body)?;
    if request.adapter.is_empty() {
        return Err(ApiError::bad_request(
            "missing_adapter",
            "`adapter` must name an adapter of the node",
        )
        .with_param("adapter"));
    }
    if request.input.is_empty() && request.messages.is_empty() {
        return Err(
            ApiError::bad_request("missing_input", "give `input` or `messages`")
                .with_param("input"),
        );
    }
    if request
        .max_tokens
        .is_some_and(|n| u64::from(n) > MAX_TOKENS_LIMIT)
    {
        return Err(ApiError::invalid_param(
            "max_tokens",
            format!("`max_tokens` must be an integer from 0 to {MAX_TOKENS_LIMIT}"),
        ));
    }
    let node = match caller.allowed_models() {
        None => request.node.clone(),
        Some(models) => {
            // Resolve the node first: the allowlist names (node, adapter) pairs through
            // the members of the key's model groups.
            let node = edge.pick_node(request.node.as_deref())?.node_id.clone();
            let config = edge.config();
            let allowed = config
                .model_groups
                .iter()
                .filter(|g| models.contains(&g.name))
                .flat_map(|g| g.members.iter())
                .any(|m| m.node == node && m.provider == request.adapter);
            if !allowed {
                return Err(ApiError::forbidden(format!(
                    "this API key may not run adapter `{}` on node `{node}`: it is not a member of the key's model groups",
                    request.adapter
                )));
            }
            Some(node)
        }
    };
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
                ..Default::default()
            })
            .collect(),
        options: Some(pb::GenerationOptions {
            max_tokens: request.max_tokens,
            temperature: request.temperature,
            ..Default::default()
        }),
        session_id: caller.scoped_session_id(&request.session_id.unwrap_or_default()),
        background: request.background,
        owner: caller.owner(),
        client_request_id: super::request_id::of(&headers).to_string(),
        provider_headers: super::forward::provider_headers(&headers, &edge.config().http),
    };
    let run = edge.submit_run(node.as_deref(), spec).await?;
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
        v["error"] = json!({"code": err.error_code().as_str(), "message": err.message});
    }
    if !e.tool_calls.is_empty() {
        v["tool_calls"] = e
            .tool_calls
            .iter()
            .map(|c| json!({"id": c.id, "name": c.name, "arguments": c.arguments}))
            .collect();
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
    Extension(caller): Extension<Caller>,
    Path(run_id): Path<String>,
) -> Result<Response, ApiError> {
    edge.cancel_run(&run_id, &caller).await?;
    Ok(axum::Json(json!({"run_id": run_id, "cancelled": true})).into_response())
}

async fn terminate_session(
    State(edge): State<Arc<Edge>>,
    Extension(caller): Extension<Caller>,
    Path((node, adapter, target, session_id)): Path<(String, String, String, String)>,
) -> Result<Response, ApiError> {
    let scoped = caller.scoped_session_id(&session_id);
    edge.terminate_session(&node, &adapter, &target, &scoped)
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
