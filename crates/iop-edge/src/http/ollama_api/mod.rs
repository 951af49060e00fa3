//! The Ollama API on the edge, so Ollama clients (Open WebUI, the `ollama` libraries) can
//! use iop as their Ollama: `/api/version`, `/api/tags`, `/api/ps`, `/api/show`,
//! `/api/chat`, `/api/generate`, `/api/embed` and the older `/api/embeddings`. A model is
//! a model group; the same keys (any role), allowlists, admission, leases, cancel on
//! disconnect and usage accounting apply as on the OpenAI surface, and errors take
//! Ollama's shape (`{"error": "…"}`).
//!
//! What a request becomes depends on the member that gets it:
//! - an `ollama` member gets the client's request through the raw tunnel to its native
//!   endpoint, only `model` rewritten, and the answer comes back byte for byte (every
//!   Ollama option, `keep_alive`, `raw`, `context` and all);
//! - an `openai_compat` / `vllm` member gets it translated to a tunnelled chat,
//!   completions or embeddings request (`translate`), and its SSE or JSON answer is
//!   rendered as Ollama NDJSON or JSON (`answer`, `render`, `embed_answer`);
//! - a `mock` / `cli` member gets a normalized run whose events are rendered the same way;
//!   these serve no embeddings.
//!
//! Endpoints that manage Ollama's local model store (`/api/pull`, `/api/push`,
//! `/api/create`, `/api/copy`, `/api/delete`, `/api/blobs/…`) answer 501.

mod answer;
mod catalog;
mod embed_answer;
mod embeddings;
pub mod error;
mod render;
mod request;
mod respond;
mod translate;
mod tunnel_answer;

use std::sync::Arc;
use std::time::{Instant, SystemTime};

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Extension, State};
use axum::http::{HeaderMap, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, delete, get, post};
use futures::stream::{self, StreamExt};
use iop_proto::pb;
use serde_json::{Value, json};

use super::error::ApiError;
use super::model_dispatch::{self, LaneInputs, Member, Started, Target, Work};
use super::passthrough;
use super::request::{ClientRequest, require_json};
use crate::auth::Caller;
use crate::config::{ProviderConfig, ProviderKind};
use crate::service::{Edge, TunnelSpec, TunnelStream};
use render::{Endpoint, Renderer, Timing};

pub use error::is_ollama_path;

pub fn routes() -> Router<Arc<Edge>> {
    Router::new()
        .route("/api/version", get(version))
        .route("/api/tags", get(tags))
        .route("/api/ps", get(ps))
        .route("/api/show", post(show))
        .route("/api/chat", post(chat))
        .route("/api/generate", post(generate))
        .route("/api/embed", post(embeddings::embed))
        .route("/api/embeddings", post(embeddings::embeddings))
        .route("/api/pull", post(not_supported))
        .route("/api/push", post(not_supported))
        .route("/api/create", post(not_supported))
        .route("/api/copy", post(not_supported))
        .route("/api/delete", delete(not_supported))
        .route("/api/blobs/{digest}", any(not_supported))
}

/// What every model handler receives.
struct Incoming {
    caller: Caller,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
    received: Instant,
    /// The request's record in the usage ledger.
    recorder: crate::ledger::RequestRecorder,
}

impl Incoming {
    /// A request received now, its ledger record started.
    fn new(
        edge: &Arc<Edge>,
        caller: Caller,
        headers: HeaderMap,
        body: Result<Bytes, BytesRejection>,
    ) -> Self {
        Self {
            recorder: edge.start_request(crate::ledger::ClientApi::Ollama, &caller),
            caller,
            headers,
            body,
            received: Instant::now(),
        }
    }
}

/// A handler's result: the group (for metrics), the path served (`tunnel`, `run`, `none`)
/// and the response — or the group and the error.
type Outcome = Result<(String, &'static str, Response), (String, ApiError)>;

fn finish(edge: &Edge, recorder: &crate::ledger::RequestRecorder, outcome: Outcome) -> Response {
    match outcome {
        // A dispatched request is counted by the dispatcher's meter when its stream ends;
        // one answered here (an unload, a load) is counted here.
        Ok((group, path, response)) => {
            recorder.set_group(&group);
            recorder.responded(response.status().as_u16());
            if path == "none" {
                edge.metrics.count_request(&group, "none", "ok");
            }
            response
        }
        Err((group, e)) => {
            super::openai::record_error(recorder, &group, &e);
            if !e.metered {
                edge.metrics
                    .count_request(&group, "none", e.reason.as_str());
            }
            error::response(e)
        }
    }
}

async fn version() -> Response {
    axum::Json(json!({"version": catalog::OLLAMA_API_VERSION})).into_response()
}

async fn tags(State(edge): State<Arc<Edge>>, Extension(caller): Extension<Caller>) -> Response {
    axum::Json(catalog::tags(&edge.config(), &caller)).into_response()
}

async fn ps(State(edge): State<Arc<Edge>>, Extension(caller): Extension<Caller>) -> Response {
    axum::Json(catalog::ps(&edge, &caller)).into_response()
}

async fn not_supported(uri: Uri) -> Response {
    error::response(error::not_supported(uri.path()))
}

async fn show(
    State(edge): State<Arc<Edge>>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let result = async {
        let body = json_body(&edge, &headers, body)?;
        let request: request::ShowRequest = request::parse(&body)?;
        let name = request.model().ok_or_else(|| {
            ApiError::bad_request("missing_model", "you must provide a `model`").with_param("model")
        })?;
        let config = edge.config();
        let group =
            catalog::resolve(&config, &caller, name).ok_or_else(|| error::model_not_found(name))?;
        Ok::<_, ApiError>(catalog::show(&edge, group).await)
    };
    match result.await {
        Ok(body) => axum::Json(body).into_response(),
        Err(e) => error::response(e),
    }
}

/// The request body, if it is JSON and arrived whole within the limits.
fn json_body(
    edge: &Edge,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Bytes, ApiError> {
    require_json(headers)?;
    body.map_err(|r| super::body_error(r, edge))
}

/// The group a request's model names, or a 404 in Ollama's words.
fn group_of(edge: &Edge, caller: &Caller, model: &str) -> Result<String, ApiError> {
    catalog::resolve(&edge.config(), caller, model)
        .map(|g| g.name.clone())
        .ok_or_else(|| error::model_not_found(model))
}

/// What the lane estimate reads of a request of `chars` prompt characters and
/// `max_tokens` to generate (the dispatcher estimates as on the OpenAI surface).
fn lane(chars: usize, max_tokens: Option<u64>) -> LaneInputs {
    LaneInputs {
        prompt_chars: chars as u64,
        max_tokens: max_tokens.unwrap_or(0),
    }
}

fn header(name: &str, value: &str) -> pb::Header {
    pb::Header {
        name: name.into(),
        value: value.as_bytes().to_vec(),
    }
}

/// A JSON POST through the tunnel.
fn tunnel_post(provider: &ProviderConfig, path: &str, body: Vec<u8>, accept: &str) -> Work {
    Work::Tunnel(TunnelSpec {
        adapter: provider.id.clone(),
        method: "POST".into(),
        path: path.into(),
        headers: vec![
            header("content-type", "application/json"),
            header("accept", accept),
        ],
        body: body.into(),
        ..Default::default()
    })
}

/// The client's own body for an Ollama member's native endpoint, `model` rewritten.
fn native(member: Member<'_>, path: &str, body: &[u8], stream: bool) -> Result<Work, ApiError> {
    let request = ClientRequest::parse(body)?;
    let accept = if stream {
        respond::NDJSON
    } else {
        "application/json"
    };
    Ok(tunnel_post(
        member.provider,
        path,
        request.with_model(member.upstream_model),
        accept,
    ))
}

/// A translated request for an OpenAI-compatible member.
fn openai(provider: &ProviderConfig, path: &str, body: &Value, stream: bool) -> Work {
    let accept = if stream {
        "text/event-stream"
    } else {
        "application/json"
    };
    tunnel_post(provider, path, body.to_string().into_bytes(), accept)
}

async fn chat(
    State(edge): State<Arc<Edge>>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let incoming = Incoming::new(&edge, caller, headers, body);
    let recorder = incoming.recorder.clone();
    let outcome = handle_chat(&edge, incoming).await;
    finish(&edge, &recorder, outcome)
}

async fn handle_chat(edge: &Arc<Edge>, incoming: Incoming) -> Outcome {
    let unknown = |e: ApiError| (String::new(), e);
    let body = json_body(edge, &incoming.headers, incoming.body).map_err(unknown)?;
    let request: request::ChatRequest = request::parse(&body).map_err(unknown)?;
    let group = group_of(edge, &incoming.caller, &request.model).map_err(unknown)?;
    let fail = |e: ApiError| (group.clone(), e);
    let options = request.options().map_err(fail)?;
    request::response_format(request.format.as_ref()).map_err(fail)?;
    request::think_level(request.think.as_ref()).map_err(fail)?;
    if request.messages.is_empty() {
        let unload = request::unloads(request.keep_alive.as_ref());
        let loaded = render::loaded(Endpoint::Chat, &group, unload, SystemTime::now());
        return Ok((group, "none", axum::Json(loaded).into_response()));
    }
    let stream = request.stream();
    let target = Target {
        group: &group,
        lane: &|| lane(request.prompt_chars(), options.max_tokens),
        caller: &incoming.caller,
        headers: &incoming.headers,
        recorder: &incoming.recorder,
    };
    let received = incoming.received;
    dispatch_and_answer(edge, target, Endpoint::Chat, received, stream, |member| {
        let provider = member.provider;
        match provider.kind {
            ProviderKind::Ollama => native(member, "/api/chat", &body, stream),
            kind if kind.is_tunnel() => {
                let body =
                    request.openai_body(member.upstream_model, provider.injects_stream_usage())?;
                Ok(openai(provider, "/chat/completions", &body, stream))
            }
            _ => Ok(Work::Run(
                request.run_spec(&provider.id, member.upstream_model)?,
            )),
        }
    })
    .await
}

async fn generate(
    State(edge): State<Arc<Edge>>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let incoming = Incoming::new(&edge, caller, headers, body);
    let recorder = incoming.recorder.clone();
    let outcome = handle_generate(&edge, incoming).await;
    finish(&edge, &recorder, outcome)
}

async fn handle_generate(edge: &Arc<Edge>, incoming: Incoming) -> Outcome {
    let unknown = |e: ApiError| (String::new(), e);
    let body = json_body(edge, &incoming.headers, incoming.body).map_err(unknown)?;
    let request: request::GenerateRequest = request::parse(&body).map_err(unknown)?;
    let group = group_of(edge, &incoming.caller, &request.model).map_err(unknown)?;
    let fail = |e: ApiError| (group.clone(), e);
    let options = request.options().map_err(fail)?;
    request::response_format(request.format.as_ref()).map_err(fail)?;
    request::think_level(request.think.as_ref()).map_err(fail)?;
    if request.prompt.is_empty() && request.images.is_empty() {
        let unload = request::unloads(request.keep_alive.as_ref());
        let loaded = render::loaded(Endpoint::Generate, &group, unload, SystemTime::now());
        return Ok((group, "none", axum::Json(loaded).into_response()));
    }
    let stream = request.stream();
    let target = Target {
        group: &group,
        lane: &|| lane(request.prompt_chars(), options.max_tokens),
        caller: &incoming.caller,
        headers: &incoming.headers,
        recorder: &incoming.recorder,
    };
    let received = incoming.received;
    dispatch_and_answer(
        edge,
        target,
        Endpoint::Generate,
        received,
        stream,
        |member| {
            let provider = member.provider;
            match provider.kind {
                ProviderKind::Ollama => native(member, "/api/generate", &body, stream),
                kind if kind.is_tunnel() => {
                    let (path, body) = request
                        .openai_request(member.upstream_model, provider.injects_stream_usage())?;
                    Ok(openai(provider, path, &body, stream))
                }
                _ => Ok(Work::Run(
                    request.run_spec(&provider.id, member.upstream_model)?,
                )),
            }
        },
    )
    .await
}

/// Sends a chat or generate request to a member of `target.group` (`build` makes what the
/// member takes) and answers it in Ollama's shape.
async fn dispatch_and_answer(
    edge: &Arc<Edge>,
    target: Target<'_>,
    endpoint: Endpoint,
    received: Instant,
    stream: bool,
    build: impl Fn(Member<'_>) -> Result<Work, ApiError> + Sync,
) -> Outcome {
    let group = target.group.to_string();
    let dispatched = match model_dispatch::dispatch(edge, target, build).await {
        Ok(dispatched) => dispatched,
        Err(e) => return Err((group, e)),
    };
    let renderer = renderer(endpoint, &group, received);
    let path = dispatched.started.path();
    match answer(edge, dispatched, renderer, stream).await {
        Ok(response) => Ok((group, path, response)),
        // From here the dispatcher's meter counts the request.
        Err(e) => Err((group, e.metered())),
    }
}

/// The renderer for an answer dispatched now to a request `received` then.
fn renderer(endpoint: Endpoint, group: &str, received: Instant) -> Renderer {
    Renderer::new(
        endpoint,
        group.to_string(),
        Timing {
            received,
            dispatched: Instant::now(),
        },
    )
}

/// The response for a dispatched chat or generate: an Ollama member's own, or the
/// translated answer of any other.
async fn answer(
    edge: &Edge,
    dispatched: model_dispatch::Dispatched,
    renderer: Renderer,
    stream: bool,
) -> Result<Response, ApiError> {
    let max = edge.config().limits.http.max_response_bytes;
    match dispatched.started {
        Started::Tunnel(tunnel) if dispatched.kind == ProviderKind::Ollama => {
            passthrough::respond(tunnel).await
        }
        Started::Tunnel(tunnel) => translate_tunnel(tunnel, renderer, stream, max).await,
        Started::Run(run) => respond::answer(respond::run_events(run), renderer, stream, max).await,
    }
}

/// An OpenAI-compatible provider's chat or completions answer, as Ollama's.
async fn translate_tunnel(
    mut tunnel: TunnelStream,
    renderer: Renderer,
    stream: bool,
    max: usize,
) -> Result<Response, ApiError> {
    let head = tunnel_answer::head(&mut tunnel).await?;
    if !head.is_success() {
        let body = tunnel_answer::error_body(&mut tunnel).await;
        return Err(tunnel_answer::provider_error(head.status, &body));
    }
    let events = if head.sse {
        tunnel_answer::sse_events(tunnel)
    } else {
        let value = json_answer(&mut tunnel, max).await?;
        stream::iter(answer::from_openai_json(&value)).boxed()
    };
    respond::answer(events, renderer, stream, max).await
}

/// A whole JSON answer of at most `max` bytes.
async fn json_answer(tunnel: &mut TunnelStream, max: usize) -> Result<Value, ApiError> {
    let body = tunnel_answer::body(tunnel, max).await?;
    serde_json::from_slice(&body).map_err(|e| {
        ApiError::upstream(
            "bad_upstream_response",
            &format!("the provider's answer is not JSON: {e}"),
        )
    })
}
