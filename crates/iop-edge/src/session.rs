//! A dispatch-ready node connection as the service sees it: the queue towards the node and
//! the routes of everything in flight on the connection (run streams, tunnel streams,
//! command replies), correlated by id.
//!
//! The transport's reader delivers frames here without ever waiting: each stream's channel
//! holds at most the credit window the edge granted plus a few control frames, and at most
//! the session's byte budget per stream (`limits.nodes.stream_buffer_bytes`), so a full
//! channel or an exhausted budget means the node broke flow control (or sent frames far
//! larger than it should) and only that stream is cut. Closing the session drops every
//! route (consumers see their channel end and report the loss), or — when the edge waits
//! for the node to come back — hands the stream routes out as [`DetachedStream`]s, which
//! the node's next session adopts: their consumers never notice, and the node is asked to
//! send again what each stream's route did not receive (`StreamResume`).

use foldhash::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use iop_proto::Outbound;
use iop_proto::pb::{self, provider_tunnel_frame::Frame};
use parking_lot::Mutex;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::registry::Generation;

pub use iop_proto::STREAM_WINDOW;
/// Streams whose last frame arrived that the edge tells the node about in one frame.
pub const RECEIVED_BATCH: usize = 64;
/// Room for the control frames of a stream (start, status, headers, usage, end ...).
const CONTROL_SLACK: usize = 32;
const STREAM_CHANNEL: usize = STREAM_WINDOW as usize + CONTROL_SLACK;

/// A reply to a command sent with a `command_id`.
#[derive(Debug)]
pub enum CommandReply {
    Command(pb::NodeCommandResponse),
    Cancel(pb::CancelResponse),
}

#[derive(Debug)]
enum Route {
    Run(StreamSender<pb::RunEvent>),
    Tunnel(StreamSender<Frame>),
}

/// How far one stream got, as both its halves see it: what a re-attach asks the node for.
#[derive(Debug, Default)]
pub struct StreamProgress {
    /// Frames delivered to the route, in all.
    received: AtomicU64,
    /// Data frames the consumer returned credit for, in all.
    credited: AtomicU64,
    /// The route was dropped because the node did not come back in time.
    gave_up: AtomicBool,
    /// The consumer gave the stream up while no session could carry its cancel.
    cancel_wanted: AtomicBool,
}

impl StreamProgress {
    /// The consumer returned `frames` of credit.
    pub fn credited(&self, frames: u32) {
        self.credited
            .fetch_add(u64::from(frames), Ordering::Relaxed);
    }

    /// The consumer gave the stream up while the node was away: the cancel goes out when
    /// a new session adopts the stream.
    pub fn want_cancel(&self) {
        self.cancel_wanted.store(true, Ordering::Release);
    }

    /// Whether the route was dropped because its node did not come back within the
    /// re-attach wait (the request may have run).
    pub fn gave_up(&self) -> bool {
        self.gave_up.load(Ordering::Acquire)
    }
}

/// The delivering half of one stream: its channel and the bytes queued in it.
#[derive(Debug)]
struct StreamSender<T> {
    tx: mpsc::Sender<(T, usize)>,
    queued: Arc<AtomicUsize>,
    progress: Arc<StreamProgress>,
}

impl<T> StreamSender<T> {
    /// Queues `item` (of `size` bytes) unless that would take the stream over `budget`
    /// bytes; a stream with nothing queued always takes one frame (frames are bounded by
    /// `max_frame_bytes` anyway), so the budget never stalls a stream that is being read.
    fn deliver(&self, item: T, size: usize, budget: usize) -> Delivery {
        let queued = self.queued.load(Ordering::Acquire);
        if queued > 0 && queued.saturating_add(size) > budget {
            return Delivery::OverBudget;
        }
        self.queued.fetch_add(size, Ordering::AcqRel);
        match self.tx.try_send((item, size)) {
            Ok(()) => {
                self.progress.received.fetch_add(1, Ordering::Relaxed);
                Delivery::Delivered
            }
            Err(err) => {
                self.queued.fetch_sub(size, Ordering::AcqRel);
                match err {
                    mpsc::error::TrySendError::Closed(_) => Delivery::NoRoute,
                    mpsc::error::TrySendError::Full(_) => Delivery::Overflow,
                }
            }
        }
    }
}

/// The consuming half of one stream: what the node sent on it, in order.
#[derive(Debug)]
pub struct StreamReceiver<T> {
    rx: mpsc::Receiver<(T, usize)>,
    queued: Arc<AtomicUsize>,
    progress: Arc<StreamProgress>,
}

impl<T> StreamReceiver<T> {
    /// The next frame; `None` once the route is gone (stream cut, session closed).
    pub async fn recv(&mut self) -> Option<T> {
        let (item, size) = self.rx.recv().await?;
        self.queued.fetch_sub(size, Ordering::AcqRel);
        Some(item)
    }

    /// The next frame if one is queued now: `Ok(None)` when none is, `Err(())` once the
    /// route is gone and nothing is left.
    #[allow(clippy::result_unit_err)]
    pub fn try_recv(&mut self) -> Result<Option<T>, ()> {
        match self.rx.try_recv() {
            Ok((item, size)) => {
                self.queued.fetch_sub(size, Ordering::AcqRel);
                Ok(Some(item))
            }
            Err(mpsc::error::TryRecvError::Empty) => Ok(None),
            Err(mpsc::error::TryRecvError::Disconnected) => Err(()),
        }
    }

    /// Bytes delivered to this stream and not taken yet.
    pub fn queued_bytes(&self) -> usize {
        self.queued.load(Ordering::Acquire)
    }

    pub fn progress(&self) -> &StreamProgress {
        &self.progress
    }
}

fn stream_channel<T>() -> (StreamSender<T>, StreamReceiver<T>) {
    let (tx, rx) = mpsc::channel(STREAM_CHANNEL);
    let queued = Arc::new(AtomicUsize::new(0));
    let progress = Arc::new(StreamProgress::default());
    (
        StreamSender {
            tx,
            queued: queued.clone(),
            progress: progress.clone(),
        },
        StreamReceiver {
            rx,
            queued,
            progress,
        },
    )
}

/// A stream whose node connection was lost while the edge waits for the node to come
/// back: its route, kept so that its consumer goes on reading when it is adopted.
#[derive(Debug)]
pub struct DetachedStream {
    id: String,
    route: Route,
}

impl DetachedStream {
    /// What asks the node to go on with this stream on a new link.
    pub fn resume(&self) -> pb::StreamResume {
        let progress = self.progress();
        pb::StreamResume {
            stream_id: self.id.clone(),
            tunnel: matches!(self.route, Route::Tunnel(_)),
            received: progress.received.load(Ordering::Relaxed),
            credited: progress.credited.load(Ordering::Relaxed),
            ..Default::default()
        }
    }

    /// The node did not come back in time: the route is dropped, its consumer ends it
    /// saying the request may have run.
    pub fn give_up(self) {
        self.progress().gave_up.store(true, Ordering::Release);
    }

    /// Whether the consumer is gone (it ended or was dropped meanwhile).
    fn abandoned(&self) -> bool {
        match &self.route {
            Route::Run(tx) => tx.tx.is_closed(),
            Route::Tunnel(tx) => tx.tx.is_closed(),
        }
    }

    fn progress(&self) -> &StreamProgress {
        match &self.route {
            Route::Run(tx) => &tx.progress,
            Route::Tunnel(tx) => &tx.progress,
        }
    }

    /// The cancel of this stream, for `reason`.
    fn cancel(&self, reason: &str) -> pb::Envelope {
        match self.route {
            Route::Run(_) => pb::CancelRequest::run(&self.id, reason).into(),
            Route::Tunnel(_) => pb::CancelRequest::tunnel(&self.id, reason).into(),
        }
    }
}

#[derive(Debug, Default)]
struct Routes {
    /// Set once the connection is gone; no new routes open after that.
    closed: Option<String>,
    streams: HashMap<String, Route>,
    commands: HashMap<String, oneshot::Sender<CommandReply>>,
}

/// The session closed: the node's connection is gone.
#[derive(Debug, Clone, thiserror::Error)]
#[error("node connection lost: {0}")]
pub struct SessionClosed(pub String);

/// What delivering a frame to its route did.
#[derive(Debug, PartialEq, Eq)]
pub enum Delivery {
    Delivered,
    /// No route (the client left, or the stream ended): drop the frame.
    NoRoute,
    /// The stream's channel was full: the node ignored flow control; the stream is cut.
    Overflow,
    /// The stream's queued bytes would exceed the byte budget; the stream is cut.
    OverBudget,
}

impl Delivery {
    /// Whether the node broke this stream's limits (and the stream was cut).
    pub fn is_overrun(&self) -> bool {
        matches!(self, Delivery::Overflow | Delivery::OverBudget)
    }
}

#[derive(Debug)]
pub struct NodeSession {
    pub node_id: String,
    pub generation: Generation,
    pub peer: String,
    pub connected_at: Instant,
    pub outbound: Outbound,
    /// Cancelling it makes the transport drop this connection (node removed by a reload).
    pub kick: CancellationToken,
    /// Bytes one stream may hold waiting for its consumer.
    stream_budget: usize,
    /// When the node's last heartbeat (a ping or pong) arrived, in milliseconds after
    /// `connected_at`.
    last_heartbeat_ms: AtomicU64,
    routes: Mutex<Routes>,
    /// Set once the session closed (read without the routes' lock).
    closed: AtomicBool,
    /// Streams whose last frame arrived, not yet told to the node.
    received: Mutex<Vec<String>>,
}

impl NodeSession {
    pub fn new(
        node_id: String,
        generation: Generation,
        peer: String,
        outbound: Outbound,
        kick: CancellationToken,
    ) -> Self {
        Self {
            node_id,
            generation,
            peer,
            connected_at: Instant::now(),
            outbound,
            kick,
            stream_budget: crate::config::node_limits::DEFAULT_STREAM_BUFFER_BYTES,
            last_heartbeat_ms: AtomicU64::new(0),
            routes: Mutex::new(Routes::default()),
            closed: AtomicBool::new(false),
            received: Mutex::new(Vec::new()),
        }
    }

    /// Sets the bytes one stream may hold waiting for its consumer.
    pub fn with_stream_budget(mut self, bytes: usize) -> Self {
        self.stream_budget = bytes;
        self
    }

    /// A heartbeat (ping or pong) arrived from the node at `now`.
    pub fn heartbeat_seen(&self, now: Instant) {
        let ms = now.saturating_duration_since(self.connected_at).as_millis() as u64;
        self.last_heartbeat_ms.store(ms, Ordering::Relaxed);
    }

    /// When the node's last heartbeat arrived (its ready time until one does).
    pub fn last_heartbeat(&self) -> Instant {
        self.connected_at
            + std::time::Duration::from_millis(self.last_heartbeat_ms.load(Ordering::Relaxed))
    }

    pub fn open_run(&self, run_id: &str) -> Result<StreamReceiver<pb::RunEvent>, SessionClosed> {
        let (tx, rx) = stream_channel();
        self.open(run_id, Route::Run(tx))?;
        Ok(rx)
    }

    pub fn open_tunnel(&self, request_id: &str) -> Result<StreamReceiver<Frame>, SessionClosed> {
        let (tx, rx) = stream_channel();
        self.open(request_id, Route::Tunnel(tx))?;
        Ok(rx)
    }

    fn open(&self, id: &str, route: Route) -> Result<(), SessionClosed> {
        let mut routes = self.routes.lock();
        if let Some(reason) = &routes.closed {
            return Err(SessionClosed(reason.clone()));
        }
        routes.streams.insert(id.to_string(), route);
        Ok(())
    }

    pub fn close_stream(&self, id: &str) {
        self.routes.lock().streams.remove(id);
    }

    pub fn has_stream(&self, id: &str) -> bool {
        self.routes.lock().streams.contains_key(id)
    }

    pub fn stream_count(&self) -> usize {
        self.routes.lock().streams.len()
    }

    pub fn open_command(
        &self,
        command_id: &str,
    ) -> Result<oneshot::Receiver<CommandReply>, SessionClosed> {
        let (tx, rx) = oneshot::channel();
        let mut routes = self.routes.lock();
        if let Some(reason) = &routes.closed {
            return Err(SessionClosed(reason.clone()));
        }
        routes.commands.insert(command_id.to_string(), tx);
        Ok(rx)
    }

    pub fn forget_command(&self, command_id: &str) {
        self.routes.lock().commands.remove(command_id);
    }

    pub fn deliver_run_event(&self, event: pb::RunEvent) -> Delivery {
        let terminal = event.is_terminal();
        let mut routes = self.routes.lock();
        let Some(Route::Run(tx)) = routes.streams.get(&event.run_id) else {
            return Delivery::NoRoute;
        };
        let run_id = event.run_id.clone();
        let size = prost::Message::encoded_len(&event);
        let delivery = tx.deliver(event, size, self.stream_budget);
        if terminal || delivery != Delivery::Delivered {
            routes.streams.remove(&run_id);
        }
        drop(routes);
        if terminal && delivery == Delivery::Delivered {
            self.last_received(run_id);
        }
        delivery
    }

    /// Notes that the edge has a stream's last frame; the node is told in batches of
    /// [`RECEIVED_BATCH`] (and at each heartbeat, [`Self::flush_received`]), so it keeps
    /// nothing of the stream for a resend.
    fn last_received(&self, stream_id: String) {
        let batch = {
            let mut received = self.received.lock();
            received.push(stream_id);
            if received.len() < RECEIVED_BATCH {
                return;
            }
            std::mem::take(&mut *received)
        };
        self.send_received(batch);
    }

    /// Tells the node about every stream whose last frame arrived since the last batch.
    pub fn flush_received(&self) {
        let batch = std::mem::take(&mut *self.received.lock());
        if !batch.is_empty() {
            self.send_received(batch);
        }
    }

    /// If the queue is full, the node forgets the streams a heartbeat later instead.
    fn send_received(&self, stream_ids: Vec<String>) {
        self.outbound.try_send(pb::StreamsReceived { stream_ids });
    }

    pub fn deliver_tunnel_frame(&self, frame: pb::ProviderTunnelFrame) -> Delivery {
        self.deliver_tunnel(&frame.request_id, frame.frame)
    }

    /// Delivers one frame of the tunnel `request_id`.
    pub fn deliver_tunnel(&self, request_id: &str, frame: Option<Frame>) -> Delivery {
        let Some(inner) = frame else {
            return Delivery::NoRoute;
        };
        let terminal = matches!(inner, Frame::End(_) | Frame::Error(_));
        let mut routes = self.routes.lock();
        let Some(Route::Tunnel(tx)) = routes.streams.get(request_id) else {
            return Delivery::NoRoute;
        };
        let size = inner.encoded_len();
        let delivery = tx.deliver(inner, size, self.stream_budget);
        if terminal || delivery != Delivery::Delivered {
            routes.streams.remove(request_id);
        }
        drop(routes);
        if terminal && delivery == Delivery::Delivered {
            self.last_received(request_id.to_string());
        }
        delivery
    }

    pub fn deliver_reply(&self, command_id: &str, reply: CommandReply) -> Delivery {
        match self.routes.lock().commands.remove(command_id) {
            Some(tx) => {
                let _ = tx.send(reply);
                Delivery::Delivered
            }
            None => Delivery::NoRoute,
        }
    }

    /// Ends the session: no new routes, and every open one is dropped so its consumer sees
    /// the stream end without a terminal.
    pub fn close(&self, reason: &str) {
        drop(self.close_detaching(reason));
    }

    /// Ends the session like [`Self::close`], but hands out its stream routes instead of
    /// dropping them (commands end either way).
    pub fn close_detaching(&self, reason: &str) -> Vec<DetachedStream> {
        let mut routes = self.routes.lock();
        if routes.closed.is_none() {
            routes.closed = Some(reason.to_string());
        }
        self.closed.store(true, Ordering::Release);
        routes.commands.clear();
        routes
            .streams
            .drain()
            .map(|(id, route)| DetachedStream { id, route })
            .filter(|s| !s.abandoned())
            .collect()
    }

    /// Takes in streams of an earlier session of the same node; returns what to send the
    /// node: a resume for each stream whose consumer still reads, and a cancel for each
    /// whose consumer left while the node was away.
    pub fn adopt(&self, streams: Vec<DetachedStream>) -> Vec<pb::Envelope> {
        let mut routes = self.routes.lock();
        let mut frames = Vec::with_capacity(streams.len());
        let reason = "the client went away while the node was reconnecting";
        for stream in streams {
            if stream.abandoned() {
                frames.push(stream.cancel(reason));
                continue;
            }
            frames.push(stream.resume().into());
            // Given up while the node was away, still waiting for its confirmation: the
            // node goes on with it here, then cancels it (its last frame returns the slot).
            if stream.progress().cancel_wanted.load(Ordering::Acquire) {
                frames.push(stream.cancel(reason));
            }
            routes.streams.insert(stream.id, stream.route);
        }
        frames
    }

    /// Whether the session closed (its node connection is gone).
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Why the session closed, if it did.
    pub fn close_reason(&self) -> Option<String> {
        self.routes.lock().closed.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn session() -> NodeSession {
        session_and_sent().0
    }

    /// A session and what it sends the node.
    fn session_and_sent() -> (NodeSession, tokio::sync::mpsc::Receiver<pb::Envelope>) {
        let (outbound, sent) = Outbound::channel(8);
        let session = NodeSession::new(
            "n".into(),
            Generation(1),
            "peer".into(),
            outbound,
            CancellationToken::new(),
        );
        (session, sent)
    }

    fn event(run_id: &str, kind: pb::RunEventKind) -> pb::RunEvent {
        pb::RunEvent {
            run_id: run_id.into(),
            kind: kind as i32,
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn events_reach_their_run_and_the_terminal_closes_the_route() {
        let s = session();
        let mut rx = s.open_run("r1").unwrap();
        assert_eq!(
            s.deliver_run_event(event("r1", pb::RunEventKind::Delta)),
            Delivery::Delivered
        );
        assert_eq!(
            s.deliver_run_event(event("r2", pb::RunEventKind::Delta)),
            Delivery::NoRoute
        );
        assert_eq!(
            s.deliver_run_event(event("r1", pb::RunEventKind::Complete)),
            Delivery::Delivered
        );
        assert!(!s.has_stream("r1"));
        // A late duplicate terminal goes nowhere.
        assert_eq!(
            s.deliver_run_event(event("r1", pb::RunEventKind::Complete)),
            Delivery::NoRoute
        );
        assert_eq!(rx.recv().await.unwrap().kind(), pb::RunEventKind::Delta);
        assert_eq!(rx.recv().await.unwrap().kind(), pb::RunEventKind::Complete);
        assert!(rx.recv().await.is_none());
    }

    #[tokio::test]
    async fn a_stream_over_its_window_is_cut_alone() {
        let s = session();
        let _flooded = s.open_run("flood").unwrap();
        let mut calm = s.open_run("calm").unwrap();
        let mut last = Delivery::Delivered;
        for _ in 0..STREAM_CHANNEL + 1 {
            last = s.deliver_run_event(event("flood", pb::RunEventKind::Delta));
        }
        assert_eq!(last, Delivery::Overflow);
        assert!(!s.has_stream("flood"));
        assert_eq!(
            s.deliver_run_event(event("calm", pb::RunEventKind::Delta)),
            Delivery::Delivered
        );
        assert!(calm.recv().await.is_some());
    }

    fn body(request_id: &str, bytes: usize) -> pb::ProviderTunnelFrame {
        pb::ProviderTunnelFrame {
            request_id: request_id.into(),
            frame: Some(Frame::Body(vec![b'x'; bytes].into())),
        }
    }

    #[tokio::test]
    async fn a_stream_over_its_byte_budget_is_cut_alone() {
        let s = session().with_stream_budget(64 * 1024);
        let _flooded = s.open_tunnel("flood").unwrap();
        let mut calm = s.open_tunnel("calm").unwrap();
        // One oversized frame is taken by an empty stream; the next is over the budget.
        assert_eq!(
            s.deliver_tunnel_frame(body("flood", 1024 * 1024)),
            Delivery::Delivered
        );
        assert_eq!(
            s.deliver_tunnel_frame(body("flood", 16)),
            Delivery::OverBudget
        );
        assert!(!s.has_stream("flood"));
        assert_eq!(
            s.deliver_tunnel_frame(body("calm", 16)),
            Delivery::Delivered
        );
        assert!(calm.recv().await.is_some());
    }

    #[tokio::test]
    async fn what_the_consumer_takes_frees_the_budget() {
        let s = session().with_stream_budget(64 * 1024);
        let mut rx = s.open_tunnel("t").unwrap();
        for _ in 0..100 {
            for _ in 0..3 {
                assert_eq!(
                    s.deliver_tunnel_frame(body("t", 16 * 1024)),
                    Delivery::Delivered
                );
            }
            assert!(rx.queued_bytes() >= 3 * 16 * 1024);
            for _ in 0..3 {
                rx.recv().await.unwrap();
            }
            assert_eq!(rx.queued_bytes(), 0);
        }
    }

    #[tokio::test]
    async fn a_detached_stream_is_adopted_by_the_next_session_and_its_consumer_reads_on() {
        let old = session();
        let mut rx = old.open_tunnel("t").unwrap();
        let abandoned = old.open_run("gone").unwrap();
        drop(abandoned);
        for _ in 0..3 {
            old.deliver_tunnel_frame(body("t", 8));
        }
        rx.progress().credited(2);
        let detached = old.close_detaching("connection closed by the node");
        assert!(old.is_closed());
        assert_eq!(
            detached.len(),
            1,
            "a stream whose consumer left is not kept"
        );
        let new = session();
        let resumes = new.adopt(detached);
        assert_eq!(
            resumes,
            vec![
                pb::StreamResume {
                    stream_id: "t".into(),
                    tunnel: true,
                    received: 3,
                    credited: 2,
                    ..Default::default()
                }
                .into()
            ]
        );
        // The node resends on the new session; the consumer reads on in order.
        new.deliver_tunnel_frame(body("t", 8));
        for _ in 0..4 {
            assert!(rx.recv().await.is_some());
        }
        assert!(!rx.progress().gave_up());
    }

    #[tokio::test]
    async fn the_node_hears_of_received_last_frames_in_batches_and_at_a_flush() {
        let (s, mut sent) = session_and_sent();
        let mut receivers = Vec::new();
        for i in 0..RECEIVED_BATCH + 1 {
            let id = format!("r{i}");
            receivers.push(s.open_run(&id).unwrap());
            s.deliver_run_event(event(&id, pb::RunEventKind::Complete));
        }
        let received = |envelope: pb::Envelope| match envelope.message {
            Some(pb::envelope::Message::StreamsReceived(r)) => r.stream_ids,
            other => panic!("{other:?}"),
        };
        assert_eq!(received(sent.try_recv().unwrap()).len(), RECEIVED_BATCH);
        assert!(
            sent.try_recv().is_err(),
            "the rest waits for the next batch"
        );
        s.flush_received();
        assert_eq!(
            received(sent.try_recv().unwrap()),
            vec![format!("r{RECEIVED_BATCH}")]
        );
    }

    #[tokio::test]
    async fn a_stream_whose_client_left_while_detached_is_cancelled_on_adoption() {
        let old = session();
        let rx = old.open_tunnel("t").unwrap();
        let detached = old.close_detaching("lost");
        drop(rx);
        let frames = session().adopt(detached);
        assert_eq!(frames.len(), 1);
        assert!(matches!(
            &frames[0].message,
            Some(pb::envelope::Message::CancelRequest(c)) if c.request_id == "t"
        ));
    }

    #[tokio::test]
    async fn a_stream_given_up_while_its_node_was_away_is_resumed_then_cancelled() {
        let old = session();
        let rx = old.open_run("r").unwrap();
        let detached = old.close_detaching("lost");
        rx.progress().want_cancel();
        let new = session();
        let frames = new.adopt(detached);
        let kinds: Vec<&str> = frames.iter().map(iop_proto::envelope::kind).collect();
        assert_eq!(kinds, ["stream_resume", "cancel_request"]);
        assert!(
            new.has_stream("r"),
            "its confirmation still reaches the consumer"
        );
    }

    #[tokio::test]
    async fn a_detached_stream_given_up_ends_its_consumer_saying_so() {
        let old = session();
        let mut rx = old.open_run("r").unwrap();
        let detached = old.close_detaching("heartbeat timeout");
        detached.into_iter().for_each(DetachedStream::give_up);
        assert!(rx.recv().await.is_none());
        assert!(rx.progress().gave_up());
    }

    #[tokio::test]
    async fn close_ends_every_stream_and_refuses_new_ones() {
        let s = session();
        let mut run = s.open_run("r").unwrap();
        let mut tunnel = s.open_tunnel("t").unwrap();
        let command = s.open_command("c").unwrap();
        s.close("heartbeat timeout");
        assert!(run.recv().await.is_none());
        assert!(tunnel.recv().await.is_none());
        assert!(command.await.is_err());
        assert_eq!(s.open_run("r2").unwrap_err().0, "heartbeat timeout");
        assert_eq!(s.close_reason().as_deref(), Some("heartbeat timeout"));
    }
}
