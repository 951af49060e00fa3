//! Edge configuration (`configs/edge.yaml`): listen addresses, client auth, limits, the
//! `nodes[]` the edge accepts (id, token, providers) and the `model_groups[]` it serves.
//!
//! Parsing rejects unknown fields; [`EdgeConfig::validate`] checks what serde cannot
//! (references, uniqueness, per-kind requirements). Every error names the YAML path of
//! the offending field, e.g. `nodes[0].providers[1].base_url`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use sha2::{Digest, Sha256};

mod auth;
mod http_api;
mod http_limits;
pub mod ledger;

pub use auth::{ApiKeyConfig, AuthConfig, KeyLimitsConfig, MIN_API_KEY_CHARS, Role};
pub use http_api::{CorsConfig, HttpApiConfig};
pub use http_limits::HttpLimitsConfig;
pub use ledger::LedgerConfig;

pub const DEFAULT_NODE_LISTEN: &str = "127.0.0.1:7700";
pub const DEFAULT_HTTP_LISTEN: &str = "127.0.0.1:8080";
pub const DEFAULT_MAX_BODY_BYTES: usize = 4 * 1024 * 1024;
pub const DEFAULT_QUEUE_MAX_WAITING: usize = 64;
pub const DEFAULT_QUEUE_TIMEOUT_SEC: u64 = 30;
/// Bounds of `max_frame_bytes`.
pub const MIN_MAX_FRAME_BYTES: usize = 64 * 1024;
pub const MAX_MAX_FRAME_BYTES: usize = 256 * 1024 * 1024;
/// Shortest inline (or environment) node token accepted.
pub const MIN_TOKEN_CHARS: usize = 16;
/// Longest `queue.wait_for_reconnect_sec`.
pub const MAX_WAIT_FOR_RECONNECT_SEC: u64 = 3600;
/// Largest capacity per lane and `max_concurrency` of one provider.
pub const MAX_CAPACITY: u32 = 10_000;
/// The state directory's name beside the config file when `state_dir` is not given.
pub const DEFAULT_STATE_DIR: &str = "iop-edge-state";
pub const DEFAULT_CREDENTIAL_DAYS: u32 = 365;

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
}

/// How the node listener secures connections.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeTlsMode {
    /// The edge's own CA (created in `state_dir` on the first start) signs the server
    /// certificate and the credentials of nodes that join; nodes trust it by its pin.
    #[default]
    Auto,
    /// The operator's certificate and key; with `client_ca`, nodes may present client
    /// certificates from that CA (mTLS, the certificate's CN names the node).
    Provided,
    /// No encryption: tokens and prompts cross the network in clear.
    InsecurePlaintext,
}

impl NodeTlsMode {
    pub fn as_str(self) -> &'static str {
        match self {
            NodeTlsMode::Auto => "auto",
            NodeTlsMode::Provided => "provided",
            NodeTlsMode::InsecurePlaintext => "insecure_plaintext",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeTlsConfig {
    #[serde(default)]
    pub mode: NodeTlsMode,
    /// auto: extra DNS names or IPs for the server certificate (for nodes that verify with
    /// `--edge-ca` and a host name instead of the pin).
    #[serde(default)]
    pub names: Vec<String>,
    /// `host:port` addresses nodes dial, written into join strings; default the node
    /// listen address when it is a specific one.
    #[serde(default)]
    pub advertise: Vec<String>,
    /// Lifetime of the credential (client certificate) a node receives when it joins.
    #[serde(default = "default_credential_days")]
    pub credential_days: u32,
    /// provided: PEM certificate chain (server certificate first) and its private key.
    #[serde(default)]
    pub cert: Option<PathBuf>,
    #[serde(default)]
    pub key: Option<PathBuf>,
    /// provided: PEM CA certificate(s) node client certificates must chain to.
    #[serde(default)]
    pub client_ca: Option<PathBuf>,
}

fn default_credential_days() -> u32 {
    DEFAULT_CREDENTIAL_DAYS
}

impl Default for NodeTlsConfig {
    fn default() -> Self {
        Self {
            mode: NodeTlsMode::Auto,
            names: Vec::new(),
            advertise: Vec::new(),
            credential_days: DEFAULT_CREDENTIAL_DAYS,
            cert: None,
            key: None,
            client_ca: None,
        }
    }
}

/// TLS for the HTTP API: PEM certificate chain and key, re-read on SIGHUP.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpTlsConfig {
    pub cert: PathBuf,
    pub key: PathBuf,
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
        }
    }
}

pub mod dispatch;
pub mod health;
pub mod node_limits;
pub use dispatch::DispatchConfig;
pub use health::{EjectionConfig, HealthConfig, ProviderHealthConfig};
pub use node_limits::NodeLimitsConfig;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeConfig {
    pub id: String,
    /// The node's token inline (development only).
    #[serde(default)]
    pub token: Option<String>,
    /// Name of an environment variable of the edge that holds the node's token.
    #[serde(default)]
    pub token_env: Option<String>,
    /// Hex SHA-256 of the node's token (`printf %s TOKEN | sha256sum`).
    #[serde(default)]
    pub token_sha256: Option<String>,
    #[serde(default)]
    pub providers: Vec<ProviderConfig>,
}

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
    pub fn as_str(self) -> &'static str {
        match self {
            ProviderKind::Mock => "mock",
            ProviderKind::OpenaiCompat => "openai_compat",
            ProviderKind::Vllm => "vllm",
            ProviderKind::Ollama => "ollama",
            ProviderKind::Cli => "cli",
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
    #[serde(default)]
    pub request_timeout_sec: Option<u32>,
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
}

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
    fn validate(&self) -> Result<(), (String, String)> {
        if self.argv.is_empty() || self.argv[0].is_empty() {
            return Err((
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
                return Err((
                    format!("cli.{field}"),
                    format!("{n} is out of range: give 1 to {MAX_CLI_SESSIONS}"),
                ));
            }
        }
        if let Some(n) = self.session_idle_sec
            && !(1..=MAX_CLI_SESSION_IDLE_SEC).contains(&n)
        {
            return Err((
                "cli.session_idle_sec".into(),
                format!("{n} is out of range: give 1 to {MAX_CLI_SESSION_IDLE_SEC} seconds"),
            ));
        }
        if let Some(marker) = &self.end_marker
            && (marker.trim().is_empty() || marker.contains(['\n', '\r']))
        {
            return Err(("cli.end_marker".into(), "must be one non-blank line".into()));
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

/// SHA-256 of a node token, the only form in which the edge keeps tokens.
pub type TokenHash = [u8; 32];

pub fn hash_token(token: &str) -> TokenHash {
    Sha256::digest(token.as_bytes()).into()
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
        let config: EdgeConfig =
            serde_path_to_error::deserialize(de).map_err(|err| ConfigError::Parse {
                file: file.to_string(),
                path: yaml_path(err.path()),
                message: err.into_inner().to_string(),
            })?;
        config
            .validate()
            .map_err(|(path, message)| ConfigError::Invalid {
                file: file.to_string(),
                path,
                message,
            })?;
        Ok(config)
    }

    /// Checks references and per-kind requirements; the error is `(yaml path, message)`.
    pub fn validate(&self) -> Result<(), (String, String)> {
        let invalid = |path: String, message: &str| Err((path, message.to_string()));
        if !(MIN_MAX_FRAME_BYTES..=MAX_MAX_FRAME_BYTES).contains(&self.max_frame_bytes) {
            return Err((
                "max_frame_bytes".into(),
                format!(
                    "must be between {MIN_MAX_FRAME_BYTES} (64 KiB) and {MAX_MAX_FRAME_BYTES} (256 MiB)"
                ),
            ));
        }
        if self.limits.max_body_bytes == 0 {
            return invalid("limits.max_body_bytes".into(), "must be positive");
        }
        self.limits
            .nodes
            .validate(self.max_frame_bytes)
            .map_err(|(field, msg)| (format!("limits.nodes.{field}"), msg))?;
        self.limits
            .http
            .validate()
            .map_err(|(field, msg)| (format!("limits.http.{field}"), msg))?;
        self.health
            .validate()
            .map_err(|(field, msg)| (format!("health.{field}"), msg))?;
        self.dispatch
            .validate()
            .map_err(|(field, msg)| (format!("dispatch.{field}"), msg))?;
        self.http
            .validate()
            .map_err(|(field, msg)| (format!("http.{field}"), msg))?;
        self.auth.validate(&self.model_groups)?;
        self.ledger
            .validate()
            .map_err(|(field, msg)| (format!("ledger.{field}"), msg))?;
        if !self.ledger.enabled
            && let Some(i) = self
                .auth
                .keys
                .iter()
                .position(|k| k.limits.tokens_per_day.is_some())
        {
            return invalid(
                format!("auth.keys[{i}].limits.tokens_per_day"),
                "needs the usage ledger (it counts tokens across restarts): set ledger.enabled: true",
            );
        }
        self.validate_tls()?;
        let mut node_ids = HashSet::new();
        let mut token_owners: HashMap<TokenHash, usize> = HashMap::new();
        for (n, node) in self.nodes.iter().enumerate() {
            let at = format!("nodes[{n}]");
            if node.id.trim().is_empty() {
                return invalid(format!("{at}.id"), "must not be empty");
            }
            if !node_ids.insert(node.id.as_str()) {
                return invalid(
                    format!("{at}.id"),
                    &format!("duplicate node id {:?}", node.id),
                );
            }
            let hash = node
                .token_hash()
                .map_err(|(field, msg)| (format!("{at}.{field}"), msg))?;
            match hash {
                Some(hash) => {
                    if let Some(&first) = token_owners.get(&hash) {
                        return Err((
                            format!("{at}.{}", node.token_field()),
                            format!(
                                "nodes {:?} (nodes[{first}]) and {:?} (nodes[{n}]) have the same \
                                 token; every node needs its own",
                                self.nodes[first].id, node.id
                            ),
                        ));
                    }
                    token_owners.insert(hash, n);
                }
                None if self.node_tls.mode == NodeTlsMode::InsecurePlaintext => {
                    return invalid(
                        format!("{at}.token"),
                        "one of token, token_env or token_sha256 is required with node_tls.mode insecure_plaintext (without TLS a node has no certificate to register with)",
                    );
                }
                None => {}
            }
            let mut provider_ids = HashSet::new();
            for (p, provider) in node.providers.iter().enumerate() {
                let at = format!("{at}.providers[{p}]");
                if provider.id.trim().is_empty() {
                    return invalid(format!("{at}.id"), "must not be empty");
                }
                if !provider_ids.insert(provider.id.as_str()) {
                    return invalid(
                        format!("{at}.id"),
                        &format!("duplicate provider id {:?} on this node", provider.id),
                    );
                }
                validate_provider(provider)
                    .map_err(|(field, msg)| (format!("{at}.{field}"), msg))?;
            }
        }
        let mut group_names = HashSet::new();
        for (g, group) in self.model_groups.iter().enumerate() {
            let at = format!("model_groups[{g}]");
            if group.name.trim().is_empty() {
                return invalid(format!("{at}.name"), "must not be empty");
            }
            if !group_names.insert(group.name.as_str()) {
                return invalid(
                    format!("{at}.name"),
                    &format!("duplicate model group {:?}", group.name),
                );
            }
            if group.members.is_empty() {
                return invalid(format!("{at}.members"), "needs at least one member");
            }
            if group.long_context_tokens == Some(0) {
                return invalid(format!("{at}.long_context_tokens"), "must be positive");
            }
            if group.queue.timeout_sec == 0 {
                return invalid(format!("{at}.queue.timeout_sec"), "must be positive");
            }
            if group.queue.wait_for_reconnect_sec > MAX_WAIT_FOR_RECONNECT_SEC {
                return Err((
                    format!("{at}.queue.wait_for_reconnect_sec"),
                    format!("must be at most {MAX_WAIT_FOR_RECONNECT_SEC}"),
                ));
            }
            if group.context_length == Some(0) {
                return invalid(format!("{at}.context_length"), "must be positive");
            }
            if let Some(owner) = &group.owned_by
                && (owner.trim().is_empty() || owner.chars().count() > MAX_OWNED_BY_CHARS)
            {
                return invalid(
                    format!("{at}.owned_by"),
                    &format!("must be 1 to {MAX_OWNED_BY_CHARS} characters"),
                );
            }
            for (m, member) in group.members.iter().enumerate() {
                let at = format!("{at}.members[{m}]");
                let Some(node) = self.nodes.iter().find(|n| n.id == member.node) else {
                    return invalid(
                        format!("{at}.node"),
                        &format!("no node with id {:?} in nodes[]", member.node),
                    );
                };
                if !node.providers.iter().any(|p| p.id == member.provider) {
                    return invalid(
                        format!("{at}.provider"),
                        &format!(
                            "node {:?} has no provider with id {:?}",
                            member.node, member.provider
                        ),
                    );
                }
                if member.model.as_deref().is_some_and(|m| m.trim().is_empty()) {
                    return invalid(format!("{at}.model"), "must not be empty when given");
                }
            }
        }
        Ok(())
    }

    /// Refuses to serve a non-loopback HTTP address with no API keys unless the config
    /// says `auth.allow_anonymous: true`; the error is `(yaml path, message)`. Checked
    /// when the edge starts or reloads, after command-line overrides of `listen.http`.
    pub fn check_http_exposure(&self) -> Result<(), (String, String)> {
        let addr = self.listen.http;
        if self.auth.keys.is_empty() && !self.auth.allow_anonymous && !addr.ip().is_loopback() {
            return Err((
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

    fn validate_tls(&self) -> Result<(), (String, String)> {
        let invalid = |path: &str, message: String| Err((path.to_string(), message));
        let tls = &self.node_tls;
        if tls.credential_days == 0 {
            return invalid("node_tls.credential_days", "must be positive".into());
        }
        for (i, addr) in tls.advertise.iter().enumerate() {
            if addr.trim().is_empty() || !addr.contains(':') || addr.contains('/') {
                return invalid(
                    &format!("node_tls.advertise[{i}]"),
                    format!("{addr:?} must be host:port"),
                );
            }
        }
        for (i, name) in tls.names.iter().enumerate() {
            if name.trim().is_empty() {
                return invalid(&format!("node_tls.names[{i}]"), "must not be empty".into());
            }
        }
        let files = [
            ("cert", tls.cert.is_some()),
            ("key", tls.key.is_some()),
            ("client_ca", tls.client_ca.is_some()),
        ];
        match tls.mode {
            NodeTlsMode::Provided => {
                for (field, given) in &files[..2] {
                    if !given {
                        return invalid(
                            &format!("node_tls.{field}"),
                            "required with node_tls.mode provided".into(),
                        );
                    }
                }
            }
            mode => {
                if let Some((field, _)) = files.iter().find(|(_, given)| *given) {
                    return invalid(
                        &format!("node_tls.{field}"),
                        format!(
                            "only with node_tls.mode provided (the mode is {})",
                            mode.as_str()
                        ),
                    );
                }
            }
        }
        Ok(())
    }
}

impl NodeConfig {
    /// The field this node's token comes from, for error paths.
    fn token_field(&self) -> &'static str {
        if self.token_env.is_some() {
            "token_env"
        } else if self.token_sha256.is_some() {
            "token_sha256"
        } else {
            "token"
        }
    }

    /// The SHA-256 of this node's static token from whichever source is configured, or
    /// `None` when it has none (it registers with a certificate: joined, or mTLS); the
    /// error is `(field, message)`.
    pub fn token_hash(&self) -> Result<Option<TokenHash>, (String, String)> {
        let sources = [
            self.token.is_some(),
            self.token_env.is_some(),
            self.token_sha256.is_some(),
        ];
        match sources.iter().filter(|s| **s).count() {
            0 => return Ok(None),
            1 => {}
            _ => {
                return Err((
                    "token".into(),
                    "give only one of token, token_env or token_sha256".into(),
                ));
            }
        }
        if let Some(token) = &self.token {
            if token.chars().count() < MIN_TOKEN_CHARS {
                return Err((
                    "token".into(),
                    format!(
                        "must be at least {MIN_TOKEN_CHARS} characters (a short token is \
                         guessable; `openssl rand -hex 24` makes a good one)"
                    ),
                ));
            }
            return Ok(Some(hash_token(token)));
        }
        if let Some(var) = &self.token_env {
            return match std::env::var(var) {
                Ok(token) if token.chars().count() >= MIN_TOKEN_CHARS => {
                    Ok(Some(hash_token(&token)))
                }
                Ok(token) if !token.is_empty() => Err((
                    "token_env".into(),
                    format!(
                        "the token in environment variable {var} must be at least \
                         {MIN_TOKEN_CHARS} characters"
                    ),
                )),
                _ => Err((
                    "token_env".into(),
                    format!("environment variable {var} is not set or empty"),
                )),
            };
        }
        let hex_hash = self.token_sha256.as_deref().unwrap_or_default();
        let mut hash = [0u8; 32];
        hex::decode_to_slice(hex_hash.trim(), &mut hash).map_err(|_| {
            (
                "token_sha256".to_string(),
                "must be 64 hexadecimal characters (a SHA-256 digest)".to_string(),
            )
        })?;
        Ok(Some(hash))
    }
}

fn validate_provider(p: &ProviderConfig) -> Result<(), (String, String)> {
    let err = |field: &str, message: String| Err((field.to_string(), message));
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
                let uri: http::Uri = url
                    .parse()
                    .map_err(|e| ("base_url".to_string(), format!("not a URL: {e}")))?;
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
                if let Err((field, message)) = cli.validate() {
                    return err(&field, message);
                }
            }
        }
    } else if p.cli.is_some() {
        return err("cli", format!("only for kind cli, not {}", p.kind.as_str()));
    }
    if let Some(health) = &p.health {
        health
            .validate()
            .map_err(|(field, msg)| (format!("health.{field}"), msg))?;
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
