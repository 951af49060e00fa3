//! A node's providers as the edge config describes them: kind, capacity per lane, the
//! backend's address and the APIs it serves itself, CLI and mock settings, probe
//! overrides.

use std::collections::BTreeMap;

use iop_proto::pb;
use serde::Deserialize;

use super::{FieldError, MAX_CAPACITY, ProviderHealthConfig, dispatch};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProviderKind {
    Mock,
    OpenaiCompat,
    Vllm,
    Ollama,
    Cli,
}

impl ProviderKind {
    /// The kind as configs spell it.
    pub fn as_str(self) -> &'static str {
        self.wire().config_name()
    }

    /// The kind as the wire names it to a node.
    pub fn wire(self) -> pb::ProviderKind {
        match self {
            ProviderKind::Mock => pb::ProviderKind::Mock,
            ProviderKind::OpenaiCompat => pb::ProviderKind::OpenaiCompat,
            ProviderKind::Vllm => pb::ProviderKind::Vllm,
            ProviderKind::Ollama => pb::ProviderKind::Ollama,
            ProviderKind::Cli => pb::ProviderKind::Cli,
        }
    }

    /// OpenAI-compatible providers are served through the raw tunnel; the others through
    /// normalized runs rendered by the edge.
    pub fn is_tunnel(self) -> bool {
        matches!(self, ProviderKind::OpenaiCompat | ProviderKind::Vllm)
    }

    fn needs_base_url(self) -> bool {
        matches!(
            self,
            ProviderKind::OpenaiCompat | ProviderKind::Vllm | ProviderKind::Ollama
        )
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CapacityConfig {
    #[serde(default = "default_normal_capacity")]
    pub normal: u32,
    #[serde(default)]
    pub long: u32,
}

fn default_normal_capacity() -> u32 {
    4
}

impl Default for CapacityConfig {
    fn default() -> Self {
        Self {
            normal: default_normal_capacity(),
            long: 0,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProviderConfig {
    pub id: String,
    pub kind: ProviderKind,
    #[serde(default = "yes")]
    pub enabled: bool,
    #[serde(default)]
    pub capacity: CapacityConfig,
    /// Node-local limit shared by runs and tunnels; defaults to normal + long capacity.
    #[serde(default)]
    pub max_concurrency: Option<u32>,
    #[serde(default)]
    pub base_url: Option<String>,
    /// Environment variable *on the node* that holds the provider's API key.
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// The provider's API key inline (development only; it travels to the node).
    #[serde(default)]
    pub api_key: Option<String>,
    /// Seconds the provider may take to answer a request that is not streamed with its
    /// response head, which comes once the whole answer is generated (default 600).
    #[serde(default)]
    pub request_timeout_sec: Option<u32>,
    /// Seconds the provider may take to answer a streamed request with its response head,
    /// which servers send once the prompt is taken in at the latest (default 120: a
    /// backend that never answers gives its slot back after this).
    #[serde(default)]
    pub stream_head_timeout_sec: Option<u32>,
    /// Seconds the provider's stream may stay silent once its response began (default
    /// 300); a longer stall ends the request with `provider_idle_timeout`.
    #[serde(default)]
    pub idle_timeout_sec: Option<u32>,
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    #[serde(default)]
    pub cli: Option<CliConfig>,
    #[serde(default)]
    pub mock: Option<MockConfig>,
    /// This provider's probe settings (unset: the edge-wide `health`).
    #[serde(default)]
    pub health: Option<ProviderHealthConfig>,
    /// openai_compat / vllm: whether a streamed request whose client did not ask for
    /// usage asks the provider for it anyway (and hides it from the client). Default
    /// `inject`.
    #[serde(default)]
    pub tunnel_usage: Option<TunnelUsage>,
    /// openai_compat / vllm: the APIs the provider serves itself, which go to it through
    /// the raw tunnel. Default `[chat, completions, embeddings]`; a Responses or Messages
    /// request for a provider that does not list it is translated to chat.
    #[serde(default)]
    pub apis: Option<Vec<ProviderApi>>,
    /// ollama: which of the models the Ollama server holds the edge serves as model
    /// groups of their own name: `auto` (the default: all of them), a list of patterns
    /// (`*` matches any run of characters: `[llama3.2:*, qwen*]`), or `[]` (none).
    #[serde(default)]
    pub models: Option<LocalModels>,
    /// ollama, with `models:` a list: `pull` makes the edge pull each listed name (those
    /// without `*`) that the provider's server does not hold, whenever it looks at its
    /// models (node ready, after model operations, every minute). Default `off`.
    #[serde(default)]
    pub reconcile: Reconcile,
}

/// Whether the edge pulls the models an Ollama provider lists and lacks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reconcile {
    #[default]
    Off,
    Pull,
}

/// An Ollama provider's `models:` setting.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum LocalModels {
    /// `auto`.
    Word(String),
    Patterns(Vec<String>),
}

/// The longest list of `models:` patterns.
pub const MAX_MODEL_PATTERNS: usize = 256;

impl LocalModels {
    /// Whether a model the server holds is served as a group (`name` as Ollama lists it,
    /// e.g. `llama3.2:latest`; a pattern without a tag also matches its `:latest`).
    pub fn exposes(&self, name: &str) -> bool {
        match self {
            LocalModels::Word(_) => true,
            LocalModels::Patterns(patterns) => patterns.iter().any(|p| {
                glob_match(p, name)
                    || name
                        .strip_suffix(":latest")
                        .is_some_and(|short| glob_match(p, short))
            }),
        }
    }

    /// The names a `reconcile: pull` provider should hold: the listed ones without `*`.
    pub fn wanted(&self) -> Vec<&str> {
        match self {
            LocalModels::Word(_) => Vec::new(),
            LocalModels::Patterns(patterns) => patterns
                .iter()
                .map(String::as_str)
                .filter(|p| !p.contains('*'))
                .collect(),
        }
    }

    /// Whether some model name could be served (not `[]`).
    pub fn any(&self) -> bool {
        !matches!(self, LocalModels::Patterns(p) if p.is_empty())
    }

    fn validate(&self) -> Result<(), FieldError> {
        let invalid = |message: String| Err(FieldError::new("models".into(), message));
        match self {
            LocalModels::Word(word) if word == "auto" => Ok(()),
            LocalModels::Word(word) => invalid(format!(
                "{word:?} is not a setting: give `auto`, a list of model name patterns, or `[]`"
            )),
            LocalModels::Patterns(patterns) if patterns.len() > MAX_MODEL_PATTERNS => {
                invalid(format!("at most {MAX_MODEL_PATTERNS} patterns"))
            }
            LocalModels::Patterns(patterns) => {
                match patterns.iter().find(|p| p.trim().is_empty()) {
                    Some(_) => invalid("a pattern must not be empty".into()),
                    None => Ok(()),
                }
            }
        }
    }
}

/// Whether `name` matches `pattern`, where `*` stands for any run of characters.
pub fn glob_match(pattern: &str, name: &str) -> bool {
    let mut parts = pattern.split('*');
    let first = parts.next().unwrap_or("");
    let Some(mut rest) = name.strip_prefix(first) else {
        return false;
    };
    let parts: Vec<&str> = parts.collect();
    let Some((last, middle)) = parts.split_last() else {
        return rest.is_empty();
    };
    for part in middle {
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    rest.len() >= last.len() && rest.ends_with(last)
}

pub use iop_api::provider_api::ProviderApi;

/// What openai_compat and vllm providers serve unless `apis` says otherwise.
pub const DEFAULT_TUNNEL_APIS: &[ProviderApi] = &[
    ProviderApi::Chat,
    ProviderApi::Completions,
    ProviderApi::Embeddings,
];

/// How the usage of tunnelled streams is obtained.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TunnelUsage {
    /// A streamed chat or completions request without `stream_options.include_usage` gets
    /// it added on the way to the provider, and the node removes the provider's usage
    /// chunk from what the client receives: every stream is accounted, and the client's
    /// bytes are the provider's answer to the request it sent.
    #[default]
    Inject,
    /// Requests go to the provider as the client sent them: a stream whose client did not
    /// ask for usage records none. For providers that refuse `stream_options`.
    Off,
}

fn yes() -> bool {
    true
}

impl ProviderConfig {
    /// Which of its server's models an Ollama provider serves as groups of their own
    /// (`None` for other kinds, and for an Ollama provider with `models: []`).
    pub fn local_models(&self) -> Option<LocalModels> {
        if self.kind != ProviderKind::Ollama {
            return None;
        }
        let models = self
            .models
            .clone()
            .unwrap_or_else(|| LocalModels::Word("auto".into()));
        models.any().then_some(models)
    }

    pub fn max_concurrency(&self) -> u32 {
        self.max_concurrency
            .unwrap_or(self.capacity.normal + self.capacity.long)
    }

    /// Whether the provider serves `api` itself (through the raw tunnel). Ollama, CLI and
    /// mock providers serve none: every API reaches them as a node run.
    pub fn serves(&self, api: ProviderApi) -> bool {
        self.served_apis().any(|a| a == api)
    }

    /// The APIs a tunnelled provider serves itself (none for other kinds).
    pub fn served_apis(&self) -> impl Iterator<Item = ProviderApi> + '_ {
        let apis = if self.kind.is_tunnel() {
            self.apis.as_deref().unwrap_or(DEFAULT_TUNNEL_APIS)
        } else {
            &[]
        };
        apis.iter().copied()
    }

    /// Whether streamed tunnel requests ask this provider for usage the client did not.
    pub fn injects_stream_usage(&self) -> bool {
        self.kind.is_tunnel() && self.tunnel_usage.unwrap_or_default() == TunnelUsage::Inject
    }

    /// How long the provider's stream may stay silent once its response began.
    pub fn idle_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_secs(
            self.idle_timeout_sec
                .unwrap_or(dispatch::DEFAULT_IDLE_TIMEOUT_SEC)
                .into(),
        )
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CliConfig {
    pub argv: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub working_dir: Option<String>,
    /// Line that ends each input and each answer of a session process.
    #[serde(default)]
    pub end_marker: Option<String>,
    /// Live session processes the adapter keeps at most (node default 32); a new session
    /// over the cap is refused.
    #[serde(default)]
    pub max_sessions: Option<u32>,
    /// Seconds a session process may sit idle before the node ends it (node default 900).
    #[serde(default)]
    pub session_idle_sec: Option<u32>,
    /// Live session processes one API key keeps at most (default a quarter of
    /// `max_sessions`, at least 1), so one key cannot take every session from the others.
    #[serde(default)]
    pub max_sessions_per_key: Option<u32>,
}

/// Upper bounds of the CLI session settings.
pub const MAX_CLI_SESSIONS: u32 = 10_000;
pub const MAX_CLI_SESSION_IDLE_SEC: u32 = 7 * 24 * 3600;

impl CliConfig {
    /// The session settings' bounds; the error names the field under `cli`.
    fn validate(&self) -> Result<(), FieldError> {
        if self.argv.is_empty() || self.argv[0].is_empty() {
            return Err(FieldError::new(
                "cli.argv".into(),
                "needs at least the program to run".into(),
            ));
        }
        for (field, value) in [
            ("max_sessions", self.max_sessions),
            ("max_sessions_per_key", self.max_sessions_per_key),
        ] {
            if let Some(n) = value
                && !(1..=MAX_CLI_SESSIONS).contains(&n)
            {
                return Err(FieldError::new(
                    format!("cli.{field}"),
                    format!("{n} is out of range: give 1 to {MAX_CLI_SESSIONS}"),
                ));
            }
        }
        if let Some(n) = self.session_idle_sec
            && !(1..=MAX_CLI_SESSION_IDLE_SEC).contains(&n)
        {
            return Err(FieldError::new(
                "cli.session_idle_sec".into(),
                format!("{n} is out of range: give 1 to {MAX_CLI_SESSION_IDLE_SEC} seconds"),
            ));
        }
        if let Some(marker) = &self.end_marker
            && (marker.trim().is_empty() || marker.contains(['\n', '\r']))
        {
            return Err(FieldError::new(
                "cli.end_marker".into(),
                "must be one non-blank line".into(),
            ));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MockConfig {
    #[serde(default)]
    pub tokens: Option<u32>,
    #[serde(default)]
    pub token_delay_ms: Option<u32>,
    #[serde(default)]
    pub reasoning: bool,
    #[serde(default)]
    pub text: Option<String>,
}

impl ProviderConfig {
    /// Checks the kind's requirements; paths are under the provider.
    // Over 100 lines: one check per rule a provider's fields must keep, each a few lines, in
    // the order the fields are documented; split, one list of rules would be scattered.
    pub fn validate(&self) -> Result<(), FieldError> {
        let p = self;
        let err = |field: &str, message: String| Err(FieldError::new(field.to_string(), message));
        if p.capacity.normal == 0 && p.capacity.long == 0 {
            return err(
                "capacity",
                "normal and long capacity cannot both be 0".into(),
            );
        }
        for (field, value) in [
            ("capacity.normal", p.capacity.normal),
            ("capacity.long", p.capacity.long),
        ] {
            if value > MAX_CAPACITY {
                return err(field, format!("must be at most {MAX_CAPACITY}"));
            }
        }
        if let Some(n) = p.idle_timeout_sec
            && !(1..=dispatch::MAX_IDLE_TIMEOUT_SEC).contains(&n)
        {
            return err(
                "idle_timeout_sec",
                format!(
                    "{n} is out of range: give 1 to {} seconds",
                    dispatch::MAX_IDLE_TIMEOUT_SEC
                ),
            );
        }
        match p.max_concurrency {
            Some(0) => return err("max_concurrency", "must be positive".into()),
            Some(n) if n > MAX_CAPACITY => {
                return err("max_concurrency", format!("must be at most {MAX_CAPACITY}"));
            }
            _ => {}
        }
        if p.kind.needs_base_url() {
            match p.base_url.as_deref() {
                None => return err("base_url", format!("required for kind {}", p.kind.as_str())),
                Some(url) => {
                    let uri: http::Uri = url.parse().map_err(|e| {
                        FieldError::new("base_url".into(), format!("not a URL: {e}"))
                    })?;
                    if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.host().is_none() {
                        return err(
                            "base_url",
                            format!("{url:?} must be an http:// or https:// URL"),
                        );
                    }
                }
            }
        }
        if p.kind == ProviderKind::Cli {
            match &p.cli {
                None => return err("cli", "required for kind cli (cli.argv)".into()),
                Some(cli) => {
                    cli.validate()?;
                }
            }
        } else if p.cli.is_some() {
            return err("cli", format!("only for kind cli, not {}", p.kind.as_str()));
        }
        if let Some(health) = &p.health {
            health.validate().map_err(|e| e.under("health"))?;
        }
        if let Some(models) = &p.models {
            if p.kind != ProviderKind::Ollama {
                return err(
                    "models",
                    format!("only for kind ollama, not {}", p.kind.as_str()),
                );
            }
            models.validate()?;
        }
        if p.reconcile == Reconcile::Pull && !matches!(p.models, Some(LocalModels::Patterns(_))) {
            return err(
                "reconcile",
                "`reconcile: pull` needs `models:` to list the models to pull (kind ollama)".into(),
            );
        }
        if p.tunnel_usage.is_some() && !p.kind.is_tunnel() {
            return err(
                "tunnel_usage",
                format!(
                    "only for kinds openai_compat and vllm (the tunnelled ones), not {}",
                    p.kind.as_str()
                ),
            );
        }
        if let Some(apis) = &p.apis {
            if !p.kind.is_tunnel() {
                return err(
                    "apis",
                    format!(
                        "only for kinds openai_compat and vllm, not {}: ollama, cli and mock \
                     providers serve every API through node runs",
                        p.kind.as_str()
                    ),
                );
            }
            if apis.is_empty() {
                return err(
                "apis",
                "must list at least one API (chat, completions, embeddings, responses, messages)"
                    .into(),
            );
            }
        }
        if p.mock.is_some() && p.kind != ProviderKind::Mock {
            return err(
                "mock",
                format!("only for kind mock, not {}", p.kind.as_str()),
            );
        }
        Ok(())
    }
}
