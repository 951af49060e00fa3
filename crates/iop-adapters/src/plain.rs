//! Plain-HTTP/1.1 connections to one provider for the raw tunnel, each driven by the task
//! that uses it, and the idle ones kept for reuse.
//!
//! hyper's pooled client runs every connection on a task of its own, and its response
//! body hands over one chunk per round trip between that task and the reader: an event
//! stream of twenty events that arrived in one read costs twenty scheduler rounds. Here
//! the tunnel's own task polls the connection (hyper's `client::conn::http1`, so HTTP is
//! still hyper's) whenever it wants the next chunk, and everything already read is handed
//! over at once. The response and body channels are only ever fed by that same poll, so
//! they are polled with a no-op waker; the connection gets the task's waker, which the
//! socket wakes.
//!
//! A connection goes back to the pool only after its response ended cleanly and hyper
//! kept it alive; dropping a [`PlainBody`] early closes it, which is how the provider
//! learns that the client went away. An idle connection the provider closed is noticed
//! when it is taken out, and a request that such a connection refused before writing it
//! is sent again on a new one; so is one a reused connection took and then closed under
//! without a byte of answer (the provider's idle timeout crossing the request), once.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::Stream;
use http_body_util::Full;
use hyper::body::{Body, Incoming};
use hyper::client::conn::http1::{self, Connection, SendRequest};
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use tokio::net::TcpStream;

/// Idle connections kept per provider; more are closed when they finish.
const MAX_IDLE: usize = 64;
/// An idle connection older than this is closed instead of reused.
const IDLE_TIMEOUT: Duration = Duration::from_secs(90);
/// How long establishing a TCP connection may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

type Conn = Connection<TokioIo<TcpStream>, Full<Bytes>>;

/// Why an exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum PlainError {
    #[error("cannot connect to {authority}")]
    Connect {
        authority: String,
        source: std::io::Error,
    },
    #[error("connecting to {0} timed out after {secs}s", secs = CONNECT_TIMEOUT.as_secs())]
    ConnectTimeout(String),
    #[error(transparent)]
    Http(#[from] hyper::Error),
    #[error("the provider closed the connection")]
    Closed,
}

impl PlainError {
    /// Whether the provider could not be reached at all.
    #[cfg(test)]
    pub fn is_connect(&self) -> bool {
        matches!(
            self,
            PlainError::Connect { .. } | PlainError::ConnectTimeout(_)
        )
    }
}

struct Idle {
    sender: SendRequest<Full<Bytes>>,
    conn: Conn,
    since: Instant,
}

/// The idle connections to one provider (`host:port`).
pub struct PlainPool {
    authority: String,
    idle: Mutex<VecDeque<Idle>>,
}

impl std::fmt::Debug for PlainPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PlainPool")
            .field("authority", &self.authority)
            .field("idle", &self.idle.lock().len())
            .finish()
    }
}

impl PlainPool {
    pub fn new(authority: impl Into<String>) -> Arc<Self> {
        Arc::new(Self {
            authority: authority.into(),
            idle: Mutex::new(VecDeque::new()),
        })
    }

    /// Sends `request` (origin-form URI, `Host` set) and returns the response head with its
    /// body; the connection travels with the body.
    pub async fn send(
        self: &Arc<Self>,
        mut request: http::Request<Full<Bytes>>,
    ) -> Result<http::Response<PlainBody>, PlainError> {
        // Once a reused connection closed under a written request, the next try takes a
        // fresh one, and is the last.
        let mut fresh_only = false;
        loop {
            let idle = if fresh_only { None } else { self.take_idle() };
            let (reused, mut sender, conn) = match idle {
                Some(idle) => (true, idle.sender, idle.conn),
                None => {
                    let (sender, conn) = self.connect().await?;
                    (false, sender, conn)
                }
            };
            // A reused connection the provider closes as the request goes out (its idle
            // timeout and our request crossing) fails with nothing read back: that request
            // was never answered, so it is sent once more on a fresh connection.
            let spare = reused.then(|| copy_of(&request));
            let mut conn = Some(conn);
            let response = {
                // Unconstrained: the response callback is polled with a no-op waker, so it
                // must never wait on the task's budget (that wake-up would be lost).
                let mut sent = pin!(tokio::task::unconstrained(sender.try_send_request(request)));
                std::future::poll_fn(|cx| drive(&mut conn, cx, |noop| sent.as_mut().poll(noop)))
                    .await
            };
            match response {
                Ok(Ok(response)) => {
                    let (head, body) = response.into_parts();
                    let body = PlainBody {
                        body,
                        conn,
                        sender: Some(sender),
                        pool: self.clone(),
                    };
                    return Ok(http::Response::from_parts(head, body));
                }
                Ok(Err(mut refused)) => match (refused.take_message(), spare) {
                    // The connection closed before the request was written: a reused one
                    // the provider had let go of. Send it again on a fresh one.
                    (Some(unsent), _) if reused => request = unsent,
                    (_, Some(spare)) if closed_unanswered(refused.error()) => {
                        request = spare;
                        fresh_only = true;
                    }
                    _ => return Err(refused.into_error().into()),
                },
                Err(PlainError::Closed) if spare.is_some() => {
                    request = spare.expect("checked");
                    fresh_only = true;
                }
                Err(PlainError::Http(err)) if spare.is_some() && closed_unanswered(&err) => {
                    request = spare.expect("checked");
                    fresh_only = true;
                }
                Err(err) => return Err(err),
            }
        }
    }

    /// An idle connection that is still open and young enough, if there is one.
    fn take_idle(&self) -> Option<Idle> {
        let mut noop = Context::from_waker(Waker::noop());
        loop {
            let mut idle = self.idle.lock().pop_back()?;
            if idle.since.elapsed() > IDLE_TIMEOUT || idle.sender.is_closed() {
                continue;
            }
            // A closed socket or a stray response shows up as the connection finishing;
            // a live idle connection asks for its next request when polled.
            if idle.conn.poll_without_shutdown(&mut noop).is_pending() && idle.sender.is_ready() {
                return Some(idle);
            }
        }
    }

    async fn connect(&self) -> Result<(SendRequest<Full<Bytes>>, Conn), PlainError> {
        let stream = match tokio::time::timeout(
            CONNECT_TIMEOUT,
            TcpStream::connect(self.authority.as_str()),
        )
        .await
        {
            Ok(Ok(stream)) => stream,
            Ok(Err(source)) => {
                return Err(PlainError::Connect {
                    authority: self.authority.clone(),
                    source,
                });
            }
            Err(_) => return Err(PlainError::ConnectTimeout(self.authority.clone())),
        };
        if let Err(err) = stream.set_nodelay(true) {
            tracing::debug!(%err, "could not set TCP_NODELAY on a provider connection");
        }
        Ok(http1::Builder::new()
            .handshake(TokioIo::new(stream))
            .await?)
    }

    fn put_back(&self, sender: SendRequest<Full<Bytes>>, conn: Conn) {
        let mut idle = self.idle.lock();
        if idle.len() < MAX_IDLE {
            idle.push_back(Idle {
                sender,
                conn,
                since: Instant::now(),
            });
        }
    }
}

/// The connection closed before any byte of the response came back.
fn closed_unanswered(err: &hyper::Error) -> bool {
    err.is_incomplete_message() || err.is_canceled()
}

/// A copy of `request` to send again (its body is shared bytes).
fn copy_of(request: &http::Request<Full<Bytes>>) -> http::Request<Full<Bytes>> {
    let mut copy = http::Request::new(request.body().clone());
    *copy.method_mut() = request.method().clone();
    *copy.uri_mut() = request.uri().clone();
    *copy.version_mut() = request.version();
    *copy.headers_mut() = request.headers().clone();
    copy
}

/// Polls what the connection feeds (`fed`, with a no-op waker) and the connection itself
/// (with the task's waker) until `fed` is ready or the connection waits on its socket.
fn drive<T>(
    conn: &mut Option<Conn>,
    cx: &mut Context<'_>,
    mut fed: impl FnMut(&mut Context<'_>) -> Poll<T>,
) -> Poll<Result<T, PlainError>> {
    let mut noop = Context::from_waker(Waker::noop());
    if let Poll::Ready(value) = fed(&mut noop) {
        return Poll::Ready(Ok(value));
    }
    let Some(connection) = conn.as_mut() else {
        return Poll::Ready(Err(PlainError::Closed));
    };
    let finished = connection.poll_without_shutdown(cx);
    if finished.is_ready() {
        *conn = None;
    }
    match (fed(&mut noop), finished) {
        (Poll::Ready(value), _) => Poll::Ready(Ok(value)),
        (Poll::Pending, Poll::Pending) => Poll::Pending,
        (Poll::Pending, Poll::Ready(Ok(()))) => Poll::Ready(Err(PlainError::Closed)),
        (Poll::Pending, Poll::Ready(Err(err))) => Poll::Ready(Err(err.into())),
    }
}

/// A response body read by driving its connection; a clean end returns the connection
/// to the pool, dropping it early closes the connection.
pub struct PlainBody {
    body: Incoming,
    conn: Option<Conn>,
    sender: Option<SendRequest<Full<Bytes>>>,
    pool: Arc<PlainPool>,
}

impl std::fmt::Debug for PlainBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PlainBody")
            .field("connection_open", &self.conn.is_some())
            .finish()
    }
}

impl Stream for PlainBody {
    type Item = Result<Bytes, PlainError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        loop {
            let frame = match drive(&mut this.conn, cx, |noop| {
                Pin::new(&mut this.body).poll_frame(noop)
            }) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(err)) => return Poll::Ready(Some(Err(err))),
                Poll::Ready(Ok(frame)) => frame,
            };
            match frame {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => return Poll::Ready(Some(Ok(data))),
                    // Trailers are not relayed.
                    Err(_) => continue,
                },
                Some(Err(err)) => return Poll::Ready(Some(Err(err.into()))),
                None => {
                    this.release();
                    return Poll::Ready(None);
                }
            }
        }
    }
}

impl PlainBody {
    /// The body ended: a connection hyper kept alive goes back to the pool.
    fn release(&mut self) {
        if let (Some(sender), Some(conn)) = (self.sender.take(), self.conn.take())
            && !sender.is_closed()
        {
            self.pool.put_back(sender, conn);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use futures::StreamExt;
    use tokio::net::TcpListener;

    use super::*;

    use crate::closing_provider::{BODY, Closing, provider};

    fn request(addr: &str) -> http::Request<Full<Bytes>> {
        http::Request::post("/v1/chat/completions")
            .header(http::header::HOST, addr)
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap()
    }

    /// One whole exchange through the pool, bounded in time.
    async fn body_of(pool: &Arc<PlainPool>, addr: &str) -> String {
        let exchange = async {
            let response = pool.send(request(addr)).await.unwrap();
            assert_eq!(response.status(), 200);
            let mut body = response.into_body();
            let mut text = Vec::new();
            while let Some(chunk) = body.next().await {
                text.extend_from_slice(&chunk.unwrap());
            }
            String::from_utf8(text).unwrap()
        };
        tokio::time::timeout(Duration::from_secs(5), exchange)
            .await
            .expect("the exchange finishes")
    }

    #[tokio::test]
    async fn a_finished_response_leaves_its_connection_for_the_next_request() {
        let (addr, accepted) = provider(Closing::Never).await;
        let pool = PlainPool::new(addr.clone());
        for _ in 0..5 {
            assert_eq!(body_of(&pool, &addr).await, BODY);
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_connection_the_provider_let_go_of_is_replaced() {
        let (addr, accepted) = provider(Closing::Silently).await;
        let pool = PlainPool::new(addr.clone());
        for _ in 0..3 {
            assert_eq!(body_of(&pool, &addr).await, BODY);
            // Let the provider's close reach us before the next request.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn a_request_a_reused_connection_closed_under_unanswered_is_sent_once_more() {
        let (addr, accepted) = provider(Closing::UnderTheNextRequest).await;
        let pool = PlainPool::new(addr.clone());
        for _ in 0..4 {
            assert_eq!(body_of(&pool, &addr).await, BODY);
        }
        // Every request after the first goes out on the connection the last one left,
        // which the provider closes under it; it is sent again on a fresh connection and
        // answered there: four answers, four connections.
        assert_eq!(accepted.load(Ordering::SeqCst), 4);
    }

    #[tokio::test]
    async fn a_connection_closed_by_its_response_is_not_reused() {
        let (addr, accepted) = provider(Closing::Announced).await;
        let pool = PlainPool::new(addr.clone());
        for _ in 0..3 {
            assert_eq!(body_of(&pool, &addr).await, BODY);
            assert_eq!(pool.idle.lock().len(), 0);
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn a_body_dropped_early_closes_its_connection() {
        let (addr, accepted) = provider(Closing::Never).await;
        let pool = PlainPool::new(addr.clone());
        let response = pool.send(request(&addr)).await.unwrap();
        drop(response);
        assert_eq!(pool.idle.lock().len(), 0);
        assert_eq!(body_of(&pool, &addr).await, BODY);
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn an_unreachable_provider_is_a_connect_error() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        drop(listener);
        let err = PlainPool::new(addr.clone())
            .send(request(&addr))
            .await
            .unwrap_err();
        assert!(err.is_connect(), "{err}");
    }
}
