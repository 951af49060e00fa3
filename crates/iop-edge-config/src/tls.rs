//! TLS of the two listeners: the node listener's mode (the edge's own CA, the
//! operator's certificate, or plaintext on purpose) and the HTTP listener's certificate.

use std::path::PathBuf;

use serde::Deserialize;

use super::FieldError;

/// Lifetime of a joined node's credential unless `node_tls.credential_days` says.
pub const DEFAULT_CREDENTIAL_DAYS: u32 = 365;

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

impl NodeTlsConfig {
    /// Checks the mode's requirements; paths are under `node_tls`.
    pub fn validate(&self) -> Result<(), FieldError> {
        let invalid = |path: &str, message: String| Err(FieldError::new(path.to_string(), message));
        let tls = self;
        if tls.credential_days == 0 {
            return invalid("credential_days", "must be positive".into());
        }
        for (i, addr) in tls.advertise.iter().enumerate() {
            if addr.trim().is_empty() || !addr.contains(':') || addr.contains('/') {
                return invalid(
                    &format!("advertise[{i}]"),
                    format!("{addr:?} must be host:port"),
                );
            }
        }
        for (i, name) in tls.names.iter().enumerate() {
            if name.trim().is_empty() {
                return invalid(&format!("names[{i}]"), "must not be empty".into());
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
                        return invalid(field, "required with node_tls.mode provided".into());
                    }
                }
            }
            mode => {
                if let Some((field, _)) = files.iter().find(|(_, given)| *given) {
                    return invalid(
                        field,
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
