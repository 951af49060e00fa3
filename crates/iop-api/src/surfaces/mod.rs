//! The client APIs as codecs around the canonical request and answer: each surface
//! decodes its requests into a [`Decoded`] request, renders the canonical answer stream
//! in its own shape ([`Renderer`]) and its errors in its own error shape ([`ErrorShape`]).
//! Nothing else differs per surface: admission, routing, relaying and accounting are the
//! service's, once for all of them.
//!
//! - [`openai`]: chat completions, completions, embeddings (the canonical form itself);
//! - [`responses`]: the OpenAI Responses API;
//! - [`messages`]: the Anthropic Messages API;
//! - [`ollama`]: Ollama's chat, generate and embeddings;
//! - [`runs`]: the native runs API (a run on a named adapter, its events as they are).
//! - [`translated`]: what the Responses and Messages decoders share.
//!
//! Pure: no I/O, no server, no edge state.

pub mod messages;
pub mod ollama;
pub mod openai;
pub mod responses;
pub mod runs;
pub mod sse;
pub mod translated;

use std::time::{Instant, SystemTime};

use http::HeaderMap;
use serde_json::{Value, json};

use crate::canonical::{AnswerEvent, ApiError, Decoded, Immediate, Operation};
use messages::render::MessageWriter;
use ollama::embed::{EmbedWriter, Embeddings};
use ollama::render::{OllamaWriter, Timing};
use openai::render::OpenAiWriter;
use responses::render::{ResponseMeta, ResponseWriter};
use sse::EventWriter;

/// A client API endpoint that asks a model group for something.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Surface {
    /// `/v1/chat/completions`, `/v1/completions`, `/v1/embeddings`.
    OpenAi(Operation),
    /// `/v1/responses`.
    Responses,
    /// `/v1/messages`.
    Messages,
    /// `/api/chat`, `/api/generate`, `/api/embed`, `/api/embeddings`.
    Ollama(ollama::Endpoint),
}

/// The client API a request came in on, as the usage ledger names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ClientApi {
    /// `/v1/chat/completions`, `/v1/completions`, `/v1/embeddings`.
    OpenAi,
    /// `/v1/responses`.
    Responses,
    /// `/v1/messages` (Anthropic).
    Messages,
    /// `/api/*` (Ollama).
    Ollama,
    /// `/v1/runs` (the native runs API).
    Runs,
    /// `/v1/messages/count_tokens` (a token count: no tokens billed).
    CountTokens,
}

impl ClientApi {
    pub fn as_str(self) -> &'static str {
        match self {
            ClientApi::OpenAi => "openai",
            ClientApi::Responses => "responses",
            ClientApi::Messages => "messages",
            ClientApi::Ollama => "ollama",
            ClientApi::Runs => "runs",
            ClientApi::CountTokens => "count_tokens",
        }
    }
}

/// How errors look in a client API.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorShape {
    /// `{"error": {"message", "type", "param", "code"}}` (OpenAI, Responses, runs, admin).
    OpenAi,
    /// `{"type": "error", "error": {"type", "message"}}`.
    Anthropic,
    /// `{"error": "message"}`.
    Ollama,
}

impl ErrorShape {
    /// The error body.
    pub fn body(self, error: &ApiError) -> Value {
        match self {
            ErrorShape::OpenAi => openai::error::body(error),
            ErrorShape::Anthropic => messages::error::body(error),
            ErrorShape::Ollama => ollama::error::body(error),
        }
    }
}

/// What a renderer needs to know of the answer it writes.
#[derive(Debug, Clone)]
pub struct AnswerMeta {
    /// The run or tunnel id the answer's ids are made from.
    pub id: String,
    /// The model group, as the client names the model.
    pub model: String,
    pub received: Instant,
    pub dispatched: Instant,
    pub created: SystemTime,
}

impl Surface {
    /// The API the usage ledger names.
    pub fn api(self) -> ClientApi {
        match self {
            Surface::OpenAi(_) => ClientApi::OpenAi,
            Surface::Responses => ClientApi::Responses,
            Surface::Messages => ClientApi::Messages,
            Surface::Ollama(_) => ClientApi::Ollama,
        }
    }

    pub fn error_shape(self) -> ErrorShape {
        match self {
            Surface::OpenAi(_) | Surface::Responses => ErrorShape::OpenAi,
            Surface::Messages => ErrorShape::Anthropic,
            Surface::Ollama(_) => ErrorShape::Ollama,
        }
    }

    /// Where a client lists the models it may use (named when a model is not found).
    pub fn models_endpoint(self) -> &'static str {
        match self {
            Surface::Ollama(_) => "GET /api/tags",
            _ => "GET /v1/models",
        }
    }

    /// Reads and checks a client's request and decodes it into the canonical form.
    pub fn decode<'a>(self, body: &'a [u8], headers: &HeaderMap) -> Result<Decoded<'a>, ApiError> {
        match self {
            Surface::OpenAi(op) => openai::decode(op, body),
            Surface::Responses => responses::request::decode(body, headers),
            Surface::Messages => messages::request::decode(body, headers),
            Surface::Ollama(endpoint) => ollama::decode(endpoint, body),
        }
    }

    /// Headers every answer to `decoded` carries: for the Responses API, the built-in
    /// tools its translation left out (`x-iop-dropped-tools`).
    pub fn notes(self, decoded: &Decoded) -> Option<(&'static str, String)> {
        match self {
            Surface::Responses => {
                let dropped = responses::request::dropped_tools(&decoded.native.request);
                (!dropped.is_empty()).then(|| ("x-iop-dropped-tools", dropped.join(",")))
            }
            _ => None,
        }
    }

    /// The renderer of an answer to `decoded`.
    pub fn renderer(self, decoded: &Decoded, meta: AnswerMeta) -> Renderer {
        let streaming = decoded.stream;
        let timing = Timing {
            received: meta.received,
            dispatched: meta.dispatched,
        };
        let created = meta
            .created
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        match self {
            Surface::OpenAi(op) => Renderer::OpenAi(OpenAiWriter::new(
                op,
                &meta.id,
                created,
                meta.model,
                openai::include_usage(&decoded.native.request),
                streaming,
            )),
            Surface::Responses => {
                let request = decoded.native.request.to_map();
                Renderer::Responses(ResponseWriter::new(
                    ResponseMeta {
                        id: format!("resp_{}", meta.id),
                        created_at: created,
                        model: meta.model,
                        echo: responses::render::echo(&request),
                        namespaced: responses::request::namespaced_names(&request),
                    },
                    streaming,
                ))
            }
            Surface::Messages => Renderer::Messages(MessageWriter::new(
                format!("msg_{}", meta.id),
                meta.model,
                streaming,
            )),
            Surface::Ollama(endpoint) => {
                let writer = match endpoint {
                    ollama::Endpoint::Chat => ollama::render::Endpoint::Chat,
                    ollama::Endpoint::Generate => ollama::render::Endpoint::Generate,
                    ollama::Endpoint::Embed => {
                        let w = EmbedWriter::new(Embeddings::Embed, meta.model, timing);
                        return Renderer::OllamaEmbed(w);
                    }
                    ollama::Endpoint::Embeddings => {
                        let w = EmbedWriter::new(Embeddings::Legacy, meta.model, timing);
                        return Renderer::OllamaEmbed(w);
                    }
                };
                Renderer::Ollama(OllamaWriter::new(writer, meta.model, timing, streaming))
            }
        }
    }

    /// The answer to a request the edge answers itself (see [`Immediate`]).
    pub fn immediate(self, immediate: Immediate, model: &str, wall: SystemTime) -> Value {
        let endpoint = match self {
            Surface::Ollama(ollama::Endpoint::Generate) => ollama::render::Endpoint::Generate,
            _ => ollama::render::Endpoint::Chat,
        };
        match (immediate, self) {
            (Immediate::Load { unload }, _) => {
                ollama::render::loaded(endpoint, model, unload, wall)
            }
            (Immediate::NoInput, Surface::Ollama(ollama::Endpoint::Embeddings)) => {
                ollama::embed::embedding(Vec::new())
            }
            (Immediate::NoInput, _) => json!({"model": model, "embeddings": []}),
        }
    }

    /// The event that ends a natively served stream (the provider's own bytes) when its
    /// tunnel fails mid-body; `None` where the API's streams are not event streams.
    pub fn native_stream_error(self, error: &ApiError) -> Option<Vec<u8>> {
        let event = match self {
            Surface::OpenAi(_) => return Some(openai::error::event(error)),
            Surface::Responses => responses::render::error_event(error),
            Surface::Messages => messages::error::event(error),
            Surface::Ollama(_) => return None,
        };
        let mut out = Vec::new();
        event.write(&mut out);
        Some(out)
    }
}

/// Writes one answer in a client API's shape: streamed (bytes per event) or whole (a
/// document once the answer finished).
#[derive(Debug)]
pub enum Renderer {
    OpenAi(OpenAiWriter),
    Responses(ResponseWriter),
    Messages(MessageWriter),
    Ollama(OllamaWriter),
    OllamaEmbed(EmbedWriter),
}

impl Renderer {
    /// The content type of a stream.
    pub fn stream_type(&self) -> &'static str {
        match self {
            Renderer::Ollama(_) | Renderer::OllamaEmbed(_) => crate::codec::NDJSON,
            _ => crate::codec::EVENT_STREAM,
        }
    }

    /// Whether a stream holds the whole answer (the Responses API repeats it in its
    /// closing events), so the edge's answer size limit applies to it.
    pub fn holds_answer(&self) -> bool {
        matches!(self, Renderer::Responses(_))
    }

    /// The bytes that open a stream.
    pub fn open(&mut self, out: &mut Vec<u8>) {
        let mut events = Vec::new();
        match self {
            Renderer::Responses(w) => w.start(&mut events),
            Renderer::Messages(w) => w.start(&mut events),
            _ => return,
        }
        for e in events {
            e.write(out);
        }
    }

    /// One event at `now` (`wall` for the clock an API shows): a stream's bytes go to
    /// `out`, a whole answer collects it.
    pub fn push(&mut self, event: AnswerEvent, now: Instant, wall: SystemTime, out: &mut Vec<u8>) {
        let mut events = Vec::new();
        match self {
            Renderer::OpenAi(w) => w.push(event, out),
            Renderer::Ollama(w) => w.push(event, now, wall, out),
            Renderer::OllamaEmbed(w) => w.push(event, now),
            Renderer::Responses(w) => w.push(event, &mut events),
            Renderer::Messages(w) => w.push(event, &mut events),
        }
        for e in events {
            e.write(out);
        }
    }

    /// The whole answer, once it finished.
    pub fn document(&self) -> Option<&Value> {
        match self {
            Renderer::OpenAi(w) => w.document(),
            Renderer::Responses(w) => w.finished(),
            Renderer::Messages(w) => w.finished(),
            Renderer::Ollama(w) => w.document(),
            Renderer::OllamaEmbed(w) => w.document(),
        }
    }
}

#[cfg(test)]
mod tests;
