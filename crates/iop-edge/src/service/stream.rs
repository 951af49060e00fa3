//! What run and tunnel streams share: the deadlines a consumer waits under (the node's
//! acknowledgement of the dispatch, then the provider's idle timeout once the response
//! began), the request meter that counts one request's outcome, latency and time to
//! first token exactly once, and the limits a stream is opened with.
//!
//! Timers are touched only when a stream has nothing queued: a frame that is already
//! there is taken without a clock read or a timer, so a burst costs nothing extra. And the
//! idle timer is not moved per frame: it stays armed at an earlier deadline, and when it
//! fires before the current one it is re-armed once — one timer update per idle period,
//! not one per token.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use iop_proto::ErrorCode;
use tokio::time::{Instant, Sleep};

use super::Edge;
use crate::ledger::RequestRecorder;
use crate::metrics::GroupMetrics;
use crate::session::StreamReceiver;

/// The bounds of one stream.
#[derive(Debug, Clone, Copy)]
pub struct StreamLimits {
    /// The node must acknowledge the dispatch (any frame) within this.
    pub ack_timeout: Duration,
    /// Once the response began, the provider may stay silent this long at most.
    pub idle_timeout: Duration,
}

impl Default for StreamLimits {
    fn default() -> Self {
        Self {
            ack_timeout: crate::config::DispatchConfig::default().ack_timeout(),
            idle_timeout: Duration::from_secs(
                crate::config::dispatch::DEFAULT_IDLE_TIMEOUT_SEC.into(),
            ),
        }
    }
}

/// Which deadline passed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expired {
    /// The node never acknowledged the dispatch.
    Ack,
    /// The provider went silent after its response began.
    Idle,
}

impl Expired {
    pub fn code(self) -> ErrorCode {
        match self {
            Expired::Ack => ErrorCode::NodeTimeout,
            Expired::Idle => ErrorCode::ProviderIdleTimeout,
        }
    }
}

/// What a consumer waits under.
#[derive(Debug)]
pub struct Deadlines {
    limits: StreamLimits,
    /// Set until the node acknowledged.
    ack_by: Option<Instant>,
    /// Whether the response began (the idle timeout applies).
    began: bool,
    /// The timer and the deadline it is armed for.
    sleep: Option<(Pin<Box<Sleep>>, Instant)>,
}

impl Deadlines {
    /// Deadlines of a stream whose request was just sent.
    pub fn new(limits: StreamLimits) -> Self {
        Self {
            limits,
            ack_by: Some(Instant::now() + limits.ack_timeout),
            began: false,
            sleep: None,
        }
    }

    /// The node acknowledged (any frame of the stream does).
    pub fn acknowledged(&mut self) {
        self.ack_by = None;
    }

    pub fn is_acknowledged(&self) -> bool {
        self.ack_by.is_none()
    }

    /// The response began: from now on silence is bounded by the idle timeout.
    pub fn began(&mut self) {
        self.ack_by = None;
        self.began = true;
    }

    pub fn limits(&self) -> StreamLimits {
        self.limits
    }

    /// The next frame, `Ok(None)` when the route is gone, or which deadline passed first.
    pub async fn recv<T>(&mut self, rx: &mut StreamReceiver<T>) -> Result<Option<T>, Expired> {
        match rx.try_recv() {
            Ok(Some(item)) => return Ok(Some(item)),
            Err(()) => return Ok(None),
            Ok(None) => {}
        }
        let (deadline, which) = match (self.ack_by, self.began) {
            (Some(at), _) => (at, Expired::Ack),
            (None, true) => (Instant::now() + self.limits.idle_timeout, Expired::Idle),
            (None, false) => return Ok(rx.recv().await),
        };
        let (sleep, armed) = match &mut self.sleep {
            Some((sleep, armed)) => {
                // Armed earlier than needed is fine (it is re-armed when it fires); armed
                // later than needed is not.
                if *armed > deadline {
                    sleep.as_mut().reset(deadline);
                    *armed = deadline;
                }
                (sleep, armed)
            }
            None => {
                let (sleep, armed) = self
                    .sleep
                    .insert((Box::pin(tokio::time::sleep_until(deadline)), deadline));
                (sleep, armed)
            }
        };
        loop {
            tokio::select! {
                biased;
                item = rx.recv() => return Ok(item),
                _ = sleep.as_mut() => {
                    if Instant::now() >= deadline {
                        return Err(which);
                    }
                    // Fired for an earlier wait's deadline: wait out this one.
                    sleep.as_mut().reset(deadline);
                    *armed = deadline;
                }
            }
        }
    }
}

/// One client request's metrics: its outcome (`ok`, or the reason it failed), latency and
/// time to first token, each recorded once. Dropped without an outcome, it counts as
/// `client_abort`.
#[derive(Debug)]
pub struct RequestMeter {
    edge: Arc<Edge>,
    group: Arc<GroupMetrics>,
    path: &'static str,
    started: std::time::Instant,
    first_token: bool,
    done: bool,
    /// The request's record in the usage ledger, told the first token and the end.
    recorder: Option<RequestRecorder>,
}

/// The `outcome` label of a request that ended with `failure` (none: `ok`).
pub fn outcome_label(failure: Option<ErrorCode>) -> &'static str {
    match failure {
        None => "ok",
        Some(code) => code.as_str(),
    }
}

impl RequestMeter {
    pub fn new(edge: Arc<Edge>, group: &str, recorder: Option<RequestRecorder>) -> Self {
        Self {
            recorder,
            group: edge.metrics.group(group),
            edge,
            path: "none",
            started: std::time::Instant::now(),
            first_token: false,
            done: false,
        }
    }

    /// The path of the attempt that serves (or last failed) the request.
    pub fn set_path(&mut self, path: &'static str) {
        self.path = path;
    }

    pub fn path(&self) -> &'static str {
        self.path
    }

    /// The request waited `waited` in its group's queue for a slot.
    pub fn queue_wait(&self, waited: Duration) {
        self.group.observe_queue_wait(waited);
    }

    /// The first token (delta or body bytes) arrived.
    pub fn first_token(&mut self) {
        if !self.first_token {
            self.first_token = true;
            if let Some(recorder) = &self.recorder {
                recorder.first_token();
            }
            self.group.observe_first_token(self.started.elapsed());
        }
    }

    /// The request ended: `None` for success, else the reason.
    pub fn finish(&mut self, failure: Option<ErrorCode>) {
        if self.done {
            return;
        }
        self.done = true;
        if let Some(recorder) = &self.recorder {
            recorder.stream_ended(failure.map(ErrorCode::as_str));
        }
        self.edge
            .metrics
            .count_group_request(&self.group, self.path, outcome_label(failure));
        self.group.observe_request_duration(self.started.elapsed());
    }
}

impl Drop for RequestMeter {
    fn drop(&mut self) {
        self.finish(Some(ErrorCode::ClientAbort));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::NodeSession;

    fn limits() -> StreamLimits {
        StreamLimits {
            ack_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(30),
        }
    }

    fn session() -> NodeSession {
        let (outbound, _rx) = iop_proto::Outbound::channel(8);
        NodeSession::new(
            "n".into(),
            crate::registry::Generation(1),
            "peer".into(),
            outbound,
            tokio_util::sync::CancellationToken::new(),
        )
    }

    fn event(kind: iop_proto::pb::RunEventKind) -> iop_proto::pb::RunEvent {
        iop_proto::pb::RunEvent {
            run_id: "r".into(),
            kind: kind as i32,
            ..Default::default()
        }
    }

    #[tokio::test(start_paused = true)]
    async fn an_unacknowledged_dispatch_expires_at_the_ack_timeout() {
        let s = session();
        let mut rx = s.open_run("r").unwrap();
        let mut d = Deadlines::new(limits());
        let started = Instant::now();
        assert_eq!(d.recv(&mut rx).await.unwrap_err(), Expired::Ack);
        assert_eq!(started.elapsed(), Duration::from_secs(5));
    }

    #[tokio::test(start_paused = true)]
    async fn after_the_ack_only_a_begun_response_has_an_idle_deadline() {
        let s = session();
        let mut rx = s.open_run("r").unwrap();
        let mut d = Deadlines::new(limits());
        s.deliver_run_event(event(iop_proto::pb::RunEventKind::Accepted));
        assert!(d.recv(&mut rx).await.unwrap().is_some());
        d.acknowledged();
        // Acknowledged but not begun: no deadline (the node bounds the provider's head).
        let waiting = tokio::time::timeout(Duration::from_secs(3600), d.recv(&mut rx)).await;
        assert!(waiting.is_err(), "no deadline before the response began");
        d.began();
        let started = Instant::now();
        for _ in 0..3 {
            tokio::time::sleep(Duration::from_secs(20)).await;
            s.deliver_run_event(event(iop_proto::pb::RunEventKind::Delta));
            assert!(
                d.recv(&mut rx).await.unwrap().is_some(),
                "each frame resets it"
            );
        }
        assert_eq!(d.recv(&mut rx).await.unwrap_err(), Expired::Idle);
        assert_eq!(started.elapsed(), Duration::from_secs(90));
    }

    #[tokio::test(start_paused = true)]
    async fn a_stream_that_keeps_talking_never_expires_and_silence_ends_it_on_time() {
        let s = std::sync::Arc::new(session());
        let mut rx = s.open_run("r").unwrap();
        let mut d = Deadlines::new(limits());
        d.began();
        // A frame every 20 s arrives while the consumer waits: 10 of them, 200 s in all,
        // longer than the 30 s idle timeout many times over.
        let feeder = {
            let s = s.clone();
            tokio::spawn(async move {
                for _ in 0..10 {
                    tokio::time::sleep(Duration::from_secs(20)).await;
                    s.deliver_run_event(event(iop_proto::pb::RunEventKind::Delta));
                }
            })
        };
        for _ in 0..10 {
            assert!(d.recv(&mut rx).await.unwrap().is_some());
        }
        feeder.await.unwrap();
        let last = Instant::now();
        assert_eq!(d.recv(&mut rx).await.unwrap_err(), Expired::Idle);
        assert_eq!(last.elapsed(), Duration::from_secs(30));
    }

    #[tokio::test(start_paused = true)]
    async fn a_closed_route_is_the_end_not_a_timeout() {
        let s = session();
        let mut rx = s.open_run("r").unwrap();
        let mut d = Deadlines::new(limits());
        s.close("gone");
        assert!(d.recv(&mut rx).await.unwrap().is_none());
    }
}
