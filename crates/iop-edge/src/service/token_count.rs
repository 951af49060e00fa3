//! Counting a prompt's tokens with a model group's own tokenizer, for
//! `/v1/messages/count_tokens`: the group's OpenAI-compatible members are asked in order
//! (the `tokens.count` node command) — a member that serves Messages gets the client's
//! request as it is, any other the translated chat request — and the first count wins.
//! `None` when no member could count (none is OpenAI-compatible, none is connected, none
//! has a tokenizer endpoint, none answered within 5 s); the caller estimates then.

use std::collections::HashMap;

use serde_json::{Map, Value};

use super::command::CommandError;
use super::{Edge, provider_of};
use crate::config::ProviderApi;

/// How long one member may take to count: the client is waiting, and the estimate is
/// there when no member answers in time.
const COUNT_LOOKUP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// A count and who made it: `provider` (the member's own count_tokens) or `tokenizer`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenCount {
    pub input_tokens: u64,
    pub counted_by: String,
}

impl Edge {
    /// The tokens of a Messages request (`messages`, and its chat translation `chat`) as
    /// a member of `group` counts them.
    pub async fn count_tokens(
        &self,
        group: &str,
        messages: &Map<String, Value>,
        chat: &Map<String, Value>,
    ) -> Option<TokenCount> {
        let config = self.config();
        let members = &config
            .model_groups
            .iter()
            .find(|g| g.name == group)?
            .members;
        for member in members {
            let Some(provider) = provider_of(&config, &member.node, &member.provider) else {
                continue;
            };
            if !provider.enabled || !provider.kind.is_tunnel() {
                continue;
            }
            let serves_messages = provider.served_apis().any(|a| a == ProviderApi::Messages);
            let (api, mut body) = if serves_messages {
                ("messages", messages.clone())
            } else {
                ("chat", chat.clone())
            };
            let upstream = member.model.as_deref().unwrap_or(group);
            body.insert("model".into(), upstream.into());
            let args = HashMap::from([
                ("api".to_string(), api.to_string()),
                ("body".to_string(), Value::Object(body).to_string()),
            ]);
            let lookup = self.node_command(&member.node, "tokens.count", &member.provider, args);
            match tokio::time::timeout(COUNT_LOOKUP_TIMEOUT, lookup)
                .await
                .unwrap_or(Err(CommandError::Timeout))
            {
                Ok(answer) => {
                    let tokens = answer.get("input_tokens").and_then(Value::as_u64);
                    let by = answer.get("counted_by").and_then(Value::as_str);
                    if let (Some(input_tokens), Some(by)) = (tokens, by) {
                        return Some(TokenCount {
                            input_tokens,
                            counted_by: by.to_string(),
                        });
                    }
                }
                Err(e) => tracing::debug!(
                    group,
                    node_id = member.node.as_str(),
                    provider = member.provider.as_str(),
                    error = %e,
                    "member could not count tokens"
                ),
            }
        }
        None
    }
}
