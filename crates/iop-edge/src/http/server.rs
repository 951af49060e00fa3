//! The HTTP listener: an accept loop over hyper's HTTP/1.1 server, so that every
//! connection is bounded — at most `limits.http.max_connections` open (a full table
//! closes a connection that sent no request head, or one of the prefix holding the most,
//! to make room, else refuses: [`super::connection_table`]), at most
//! `max_connections_per_address` from one address ([`super::client_addr`]; more are
//! answered 503 and closed at once), and each one under the deadlines of
//! [`super::deadlines`]. Every request carries its [`ClientAddr`].
//!
//! A connection is served by [`serve_connection`], generic over its byte stream: with
//! `http_tls` the connection's own task first runs the TLS handshake ([`super::tls`]),
//! holding its place under the cap and bounded by the header timeout, then hands the TLS
//! stream to hyper. Shutdown stops the accepts,
//! lets each connection finish the response it is writing (hyper's graceful shutdown), and
//! the caller's grace period bounds the wait.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::ConnectInfo;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::client_addr::{AddressSlot, ClientAddr, ConnectionsPerAddress, TrustedProxies};
use super::connection_table::{ConnectionTable, Entered, TableSlot};
use super::deadlines::{Activity, DeadlineIo, Expired, Holding, TimedBody};
use super::front::App;
use super::tls::HttpTls;
use crate::config::HttpLimitsConfig;
use crate::service::Edge;

/// Connections the kernel may queue before the accept loop takes them (capped by the
/// system's `somaxconn`): a burst of connections must not overflow the queue, whose
/// victims see their handshake hang or their connection reset.
const LISTEN_BACKLOG: u32 = 4096;

/// Largest request head (request line and headers) read; a longer one gets 431. It also
/// bounds hyper's read and write buffers, so one connection holds at most about this much
/// memory in them.
pub const MAX_HEAD_BYTES: usize = 64 * 1024;

/// How often a full connection table or failing accepts are logged at most.
const LOG_EVERY: Duration = Duration::from_secs(10);

/// The open files kept free of HTTP connections, for node links, the store's pool, the
/// ledger, logs and listeners: an eighth of the open-files limit, at least 256 and at most
/// 4096.
pub fn open_files_headroom(limit: u64) -> u64 {
    (limit / 8).clamp(256, 4096)
}

/// The connection cap in force. Not configured: the open-files limit (which the edge
/// raised to its hard limit at start) less [`open_files_headroom`] — 17,500 connections
/// under a limit of 20,000, 61,440 under 65,536 — or
/// [`crate::config::DEFAULT_MAX_CONNECTIONS`] when the limit is unknown.
/// Configured: that, but never more than the same bound.
pub fn effective_max_connections(configured: Option<usize>, open_files: Option<u64>) -> usize {
    let fits = open_files.map(|limit| {
        let n = limit
            .saturating_sub(open_files_headroom(limit))
            .min(1 << 20);
        usize::try_from(n).unwrap_or(usize::MAX)
    });
    let cap = match (configured, fits) {
        (Some(c), Some(fits)) => c.min(fits),
        (Some(c), None) => c,
        (None, Some(fits)) => fits,
        (None, None) => crate::config::DEFAULT_MAX_CONNECTIONS,
    };
    cap.max(1)
}

/// Binds the HTTP listener (address reuse on, a deep accept queue).
pub fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = match addr {
        SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
        SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// Serves HTTP on `listener` until the edge shuts down (HTTPS with `tls`); returns once
/// every connection has closed.
pub async fn serve_http(
    edge: Arc<Edge>,
    listener: TcpListener,
    tls: Option<Arc<HttpTls>>,
) -> std::io::Result<()> {
    let limits = edge.config().limits.http.clone();
    let open_files = crate::fdlimit::open_files_limit();
    let cap = effective_max_connections(limits.max_connections, open_files);
    match limits.max_connections {
        Some(configured) if cap < configured => tracing::warn!(
            max_connections = configured,
            open_files = open_files.unwrap_or_default(),
            cap,
            "limits.http.max_connections is more than the open-files limit allows: serving at most {cap} HTTP connections"
        ),
        Some(_) => {}
        None => tracing::info!(
            open_files = open_files.unwrap_or_default(),
            max_connections = cap,
            "HTTP connection cap derived from the open-files limit (limits.http.max_connections)"
        ),
    }
    let trusted = TrustedProxies::parse(&limits.trusted_proxies)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    let mut gate = ConnectionGate {
        table: ConnectionTable::new(
            cap,
            limits.share_prefix_v4,
            limits.share_prefix_v6,
            trusted.clone(),
        ),
        cap,
        header_timeout: limits.header_timeout(),
        idle_timeout: limits.idle_timeout(),
        per_address: ConnectionsPerAddress::new(
            limits.max_connections_per_address,
            trusted.clone(),
        ),
        max_per_address: limits.max_connections_per_address,
        trusted,
        tls: tls.is_some(),
        refused: RateLimitedLog::default(),
        refused_per_address: RateLimitedLog::default(),
        evicted: RateLimitedLog::default(),
    };
    let app = App::new(edge.clone());
    let shutdown = edge.shutdown_token().clone();
    let mut connections = JoinSet::new();
    let mut accept_errors = RateLimitedLog::default();
    loop {
        let accepted = tokio::select! {
            _ = shutdown.cancelled() => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
            accepted = listener.accept() => accepted,
        };
        let (tcp, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(err) if is_per_connection(&err) => continue,
            Err(err) => {
                // Out of file descriptors, most likely: wait for some to close.
                if let Some(n) = accepted_log(&mut accept_errors) {
                    tracing::warn!(%err, errors = n, "HTTP accept failing; retrying");
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Some(source) = gate.admit(&tcp, peer) else {
            drop(tcp);
            continue;
        };
        let _ = tcp.set_nodelay(true);
        let (app, limits, shutdown) = (app.clone(), limits.clone(), shutdown.clone());
        match tls.clone() {
            None => {
                connections.spawn(serve_connection(tcp, source, app, limits, shutdown));
            }
            Some(tls) => {
                connections.spawn(async move {
                    let handshake = tls.accept(tcp, limits.header_timeout());
                    let stream = tokio::select! {
                        _ = shutdown.cancelled() => return,
                        // A full table gave its place to a newcomer.
                        _ = source.evict.cancelled() => return,
                        stream = handshake => stream,
                    };
                    match stream {
                        Ok(stream) => serve_connection(stream, source, app, limits, shutdown).await,
                        Err(err) => tracing::debug!(%peer, %err, "HTTP TLS handshake failed"),
                    }
                });
            }
        }
    }
    drop(listener);
    while connections.join_next().await.is_some() {}
    Ok(())
}

/// Serves one connection over `io` (a TCP socket, or a TLS stream around one) until the
/// client closes it, a deadline passes, or shutdown lets its last response finish.
pub async fn serve_connection<S>(
    io: S,
    source: Source,
    app: App,
    limits: HttpLimitsConfig,
    shutdown: CancellationToken,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let peer = source.peer;
    let trusted = source.trusted.clone();
    let activity = source.activity.clone();
    let evicted = source.evict.clone();
    let io = DeadlineIo::new(io, activity.clone(), limits.write_timeout(), peer);
    let body_timeout = limits.body_timeout();
    let requests = activity.clone();
    let service = hyper::service::service_fn(move |mut request: http::Request<Incoming>| {
        let busy = requests.request_started();
        request.extensions_mut().insert(ConnectInfo(peer));
        let client = ClientAddr(trusted.client_of(peer.ip(), request.headers()));
        request.extensions_mut().insert(client);
        let request = request.map(|body| axum::body::Body::new(TimedBody::new(body, body_timeout)));
        let app = app.clone();
        async move {
            let response = app.serve(request).await;
            Ok::<_, Infallible>(response.map(|body| Holding::new(body, busy)))
        }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    // A backstop only: `Activity` closes slow heads and idle connections first.
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout() + limits.idle_timeout())
        .max_header_size(MAX_HEAD_BYTES)
        .max_buf_size(MAX_HEAD_BYTES);
    let connection = builder.serve_connection(TokioIo::new(io), service);
    tokio::pin!(connection);
    let mut draining = false;
    loop {
        tokio::select! {
            result = connection.as_mut() => {
                if let Err(err) = result {
                    tracing::debug!(%peer, %err, "HTTP connection ended with an error");
                }
                return;
            }
            _ = shutdown.cancelled(), if !draining => {
                draining = true;
                connection.as_mut().graceful_shutdown();
            }
            _ = evicted.cancelled() => {
                tracing::debug!(%peer, "HTTP connection closed to make room in a full connection table");
                return;
            }
            why = activity.expired() => {
                match why {
                    Expired::Header => tracing::debug!(
                        %peer,
                        "HTTP request head not complete within {}s (limits.http.header_timeout_sec): closing",
                        limits.header_timeout_sec
                    ),
                    Expired::Idle => tracing::debug!(%peer, "idle HTTP connection closed"),
                }
                return;
            }
        }
    }
}

/// The caps a new connection passes: the whole table (which makes room when it can), then
/// its address's share.
struct ConnectionGate {
    table: Arc<ConnectionTable>,
    cap: usize,
    header_timeout: Duration,
    idle_timeout: Duration,
    per_address: Arc<ConnectionsPerAddress>,
    max_per_address: usize,
    trusted: TrustedProxies,
    /// Whether connections speak TLS (a TLS client could not read a plaintext 503).
    tls: bool,
    refused: RateLimitedLog,
    refused_per_address: RateLimitedLog,
    evicted: RateLimitedLog,
}

impl ConnectionGate {
    /// The new connection's places under the caps, or `None` when it was refused (a 503
    /// written to it, the refusal counted and now and then logged). Its address's cap
    /// first, so that nobody's place is taken for a newcomer refused after all.
    fn admit(&mut self, tcp: &TcpStream, peer: SocketAddr) -> Option<Source> {
        let Some(address_slot) = self.per_address.open(peer.ip()) else {
            if !self.tls {
                refuse_address(tcp);
            }
            if let Some(n) = accepted_log(&mut self.refused_per_address) {
                tracing::warn!(
                    %peer,
                    refused = n,
                    max = self.max_per_address,
                    "HTTP connections from one address over limits.http.max_connections_per_address: refusing its new connections"
                );
            }
            return None;
        };
        let activity = Activity::new(self.header_timeout, self.idle_timeout);
        let evict = CancellationToken::new();
        let admitted = self.table.admit(
            peer.ip(),
            activity.clone(),
            evict.clone(),
            std::time::Instant::now(),
        );
        let Some((slot, entered)) = admitted else {
            if !self.tls {
                refuse(tcp);
            }
            if let Some(n) = accepted_log(&mut self.refused) {
                tracing::warn!(
                    refused = n,
                    open = self.cap,
                    "HTTP connection cap reached (limits.http.max_connections): refusing new connections"
                );
            }
            return None;
        };
        if entered != Entered::Room
            && let Some(n) = accepted_log(&mut self.evicted)
        {
            tracing::warn!(
                evicted = n,
                open = self.cap,
                "HTTP connection table full (limits.http.max_connections): closing connections that sent no request head, or of the prefixes holding the most, to make room"
            );
        }
        Some(Source {
            peer,
            trusted: self.trusted.clone(),
            activity,
            evict,
            _slots: (slot, address_slot),
        })
    }
}

/// Where a connection comes from, and its places under the connection caps (held until
/// it closes).
pub struct Source {
    pub peer: SocketAddr,
    pub trusted: TrustedProxies,
    /// The connection's phase, which the table reads to choose whom to close.
    activity: Arc<Activity>,
    /// Cancelled when a full table gives the connection's place to a newcomer.
    evict: CancellationToken,
    _slots: (TableSlot, AddressSlot),
}

/// Answers a connection over its address's cap without waiting on it: one non-blocking
/// write of a 503, then the socket is closed.
fn refuse_address(tcp: &TcpStream) {
    const BODY: &str = r#"{"error":{"message":"this address has as many connections open as the edge allows one address (limits.http.max_connections_per_address); close some or retry shortly","type":"server_error","param":null,"code":"too_many_connections"}}"#;
    let response = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{BODY}",
        BODY.len()
    );
    let _ = tcp.try_write(response.as_bytes());
}

/// Answers a connection over the cap without waiting on it: one non-blocking write of a
/// 503, then the socket is closed.
fn refuse(tcp: &TcpStream) {
    const BODY: &str = r#"{"error":{"message":"this edge has as many connections open as it serves (limits.http.max_connections); retry shortly","type":"server_error","param":null,"code":"too_many_connections"}}"#;
    let response = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{BODY}",
        BODY.len()
    );
    let _ = tcp.try_write(response.as_bytes());
}

/// Accept errors that concern one connection only (it was reset before we took it).
fn is_per_connection(err: &std::io::Error) -> bool {
    matches!(
        err.kind(),
        std::io::ErrorKind::ConnectionRefused
            | std::io::ErrorKind::ConnectionAborted
            | std::io::ErrorKind::ConnectionReset
    )
}

/// Counts occurrences and says when to log them (at most once per [`LOG_EVERY`]).
#[derive(Debug, Default)]
struct RateLimitedLog {
    count: u64,
    last: Option<Instant>,
}

/// Counts one occurrence; `Some(count since the last line)` when a line is due.
fn accepted_log(log: &mut RateLimitedLog) -> Option<u64> {
    log.count += 1;
    let now = Instant::now();
    if log
        .last
        .is_some_and(|last| now.duration_since(last) < LOG_EVERY)
    {
        return None;
    }
    log.last = Some(now);
    Some(std::mem::take(&mut log.count))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_is_the_open_files_limit_less_headroom_unless_configured_lower() {
        // Not configured: what the limit allows.
        assert_eq!(effective_max_connections(None, Some(1024)), 768);
        assert_eq!(effective_max_connections(None, Some(20_000)), 17_500);
        assert_eq!(effective_max_connections(None, Some(65_536)), 61_440);
        assert_eq!(effective_max_connections(None, Some(1 << 24)), 1 << 20);
        assert_eq!(effective_max_connections(None, None), 4096);
        // Configured: that, within the same bound.
        assert_eq!(effective_max_connections(Some(4096), Some(1024)), 768);
        assert_eq!(effective_max_connections(Some(4096), Some(1 << 20)), 4096);
        assert_eq!(effective_max_connections(Some(100), None), 100);
        assert_eq!(effective_max_connections(Some(100), Some(0)), 1);
    }

    #[test]
    fn repeated_events_are_logged_once_per_period_with_their_count() {
        let mut log = RateLimitedLog::default();
        assert_eq!(accepted_log(&mut log), Some(1));
        for _ in 0..99 {
            assert_eq!(accepted_log(&mut log), None);
        }
        log.last = Some(Instant::now() - LOG_EVERY);
        assert_eq!(accepted_log(&mut log), Some(100));
    }
}
