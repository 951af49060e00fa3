//! The OpenAI-compatible surface: `GET /v1/models`, `POST /v1/chat/completions`,
//! `POST /v1/completions`, `POST /v1/embeddings`.
//!
//! `model` names a model group. The edge takes a slot on one member, rewrites `model` to the
//! member's upstream name and dispatches by the member provider's kind: OpenAI-compatible
//! and vLLM providers get the request through the raw tunnel (their response bytes pass
//! through untouched); Ollama, CLI and mock providers get a normalized run whose events
//! the edge renders as OpenAI JSON or SSE. Nothing in the client's request picks the path.

use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use iop_proto::pb;
use serde_json::value::RawValue;
use serde_json::{Map, Value, json};

use super::error::ApiError;
use super::request::ClientRequest;
use super::{passthrough, render};
use crate::lease::Lane;
use crate::service::{Edge, Observe, RunSpec, TunnelSpec};

pub fn routes() -> Router<Arc<Edge>> {
    Router::new()
        .route("/v1/models", get(list_models))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/embeddings", post(embeddings))
}

/// Which OpenAI operation a request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    Chat,
    Completion,
    Embedding,
}

impl Operation {
    /// The path below the provider's API root.
    fn provider_path(self) -> &'static str {
        match self {
            Operation::Chat => "/chat/completions",
            Operation::Completion => "/completions",
            Operation::Embedding => "/embeddings",
        }
    }
}

async fn list_models(State(edge): State<Arc<Edge>>) -> Response {
    let data: Vec<Value> = edge
        .config()
        .model_groups
        .iter()
        .map(|g| json!({"id": g.name, "object": "model", "created": 0, "owned_by": "iop"}))
        .collect();
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

async fn chat_completions(
    State(edge): State<Arc<Edge>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    respond(&edge, Operation::Chat, body).await
}

async fn completions(
    State(edge): State<Arc<Edge>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    respond(&edge, Operation::Completion, body).await
}

async fn embeddings(
    State(edge): State<Arc<Edge>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    respond(&edge, Operation::Embedding, body).await
}

async fn respond(edge: &Arc<Edge>, op: Operation, body: Result<Bytes, BytesRejection>) -> Response {
    match handle(edge, op, body).await {
        Ok(response) => response,
        Err((group, err)) => {
            edge.metrics.count_request(&group, "none", &err.code);
            err.into_response()
        }
    }
}

/// Parses, admits and dispatches one request. Errors carry the model group for metrics.
async fn handle(
    edge: &Arc<Edge>,
    op: Operation,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, (String, ApiError)> {
    let unknown = |e: ApiError| (String::new(), e);
    let body = body.map_err(|r| unknown(super::body_error(r, edge)))?;
    let request = ClientRequest::parse(&body).map_err(unknown)?;
    let group = match request.get::<String>("model") {
        Some(m) if !m.is_empty() => m,
        Some(_) => {
            return Err(unknown(ApiError::bad_request(
                "invalid_model",
                "`model` must be a non-empty string",
            )));
        }
        None if request.has("model") => {
            return Err(unknown(ApiError::bad_request(
                "invalid_model",
                "`model` must be a non-empty string",
            )));
        }
        None => {
            return Err(unknown(ApiError::bad_request(
                "missing_model",
                "you must provide a `model` parameter",
            )));
        }
    };
    let fail = |e: ApiError| (group.clone(), e);
    let policy = edge.admission.policy(&group).ok_or_else(|| {
        fail(ApiError::not_found(
            "model_not_found",
            format!(
                "the model `{group}` does not exist; GET /v1/models lists the models served here"
            ),
        ))
    })?;
    validate(&request, op).map_err(fail)?;
    let stream = op != Operation::Embedding && request.get::<bool>("stream").unwrap_or(false);
    let lane = match policy.long_context_tokens {
        Some(threshold) if estimate_context_tokens(&request, op) >= threshold => Lane::Long,
        _ => Lane::Normal,
    };
    let (admitted, session) = edge
        .admit_group(&group, lane)
        .await
        .map_err(|e| fail(e.into()))?;
    let grant = admitted.grant.clone();
    let provider = edge.provider(&grant.node, &grant.provider).ok_or_else(|| {
        fail(ApiError::new(
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "model_unavailable",
            format!(
                "provider {}/{} was removed from the configuration",
                grant.node, grant.provider
            ),
        ))
    })?;
    let observe = Observe {
        model_group: group.clone(),
        node_id: grant.node.to_string(),
        provider_id: grant.provider.to_string(),
    };
    if provider.kind.is_tunnel() {
        let body = request.with_model(&grant.upstream_model);
        let accept = if stream {
            "text/event-stream"
        } else {
            "application/json"
        };
        let spec = TunnelSpec {
            adapter: provider.id.clone(),
            method: "POST".into(),
            path: op.provider_path().into(),
            headers: vec![
                header("content-type", "application/json"),
                header("accept", accept),
            ],
            body: body.into(),
        };
        let tunnel = edge
            .start_tunnel(session, spec, Some(admitted.guard), Some(observe))
            .await
            .map_err(|e| fail(e.into()))?;
        let response = passthrough::respond(tunnel).await.map_err(fail)?;
        edge.metrics.count_request(&group, "tunnel", "ok");
        return Ok(response);
    }
    if op == Operation::Embedding {
        return Err(fail(ApiError::bad_request(
            "unsupported_operation",
            format!(
                "model `{group}` is served by a {} provider; embeddings are served by openai_compat and vllm providers only",
                provider.kind.as_str()
            ),
        )));
    }
    let request = request.to_map();
    let spec = run_spec(&request, op, &provider.id, &grant.upstream_model);
    let include_usage = request
        .get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let mut run = edge
        .start_run(session, spec, Some(admitted.guard), Some(observe))
        .await
        .map_err(|e| fail(e.into()))?;
    let first = render::first_event(&mut run).await.map_err(fail)?;
    let shape = render::Shape {
        op,
        model: group.clone(),
        include_usage,
    };
    let response = if stream {
        render::sse(run, first, shape)
    } else {
        render::json(run, first, shape).await.map_err(fail)?
    };
    edge.metrics.count_request(&group, "run", "ok");
    Ok(response)
}

fn header(name: &str, value: &str) -> pb::Header {
    pb::Header {
        name: name.into(),
        value: value.as_bytes().to_vec(),
    }
}

/// The parameters the edge itself relies on, checked so a mistake gets a 400 here rather
/// than an opaque failure upstream.
fn validate(request: &ClientRequest, op: Operation) -> Result<(), ApiError> {
    let text_or_array = |key: &str| {
        request.raw(key).is_some_and(|raw| {
            matches!(raw.get().trim_start().as_bytes().first(), Some(b'"' | b'['))
        })
    };
    match op {
        Operation::Chat => match request.get::<Vec<&RawValue>>("messages") {
            Some(m) if !m.is_empty() => Ok(()),
            _ if request.has("messages") => Err(ApiError::bad_request(
                "invalid_messages",
                "`messages` must be a non-empty array",
            )),
            _ => Err(ApiError::bad_request(
                "missing_messages",
                "you must provide a `messages` parameter",
            )),
        },
        Operation::Completion if text_or_array("prompt") => Ok(()),
        Operation::Completion => Err(ApiError::bad_request(
            "missing_prompt",
            "you must provide a `prompt` string or array",
        )),
        Operation::Embedding if text_or_array("input") => Ok(()),
        Operation::Embedding => Err(ApiError::bad_request(
            "missing_input",
            "you must provide an `input` string or array",
        )),
    }?;
    if request.has("stream") && request.get::<Option<bool>>("stream").is_none() {
        return Err(ApiError::bad_request(
            "invalid_stream",
            "`stream` must be a boolean",
        ));
    }
    Ok(())
}

/// Cheap context estimate deciding the lane: characters of the prompt / 4 (about one token
/// per four characters of English) plus the requested `max_tokens`.
pub fn estimate_context_tokens(request: &ClientRequest, op: Operation) -> u64 {
    let chars: usize = match op {
        Operation::Chat => request
            .value("messages")
            .as_array()
            .map(|messages| {
                messages
                    .iter()
                    .map(|m| content_text(m.get("content")).chars().count())
                    .sum()
            })
            .unwrap_or(0),
        Operation::Completion => text_of(Some(&request.value("prompt"))).chars().count(),
        Operation::Embedding => text_of(Some(&request.value("input"))).chars().count(),
    };
    let max_tokens = request
        .get::<u64>("max_completion_tokens")
        .or_else(|| request.get::<u64>("max_tokens"))
        .unwrap_or(0);
    (chars as u64).div_ceil(4) + max_tokens
}

/// The text of a message's `content`: a string, or the text parts of an array.
fn content_text(content: Option<&Value>) -> String {
    match content {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join(""),
        _ => String::new(),
    }
}

/// A string, or the strings of an array joined by newlines.
fn text_of(value: Option<&Value>) -> String {
    match value {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(items)) => items
            .iter()
            .filter_map(Value::as_str)
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

/// The normalized run for a non-tunnel provider.
fn run_spec(
    request: &Map<String, Value>,
    op: Operation,
    adapter: &str,
    upstream_model: &str,
) -> RunSpec {
    let (messages, input) = match op {
        Operation::Chat => {
            let messages = request
                .get("messages")
                .and_then(Value::as_array)
                .map(|ms| {
                    ms.iter()
                        .map(|m| pb::ChatMessage {
                            role: m
                                .get("role")
                                .and_then(Value::as_str)
                                .unwrap_or("user")
                                .to_string(),
                            content: content_text(m.get("content")),
                        })
                        .collect()
                })
                .unwrap_or_default();
            (messages, String::new())
        }
        _ => (Vec::new(), text_of(request.get("prompt"))),
    };
    let stop = match request.get("stop") {
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(Value::as_str)
            .map(String::from)
            .collect(),
        _ => Vec::new(),
    };
    let options = pb::GenerationOptions {
        max_tokens: request
            .get("max_completion_tokens")
            .or_else(|| request.get("max_tokens"))
            .and_then(Value::as_u64)
            .map(|n| n.min(u32::MAX as u64) as u32),
        temperature: request
            .get("temperature")
            .and_then(Value::as_f64)
            .map(|t| t as f32),
        top_p: request
            .get("top_p")
            .and_then(Value::as_f64)
            .map(|t| t as f32),
        stop,
        seed: request.get("seed").and_then(Value::as_u64),
    };
    RunSpec {
        adapter: adapter.to_string(),
        target: upstream_model.to_string(),
        input,
        messages,
        options: Some(options),
        session_id: String::new(),
        background: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    fn estimate(v: Value, op: Operation) -> u64 {
        let body = v.to_string();
        estimate_context_tokens(&ClientRequest::parse(body.as_bytes()).unwrap(), op)
    }

    fn check(v: Value, op: Operation) -> Result<(), ApiError> {
        let body = v.to_string();
        validate(&ClientRequest::parse(body.as_bytes()).unwrap(), op)
    }

    #[test]
    fn estimate_counts_prompt_characters_and_max_tokens() {
        let r = json!({"messages": [{"role": "user", "content": "abcdefgh"}], "max_tokens": 10});
        assert_eq!(estimate(r, Operation::Chat), 12);
        let r =
            json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "abcd"}]}]});
        assert_eq!(estimate(r, Operation::Chat), 1);
        let r = json!({"prompt": "abcde", "max_completion_tokens": 1});
        assert_eq!(estimate(r, Operation::Completion), 3);
    }

    #[test]
    fn validation_names_the_parameter() {
        let e = check(json!({"model": "m"}), Operation::Chat).unwrap_err();
        assert!(e.message.contains("messages"));
        let e = check(json!({"model": "m", "messages": []}), Operation::Chat).unwrap_err();
        assert!(e.message.contains("non-empty"));
        let e = check(
            json!({"model": "m", "messages": [{}], "stream": "yes"}),
            Operation::Chat,
        )
        .unwrap_err();
        assert!(e.message.contains("stream"));
        assert!(check(json!({"messages": [{}], "stream": null}), Operation::Chat).is_ok());
        assert!(check(json!({"input": "x"}), Operation::Embedding).is_ok());
        assert!(check(json!({"input": 3}), Operation::Embedding).is_err());
    }

    #[test]
    fn run_spec_carries_messages_and_options() {
        let r = map(json!({
            "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
            "max_tokens": 5, "temperature": 0.5, "stop": "x", "seed": 3
        }));
        let spec = run_spec(&r, Operation::Chat, "ollama", "llama3");
        assert_eq!(spec.messages.len(), 2);
        assert_eq!(spec.messages[0].role, "system");
        let o = spec.options.unwrap();
        assert_eq!(o.max_tokens, Some(5));
        assert_eq!(o.stop, vec!["x".to_string()]);
        assert_eq!(o.seed, Some(3));
        assert_eq!(spec.target, "llama3");
    }
}
