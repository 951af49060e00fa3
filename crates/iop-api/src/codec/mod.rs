//! Provider-facing codecs: the canonical request as a provider takes it and a provider's
//! answer as canonical answer events.
//!
//! - [`openai_request`]: the body for a tunnelled provider — the canonical request (or a
//!   client's native request) with the member's upstream `model`, and for a stream the
//!   usage the edge accounts by.
//! - [`openai_answer`]: an OpenAI-compatible answer (document, stream, error) as events.
//! - [`run`]: the canonical request as a node run ([`RunSpec`]), and a run's events as
//!   answer events.
//!
//! Pure: no I/O.

pub mod openai_answer;
pub mod openai_request;
pub mod run;

use bytes::Bytes;
use iop_proto::pb;

pub use run::RunSpec;

/// One HTTP request for a provider, relative to its API root.
#[derive(Debug, Clone, Default)]
pub struct TunnelSpec {
    /// The provider (adapter instance) on the node.
    pub adapter: String,
    pub method: String,
    pub path: String,
    pub headers: Vec<pb::Header>,
    pub body: Bytes,
    /// The body asks for stream usage the client did not ask for: the node removes it
    /// from the relayed stream (`ProviderTunnelRequest.usage_injected`).
    pub usage_injected: bool,
    /// The client's request id, for the node's logs (the provider gets it in `headers`).
    pub client_request_id: String,
    /// The answer is streamed (the node awaits the head for the stream timeout).
    pub stream: bool,
    /// Who asked (the API key's name; empty for none): only it may resume the answer.
    pub owner: String,
    /// How to bill it should its edge not receive its end.
    pub billing: Option<pb::Billing>,
}

/// What a client accepts back.
pub const EVENT_STREAM: &str = "text/event-stream";
pub const NDJSON: &str = "application/x-ndjson";
pub const JSON: &str = "application/json";

impl TunnelSpec {
    /// A JSON `POST` to `path` of provider `adapter`, accepting `accept`.
    pub fn post_json(adapter: &str, path: &str, body: Vec<u8>, accept: &str) -> Self {
        Self {
            adapter: adapter.to_string(),
            method: "POST".into(),
            path: path.into(),
            headers: vec![header("content-type", JSON), header("accept", accept)],
            body: body.into(),
            ..Default::default()
        }
    }
}

pub fn header(name: &str, value: &str) -> pb::Header {
    pb::Header {
        name: name.into(),
        value: value.as_bytes().to_vec(),
    }
}
