//! The provider raw tunnel: on a `ProviderTunnelRequest`, make the HTTP request to the
//! adapter's provider — an OpenAI-compatible server, or an Ollama server's native API —
//! and relay its response as ordered frames: status, headers, body chunks as they
//! arrive, then end or error.
//!
//! The body is relayed byte for byte. Usage and the served model are read from it on the
//! side and sent as separate usage / metadata frames before the end, never inside the
//! body. When the edge asked the provider for stream usage the client did not ask for
//! (`usage_injected`), what that added is removed from the relayed event stream
//! ([`crate::usage`]). Cancelling the tunnel drops the provider response, closing its
//! connection.
//!
//! A tunnel that passes its adapter's capacity gate (waiting up to
//! [`crate::instance::SLOT_GRACE`] for a slot) is acknowledged by the provider's answer when
//! that comes within [`crate::runtime::ACCEPT_GRACE`] (the status frame, or an error), else by an
//! `accepted` frame then: a fast provider costs no extra frame per request, a slow one
//! (a non-streaming completion) is acknowledged long before any acknowledgement deadline.
//! A gate still full answers `node_capacity` instead. The gate's
//! slot is freed before the tunnel's last frame (end, or error — `cancelled` when the edge
//! cancelled it) leaves, so the edge, seeing that frame, may hand the slot on.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use bytes::Bytes;
use futures::{FutureExt, StreamExt};
use iop_proto::ErrorCode;
use iop_proto::pb::{self, provider_tunnel_frame::Frame};
use tokio::sync::OwnedSemaphorePermit;

use crate::permit_desk::PermitHook;

use tokio_util::sync::CancellationToken;

use crate::adapters::AdapterError;
use crate::adapters::http::{HeadWait, HttpProvider, RawResponse};
use crate::instance::AdapterInstance;
use crate::journal::{JournalStream, StreamFrame, StreamMeta};
use crate::runtime::{Connection, NodeRuntime};
use crate::usage::{UsageDialect, UsageObserver};

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
    /// The tunnel in the journal: its frames go out on the link it is on now.
    stream: &'a JournalStream,
    request_id: &'a str,
    /// The client's request id, for log lines.
    client_request_id: &'a str,
    /// The response head, held back until the first frame after it is ready so that both
    /// leave in the same write.
    head: Option<(u32, Vec<pb::Header>)>,
    /// The adapter's capacity slot, released just before the tunnel's last frame.
    permit: Option<OwnedSemaphorePermit>,
    /// Counts the tunnel in its edge's permits until then too.
    hook: Option<PermitHook>,
}

impl TunnelOut<'_> {
    /// Sends one frame, after the held-back head if there is one.
    async fn send(&mut self, frame: Frame) -> bool {
        self.flush_head().await && self.frame(frame).await
    }

    async fn frame(&self, frame: Frame) -> bool {
        let data = matches!(frame, Frame::Body(_));
        let last = matches!(frame, Frame::End(_) | Frame::Error(_));
        self.stream
            .send(StreamFrame::Tunnel(frame), data, last)
            .await
    }

    /// Sends the held-back head now.
    async fn flush_head(&mut self) -> bool {
        match self.head.take() {
            Some((status, headers)) => {
                self.frame(Frame::Status(status)).await
                    && self
                        .frame(Frame::Headers(pb::TunnelHeaders { headers }))
                        .await
            }
            None => true,
        }
    }

    /// Ends the tunnel with an error (after freeing the slot).
    async fn error(&mut self, code: ErrorCode, message: String) {
        tracing::warn!(
            tunnel_id = self.request_id,
            request_id = self.client_request_id,
            code = code.as_str(),
            %message,
            "tunnel failed"
        );
        self.permit = None;
        self.hook = None;
        self.send(Frame::Error(pb::TunnelError::new(code, message)))
            .await;
    }

    /// The last frame of a tunnel stopped before its end, once the provider request is
    /// dropped: the acknowledgement of the edge's cancel, or — when the node itself
    /// stopped it (it shuts down, no edge re-attached it in time) — `node_disconnected`
    /// with why.
    async fn cancelled(&mut self) {
        self.permit = None;
        self.hook = None;
        self.head = None;
        let error = match self.stream.stopped() {
            Some(why) => pb::TunnelError::new(ErrorCode::NodeDisconnected, why),
            None => pb::TunnelError::new(ErrorCode::Cancelled, "cancelled by the edge"),
        };
        self.frame(Frame::Error(error)).await;
    }

    /// Ends the tunnel normally (after freeing the slot).
    async fn end(&mut self) {
        self.permit = None;
        self.hook = None;
        self.send(Frame::End(pb::TunnelEnd {})).await;
    }
}

impl NodeRuntime {
    pub fn start_tunnel(self: &Arc<Self>, request: pb::ProviderTunnelRequest, conn: &Connection) {
        let runtime = self.clone();
        // In the journal before this returns, so a resume read after the request finds it.
        let stream = self.journal.begin(
            &request.request_id,
            StreamMeta {
                owner: request.owner.clone(),
                billing: request.billing.clone(),
                provider: request.adapter.clone(),
                tunnel: true,
                resumable: request.stream,
            },
            conn.link_out(),
            request.initial_credit,
        );
        // No span on this hot path: its few log lines carry the request id themselves.
        // Boxed: the tunnel's state (provider exchange, body, observer) is a few KiB that
        // the task would otherwise copy when it is spawned and when it completes.
        let hook = self.permits.arrived(&request.adapter, conn.link);
        conn.tasks.spawn(Box::pin(async move {
            let id = request.request_id.clone();
            let tunnel = AssertUnwindSafe(runtime.clone().tunnel(request, &stream, hook));
            // A panic ends the tunnel with an error frame like any other failure (its
            // capacity slot was freed as it unwound), instead of leaving it open.
            if let Err(panic) = tunnel.catch_unwind().await {
                let message = format!(
                    "the node's tunnel failed unexpectedly (it panicked: {}); this is a bug in iop",
                    crate::runtime::panic_message(&panic)
                );
                tracing::error!(tunnel_id = %id, %message);
                runtime.end_tunnel(&id);
                let error = pb::TunnelError::new(ErrorCode::Internal, message);
                stream
                    .send(StreamFrame::Tunnel(Frame::Error(error)), false, true)
                    .await;
            }
        }));
    }

    async fn tunnel(
        self: Arc<Self>,
        request: pb::ProviderTunnelRequest,
        stream: &JournalStream,
        hook: PermitHook,
    ) {
        let mut out = TunnelOut {
            stream,
            request_id: &request.request_id,
            client_request_id: &request.client_request_id,
            head: None,
            permit: None,
            hook: Some(hook),
        };
        tracing::debug!(
            tunnel_id = %request.request_id,
            request_id = %request.client_request_id,
            adapter = %request.adapter,
            path = %request.path,
            "tunnel request"
        );
        let Some(instance) = self.adapter(&request.adapter) else {
            let message = format!(
                "node {} has no adapter {:?}",
                self.node_id(),
                request.adapter
            );
            return out.error(ErrorCode::UnknownAdapter, message).await;
        };
        let (provider, dialect) = match tunnel_provider(&instance) {
            Ok(target) => target,
            Err(message) => return out.error(ErrorCode::NotSupported, message).await,
        };
        let cancel = stream.cancel.clone();
        self.tunnels
            .lock()
            .insert(request.request_id.clone(), cancel.clone());
        let slot = tokio::select! {
            biased;
            _ = cancel.cancelled() => {
                out.cancelled().await;
                return self.end_tunnel(&request.request_id);
            }
            slot = instance.acquire_slot() => slot,
        };
        let Some(permit) = slot else {
            let refused = instance.at_capacity();
            out.error(refused.code, refused.message).await;
            return self.end_tunnel(&request.request_id);
        };
        out.permit = Some(permit);
        let usage_seen = match self.answer(provider, &request, &cancel, &mut out).await {
            None => {
                tracing::info!(tunnel_id = %request.request_id, request_id = %request.client_request_id, "tunnel cancelled before the provider answered");
                out.cancelled().await;
                None
            }
            Some(Err(err)) => {
                out.error(err.code, err.message).await;
                None
            }
            Some(Ok(response)) => {
                let mut relay = Relay {
                    out: &mut out,
                    cancel: &cancel,
                };
                match relay.answer(response, dialect, &request).await {
                    Relayed::Ended(usage) => usage,
                    Relayed::Broken => None,
                    Relayed::Cancelled => {
                        out.cancelled().await;
                        return self.end_tunnel(&request.request_id);
                    }
                }
            }
        };
        instance.record_usage(usage_seen.as_ref(), true);
        self.end_tunnel(&request.request_id);
    }

    /// Sends the request to the provider and waits for its answer (`None`: cancelled
    /// first), acknowledging the request with an `accepted` frame if the answer takes
    /// longer than the accept grace.
    async fn answer(
        &self,
        provider: &HttpProvider,
        request: &pb::ProviderTunnelRequest,
        cancel: &CancellationToken,
        out: &mut TunnelOut<'_>,
    ) -> Option<Result<RawResponse, AdapterError>> {
        let headers = request
            .headers
            .iter()
            .filter(|h| !DROPPED_REQUEST_HEADERS.contains(&h.name.to_ascii_lowercase().as_str()))
            .map(|h| (h.name.as_str(), h.value.as_slice()));
        let wait = if request.stream {
            HeadWait::Streamed
        } else {
            HeadWait::Whole
        };
        let exchange = provider.exchange(
            &request.method,
            &request.path,
            headers,
            request.body.clone(),
            wait,
        );
        tokio::pin!(exchange);
        let accept_after = tokio::time::sleep(self.accept_grace);
        tokio::pin!(accept_after);
        let mut accepted = false;
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return None,
                r = &mut exchange => return Some(r),
                _ = &mut accept_after, if !accepted => {
                    accepted = true;
                    out.frame(Frame::Accepted(pb::TunnelAccepted {})).await;
                }
            }
        }
    }

    fn end_tunnel(&self, request_id: &str) {
        self.tunnels.lock().remove(request_id);
    }
}

/// The HTTP provider of an adapter and the dialect its usage is read in; or why it takes
/// no tunnel.
fn tunnel_provider(instance: &AdapterInstance) -> Result<(&HttpProvider, UsageDialect), String> {
    match (instance.adapter.tunnel(), instance.adapter.ollama()) {
        (Some(endpoint), _) => Ok((&endpoint.provider, endpoint.dialect)),
        (None, Some(ollama)) => Ok((&ollama.provider, UsageDialect::Ollama)),
        (None, None) => Err(format!(
            "adapter {} (kind {}) has no HTTP API and takes no raw tunnel",
            instance.spec.id,
            instance.kind()
        )),
    }
}

/// How relaying a provider's answer ended.
enum Relayed {
    /// The body ended and its end went out; with the usage the provider reported.
    Ended(Option<pb::Usage>),
    /// The body broke; its error went out.
    Broken,
    /// The edge cancelled it (or the link went) before the end.
    Cancelled,
}

/// Relays one provider answer to the edge, within the tunnel's credit.
struct Relay<'r, 'a> {
    out: &'r mut TunnelOut<'a>,
    cancel: &'r CancellationToken,
}

impl Relay<'_, '_> {
    /// Relays `response`'s head and body; then, after a body that ended, the model and
    /// usage read from it and the end.
    async fn answer(
        &mut self,
        mut response: RawResponse,
        dialect: UsageDialect,
        request: &pb::ProviderTunnelRequest,
    ) -> Relayed {
        let mut observer = UsageObserver::new(response.sse, dialect).for_path(&request.path);
        if request.usage_injected && response.sse && (200..300).contains(&response.status) {
            observer = observer.removing_injected_usage();
            // The body gets shorter than a declared length.
            response
                .headers
                .retain(|h| !h.name.eq_ignore_ascii_case("content-length"));
        }
        let yield_for_more = response.sse && !response.read_in_task;
        let mut body = response.body;
        // The head leaves together with the body bytes that came with it (a JSON answer,
        // an event stream's first events) in one write; when the body is not there yet,
        // the head goes out alone at once. A body read on another task is handed over
        // only once asked, so that one gets a scheduler round.
        let mut early = body.next().now_or_never();
        if early.is_none() && !response.read_in_task {
            iop_proto::yield_once().await;
            early = body.next().now_or_never();
        }
        self.out.head = Some((response.status as u32, response.headers));
        if early.is_none() && !self.out.flush_head().await {
            return Relayed::Cancelled;
        }
        loop {
            let chunk = match early.take() {
                Some(chunk) => chunk,
                None => tokio::select! {
                    _ = self.cancel.cancelled() => {
                        tracing::info!(tunnel_id = %request.request_id, request_id = %request.client_request_id, "tunnel cancelled mid-body: provider connection dropped");
                        return Relayed::Cancelled;
                    }
                    chunk = body.next() => chunk,
                },
            };
            let next = match chunk {
                None => break,
                Some(Err(err)) => Pending::Error(err),
                Some(Ok(bytes)) => {
                    // Chunks the provider already sent are relayed together: one frame
                    // instead of many when it bursts, no wait when it does not.
                    let (bytes, next) = coalesce(bytes, &mut body, yield_for_more).await;
                    let bytes = observer.relay(bytes);
                    // A relay that held everything back still lets the head go.
                    let sent = if bytes.is_empty() {
                        self.out.flush_head().await
                    } else {
                        self.body(bytes).await
                    };
                    if !sent {
                        return Relayed::Cancelled;
                    }
                    next
                }
            };
            match next {
                Pending::Nothing => {}
                Pending::End => break,
                Pending::Error(err) => {
                    self.out.error(ErrorCode::BrokenStream, err.message).await;
                    return Relayed::Broken;
                }
            }
        }
        // What the stripping held back (an unfinished last line) goes out as the provider
        // sent it.
        if !self.body(observer.take_held()).await {
            return Relayed::Cancelled;
        }
        let usage = observer.finish();
        if let Some(model) = observer.model() {
            self.out
                .send(Frame::Metadata(pb::TunnelMetadata {
                    entries: [("model".to_string(), model.to_string())].into(),
                }))
                .await;
        }
        if let Some(usage) = &usage {
            self.out.send(Frame::Usage(*usage)).await;
        }
        self.out.end().await;
        Relayed::Ended(usage)
    }

    /// Sends one provider chunk as body frames of at most [`MAX_BODY_FRAME`] bytes, each
    /// spending one frame of credit.
    async fn body(&mut self, mut bytes: Bytes) -> bool {
        while !bytes.is_empty() {
            let piece = bytes.split_to(bytes.len().min(MAX_BODY_FRAME));
            if !self.out.stream.credit().await || !self.out.send(Frame::Body(piece)).await {
                return false;
            }
        }
        true
    }
}

/// What polling ahead found after the coalesced chunks.
enum Pending {
    Nothing,
    End,
    Error(AdapterError),
}

/// Appends every chunk the provider already sent (up to one frame's worth) to `first`.
///
/// A body read on another task (reqwest's connection tasks) hands over one chunk at a
/// time and decodes the next only once the previous one was taken, so for its event
/// streams (`yield_for_more`), when nothing is ready, this yields to the scheduler once and
/// looks again: what already arrived is then ready.
/// It stops at the first yield that brought nothing, so a provider that is not bursting
/// costs one scheduler round, never a wait. A plain body (one JSON document) does not
/// yield: there is rarely a second chunk.
async fn coalesce<S>(first: Bytes, body: &mut S, yield_for_more: bool) -> (Bytes, Pending)
where
    S: futures::Stream<Item = Result<Bytes, AdapterError>> + Unpin,
{
    let mut merged: Option<bytes::BytesMut> = None;
    let mut len = first.len();
    let mut pending = Pending::Nothing;
    let mut yielded = !yield_for_more;
    while len < MAX_BODY_FRAME {
        let next = match body.next().now_or_never() {
            None if !yielded => {
                yielded = true;
                iop_proto::yield_once().await;
                continue;
            }
            next => next,
        };
        yielded = !yield_for_more;
        match next {
            Some(Some(Ok(more))) => {
                len += more.len();
                merged
                    .get_or_insert_with(|| {
                        // Room for a frame's worth up front: a burst of small events
                        // would otherwise regrow (and copy) the buffer several times.
                        let mut buf = bytes::BytesMut::with_capacity(MAX_BODY_FRAME);
                        buf.extend_from_slice(&first);
                        buf
                    })
                    .extend_from_slice(&more);
            }
            Some(Some(Err(err))) => {
                pending = Pending::Error(err);
                break;
            }
            Some(None) => {
                pending = Pending::End;
                break;
            }
            None => break,
        }
    }
    (merged.map_or(first, |m| m.freeze()), pending)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use iop_proto::pb::envelope::Message;

    /// The mock provider on loopback, answering (non-streamed) `delay` after a request.
    async fn provider(delay: Duration) -> iop_mock::MockServer {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let config = iop_mock::MockConfig {
            tokens: 5,
            token_delay: delay / 5,
            ..Default::default()
        };
        iop_mock::MockServer::serve(listener, config).unwrap()
    }

    /// The frames a tunnel sends, by kind, when the provider answers after `delay` and the
    /// node waits `grace` for that answer.
    async fn frames_of_a_tunnel(delay: Duration, grace: Duration) -> Vec<&'static str> {
        let mut runtime = NodeRuntime::new(None);
        Arc::get_mut(&mut runtime).unwrap().accept_grace = grace;
        let provider = provider(delay).await;
        runtime
            .apply(&pb::NodeConfigPayload {
                node_id: "n".into(),
                providers: vec![pb::ProviderSpec {
                    id: "p".into(),
                    kind: pb::ProviderKind::OpenaiCompat as i32,
                    base_url: provider.openai_base(),
                    max_concurrency: 1,
                    ..Default::default()
                }],
                config_version: 1,
                reattach_wait_ms: 0,
                resume_keep_ms: 0,
            })
            .unwrap();
        let (outbound, mut rx) = iop_proto::Outbound::channel(64);
        let conn = Connection::new(outbound);
        let request = pb::ProviderTunnelRequest {
            request_id: "t1".into(),
            adapter: "p".into(),
            method: "POST".into(),
            path: "/chat/completions".into(),
            body: Bytes::from_static(
                br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
            ),
            ..Default::default()
        };
        let hook = runtime.permits.arrived(&request.adapter, conn.link);
        let stream = runtime
            .journal
            .begin("t1", StreamMeta::default(), conn.link_out(), 0);
        runtime.tunnel(request, &stream, hook).await;
        let mut kinds = Vec::new();
        while let Ok(envelope) = rx.try_recv() {
            if let Some(Message::ProviderTunnelFrame(f)) = envelope.message {
                kinds.push(match f.frame {
                    Some(Frame::Accepted(_)) => "accepted",
                    Some(Frame::Status(_)) => "status",
                    Some(Frame::Headers(_)) => "headers",
                    Some(Frame::Body(_)) => "body",
                    Some(Frame::End(_)) => "end",
                    Some(Frame::Error(_)) => "error",
                    Some(Frame::Usage(_)) => "usage",
                    Some(Frame::Metadata(_)) => "metadata",
                    None => "none",
                });
            }
        }
        kinds
    }

    #[tokio::test]
    async fn a_provider_answering_within_the_grace_acknowledges_the_tunnel_itself() {
        // A grace no loaded machine exceeds on loopback.
        let frames = frames_of_a_tunnel(Duration::ZERO, Duration::from_secs(30)).await;
        assert_eq!(frames.first(), Some(&"status"), "{frames:?}");
        assert!(!frames.contains(&"accepted"), "{frames:?}");
        assert_eq!(frames.last(), Some(&"end"), "{frames:?}");
    }

    #[tokio::test]
    async fn a_slower_provider_gets_the_tunnel_an_accepted_frame_first() {
        let frames = frames_of_a_tunnel(Duration::from_millis(500), Duration::from_millis(1)).await;
        assert_eq!(frames.first(), Some(&"accepted"), "{frames:?}");
        assert_eq!(frames.iter().filter(|f| **f == "accepted").count(), 1);
        assert_eq!(frames.get(1), Some(&"status"), "{frames:?}");
        assert_eq!(frames.last(), Some(&"end"), "{frames:?}");
    }
}
