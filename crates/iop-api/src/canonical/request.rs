//! The canonical request: what every surface decodes a client's request into.
//!
//! Its body is an OpenAI request — chat completions, completions or embeddings
//! ([`Operation`]) — as the OpenAI surface validates it: the form most providers take, so
//! the provider codecs only rewrite it for a tunnelled provider (`codec::openai_request`)
//! or map it onto a node run (`codec::run`). A client of the OpenAI API sends it as it is;
//! the Responses, Messages and Ollama surfaces translate theirs into it.
//!
//! Beside it travels the client's own request in its own API ([`Native`]): a member
//! whose provider serves that API itself gets it untouched (only `model` rewritten), the
//! fast path. A request whose translation was refused (a field the canonical form cannot
//! carry) can still be served by such a member.
//!
//! Pure: no I/O.

use iop_proto::pb;
use serde_json::Value;

use super::error::ApiError;
use super::json::ClientRequest;
use crate::provider_api::ProviderApi;

/// What a client asks a model group for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    Chat,
    Completion,
    Embedding,
}

impl Operation {
    /// The provider API that serves it.
    pub fn api(self) -> ProviderApi {
        match self {
            Operation::Chat => ProviderApi::Chat,
            Operation::Completion => ProviderApi::Completions,
            Operation::Embedding => ProviderApi::Embeddings,
        }
    }

    /// Whether the answer is generated text (and streams).
    pub fn generates(self) -> bool {
        self != Operation::Embedding
    }
}

/// An API in which a client's request can go to a provider that serves it itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NativeApi {
    /// An API a tunnelled (OpenAI-compatible) provider lists in its `apis`.
    Provider(ProviderApi),
    /// Ollama's own API, served by `ollama` providers, at this path.
    Ollama(&'static str),
}

impl NativeApi {
    /// The path below the provider's API root.
    pub fn path(self) -> &'static str {
        match self {
            NativeApi::Provider(api) => api.provider_path(),
            NativeApi::Ollama(path) => path,
        }
    }

    /// Whether a streamed request in this API can ask for usage in its stream
    /// (`stream_options.include_usage`), so the edge may add that for its accounting.
    pub fn takes_stream_usage(self) -> bool {
        matches!(
            self,
            NativeApi::Provider(ProviderApi::Chat | ProviderApi::Completions)
        )
    }
}

/// The client's request in its own API.
#[derive(Debug)]
pub struct Native<'a> {
    pub api: NativeApi,
    pub request: ClientRequest<'a>,
    /// Client headers the provider's API reads (e.g. `anthropic-version`).
    pub headers: Vec<pb::Header>,
}

/// Where the canonical body of a decoded request is.
#[derive(Debug)]
pub enum Canonical {
    /// The client's own request is it (an OpenAI client's).
    Client,
    /// The client's request translated into it (JSON).
    Translated(Vec<u8>),
    /// It has none: what the translation refused. Only a member that serves the client's
    /// API itself can serve the request.
    Refused(ApiError),
}

/// An answer the edge gives without a member, once the request was admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Immediate {
    /// Nothing to generate: the client only asks for the model to be loaded (or, with
    /// `unload`, unloaded), as Ollama clients do.
    Load { unload: bool },
    /// An embedding of no input: no vectors.
    NoInput,
}

/// A client's request as its surface decoded it.
#[derive(Debug)]
pub struct Decoded<'a> {
    /// The model group it names.
    pub model: String,
    pub op: Operation,
    pub stream: bool,
    pub native: Native<'a>,
    pub canonical: Canonical,
    /// The most output tokens it asks for, if it says.
    pub max_output_tokens: Option<u64>,
    /// An answer the edge gives without a member: after admission, nothing is
    /// dispatched.
    pub immediate: Option<Immediate>,
}

impl<'a> Decoded<'a> {
    /// A request whose canonical form is the client's own (OpenAI) request.
    pub fn openai(model: String, op: Operation, stream: bool, request: ClientRequest<'a>) -> Self {
        let max_output_tokens = request
            .get::<u64>("max_completion_tokens")
            .or_else(|| request.get::<u64>("max_tokens"));
        Self {
            model,
            op,
            stream,
            native: Native {
                api: NativeApi::Provider(op.api()),
                request,
                headers: Vec::new(),
            },
            canonical: Canonical::Client,
            max_output_tokens,
            immediate: None,
        }
    }
}

/// A request for a model group, ready for the service: the decoded request with its
/// canonical body parsed.
#[derive(Debug, Clone, Copy)]
pub struct ModelRequest<'r> {
    pub group: &'r str,
    pub op: Operation,
    pub stream: bool,
    pub native: &'r Native<'r>,
    /// The canonical body, or why there is none.
    pub canonical: Result<&'r ClientRequest<'r>, &'r ApiError>,
    pub max_output_tokens: Option<u64>,
    /// The session key the client sent, if any (`crate::routing::session`).
    pub session: Option<&'r str>,
    /// A background Responses request: the provider streams it (`stream` is true) and is
    /// not told it is a background one; the edge answers at once and keeps it going.
    pub background: bool,
}

/// What the lane estimate reads of a request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LaneInputs {
    /// Characters of the prompt: every message's text (chat), the prompt, or the input.
    pub prompt_chars: u64,
    /// `max_completion_tokens`, else `max_tokens`, else 0.
    pub max_tokens: u64,
}

/// The canonical fields that hold a prompt.
const PROMPT_FIELDS: &[&str] = &["messages", "prompt", "input", "tools"];

/// The input tokens the edge estimates for a canonical request (its prompt fields' JSON,
/// four bytes a token), as admission reserves them.
pub fn estimate_input_tokens(canonical: &ClientRequest) -> u64 {
    let bytes: usize = PROMPT_FIELDS
        .iter()
        .filter_map(|f| canonical.raw(f))
        .map(|raw| raw.get().len())
        .sum();
    (bytes as u64).div_ceil(4)
}

impl ModelRequest<'_> {
    /// What the lane estimate reads: characters of the prompt's text (this walks every
    /// message, so it is asked only for groups with a long-context threshold).
    pub fn lane_inputs(&self) -> LaneInputs {
        let max_tokens = self.max_output_tokens.unwrap_or(0);
        match self.canonical {
            Ok(canonical) => LaneInputs {
                prompt_chars: prompt_chars(canonical, self.op),
                max_tokens,
            },
            // Served natively only: the whole body stands for the prompt.
            Err(_) => LaneInputs {
                prompt_chars: self.native.request.raw_len() as u64,
                max_tokens,
            },
        }
    }

    /// The input tokens estimated without reading the prompt: a quarter of the bytes of
    /// its JSON (messages, prompt or input, and tools). An estimate, marked as one
    /// wherever it is used; it never replaces what a provider reports.
    pub fn input_estimate(&self) -> u64 {
        match self.canonical {
            Ok(canonical) => estimate_input_tokens(canonical),
            Err(_) => (self.native.request.raw_len() as u64).div_ceil(4),
        }
    }
}

/// Characters of the prompt's text: every message's text content, the prompt or the
/// input.
fn prompt_chars(request: &ClientRequest, op: Operation) -> u64 {
    let chars = match op {
        Operation::Chat => request
            .value("messages")
            .as_array()
            .map(|messages| {
                messages
                    .iter()
                    .map(|m| content_chars(m.get("content")))
                    .sum()
            })
            .unwrap_or(0),
        Operation::Completion => text_chars(&request.value("prompt")),
        Operation::Embedding => text_chars(&request.value("input")),
    };
    chars as u64
}

/// Characters of a message's `content`: a string, or the text parts of an array.
fn content_chars(content: Option<&Value>) -> usize {
    match content {
        Some(Value::String(s)) => s.chars().count(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .map(|t| t.chars().count())
            .sum(),
        _ => 0,
    }
}

/// Characters of a string, or of the strings of an array (one between each).
fn text_chars(value: &Value) -> usize {
    match value {
        Value::String(s) => s.chars().count(),
        Value::Array(items) => {
            let texts: Vec<&str> = items.iter().filter_map(Value::as_str).collect();
            texts.iter().map(|t| t.chars().count()).sum::<usize>() + texts.len().saturating_sub(1)
        }
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn request(body: &Value, op: Operation) -> (String, Operation) {
        (body.to_string(), op)
    }

    fn lane((body, op): (String, Operation)) -> LaneInputs {
        let client = ClientRequest::parse(body.as_bytes()).unwrap();
        let decoded = Decoded::openai("g".into(), op, false, client);
        let model = ModelRequest {
            group: "g",
            op,
            stream: false,
            native: &decoded.native,
            canonical: Ok(&decoded.native.request),
            max_output_tokens: decoded.max_output_tokens,
            session: None,
            background: false,
        };
        model.lane_inputs()
    }

    #[test]
    fn the_lane_reads_prompt_characters_and_max_tokens() {
        let r = json!({"messages": [{"role": "user", "content": "abcdefgh"}], "max_tokens": 10});
        assert_eq!(
            lane(request(&r, Operation::Chat)),
            LaneInputs {
                prompt_chars: 8,
                max_tokens: 10
            }
        );
        let r =
            json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "abcd"}]}]});
        assert_eq!(lane(request(&r, Operation::Chat)).prompt_chars, 4);
        let r = json!({"prompt": "abcde", "max_completion_tokens": 1, "max_tokens": 9});
        assert_eq!(
            lane(request(&r, Operation::Completion)),
            LaneInputs {
                prompt_chars: 5,
                max_tokens: 1
            }
        );
        let r = json!({"input": ["ab", "cd"]});
        assert_eq!(lane(request(&r, Operation::Embedding)).prompt_chars, 5);
    }

    #[test]
    fn the_input_estimate_is_a_quarter_of_the_prompts_bytes() {
        let body = r#"{"model":"g","messages":[{"role":"user","content":"hi"}],"temperature":1}"#;
        let client = ClientRequest::parse(body.as_bytes()).unwrap();
        let decoded = Decoded::openai("g".into(), Operation::Chat, false, client);
        let request = ModelRequest {
            group: "g",
            op: Operation::Chat,
            stream: false,
            native: &decoded.native,
            canonical: Ok(&decoded.native.request),
            max_output_tokens: None,
            session: None,
            background: false,
        };
        let messages = r#"[{"role":"user","content":"hi"}]"#.len() as u64;
        assert_eq!(request.input_estimate(), messages.div_ceil(4));
    }
}
