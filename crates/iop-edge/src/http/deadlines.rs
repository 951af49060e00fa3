//! The time limits of one HTTP connection, as wrappers around what hyper drives:
//!
//! - [`Activity`] knows whether the connection is idle, receiving a request head, or busy
//!   with a request, and [`Activity::expired`] resolves when an idle connection outstayed
//!   `idle_timeout` or a head took longer than `header_timeout` (from its first byte, or
//!   from the accept for a new connection);
//! - [`DeadlineIo`] wraps the socket: it marks the first byte of each head, and fails a
//!   write that could make no progress for `write_timeout` (a client that stopped reading);
//! - [`TimedBody`] fails a request body that is not complete `body_timeout` after its head
//!   (a chunked body that never ends, a dribbling upload);
//! - [`Holding`] keeps a guard until its response is fully written (the connection busy,
//!   a client request in progress).
//!
//! None of these allocate per read or write; the timers are armed only when needed.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::Notify;
use tokio::time::{Instant, Sleep, sleep_until};

const IDLE: u8 = 0;
const HEAD: u8 = 1;
const BUSY: u8 = 2;

/// Why a connection was closed by [`Activity::expired`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expired {
    /// No request came within `idle_timeout` of the previous response.
    Idle,
    /// A request head was not complete within `header_timeout`.
    Header,
}

#[derive(Debug)]
struct State {
    /// Requests being handled or responded to (at most one on HTTP/1.1).
    busy: usize,
    /// When the current idle or head phase began.
    since: Instant,
}

/// The phase of one connection, shared by its socket wrapper, its requests and its
/// watchdog.
#[derive(Debug)]
pub struct Activity {
    phase: AtomicU8,
    /// Whether a request head was ever complete on the connection.
    served: std::sync::atomic::AtomicBool,
    state: Mutex<State>,
    changed: Notify,
    header_timeout: Duration,
    idle_timeout: Duration,
}

impl Activity {
    /// A just-accepted connection: its first head is due within `header_timeout`.
    pub fn new(header_timeout: Duration, idle_timeout: Duration) -> Arc<Self> {
        Arc::new(Self {
            phase: AtomicU8::new(HEAD),
            served: std::sync::atomic::AtomicBool::new(false),
            state: Mutex::new(State {
                busy: 0,
                since: Instant::now(),
            }),
            changed: Notify::new(),
            header_timeout,
            idle_timeout,
        })
    }

    /// Bytes arrived: on an idle connection they begin a request head.
    fn bytes_read(&self) {
        if self.phase.load(Ordering::Relaxed) != IDLE {
            return;
        }
        let mut state = self.state.lock();
        if state.busy == 0 && self.phase.load(Ordering::Relaxed) == IDLE {
            state.since = Instant::now();
            self.phase.store(HEAD, Ordering::Relaxed);
            self.changed.notify_one();
        }
    }

    /// A request head was parsed; the connection is busy until the guard drops.
    pub fn request_started(self: &Arc<Self>) -> BusyGuard {
        let mut state = self.state.lock();
        state.busy += 1;
        self.served.store(true, Ordering::Relaxed);
        self.phase.store(BUSY, Ordering::Relaxed);
        BusyGuard {
            activity: self.clone(),
        }
    }

    fn request_finished(&self) {
        let mut state = self.state.lock();
        state.busy -= 1;
        if state.busy == 0 {
            state.since = Instant::now();
            self.phase.store(IDLE, Ordering::Relaxed);
            self.changed.notify_one();
        }
    }

    /// Whether a request is being handled or answered.
    pub fn is_busy(&self) -> bool {
        self.phase.load(Ordering::Relaxed) == BUSY
    }

    /// Whether a request head was ever complete on the connection.
    pub fn has_served(&self) -> bool {
        self.served.load(Ordering::Relaxed)
    }

    fn deadline(&self) -> Option<(Instant, Expired)> {
        let state = self.state.lock();
        match self.phase.load(Ordering::Relaxed) {
            IDLE => Some((state.since + self.idle_timeout, Expired::Idle)),
            HEAD => Some((state.since + self.header_timeout, Expired::Header)),
            _ => None,
        }
    }

    /// Resolves when the connection outstays its idle or head deadline. A connection busy
    /// with a request never expires here (its body and writes have their own deadlines).
    pub async fn expired(&self) -> Expired {
        loop {
            match self.deadline() {
                Some((at, why)) if at <= Instant::now() => return why,
                Some((at, _)) => {
                    tokio::select! {
                        _ = sleep_until(at) => {}
                        _ = self.changed.notified() => {}
                    }
                }
                None => self.changed.notified().await,
            }
        }
    }
}

/// Holds the connection busy; dropped when the response is written (or abandoned).
#[derive(Debug)]
pub struct BusyGuard {
    activity: Arc<Activity>,
}

impl Drop for BusyGuard {
    fn drop(&mut self) {
        self.activity.request_finished();
    }
}

/// The connection's socket (or TLS stream) with its read activity tracked and a deadline
/// on writes that make no progress.
#[derive(Debug)]
pub struct DeadlineIo<S> {
    inner: S,
    activity: Arc<Activity>,
    write_timeout: Duration,
    peer: SocketAddr,
    /// Armed while writes are blocked; reset by any progress.
    stall: Option<Pin<Box<Sleep>>>,
    stalled: bool,
}

impl<S> DeadlineIo<S> {
    pub fn new(
        inner: S,
        activity: Arc<Activity>,
        write_timeout: Duration,
        peer: SocketAddr,
    ) -> Self {
        Self {
            inner,
            activity,
            write_timeout,
            peer,
            stall: None,
            stalled: false,
        }
    }

    fn progress<T>(
        &mut self,
        result: Poll<io::Result<T>>,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<T>> {
        match result {
            Poll::Ready(r) => {
                self.stalled = false;
                Poll::Ready(r)
            }
            Poll::Pending => {
                if !self.stalled {
                    self.stalled = true;
                    let deadline = Instant::now() + self.write_timeout;
                    match &mut self.stall {
                        Some(sleep) => sleep.as_mut().reset(deadline),
                        None => self.stall = Some(Box::pin(sleep_until(deadline))),
                    }
                }
                let sleep = self.stall.as_mut().expect("armed above");
                ready!(sleep.as_mut().poll(cx));
                tracing::info!(
                    peer = %self.peer,
                    "HTTP client accepted no response bytes for {}s (limits.http.write_timeout_sec): disconnecting it",
                    self.write_timeout.as_secs()
                );
                Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the client stopped reading the response",
                )))
            }
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for DeadlineIo<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        ready!(Pin::new(&mut this.inner).poll_read(cx, buf))?;
        if buf.filled().len() > before {
            this.activity.bytes_read();
        }
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for DeadlineIo<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let result = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.progress(result, cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let result = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.progress(result, cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let result = Pin::new(&mut this.inner).poll_flush(cx);
        this.progress(result, cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let result = Pin::new(&mut this.inner).poll_shutdown(cx);
        this.progress(result, cx)
    }
}

/// A request body that failed to arrive in time, or failed to read.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error(transparent)]
    Read(#[from] hyper::Error),
    #[error(
        "the request body was not complete within {}s (limits.http.body_timeout_sec)",
        .0.as_secs()
    )]
    Timeout(Duration),
}

impl From<std::convert::Infallible> for BodyError {
    fn from(never: std::convert::Infallible) -> Self {
        match never {}
    }
}

/// A request body with a deadline for its last byte.
#[derive(Debug)]
pub struct TimedBody<B> {
    inner: B,
    deadline: Instant,
    limit: Duration,
    /// Armed the first time the body has to wait.
    sleep: Option<Pin<Box<Sleep>>>,
    failed: bool,
}

impl<B> TimedBody<B> {
    pub fn new(inner: B, limit: Duration) -> Self {
        Self {
            inner,
            deadline: Instant::now() + limit,
            limit,
            sleep: None,
            failed: false,
        }
    }
}

impl<B> Body for TimedBody<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BodyError>,
{
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = self.get_mut();
        if this.failed {
            return Poll::Ready(None);
        }
        if let Poll::Ready(frame) = Pin::new(&mut this.inner).poll_frame(cx) {
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        let deadline = this.deadline;
        let sleep = this
            .sleep
            .get_or_insert_with(|| Box::pin(sleep_until(deadline)));
        ready!(sleep.as_mut().poll(cx));
        this.failed = true;
        Poll::Ready(Some(Err(BodyError::Timeout(this.limit))))
    }

    fn is_end_stream(&self) -> bool {
        self.failed || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A response body that holds `G` (a guard) until the body ends or is dropped.
pub struct Holding<B, G> {
    inner: B,
    _guard: G,
}

impl<B, G> Holding<B, G> {
    pub fn new(inner: B, guard: G) -> Self {
        Self {
            inner,
            _guard: guard,
        }
    }
}

impl<B: Body + Unpin, G: Unpin> Body for Holding<B, G> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const SEC: Duration = Duration::from_secs(1);

    #[tokio::test(start_paused = true)]
    async fn a_new_connection_must_send_its_head_within_the_header_timeout() {
        let activity = Activity::new(10 * SEC, 60 * SEC);
        let started = Instant::now();
        assert_eq!(activity.expired().await, Expired::Header);
        assert_eq!(started.elapsed(), 10 * SEC);
    }

    #[tokio::test(start_paused = true)]
    async fn a_busy_connection_never_expires_and_idles_after_its_response() {
        let activity = Activity::new(10 * SEC, 60 * SEC);
        let guard = activity.request_started();
        let watch = {
            let activity = activity.clone();
            tokio::spawn(async move {
                let why = activity.expired().await;
                (why, Instant::now())
            })
        };
        tokio::time::sleep(3600 * SEC).await;
        assert!(!watch.is_finished(), "a busy connection expired");
        let done = Instant::now();
        drop(guard);
        let (why, at) = watch.await.unwrap();
        assert_eq!(why, Expired::Idle);
        assert_eq!(at - done, 60 * SEC);
    }

    #[tokio::test(start_paused = true)]
    async fn the_first_byte_of_a_head_starts_the_header_deadline() {
        let activity = Activity::new(10 * SEC, 60 * SEC);
        drop(activity.request_started());
        tokio::time::sleep(55 * SEC).await;
        let head_began = Instant::now();
        activity.bytes_read();
        // Bytes that follow do not move the deadline (a dribbled head gains nothing).
        tokio::time::sleep(5 * SEC).await;
        activity.bytes_read();
        assert_eq!(activity.expired().await, Expired::Header);
        assert_eq!(head_began.elapsed(), 10 * SEC);
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_never_ends_fails_at_its_deadline() {
        let (mut tx, body) = http_body_util::channel::Channel::<Bytes>::new(4);
        let mut body = TimedBody::new(body, 30 * SEC);
        let started = Instant::now();
        let feeder = tokio::spawn(async move {
            loop {
                if tx.send_data(Bytes::from_static(b"x")).await.is_err() {
                    return;
                }
                tokio::time::sleep(SEC).await;
            }
        });
        let mut received = 0;
        let error = loop {
            match body.frame().await {
                Some(Ok(_)) => received += 1,
                Some(Err(e)) => break e,
                None => panic!("the body ended"),
            }
        };
        assert!(matches!(error, BodyError::Timeout(_)), "{error}");
        assert_eq!(started.elapsed(), 30 * SEC);
        assert!(received >= 29, "{received}");
        assert!(body.frame().await.is_none());
        feeder.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_complete_body_is_untouched() {
        let body = TimedBody::new(http_body_util::Full::new(Bytes::from_static(b"hello")), SEC);
        tokio::time::sleep(10 * SEC).await;
        let bytes = body.collect().await.unwrap().to_bytes();
        assert_eq!(&bytes[..], b"hello");
    }

    #[tokio::test(start_paused = true)]
    async fn a_write_that_makes_no_progress_fails_at_the_write_deadline() {
        let (client, server) = tokio::io::duplex(64);
        let activity = Activity::new(SEC, SEC);
        let peer: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let mut io = DeadlineIo::new(server, activity, 20 * SEC, peer);
        // The client reads slowly but steadily: every write makes progress eventually.
        let reader = tokio::spawn(async move {
            let mut client = client;
            let mut buf = [0u8; 64];
            for _ in 0..10 {
                tokio::time::sleep(5 * SEC).await;
                let _ = client.read(&mut buf).await;
            }
            client // then it stops reading, but stays connected
        });
        let started = Instant::now();
        let chunk = [7u8; 64];
        let error = loop {
            if let Err(e) = io.write_all(&chunk).await {
                break e;
            }
        };
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
        // Ten reads five seconds apart, then the 20 s deadline.
        let elapsed = started.elapsed();
        assert!(elapsed >= 65 * SEC && elapsed <= 75 * SEC, "{elapsed:?}");
        drop(reader);
    }
}
