//! Who a request is and what it may do: the configured API keys (SHA-256 digests, compared
//! in constant time against every key), the [`Caller`] a request authenticates as, and the
//! decisions that depend on it — admin-only surfaces, a key's model allowlist, and which
//! runs and CLI sessions belong to it. Pure: no I/O, no clocks.
//!
//! With no keys configured every request is the anonymous caller, who may do everything (a
//! loopback development edge, or one the config opened with `auth.allow_anonymous`).

use std::sync::Arc;

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::config::{AuthConfig, KeyLimitsConfig, Role, TokenHash};

/// One configured key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiKey {
    pub name: Arc<str>,
    pub role: Role,
    /// The model groups it may use; `None`: all.
    pub models: Option<Vec<String>>,
    /// Its limits (`auth.keys[].limits`).
    pub limits: KeyLimitsConfig,
    hash: TokenHash,
}

/// Every configured key; replaced as a whole on reload.
#[derive(Debug, Clone, Default)]
pub struct KeyTable {
    keys: Vec<Arc<ApiKey>>,
}

impl KeyTable {
    /// The keys of a validated config (a key whose source no longer resolves is left out).
    pub fn from_config(auth: &AuthConfig) -> Self {
        let keys = auth
            .keys
            .iter()
            .filter_map(|k| {
                let hash = k.key_hash()?;
                Some(Arc::new(ApiKey {
                    name: k.name.as_str().into(),
                    role: k.role,
                    models: k.models.clone(),
                    limits: k.limits,
                    hash,
                }))
            })
            .collect();
        Self { keys }
    }

    /// No keys: the API is open.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The key `presented` is, if any. Every key is compared, in constant time.
    pub fn find(&self, presented: &str) -> Option<Arc<ApiKey>> {
        let digest: TokenHash = Sha256::digest(presented.as_bytes()).into();
        let mut found = None;
        for key in &self.keys {
            if bool::from(key.hash.ct_eq(&digest)) {
                found = Some(key.clone());
            }
        }
        found
    }

    /// The key named `name`.
    pub fn find_by_name(&self, name: &str) -> Option<&ApiKey> {
        self.keys.iter().map(|k| &**k).find(|k| &*k.name == name)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.keys.iter().map(|k| &*k.name)
    }
}

/// The identity a request was authenticated as.
#[derive(Debug, Clone)]
pub struct Caller {
    key: Option<Arc<ApiKey>>,
}

/// Separates a client key's name from the session id it chose.
pub const SESSION_SCOPE_SEPARATOR: char = ':';

impl Caller {
    /// No keys are configured: everything is allowed.
    pub fn anonymous() -> Self {
        Self { key: None }
    }

    pub fn with_key(key: Arc<ApiKey>) -> Self {
        Self { key: Some(key) }
    }

    /// The key's name; `None` for the anonymous caller.
    pub fn key_name(&self) -> Option<&str> {
        self.key.as_deref().map(|k| &*k.name)
    }

    /// The key's limits, when it has any.
    pub fn limits(&self) -> Option<&KeyLimitsConfig> {
        self.key.as_ref().map(|k| &k.limits).filter(|l| l.any())
    }

    /// Admin surfaces (`/admin/*`, `/metrics`, node commands) and every key's runs and
    /// sessions. The anonymous caller of an open edge is admin.
    pub fn is_admin(&self) -> bool {
        self.key.as_ref().is_none_or(|k| k.role == Role::Admin)
    }

    /// Whether the key's allowlist includes `group` (every key without one does).
    pub fn may_use_model(&self, group: &str) -> bool {
        match self.key.as_ref().and_then(|k| k.models.as_ref()) {
            Some(models) => models.iter().any(|m| m == group),
            None => true,
        }
    }

    /// The key's model allowlist, if it has one.
    pub fn allowed_models(&self) -> Option<&[String]> {
        self.key.as_ref()?.models.as_deref()
    }

    /// The owner recorded on runs this caller starts.
    pub fn owner(&self) -> Option<String> {
        self.key_name().map(String::from)
    }

    /// Whether this caller may see or cancel a run started by `owner`: admins any run,
    /// a client key only its own.
    pub fn may_touch(&self, owner: Option<&str>) -> bool {
        self.is_admin() || (owner.is_some() && owner == self.key_name())
    }

    /// The session id sent to the node for the id a client chose. A client key's sessions
    /// live in its own namespace (`<key name>:<id>`), so another key naming the same id
    /// reaches a different session and can neither take over nor end this one. Admins
    /// (and the anonymous caller) address sessions by their full id.
    pub fn scoped_session_id(&self, session_id: &str) -> String {
        match &self.key {
            Some(k) if k.role == Role::Client && !session_id.is_empty() => {
                format!("{}{SESSION_SCOPE_SEPARATOR}{session_id}", k.name)
            }
            _ => session_id.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::EdgeConfig;

    fn table() -> KeyTable {
        let config = EdgeConfig::from_yaml(
            r#"
auth:
  keys:
    - {name: ops, role: admin, key: admin-key-0123456789}
    - {name: alice, role: client, key: alice-key-0123456789}
    - {name: bob, role: client, key: bob-key-01234567890, models: [small]}
nodes:
  - {id: n, token: node-token-0123456789, providers: [{id: m, kind: mock}]}
model_groups:
  - {name: small, members: [{node: n, provider: m}]}
"#,
            "test",
        )
        .unwrap();
        KeyTable::from_config(&config.auth)
    }

    fn caller(presented: &str) -> Caller {
        Caller::with_key(table().find(presented).expect("a configured key"))
    }

    #[test]
    fn keys_are_found_by_value_and_nothing_else() {
        let t = table();
        assert_eq!(
            t.find("alice-key-0123456789").unwrap().name.as_ref(),
            "alice"
        );
        assert!(t.find("alice-key-012345678").is_none());
        assert!(t.find("").is_none());
        assert!(t.find("alice").is_none());
        assert!(!t.is_empty());
        assert!(KeyTable::default().is_empty());
    }

    #[test]
    fn only_admins_and_the_anonymous_caller_reach_admin_surfaces() {
        assert!(caller("admin-key-0123456789").is_admin());
        assert!(!caller("alice-key-0123456789").is_admin());
        assert!(Caller::anonymous().is_admin());
    }

    #[test]
    fn the_model_allowlist_limits_only_keys_that_have_one() {
        let bob = caller("bob-key-01234567890");
        assert!(bob.may_use_model("small"));
        assert!(!bob.may_use_model("large"));
        assert!(caller("alice-key-0123456789").may_use_model("large"));
        assert!(Caller::anonymous().may_use_model("anything"));
    }

    #[test]
    fn a_client_touches_only_its_own_runs_and_an_admin_any() {
        let alice = caller("alice-key-0123456789");
        let bob = caller("bob-key-01234567890");
        assert!(alice.may_touch(Some("alice")));
        assert!(!bob.may_touch(Some("alice")));
        assert!(
            !alice.may_touch(None),
            "a run of an unknown owner is not a client's"
        );
        assert!(caller("admin-key-0123456789").may_touch(Some("alice")));
        assert!(Caller::anonymous().may_touch(None));
    }

    #[test]
    fn client_sessions_live_in_their_key_namespace() {
        let alice = caller("alice-key-0123456789");
        let bob = caller("bob-key-01234567890");
        assert_eq!(alice.scoped_session_id("s1"), "alice:s1");
        assert_ne!(alice.scoped_session_id("s1"), bob.scoped_session_id("s1"));
        // Naming another key's namespace only nests inside one's own.
        assert_eq!(bob.scoped_session_id("alice:s1"), "bob:alice:s1");
        assert_eq!(alice.scoped_session_id(""), "");
        let admin = caller("admin-key-0123456789");
        assert_eq!(admin.scoped_session_id("alice:s1"), "alice:s1");
        assert_eq!(Caller::anonymous().scoped_session_id("s1"), "s1");
    }
}
