//! The provider raw tunnel: on a `ProviderTunnelRequest`, make the HTTP request to the
//! adapter's OpenAI-compatible provider and relay its response as ordered frames —
//! status, headers, body chunks as they arrive, then end or error.
//!
//! The body is relayed byte for byte. Usage and the served model are read from it on the
//! side and sent as separate usage / metadata frames before the end, never inside the
//! body. Cancelling the tunnel drops the provider response, closing its connection.

use std::sync::Arc;

use bytes::Bytes;
use futures::StreamExt;
use iop_proto::pb::{self, provider_tunnel_frame::Frame};
use tracing::Instrument;

use crate::runtime::{Connection, NodeRuntime};
use crate::usage::UsageObserver;

/// Largest body frame; bigger provider chunks are split.
pub const MAX_BODY_FRAME: usize = 16 * 1024;

/// Request headers that describe the edge→node hop or that the node sets itself.
const DROPPED_REQUEST_HEADERS: &[&str] = &[
    "host",
    "content-length",
    "authorization",
    "connection",
    "keep-alive",
    "transfer-encoding",
    "te",
    "upgrade",
];

struct TunnelOut<'a> {
    conn: &'a Connection,
    request_id: &'a str,
}

impl TunnelOut<'_> {
    async fn send(&self, frame: Frame) -> bool {
        self.conn
            .outbound
            .send(pb::ProviderTunnelFrame {
                request_id: self.request_id.to_string(),
                frame: Some(frame),
            })
            .await
            .is_ok()
    }

    async fn error(&self, code: &str, message: String) {
        tracing::warn!(code, %message, "tunnel failed");
        self.send(Frame::Error(pb::TunnelError {
            code: code.to_string(),
            message,
        }))
        .await;
    }
}

impl NodeRuntime {
    pub fn start_tunnel(self: &Arc<Self>, request: pb::ProviderTunnelRequest, conn: &Connection) {
        let runtime = self.clone();
        let conn2 = conn.clone();
        let span = tracing::info_span!("tunnel", request_id = %request.request_id, adapter = %request.adapter);
        conn.tasks
            .spawn(async move { runtime.tunnel(request, conn2).await }.instrument(span));
    }

    async fn tunnel(self: Arc<Self>, request: pb::ProviderTunnelRequest, conn: Connection) {
        let out = TunnelOut {
            conn: &conn,
            request_id: &request.request_id,
        };
        let Some(instance) = self.adapter(&request.adapter) else {
            out.error(
                "unknown_adapter",
                format!(
                    "node {} has no adapter {:?}",
                    self.node_id(),
                    request.adapter
                ),
            )
            .await;
            return;
        };
        let Some(endpoint) = instance.adapter.tunnel() else {
            out.error(
                "not_supported",
                format!(
                    "adapter {} (kind {}) is not OpenAI-compatible and takes no raw tunnel",
                    instance.spec.id,
                    instance.kind()
                ),
            )
            .await;
            return;
        };
        let Ok(_permit) = instance.gate.clone().try_acquire_owned() else {
            out.error(
                "capacity",
                format!(
                    "adapter {} is at its max concurrency ({})",
                    instance.spec.id,
                    instance.max_concurrency()
                ),
            )
            .await;
            return;
        };
        let cancel = conn.cancel.child_token();
        self.tunnels
            .lock()
            .insert(request.request_id.clone(), cancel.clone());
        let credit = conn
            .credits
            .open(&request.request_id, request.initial_credit);
        let method =
            reqwest::Method::from_bytes(request.method.as_bytes()).unwrap_or(reqwest::Method::POST);
        let mut builder = endpoint.provider.request(method, &request.path);
        for h in &request.headers {
            if !DROPPED_REQUEST_HEADERS.contains(&h.name.to_ascii_lowercase().as_str()) {
                builder = builder.header(h.name.as_str(), h.value.as_slice());
            }
        }
        builder = builder.body(request.body.clone());
        let provider = &endpoint.provider;
        let response = tokio::select! {
            _ = cancel.cancelled() => None,
            r = provider.send(builder) => Some(r),
        };
        let mut usage_seen = None;
        match response {
            None => tracing::info!("tunnel cancelled before the provider answered"),
            Some(Err(err)) => out.error(&err.code, err.message).await,
            Some(Ok(response)) => {
                let status = response.status().as_u16() as u32;
                let headers: Vec<pb::Header> = response
                    .headers()
                    .iter()
                    .map(|(name, value)| pb::Header {
                        name: name.as_str().to_string(),
                        value: value.as_bytes().to_vec(),
                    })
                    .collect();
                let sse = response
                    .headers()
                    .get(reqwest::header::CONTENT_TYPE)
                    .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
                let mut observer = UsageObserver::new(sse, endpoint.dialect);
                if !out.send(Frame::Status(status)).await
                    || !out
                        .send(Frame::Headers(pb::TunnelHeaders { headers }))
                        .await
                {
                    return self.end_tunnel(&request.request_id);
                }
                let mut body = response.bytes_stream();
                let ok = loop {
                    let chunk = tokio::select! {
                        _ = cancel.cancelled() => {
                            tracing::info!("tunnel cancelled mid-body: provider connection dropped");
                            return self.end_tunnel(&request.request_id);
                        }
                        chunk = body.next() => chunk,
                    };
                    match chunk {
                        None => break true,
                        Some(Err(err)) => {
                            let e = provider.transport_error(&err);
                            out.error("provider_stream_error", e.message).await;
                            break false;
                        }
                        Some(Ok(bytes)) => {
                            observer.feed(&bytes);
                            if !send_body(&out, &credit, &cancel, bytes).await {
                                return self.end_tunnel(&request.request_id);
                            }
                        }
                    }
                };
                if ok {
                    usage_seen = observer.finish();
                    if let Some(usage) = &usage_seen {
                        out.send(Frame::Usage(*usage)).await;
                    }
                    if let Some(model) = observer.model() {
                        out.send(Frame::Metadata(pb::TunnelMetadata {
                            entries: [("model".to_string(), model.to_string())].into(),
                        }))
                        .await;
                    }
                    out.send(Frame::End(pb::TunnelEnd {})).await;
                }
            }
        }
        instance.record_usage(usage_seen.as_ref(), true);
        self.end_tunnel(&request.request_id);
    }

    fn end_tunnel(&self, request_id: &str) {
        self.tunnels.lock().remove(request_id);
    }
}

/// Sends one provider chunk as body frames of at most [`MAX_BODY_FRAME`] bytes, each
/// spending one frame of credit.
async fn send_body(
    out: &TunnelOut<'_>,
    credit: &crate::stream::Credit,
    cancel: &tokio_util::sync::CancellationToken,
    mut bytes: Bytes,
) -> bool {
    while !bytes.is_empty() {
        let piece = bytes.split_to(bytes.len().min(MAX_BODY_FRAME));
        if !credit.take(cancel).await || !out.send(Frame::Body(piece)).await {
            return false;
        }
    }
    true
}
