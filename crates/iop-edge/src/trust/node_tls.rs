//! TLS on the node listener: the server certificate the edge presents (its own CA's, or
//! an operator's files), which client certificates it accepts, and the handshake of each
//! accepted socket, bounded in time, before a single frame is read.
//!
//! TLS 1.3 only: the edge and the node are the same program, so nothing older is needed.
//! Client certificates are optional at the TLS layer (nodes that join or use a static
//! token present none); one that is presented must chain to a trusted client CA or the
//! handshake fails. Who the certificate names is decided at registration. In auto mode the
//! server certificate is renewed under the same CA while the edge runs
//! ([`NodeListenerTls::renew_if_due`]); new handshakes get the new one.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use iop_proto::trust::Pin;
use parking_lot::RwLock;
use rustls::RootCertStore;
use rustls::server::WebPkiClientVerifier;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::TcpStream;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

use super::{ClientCert, Link, TrustStore, load_pem_identity};
use crate::config::{NodeTlsConfig, NodeTlsMode};
use crate::pem::load_pem_certs;

/// In the state directory: the certificate(s) of CAs this edge's CA replaced, whose node
/// credentials are still accepted.
pub const PREVIOUS_CA: &str = "previous-ca.pem";

/// How often a running edge checks whether its server certificate needs renewing.
pub const RENEW_CHECK: Duration = Duration::from_secs(12 * 3600);

/// The node listener's TLS setup.
pub struct NodeListenerTls {
    acceptor: RwLock<TlsAcceptor>,
    pin: Option<Pin>,
    /// Whether client certificates can identify nodes.
    client_certs: bool,
    /// Auto mode: what renewing the server certificate needs.
    renewal: Option<Renewal>,
}

struct Renewal {
    trust: Arc<TrustStore>,
    names: Vec<String>,
    client_roots: Vec<CertificateDer<'static>>,
}

impl std::fmt::Debug for NodeListenerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeListenerTls")
            .field("pin", &self.pin)
            .field("client_certs", &self.client_certs)
            .finish()
    }
}

impl NodeListenerTls {
    /// The listener's TLS for `config`; `None` for `insecure_plaintext`.
    pub fn build(config: &NodeTlsConfig, trust: &Arc<TrustStore>) -> Result<Option<Self>, String> {
        match config.mode {
            NodeTlsMode::InsecurePlaintext => Ok(None),
            NodeTlsMode::Auto => {
                let ca = trust
                    .ca()
                    .ok_or("node_tls.mode auto needs the edge CA, which was not loaded")?;
                let identity = ca
                    .server_identity(trust.dir(), &config.names, SystemTime::now())
                    .map_err(|e| e.to_string())?;
                if identity.renewed {
                    tracing::info!(pin = %ca.pin(), "issued the node listener's server certificate under the edge CA");
                }
                // Client certificates from the CA this one replaced stay valid while
                // `previous-ca.pem` is there (a CA rotation, docs/trust.md).
                let mut client_roots = vec![ca.cert().clone()];
                let previous = trust.dir().join(PREVIOUS_CA);
                if previous.exists() {
                    let certs = load_pem_certs(&previous)?;
                    tracing::info!(file = %previous.display(), count = certs.len(), "also accepting node credentials from the previous CA");
                    client_roots.extend(certs);
                }
                let acceptor = acceptor(identity.chain, identity.key, Some(client_roots.clone()))?;
                Ok(Some(NodeListenerTls {
                    acceptor: RwLock::new(acceptor),
                    pin: Some(ca.pin()),
                    client_certs: true,
                    renewal: Some(Renewal {
                        trust: trust.clone(),
                        names: config.names.clone(),
                        client_roots,
                    }),
                }))
            }
            NodeTlsMode::Provided => {
                let (cert, key) = (
                    config.cert.as_deref().ok_or("node_tls.cert is required")?,
                    config.key.as_deref().ok_or("node_tls.key is required")?,
                );
                let (chain, key) =
                    load_pem_identity(cert, key).map_err(|e| format!("node_tls: {e}"))?;
                // The pin names the top of the chain the edge presents (its CA).
                let pin = if chain.len() > 1 {
                    Some(
                        Pin::of_certificate(chain.last().expect("non-empty"))
                            .map_err(|e| format!("node_tls.cert: {e}"))?,
                    )
                } else {
                    None
                };
                let client_roots = match &config.client_ca {
                    Some(path) => {
                        Some(load_pem_certs(path).map_err(|e| format!("node_tls.client_ca: {e}"))?)
                    }
                    None => None,
                };
                let client_certs = client_roots.is_some();
                Ok(Some(NodeListenerTls {
                    acceptor: RwLock::new(acceptor(chain, key, client_roots)?),
                    pin,
                    client_certs,
                    renewal: None,
                }))
            }
        }
    }

    /// Auto mode: issues a new server certificate under the same CA when the current one
    /// is within its renewal window at `now` (or missing); returns whether it did.
    pub fn renew_if_due(&self, now: SystemTime) -> Result<bool, String> {
        let Some(renewal) = &self.renewal else {
            return Ok(false);
        };
        let ca = renewal.trust.ca().ok_or("no edge CA")?;
        let identity = ca
            .server_identity(renewal.trust.dir(), &renewal.names, now)
            .map_err(|e| e.to_string())?;
        if !identity.renewed {
            return Ok(false);
        }
        let fresh = acceptor(
            identity.chain,
            identity.key,
            Some(renewal.client_roots.clone()),
        )?;
        *self.acceptor.write() = fresh;
        tracing::info!(pin = %ca.pin(), "renewed the node listener's server certificate under the same CA");
        Ok(true)
    }

    /// The pin nodes verify this listener by, when it has one.
    pub fn pin(&self) -> Option<Pin> {
        self.pin
    }

    /// Runs the TLS handshake on an accepted socket; it must finish `within`.
    pub async fn accept(
        &self,
        tcp: TcpStream,
        within: Duration,
    ) -> Result<(TlsStream<TcpStream>, Link), HandshakeError> {
        let acceptor = self.acceptor.read().clone();
        let tls = tokio::time::timeout(within, acceptor.accept(tcp))
            .await
            .map_err(|_| HandshakeError::Timeout(within))?
            .map_err(|e| {
                let refused_certificate = e
                    .get_ref()
                    .and_then(|inner| inner.downcast_ref::<rustls::Error>())
                    .is_some_and(|e| {
                        matches!(
                            e,
                            rustls::Error::InvalidCertificate(_)
                                | rustls::Error::NoCertificatesPresented
                        )
                    });
                if refused_certificate {
                    return HandshakeError::ClientCertificate(e.to_string());
                }
                let hint = if e.to_string().contains("corrupt message") {
                    " (a plaintext client? nodes speak TLS to this listener unless node_tls.mode is insecure_plaintext)"
                } else {
                    ""
                };
                HandshakeError::Failed(format!("{e}{hint}"))
            })?;
        let client = match tls.get_ref().1.peer_certificates().and_then(|c| c.first()) {
            Some(der) if self.client_certs => {
                Some(ClientCert::parse(der).map_err(HandshakeError::ClientCertificate)?)
            }
            _ => None,
        };
        Ok((tls, Link::Tls { client }))
    }
}

/// Why a TLS handshake on the node listener did not complete.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("TLS handshake not finished within {}s (limits.nodes.tls_handshake_timeout_sec)", .0.as_secs_f64())]
    Timeout(Duration),
    /// The peer presented a client certificate the listener does not trust: a failed
    /// credential, throttled like a bad token.
    #[error("TLS handshake failed: client certificate refused: {0}")]
    ClientCertificate(String),
    #[error("TLS handshake failed: {0}")]
    Failed(String),
}

fn acceptor(
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    client_roots: Option<Vec<CertificateDer<'static>>>,
) -> Result<TlsAcceptor, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| format!("TLS setup: {e}"))?;
    let builder = match client_roots {
        Some(roots) => {
            let mut store = RootCertStore::empty();
            for cert in roots {
                store
                    .add(cert)
                    .map_err(|e| format!("client CA certificate: {e}"))?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(store), provider)
                .allow_unauthenticated()
                .build()
                .map_err(|e| format!("client certificate verifier: {e}"))?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let config = builder
        .with_single_cert(chain, key)
        .map_err(|e| format!("the node listener's certificate and key do not fit: {e}"))?;
    Ok(TlsAcceptor::from(Arc::new(config)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_running_listener_renews_its_server_certificate_under_the_same_ca() {
        let dir = tempfile::tempdir().unwrap();
        let trust = Arc::new(TrustStore::open(dir.path(), true).unwrap());
        let tls = NodeListenerTls::build(&NodeTlsConfig::default(), &trust)
            .unwrap()
            .unwrap();
        let pin = tls.pin();
        let now = SystemTime::now();
        assert!(!tls.renew_if_due(now).unwrap(), "fresh: nothing to do");
        let before = std::fs::read(dir.path().join(super::super::ca::SERVER_CERT)).unwrap();
        let near_end = now + Duration::from_secs(380 * 86_400);
        assert!(tls.renew_if_due(near_end).unwrap());
        let after = std::fs::read(dir.path().join(super::super::ca::SERVER_CERT)).unwrap();
        assert_ne!(before, after);
        assert_eq!(tls.pin(), pin, "same CA, same pin");
    }
}
