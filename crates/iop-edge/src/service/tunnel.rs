//! SubmitProviderTunnel: asks a node to make an HTTP request to one of its OpenAI-compatible
//! providers and streams the response back as ordered frames.
//!
//! A [`TunnelStream`] yields status, headers, body chunks and exactly one ending (end or
//! error). Usage and metadata frames are observations: they are consumed here and never
//! reach the body. They may arrive in either order, so the usage is published once the
//! stream ends, with the served model the metadata named. Dropping the stream early
//! cancels the tunnel on the node, which aborts the provider request.
//!
//! A model-group tunnel (one with an [`Observe`]) reports its provider's outcome for
//! passive ejection once it is known: a 5xx status at once, a clean end after a 2xx as a
//! success, an error frame that blames the provider as a failure.

use std::sync::Arc;

use bytes::Bytes;
use iop_proto::pb::{self, provider_tunnel_frame::Frame};

use super::admission::LeaseGuard;
use super::run::SubmitError;
use super::{CreditReturn, Edge, Observe};
use crate::ejection::ProviderOutcome;
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

impl Edge {
    pub(crate) async fn start_tunnel(
        self: &Arc<Self>,
        session: Arc<NodeSession>,
        spec: TunnelSpec,
        lease: Option<LeaseGuard>,
        observe: Option<Observe>,
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
            edge: self.clone(),
            credit: CreditReturn::new(&request_id),
            client_request_id: spec.client_request_id,
            request_id,
            session,
            rx,
            finished: false,
            lease,
            observe,
            usage: None,
            served_model: None,
            status: None,
            outcome_reported: false,
            first_body: false,
        })
    }
}

#[derive(Debug)]
pub struct TunnelStream {
    edge: Arc<Edge>,
    session: Arc<NodeSession>,
    request_id: String,
    /// The client's request id (`x-request-id`), for log lines.
    client_request_id: String,
    rx: StreamReceiver<Frame>,
    credit: CreditReturn,
    finished: bool,
    lease: Option<LeaseGuard>,
    observe: Option<Observe>,
    /// The provider-reported usage, published when the stream ends.
    usage: Option<pb::Usage>,
    /// The metadata's `model`: what the provider said served the request.
    served_model: Option<String>,
    /// The provider's status, once it came.
    status: Option<u32>,
    /// The provider's outcome was reported (at most once per tunnel).
    outcome_reported: bool,
    /// Body bytes came (the first is the request's first token).
    first_body: bool,
}

impl TunnelStream {
    pub fn request_id(&self) -> &str {
        &self.request_id
    }

    pub fn node_id(&self) -> &str {
        &self.session.node_id
    }

    /// The client's request id (`x-request-id`).
    pub fn client_request_id(&self) -> &str {
        &self.client_request_id
    }

    /// Whether the provider's `set-cookie` headers reach the client
    /// (`http.relay_set_cookie`).
    pub fn relays_set_cookie(&self) -> bool {
        self.edge.config().http.relay_set_cookie
    }

    /// The next client-relevant frame; `None` after the ending.
    pub async fn next(&mut self) -> Option<TunnelItem> {
        while !self.finished {
            let Some(frame) = self.rx.recv().await else {
                self.finish(Some("node_disconnected"));
                let reason = self
                    .session
                    .close_reason()
                    .unwrap_or_else(|| "the node stopped the stream".into());
                return Some(TunnelItem::Error(pb::TunnelError {
                    code: "node_disconnected".into(),
                    message: format!("node {} connection lost: {reason}", self.session.node_id),
                }));
            };
            match frame {
                Frame::Status(status) => {
                    self.status = Some(status);
                    if let Some(recorder) = self.recorder() {
                        recorder.provider_status(u16::try_from(status).unwrap_or(u16::MAX));
                    }
                    if status >= 500 {
                        self.report(ProviderOutcome::of_tunnel_end(Some(status)));
                    }
                    return Some(TunnelItem::Status(status));
                }
                Frame::Headers(h) => return Some(TunnelItem::Headers(h.headers)),
                Frame::Body(bytes) => {
                    self.credit.consumed_one(&self.edge, &self.session);
                    if !self.first_body {
                        self.first_body = true;
                        if let Some(recorder) = self.recorder() {
                            recorder.first_token();
                        }
                    }
                    return Some(TunnelItem::Body(bytes));
                }
                Frame::End(_) => {
                    self.finish(None);
                    self.report(ProviderOutcome::of_tunnel_end(self.status));
                    return Some(TunnelItem::End);
                }
                Frame::Error(err) => {
                    self.finish(Some(if err.code.is_empty() {
                        "provider_error"
                    } else {
                        &err.code
                    }));
                    self.report(ProviderOutcome::of_tunnel_error(&err.code, self.status));
                    return Some(TunnelItem::Error(err));
                }
                Frame::Usage(usage) => self.usage = Some(usage),
                Frame::Metadata(mut meta) => {
                    tracing::trace!(request_id = %self.request_id, ?meta.entries, "tunnel metadata");
                    if let Some(model) = meta.entries.remove("model") {
                        self.served_model = Some(model);
                    }
                }
            }
        }
        None
    }

    /// The next item if one is ready now, without waiting.
    pub fn next_ready(&mut self) -> Option<TunnelItem> {
        use futures::FutureExt;
        self.next().now_or_never().flatten()
    }

    /// Reports the provider's outcome for passive ejection, once, for model-group tunnels.
    fn report(&mut self, outcome: ProviderOutcome) {
        if self.outcome_reported {
            return;
        }
        self.outcome_reported = true;
        if let Some(observe) = &self.observe {
            self.edge.report_provider_outcome(
                &observe.node_id,
                &observe.provider_id,
                outcome,
                super::admission::clock(),
            );
        }
    }

    /// The request's record in the usage ledger, for a model-group tunnel.
    fn recorder(&self) -> Option<&crate::ledger::RequestRecorder> {
        self.observe.as_ref()?.recorder.as_ref()
    }

    /// The tunnel ended: cleanly (`None`) or with an error code.
    fn finish(&mut self, error: Option<&str>) {
        self.finished = true;
        self.lease = None;
        self.publish_usage();
        if let Some(recorder) = self.recorder() {
            recorder.stream_ended(error);
        }
    }

    /// Publishes the usage the provider reported, once.
    fn publish_usage(&mut self) {
        if let (Some(observe), Some(usage)) = (&self.observe, self.usage.take()) {
            let served = self.served_model.take();
            self.edge.observe_usage(observe, "tunnel", &usage, served);
        }
    }
}

impl Drop for TunnelStream {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        // The provider did the work even if the client left before the end frame.
        self.publish_usage();
        tracing::info!(node_id = %self.session.node_id, tunnel_id = %self.request_id, request_id = %self.client_request_id, "client went away: cancelling tunnel");
        self.session.close_stream(&self.request_id);
        self.edge.send_control(
            &self.session.outbound,
            pb::CancelRequest::tunnel(&self.request_id, "client disconnected").into(),
        );
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
            .start_tunnel(session.clone(), spec(), None, observe())
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
            .start_tunnel(session.clone(), spec(), None, observe())
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
