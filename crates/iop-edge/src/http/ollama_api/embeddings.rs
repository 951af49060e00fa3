//! `/api/embed` and the older `/api/embeddings`: an Ollama member gets the client's
//! request through the tunnel (its answer byte for byte), an OpenAI-compatible member a
//! translated `/embeddings` request whose answer is rendered in Ollama's shape
//! ([`super::embed_answer`]); mock and CLI members serve no embeddings (400). No input
//! answers at once with no vectors, as Ollama does.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Extension, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::render::Timing;
use super::{
    Incoming, Outcome, embed_answer, finish, group_of, json_answer, json_body, lane, native,
    openai, request, tunnel_answer,
};
use crate::auth::Caller;
use crate::config::ProviderKind;
use crate::http::error::ApiError;
use crate::http::model_dispatch::{self, Started, Target};
use crate::http::passthrough;
use crate::service::Edge;

/// Which embeddings endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Embeddings {
    /// `/api/embed`: several inputs, `embeddings`.
    Embed,
    /// `/api/embeddings`: one prompt, `embedding`.
    Legacy,
}

pub(super) async fn embed(
    State(edge): State<Arc<Edge>>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let incoming = Incoming::new(&edge, caller, headers, body);
    let recorder = incoming.recorder.clone();
    let outcome = handle_embed(&edge, incoming, Embeddings::Embed).await;
    finish(&edge, &recorder, outcome)
}

pub(super) async fn embeddings(
    State(edge): State<Arc<Edge>>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let incoming = Incoming::new(&edge, caller, headers, body);
    let recorder = incoming.recorder.clone();
    let outcome = handle_embed(&edge, incoming, Embeddings::Legacy).await;
    finish(&edge, &recorder, outcome)
}

async fn handle_embed(edge: &Arc<Edge>, incoming: Incoming, which: Embeddings) -> Outcome {
    let unknown = |e: ApiError| (String::new(), e);
    let body = json_body(edge, &incoming.headers, incoming.body).map_err(unknown)?;
    let (model, texts) = match which {
        Embeddings::Embed => {
            let r: request::EmbedRequest = request::parse(&body).map_err(unknown)?;
            (r.model.clone(), Texts::Embed(r))
        }
        Embeddings::Legacy => {
            let r: request::EmbeddingsRequest = request::parse(&body).map_err(unknown)?;
            (r.model.clone(), Texts::Legacy(r))
        }
    };
    let group = group_of(edge, &incoming.caller, &model).map_err(unknown)?;
    let fail = |e: ApiError| (group.clone(), e);
    if texts.is_empty() {
        let out = match which {
            Embeddings::Embed => json!({"model": group, "embeddings": []}),
            Embeddings::Legacy => json!({"embedding": []}),
        };
        return Ok((group, "none", axum::Json(out).into_response()));
    }
    let native_path = match which {
        Embeddings::Embed => "/api/embed",
        Embeddings::Legacy => "/api/embeddings",
    };
    let target = Target {
        group: &group,
        lane: &|| lane(texts.chars(), None),
        caller: &incoming.caller,
        headers: &incoming.headers,
        recorder: &incoming.recorder,
    };
    let dispatched = model_dispatch::dispatch(edge, target, |member| {
        let provider = member.provider;
        match provider.kind {
            ProviderKind::Ollama => native(member, native_path, &body, false),
            kind if kind.is_tunnel() => Ok(openai(
                provider,
                "/embeddings",
                &texts.openai_body(member.upstream_model),
                false,
            )),
            kind => Err(ApiError::bad_request(
                "unsupported_operation",
                format!(
                    "model \"{group}\" is served by a {} provider; embeddings are served by \
                     openai_compat, vllm and ollama providers only",
                    kind.as_str()
                ),
            )),
        }
    })
    .await
    .map_err(fail)?;
    // From here the dispatcher's meter counts the request.
    let fail = |e: ApiError| (group.clone(), e.metered());
    let dispatched_at = Instant::now();
    let mut tunnel = match dispatched.started {
        Started::Tunnel(tunnel) if dispatched.kind == ProviderKind::Ollama => {
            let response = passthrough::respond(tunnel).await.map_err(fail)?;
            return Ok((group, "tunnel", response));
        }
        Started::Tunnel(tunnel) => tunnel,
        // Never built above; a run here would be dropped (and cancelled).
        Started::Run(_) => {
            return Err(fail(ApiError::upstream(
                "upstream_error",
                "embeddings are not served by runs",
            )));
        }
    };
    let head = tunnel_answer::head(&mut tunnel).await.map_err(fail)?;
    if !head.is_success() {
        let body = tunnel_answer::error_body(&mut tunnel).await;
        return Err(fail(tunnel_answer::provider_error(head.status, &body)));
    }
    let max = edge.config().limits.http.max_response_bytes;
    let value = json_answer(&mut tunnel, max).await.map_err(fail)?;
    let (vectors, tokens) = embed_answer::vectors(&value).map_err(fail)?;
    let out = match which {
        Embeddings::Embed => {
            let timing = Timing {
                received: incoming.received,
                dispatched: dispatched_at,
            };
            embed_answer::embed(&group, vectors, tokens, timing, Instant::now())
        }
        Embeddings::Legacy => embed_answer::embedding(vectors),
    };
    Ok((group, "tunnel", axum::Json(out).into_response()))
}

/// An embeddings request of either endpoint.
enum Texts {
    Embed(request::EmbedRequest),
    Legacy(request::EmbeddingsRequest),
}

impl Texts {
    /// No input (Ollama answers with no vectors and only loads the model).
    fn is_empty(&self) -> bool {
        match self {
            Texts::Embed(r) => matches!(r.texts()[..], [] | [""]),
            Texts::Legacy(r) => r.prompt.is_empty(),
        }
    }

    fn chars(&self) -> usize {
        match self {
            Texts::Embed(r) => r.texts().iter().map(|t| t.chars().count()).sum(),
            Texts::Legacy(r) => r.prompt.chars().count(),
        }
    }

    fn openai_body(&self, model: &str) -> Value {
        match self {
            Texts::Embed(r) => r.openai_body(model),
            Texts::Legacy(r) => r.openai_body(model),
        }
    }
}
