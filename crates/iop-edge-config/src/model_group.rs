//! The model groups the edge serves: the public name, its members (node, provider,
//! upstream model), the long-context threshold and the queue.

use serde::Deserialize;

use super::{DEFAULT_QUEUE_MAX_WAITING, DEFAULT_QUEUE_TIMEOUT_SEC, FieldError, NodeConfig};

/// The longest `queue.wait_for_reconnect_sec`.
pub const MAX_WAIT_FOR_RECONNECT_SEC: u64 = 3600;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelGroupConfig {
    /// The public model name clients send.
    pub name: String,
    pub members: Vec<MemberConfig>,
    /// Requests whose estimated context reaches this many tokens need a long slot.
    #[serde(default)]
    pub long_context_tokens: Option<u64>,
    #[serde(default)]
    pub queue: QueueConfig,
    /// The model's context length in tokens, as `/v1/models` and the Ollama API report it.
    #[serde(default)]
    pub context_length: Option<u64>,
    /// Who the model is from, as `/v1/models` reports it (`owned_by`; default `iop`).
    #[serde(default)]
    pub owned_by: Option<String>,
    /// How a request picks its member: `least_in_flight`, `session`, `prefix` or
    /// `session_prefix` (the default: a session key when the request has one, else the
    /// longest shared prompt prefix; see docs/admission.md).
    #[serde(default)]
    pub routing: super::RoutingPolicy,
    /// Made by the edge for a model its Ollama providers hold (`models:` on an Ollama
    /// provider), not written in the config.
    #[serde(skip)]
    pub local: bool,
}

/// Longest `owned_by`.
pub const MAX_OWNED_BY_CHARS: usize = 256;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemberConfig {
    pub node: String,
    pub provider: String,
    /// The upstream model name sent to the provider; defaults to the group's name.
    #[serde(default)]
    pub model: Option<String>,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QueueConfig {
    #[serde(default = "default_max_waiting")]
    pub max_waiting: usize,
    #[serde(default = "default_queue_timeout")]
    pub timeout_sec: u64,
    /// When no member's node is connected: how long a request waits for one to reconnect
    /// (at most `timeout_sec`); 0 fails it at once with 503.
    #[serde(default)]
    pub wait_for_reconnect_sec: u64,
}

fn default_max_waiting() -> usize {
    DEFAULT_QUEUE_MAX_WAITING
}

fn default_queue_timeout() -> u64 {
    DEFAULT_QUEUE_TIMEOUT_SEC
}

impl Default for QueueConfig {
    fn default() -> Self {
        Self {
            max_waiting: DEFAULT_QUEUE_MAX_WAITING,
            timeout_sec: DEFAULT_QUEUE_TIMEOUT_SEC,
            wait_for_reconnect_sec: 0,
        }
    }
}

impl ModelGroupConfig {
    /// Checks the group's settings and that each member names a configured node and
    /// provider; paths are under the group.
    pub fn validate(&self, nodes: &[NodeConfig]) -> Result<(), FieldError> {
        let invalid = |path: &str, message: String| Err(FieldError::new(path.into(), message));
        if self.name.trim().is_empty() {
            return invalid("name", "must not be empty".into());
        }
        if self.members.is_empty() {
            return invalid("members", "needs at least one member".into());
        }
        if self.long_context_tokens == Some(0) {
            return invalid("long_context_tokens", "must be positive".into());
        }
        if self.queue.timeout_sec == 0 {
            return invalid("queue.timeout_sec", "must be positive".into());
        }
        if self.queue.wait_for_reconnect_sec > MAX_WAIT_FOR_RECONNECT_SEC {
            return invalid(
                "queue.wait_for_reconnect_sec",
                format!("must be at most {MAX_WAIT_FOR_RECONNECT_SEC}"),
            );
        }
        if self.context_length == Some(0) {
            return invalid("context_length", "must be positive".into());
        }
        if let Some(owner) = &self.owned_by
            && (owner.trim().is_empty() || owner.chars().count() > MAX_OWNED_BY_CHARS)
        {
            return invalid(
                "owned_by",
                format!("must be 1 to {MAX_OWNED_BY_CHARS} characters"),
            );
        }
        for (m, member) in self.members.iter().enumerate() {
            member
                .validate(nodes)
                .map_err(|e| e.under(&format!("members[{m}]")))?;
        }
        Ok(())
    }
}

impl MemberConfig {
    fn validate(&self, nodes: &[NodeConfig]) -> Result<(), FieldError> {
        let Some(node) = nodes.iter().find(|n| n.id == self.node) else {
            return Err(FieldError::new(
                "node".into(),
                format!("no node with id {:?} in nodes[]", self.node),
            ));
        };
        if !node.providers.iter().any(|p| p.id == self.provider) {
            return Err(FieldError::new(
                "provider".into(),
                format!(
                    "node {:?} has no provider with id {:?}",
                    self.node, self.provider
                ),
            ));
        }
        if self.model.as_deref().is_some_and(|m| m.trim().is_empty()) {
            return Err(FieldError::new(
                "model".into(),
                "must not be empty when given".into(),
            ));
        }
        Ok(())
    }
}
