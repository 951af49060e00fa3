//! The one handler of every endpoint that asks a model group for something — OpenAI's
//! chat completions, completions and embeddings, the Responses and Messages APIs,
//! Ollama's chat, generate and embeddings — whatever API it speaks:
//!
//! ```text
//! body → surface decodes (canonical request + the client's own)
//!      → service admits (group, allowlist, key limits) and serves it (route, dispatch)
//!      → the provider's own bytes (native), or canonical events the surface renders
//! ```
//!
//! Every request is recorded once (its record starts here and ends when the response
//! does), and every error answers in the surface's own shape. Responses of dispatched
//! requests carry `x-iop-attempts`. A streamed request still waiting for its answer after
//! `limits.http.stream_keepalive_sec` is answered with its stream at once and kept alive
//! ([`super::keepalive`]).

use std::sync::Arc;
use std::time::{Instant, SystemTime};

use axum::Router;
use axum::extract::{Extension, Request, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};

use super::decode::{LargeBodies, Prepared};
use super::error::{self, with_attempts};
use super::{answer, background, forward, keepalive, passthrough, request_id, resume};
use crate::auth::Caller;
use crate::canonical::{ApiError, ModelRequest, Operation};
use crate::ledger::RequestRecorder;
use crate::service::Edge;
use crate::service::dispatch::{Answer, RequestContext};
use crate::service::pipeline::{AdmitTarget, TokenEstimate};
use crate::surfaces::{AnswerMeta, Surface, ollama};

/// The model endpoints of every API (behind authentication).
pub fn routes(large: Arc<LargeBodies>) -> Router<Arc<Edge>> {
    let endpoints = [
        ("/v1/chat/completions", Surface::OpenAi(Operation::Chat)),
        ("/v1/completions", Surface::OpenAi(Operation::Completion)),
        ("/v1/embeddings", Surface::OpenAi(Operation::Embedding)),
        ("/v1/responses", Surface::Responses),
        ("/v1/messages", Surface::Messages),
        ("/api/chat", Surface::Ollama(ollama::Endpoint::Chat)),
        ("/api/generate", Surface::Ollama(ollama::Endpoint::Generate)),
        ("/api/embed", Surface::Ollama(ollama::Endpoint::Embed)),
        (
            "/api/embeddings",
            Surface::Ollama(ollama::Endpoint::Embeddings),
        ),
    ];
    let mut router = Router::new();
    for (path, surface) in endpoints {
        let large = large.clone();
        router = router.route(
            path,
            post(
                move |State(edge): State<Arc<Edge>>,
                      Extension(caller): Extension<Caller>,
                      headers: HeaderMap,
                      body: Request| {
                    let request = Incoming {
                        surface,
                        caller,
                        headers,
                        body,
                    };
                    serve(edge, large, request)
                },
            ),
        );
    }
    router
        .route("/v1/responses/{id}", get(background::retrieve))
        .route("/v1/responses/{id}/cancel", post(background::cancel))
}

/// One request as it arrived at a model endpoint.
struct Incoming {
    surface: Surface,
    caller: Caller,
    headers: HeaderMap,
    /// The request, its body not read yet.
    body: Request,
}

/// Serves one request, recording it whatever ends it.
async fn serve(edge: Arc<Edge>, large: Arc<LargeBodies>, incoming: Incoming) -> Response {
    let surface = incoming.surface;
    let recorder = edge.start_request(surface.api(), &incoming.caller);
    match handle(&edge, &large, incoming, &recorder).await {
        Ok(response) => {
            recorder.responded(response.status().as_u16());
            response
        }
        Err(e) => {
            recorder.failed(e.reason, e.status.as_u16());
            error::response(surface.error_shape(), e)
        }
    }
}

async fn handle(
    edge: &Arc<Edge>,
    large: &Arc<LargeBodies>,
    incoming: Incoming,
    recorder: &RequestRecorder,
) -> Result<Response, ApiError> {
    let received = Instant::now();
    let Incoming {
        surface,
        caller,
        headers,
        body,
    } = incoming;
    let key = caller.key_name().unwrap_or("");
    let resumed = resume::requested(edge, surface, &headers);
    let prepared = large
        .read_and_decode(edge, key, surface, body, &headers)
        .await?;
    if let Some(point) = resumed {
        recorder.set_group(&prepared.decoded().model);
        return resume::serve(edge, surface, &caller, &headers, point, recorder, None).await;
    }
    let keepalive = keepalive::interval(edge, surface, prepared.decoded().stream);
    // Owned, so a stream kept alive while it waits can outlive the handler.
    let (edge, answer_recorder) = (edge.clone(), recorder.clone());
    let answering = async move {
        let recorder = &answer_recorder;
        admit_and_serve(
            &edge, surface, &caller, &headers, &prepared, recorder, received,
        )
        .await
    };
    match keepalive {
        None => answering.await,
        Some(every) => {
            let errors = keepalive::ErrorEvents::Api(surface);
            keepalive::answer_or_keep_alive(answering, every, errors, recorder).await
        }
    }
}

/// Admits and serves a decoded request: its response, head and (streamed) body.
async fn admit_and_serve(
    edge: &Arc<Edge>,
    surface: Surface,
    caller: &Caller,
    headers: &HeaderMap,
    prepared: &Prepared,
    recorder: &RequestRecorder,
    received: Instant,
) -> Result<Response, ApiError> {
    let decoded = prepared.decoded();
    let canonical = prepared.canonical();
    let session = crate::routing::session::session_key(headers, &decoded.native.request);
    let background = background::requested(edge, surface, decoded)?;
    let mut request = ModelRequest {
        group: &decoded.model,
        op: decoded.op,
        stream: decoded.stream || background,
        native: &decoded.native,
        canonical,
        max_output_tokens: decoded.max_output_tokens,
        session: session.as_deref(),
        background,
    };
    let estimate = TokenEstimate {
        input: request.input_estimate(),
        max_output: decoded.max_output_tokens,
    };
    let target = AdmitTarget::Model {
        name: &decoded.model,
        models_endpoint: surface.models_endpoint(),
    };
    let group = edge.admit(caller, target, estimate, recorder).await?;
    if let Some(immediate) = decoded.immediate {
        let answer = surface.immediate(immediate, &group, SystemTime::now());
        return Ok(axum::Json(answer).into_response());
    }
    request.group = &group;
    let ctx = RequestContext {
        api_key: caller.owner(),
        client_request_id: request_id::of(headers).to_string(),
        provider_headers: forward::provider_headers(headers, &edge.config().http),
        recorder: recorder.clone(),
    };
    let served = edge.serve_model(&request, &ctx).await?;
    let attempts = served.attempts;
    // What a translation left out is said on translated answers (a member that serves the
    // client's API itself got the request whole).
    let mut notes = None;
    let response = match served.answer {
        Answer::Native { head, stream } if background => {
            background::started(head, stream, &group, decoded.stream)
        }
        Answer::Native { head, stream } => {
            passthrough::respond_head(head, stream, surface, None, None)
        }
        Answer::Events(source) => {
            notes = surface.notes(decoded);
            let meta = AnswerMeta {
                id: source.id().to_string(),
                model: group.clone(),
                received,
                dispatched: served.dispatched,
                created: SystemTime::now(),
            };
            let renderer = surface.renderer(decoded, meta);
            let limit = edge.config().limits.http.max_response_bytes;
            answer::respond(source, renderer, decoded.stream, limit).await
        }
    };
    let mut response = with_attempts(response.map_err(|e| e.with_attempts(attempts))?, attempts);
    if let Some((name, value)) = notes
        && let Ok(value) = axum::http::HeaderValue::from_str(&value)
    {
        response.headers_mut().insert(name, value);
    }
    Ok(response)
}
