//! One finished request as the ledger keeps it ([`UsageRecord`]), and the names its
//! fields take (the API a request came in on, how it reached its provider).

use serde::Serialize;

/// The name recorded for requests on an edge without API keys.
pub const ANONYMOUS_KEY: &str = "anonymous";

/// The outcome of a request that succeeded.
pub const OUTCOME_OK: &str = "ok";

/// The client API a request came in on.
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
}

impl ClientApi {
    pub fn as_str(self) -> &'static str {
        match self {
            ClientApi::OpenAi => "openai",
            ClientApi::Responses => "responses",
            ClientApi::Messages => "messages",
            ClientApi::Ollama => "ollama",
        }
    }
}

/// One finished request: who asked, what served it, what it cost and how it ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct UsageRecord {
    /// When the request arrived, in milliseconds since the Unix epoch.
    pub time_ms: i64,
    /// The API key's name, or [`ANONYMOUS_KEY`].
    pub key: String,
    /// The model group asked for (empty when the request named none the edge could read).
    pub group: String,
    /// The node and provider that served it (empty when it never reached one).
    pub node: String,
    pub provider: String,
    /// `tunnel`, `run` or `none` (answered by the edge itself).
    pub path: &'static str,
    /// `openai`, `responses`, `messages` or `ollama`.
    pub api: &'static str,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub reasoning_tokens: u64,
    pub cached_tokens: u64,
    /// From arrival to the end of the response.
    pub latency_ms: u64,
    /// From arrival to the first token (body bytes or a delta), when there was one.
    pub ttft_ms: Option<u64>,
    /// `ok`, or the error code the request ended with (`client_abort` when the client
    /// left first).
    pub outcome: String,
    /// The HTTP status the client got.
    pub status: u16,
    /// Members tried.
    pub attempts: u32,
}

impl UsageRecord {
    pub fn is_ok(&self) -> bool {
        self.outcome == OUTCOME_OK
    }

    /// Input plus output tokens: what `tokens_per_day` limits count.
    pub fn billed_tokens(&self) -> u64 {
        self.input_tokens.saturating_add(self.output_tokens)
    }
}

/// The outcome of a request whose provider answered with an error status (and nothing
/// more specific was known).
pub fn provider_status_outcome(status: u16) -> &'static str {
    match status {
        400 | 422 => "bad_request",
        401 | 403 => "provider_auth",
        404 => "unknown_target",
        413 => "request_too_large",
        429 => "provider_rate_limited",
        503 => "provider_overloaded",
        400..=499 => "bad_request",
        _ => "provider_error",
    }
}
