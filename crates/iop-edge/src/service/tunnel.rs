//! SubmitProviderTunnel: asks a node to make an HTTP request to one of its providers and
//! streams the response back as ordered frames.
//!
//! A [`TunnelStream`] yields status, headers, body chunks and exactly one ending (end or
//! error). The node's `accepted` frame, usage and metadata are consumed here and never
//! reach the body; usage and metadata may arrive in either order, so the usage is handed
//! to the request's record once the stream ends, with the served model the metadata
//! named. An event stream's events are counted as they pass (what the request relayed,
//! should the provider report no usage).
//!
//! Deadlines: the node must acknowledge the tunnel within the dispatch's ack timeout, and
//! once the response head arrived the provider may stay silent only up to its idle
//! timeout; either ends the stream with one error and cancels the tunnel on the node.
//!
//! A stream dropped (or timed out) before the node's last frame cancels the tunnel on the
//! node, which aborts the provider request, and keeps its provider slot until the node
//! confirms ([`super::stream::StreamCore`]): a waiter given the slot never finds the node's gate still
//! full. A model-group tunnel reports its provider's outcome for passive ejection once it
//! ends: a clean end after a 2xx as a success, a 5xx status or an error that blames the
//! provider as a failure.

use std::sync::Arc;

use bytes::Bytes;
use iop_proto::ErrorCode;
use iop_proto::pb::{self, provider_tunnel_frame::Frame};

use super::Edge;
use super::errors::SubmitError;
use super::stream::{Live, StreamItem, StreamKind, StreamTerms};
use crate::codec::TunnelSpec;
use crate::session::{NodeSession, STREAM_WINDOW, SessionClosed, StreamReceiver};

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

impl TunnelHead {
    /// The provider's `Retry-After`, in seconds (a number of seconds; an HTTP date is not
    /// read).
    pub fn retry_after(&self) -> Option<u64> {
        self.headers
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case("retry-after"))
            .and_then(|h| std::str::from_utf8(&h.value).ok()?.trim().parse().ok())
    }

    fn is_event_stream(&self) -> bool {
        self.headers.iter().any(|h| {
            h.name.eq_ignore_ascii_case("content-type")
                && h.value
                    .to_ascii_lowercase()
                    .starts_with(crate::codec::EVENT_STREAM.as_bytes())
        })
    }
}

impl StreamItem for Frame {
    const KIND: StreamKind = StreamKind::Tunnel;

    fn open(session: &NodeSession, id: &str) -> Result<StreamReceiver<Self>, SessionClosed> {
        session.open_tunnel(id)
    }

    fn is_last(&self) -> bool {
        matches!(self, Frame::End(_) | Frame::Error(_))
    }

    fn is_data(&self) -> bool {
        matches!(self, Frame::Body(_))
    }

    fn observation(&mut self) -> (Option<pb::Usage>, Option<String>) {
        match self {
            Frame::Usage(usage) => (Some(*usage), None),
            Frame::Metadata(meta) => (None, meta.entries.remove("model")),
            _ => (None, None),
        }
    }
}

impl Edge {
    /// Sends a tunnel request on `session`. The terms' lease, if any, is held until the
    /// tunnel's last frame.
    pub(crate) async fn start_tunnel(
        self: &Arc<Self>,
        session: Arc<NodeSession>,
        spec: TunnelSpec,
        terms: StreamTerms,
    ) -> Result<TunnelStream, SubmitError> {
        let client_request_id = spec.client_request_id.clone();
        let core = self
            .open_stream(session, client_request_id, terms, |request_id| {
                pb::ProviderTunnelRequest {
                    request_id,
                    adapter: spec.adapter,
                    method: spec.method,
                    path: spec.path,
                    headers: spec.headers,
                    body: spec.body,
                    initial_credit: STREAM_WINDOW,
                    usage_injected: spec.usage_injected,
                    client_request_id: spec.client_request_id,
                    stream: spec.stream,
                    owner: spec.owner,
                    billing: spec.billing,
                }
            })
            .await?;
        Ok(TunnelStream {
            replay: Default::default(),
            events: None,
            core,
        })
    }
}

/// What a client's resume asks of an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResumeMode {
    /// The answer, whole, and then the rest: it goes on here.
    Take,
    /// What the node has of it now, then an end; it stays where it is.
    Peek,
    /// Stop it (the client cancels it); an end at once.
    Stop,
}

impl Edge {
    /// Asks the node on `session` for answer `origin` again, whole, under a new id: a
    /// client resumes it (it may have begun on another edge), only looks at it (the node
    /// sends what it has, then an end, and the answer stays where it is), or stops it. The node answers like any
    /// tunnel, from its first frame; one it does not keep, or that `owner` did not ask
    /// for, ends with an error at once.
    pub(crate) async fn resume_tunnel(
        self: &Arc<Self>,
        session: Arc<NodeSession>,
        origin: &str,
        owner: String,
        client_request_id: String,
        terms: StreamTerms,
        mode: ResumeMode,
    ) -> Result<TunnelStream, SubmitError> {
        let core = self
            .open_stream(session, client_request_id, terms, |stream_id| {
                pb::StreamResume {
                    stream_id,
                    tunnel: true,
                    origin: origin.to_string(),
                    owner,
                    peek: mode == ResumeMode::Peek,
                    stop: mode == ResumeMode::Stop,
                    ..Default::default()
                }
            })
            .await?;
        Ok(TunnelStream {
            replay: Default::default(),
            events: None,
            core,
        })
    }
}

#[derive(Debug)]
pub struct TunnelStream {
    pub core: Live<Frame>,
    /// The head the dispatcher already read, returned again first.
    replay: std::collections::VecDeque<TunnelItem>,
    /// Counts an event stream's events as they pass.
    events: Option<EventCounter>,
}

impl TunnelStream {
    /// Whether the provider's `set-cookie` headers reach the client
    /// (`http.relay_set_cookie`).
    pub fn relays_set_cookie(&self) -> bool {
        self.core.edge.config().http.relay_set_cookie
    }

    /// Makes this tunnel's outcome and usage the client request's.
    pub fn serve(&mut self, recorder: crate::ledger::RequestRecorder) {
        if let Some(status) = self.core.status {
            recorder.provider_status(u16::try_from(status).unwrap_or(u16::MAX));
        }
        self.core.serve(recorder);
    }

    /// The next client-relevant frame; `None` after the ending.
    pub async fn next(&mut self) -> Option<TunnelItem> {
        loop {
            if let Some(item) = self.next_ready() {
                return Some(item);
            }
            let core = self.core.get_mut()?;
            if core.done {
                return None;
            }
            let frame = match core.recv().await {
                Ok(Some(frame)) => frame,
                Ok(None) => {
                    let error = pb::TunnelError::new(ErrorCode::NodeDisconnected, core.lost());
                    core.node_ended(Some(ErrorCode::NodeDisconnected));
                    return Some(TunnelItem::Error(error));
                }
                Err(expired) => {
                    let (code, message) = core.expire(expired);
                    return Some(TunnelItem::Error(pb::TunnelError::new(code, message)));
                }
            };
            if let Some(item) = self.take(frame) {
                return Some(item);
            }
        }
    }

    /// The next item if one is ready now, without waiting (never touches a timer); `None`
    /// also when the route is gone (the next `next` reports that).
    pub fn next_ready(&mut self) -> Option<TunnelItem> {
        if let Some(item) = self.replay.pop_front() {
            return Some(item);
        }
        loop {
            let core = self.core.get_mut()?;
            if core.done {
                return None;
            }
            match core.rx.try_recv() {
                Ok(Some(frame)) => {
                    if let Some(item) = self.take(frame) {
                        return Some(item);
                    }
                }
                Ok(None) | Err(()) => return None,
            }
        }
    }

    /// Puts back `head`, which the dispatcher waited for: [`Self::next`] returns its status
    /// and headers again (and [`Self::head`] the head), for a consumer that reads the
    /// tunnel from its start.
    pub fn replay_head(&mut self, head: TunnelHead) {
        self.replay.push_back(TunnelItem::Status(head.status));
        self.replay.push_back(TunnelItem::Headers(head.headers));
    }

    /// Waits for the provider's response head; an error (or an ending before the head)
    /// comes back as the tunnel error.
    pub async fn head(&mut self) -> Result<TunnelHead, pb::TunnelError> {
        let mut status = None;
        let missing = loop {
            match self.next().await {
                Some(TunnelItem::Status(s)) => status = Some(s),
                Some(TunnelItem::Headers(headers)) => match status {
                    Some(status) => return Ok(TunnelHead { status, headers }),
                    None => break "the provider response came without a status",
                },
                Some(TunnelItem::Error(e)) => return Err(e),
                Some(TunnelItem::Body(_) | TunnelItem::End) | None => {
                    break "the provider response ended before its headers";
                }
            }
        };
        self.fail(ErrorCode::BadUpstreamResponse);
        Err(pb::TunnelError::new(
            ErrorCode::BadUpstreamResponse,
            missing,
        ))
    }

    /// Says why the consumer gives the tunnel up (before dropping it): what the request's
    /// record and the attempt report record instead of `client_abort`.
    pub fn fail(&mut self, code: ErrorCode) {
        let core = &mut self.core;
        if core.failure.is_none() && !core.ended {
            core.failure = Some(code);
        }
    }

    /// Takes one frame from the node: what the consumer gets of it, if anything.
    fn take(&mut self, mut frame: Frame) -> Option<TunnelItem> {
        let core = &mut self.core;
        match frame {
            Frame::Accepted(_) => core.deadlines.acknowledged(),
            Frame::Status(status) => {
                core.deadlines.acknowledged();
                core.status = Some(status);
                if let Some(recorder) = &core.reports.recorder {
                    recorder.provider_status(u16::try_from(status).unwrap_or(u16::MAX));
                }
                return Some(TunnelItem::Status(status));
            }
            Frame::Headers(h) => {
                core.deadlines.began();
                let head = TunnelHead {
                    status: core.status.unwrap_or(0),
                    headers: h.headers,
                };
                if head.is_event_stream() {
                    self.events = Some(EventCounter::default());
                }
                return Some(TunnelItem::Headers(head.headers));
            }
            Frame::Body(bytes) => {
                let events = self.events.as_mut().map_or(0, |c| c.push(&bytes));
                core.data(events);
                return Some(TunnelItem::Body(bytes));
            }
            Frame::End(_) => {
                let failure = match core.status {
                    Some(status) => ErrorCode::from_provider_status(status as u16),
                    // An ending without a response head is not a response.
                    None => Some(ErrorCode::BadUpstreamResponse),
                };
                core.node_ended(failure);
                return Some(TunnelItem::End);
            }
            Frame::Error(err) => {
                core.node_ended(Some(err.error_code()));
                return Some(TunnelItem::Error(err));
            }
            Frame::Usage(_) | Frame::Metadata(_) => {
                core.deadlines.acknowledged();
                let (usage, model) = frame.observation();
                core.observe(usage, model);
            }
        }
        None
    }
}

impl Drop for TunnelStream {
    fn drop(&mut self) {
        if let Some(core) = self.core.take() {
            core.abandon();
        }
    }
}

/// Counts the events of an event stream as its bytes pass: an event ends at an empty
/// line (`\n` or `\r\n`), wherever the bytes were split.
#[derive(Debug, Default)]
struct EventCounter {
    /// Bytes of the current line so far.
    line: usize,
    /// The bytes so far ended with a CR (which belongs to a CRLF if an LF follows).
    trailing_cr: bool,
    /// The current event has a non-empty line.
    in_event: bool,
}

impl EventCounter {
    /// Takes the next bytes; returns how many events they ended.
    fn push(&mut self, bytes: &[u8]) -> u64 {
        let mut ended = 0;
        let mut from = 0;
        for at in memchr::memchr_iter(b'\n', bytes) {
            let cr = if at > from {
                bytes[at - 1] == b'\r'
            } else {
                self.trailing_cr
            };
            let line = self.line + (at - from) - usize::from(cr);
            if line == 0 {
                if self.in_event {
                    ended += 1;
                    self.in_event = false;
                }
            } else {
                self.in_event = true;
            }
            self.line = 0;
            self.trailing_cr = false;
            from = at + 1;
        }
        let rest = &bytes[from..];
        if !rest.is_empty() {
            self.line += rest.len();
            self.trailing_cr = rest.last() == Some(&b'\r');
        }
        ended
    }
}

#[cfg(test)]
mod tests;
