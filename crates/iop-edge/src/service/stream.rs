//! What run and tunnel streams share: the deadlines a consumer waits under (the node's
//! acknowledgement of the dispatch, then the provider's idle timeout once the response
//! began), the limits a stream is opened with, and [`StreamCore`]: the route, credit, slot
//! and the one report of how the stream ended.
//!
//! Timers are touched only when a stream has nothing queued: a frame that is already
//! there is taken without a clock read or a timer, so a burst costs nothing extra. And the
//! idle timer is not moved per frame: it stays armed at an earlier deadline, and when it
//! fires before the current one it is re-armed once — one timer update per idle period,
//! not one per token.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use iop_proto::{ErrorCode, pb};
use tokio::time::{Instant, Sleep};

use super::admission::LeaseGuard;
use super::errors::SubmitError;
use super::{CreditReturn, Edge};
use crate::ledger::RequestRecorder;
use crate::session::{NodeSession, SessionClosed, StreamReceiver};

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

    /// Gives an unacknowledged dispatch another ack timeout from now (its node's link is
    /// down and the edge waits for it to come back).
    pub fn extend_ack(&mut self) {
        if self.ack_by.is_some() {
            self.ack_by = Some(Instant::now() + self.limits.ack_timeout);
        }
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

/// Which kind of node stream: what its cancel asks for and how logs name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamKind {
    Run,
    Tunnel,
}

impl StreamKind {
    fn name(self) -> &'static str {
        match self {
            StreamKind::Run => "run",
            StreamKind::Tunnel => "tunnel",
        }
    }
}

/// What one item of a node stream says besides itself, as a stream being drained sees it.
pub trait StreamItem: Send + Sized + 'static {
    const KIND: StreamKind;
    /// Opens the route that carries stream `id`'s frames on `session`.
    fn open(session: &NodeSession, id: &str) -> Result<StreamReceiver<Self>, SessionClosed>;
    /// The node's last frame of the stream (a run's terminal, a tunnel's end or error).
    fn is_last(&self) -> bool;
    /// Usage the provider reported, and the model it said served the request.
    fn observation(&mut self) -> (Option<pb::Usage>, Option<String>);
    /// A data frame (it spent a frame of credit).
    fn is_data(&self) -> bool {
        false
    }
}

/// Where a stream reports: the member of a model-group attempt (its outcome feeds passive
/// ejection) and, once the stream serves the client's request, the request's record.
#[derive(Debug, Default)]
pub struct Reports {
    /// The member the stream's attempt went to, and whose request it was (for passive
    /// ejection).
    pub member: Option<AttemptOf>,
    pub recorder: Option<RequestRecorder>,
}

/// An attempt's member and caller.
#[derive(Debug, Clone)]
pub struct AttemptOf {
    pub node: Arc<str>,
    pub provider: Arc<str>,
    /// The API key's name (empty for the anonymous caller).
    pub caller: Arc<str>,
}

/// What a stream holds besides its frames: the provider slot (until its end), where its
/// ending is reported, and its bounds.
#[derive(Debug, Default)]
pub struct StreamTerms {
    pub lease: Option<LeaseGuard>,
    pub reports: Reports,
    pub limits: StreamLimits,
}

impl Edge {
    /// Opens a new stream on `session`: its route, then the request `request(id)` that
    /// starts it on the node. If the link closed, the route is closed again and the
    /// lease dropped (its slot returns).
    pub(crate) async fn open_stream<T: StreamItem, R: Into<pb::Envelope>>(
        self: &Arc<Self>,
        session: Arc<NodeSession>,
        client_request_id: String,
        terms: StreamTerms,
        request: impl FnOnce(String) -> R,
    ) -> Result<Live<T>, SubmitError> {
        let id = self.new_id();
        let rx = T::open(&session, &id).map_err(|e| SubmitError::send_failed(&session, e))?;
        if session.outbound.send(request(id.clone())).await.is_err() {
            session.close_stream(&id);
            return Err(SubmitError::send_failed(&session, "the connection closed"));
        }
        if let Some(lease) = &terms.lease {
            lease.sent();
        }
        let core = StreamCore::new(self.clone(), session, id, client_request_id, rx, terms);
        Ok(Live::new(core))
    }
}

/// What run and tunnel streams share: the route's receiver and the deadlines it is read
/// under, stream credit, the provider slot, and the outcome reported exactly once — to the
/// request's record and to passive ejection — however the stream ends: the node's last
/// frame, a deadline, node loss, or the consumer giving it up (which cancels it on the
/// node and keeps the slot until the node confirms, or the ack timeout passes).
#[derive(Debug)]
pub struct StreamCore<T> {
    pub edge: Arc<Edge>,
    pub session: Arc<NodeSession>,
    /// The run id or tunnel request id.
    pub id: String,
    /// The client's request id (`x-request-id`), for log lines.
    pub client_request_id: String,
    kind: StreamKind,
    pub rx: StreamReceiver<T>,
    credit: CreditReturn,
    pub deadlines: Deadlines,
    /// The node's last frame arrived, or the route is gone.
    pub ended: bool,
    /// The consumer has seen the end.
    pub done: bool,
    cancel_sent: bool,
    pub lease: Option<LeaseGuard>,
    pub reports: Reports,
    /// Why the consumer gave the stream up other than by the node's end: a deadline, a
    /// head the edge refused, a retry.
    pub failure: Option<ErrorCode>,
    concluded: bool,
    /// The provider's status (tunnels), once it came.
    pub status: Option<u32>,
    usage: Option<pb::Usage>,
    served_model: Option<String>,
    first_token: bool,
    /// The answer is resumable: a client that leaves it lets it go on this long for a
    /// resume (`dispatch.resume_grace_sec`) before it is cancelled.
    pub resume_grace: Option<Duration>,
    /// A background response: read to its end without a client, and recorded as served.
    pub background: bool,
}

/// A stream's core for as long as the stream holds it: it is taken when the stream is
/// dropped (to abandon it, or to hand it to a task that drains it); a stream is never
/// read after that.
#[derive(Debug)]
pub struct Live<T>(Option<StreamCore<T>>);

impl<T> Live<T> {
    pub fn new(core: StreamCore<T>) -> Self {
        Self(Some(core))
    }

    /// The core, unless it was taken.
    pub fn get_mut(&mut self) -> Option<&mut StreamCore<T>> {
        self.0.as_mut()
    }

    /// Takes the core (on drop).
    pub fn take(&mut self) -> Option<StreamCore<T>> {
        self.0.take()
    }
}

impl<T> std::ops::Deref for Live<T> {
    type Target = StreamCore<T>;

    fn deref(&self) -> &StreamCore<T> {
        self.0
            .as_ref()
            .expect("a stream is not read after it was dropped")
    }
}

impl<T> std::ops::DerefMut for Live<T> {
    fn deref_mut(&mut self) -> &mut StreamCore<T> {
        self.0
            .as_mut()
            .expect("a stream is not read after it was dropped")
    }
}

impl<T> StreamCore<T> {
    /// The node the stream runs on.
    pub fn node_id(&self) -> &str {
        &self.session.node_id
    }

    /// Whether the node acknowledged the stream (a run passed its adapter's gate; a
    /// tunnel's provider accepted it, or answered).
    pub fn acknowledged(&self) -> bool {
        self.deadlines.is_acknowledged()
    }
}

impl<T: StreamItem> StreamCore<T> {
    pub fn new(
        edge: Arc<Edge>,
        session: Arc<NodeSession>,
        id: String,
        client_request_id: String,
        rx: StreamReceiver<T>,
        terms: StreamTerms,
    ) -> Self {
        Self {
            credit: CreditReturn::new(&id),
            edge,
            session,
            id,
            client_request_id,
            kind: T::KIND,
            rx,
            deadlines: Deadlines::new(terms.limits),
            ended: false,
            done: false,
            cancel_sent: false,
            lease: terms.lease,
            reports: terms.reports,
            failure: None,
            concluded: false,
            status: None,
            usage: None,
            served_model: None,
            first_token: false,
            resume_grace: None,
            background: false,
        }
    }

    /// The next frame from the node, `Ok(None)` when the route is gone, or which deadline
    /// passed first. While the node's link is down (the stream waits to be re-attached,
    /// bounded by the re-attach wait) the acknowledgement deadline does not pass.
    pub async fn recv(&mut self) -> Result<Option<T>, Expired> {
        loop {
            match self.deadlines.recv(&mut self.rx).await {
                Err(Expired::Ack) if self.waits_for_node() => self.deadlines.extend_ack(),
                other => return other,
            }
        }
    }

    /// Whether the stream's node connection is gone and no new one is ready yet.
    fn waits_for_node(&self) -> bool {
        self.session.is_closed() && self.edge.session(&self.session.node_id).is_none()
    }

    /// The session control frames (credit, cancel) go to: the stream's own, or — once
    /// that is gone — the node's current one, which adopted the stream.
    fn control_session(&self) -> Option<Arc<NodeSession>> {
        if self.session.is_closed() {
            self.edge.session(&self.session.node_id)
        } else {
            Some(self.session.clone())
        }
    }

    /// A data frame (a delta, a tool call, a body chunk holding `events` streamed events)
    /// reached the consumer: credit goes back, the first token is noted, output counted.
    pub fn data(&mut self, events: u64) {
        if let Some(credit) = self.credit.consumed_one(self.rx.progress())
            && let Some(session) = self.control_session()
        {
            self.edge.send_control(&session.outbound, credit.into());
        }
        if let Some(recorder) = &self.reports.recorder {
            if !self.first_token {
                self.first_token = true;
                recorder.first_token();
            }
            if events > 0 {
                recorder.relayed(events);
            }
        }
    }

    /// Usage (or the served model) the node reported.
    pub fn observe(&mut self, usage: Option<pb::Usage>, served_model: Option<String>) {
        if usage.is_some() {
            self.usage = usage;
        }
        if served_model.is_some() {
            self.served_model = served_model;
        }
    }

    /// The serving stream's record: from now on it records the request's end.
    pub fn serve(&mut self, recorder: RequestRecorder) {
        self.reports.recorder = Some(recorder);
    }

    /// The node's last frame came (or its route is gone): the node's slot is free, so ours
    /// is returned now, and the outcome is recorded.
    pub fn node_ended(&mut self, failure: Option<ErrorCode>) {
        self.ended = true;
        self.done = true;
        self.lease = None;
        self.publish_usage();
        self.conclude(self.failure.or(failure));
    }

    /// The message of a stream whose node connection went away. One that waited for its
    /// node to come back and was given up counts as acknowledged from now on: the node
    /// may have run it, so it is not tried on another member.
    pub fn lost(&mut self) -> String {
        let reason = self
            .session
            .close_reason()
            .unwrap_or_else(|| "the node stopped the stream".into());
        if self.rx.progress().gave_up() {
            self.deadlines.acknowledged();
            let wait = self.edge.config().dispatch.reattach_wait_sec;
            return format!(
                "node {} connection lost ({reason}) and it did not come back within {wait}s; the request may have run on it",
                self.session.node_id
            );
        }
        format!("node {} connection lost: {reason}", self.session.node_id)
    }

    /// A deadline passed: the stream ends with its error (returned), cancelled on the node.
    pub fn expire(&mut self, expired: Expired) -> (ErrorCode, String) {
        let limits = self.deadlines.limits();
        let message = match expired {
            Expired::Ack => format!(
                "node {} did not acknowledge the {} within {:.1}s",
                self.session.node_id,
                self.kind.name(),
                limits.ack_timeout.as_secs_f64()
            ),
            Expired::Idle => format!(
                "the provider sent nothing for {}s (its idle_timeout_sec)",
                limits.idle_timeout.as_secs()
            ),
        };
        let code = expired.code();
        tracing::warn!(node_id = %self.session.node_id, stream_id = %self.id, code = code.as_str(), "{message}");
        self.failure = Some(code);
        self.done = true;
        self.conclude(Some(code));
        self.send_cancel("deadline passed");
        (code, message)
    }

    /// Records the outcome once: the request's record and the attempt's report.
    pub fn conclude(&mut self, failure: Option<ErrorCode>) {
        if self.concluded {
            return;
        }
        self.concluded = true;
        if let Some(recorder) = &self.reports.recorder {
            recorder.stream_ended(failure);
        }
        if let Some(of) = &self.reports.member {
            self.edge.attempt_finished(of, failure, self.status);
        }
    }

    fn send_cancel(&mut self, reason: &str) {
        if self.cancel_sent || self.ended {
            return;
        }
        self.cancel_sent = true;
        let cancel = match self.kind {
            StreamKind::Run => pb::CancelRequest::run(&self.id, reason),
            StreamKind::Tunnel => pb::CancelRequest::tunnel(&self.id, reason),
        };
        match self.control_session() {
            Some(session) => self.edge.send_control(&session.outbound, cancel.into()),
            // The node is away: its next session sends the cancel when it adopts the
            // stream.
            None => self.rx.progress().want_cancel(),
        }
    }

    /// Drops the stream's route, wherever it is now.
    /// (A closed session holds no routes; a parked one ends with its consumer.)
    fn close_route(&self) {
        if let Some(session) = self.control_session() {
            session.close_stream(&self.id);
        }
    }

    /// Hands the usage the provider reported to the request's record, once.
    fn publish_usage(&mut self) {
        if let (Some(recorder), Some(usage)) = (&self.reports.recorder, self.usage.take()) {
            recorder.usage(usage, self.served_model.take());
        }
    }

    /// The consumer gave the stream up before the node's end (dropped it): the outcome is
    /// recorded (`client_abort` unless it said why), the node is told to cancel, and the
    /// provider slot is kept until the node confirms.
    pub fn abandon(mut self) {
        if self.ended {
            return;
        }
        if self.failure.is_none()
            && let Some(grace) = self.resume_grace.take().filter(|g| !g.is_zero())
        {
            tracing::info!(node_id = %self.session.node_id, stream_id = %self.id, request_id = %self.client_request_id, grace_sec = grace.as_secs(), "client went away: the answer goes on a while for it to resume");
            let tasks = self.edge.tasks().clone();
            tasks.spawn(self.await_resume(grace));
            return;
        }
        // The provider did the work even if the client left before the end.
        self.publish_usage();
        let failure = self.failure.unwrap_or(ErrorCode::ClientAbort);
        self.conclude(Some(failure));
        if !self.cancel_sent {
            let kind = self.kind.name();
            match failure {
                ErrorCode::ClientAbort => {
                    tracing::info!(node_id = %self.session.node_id, stream_id = %self.id, request_id = %self.client_request_id, "client went away: cancelling {kind}")
                }
                other => {
                    tracing::info!(node_id = %self.session.node_id, stream_id = %self.id, request_id = %self.client_request_id, reason = other.as_str(), "{kind} given up: cancelling it on the node")
                }
            }
        }
        self.send_cancel(match failure {
            ErrorCode::ClientAbort => "client disconnected",
            other => other.as_str(),
        });
        if self.lease.is_none() {
            self.close_route();
            return;
        }
        let tasks = self.edge.tasks().clone();
        tasks.spawn(self.drain());
    }

    /// The client left a resumable answer: it goes on for `grace` (its frames taken and
    /// credited, so the node keeps sending and keeps it in its journal) for the client to
    /// resume it. It ends here when it ends (billed here: the tokens were served), when a
    /// resume took it elsewhere (the node ends it here with `cancelled`; the edge that has
    /// it now bills it), or when the grace passes: then it is cancelled like any
    /// abandoned stream.
    async fn await_resume(mut self, grace: Duration) {
        let until = tokio::time::Instant::now() + grace;
        while let Ok(item) = tokio::time::timeout_at(until, self.rx.recv()).await {
            let Some(mut item) = item else {
                // The route is gone (its node did not come back).
                self.ended = true;
                self.lease = None;
                self.conclude(Some(ErrorCode::ClientAbort));
                return;
            };
            let (usage, model) = item.observation();
            self.observe(usage, model);
            if item.is_data() {
                self.data(0);
            }
            if item.is_last() {
                let failure = (!self.background).then_some(ErrorCode::ClientAbort);
                self.node_ended(failure);
                return;
            }
        }
        self.abandon();
    }

    /// After a cancel: takes the node's frames until its last one (which comes once the
    /// node freed its slot), up to the ack timeout, then returns the slot.
    async fn drain(mut self) {
        let bound = self.deadlines.limits().ack_timeout;
        let confirmed = tokio::time::timeout(bound, async {
            while let Some(mut item) = self.rx.recv().await {
                let (usage, model) = item.observation();
                self.observe(usage, model);
                if item.is_last() {
                    return true;
                }
            }
            // The route is gone (connection lost): its leases were returned with it.
            true
        })
        .await
        .unwrap_or(false);
        if !confirmed {
            tracing::warn!(node_id = %self.session.node_id, stream_id = %self.id, "the node did not confirm the {}'s cancel within {:.1}s: its slot is returned anyway", self.kind.name(), bound.as_secs_f64());
            self.close_route();
        }
        self.ended = true;
        self.lease = None;
        self.publish_usage();
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
