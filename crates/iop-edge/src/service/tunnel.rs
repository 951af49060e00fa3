//! SubmitProviderTunnel: asks a node to make an HTTP request to one of its OpenAI-compatible
//! providers and streams the response back as ordered frames.
//!
//! A [`TunnelStream`] yields status, headers, body chunks and exactly one ending (end or
//! error). Usage and metadata frames are observations: they are consumed here and never
//! reach the body. They may arrive in either order, so the usage is published once the
//! stream ends, with the served model the metadata named. Dropping the stream early
//! cancels the tunnel on the node, which aborts the provider request.

use std::sync::Arc;

use bytes::Bytes;
use iop_proto::pb::{self, provider_tunnel_frame::Frame};
use tokio::sync::mpsc;

use super::admission::LeaseGuard;
use super::run::SubmitError;
use super::{CreditReturn, Edge, Observe};
use crate::session::{NodeSession, STREAM_WINDOW};

/// One HTTP request for a provider, relative to its API root.
#[derive(Debug, Clone)]
pub struct TunnelSpec {
    pub adapter: String,
    pub method: String,
    pub path: String,
    pub headers: Vec<pb::Header>,
    pub body: Bytes,
}

/// What the client-facing side needs of the tunnel's frames.
#[derive(Debug)]
pub enum TunnelItem {
    Status(u16),
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
        };
        if session.outbound.send(request).await.is_err() {
            session.close_stream(&request_id);
            return Err(send_failed("the connection closed".into()));
        }
        Ok(TunnelStream {
            edge: self.clone(),
            credit: CreditReturn::new(&request_id),
            request_id,
            session,
            rx,
            finished: false,
            lease,
            observe,
            usage: None,
            served_model: None,
        })
    }
}

#[derive(Debug)]
pub struct TunnelStream {
    edge: Arc<Edge>,
    session: Arc<NodeSession>,
    request_id: String,
    rx: mpsc::Receiver<Frame>,
    credit: CreditReturn,
    finished: bool,
    lease: Option<LeaseGuard>,
    observe: Option<Observe>,
    /// The provider-reported usage, published when the stream ends.
    usage: Option<pb::Usage>,
    /// The metadata's `model`: what the provider said served the request.
    served_model: Option<String>,
}

impl TunnelStream {
    pub fn request_id(&self) -> &str {
        &self.request_id
    }

    pub fn node_id(&self) -> &str {
        &self.session.node_id
    }

    /// The next client-relevant frame; `None` after the ending.
    pub async fn next(&mut self) -> Option<TunnelItem> {
        while !self.finished {
            let Some(frame) = self.rx.recv().await else {
                self.finish();
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
                Frame::Status(status) => return Some(TunnelItem::Status(status as u16)),
                Frame::Headers(h) => return Some(TunnelItem::Headers(h.headers)),
                Frame::Body(bytes) => {
                    self.credit.consumed_one(&self.edge, &self.session);
                    return Some(TunnelItem::Body(bytes));
                }
                Frame::End(_) => {
                    self.finish();
                    return Some(TunnelItem::End);
                }
                Frame::Error(err) => {
                    self.finish();
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

    fn finish(&mut self) {
        self.finished = true;
        self.lease = None;
        self.publish_usage();
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
        tracing::info!(node_id = %self.session.node_id, request_id = %self.request_id, "client went away: cancelling tunnel");
        self.session.close_stream(&self.request_id);
        self.edge.send_control(
            &self.session.outbound,
            pb::CancelRequest::tunnel(&self.request_id, "client disconnected").into(),
        );
    }
}
