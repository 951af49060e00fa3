//! How the node reaches the edge and proves who it is: the edge addresses, TLS (and how the
//! edge is verified), and the node's credential — a static token, a join token about to be
//! redeemed, or a client certificate (received at a join, or from an operator's PKI).
//!
//! A join turns into a certificate on the first accepted registration: the private key is
//! made here, only its certificate signing request goes to the edge, and the certificate
//! the edge returns is saved with the key in the state file (0600) before the node goes on.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use iop_proto::pb;
use iop_proto::trust::{JoinString, Pin};
use parking_lot::Mutex;
use rustls::ClientConfig;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};

use crate::identity::NodeState;
use crate::tls::{EdgeVerification, client_config, server_name};

/// Whether and how the link is encrypted.
#[derive(Debug, Clone)]
pub enum Security {
    /// Plain TCP, for an edge whose node listener is `insecure_plaintext`.
    InsecurePlaintext,
    Tls(EdgeVerification),
}

enum Credential {
    Token(String),
    Join {
        join: JoinString,
        key_pem: String,
        csr_der: Vec<u8>,
    },
    Certificate {
        chain: Vec<CertificateDer<'static>>,
        key: PrivateKeyDer<'static>,
        source: &'static str,
    },
}

/// The node's way to the edge.
pub struct EdgeLink {
    edges: Vec<String>,
    next: AtomicUsize,
    security: Security,
    state_file: Option<PathBuf>,
    /// Shared with the links to the fleet's other edges ([`EdgeLink::for_edge`]).
    credential: Arc<Mutex<Credential>>,
}

impl std::fmt::Debug for EdgeLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EdgeLink")
            .field("edges", &self.edges)
            .field("security", &self.security)
            .field("credential", &self.credential_kind())
            .finish()
    }
}

impl EdgeLink {
    fn new(edges: Vec<String>, security: Security, credential: Credential) -> Self {
        Self {
            edges,
            next: AtomicUsize::new(0),
            security,
            state_file: None,
            credential: Arc::new(Mutex::new(credential)),
        }
    }

    /// A link to another edge of the fleet, at `address`: the same credential (a joined
    /// node's certificate, once it has one) and the same way of verifying the edge.
    pub fn for_edge(&self, address: String) -> EdgeLink {
        EdgeLink {
            edges: vec![address],
            next: AtomicUsize::new(0),
            security: self.security.clone(),
            state_file: None,
            credential: self.credential.clone(),
        }
    }

    /// A node that authenticates with its client certificate (`chain`, `key`) over TLS.
    fn with_certificate(
        edges: Vec<String>,
        verification: EdgeVerification,
        chain: Vec<CertificateDer<'static>>,
        key: PrivateKeyDer<'static>,
    ) -> Self {
        let credential = Credential::Certificate {
            chain,
            key,
            source: "client_certificate",
        };
        Self::new(edges, Security::Tls(verification), credential)
    }

    /// A node that authenticates with a static token.
    pub fn with_token(edges: Vec<String>, security: Security, token: String) -> Self {
        Self::new(edges, security, Credential::Token(token))
    }

    /// A node with an operator-issued client certificate (mTLS); PEM files.
    pub fn with_certificate_files(
        edges: Vec<String>,
        verification: EdgeVerification,
        cert: &std::path::Path,
        key: &std::path::Path,
    ) -> Result<Self, String> {
        let chain = CertificateDer::pem_file_iter(cert)
            .map_err(|e| format!("{}: {e}", cert.display()))?
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("{}: {e}", cert.display()))?;
        if chain.is_empty() {
            return Err(format!("{}: no PEM certificate in it", cert.display()));
        }
        let key =
            PrivateKeyDer::from_pem_file(key).map_err(|e| format!("{}: {e}", key.display()))?;
        Ok(Self::with_certificate(edges, verification, chain, key))
    }

    /// A node about to join with `join`; `extra_pins` are trusted besides the join
    /// string's. The credential is saved to `state_file` once the edge issues it.
    pub fn join(
        join: JoinString,
        edges: Vec<String>,
        extra_pins: Vec<Pin>,
        state_file: PathBuf,
    ) -> Result<Self, String> {
        let key = rcgen::KeyPair::generate().map_err(|e| format!("cannot make a key: {e}"))?;
        let mut params = rcgen::CertificateParams::default();
        params.distinguished_name = rcgen::DistinguishedName::new();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "iop node");
        let csr = params
            .serialize_request(&key)
            .map_err(|e| format!("cannot make a certificate signing request: {e}"))?;
        let mut pins = vec![join.pin];
        pins.extend(extra_pins.into_iter().filter(|p| *p != join.pin));
        let mut link = Self::new(
            edges,
            Security::Tls(EdgeVerification::Pins(pins)),
            Credential::Join {
                key_pem: key.serialize_pem(),
                csr_der: csr.der().to_vec(),
                join,
            },
        );
        link.state_file = Some(state_file);
        Ok(link)
    }

    /// A node that joined before: the credential and pins of its state file (with
    /// `verification` overriding the stored pins when given).
    pub fn from_state(
        state: &NodeState,
        edges: Vec<String>,
        verification: Option<EdgeVerification>,
        extra_pins: Vec<Pin>,
    ) -> Result<Self, String> {
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        if state.expires_unix_ms <= now_ms {
            return Err(format!(
                "this node's credential (node {}) has expired: create a new join token on the edge (`iop join-token --node {}`) and join again with it",
                state.node_id, state.node_id
            ));
        }
        let days_left = (state.expires_unix_ms - now_ms) / 86_400_000;
        if days_left < 30 {
            tracing::warn!(node_id = %state.node_id, days_left, "this node's credential expires soon: join again with a new join token before it does");
        }
        let chain = CertificateDer::pem_slice_iter(state.certificate_pem.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("the state file's certificate: {e}"))?;
        let key = PrivateKeyDer::from_pem_slice(state.key_pem.as_bytes())
            .map_err(|e| format!("the state file's key: {e}"))?;
        let verification = match verification {
            Some(v) => v,
            None => {
                let mut pins = state
                    .pins
                    .iter()
                    .map(|p| {
                        p.parse::<Pin>()
                            .map_err(|e| format!("the state file's pins: {e}"))
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                for pin in extra_pins {
                    if !pins.contains(&pin) {
                        pins.push(pin);
                    }
                }
                EdgeVerification::Pins(pins)
            }
        };
        Ok(Self::with_certificate(edges, verification, chain, key))
    }

    /// The edge address to dial now.
    pub fn edge_addr(&self) -> &str {
        &self.edges[self.next.load(Ordering::Relaxed) % self.edges.len()]
    }

    /// Moves on to the next edge address (after a failed dial).
    pub fn advance(&self) {
        self.next.fetch_add(1, Ordering::Relaxed);
    }

    pub fn edges(&self) -> &[String] {
        &self.edges
    }

    pub fn security(&self) -> &Security {
        &self.security
    }

    /// `static_token`, `join_token` or `client_certificate`.
    pub fn credential_kind(&self) -> &'static str {
        match &*self.credential.lock() {
            Credential::Token(_) => "static_token",
            Credential::Join { .. } => "join_token",
            Credential::Certificate { source, .. } => source,
        }
    }

    /// The TLS client config for the next connection, with the client certificate if
    /// the node has one.
    pub(crate) fn client_config(&self) -> Result<(Arc<ClientConfig>, ServerName<'static>), String> {
        let Security::Tls(verification) = &self.security else {
            return Err("the link is plaintext".into());
        };
        let cert = match &*self.credential.lock() {
            Credential::Certificate { chain, key, .. } => Some((chain.clone(), key.clone_key())),
            _ => None,
        };
        Ok((
            client_config(verification, cert)?,
            server_name(verification, self.edge_addr())?,
        ))
    }

    /// The registration this node sends.
    pub(crate) fn register_request(&self) -> pb::RegisterRequest {
        let mut request = pb::RegisterRequest {
            node_version: env!("CARGO_PKG_VERSION").to_string(),
            hostname: std::env::var("HOSTNAME").unwrap_or_default(),
            ..Default::default()
        };
        match &*self.credential.lock() {
            Credential::Token(token) => request.token = token.clone(),
            Credential::Join { join, csr_der, .. } => {
                request.join_token = join.token.to_string();
                request.credential_csr = csr_der.clone();
            }
            Credential::Certificate { .. } => {}
        }
        request
    }

    /// The edge accepted a join and issued `credential`: save it with the key and use it
    /// from now on.
    pub(crate) fn joined(
        &self,
        node_id: &str,
        credential: &pb::NodeCredential,
    ) -> Result<(), String> {
        let mut current = self.credential.lock();
        let Credential::Join { join, key_pem, .. } = &*current else {
            return Err("the edge sent a credential this node did not ask for".into());
        };
        let Security::Tls(EdgeVerification::Pins(pins)) = &self.security else {
            return Err("a join always verifies the edge by pin".into());
        };
        let certificate_pem = iop_proto::trust::pem("CERTIFICATE", &credential.certificate_der);
        let state = NodeState {
            node_id: node_id.to_string(),
            edges: self.edges.clone(),
            pins: pins.iter().map(Pin::to_string).collect(),
            join_token_id: join.token.id.clone(),
            certificate_pem,
            key_pem: key_pem.clone(),
            expires_unix_ms: credential.expires_unix_ms,
        };
        let path = self
            .state_file
            .as_ref()
            .ok_or("no state file to keep the credential in")?;
        state.save(path).map_err(|e| {
            format!("{e}; the join token is spent: create a new one and join again once the file can be written")
        })?;
        let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
            .map_err(|e| format!("the node's key: {e}"))?;
        tracing::info!(node_id, state_file = %path.display(), "joined: node credential saved; it is used from now on");
        *current = Credential::Certificate {
            chain: vec![CertificateDer::from(credential.certificate_der.clone())],
            key,
            source: "client_certificate",
        };
        Ok(())
    }
}

/// What the node was told on its command line besides its config file.
#[derive(Debug, Clone, Default)]
pub struct LinkOptions {
    /// A join string (`--join`).
    pub join: Option<String>,
    /// A static token (`--token`, `IOP_NODE_TOKEN`, or the config's).
    pub token: Option<String>,
    /// An edge address given explicitly (`--edge`, or a config file's `edge`).
    pub edge: Option<String>,
}

/// Builds the node's link from its config: an operator client certificate, else a join
/// string (unless the state file already holds the credential that join string gave),
/// else the state file's credential, else a static token. Fails closed: a token without a
/// way to verify the edge is a configuration error.
pub fn from_config(config: &crate::NodeConfig, options: LinkOptions) -> Result<EdgeLink, String> {
    use crate::identity::{NodeState, check_writable};
    let pins = config.pins();
    let explicit = if config.insecure_skip_tls_verify {
        Some(EdgeVerification::InsecureSkipVerify)
    } else if let Some(path) = &config.edge_ca {
        let certs = CertificateDer::pem_file_iter(path)
            .map_err(|e| format!("edge_ca {}: {e}", path.display()))?
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("edge_ca {}: {e}", path.display()))?;
        if certs.is_empty() {
            return Err(format!(
                "edge_ca {}: no PEM certificate in it",
                path.display()
            ));
        }
        Some(EdgeVerification::CaFile(certs))
    } else if !pins.is_empty() {
        Some(EdgeVerification::Pins(pins.clone()))
    } else {
        None
    };
    let edges_or = |fallback: &[String]| -> Vec<String> {
        match &options.edge {
            Some(edge) => vec![edge.clone()],
            None => fallback.to_vec(),
        }
    };
    let no_verification = || {
        "no way to verify the edge: pass --edge-pin sha256:... (the edge prints its pin at start; `iop edge --print-pin`), or --edge-ca FILE, or join with --join '<join string>'".to_string()
    };
    if let (Some(cert), Some(key)) = (&config.client_cert, &config.client_key) {
        let verification = explicit.ok_or_else(no_verification)?;
        return EdgeLink::with_certificate_files(
            edges_or(std::slice::from_ref(&config.edge)),
            verification,
            cert,
            key,
        );
    }
    let state = NodeState::load(&config.state_file)?;
    if let Some(join) = &options.join {
        let join = JoinString::parse(join).map_err(|e| format!("--join: {e}"))?;
        if let Some(state) = &state
            && state.join_token_id == join.token.id
        {
            tracing::info!(node_id = %state.node_id, state_file = %config.state_file.display(), "already joined with this join string: using the stored credential");
            let overriding = explicit.filter(|v| !matches!(v, EdgeVerification::Pins(_)));
            return EdgeLink::from_state(state, edges_or(&state.edges), overriding, pins);
        }
        if config.insecure_plaintext {
            return Err("a join needs TLS: drop insecure_plaintext".into());
        }
        check_writable(&config.state_file)?;
        if let Some(state) = &state {
            tracing::warn!(node_id = %state.node_id, state_file = %config.state_file.display(), "a new join string: the state file's credential will be replaced once the join succeeds");
        }
        let edges = edges_or(&join.edges);
        return EdgeLink::join(join, edges, pins, config.state_file.clone());
    }
    if let Some(state) = &state {
        if options.token.is_some() {
            tracing::info!(state_file = %config.state_file.display(), "the state file holds a credential from a join: using it instead of the token");
        }
        let overriding = explicit.filter(|v| !matches!(v, EdgeVerification::Pins(_)));
        return EdgeLink::from_state(state, edges_or(&state.edges), overriding, pins);
    }
    let token = options.token.ok_or_else(|| {
        "no credential: join with --join '<join string>' (from `iop join-token` on the edge), or pass --token / IOP_NODE_TOKEN, or give token/token_env in the config".to_string()
    })?;
    let edges = edges_or(std::slice::from_ref(&config.edge));
    if config.insecure_plaintext {
        return Ok(EdgeLink::with_token(
            edges,
            Security::InsecurePlaintext,
            token,
        ));
    }
    let verification = explicit.ok_or_else(no_verification)?;
    Ok(EdgeLink::with_token(
        edges,
        Security::Tls(verification),
        token,
    ))
}
