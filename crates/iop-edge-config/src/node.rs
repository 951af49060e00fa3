//! The nodes the edge accepts: each one's id, its static token (if it registers with
//! one rather than a certificate) and its providers.

use serde::Deserialize;

use super::secret::{Env, SecretFields, TokenHash};
use super::{FieldError, ProviderConfig};

/// Shortest node token accepted.
pub const MIN_TOKEN_CHARS: usize = 16;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeConfig {
    pub id: String,
    /// The node's token inline (development only; dropped once hashed).
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
    /// The token's hash, resolved from whichever field gives it when the config was read.
    #[serde(skip)]
    token_hash: Option<TokenHash>,
    #[serde(skip)]
    token_field: &'static str,
}

impl NodeConfig {
    /// Resolves the node's token (once): its hash is kept, the inline token dropped.
    pub(super) fn resolve_token(&mut self, env: Env<'_>) -> Result<(), FieldError> {
        let fields = SecretFields {
            inline: ("token", self.token.as_deref()),
            env: ("token_env", self.token_env.as_deref()),
            sha256: ("token_sha256", self.token_sha256.as_deref()),
        };
        self.token_field = fields.given();
        self.token_hash = fields.resolve(MIN_TOKEN_CHARS, env)?;
        self.token = None;
        Ok(())
    }

    /// The field this node's token comes from, for error paths.
    pub fn token_field(&self) -> &'static str {
        self.token_field
    }

    /// The SHA-256 of this node's static token, or `None` when it has none (it registers
    /// with a certificate: joined, or mTLS).
    pub fn token_hash(&self) -> Option<TokenHash> {
        self.token_hash
    }
}
