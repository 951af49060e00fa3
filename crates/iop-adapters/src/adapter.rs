//! What every adapter is: it runs a [`RunInput`] to completion as events on a
//! [`RunSink`], and may keep logical sessions (CLI processes kept across runs).

use std::any::Any;

use async_trait::async_trait;
use iop_proto::pb;
use serde::Serialize;

use super::error::AdapterError;
use crate::sink::RunSink;

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
pub trait Adapter: Any + Send + Sync + std::fmt::Debug {
    /// Runs to completion, writing events to `sink`. Returning without a terminal is
    /// allowed: the run manager synthesizes one.
    async fn execute(&self, input: RunInput, sink: &mut RunSink) -> Result<(), AdapterError>;

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
