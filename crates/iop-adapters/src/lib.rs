//! The node's provider adapters: one per provider kind, each a real client of its
//! backend's protocol. An adapter turns a run into events on a
//! [`RunSink`](sink::RunSink) ([`sink`], whose outlet the node chooses: the link the run
//! came on); OpenAI-compatible ones also expose their HTTP endpoint for the raw tunnel.
//! [`usage`] reads what providers report of their token use, from answers and from the
//! raw bytes the tunnel relays.

pub mod adapter;
pub mod cli;
#[cfg(test)]
pub(crate) mod closing_provider;
pub mod error;
pub mod http;
pub mod mock;
pub mod model_info;
pub mod ollama;
pub mod openai_compat;
pub mod plain;
pub mod sink;
pub mod token_count;
pub mod tokenizer;
pub mod usage;

use std::sync::Arc;

use iop_proto::pb;
use std::any::Any;

pub use adapter::{Adapter, RunInput};
pub use error::AdapterError;
pub use http::{HttpClients, HttpProvider};

/// What only some adapters have, found by their type.
impl dyn Adapter {
    /// The HTTP endpoint behind this adapter, for the raw tunnel (OpenAI-compatible only).
    pub fn tunnel(&self) -> Option<&openai_compat::OpenAiCompatAdapter> {
        (self as &dyn Any).downcast_ref()
    }

    /// The Ollama client, for the `ollama.*` commands.
    pub fn ollama(&self) -> Option<&ollama::OllamaAdapter> {
        (self as &dyn Any).downcast_ref()
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
