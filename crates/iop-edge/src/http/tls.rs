//! Optional TLS for the HTTP listener (`http_tls`): the certificate and key files are read
//! at start and again on every SIGHUP ([`HttpTls::reload`]); new connections get the new
//! certificate, open ones keep theirs. A file that does not load on reload is reported and
//! the running certificate stays.
//!
//! The handshake runs inside each connection's own task (the [`TlsListener`] hands out a
//! stream that completes it on first use), so a slow or silent client never holds up the
//! accept loop, and it is bounded by [`HANDSHAKE_TIMEOUT`].

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use parking_lot::RwLock;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Sleep;
use tokio_rustls::server::TlsStream;
use tokio_rustls::{Accept, TlsAcceptor};

use crate::config::HttpTlsConfig;
use crate::trust::load_pem_identity;

/// A client must finish the TLS handshake within this time.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

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

    fn current(&self) -> TlsAcceptor {
        self.acceptor.read().clone()
    }
}

/// A TCP listener whose connections speak TLS.
pub struct TlsListener {
    tcp: TcpListener,
    tls: Arc<HttpTls>,
}

impl TlsListener {
    pub fn new(tcp: TcpListener, tls: Arc<HttpTls>) -> Self {
        Self { tcp, tls }
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = LazyTlsStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            match self.tcp.accept().await {
                Ok((tcp, addr)) => {
                    let _ = tcp.set_nodelay(true);
                    let stream = LazyTlsStream {
                        state: State::Handshake {
                            accept: Box::pin(self.tls.current().accept(tcp)),
                            deadline: Box::pin(tokio::time::sleep(HANDSHAKE_TIMEOUT)),
                        },
                    };
                    return (stream, addr);
                }
                Err(err) => {
                    tracing::warn!(%err, "accepting an HTTP connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.tcp.local_addr()
    }
}

enum State {
    Handshake {
        accept: Pin<Box<Accept<TcpStream>>>,
        deadline: Pin<Box<Sleep>>,
    },
    Ready(Box<TlsStream<TcpStream>>),
    Failed,
}

/// A TLS server stream whose handshake runs on first use.
pub struct LazyTlsStream {
    state: State,
}

impl LazyTlsStream {
    fn poll_handshake(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<&mut TlsStream<TcpStream>>> {
        if let State::Handshake { accept, deadline } = &mut self.state {
            if deadline.as_mut().poll(cx).is_ready() {
                self.state = State::Failed;
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "TLS handshake timed out",
                )));
            }
            match accept.as_mut().poll(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(stream)) => self.state = State::Ready(Box::new(stream)),
                Poll::Ready(Err(err)) => {
                    tracing::debug!(%err, "HTTP TLS handshake failed");
                    self.state = State::Failed;
                    return Poll::Ready(Err(err));
                }
            }
        }
        match &mut self.state {
            State::Ready(stream) => Poll::Ready(Ok(stream)),
            _ => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::NotConnected,
                "TLS handshake failed",
            ))),
        }
    }
}

impl AsyncRead for LazyTlsStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut().poll_handshake(cx) {
            Poll::Ready(Ok(stream)) => Pin::new(stream).poll_read(cx, buf),
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl AsyncWrite for LazyTlsStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut().poll_handshake(cx) {
            Poll::Ready(Ok(stream)) => Pin::new(stream).poll_write(cx, buf),
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => Poll::Pending,
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut().poll_handshake(cx) {
            Poll::Ready(Ok(stream)) => Pin::new(stream).poll_flush(cx),
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => Poll::Pending,
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        match &mut this.state {
            State::Ready(stream) => Pin::new(stream).poll_shutdown(cx),
            _ => Poll::Ready(Ok(())),
        }
    }
}
