//! Node configuration (`configs/node.yaml`): where the edge is, the node's token, the run
//! store, and the reconnect policy. Everything about providers comes from the edge in the
//! `NodeConfigPayload`; this file only says how to reach it.
//!
//! Errors name the YAML path of the offending field.

use std::path::Path;
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
        Ok(())
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
