//! The `/v1/responses` and `/v1/messages` handlers and their one way to a member: parse
//! and check the request, translate it to chat, dispatch it through the chat path
//! ([`openai::dispatch`]: admission, lease, tunnel or run), and answer — the provider's
//! own bytes for a native member, else the normalized answer rendered in the API's shape,
//! as JSON or as a stream.
//!
//! A request the translation refuses is answered before admission when no member of the
//! group serves the API itself; in a group with such members, a refused request is sent
//! natively if it lands on one, and refused otherwise.

use std::sync::Arc;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{Extension, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use futures::stream;
use iop_proto::pb;
use serde_json::Value;

use super::answer::AnswerEvent;
use super::messages::render::MessageWriter;
use super::responses::render::{ResponseMeta, ResponseWriter};
use super::source::AnswerSource;
use super::sse::{self, SseEvent};
use super::{messages, responses};
use crate::auth::Caller;
use crate::config::ProviderApi;
use crate::http::error::{ATTEMPTS_HEADER, ApiError};
use crate::http::openai::{self, ChatDispatch, Dispatched, NativeRequest, Operation};
use crate::http::passthrough;
use crate::http::request::{ClientRequest, require_json};
use crate::ledger::{ClientApi as LedgerApi, RequestRecorder};
use crate::service::{Edge, LaneInputs};

/// `POST /v1/responses` (behind the usual authentication).
pub fn responses_routes() -> Router<Arc<Edge>> {
    Router::new().route("/v1/responses", post(responses_handler))
}

/// `POST /v1/messages` (behind [`crate::http::auth::authenticate_anthropic`]).
pub fn messages_routes() -> Router<Arc<Edge>> {
    Router::new().route("/v1/messages", post(messages_handler))
}

async fn responses_handler(
    State(edge): State<Arc<Edge>>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    serve(&edge, ClientApi::Responses, caller, headers, body).await
}

async fn messages_handler(
    State(edge): State<Arc<Edge>>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    serve(&edge, ClientApi::Messages, caller, headers, body).await
}

/// The API a client speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientApi {
    Responses,
    Messages,
}

/// Client headers passed on to a provider that serves the Messages API itself.
const ANTHROPIC_HEADERS: &[&str] = &["anthropic-version", "anthropic-beta"];

impl ClientApi {
    /// How the usage ledger names the API.
    fn ledger_api(self) -> LedgerApi {
        match self {
            ClientApi::Responses => LedgerApi::Responses,
            ClientApi::Messages => LedgerApi::Messages,
        }
    }

    fn provider_api(self) -> ProviderApi {
        match self {
            ClientApi::Responses => ProviderApi::Responses,
            ClientApi::Messages => ProviderApi::Messages,
        }
    }

    fn error_response(self, error: ApiError) -> Response {
        match self {
            ClientApi::Responses => error.into_response(),
            ClientApi::Messages => messages::error::response(error),
        }
    }

    /// How a natively served stream ends on a tunnel failure.
    fn native_error_event(self) -> passthrough::ErrorEvent {
        match self {
            ClientApi::Responses => |e| sse::encode(&[responses::render::error_event(e)]),
            ClientApi::Messages => |e| sse::encode(&[messages::error::event(e)]),
        }
    }

    /// The client headers a native provider gets.
    fn forwarded(self, headers: &HeaderMap) -> Vec<pb::Header> {
        let names: &[&str] = match self {
            ClientApi::Responses => &[],
            ClientApi::Messages => ANTHROPIC_HEADERS,
        };
        names
            .iter()
            .flat_map(|name| {
                headers.get_all(*name).iter().map(|value| pb::Header {
                    name: name.to_string(),
                    value: value.as_bytes().to_vec(),
                })
            })
            .collect()
    }
}

/// What the edge reads of a request in either API.
struct Checked {
    stream: bool,
    max_tokens: Option<u64>,
}

/// The one entry point of both APIs.
pub async fn serve(
    edge: &Arc<Edge>,
    api: ClientApi,
    caller: Caller,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let recorder = edge.start_request(api.ledger_api(), &caller);
    match handle(edge, api, caller, headers, body, &recorder).await {
        Ok(response) => {
            recorder.responded(response.status().as_u16());
            response
        }
        Err((group, err)) => {
            openai::record_error(&recorder, &group, &err);
            // Requests that reached the dispatcher are counted by its meter.
            if !err.metered {
                edge.metrics
                    .count_request(&group, "none", err.reason.as_str());
            }
            api.error_response(err)
        }
    }
}

async fn handle(
    edge: &Arc<Edge>,
    api: ClientApi,
    caller: Caller,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
    recorder: &RequestRecorder,
) -> Result<Response, (String, ApiError)> {
    let unknown = |e: ApiError| (String::new(), e);
    require_json(&headers).map_err(unknown)?;
    let body = body.map_err(|r| unknown(crate::http::body_error(r, edge)))?;
    let request = ClientRequest::parse(&body).map_err(unknown)?;
    let group = openai::requested_group(&request).map_err(unknown)?;
    let fail = |e: ApiError| (group.clone(), e);
    openai::check_group(edge, &caller, &group).map_err(fail)?;
    let checked = match api {
        ClientApi::Responses => responses::request::check(&request).map(|c| Checked {
            stream: c.stream,
            max_tokens: c.max_output_tokens,
        }),
        ClientApi::Messages => messages::request::check(&request).map(|c| Checked {
            stream: c.stream,
            max_tokens: Some(c.max_tokens),
        }),
    }
    .map_err(fail)?;
    let translated = match api {
        ClientApi::Responses => responses::request::to_chat(&request),
        ClientApi::Messages => messages::request::to_chat(&request),
    }
    .map(|chat| serde_json::to_vec(&Value::Object(chat)).expect("JSON values serialize"));
    if let Err(e) = &translated
        && !served_natively_in(edge, &group, api.provider_api())
    {
        return Err(fail(e.clone()));
    }
    let chat = match &translated {
        Ok(bytes) => Ok(ClientRequest::parse(bytes).map_err(fail)?),
        Err(e) => Err(e.clone()),
    };
    let lane = || match &chat {
        Ok(chat) => openai::lane_inputs(chat, Operation::Chat),
        // Served natively only: the whole body stands for the prompt.
        Err(_) => LaneInputs {
            prompt_chars: body.len() as u64,
            max_tokens: checked.max_tokens.unwrap_or(0),
        },
    };
    let (dispatched, attempts) = openai::dispatch(
        edge,
        &caller,
        &headers,
        ChatDispatch {
            group: group.clone(),
            op: Operation::Chat,
            chat: chat.as_ref().map_err(Clone::clone),
            stream: checked.stream,
            lane: &lane,
            keep_stream_usage: true,
            native: Some(NativeRequest {
                api: api.provider_api(),
                request: &request,
                headers: api.forwarded(&headers),
            }),
            recorder,
        },
    )
    .await
    .map_err(fail)?;
    // From here the dispatcher's meter counts the request.
    let fail = |e: ApiError| (group.clone(), e.with_attempts(attempts).metered());
    let limit = edge.config().limits.http.max_response_bytes;
    let mut source = match dispatched {
        Dispatched::Tunnel {
            tunnel,
            native: true,
        } => {
            let response = passthrough::respond_with(tunnel, api.native_error_event())
                .await
                .map_err(fail)?;
            return Ok(with_attempts(response, attempts));
        }
        Dispatched::Tunnel {
            tunnel,
            native: false,
        } => AnswerSource::chat(tunnel, limit),
        Dispatched::Run(run) => AnswerSource::run(run, limit),
    };
    let first = source.first().await.map_err(fail)?;
    let writer = Writer::new(api, &source, &group, &request, checked.stream);
    let response = if checked.stream {
        stream_answer(source, first, writer, limit)
    } else {
        collect_answer(source, first, writer, limit)
            .await
            .map_err(fail)?
    };
    Ok(with_attempts(response, attempts))
}

/// The response with `x-iop-attempts`.
fn with_attempts(mut response: Response, attempts: u32) -> Response {
    response
        .headers_mut()
        .insert(ATTEMPTS_HEADER, HeaderValue::from(attempts));
    response
}

/// Whether a member of `group` serves `api` itself.
fn served_natively_in(edge: &Edge, group: &str, api: ProviderApi) -> bool {
    let config = edge.config();
    config
        .model_groups
        .iter()
        .filter(|g| g.name == group)
        .flat_map(|g| &g.members)
        .any(|m| {
            config
                .nodes
                .iter()
                .filter(|n| n.id == m.node)
                .flat_map(|n| &n.providers)
                .any(|p| p.id == m.provider && p.serves(api))
        })
}

/// The renderer of the client's API.
enum Writer {
    Responses(ResponseWriter),
    Messages(MessageWriter),
}

impl Writer {
    fn new(
        api: ClientApi,
        source: &AnswerSource,
        model: &str,
        request: &ClientRequest,
        streaming: bool,
    ) -> Self {
        match api {
            ClientApi::Responses => Writer::Responses(ResponseWriter::new(
                ResponseMeta {
                    id: format!("resp_{}", source.id()),
                    created_at: crate::events::unix_ms() / 1000,
                    model: model.to_string(),
                    echo: responses::render::echo(&request.to_map()),
                },
                streaming,
            )),
            ClientApi::Messages => Writer::Messages(MessageWriter::new(
                format!("msg_{}", source.id()),
                model.to_string(),
                streaming,
            )),
        }
    }

    fn start(&mut self, out: &mut Vec<SseEvent>) {
        match self {
            Writer::Responses(w) => w.start(out),
            Writer::Messages(w) => w.start(out),
        }
    }

    fn push(&mut self, event: AnswerEvent, out: &mut Vec<SseEvent>) {
        match self {
            Writer::Responses(w) => w.push(event, out),
            Writer::Messages(w) => w.push(event, out),
        }
    }

    fn finished(&self) -> Option<&Value> {
        match self {
            Writer::Responses(w) => w.finished(),
            Writer::Messages(w) => w.finished(),
        }
    }
}

/// The output bytes an event adds to the answer.
fn output_bytes(event: &AnswerEvent) -> usize {
    match event {
        AnswerEvent::Text(t) | AnswerEvent::Reasoning(t) => t.len(),
        AnswerEvent::ToolCall(c) => c.id.len() + c.name.len() + c.arguments.len(),
        _ => 0,
    }
}

/// The error of an answer that grew past what the edge assembles.
fn too_large(max_bytes: usize, streamed: bool) -> ApiError {
    let advice = if streamed {
        "ask for fewer tokens"
    } else {
        "ask for fewer tokens or set \"stream\": true"
    };
    ApiError::new(
        StatusCode::BAD_GATEWAY,
        "upstream_error",
        "response_too_large",
        format!(
            "the answer grew past this edge's limit of {max_bytes} bytes for an answer it \
             assembles (limits.http.max_response_bytes) and was cancelled; {advice}"
        ),
    )
}

/// Reads the whole answer into one JSON document of at most `max_bytes` of output. A
/// longer answer ends with a 502 and is cancelled (the source is dropped).
async fn collect_answer(
    mut source: AnswerSource,
    first: AnswerEvent,
    mut writer: Writer,
    max_bytes: usize,
) -> Result<Response, ApiError> {
    let mut size = 0usize;
    let mut event = Some(first);
    let mut none = Vec::new();
    while let Some(e) = event.take() {
        size += output_bytes(&e);
        if size > max_bytes {
            tracing::warn!(
                id = source.id(),
                max_bytes,
                "non-streamed answer over limits.http.max_response_bytes: cancelling it"
            );
            return Err(too_large(max_bytes, false));
        }
        if let AnswerEvent::Failed(error) = e {
            return Err(error);
        }
        writer.push(e, &mut none);
        if let Some(done) = writer.finished() {
            return Ok(axum::Json(done.clone()).into_response());
        }
        event = source.next().await;
    }
    Err(ApiError::upstream(
        "upstream_error",
        "the answer ended without a terminal",
    ))
}

struct StreamState {
    source: AnswerSource,
    writer: Writer,
    first: Option<AnswerEvent>,
    started: bool,
    done: bool,
    /// Output bytes so far, and the most the writer may hold (`None`: it holds nothing).
    size: usize,
    max_bytes: Option<usize>,
}

/// Streams the answer as the API's events. Dropping the body (the client went away)
/// drops the source, which cancels the run or tunnel and frees its slot.
///
/// A Responses stream repeats the whole answer in its closing events, so the edge holds
/// it: one longer than `max_bytes` fails (`response.failed`) and is cancelled. A Messages
/// stream holds nothing and has no such limit.
fn stream_answer(
    source: AnswerSource,
    first: AnswerEvent,
    writer: Writer,
    max_bytes: usize,
) -> Response {
    let max_bytes = matches!(writer, Writer::Responses(_)).then_some(max_bytes);
    let state = StreamState {
        source,
        writer,
        first: Some(first),
        started: false,
        done: false,
        size: 0,
        max_bytes,
    };
    let body = stream::unfold(state, |mut state| async move {
        let mut out = Vec::new();
        if !state.started {
            state.started = true;
            state.writer.start(&mut out);
        }
        while out.is_empty() || state.first.is_some() {
            if state.done {
                break;
            }
            let mut event = match state.first.take() {
                Some(e) => e,
                None => state.source.next().await.unwrap_or_else(|| {
                    AnswerEvent::Failed(ApiError::upstream(
                        "upstream_error",
                        "the answer ended without a terminal",
                    ))
                }),
            };
            state.size += output_bytes(&event);
            if let Some(max) = state.max_bytes
                && state.size > max
            {
                tracing::warn!(
                    id = state.source.id(),
                    max_bytes = max,
                    "streamed Responses answer over limits.http.max_response_bytes: cancelling it"
                );
                event = AnswerEvent::Failed(too_large(max, true));
            }
            state.done = event.is_terminal();
            state.writer.push(event, &mut out);
        }
        if out.is_empty() {
            return None;
        }
        Some((Ok::<_, std::io::Error>(sse::encode(&out)), state))
    });
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(body),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_anthropic_headers_reach_a_native_messages_provider() {
        let mut h = HeaderMap::new();
        h.insert("anthropic-version", "2023-06-01".parse().unwrap());
        h.insert("x-api-key", "secret".parse().unwrap());
        h.insert("authorization", "Bearer secret".parse().unwrap());
        let forwarded = ClientApi::Messages.forwarded(&h);
        assert_eq!(forwarded.len(), 1);
        assert_eq!(forwarded[0].name, "anthropic-version");
        assert_eq!(forwarded[0].value, b"2023-06-01");
        assert!(ClientApi::Responses.forwarded(&h).is_empty());
    }

    #[test]
    fn native_stream_errors_are_in_each_apis_shape() {
        let e = ApiError::upstream("provider_stream_error", "boom");
        let anthropic = (ClientApi::Messages.native_error_event())(&e);
        assert_eq!(
            anthropic,
            "event: error\ndata: {\"error\":{\"message\":\"boom\",\"type\":\"api_error\"},\"type\":\"error\"}\n\n"
        );
        let openai = (ClientApi::Responses.native_error_event())(&e);
        assert!(openai.starts_with(b"event: error\ndata: {"), "{openai:?}");
    }
}
