//! Counting a prompt's tokens with a model group's own tokenizer, for
//! `/v1/messages/count_tokens`: the group's OpenAI-compatible members are asked in order
//! (the `tokens.count` node command) — a member that serves Messages gets the client's
//! request as it is, any other the translated chat request — and the first count wins.
//! Each member (node and provider) is asked at most once per count, and all of them
//! within [`COUNT_LOOKUP_TIMEOUT`] together. `None` when no member could count (none is
//! OpenAI-compatible, none is connected, none has a tokenizer endpoint, its node's
//! tokenizer places are taken, none answered in time); the caller estimates then.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use serde_json::Value;

use super::{Edge, provider_of};
use crate::config::ProviderApi;
use crate::ledger::RequestRecorder;

/// How long the members of a group may take to count, all together: the client is
/// waiting, and the estimate is there when no member answers in time.
pub const COUNT_LOOKUP_TIMEOUT: Duration = Duration::from_secs(5);

/// A count and who made it: `provider` (the member's own count_tokens) or `tokenizer`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenCount {
    pub input_tokens: u64,
    pub counted_by: String,
}

/// A count request's two forms as JSON objects without `model`: the client's Messages
/// request and its chat translation.
#[derive(Debug, Clone)]
pub struct CountBodies {
    pub messages: String,
    pub chat: String,
}

/// `body` (a JSON object without `model`) with `model` first.
fn with_model(body: &str, model: &str) -> String {
    let model = Value::from(model).to_string();
    let rest = body.strip_prefix('{').unwrap_or(body).trim_start();
    let mut out = String::with_capacity(body.len() + model.len() + 10);
    out.push_str("{\"model\":");
    out.push_str(&model);
    if !rest.starts_with('}') {
        out.push(',');
    }
    out.push_str(rest);
    out
}

impl Edge {
    /// The tokens of a count request (`bodies`) as a member of `group` counts them; the
    /// member that counted goes on the request's record.
    pub async fn count_tokens(
        &self,
        group: &str,
        bodies: &CountBodies,
        recorder: &RequestRecorder,
    ) -> Option<TokenCount> {
        let asked = async {
            let config = self.config();
            let members = &config
                .model_groups
                .iter()
                .find(|g| g.name == group)?
                .members;
            let mut tried = HashSet::new();
            for member in members {
                let Some(provider) = provider_of(&config, &member.node, &member.provider) else {
                    continue;
                };
                if !provider.enabled
                    || !provider.kind.is_tunnel()
                    || !tried.insert((member.node.clone(), member.provider.clone()))
                {
                    continue;
                }
                let serves_messages = provider.served_apis().any(|a| a == ProviderApi::Messages);
                let (api, body) = if serves_messages {
                    ("messages", &bodies.messages)
                } else {
                    ("chat", &bodies.chat)
                };
                let upstream = member.model.as_deref().unwrap_or(group);
                let args = HashMap::from([
                    ("api".to_string(), api.to_string()),
                    ("body".to_string(), with_model(body, upstream)),
                ]);
                match self
                    .node_command(&member.node, "tokens.count", &member.provider, args)
                    .await
                {
                    Ok(answer) => {
                        let tokens = answer.get("input_tokens").and_then(Value::as_u64);
                        let by = answer.get("counted_by").and_then(Value::as_str);
                        if let (Some(input_tokens), Some(by)) = (tokens, by) {
                            recorder.counted_by(&member.node, &member.provider);
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
        };
        tokio::time::timeout(COUNT_LOOKUP_TIMEOUT, asked)
            .await
            .unwrap_or_else(|_| {
                tracing::debug!(group, "no member counted within {COUNT_LOOKUP_TIMEOUT:?}");
                None
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_member_model_goes_first_in_the_body() {
        let parsed = |s: String| serde_json::from_str::<Value>(&s).unwrap();
        assert_eq!(
            parsed(with_model(r#"{"messages":[1]}"#, "m\"x")),
            serde_json::json!({"model": "m\"x", "messages": [1]})
        );
        assert_eq!(
            parsed(with_model("{}", "m")),
            serde_json::json!({"model": "m"})
        );
    }
}
