//! The `auth` section: named API keys, each with a role (`admin` or `client`) and an
//! optional allowlist of model groups, given inline (development), by environment variable
//! or as a SHA-256 digest; and `allow_anonymous`, the explicit opt-in to serve a
//! non-loopback HTTP address without keys.
//!
//! The former `api_keys` / `api_keys_env` fields are still recognised, but only to refuse
//! them with the exact replacement: their keys had no name and no role, and guessing one
//! (admin? client?) would either hand every user the admin surfaces or lock the operator
//! out of them.

use std::collections::HashSet;

use serde::Deserialize;
use serde::de::IgnoredAny;

use super::secret::{Env, SecretFields, TokenHash};
use super::{FieldError, ModelGroupConfig};

/// Shortest key accepted inline or from the environment.
pub const MIN_API_KEY_CHARS: usize = 16;
/// Longest key name (it is a metrics label and appears in usage events).
pub const MAX_KEY_NAME_CHARS: usize = 64;

/// What a key may reach.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Everything: the OpenAI and runs APIs for any key's runs and sessions, `/admin/*`,
    /// `/metrics` and node commands.
    Admin,
    /// The OpenAI-compatible endpoints and the runs API, for its own runs and sessions.
    Client,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Admin => "admin",
            Role::Client => "client",
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuthConfig {
    /// The API keys clients present as `Authorization: Bearer <key>`.
    #[serde(default)]
    pub keys: Vec<ApiKeyConfig>,
    /// Serve a non-loopback HTTP address with no keys (everyone is admin). Off by default:
    /// without keys the edge serves loopback only.
    #[serde(default)]
    pub allow_anonymous: bool,
    /// Replaced by `keys`; present only to explain the migration.
    #[serde(default)]
    pub api_keys: Option<IgnoredAny>,
    /// Replaced by `keys[].key_env`; present only to explain the migration.
    #[serde(default)]
    pub api_keys_env: Option<IgnoredAny>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiKeyConfig {
    /// Names the key in usage events, metrics and logs (never the key itself).
    pub name: String,
    pub role: Role,
    /// The key inline (development only; dropped once hashed).
    #[serde(default)]
    pub key: Option<String>,
    /// Name of an environment variable of the edge that holds the key.
    #[serde(default)]
    pub key_env: Option<String>,
    /// Hex SHA-256 of the key (`printf %s KEY | sha256sum`).
    #[serde(default)]
    pub key_sha256: Option<String>,
    /// Model groups this key may use; absent: all of them.
    #[serde(default)]
    pub models: Option<Vec<String>>,
    /// Requests per minute, tokens per day and concurrent requests (each optional).
    #[serde(default)]
    pub limits: KeyLimitsConfig,
    /// The key's hash, resolved from whichever field gives it when the config was read.
    #[serde(skip)]
    hash: Option<TokenHash>,
}

/// Largest `requests_per_minute` and `max_concurrent`.
pub const MAX_KEY_RATE: u32 = 1_000_000;

/// A key's limits, enforced at admission (over one: 429 with `Retry-After`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyLimitsConfig {
    /// Requests admitted in any 60 s.
    #[serde(default)]
    pub requests_per_minute: Option<u32>,
    /// Input + output tokens in the current UTC day (from the usage ledger's counts).
    #[serde(default)]
    pub tokens_per_day: Option<u64>,
    /// Requests in flight at once.
    #[serde(default)]
    pub max_concurrent: Option<u32>,
    /// Output tokens a request that gives no `max_tokens` reserves against
    /// `tokens_per_day` while it runs (default 1024).
    #[serde(default)]
    pub reserve_tokens: Option<u64>,
}

/// Output tokens reserved for a request that gives no `max_tokens` (`reserve_tokens`).
pub const DEFAULT_RESERVE_TOKENS: u64 = 1024;
/// The largest `reserve_tokens`.
pub const MAX_RESERVE_TOKENS: u64 = 10_000_000;

impl KeyLimitsConfig {
    /// The output tokens a request reserves: its `max_tokens`, or `reserve_tokens`.
    pub fn reserved_output(&self, max_tokens: Option<u64>) -> u64 {
        max_tokens.unwrap_or(self.reserve_tokens.unwrap_or(DEFAULT_RESERVE_TOKENS))
    }

    /// Whether any limit is set.
    pub fn any(&self) -> bool {
        self.requests_per_minute.is_some()
            || self.tokens_per_day.is_some()
            || self.max_concurrent.is_some()
    }

    /// The bounds; the error names the field.
    pub fn validate(&self) -> Result<(), FieldError> {
        for (field, value) in [
            ("requests_per_minute", self.requests_per_minute),
            ("max_concurrent", self.max_concurrent),
        ] {
            if let Some(n) = value
                && !(1..=MAX_KEY_RATE).contains(&n)
            {
                return Err(FieldError::new(
                    field.into(),
                    format!(
                        "{n} is out of range: give 1 to {MAX_KEY_RATE}, or leave it out for no limit"
                    ),
                ));
            }
        }
        if let Some(n) = self.reserve_tokens
            && n > MAX_RESERVE_TOKENS
        {
            return Err(FieldError::new(
                "reserve_tokens".into(),
                format!("{n} is out of range: give 0 to {MAX_RESERVE_TOKENS}"),
            ));
        }
        if self.tokens_per_day == Some(0) {
            return Err(FieldError::new(
                "tokens_per_day".into(),
                "0 allows nothing: give at least 1, or leave it out for no limit".into(),
            ));
        }
        Ok(())
    }
}

const MIGRATION: &str = "auth.api_keys and auth.api_keys_env were replaced by named keys with a role. \
Write each key as an entry of auth.keys, e.g.\n  auth:\n    keys:\n      \
- {name: ops, role: admin, key_env: IOP_ADMIN_KEY}      # /admin/*, /metrics, node commands\n      \
- {name: team-a, role: client, key_sha256: <hex>}       # OpenAI API and its own runs\n\
(`key:` inline, `key_env:` an environment variable, or `key_sha256:` the digest from \
`printf %s KEY | sha256sum`; keys need at least 16 characters)";

impl AuthConfig {
    /// Checks the keys; the error names the field by its YAML path. `local` says whether
    /// a name no configured group has may still be a group of an Ollama provider's own
    /// models (`models:` on an Ollama provider).
    pub fn validate(
        &self,
        groups: &[ModelGroupConfig],
        local: &dyn Fn(&str) -> bool,
    ) -> Result<(), FieldError> {
        if self.api_keys.is_some() {
            return Err(FieldError::new("auth.api_keys".into(), MIGRATION.into()));
        }
        if self.api_keys_env.is_some() {
            return Err(FieldError::new(
                "auth.api_keys_env".into(),
                MIGRATION.into(),
            ));
        }
        if self.allow_anonymous && !self.keys.is_empty() {
            return Err(FieldError::new(
                "auth.allow_anonymous".into(),
                "only meaningful without auth.keys: with keys, every request needs one".into(),
            ));
        }
        let mut names = HashSet::new();
        let mut hashes: Vec<(TokenHash, &str)> = Vec::new();
        for (i, key) in self.keys.iter().enumerate() {
            let at = format!("auth.keys[{i}]");
            validate_name(&key.name).map_err(|m| FieldError::new(format!("{at}.name"), m))?;
            key.limits
                .validate()
                .map_err(|e| e.under(&format!("{at}.limits")))?;
            if !names.insert(key.name.as_str()) {
                return Err(FieldError::new(
                    format!("{at}.name"),
                    format!("duplicate key name {:?}", key.name),
                ));
            }
            let Some(hash) = key.key_hash() else {
                return Err(FieldError::new(
                    format!("{at}.key"),
                    "one of key, key_env or key_sha256 is required".into(),
                ));
            };
            if let Some((_, other)) = hashes.iter().find(|(h, _)| *h == hash) {
                return Err(FieldError::new(
                    at.to_string(),
                    format!(
                        "keys {other:?} and {:?} are the same key; give each its own",
                        key.name
                    ),
                ));
            }
            hashes.push((hash, &key.name));
            if let Some(models) = &key.models {
                if models.is_empty() {
                    return Err(FieldError::new(
                        format!("{at}.models"),
                        "an empty allowlist allows nothing; leave `models` out to allow every model group".into(),
                    ));
                }
                for (m, model) in models.iter().enumerate() {
                    if !groups.iter().any(|g| &g.name == model) && !local(model) {
                        return Err(FieldError::new(
                            format!("{at}.models[{m}]"),
                            format!(
                                "no model group named {model:?} in model_groups[], and no Ollama provider's `models:` serves a model of that name"
                            ),
                        ));
                    }
                }
            }
        }
        Ok(())
    }
}

fn validate_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("must not be empty".into());
    }
    if name.len() > MAX_KEY_NAME_CHARS {
        return Err(format!("at most {MAX_KEY_NAME_CHARS} characters"));
    }
    if !name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    {
        return Err(format!(
            "{name:?}: only letters, digits, '-', '_' and '.' (it is a metrics label)"
        ));
    }
    Ok(())
}

impl ApiKeyConfig {
    /// Resolves the key (once): its hash is kept, the inline key dropped.
    pub(super) fn resolve_key(&mut self, env: Env<'_>) -> Result<(), FieldError> {
        let fields = SecretFields {
            inline: ("key", self.key.as_deref()),
            env: ("key_env", self.key_env.as_deref()),
            sha256: ("key_sha256", self.key_sha256.as_deref()),
        };
        self.hash = fields.resolve(MIN_API_KEY_CHARS, env)?;
        self.key = None;
        Ok(())
    }

    /// The SHA-256 of the key, as resolved when the config was read (`None`: no field
    /// gives one, which validation refuses).
    pub fn key_hash(&self) -> Option<TokenHash> {
        self.hash
    }
}

#[cfg(test)]
mod tests {
    use crate::{EdgeConfig, FieldError, Role};

    const GROUPS: &str = r#"
nodes:
  - id: n
    token: node-token-0123456789
    providers: [{id: m, kind: mock}]
model_groups:
  - {name: small, members: [{node: n, provider: m}]}
"#;

    fn parse(auth: &str) -> Result<EdgeConfig, String> {
        EdgeConfig::from_yaml(&format!("{auth}\n{GROUPS}"), "edge.yaml").map_err(|e| e.to_string())
    }

    #[test]
    fn keys_parse_with_name_role_source_and_allowlist() {
        let c = parse(
            "auth:\n  keys:\n    - {name: ops, role: admin, key: admin-key-0123456789}\n    - {name: a.b-c_1, role: client, key_sha256: '9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08', models: [small]}",
        )
        .unwrap();
        assert_eq!(c.auth.keys[0].role, Role::Admin);
        assert_eq!(
            c.auth.keys[1].models.as_deref(),
            Some(&["small".to_string()][..])
        );
        assert!(!c.auth.allow_anonymous);
    }

    #[test]
    fn the_old_fields_are_refused_with_the_migration() {
        for old in ["auth: {api_keys: [sk-1]}", "auth: {api_keys_env: KEYS}"] {
            let e = parse(old).unwrap_err();
            assert!(e.contains("auth.api_keys"), "{e}");
            assert!(e.contains("auth:\n    keys:"), "{e}");
            assert!(e.contains("role: client"), "{e}");
        }
    }

    #[test]
    fn bad_keys_are_named_by_their_path() {
        let cases = [
            (
                "{name: a, role: client, key: short}",
                "auth.keys[0].key",
                "16",
            ),
            ("{name: a, role: client}", "auth.keys[0].key", "required"),
            (
                "{name: a, role: client, key: long-enough-key-123, key_env: X}",
                "auth.keys[0].key",
                "only one",
            ),
            (
                "{name: '', role: client, key: long-enough-key-123}",
                "auth.keys[0].name",
                "empty",
            ),
            (
                "{name: 'a b', role: client, key: long-enough-key-123}",
                "auth.keys[0].name",
                "label",
            ),
            (
                "{name: a, role: root, key: long-enough-key-123}",
                "auth.keys[0].role",
                "variant",
            ),
            (
                "{name: a, role: client, key: long-enough-key-123, models: [big]}",
                "auth.keys[0].models[0]",
                "big",
            ),
            (
                "{name: a, role: client, key: long-enough-key-123, models: []}",
                "auth.keys[0].models",
                "empty",
            ),
            (
                "{name: a, role: client, key_sha256: abc}",
                "auth.keys[0].key_sha256",
                "64",
            ),
            (
                "{name: a, role: client, key_env: IOP_TEST_SURELY_UNSET_VAR}",
                "auth.keys[0].key_env",
                "not set",
            ),
            (
                "{name: a, role: client, key: long-enough-key-123, limits: {reserve_tokens: 99999999999}}",
                "auth.keys[0].limits.reserve_tokens",
                "out of range",
            ),
        ];
        for (key, path, words) in cases {
            let e = parse(&format!("auth:\n  keys:\n    - {key}")).unwrap_err();
            assert!(e.contains(path) && e.contains(words), "{key}: {e}");
        }
    }

    #[test]
    fn two_keys_may_share_neither_a_name_nor_a_value() {
        let e = parse("auth:\n  keys:\n    - {name: a, role: client, key: long-enough-key-123}\n    - {name: a, role: admin, key: other-long-key-4567}").unwrap_err();
        assert!(
            e.contains("auth.keys[1].name") && e.contains("duplicate"),
            "{e}"
        );
        let e = parse("auth:\n  keys:\n    - {name: a, role: client, key: long-enough-key-123}\n    - {name: b, role: admin, key: long-enough-key-123}").unwrap_err();
        assert!(
            e.contains("auth.keys[1]") && e.contains("\"a\"") && e.contains("\"b\""),
            "{e}"
        );
    }

    #[test]
    fn anonymous_access_is_for_keyless_edges_only() {
        let e = parse("auth:\n  allow_anonymous: true\n  keys:\n    - {name: a, role: client, key: long-enough-key-123}").unwrap_err();
        assert!(e.contains("auth.allow_anonymous"), "{e}");
    }

    #[test]
    fn a_keyless_edge_serves_loopback_only_unless_told_otherwise() {
        let mut c = parse("").unwrap();
        c.check_http_exposure().unwrap();
        c.listen.http = "[::1]:8080".parse().unwrap();
        c.check_http_exposure().unwrap();
        c.listen.http = "0.0.0.0:8080".parse().unwrap();
        let FieldError { path, message } = c.check_http_exposure().unwrap_err();
        assert_eq!(path, "auth.keys");
        assert!(
            message.contains("0.0.0.0:8080") && message.contains("allow_anonymous"),
            "{message}"
        );
        c.auth.allow_anonymous = true;
        c.check_http_exposure().unwrap();
        let mut keyed =
            parse("auth:\n  keys:\n    - {name: a, role: admin, key: long-enough-key-123}")
                .unwrap();
        keyed.listen.http = "192.0.2.1:80".parse().unwrap();
        keyed.check_http_exposure().unwrap();
    }

    #[test]
    fn http_limits_have_defaults_and_bounds() {
        let c = parse("").unwrap();
        assert_eq!(c.limits.http, crate::HttpLimitsConfig::default());
        assert_eq!(c.limits.http.header_timeout_sec, 10);
        let c = parse("limits: {http: {header_timeout_sec: 1, max_connections: 5000}}").unwrap();
        assert_eq!(
            (
                c.limits.http.header_timeout_sec,
                c.limits.http.max_connections
            ),
            (1, Some(5000))
        );
        for (bad, path) in [
            (
                "limits: {http: {header_timeout_sec: 0}}",
                "limits.http.header_timeout_sec",
            ),
            (
                "limits: {http: {write_timeout_sec: 0}}",
                "limits.http.write_timeout_sec",
            ),
            (
                "limits: {http: {max_connections: 0}}",
                "limits.http.max_connections",
            ),
            (
                "limits: {http: {max_response_bytes: 10}}",
                "limits.http.max_response_bytes",
            ),
            ("limits: {http: {header_timout_sec: 1}}", "limits.http"),
        ] {
            let e = parse(bad).unwrap_err();
            assert!(e.contains(path), "{bad}: {e}");
        }
    }
}
