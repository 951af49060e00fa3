//! SubmitProviderTunnel: asks a node to make an HTTP request to one of its OpenAI-compatible
//! providers and streams the response back as ordered frames.
//!
//! A [`TunnelStream`] yields status, headers, body chunks and exactly one ending (end or
//! error). The node's `accepted` frame, usage and metadata are consumed here and never
//! reach the body; usage and metadata may arrive in either order, so the usage is
//! published once the stream ends, with the served model the metadata named.
//!
//! Deadlines: the node must acknowledge the tunnel within the dispatch's ack timeout, and
//! once the response head arrived the provider may stay silent only up to its idle
//! timeout; either ends the stream with one error and cancels the tunnel on the node.
//!
//! A stream dropped (or timed out) before the node's last frame cancels the tunnel on the
//! node, which aborts the provider request, and keeps its provider slot until the node
//! confirms (its last frame comes after the node freed its own slot) or the ack timeout
//! passes: a waiter given the slot never finds the node's gate still full.
//!
//! A model-group tunnel (one with an [`Observe`]) reports its provider's outcome for
//! passive ejection once it ends ([`Edge::attempt_finished`]): a clean end after a 2xx as
//! a success, a 5xx status or an error that blames the provider as a failure.

use std::sync::Arc;

use bytes::Bytes;
use iop_proto::ErrorCode;
use iop_proto::pb::{self, provider_tunnel_frame::Frame};

use super::admission::LeaseGuard;
use super::run::SubmitError;
use super::stream::{Deadlines, RequestMeter, StreamLimits};
use super::{CreditReturn, Edge, Observe};
use crate::session::{NodeSession, STREAM_WINDOW, StreamReceiver};

/// One HTTP request for a provider, relative to its API root.
#[derive(Debug, Clone, Default)]
pub struct TunnelSpec {
    pub adapter: String,
    pub method: String,
    pub path: String,
    pub headers: Vec<pb::Header>,
    pub body: Bytes,
    /// The body asks for stream usage the client did not ask for: the node removes it
    /// from the relayed stream (`ProviderTunnelRequest.usage_injected`).
    pub usage_injected: bool,
    /// The client's request id, for the node's logs (the provider gets it in `headers`).
    pub client_request_id: String,
}

/// What the client-facing side needs of the tunnel's frames.
#[derive(Debug)]
pub enum TunnelItem {
    /// The provider's status as the node sent it (checked by the HTTP layer).
    Status(u32),
    Headers(Vec<pb::Header>),
    Body(Bytes),
    End,
    Error(pb::TunnelError),
}

/// A provider's response head as the node sent it (checked by the HTTP layer).
#[derive(Debug, Clone)]
pub struct TunnelHead {
    pub status: u32,
    pub headers: Vec<pb::Header>,
}

impl Edge {
    pub(crate) async fn start_tunnel(
        self: &Arc<Self>,
        session: Arc<NodeSession>,
        spec: TunnelSpec,
        lease: Option<LeaseGuard>,
        observe: Option<Observe>,
        limits: StreamLimits,
    ) -> Result<TunnelStream, SubmitError> {
        let request_id = self.new_id();
        let send_failed = |reason: String| SubmitError::SendFailed {
            node: session.node_id.clone(),
            reason,
        };
        let rx = session
            .open_tunnel(&request_id)
            .map_err(|e| send_failed(e.to_string()))?;
        let request = pb::ProviderTunnelRequest {
            request_id: request_id.clone(),
            adapter: spec.adapter,
            method: spec.method,
            path: spec.path,
            headers: spec.headers,
            body: spec.body,
            initial_credit: STREAM_WINDOW,
            usage_injected: spec.usage_injected,
            client_request_id: spec.client_request_id.clone(),
        };
        if session.outbound.send(request).await.is_err() {
            session.close_stream(&request_id);
            return Err(send_failed("the connection closed".into()));
        }
        Ok(TunnelStream {
            replay: Default::default(),
            inner: Some(TunnelInner {
                edge: self.clone(),
                credit: CreditReturn::new(&request_id),
                client_request_id: spec.client_request_id,
                request_id,
                session,
                rx,
                deadlines: Deadlines::new(limits),
                ended: false,
                done: false,
                cancel_sent: false,
                lease,
                observe,
                usage: None,
                served_model: None,
                status: None,
                failure: None,
                meter: None,
                concluded: false,
            }),
        })
    }
}

#[derive(Debug)]
pub struct TunnelStream {
    inner: Option<TunnelInner>,
    /// The head the dispatcher already read, returned again first.
    replay: std::collections::VecDeque<TunnelItem>,
}

#[derive(Debug)]
struct TunnelInner {
    edge: Arc<Edge>,
    session: Arc<NodeSession>,
    request_id: String,
    /// The client's request id (`x-request-id`), for log lines.
    client_request_id: String,
    rx: StreamReceiver<Frame>,
    credit: CreditReturn,
    deadlines: Deadlines,
    /// The node's last frame (end or error) arrived, or the route is gone.
    ended: bool,
    /// The consumer has seen the ending.
    done: bool,
    cancel_sent: bool,
    lease: Option<LeaseGuard>,
    observe: Option<Observe>,
    /// The provider-reported usage, published when the stream ends.
    usage: Option<pb::Usage>,
    /// The metadata's `model`: what the provider said served the request.
    served_model: Option<String>,
    /// The provider's status, once it came.
    status: Option<u32>,
    /// Why the consumer's stream ended other than by the node's ending: a deadline, a
    /// head the edge refused, a retry.
    failure: Option<ErrorCode>,
    /// The client request's metrics, when this tunnel serves one.
    meter: Option<RequestMeter>,
    /// Outcome recorded (metrics, attempt report).
    concluded: bool,
}

impl TunnelStream {
    fn inner(&self) -> &TunnelInner {
        self.inner.as_ref().expect("live stream")
    }

    fn inner_mut(&mut self) -> &mut TunnelInner {
        self.inner.as_mut().expect("live stream")
    }

    pub fn request_id(&self) -> &str {
        &self.inner().request_id
    }

    pub fn node_id(&self) -> &str {
        &self.inner().session.node_id
    }

    /// Whether the node acknowledged the tunnel.
    pub fn acknowledged(&self) -> bool {
        self.inner().deadlines.is_acknowledged()
    }

    /// The client's request id (`x-request-id`).
    pub fn client_request_id(&self) -> &str {
        &self.inner().client_request_id
    }

    /// Whether the provider's `set-cookie` headers reach the client
    /// (`http.relay_set_cookie`).
    pub fn relays_set_cookie(&self) -> bool {
        self.inner().edge.config().http.relay_set_cookie
    }

    /// The next client-relevant frame; `None` after the ending.
    pub async fn next(&mut self) -> Option<TunnelItem> {
        if let Some(item) = self.replay.pop_front() {
            return Some(item);
        }
        self.inner_mut().next().await
    }

    /// The next item if one is ready now, without waiting.
    pub fn next_ready(&mut self) -> Option<TunnelItem> {
        if let Some(item) = self.replay.pop_front() {
            return Some(item);
        }
        self.inner_mut().next_ready()
    }

    /// Puts back `head`, which the dispatcher waited for: [`Self::next`] returns its status
    /// and headers again (and [`Self::head`] the head), for a surface that reads the
    /// tunnel from its start.
    pub fn replay_head(&mut self, head: TunnelHead) {
        self.replay.push_back(TunnelItem::Status(head.status));
        self.replay.push_back(TunnelItem::Headers(head.headers));
    }

    /// Waits for the provider's response head; an error (or an ending before the head)
    /// comes back as the tunnel error.
    pub async fn head(&mut self) -> Result<TunnelHead, pb::TunnelError> {
        let mut status = None;
        loop {
            match self.next().await {
                Some(TunnelItem::Status(s)) => status = Some(s),
                Some(TunnelItem::Headers(headers)) => {
                    return match status {
                        Some(status) => Ok(TunnelHead { status, headers }),
                        None => {
                            self.fail(ErrorCode::BadUpstreamResponse);
                            Err(pb::TunnelError::new(
                                ErrorCode::BadUpstreamResponse,
                                "the provider response came without a status",
                            ))
                        }
                    };
                }
                Some(TunnelItem::Error(e)) => return Err(e),
                Some(TunnelItem::Body(_)) | Some(TunnelItem::End) | None => {
                    self.fail(ErrorCode::BadUpstreamResponse);
                    return Err(pb::TunnelError::new(
                        ErrorCode::BadUpstreamResponse,
                        "the provider response ended before its headers",
                    ));
                }
            }
        }
    }

    /// Makes this tunnel's metrics the client request's.
    pub fn set_meter(&mut self, mut meter: RequestMeter) {
        meter.set_path("tunnel");
        self.inner_mut().meter = Some(meter);
    }

    /// Says why the consumer gives the tunnel up (before dropping it): what the metrics
    /// and the attempt report record instead of `client_abort`.
    pub fn fail(&mut self, code: ErrorCode) {
        let inner = self.inner_mut();
        if inner.failure.is_none() && !inner.ended {
            inner.failure = Some(code);
        }
    }
}

impl TunnelInner {
    async fn next(&mut self) -> Option<TunnelItem> {
        while !self.done {
            let frame = match self.deadlines.recv(&mut self.rx).await {
                Ok(Some(frame)) => frame,
                Ok(None) => {
                    let reason = self
                        .session
                        .close_reason()
                        .unwrap_or_else(|| "the node stopped the stream".into());
                    let error = pb::TunnelError::new(
                        ErrorCode::NodeDisconnected,
                        format!("node {} connection lost: {reason}", self.session.node_id),
                    );
                    self.node_ended(Some(ErrorCode::NodeDisconnected));
                    return Some(TunnelItem::Error(error));
                }
                Err(expired) => {
                    let code = expired.code();
                    let limits = self.deadlines.limits();
                    let message = match expired {
                        super::stream::Expired::Ack => format!(
                            "node {} did not acknowledge the request within {:.1}s",
                            self.session.node_id,
                            limits.ack_timeout.as_secs_f64()
                        ),
                        super::stream::Expired::Idle => format!(
                            "the provider sent nothing for {}s (its idle_timeout_sec)",
                            limits.idle_timeout.as_secs()
                        ),
                    };
                    tracing::warn!(node_id = %self.session.node_id, request_id = %self.request_id, code = code.as_str(), "{message}");
                    self.failure = Some(code);
                    self.done = true;
                    self.conclude(Some(code));
                    self.send_cancel("deadline passed");
                    return Some(TunnelItem::Error(pb::TunnelError::new(code, message)));
                }
            };
            if let Some(item) = self.take(frame) {
                return Some(item);
            }
        }
        None
    }

    /// The next client-relevant frame if one is queued now (never waits, never touches a
    /// timer); `None` also when the route is gone (the next `next` reports that).
    fn next_ready(&mut self) -> Option<TunnelItem> {
        while !self.done {
            match self.rx.try_recv() {
                Ok(Some(frame)) => {
                    if let Some(item) = self.take(frame) {
                        return Some(item);
                    }
                }
                Ok(None) | Err(()) => return None,
            }
        }
        None
    }

    /// Takes one frame from the node: what the consumer gets of it, if anything.
    fn take(&mut self, frame: Frame) -> Option<TunnelItem> {
        match frame {
            Frame::Accepted(_) => self.deadlines.acknowledged(),
            Frame::Status(status) => {
                self.deadlines.acknowledged();
                self.status = Some(status);
                if let Some(recorder) = self.observe.as_ref().and_then(|o| o.recorder.as_ref()) {
                    recorder.provider_status(u16::try_from(status).unwrap_or(u16::MAX));
                }
                return Some(TunnelItem::Status(status));
            }
            Frame::Headers(h) => {
                self.deadlines.began();
                return Some(TunnelItem::Headers(h.headers));
            }
            Frame::Body(bytes) => {
                self.credit.consumed_one(&self.edge, &self.session);
                if let Some(meter) = &mut self.meter {
                    meter.first_token();
                }
                return Some(TunnelItem::Body(bytes));
            }
            Frame::End(_) => {
                let failure = match self.status {
                    Some(status) => ErrorCode::from_provider_status(status as u16),
                    // An ending without a response head is not a response.
                    None => Some(ErrorCode::BadUpstreamResponse),
                };
                self.node_ended(failure);
                return Some(TunnelItem::End);
            }
            Frame::Error(err) => {
                self.node_ended(Some(err.error_code()));
                return Some(TunnelItem::Error(err));
            }
            Frame::Usage(usage) => {
                self.deadlines.acknowledged();
                self.usage = Some(usage);
            }
            Frame::Metadata(mut meta) => {
                self.deadlines.acknowledged();
                tracing::trace!(request_id = %self.request_id, ?meta.entries, "tunnel metadata");
                if let Some(model) = meta.entries.remove("model") {
                    self.served_model = Some(model);
                }
            }
        }
        None
    }

    /// The node's last frame came (or its route is gone): the node's slot is free, so
    /// ours is returned now.
    fn node_ended(&mut self, failure: Option<ErrorCode>) {
        self.ended = true;
        self.done = true;
        self.lease = None;
        self.publish_usage();
        self.conclude(self.failure.or(failure));
    }

    /// Records the outcome once: the request's metrics and the attempt's report.
    fn conclude(&mut self, failure: Option<ErrorCode>) {
        if self.concluded {
            return;
        }
        self.concluded = true;
        if let Some(meter) = &mut self.meter {
            meter.finish(failure);
        }
        if let Some(observe) = &self.observe {
            self.edge.attempt_finished(
                &observe.node_id,
                &observe.provider_id,
                failure,
                self.status,
            );
        }
    }

    fn send_cancel(&mut self, reason: &str) {
        if self.cancel_sent || self.ended {
            return;
        }
        self.cancel_sent = true;
        self.edge.send_control(
            &self.session.outbound,
            pb::CancelRequest::tunnel(&self.request_id, reason).into(),
        );
    }

    /// Publishes the usage the provider reported, once.
    fn publish_usage(&mut self) {
        if let (Some(observe), Some(usage)) = (&self.observe, self.usage.take()) {
            let served = self.served_model.take();
            self.edge.observe_usage(observe, "tunnel", &usage, served);
        }
    }

    /// After a cancel: takes the node's frames until its last one (which comes once the
    /// node freed its slot), up to the ack timeout, then returns the slot.
    async fn drain(mut self) {
        let bound = self.deadlines.limits().ack_timeout;
        let confirmed = tokio::time::timeout(bound, async {
            while let Some(frame) = self.rx.recv().await {
                match frame {
                    Frame::End(_) | Frame::Error(_) => return true,
                    Frame::Usage(usage) => self.usage = Some(usage),
                    Frame::Metadata(mut meta) => {
                        if let Some(model) = meta.entries.remove("model") {
                            self.served_model = Some(model);
                        }
                    }
                    _ => {}
                }
            }
            // The route is gone (connection lost): its leases were returned with it.
            true
        })
        .await
        .unwrap_or(false);
        if !confirmed {
            tracing::warn!(node_id = %self.session.node_id, request_id = %self.request_id, "the node did not confirm the tunnel's cancel within {:.1}s: its slot is returned anyway", bound.as_secs_f64());
            self.session.close_stream(&self.request_id);
        }
        self.ended = true;
        self.lease = None;
        self.publish_usage();
    }
}

impl Drop for TunnelStream {
    fn drop(&mut self) {
        let Some(mut inner) = self.inner.take() else {
            return;
        };
        if inner.ended {
            return;
        }
        // The provider did the work even if the client left before the end frame.
        inner.publish_usage();
        let failure = inner.failure.unwrap_or(ErrorCode::ClientAbort);
        inner.conclude(Some(failure));
        if !inner.cancel_sent {
            match failure {
                ErrorCode::ClientAbort => {
                    tracing::info!(node_id = %inner.session.node_id, tunnel_id = %inner.request_id, request_id = %inner.client_request_id, "client went away: cancelling tunnel")
                }
                other => {
                    tracing::info!(node_id = %inner.session.node_id, tunnel_id = %inner.request_id, request_id = %inner.client_request_id, reason = other.as_str(), "tunnel given up: cancelling it on the node")
                }
            }
        }
        inner.send_cancel(match failure {
            ErrorCode::ClientAbort => "client disconnected",
            other => other.as_str(),
        });
        if inner.lease.is_none() {
            inner.session.close_stream(&inner.request_id);
            return;
        }
        let tasks = inner.edge.tasks().clone();
        tasks.spawn(inner.drain());
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use iop_proto::Outbound;
    use tokio::sync::mpsc;
    use tokio_util::sync::CancellationToken;

    use super::*;
    use crate::config::EdgeConfig;
    use crate::events::{EdgeEvent, UsageEvent};
    use crate::registry::Generation;
    use crate::service::stream::StreamLimits;

    fn edge_and_session() -> (Arc<Edge>, Arc<NodeSession>, mpsc::Receiver<pb::Envelope>) {
        let config = EdgeConfig::from_yaml("nodes: []\nmodel_groups: []\n", "test").unwrap();
        let (outbound, sent) = Outbound::channel(64);
        let session = NodeSession::new(
            "n1".into(),
            Generation(1),
            "peer".into(),
            outbound,
            CancellationToken::new(),
        );
        (Edge::new(config), Arc::new(session), sent)
    }

    fn spec() -> TunnelSpec {
        TunnelSpec {
            adapter: "oa".into(),
            method: "POST".into(),
            path: "/chat/completions".into(),
            headers: vec![],
            body: Bytes::new(),
            ..Default::default()
        }
    }

    fn observe() -> Option<Observe> {
        Some(Observe {
            model_group: "g".into(),
            node_id: "n1".into(),
            provider_id: "oa".into(),
            api_key: None,
            recorder: None,
        })
    }

    fn frame(stream: &TunnelStream, frame: Frame) -> pb::ProviderTunnelFrame {
        pb::ProviderTunnelFrame {
            request_id: stream.request_id().to_string(),
            frame: Some(frame),
        }
    }

    fn usage(output_tokens: u64) -> Frame {
        Frame::Usage(pb::Usage {
            input_tokens: 3,
            output_tokens,
            ..Default::default()
        })
    }

    fn model(name: &str) -> Frame {
        Frame::Metadata(pb::TunnelMetadata {
            entries: [("model".to_string(), name.to_string())].into(),
        })
    }

    /// The usage events published so far.
    fn published(events: &mut tokio::sync::broadcast::Receiver<Arc<EdgeEvent>>) -> Vec<UsageEvent> {
        let mut seen = Vec::new();
        while let Ok(event) = events.try_recv() {
            if let EdgeEvent::Usage(u) = &*event {
                seen.push(u.clone());
            }
        }
        seen
    }

    #[tokio::test]
    async fn usage_is_published_once_at_the_end_with_the_served_model_in_either_order() {
        let (edge, session, _sent) = edge_and_session();
        let mut events = edge.events.subscribe();
        let mut stream = edge
            .start_tunnel(
                session.clone(),
                spec(),
                None,
                observe(),
                StreamLimits::default(),
            )
            .await
            .unwrap();
        // Usage first, then the metadata naming the model: nothing is published before the end.
        for f in [
            Frame::Status(200),
            usage(16),
            model("served-model"),
            Frame::End(pb::TunnelEnd {}),
        ] {
            assert_eq!(
                session.deliver_tunnel_frame(frame(&stream, f)),
                crate::session::Delivery::Delivered
            );
        }
        assert!(matches!(stream.next().await, Some(TunnelItem::Status(200))));
        assert!(published(&mut events).is_empty());
        assert!(matches!(stream.next().await, Some(TunnelItem::End)));
        let seen = published(&mut events);
        assert_eq!(seen.len(), 1, "{seen:?}");
        assert_eq!(seen[0].output_tokens, 16);
        assert_eq!(seen[0].served_model.as_deref(), Some("served-model"));
        assert_eq!((seen[0].path, seen[0].node_id.as_str()), ("tunnel", "n1"));
        drop(stream);
        assert!(published(&mut events).is_empty(), "published twice");
    }

    #[tokio::test]
    async fn usage_that_arrived_is_published_when_the_client_leaves_before_the_end() {
        let (edge, session, mut sent) = edge_and_session();
        let mut events = edge.events.subscribe();
        let mut stream = edge
            .start_tunnel(
                session.clone(),
                spec(),
                None,
                observe(),
                StreamLimits::default(),
            )
            .await
            .unwrap();
        for f in [Frame::Status(200), model("m"), usage(7)] {
            session.deliver_tunnel_frame(frame(&stream, f));
        }
        assert!(matches!(stream.next().await, Some(TunnelItem::Status(200))));
        // The frames after the status are taken in (observations only), then the client goes.
        let pending = tokio::time::timeout(Duration::from_millis(50), stream.next()).await;
        assert!(pending.is_err(), "no client-relevant frame was sent");
        drop(stream);
        let seen = published(&mut events);
        assert_eq!(seen.len(), 1, "{seen:?}");
        assert_eq!(
            (seen[0].output_tokens, seen[0].served_model.as_deref()),
            (7, Some("m"))
        );
        // The node is told to cancel the tunnel.
        let cancel = tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                let envelope = sent.recv().await.expect("outbound open");
                if matches!(
                    envelope.message,
                    Some(pb::envelope::Message::CancelRequest(_))
                ) {
                    return envelope;
                }
            }
        })
        .await;
        assert!(cancel.is_ok(), "no cancel sent to the node");
    }
}
