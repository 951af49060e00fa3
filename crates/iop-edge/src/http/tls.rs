//! Optional TLS for the HTTP listener (`http_tls`): the certificate and key files are read
//! at start and again on every SIGHUP ([`HttpTls::reload`]); new connections get the new
//! certificate, open ones keep theirs. A file that does not load on reload is reported and
//! the running certificate stays.
//!
//! The handshake itself ([`HttpTls::accept`]) runs inside each connection's own task in
//! [`super::server`], after the connection took its place under
//! `limits.http.max_connections` and bounded by `limits.http.header_timeout_sec`, so a
//! slow or silent client never holds up the accept loop nor escapes the caps.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::RwLock;
use tokio::net::TcpStream;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

use crate::config::HttpTlsConfig;
use crate::trust::load_pem_identity;

/// The HTTP listener's current TLS certificate.
pub struct HttpTls {
    acceptor: RwLock<TlsAcceptor>,
}

impl std::fmt::Debug for HttpTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpTls").finish_non_exhaustive()
    }
}

fn acceptor(config: &HttpTlsConfig) -> Result<TlsAcceptor, String> {
    let (chain, key) =
        load_pem_identity(&config.cert, &config.key).map_err(|e| format!("http_tls: {e}"))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut server = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("http_tls: {e}"))?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| format!("http_tls: the certificate and key do not fit: {e}"))?;
    server.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(server)))
}

impl HttpTls {
    pub fn load(config: &HttpTlsConfig) -> Result<Self, String> {
        Ok(Self {
            acceptor: RwLock::new(acceptor(config)?),
        })
    }

    /// Re-reads the certificate and key; on failure the running ones stay.
    pub fn reload(&self, config: &HttpTlsConfig) -> Result<(), String> {
        *self.acceptor.write() = acceptor(config)?;
        Ok(())
    }

    /// Runs the TLS handshake on an accepted socket with the current certificate; it must
    /// finish `within`.
    pub async fn accept(
        &self,
        tcp: TcpStream,
        within: Duration,
    ) -> io::Result<TlsStream<TcpStream>> {
        let accept = self.acceptor.read().clone().accept(tcp);
        tokio::time::timeout(within, accept).await.map_err(|_| {
            io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "TLS handshake not finished within {}s (limits.http.header_timeout_sec)",
                    within.as_secs_f64()
                ),
            )
        })?
    }
}
