//! The HTTP APIs a provider can serve itself, as a provider's `apis:` names them: which
//! client requests are relayed to it as they are and which are translated to chat.

use serde::Deserialize;

/// An HTTP API a provider can serve itself (`apis:`), named by its endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProviderApi {
    /// `POST /chat/completions`
    Chat,
    /// `POST /completions`
    Completions,
    /// `POST /embeddings`
    Embeddings,
    /// `POST /responses` (the OpenAI Responses API)
    Responses,
    /// `POST /messages` (the Anthropic Messages API)
    Messages,
}

impl ProviderApi {
    pub fn as_str(self) -> &'static str {
        match self {
            ProviderApi::Chat => "chat",
            ProviderApi::Completions => "completions",
            ProviderApi::Embeddings => "embeddings",
            ProviderApi::Responses => "responses",
            ProviderApi::Messages => "messages",
        }
    }

    /// The path below the provider's API root.
    pub fn provider_path(self) -> &'static str {
        match self {
            ProviderApi::Chat => "/chat/completions",
            ProviderApi::Completions => "/completions",
            ProviderApi::Embeddings => "/embeddings",
            ProviderApi::Responses => "/responses",
            ProviderApi::Messages => "/messages",
        }
    }
}
