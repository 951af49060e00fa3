//! Adapters: one per provider kind, each a real client of its backend's protocol. An
//! adapter turns a run into events on a [`RunSink`]; OpenAI-compatible ones also expose
//! their HTTP endpoint for the raw tunnel.
//!
//! Cancellation is by drop: the run manager drops `execute`'s future when the run is
//! cancelled, which closes the provider connection (HTTP) or kills the process group
//! (CLI).

pub mod cli;
#[cfg(test)]
pub(crate) mod closing_provider;
pub mod http;
pub mod mock;
pub mod model_info;
pub mod ollama;
pub mod openai_compat;
pub mod plain;
pub mod token_count;
pub mod tokenizer;

use iop_proto::ErrorCode;
use std::sync::Arc;

use async_trait::async_trait;
use iop_proto::pb;
use serde::Serialize;

use crate::sink::RunSink;
pub use http::{HttpClients, HttpProvider};

/// What an adapter runs.
#[derive(Debug, Clone, Default)]
pub struct RunInput {
    pub run_id: String,
    pub target: String,
    pub input: String,
    pub messages: Vec<pb::ChatMessage>,
    pub options: pb::GenerationOptions,
    pub session_id: String,
    /// Headers for the provider request (`RunRequest.provider_headers`).
    pub provider_headers: Vec<pb::Header>,
    /// The API key the run is for (`RunRequest.owner`; empty for none).
    pub owner: String,
}

impl RunInput {
    /// Chat messages; a plain input becomes one user message.
    pub fn chat_messages(&self) -> Vec<pb::ChatMessage> {
        if self.messages.is_empty() {
            vec![pb::ChatMessage {
                role: "user".into(),
                content: self.input.clone(),
                ..Default::default()
            }]
        } else {
            self.messages.clone()
        }
    }

    /// The chat messages as JSON `{role, content}` objects.
    pub fn messages_json(&self) -> Vec<serde_json::Value> {
        self.chat_messages()
            .iter()
            .map(|m| serde_json::json!({"role": m.role, "content": m.content}))
            .collect()
    }

    /// The generation options that are set, as JSON fields; `max_tokens_key` is the
    /// backend's name for the length limit.
    pub fn options_json(&self, max_tokens_key: &str) -> serde_json::Map<String, serde_json::Value> {
        use serde_json::json;
        let o = &self.options;
        let mut fields = serde_json::Map::new();
        if let Some(n) = o.max_tokens {
            fields.insert(max_tokens_key.into(), json!(n));
        }
        if let Some(t) = o.temperature {
            fields.insert("temperature".into(), json!(t));
        }
        if let Some(p) = o.top_p {
            fields.insert("top_p".into(), json!(p));
        }
        if !o.stop.is_empty() {
            fields.insert("stop".into(), json!(o.stop));
        }
        if let Some(s) = o.seed {
            fields.insert("seed".into(), json!(s));
        }
        fields
    }

    /// The text a program-style backend reads: the plain input, or the last user message.
    pub fn prompt_text(&self) -> String {
        if !self.input.is_empty() {
            return self.input.clone();
        }
        self.messages
            .iter()
            .rev()
            .find(|m| m.role == "user")
            .or(self.messages.last())
            .map(|m| m.content.clone())
            .unwrap_or_default()
    }
}

/// A failed run, with its typed reason (the edge maps it to a status and decides on
/// retries). The message is for humans: it names the provider by id, never by address.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct AdapterError {
    pub code: ErrorCode,
    pub message: String,
}

impl AdapterError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    pub fn not_supported(what: &str) -> Self {
        Self::new(ErrorCode::NotSupported, what)
    }

    /// The error as it goes on the wire.
    pub fn to_wire(&self) -> pb::RunError {
        pb::RunError::new(self.code, self.message.clone())
    }
}

impl From<crate::sink::SinkClosed> for AdapterError {
    fn from(_: crate::sink::SinkClosed) -> Self {
        AdapterError::new(ErrorCode::NodeDisconnected, "the run's stream closed")
    }
}

/// A live logical session (CLI processes kept across runs).
#[derive(Debug, Clone, Serialize)]
pub struct SessionInfo {
    pub target: String,
    pub session_id: String,
    pub pid: Option<u32>,
    pub age_sec: u64,
    /// Seconds since its last turn ended; `None` while a turn runs.
    pub idle_sec: Option<u64>,
}

#[async_trait]
pub trait Adapter: Send + Sync + std::fmt::Debug + 'static {
    /// Runs to completion, writing events to `sink`. Returning without a terminal is
    /// allowed: the run manager synthesizes one.
    async fn execute(&self, input: RunInput, sink: &mut RunSink) -> Result<(), AdapterError>;

    /// The HTTP endpoint behind this adapter, for the raw tunnel (OpenAI-compatible only).
    fn tunnel(&self) -> Option<&openai_compat::OpenAiCompatAdapter> {
        None
    }

    /// The Ollama client, for the `ollama.*` commands.
    fn ollama(&self) -> Option<&ollama::OllamaAdapter> {
        None
    }

    fn supports_sessions(&self) -> bool {
        false
    }

    async fn terminate_session(
        &self,
        _target: &str,
        _session_id: &str,
    ) -> Result<(), AdapterError> {
        Err(AdapterError::not_supported(
            "this adapter has no logical sessions to terminate",
        ))
    }

    fn sessions(&self) -> Vec<SessionInfo> {
        Vec::new()
    }
}

/// Builds the adapter for a provider spec; the error says which field is wrong.
pub fn build(spec: &pb::ProviderSpec, client: &HttpClients) -> Result<Arc<dyn Adapter>, String> {
    let adapter: Arc<dyn Adapter> = match spec.kind() {
        pb::ProviderKind::Mock => Arc::new(mock::MockAdapter::new(
            spec.mock.clone().unwrap_or_default(),
        )),
        pb::ProviderKind::OpenaiCompat => Arc::new(openai_compat::OpenAiCompatAdapter::new(
            HttpProvider::new(spec, client)?,
            crate::usage::UsageDialect::OpenAi,
        )),
        pb::ProviderKind::Vllm => Arc::new(openai_compat::OpenAiCompatAdapter::new(
            HttpProvider::new(spec, client)?,
            crate::usage::UsageDialect::Vllm,
        )),
        pb::ProviderKind::Ollama => {
            Arc::new(ollama::OllamaAdapter::new(HttpProvider::new(spec, client)?))
        }
        pb::ProviderKind::Cli => Arc::new(cli::CliAdapter::new(
            spec.cli
                .clone()
                .ok_or_else(|| "kind cli needs cli.argv".to_string())?,
        )?),
        pb::ProviderKind::Unspecified => {
            return Err("kind is missing or unknown to this node".into());
        }
    };
    Ok(adapter)
}

/// A kind's name as configs spell it.
pub fn kind_name(kind: pb::ProviderKind) -> &'static str {
    match kind {
        pb::ProviderKind::Mock => "mock",
        pb::ProviderKind::OpenaiCompat => "openai_compat",
        pb::ProviderKind::Vllm => "vllm",
        pb::ProviderKind::Ollama => "ollama",
        pb::ProviderKind::Cli => "cli",
        pb::ProviderKind::Unspecified => "unspecified",
    }
}

/// Builds the HTTP clients all adapters share: pooled, `TCP_NODELAY`, no proxy from the
/// environment (providers sit next to the node).
pub fn http_clients() -> HttpClients {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let builder = || {
        reqwest::Client::builder()
            .tcp_nodelay(true)
            .no_proxy()
            .connect_timeout(std::time::Duration::from_secs(10))
    };
    let reqwest = builder()
        .pool_idle_timeout(std::time::Duration::from_secs(90))
        .build()
        .expect("a TLS backend is available");
    let fresh = builder()
        .pool_max_idle_per_host(0)
        .build()
        .expect("a TLS backend is available");
    HttpClients { reqwest, fresh }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_set_options_become_fields_under_the_backend_names() {
        let input = RunInput {
            input: "hi".into(),
            options: pb::GenerationOptions {
                max_tokens: Some(7),
                seed: Some(3),
                ..Default::default()
            },
            ..Default::default()
        };
        let fields = input.options_json("num_predict");
        assert_eq!(fields.len(), 2);
        assert_eq!(fields["num_predict"], 7);
        assert_eq!(fields["seed"], 3);
        assert_eq!(
            input.messages_json(),
            vec![serde_json::json!({"role": "user", "content": "hi"})]
        );
    }
}
