//! Edge configuration (`configs/edge.yaml`): listen addresses, client auth, limits, the
//! `nodes[]` the edge accepts (id, token, providers) and the `model_groups[]` it serves.
//!
//! Reading a config is three steps: parse (unknown fields are errors), resolve the node
//! tokens and API keys once (`secret`: only their hashes are kept), then
//! [`EdgeConfig::validate`] — a pure function of what was parsed — checks what serde
//! cannot (ranges, references, uniqueness, per-kind requirements). Every error is a
//! [`FieldError`] naming the YAML path of the offending field, e.g.
//! `nodes[0].providers[1].base_url`, and reaches the caller as a [`ConfigError`] naming
//! the file. Each section's types and checks live in their own module below.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

mod auth;
pub mod dispatch;
pub mod health;
mod http_api;
mod http_limits;
pub mod ledger;
mod model_group;
mod node;
pub mod node_limits;
mod provider;
mod routing;
mod secret;
pub mod shutdown;
pub mod store;
mod tls;

pub use auth::{ApiKeyConfig, AuthConfig, KeyLimitsConfig, MIN_API_KEY_CHARS, Role};
pub use dispatch::DispatchConfig;
pub use health::{EjectionConfig, HealthConfig, ProviderHealthConfig};
pub use http_api::{CorsConfig, HttpApiConfig};
pub use http_limits::{DEFAULT_MAX_CONNECTIONS, HttpLimitsConfig, parse_proxies};
pub use ledger::LedgerConfig;
pub use model_group::{
    MAX_OWNED_BY_CHARS, MAX_WAIT_FOR_RECONNECT_SEC, MemberConfig, ModelGroupConfig, QueueConfig,
};
pub use node::{MIN_TOKEN_CHARS, NodeConfig};
pub use node_limits::NodeLimitsConfig;
pub use provider::{
    CapacityConfig, CliConfig, DEFAULT_TUNNEL_APIS, LocalModels, MAX_CLI_SESSION_IDLE_SEC,
    MAX_CLI_SESSIONS, MockConfig, ProviderApi, ProviderConfig, ProviderKind, Reconcile,
    TunnelUsage,
};
pub use routing::RoutingPolicy;
pub use secret::{Env, TokenHash, hash_token};
pub use shutdown::ShutdownConfig;
pub use store::StoreConfig;
pub use tls::{DEFAULT_CREDENTIAL_DAYS, HttpTlsConfig, NodeTlsConfig, NodeTlsMode};

pub const DEFAULT_NODE_LISTEN: &str = "127.0.0.1:7700";
pub const DEFAULT_HTTP_LISTEN: &str = "127.0.0.1:8080";
pub const DEFAULT_MAX_BODY_BYTES: usize = 4 * 1024 * 1024;
pub const DEFAULT_QUEUE_MAX_WAITING: usize = 64;
pub const DEFAULT_QUEUE_TIMEOUT_SEC: u64 = 30;
/// Bounds of `max_frame_bytes`.
pub const MIN_MAX_FRAME_BYTES: usize = 64 * 1024;
pub const MAX_MAX_FRAME_BYTES: usize = 256 * 1024 * 1024;
/// Largest capacity per lane and `max_concurrency` of one provider.
pub const MAX_CAPACITY: u32 = 10_000;
/// The state directory's name beside the config file when `state_dir` is not given.
pub const DEFAULT_STATE_DIR: &str = "iop-edge-state";

/// An error in the edge config, naming the file and the YAML path it is about.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {file}: {source}")]
    Io {
        file: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{file}: {path}: {message}")]
    Parse {
        file: String,
        path: String,
        message: String,
    },
    #[error("{file}: {path}: {message}")]
    Invalid {
        file: String,
        path: String,
        message: String,
    },
}

/// A wrong config field: its YAML path (`nodes[0].providers[1].base_url`) and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{path}: {message}")]
pub struct FieldError {
    pub path: String,
    pub message: String,
}

impl FieldError {
    pub fn new(path: String, message: String) -> Self {
        Self { path, message }
    }

    /// The same error for the field as a field of `prefix` (`max_streams` under
    /// `limits.nodes` is `limits.nodes.max_streams`).
    pub fn under(self, prefix: &str) -> Self {
        let path = match self.path.as_str() {
            "" => prefix.to_string(),
            p if p.starts_with('[') => format!("{prefix}{p}"),
            p => format!("{prefix}.{p}"),
        };
        Self { path, ..self }
    }
}

impl ConfigError {
    /// The config in `file` has a wrong field.
    pub fn invalid(file: &str, error: FieldError) -> Self {
        ConfigError::Invalid {
            file: file.to_string(),
            path: error.path,
            message: error.message,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EdgeConfig {
    #[serde(default)]
    pub listen: ListenConfig,
    /// Largest Edge–Node frame accepted or sent.
    #[serde(default = "default_max_frame_bytes")]
    pub max_frame_bytes: usize,
    #[serde(default)]
    pub auth: AuthConfig,
    #[serde(default)]
    pub limits: LimitsConfig,
    /// CORS and the headers passed between clients and providers.
    #[serde(default)]
    pub http: HttpApiConfig,
    #[serde(default)]
    pub nodes: Vec<NodeConfig>,
    #[serde(default)]
    pub model_groups: Vec<ModelGroupConfig>,
    /// Where the edge keeps its CA, server certificate, join tokens and revocations.
    /// Relative paths are relative to the config file; default `iop-edge-state` beside it.
    #[serde(default)]
    pub state_dir: Option<PathBuf>,
    /// TLS on the node listener.
    #[serde(default)]
    pub node_tls: NodeTlsConfig,
    /// TLS on the HTTP listener (off unless given).
    #[serde(default)]
    pub http_tls: Option<HttpTlsConfig>,
    /// Provider health probes (by the nodes) and passive ejection (by the edge).
    #[serde(default)]
    pub health: HealthConfig,
    /// Attempts, retry budget and the node's acknowledgement deadline.
    #[serde(default)]
    pub dispatch: DispatchConfig,
    /// The durable usage ledger in `state_dir`.
    #[serde(default)]
    pub ledger: LedgerConfig,
    /// How the edge stops: the drain on SIGTERM.
    #[serde(default)]
    pub shutdown: ShutdownConfig,
    /// The PostgreSQL database the edges of a fleet share (none: everything in state_dir).
    #[serde(default)]
    pub store: StoreConfig,
}

fn default_max_frame_bytes() -> usize {
    iop_proto::DEFAULT_MAX_FRAME_BYTES
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenConfig {
    /// Where nodes connect (TCP, length-prefixed protobuf).
    #[serde(default = "default_node_listen")]
    pub nodes: SocketAddr,
    /// Where clients connect (OpenAI-compatible API, runs API, admin).
    #[serde(default = "default_http_listen")]
    pub http: SocketAddr,
}

fn default_node_listen() -> SocketAddr {
    DEFAULT_NODE_LISTEN.parse().expect("valid default")
}

fn default_http_listen() -> SocketAddr {
    DEFAULT_HTTP_LISTEN.parse().expect("valid default")
}

impl Default for ListenConfig {
    fn default() -> Self {
        Self {
            nodes: default_node_listen(),
            http: default_http_listen(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsConfig {
    /// Largest HTTP request body accepted; larger ones get 413.
    #[serde(default = "default_max_body_bytes")]
    pub max_body_bytes: usize,
    /// Limits of the node listener.
    #[serde(default)]
    pub nodes: NodeLimitsConfig,
    /// Timeouts, connection cap and response size of the HTTP listener.
    #[serde(default)]
    pub http: HttpLimitsConfig,
    /// Models taken from one Ollama provider's own list (`models: auto` and patterns) at
    /// most; names past it, and names that are not valid Ollama names, are left out.
    #[serde(default = "default_models_per_provider")]
    pub models_per_provider: usize,
    /// Model groups made of Ollama providers' own models, all providers together, at most.
    #[serde(default = "default_local_model_groups")]
    pub local_model_groups: usize,
}

pub const DEFAULT_MODELS_PER_PROVIDER: usize = 256;
pub const DEFAULT_LOCAL_MODEL_GROUPS: usize = 1024;

fn default_models_per_provider() -> usize {
    DEFAULT_MODELS_PER_PROVIDER
}

fn default_local_model_groups() -> usize {
    DEFAULT_LOCAL_MODEL_GROUPS
}

fn default_max_body_bytes() -> usize {
    DEFAULT_MAX_BODY_BYTES
}

impl Default for LimitsConfig {
    fn default() -> Self {
        Self {
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            nodes: NodeLimitsConfig::default(),
            http: HttpLimitsConfig::default(),
            models_per_provider: DEFAULT_MODELS_PER_PROVIDER,
            local_model_groups: DEFAULT_LOCAL_MODEL_GROUPS,
        }
    }
}

impl EdgeConfig {
    /// The model group a client's name means: the group of that name, or of that name
    /// without Ollama's default `:latest` tag.
    pub fn resolve_group(&self, name: &str) -> Option<&ModelGroupConfig> {
        let find = |n: &str| self.model_groups.iter().find(|g| g.name == n);
        find(name).or_else(|| name.strip_suffix(":latest").and_then(find))
    }

    /// Reads, parses and validates a config file. Relative paths in it (state, TLS files)
    /// are taken relative to the file's directory; `state_dir` defaults to
    /// [`DEFAULT_STATE_DIR`] there.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            file: file.clone(),
            source,
        })?;
        let mut config = Self::from_yaml(&text, &file)?;
        let base = path.parent().unwrap_or(Path::new("."));
        config.resolve_paths(base);
        Ok(config)
    }

    /// Makes the state and TLS paths absolute against `base` and fills in the default
    /// state directory.
    pub fn resolve_paths(&mut self, base: &Path) {
        let base = if base.as_os_str().is_empty() {
            Path::new(".")
        } else {
            base
        };
        let resolve = |p: &mut PathBuf| {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        };
        resolve(
            self.state_dir
                .get_or_insert_with(|| PathBuf::from(DEFAULT_STATE_DIR)),
        );
        for p in [
            &mut self.node_tls.cert,
            &mut self.node_tls.key,
            &mut self.node_tls.client_ca,
        ]
        .into_iter()
        .flatten()
        {
            resolve(p);
        }
        if let Some(http) = &mut self.http_tls {
            resolve(&mut http.cert);
            resolve(&mut http.key);
        }
    }

    /// Parses and validates YAML text; `file` names it in errors.
    pub fn from_yaml(text: &str, file: &str) -> Result<Self, ConfigError> {
        Self::from_yaml_with_env(text, file, &secret::process_env)
    }

    /// [`Self::from_yaml`] with environment variables read from `env`.
    pub fn from_yaml_with_env(text: &str, file: &str, env: Env<'_>) -> Result<Self, ConfigError> {
        if is_blank_yaml(text) {
            return Err(ConfigError::Invalid {
                file: file.to_string(),
                path: "(top level)".into(),
                message: "the file is empty: an edge config needs at least nodes[] and \
                          model_groups[] (configs/edge.yaml is a commented example)"
                    .into(),
            });
        }
        let de = serde_yaml_ng::Deserializer::from_str(text);
        let mut config: EdgeConfig =
            serde_path_to_error::deserialize(de).map_err(|err| ConfigError::Parse {
                file: file.to_string(),
                path: yaml_path(err.path()),
                message: err.into_inner().to_string(),
            })?;
        config
            .resolve_secrets(env)
            .map_err(|e| ConfigError::invalid(file, e))?;
        config
            .validate()
            .map_err(|e| ConfigError::invalid(file, e))?;
        Ok(config)
    }

    /// Resolves every node token and API key once (only their hashes are kept).
    fn resolve_secrets(&mut self, env: Env<'_>) -> Result<(), FieldError> {
        for (n, node) in self.nodes.iter_mut().enumerate() {
            node.resolve_token(env)
                .map_err(|e| e.under(&format!("nodes[{n}]")))?;
        }
        for (i, key) in self.auth.keys.iter_mut().enumerate() {
            key.resolve_key(env)
                .map_err(|e| e.under(&format!("auth.keys[{i}]")))?;
        }
        if let Some(url) = env(store::STORE_URL_ENV).filter(|u| !u.is_empty()) {
            self.store.url = Some(url);
        }
        self.store
            .resolve_secret_key(env(store::STORE_SECRET_KEY_ENV))
            .map_err(|e| e.under("store"))?;
        Ok(())
    }

    /// Checks what serde cannot — ranges, references, uniqueness, per-kind requirements —
    /// as a pure function of the parsed config (its secrets already resolved).
    pub fn validate(&self) -> Result<(), FieldError> {
        if !(MIN_MAX_FRAME_BYTES..=MAX_MAX_FRAME_BYTES).contains(&self.max_frame_bytes) {
            return Err(FieldError::new(
                "max_frame_bytes".into(),
                format!(
                    "must be between {MIN_MAX_FRAME_BYTES} (64 KiB) and {MAX_MAX_FRAME_BYTES} (256 MiB)"
                ),
            ));
        }
        for (field, value) in [
            ("limits.max_body_bytes", self.limits.max_body_bytes),
            (
                "limits.models_per_provider",
                self.limits.models_per_provider,
            ),
            ("limits.local_model_groups", self.limits.local_model_groups),
        ] {
            if value == 0 {
                return Err(FieldError::new(field.into(), "must be positive".into()));
            }
        }
        self.limits
            .nodes
            .validate(self.max_frame_bytes)
            .map_err(|e| e.under("limits.nodes"))?;
        self.limits
            .http
            .validate()
            .map_err(|e| e.under("limits.http"))?;
        self.health.validate().map_err(|e| e.under("health"))?;
        self.dispatch.validate().map_err(|e| e.under("dispatch"))?;
        self.http.validate().map_err(|e| e.under("http"))?;
        let local = |name: &str| {
            self.nodes
                .iter()
                .flat_map(|n| &n.providers)
                .filter_map(|p| p.local_models())
                .any(|m| m.exposes(name))
        };
        self.auth.validate(&self.model_groups, &local)?;
        self.ledger.validate().map_err(|e| e.under("ledger"))?;
        self.shutdown.validate().map_err(|e| e.under("shutdown"))?;
        self.store.validate().map_err(|e| e.under("store"))?;
        if self.store.url.is_some()
            && self.node_tls.mode == NodeTlsMode::Auto
            && self.store.secret_key.is_none()
        {
            return Err(FieldError::new(
                "store.secret_key_file".into(),
                format!(
                    "the edges of a fleet share one CA, whose key the store keeps sealed: give \
                     the secret key in {} or store.secret_key_file; {}",
                    store::STORE_SECRET_KEY_ENV,
                    store::MAKE_A_KEY
                ),
            ));
        }
        if !self.ledger.enabled
            && let Some(i) = self
                .auth
                .keys
                .iter()
                .position(|k| k.limits.tokens_per_day.is_some())
        {
            return Err(FieldError::new(
                format!("auth.keys[{i}].limits.tokens_per_day"),
                "needs the usage ledger (it counts tokens across restarts): set ledger.enabled: true".into(),
            ));
        }
        self.node_tls.validate().map_err(|e| e.under("node_tls"))?;
        self.validate_nodes()?;
        let mut group_names = HashSet::new();
        for (g, group) in self.model_groups.iter().enumerate() {
            let at = format!("model_groups[{g}]");
            group.validate(&self.nodes).map_err(|e| e.under(&at))?;
            if !group_names.insert(group.name.as_str()) {
                return Err(FieldError::new(
                    format!("{at}.name"),
                    format!("duplicate model group {:?}", group.name),
                ));
            }
        }
        Ok(())
    }

    /// Node ids, tokens and providers: each id and token once, each provider valid.
    fn validate_nodes(&self) -> Result<(), FieldError> {
        let mut node_ids = HashSet::new();
        let mut token_owners: HashMap<TokenHash, usize> = HashMap::new();
        for (n, node) in self.nodes.iter().enumerate() {
            let at = format!("nodes[{n}]");
            let invalid = |field: &str, message: String| {
                Err(FieldError::new(format!("{at}.{field}"), message))
            };
            if node.id.trim().is_empty() {
                return invalid("id", "must not be empty".into());
            }
            if !node_ids.insert(node.id.as_str()) {
                return invalid("id", format!("duplicate node id {:?}", node.id));
            }
            match node.token_hash() {
                Some(hash) => {
                    if let Some(&first) = token_owners.get(&hash) {
                        return invalid(
                            node.token_field(),
                            format!(
                                "nodes {:?} (nodes[{first}]) and {:?} (nodes[{n}]) have the same \
                                 token; every node needs its own",
                                self.nodes[first].id, node.id
                            ),
                        );
                    }
                    token_owners.insert(hash, n);
                }
                None if self.node_tls.mode == NodeTlsMode::InsecurePlaintext => {
                    return invalid(
                        "token",
                        "one of token, token_env or token_sha256 is required with node_tls.mode insecure_plaintext (without TLS a node has no certificate to register with)".into(),
                    );
                }
                None => {}
            }
            let mut provider_ids = HashSet::new();
            for (p, provider) in node.providers.iter().enumerate() {
                let at = format!("{at}.providers[{p}]");
                if provider.id.trim().is_empty() {
                    return Err(FieldError::new(
                        format!("{at}.id"),
                        "must not be empty".into(),
                    ));
                }
                if !provider_ids.insert(provider.id.as_str()) {
                    return Err(FieldError::new(
                        format!("{at}.id"),
                        format!("duplicate provider id {:?} on this node", provider.id),
                    ));
                }
                provider.validate().map_err(|e| e.under(&at))?;
            }
        }
        Ok(())
    }

    /// Refuses to serve a non-loopback HTTP address with no API keys unless the config
    /// says `auth.allow_anonymous: true`. Checked
    /// when the edge starts or reloads, after command-line overrides of `listen.http`.
    pub fn check_http_exposure(&self) -> Result<(), FieldError> {
        let addr = self.listen.http;
        if self.auth.keys.is_empty() && !self.auth.allow_anonymous && !addr.ip().is_loopback() {
            return Err(FieldError::new(
                "auth.keys".into(),
                format!(
                    "the HTTP API would listen on {addr}, which is not a loopback address, with no \
                     API keys: anyone who reaches it could use every model and read every prompt. \
                     Add keys under auth.keys (see configs/edge.yaml), listen on 127.0.0.1, or set \
                     `auth.allow_anonymous: true` to serve it without authentication on purpose"
                ),
            ));
        }
        Ok(())
    }
}

/// Whether a YAML text holds nothing but blank lines, comments and document markers.
fn is_blank_yaml(text: &str) -> bool {
    text.lines().all(|line| {
        let line = line.trim();
        line.is_empty() || line.starts_with('#') || line == "---" || line == "..."
    })
}

/// Renders a serde path as `a.b[2].c`.
fn yaml_path(path: &serde_path_to_error::Path) -> String {
    use serde_path_to_error::Segment;
    let mut out = String::new();
    for segment in path.iter() {
        match segment {
            Segment::Seq { index } => out.push_str(&format!("[{index}]")),
            Segment::Map { key } | Segment::Enum { variant: key } => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(key);
            }
            Segment::Unknown => out.push_str(".?"),
        }
    }
    if out.is_empty() {
        "(top level)".into()
    } else {
        out
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod shipped_examples {
    #[test]
    fn the_shipped_edge_config_is_valid() {
        let text = include_str!("../../../configs/edge.yaml");
        super::EdgeConfig::from_yaml(text, "configs/edge.yaml").unwrap();
    }
}
