//! The OpenAI-compatible surface: `POST /v1/chat/completions`, `POST /v1/completions`,
//! `POST /v1/embeddings` (the model list is [`super::models`]).
//!
//! `model` names a model group. This layer parses and validates the request and renders
//! what the service's dispatcher returns: the dispatcher takes a slot on one member
//! (retrying on another when one fails before the response began) and sends the request
//! by the member provider's kind — OpenAI-compatible and vLLM providers get the client's
//! body through the raw tunnel with `model` rewritten to the member's upstream name (their
//! response bytes pass through untouched); Ollama, CLI and mock providers get a normalized
//! run whose events are rendered here as OpenAI JSON or SSE. Nothing in the client's
//! request picks the path. Responses of dispatched requests carry `x-iop-attempts`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Extension, State};
use axum::http::{HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use iop_proto::pb;
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use super::error::{ATTEMPTS_HEADER, ApiError};
use super::model_dispatch::{self, Started, Target, Work};
use super::request::{ClientRequest, WrongType, require_json};
use super::{chat_input, passthrough, render, stream_usage};
use crate::auth::Caller;
use crate::config::ProviderApi;
use crate::ledger::{ClientApi, RequestRecorder};
use crate::service::{
    Edge, LaneEstimate, LaneInputs, RunSpec, RunStream, TunnelSpec, TunnelStream,
};

pub fn routes() -> Router<Arc<Edge>> {
    Router::new()
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
        self.api().provider_path()
    }

    /// The provider API that serves it.
    pub fn api(self) -> ProviderApi {
        match self {
            Operation::Chat => ProviderApi::Chat,
            Operation::Completion => ProviderApi::Completions,
            Operation::Embedding => ProviderApi::Embeddings,
        }
    }
}

/// What every OpenAI-surface handler receives.
struct Incoming {
    caller: Caller,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
}

async fn chat_completions(
    State(edge): State<Arc<Edge>>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let incoming = Incoming {
        caller,
        headers,
        body,
    };
    respond(&edge, Operation::Chat, incoming).await
}

async fn completions(
    State(edge): State<Arc<Edge>>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let incoming = Incoming {
        caller,
        headers,
        body,
    };
    respond(&edge, Operation::Completion, incoming).await
}

async fn embeddings(
    State(edge): State<Arc<Edge>>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let incoming = Incoming {
        caller,
        headers,
        body,
    };
    respond(&edge, Operation::Embedding, incoming).await
}

async fn respond(edge: &Arc<Edge>, op: Operation, incoming: Incoming) -> Response {
    let recorder = edge.start_request(ClientApi::OpenAi, &incoming.caller);
    match handle(edge, op, incoming, &recorder).await {
        Ok(response) => {
            recorder.responded(response.status().as_u16());
            response
        }
        Err((group, err)) => {
            record_error(&recorder, &group, &err);
            // Requests that reached the dispatcher are counted by its meter.
            if !err.metered {
                edge.metrics
                    .count_request(&group, "none", err.reason.as_str());
            }
            err.into_response()
        }
    }
}

/// Records a request the edge answered with `err` (for `group`, when known).
pub(crate) fn record_error(recorder: &RequestRecorder, group: &str, err: &ApiError) {
    if !group.is_empty() {
        recorder.set_group(group);
    }
    recorder.failed(&err.code, err.status.as_u16());
}

/// Parses and validates one request, has the service dispatch it and renders the answer.
/// Errors carry the model group for metrics.
async fn handle(
    edge: &Arc<Edge>,
    op: Operation,
    incoming: Incoming,
    recorder: &RequestRecorder,
) -> Result<Response, (String, ApiError)> {
    let Incoming {
        caller,
        headers,
        body,
    } = incoming;
    let unknown = |e: ApiError| (String::new(), e);
    require_json(&headers).map_err(unknown)?;
    let body = body.map_err(|r| unknown(super::body_error(r, edge)))?;
    let request = ClientRequest::parse(&body).map_err(unknown)?;
    let group = requested_group(&request).map_err(unknown)?;
    let fail = |e: ApiError| (group.clone(), e);
    check_group(edge, &caller, &group).map_err(fail)?;
    validate(&request, op).map_err(fail)?;
    let stream = op != Operation::Embedding && request.get::<bool>("stream").unwrap_or(false);
    let include_usage = request
        .get::<Map<String, Value>>("stream_options")
        .and_then(|o| o.get("include_usage").and_then(Value::as_bool))
        .unwrap_or(false);
    let lane = || lane_inputs(&request, op);
    let dispatch_request = ChatDispatch {
        group: group.clone(),
        op,
        chat: Ok(&request),
        stream,
        lane: &lane,
        keep_stream_usage: false,
        native: None,
        recorder,
    };
    let (dispatched, attempts) = dispatch(edge, &caller, &headers, dispatch_request)
        .await
        .map_err(fail)?;
    // From here the dispatcher's meter counts the request.
    let fail = |e: ApiError| (group.clone(), e.with_attempts(attempts).metered());
    let mut response = match dispatched {
        Dispatched::Tunnel { tunnel, .. } => passthrough::respond(tunnel).await.map_err(fail)?,
        Dispatched::Run(mut run) => {
            let first = render::first_event(&mut run).await.map_err(fail)?;
            let shape = render::Shape {
                op,
                model: group.clone(),
                include_usage,
            };
            if stream {
                render::sse(run, first, shape)
            } else {
                let limit = edge.config().limits.http.max_response_bytes;
                render::json(run, first, shape, limit).await.map_err(fail)?
            }
        }
    };
    response
        .headers_mut()
        .insert(ATTEMPTS_HEADER, HeaderValue::from(attempts));
    Ok(response)
}

/// The model group `request` names (`model`).
pub(crate) fn requested_group(request: &ClientRequest) -> Result<String, ApiError> {
    match request.typed::<String>("model") {
        Ok(Some(m)) if !m.is_empty() => Ok(m),
        Ok(None) if !request.has("model") => Err(ApiError::bad_request(
            "missing_model",
            "you must provide a `model` parameter",
        )
        .with_param("model")),
        _ => Err(
            ApiError::bad_request("invalid_model", "`model` must be a non-empty string")
                .with_param("model"),
        ),
    }
}

/// Refuses a `group` that does not exist or that the caller may not use.
pub(crate) fn check_group(edge: &Edge, caller: &Caller, group: &str) -> Result<(), ApiError> {
    edge.admission
        .policy(group)
        .filter(|_| caller.may_use_model(group))
        .map(|_| ())
        .ok_or_else(|| {
            ApiError::not_found(
                "model_not_found",
                format!(
                    "the model `{group}` does not exist or you do not have access to it; \
                     GET /v1/models lists the models you can use"
                ),
            )
            .with_param("model")
        })
}

/// A request for one model group, ready to go to one of its members: what [`handle`]
/// parsed, or what another API's surface translated its request into.
pub(crate) struct ChatDispatch<'r> {
    pub group: String,
    pub op: Operation,
    /// The OpenAI request (`op`'s body), or why the client's request has none: it is then
    /// served only by members whose provider serves `native`'s API itself.
    pub chat: Result<&'r ClientRequest<'r>, ApiError>,
    pub stream: bool,
    pub lane: LaneEstimate<'r>,
    /// The caller reads a tunnelled stream itself: stream usage the edge asks the provider
    /// for stays in the stream (it is still recorded).
    pub keep_stream_usage: bool,
    /// The client's own request in another API, sent as it is (with the upstream `model`)
    /// to a member whose provider serves that API.
    pub native: Option<NativeRequest<'r>>,
    /// The request's record in the usage ledger.
    pub recorder: &'r RequestRecorder,
}

/// A request in an API some providers serve themselves.
pub(crate) struct NativeRequest<'r> {
    pub api: ProviderApi,
    pub request: &'r ClientRequest<'r>,
    /// Client headers the provider's API reads (e.g. `anthropic-version`).
    pub headers: Vec<pb::Header>,
}

/// Where a dispatched request went.
pub(crate) enum Dispatched {
    /// Through the raw tunnel; `native` when the client's own request went (not `chat`).
    Tunnel { tunnel: TunnelStream, native: bool },
    /// As a node run of the chat request.
    Run(RunStream),
}

/// Has the dispatcher send the request to a member of the group (failing over before the
/// first byte): the client's own request through the raw tunnel to a provider that serves
/// `native`'s API, the OpenAI request through the tunnel to other OpenAI-compatible
/// providers, a run to the others. The slot is held by the stream returned, with the
/// attempts it took, and freed when it ends or is dropped.
pub(crate) async fn dispatch(
    edge: &Arc<Edge>,
    caller: &Caller,
    headers: &HeaderMap,
    request: ChatDispatch<'_>,
) -> Result<(Dispatched, u32), ApiError> {
    let ChatDispatch {
        group,
        op,
        chat,
        stream,
        lane,
        keep_stream_usage,
        native,
        recorder,
    } = request;
    let accept = if stream {
        "text/event-stream"
    } else {
        "application/json"
    };
    let target = Target {
        group: &group,
        lane,
        caller,
        headers,
        recorder,
    };
    let went_native = AtomicBool::new(false);
    let dispatched = model_dispatch::dispatch(edge, target, |member| {
        let provider = member.provider;
        went_native.store(false, Ordering::Relaxed);
        if let Some(native) = native.as_ref().filter(|n| provider.serves(n.api)) {
            went_native.store(true, Ordering::Relaxed);
            let mut headers = vec![
                header("content-type", "application/json"),
                header("accept", accept),
            ];
            headers.extend(native.headers.iter().cloned());
            return Ok(Work::Tunnel(TunnelSpec {
                adapter: provider.id.clone(),
                method: "POST".into(),
                path: native.api.provider_path().into(),
                headers,
                body: native.request.with_model(member.upstream_model).into(),
                usage_injected: false,
                ..Default::default()
            }));
        }
        let request = *chat.as_ref().map_err(Clone::clone)?;
        if provider.kind.is_tunnel() && !provider.serves(op.api()) {
            return Err(ApiError::bad_request(
                "unsupported_operation",
                format!(
                    "model `{group}` is served by provider {}/{}, which does not serve the {} API \
                     (provider config `apis`)",
                    member.node,
                    provider.id,
                    op.api().as_str()
                ),
            ));
        }
        if provider.kind.is_tunnel() {
            let usage_injected =
                stream && provider.injects_stream_usage() && !stream_usage::client_asked(request);
            let body = stream_usage::provider_body(request, member.upstream_model, usage_injected);
            return Ok(Work::Tunnel(TunnelSpec {
                adapter: provider.id.clone(),
                method: "POST".into(),
                path: op.provider_path().into(),
                headers: vec![
                    header("content-type", "application/json"),
                    header("accept", accept),
                ],
                body: body.into(),
                usage_injected: usage_injected && !keep_stream_usage,
                ..Default::default()
            }));
        }
        if op == Operation::Embedding {
            return Err(ApiError::bad_request(
                "unsupported_operation",
                format!(
                    "model `{group}` is served by a {} provider; embeddings are served by openai_compat and vllm providers only",
                    provider.kind.as_str()
                ),
            ));
        }
        let mut spec = run_spec(&request.to_map(), op, &provider.id, member.upstream_model);
        spec.owner = caller.owner();
        Ok(Work::Run(spec))
    })
    .await?;
    let started = match dispatched.started {
        Started::Tunnel(tunnel) => Dispatched::Tunnel {
            tunnel,
            native: went_native.load(Ordering::Relaxed),
        },
        Started::Run(run) => Dispatched::Run(run),
    };
    Ok((started, dispatched.attempts))
}

/// Largest `max_tokens` / `max_completion_tokens` accepted.
pub const MAX_TOKENS_LIMIT: u64 = i32::MAX as u64;
/// Largest `n` (choices per request) accepted, as OpenAI's API.
pub const MAX_CHOICES: u64 = 128;

/// The parameters the edge itself reads, checked so a mistake gets a 400 naming the field
/// here rather than an opaque failure upstream, and so the edge and the backend can never
/// read a field differently. Other fields pass to the backend untouched.
fn validate(request: &ClientRequest, op: Operation) -> Result<(), ApiError> {
    match op {
        Operation::Chat => validate_messages(request)?,
        Operation::Completion => validate_text_input(request, "prompt")?,
        Operation::Embedding => validate_text_input(request, "input")?,
    }
    let wrong = |param: &str, what: &str| {
        ApiError::invalid_param(param, format!("`{param}` must be {what}"))
    };
    if request.typed::<bool>("stream").is_err() {
        return Err(ApiError {
            code: "invalid_stream".into(),
            ..wrong("stream", "a boolean")
        });
    }
    for key in ["max_tokens", "max_completion_tokens"] {
        match request.typed::<u64>(key) {
            Ok(Some(n)) if n > MAX_TOKENS_LIMIT => {}
            Ok(_) => continue,
            Err(WrongType) => {}
        }
        return Err(wrong(
            key,
            &format!("an integer from 0 to {MAX_TOKENS_LIMIT}"),
        ));
    }
    match request.typed::<u64>("n") {
        Ok(Some(n)) if !(1..=MAX_CHOICES).contains(&n) => {
            return Err(wrong("n", &format!("an integer from 1 to {MAX_CHOICES}")));
        }
        Err(WrongType) => return Err(wrong("n", &format!("an integer from 1 to {MAX_CHOICES}"))),
        Ok(_) => {}
    }
    for key in ["temperature", "top_p"] {
        if request.typed::<f64>(key).is_err() {
            return Err(wrong(key, "a number"));
        }
    }
    match request.typed::<serde_json::Number>("seed") {
        Ok(Some(n)) if !(n.is_i64() || n.is_u64()) => return Err(wrong("seed", "an integer")),
        Err(WrongType) => return Err(wrong("seed", "an integer")),
        _ => {}
    }
    match request.typed::<Value>("stop") {
        Ok(None | Some(Value::String(_))) => {}
        Ok(Some(Value::Array(items))) if items.iter().all(Value::is_string) => {}
        _ => return Err(wrong("stop", "a string or an array of strings")),
    }
    match request.typed::<Map<String, Value>>("stream_options") {
        Ok(None) => {}
        Ok(Some(options)) => {
            if !matches!(
                options.get("include_usage"),
                None | Some(Value::Null | Value::Bool(_))
            ) {
                return Err(wrong("stream_options.include_usage", "a boolean"));
            }
        }
        Err(WrongType) => return Err(wrong("stream_options", "an object")),
    }
    Ok(())
}

/// `messages`: a non-empty array of objects, each with a string `role` and a `content`
/// that is a string, an array of content parts (objects) or absent.
fn validate_messages(request: &ClientRequest) -> Result<(), ApiError> {
    let messages = match request.typed::<Vec<&RawValue>>("messages") {
        Ok(Some(m)) if !m.is_empty() => m,
        Ok(None) if !request.has("messages") => {
            return Err(ApiError::bad_request(
                "missing_messages",
                "you must provide a `messages` parameter",
            )
            .with_param("messages"));
        }
        _ => {
            return Err(ApiError::bad_request(
                "invalid_messages",
                "`messages` must be a non-empty array of message objects",
            )
            .with_param("messages"));
        }
    };
    for (i, raw) in messages.iter().enumerate() {
        let at = format!("messages[{i}]");
        let Ok(message) = serde_json::from_str::<Map<String, Value>>(raw.get()) else {
            return Err(ApiError::invalid_param(
                &at,
                format!("`{at}` must be a message object"),
            ));
        };
        if !matches!(message.get("role"), Some(Value::String(_))) {
            let param = format!("{at}.role");
            return Err(ApiError::invalid_param(
                &param,
                format!("`{param}` must be a string"),
            ));
        }
        match message.get("content") {
            None | Some(Value::Null | Value::String(_)) => {}
            Some(Value::Array(parts)) => {
                if let Some(j) = parts.iter().position(|p| !p.is_object()) {
                    let param = format!("{at}.content[{j}]");
                    return Err(ApiError::invalid_param(
                        &param,
                        format!("`{param}` must be a content part object"),
                    ));
                }
            }
            Some(_) => {
                let param = format!("{at}.content");
                return Err(ApiError::invalid_param(
                    &param,
                    format!("`{param}` must be a string or an array of content parts"),
                ));
            }
        }
    }
    Ok(())
}

/// `prompt` / `input`: a string or an array (of strings or token ids).
fn validate_text_input(request: &ClientRequest, key: &str) -> Result<(), ApiError> {
    match request.typed::<Value>(key) {
        Ok(Some(Value::String(_) | Value::Array(_))) => Ok(()),
        Ok(None) if !request.has(key) => Err(ApiError::bad_request(
            &format!("missing_{key}"),
            format!("you must provide the `{key}` parameter (a string or an array)"),
        )
        .with_param(key)),
        _ => Err(ApiError::invalid_param(
            key,
            format!("`{key}` must be a string or an array"),
        )),
    }
}

/// What the lane estimate reads of a request: characters of the prompt (every message's
/// text content, the prompt or the input) and `max_completion_tokens` / `max_tokens`.
pub fn lane_inputs(request: &ClientRequest, op: Operation) -> LaneInputs {
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
    LaneInputs {
        prompt_chars: chars as u64,
        max_tokens,
    }
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
                .map(|ms| ms.iter().map(chat_input::chat_message).collect())
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
    let mut options = pb::GenerationOptions {
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
        ..Default::default()
    };
    chat_input::tool_options(request, &mut options);
    RunSpec {
        adapter: adapter.to_string(),
        target: upstream_model.to_string(),
        input,
        messages,
        options: Some(options),
        session_id: String::new(),
        background: false,
        ..Default::default()
    }
}

fn header(name: &str, value: &str) -> pb::Header {
    pb::Header {
        name: name.into(),
        value: value.as_bytes().to_vec(),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn map(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    fn estimate(v: Value, op: Operation) -> u64 {
        let body = v.to_string();
        crate::service::dispatch::estimate_context_tokens(lane_inputs(
            &ClientRequest::parse(body.as_bytes()).unwrap(),
            op,
        ))
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
        let hi = json!([{"role": "user", "content": "hi"}]);
        let e = check(json!({"messages": hi, "stream": "yes"}), Operation::Chat).unwrap_err();
        assert!(e.message.contains("stream"));
        assert_eq!(e.param.as_deref(), Some("stream"));
        assert!(check(json!({"messages": hi, "stream": null}), Operation::Chat).is_ok());
        assert!(check(json!({"input": "x"}), Operation::Embedding).is_ok());
        assert!(check(json!({"input": 3}), Operation::Embedding).is_err());
    }

    #[test]
    fn every_malformed_field_is_a_400_naming_it() {
        let hi = json!([{"role": "user", "content": "hi"}]);
        let cases = [
            (json!({"messages": hi, "max_tokens": -1}), "max_tokens"),
            (
                json!({"messages": hi, "max_tokens": 9223372036854775808u64}),
                "max_tokens",
            ),
            (
                json!({"messages": hi, "max_tokens": u64::MAX}),
                "max_tokens",
            ),
            (json!({"messages": hi, "max_tokens": "5"}), "max_tokens"),
            (json!({"messages": hi, "max_tokens": 5.5}), "max_tokens"),
            (
                json!({"messages": hi, "max_completion_tokens": -1}),
                "max_completion_tokens",
            ),
            (json!({"messages": hi, "n": 1_000_000}), "n"),
            (json!({"messages": hi, "n": 0}), "n"),
            (json!({"messages": hi, "n": "2"}), "n"),
            (json!({"messages": hi, "stream": 1}), "stream"),
            (json!({"messages": hi, "temperature": "hot"}), "temperature"),
            (json!({"messages": hi, "top_p": [1]}), "top_p"),
            (json!({"messages": hi, "seed": 1.5}), "seed"),
            (json!({"messages": hi, "stop": [1]}), "stop"),
            (
                json!({"messages": hi, "stream_options": true}),
                "stream_options",
            ),
            (
                json!({"messages": hi, "stream_options": {"include_usage": "yes"}}),
                "stream_options.include_usage",
            ),
            (json!({"messages": [1, 2]}), "messages[0]"),
            (json!({"messages": "hi"}), "messages"),
            (json!({"messages": [{"content": "hi"}]}), "messages[0].role"),
            (
                json!({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": 5}]}),
                "messages[1].content",
            ),
            (
                json!({"messages": [{"role": "user", "content": ["text"]}]}),
                "messages[0].content[0]",
            ),
        ];
        for (body, param) in cases {
            let e = check(body.clone(), Operation::Chat).unwrap_err();
            assert_eq!(e.status, 400, "{body}");
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
        }
        let e = check(json!({"prompt": {"x": 1}}), Operation::Completion).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("prompt"));
        // What the OpenAI API accepts still passes.
        let ok = json!({
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                {"role": "assistant", "content": null, "tool_calls": []},
            ],
            "max_tokens": 0, "max_completion_tokens": MAX_TOKENS_LIMIT, "n": 128,
            "temperature": 0, "top_p": 0.5, "seed": -3, "stop": ["a", "b"],
            "stream": true, "stream_options": {"include_usage": true},
        });
        check(ok, Operation::Chat).unwrap();
        check(
            json!({"prompt": [1, 2, 3], "stop": null}),
            Operation::Completion,
        )
        .unwrap();
    }

    #[test]
    fn the_lane_estimate_saturates() {
        let r = json!({"prompt": "abcd", "max_tokens": u64::MAX});
        assert_eq!(estimate(r, Operation::Completion), u64::MAX);
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
