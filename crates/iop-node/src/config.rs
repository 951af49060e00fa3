//! Node configuration (`configs/node.yaml`): where the edge is, how the node verifies it
//! (pin, CA file) and proves itself (token, client certificate, the state file a join
//! fills), the run store, and the reconnect policy. Everything about providers comes from the edge in the
//! `NodeConfigPayload`; this file only says how to reach it.
//!
//! Errors name the YAML path of the offending field.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

/// The node's local run store, as the spec gives it.
pub const DEFAULT_DB: &str = "file:iop.db?cache=shared&mode=rwc";
pub const DEFAULT_EDGE: &str = "127.0.0.1:7700";
pub const DEFAULT_MAX_ATTEMPTS: u32 = 10;
pub const DEFAULT_INTERVAL_SEC: f64 = 10.0;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {file}: {source}")]
    Io {
        file: String,
        #[source]
        source: std::io::Error,
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
pub struct NodeConfig {
    /// The edge's node listener, `host:port`.
    #[serde(default = "default_edge")]
    pub edge: String,
    /// The node's token inline (development only).
    #[serde(default)]
    pub token: Option<String>,
    /// Name of an environment variable holding the token.
    #[serde(default)]
    pub token_env: Option<String>,
    /// SQLite database of the local run store (a path or a `file:` URI).
    #[serde(default = "default_db")]
    pub db: String,
    #[serde(default)]
    pub reconnect: ReconnectConfig,
    #[serde(default = "default_max_frame_bytes")]
    pub max_frame_bytes: usize,
    /// Pins (`sha256:...`) of the edge's CA, any one of which must match: the edge prints
    /// its pin at start. One string or a list (a list while the edge's CA is rotated).
    #[serde(default, deserialize_with = "one_or_many")]
    pub edge_pin: Vec<String>,
    /// A PEM file of CA certificates to verify the edge by instead of a pin (host names
    /// are checked).
    #[serde(default)]
    pub edge_ca: Option<PathBuf>,
    /// Do not verify the edge at all: anyone on the path can read and change everything.
    #[serde(default)]
    pub insecure_skip_tls_verify: bool,
    /// Plain TCP, for an edge whose `node_tls.mode` is `insecure_plaintext`.
    #[serde(default)]
    pub insecure_plaintext: bool,
    /// Where the node keeps the credential it receives when it joins (mode 0600).
    #[serde(default = "default_state_file")]
    pub state_file: PathBuf,
    /// mTLS with an operator's PKI: the node's PEM client certificate (its CN is the node
    /// id) and key.
    #[serde(default)]
    pub client_cert: Option<PathBuf>,
    #[serde(default)]
    pub client_key: Option<PathBuf>,
}

fn default_state_file() -> PathBuf {
    PathBuf::from(crate::identity::DEFAULT_STATE_FILE)
}

fn one_or_many<'de, D: serde::Deserializer<'de>>(de: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(String),
        Many(Vec<String>),
    }
    Ok(match OneOrMany::deserialize(de)? {
        OneOrMany::One(s) => vec![s],
        OneOrMany::Many(v) => v,
    })
}

fn default_edge() -> String {
    DEFAULT_EDGE.into()
}

fn default_db() -> String {
    DEFAULT_DB.into()
}

fn default_max_frame_bytes() -> usize {
    iop_proto::DEFAULT_MAX_FRAME_BYTES
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReconnectConfig {
    /// Connection attempts before giving up: omitted → 10, 0 → unlimited.
    #[serde(default = "default_max_attempts")]
    pub max_attempts: u32,
    /// Wait between attempts, in seconds (fractions allowed).
    #[serde(default = "default_interval")]
    pub interval_sec: f64,
}

fn default_max_attempts() -> u32 {
    DEFAULT_MAX_ATTEMPTS
}

fn default_interval() -> f64 {
    DEFAULT_INTERVAL_SEC
}

impl Default for ReconnectConfig {
    fn default() -> Self {
        Self {
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            interval_sec: DEFAULT_INTERVAL_SEC,
        }
    }
}

impl ReconnectConfig {
    pub fn interval(&self) -> Duration {
        Duration::from_secs_f64(self.interval_sec)
    }

    /// `None` means unlimited.
    pub fn limit(&self) -> Option<u32> {
        (self.max_attempts != 0).then_some(self.max_attempts)
    }
}

impl Default for NodeConfig {
    fn default() -> Self {
        Self {
            edge: default_edge(),
            token: None,
            token_env: None,
            db: default_db(),
            reconnect: ReconnectConfig::default(),
            max_frame_bytes: default_max_frame_bytes(),
            edge_pin: Vec::new(),
            edge_ca: None,
            insecure_skip_tls_verify: false,
            insecure_plaintext: false,
            state_file: default_state_file(),
            client_cert: None,
            client_key: None,
        }
    }
}

impl NodeConfig {
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            file: file.clone(),
            source,
        })?;
        Self::from_yaml(&text, &file)
    }

    pub fn from_yaml(text: &str, file: &str) -> Result<Self, ConfigError> {
        let invalid = |path: String, message: String| ConfigError::Invalid {
            file: file.to_string(),
            path,
            message,
        };
        let config: NodeConfig = if text.trim().is_empty() {
            NodeConfig::default()
        } else {
            let de = serde_yaml_ng::Deserializer::from_str(text);
            serde_path_to_error::deserialize(de).map_err(|err| {
                let path = err.path().to_string();
                invalid(
                    if path == "." {
                        "(top level)".into()
                    } else {
                        path
                    },
                    err.into_inner().to_string(),
                )
            })?
        };
        config
            .validate()
            .map_err(|(path, message)| invalid(path, message))?;
        Ok(config)
    }

    pub fn validate(&self) -> Result<(), (String, String)> {
        if self.edge.trim().is_empty() || !self.edge.contains(':') {
            return Err(("edge".into(), format!("{:?} must be host:port", self.edge)));
        }
        if self.token.is_some() && self.token_env.is_some() {
            return Err((
                "token".into(),
                "give only one of token and token_env".into(),
            ));
        }
        let r = &self.reconnect;
        if !r.interval_sec.is_finite() || r.interval_sec < 0.0 {
            return Err((
                "reconnect.interval_sec".into(),
                "must be a non-negative number of seconds".into(),
            ));
        }
        if r.max_attempts == 0 && r.interval_sec <= 0.0 {
            return Err((
                "reconnect.interval_sec".into(),
                "must be positive when reconnect.max_attempts is 0 (unlimited)".into(),
            ));
        }
        if self.max_frame_bytes < 1024 {
            return Err(("max_frame_bytes".into(), "must be at least 1024".into()));
        }
        for (i, pin) in self.edge_pin.iter().enumerate() {
            if let Err(e) = pin.parse::<iop_proto::trust::Pin>() {
                return Err((format!("edge_pin[{i}]"), e.to_string()));
            }
        }
        if self.client_cert.is_some() != self.client_key.is_some() {
            return Err((
                "client_cert".into(),
                "client_cert and client_key go together".into(),
            ));
        }
        if self.insecure_plaintext {
            let tls_fields = [
                ("edge_pin", !self.edge_pin.is_empty()),
                ("edge_ca", self.edge_ca.is_some()),
                ("insecure_skip_tls_verify", self.insecure_skip_tls_verify),
                ("client_cert", self.client_cert.is_some()),
            ];
            if let Some((field, _)) = tls_fields.iter().find(|(_, set)| *set) {
                return Err((
                    (*field).into(),
                    "is a TLS setting, and insecure_plaintext turns TLS off".into(),
                ));
            }
        }
        Ok(())
    }

    /// The pins of `edge_pin`, parsed (valid after [`NodeConfig::validate`]).
    pub fn pins(&self) -> Vec<iop_proto::trust::Pin> {
        self.edge_pin
            .iter()
            .filter_map(|p| p.parse().ok())
            .collect()
    }

    /// The token from the config or its environment variable, if either is set.
    pub fn resolve_token(&self) -> Result<Option<String>, String> {
        if let Some(token) = &self.token {
            return Ok(Some(token.clone()));
        }
        if let Some(var) = &self.token_env {
            return match std::env::var(var) {
                Ok(t) if !t.is_empty() => Ok(Some(t)),
                _ => Err(format!("token_env: environment variable {var} is not set")),
            };
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<NodeConfig, ConfigError> {
        NodeConfig::from_yaml(text, "node.yaml")
    }

    #[test]
    fn empty_config_takes_the_defaults() {
        let c = parse("").unwrap();
        assert_eq!(c.edge, DEFAULT_EDGE);
        assert_eq!(c.db, DEFAULT_DB);
        assert_eq!(c.reconnect.limit(), Some(10));
        assert_eq!(c.reconnect.interval(), Duration::from_secs(10));
    }

    #[test]
    fn zero_attempts_means_unlimited() {
        let c = parse("reconnect: {max_attempts: 0, interval_sec: 0.5}").unwrap();
        assert_eq!(c.reconnect.limit(), None);
        assert_eq!(c.reconnect.interval(), Duration::from_millis(500));
    }

    #[test]
    fn unlimited_needs_a_positive_interval() {
        let e = parse("reconnect: {max_attempts: 0, interval_sec: 0}")
            .unwrap_err()
            .to_string();
        assert!(e.contains("reconnect.interval_sec"), "{e}");
    }

    #[test]
    fn unknown_fields_are_named() {
        let e = parse("reconect: {}").unwrap_err().to_string();
        assert!(e.contains("reconect"), "{e}");
        let e = parse("reconnect: {max_attempt: 3}")
            .unwrap_err()
            .to_string();
        assert!(e.contains("reconnect"), "{e}");
    }

    #[test]
    fn pins_are_one_or_many_and_checked() {
        let pin = iop_proto::trust::Pin::of_spki(b"ca").to_string();
        let c = parse(&format!("edge_pin: \"{pin}\"")).unwrap();
        assert_eq!(c.pins().len(), 1);
        let c = parse(&format!("edge_pin: [\"{pin}\", \"{pin}\"]")).unwrap();
        assert_eq!(c.edge_pin.len(), 2);
        let e = parse("edge_pin: [\"sha256:nope\"]")
            .unwrap_err()
            .to_string();
        assert!(e.contains("edge_pin[0]"), "{e}");
        let e = parse("insecure_plaintext: true\nedge_ca: ca.pem")
            .unwrap_err()
            .to_string();
        assert!(e.contains("edge_ca"), "{e}");
        let e = parse("client_cert: c.pem").unwrap_err().to_string();
        assert!(e.contains("client_key"), "{e}");
    }

    #[test]
    fn bad_edge_is_named() {
        let e = parse("edge: localhost").unwrap_err().to_string();
        assert!(e.contains("edge"), "{e}");
    }
}

#[cfg(test)]
mod shipped_examples {
    #[test]
    fn the_shipped_node_config_is_valid() {
        let text = include_str!("../../../configs/node.yaml");
        let c = super::NodeConfig::from_yaml(text, "configs/node.yaml").unwrap();
        assert_eq!(c.db, super::DEFAULT_DB);
    }
}
