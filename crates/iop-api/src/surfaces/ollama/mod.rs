//! Ollama's API as a codec, so Ollama clients (Open WebUI, the `ollama` libraries) can use
//! iop as their Ollama: `/api/chat`, `/api/generate`, `/api/embed` and the older
//! `/api/embeddings` decode into the canonical request ([`decode`]); answers render as
//! Ollama's NDJSON or JSON ([`render`], [`embed`]); errors take Ollama's shape
//! (`{"error": "…"}`, [`error`]).
//!
//! An `ollama` member gets the client's own request (only `model` rewritten) and its
//! answer comes back byte for byte (every Ollama option, `keep_alive`, `raw`, `context`
//! and all); every other member gets the canonical translation ([`translate`]).
//!
//! Pure: no I/O.

pub mod embed;
pub mod error;
pub mod render;
pub mod request;
pub mod translate;

use crate::canonical::{
    ApiError, Canonical, ClientRequest, Decoded, Immediate, Native, NativeApi, Operation,
};
use request::{ChatRequest, EmbedRequest, EmbeddingsRequest, GenerateRequest};

/// An Ollama endpoint that asks a model for something.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Generate,
    Embed,
    Embeddings,
}

impl Endpoint {
    /// The endpoint's path on an Ollama server.
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Chat => "/api/chat",
            Endpoint::Generate => "/api/generate",
            Endpoint::Embed => "/api/embed",
            Endpoint::Embeddings => "/api/embeddings",
        }
    }
}

/// What decoding one request found, before it is put together.
struct Parts {
    model: String,
    op: Operation,
    stream: bool,
    canonical: serde_json::Value,
    max_output_tokens: Option<u64>,
    immediate: Option<Immediate>,
}

/// The parts of a chat or generate request; `empty`: it asks for nothing but to load (or,
/// with `keep_alive: 0`, unload) the model.
fn generation_parts(
    generation: request::Generation,
    op: Operation,
    canonical: serde_json::Value,
    empty: bool,
) -> Result<Parts, ApiError> {
    let options = generation.options()?;
    Ok(Parts {
        immediate: empty.then(|| Immediate::Load {
            unload: request::unloads(generation.keep_alive.as_ref()),
        }),
        canonical,
        op,
        stream: generation.stream(),
        max_output_tokens: options.max_tokens,
        model: generation.model,
    })
}

/// Reads and checks a request of `endpoint` and translates it into the canonical form.
pub fn decode(endpoint: Endpoint, body: &[u8]) -> Result<Decoded<'_>, ApiError> {
    let parts = match endpoint {
        Endpoint::Chat => {
            let r = ChatRequest::parse(body)?;
            let canonical = r.canonical()?;
            let empty = r.fields.messages.is_empty();
            generation_parts(r.generation, Operation::Chat, canonical, empty)?
        }
        Endpoint::Generate => {
            let r = GenerateRequest::parse(body)?;
            let (op, canonical) = r.canonical()?;
            let empty = r.fields.prompt.is_empty() && r.fields.images.is_empty();
            generation_parts(r.generation, op, canonical, empty)?
        }
        Endpoint::Embed => {
            let r: EmbedRequest = request::parse(body)?;
            Parts {
                immediate: matches!(r.texts()[..], [] | [""]).then_some(Immediate::NoInput),
                canonical: r.canonical(),
                op: Operation::Embedding,
                stream: false,
                max_output_tokens: None,
                model: r.model,
            }
        }
        Endpoint::Embeddings => {
            let r: EmbeddingsRequest = request::parse(body)?;
            Parts {
                immediate: r.prompt.is_empty().then_some(Immediate::NoInput),
                canonical: r.canonical(),
                op: Operation::Embedding,
                stream: false,
                max_output_tokens: None,
                model: r.model,
            }
        }
    };
    Ok(Decoded {
        model: parts.model,
        op: parts.op,
        stream: parts.stream,
        native: Native {
            api: NativeApi::Ollama(endpoint.path()),
            request: ClientRequest::parse(body)?,
            headers: Vec::new(),
        },
        canonical: Canonical::Translated(
            serde_json::to_vec(&parts.canonical).expect("JSON values serialize"),
        ),
        max_output_tokens: parts.max_output_tokens,
        immediate: parts.immediate,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_decode_into_the_canonical_form_beside_their_own() {
        let body = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"options":{"num_predict":3}}"#;
        let d = decode(Endpoint::Chat, body).unwrap();
        assert_eq!(
            (d.model.as_str(), d.op, d.stream),
            ("m", Operation::Chat, true)
        );
        assert_eq!(d.max_output_tokens, Some(3));
        assert_eq!(d.native.api, NativeApi::Ollama("/api/chat"));
        assert!(d.immediate.is_none());
        let Canonical::Translated(chat) = &d.canonical else {
            panic!("{:?}", d.canonical)
        };
        let chat = ClientRequest::parse(chat).unwrap();
        crate::surfaces::openai::validate(&chat, Operation::Chat).unwrap();

        let d = decode(Endpoint::Chat, br#"{"model":"m","keep_alive":0}"#).unwrap();
        assert_eq!(d.immediate, Some(Immediate::Load { unload: true }));
        let d = decode(
            Endpoint::Generate,
            br#"{"model":"m","prompt":"x","raw":true,"stream":false}"#,
        )
        .unwrap();
        assert_eq!((d.op, d.stream), (Operation::Completion, false));
        let d = decode(Endpoint::Embed, br#"{"model":"m","input":[]}"#).unwrap();
        assert_eq!(d.immediate, Some(Immediate::NoInput));
        let e = decode(Endpoint::Chat, br#"{"model":"m","options":{"seed":"x"}}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("options.seed"));
    }
}
