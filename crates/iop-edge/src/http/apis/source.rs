//! Where a translated request's answer comes from: a node run, or the raw tunnel's
//! answer to the chat request (a JSON document, an event stream or an error), read as
//! [`AnswerEvent`]s ending in exactly one terminal.
//!
//! The source owns the run or tunnel: dropping it before its end cancels the request on
//! the node and returns the provider slot, as for chat. A tunnelled stream is read to its
//! end even after the answer finished, so that the usage the node reports after the last
//! bytes is recorded.

use std::collections::VecDeque;
use std::pin::Pin;

use axum::http::StatusCode;
use bytes::Bytes;
use eventsource_stream::{EventStreamError, Eventsource};
use futures::{Stream, StreamExt, stream};
use iop_proto::pb;

use super::answer::{self, AnswerEvent};
use super::chat_answer::{self, ChatStream};
use crate::http::error::ApiError;
use crate::service::{RunStream, TunnelItem, TunnelStream};

/// Largest single event of a provider's stream (an event longer than this fails the
/// answer instead of growing the edge's buffer without end).
pub const MAX_EVENT_BYTES: usize = 1024 * 1024;

/// Most bytes of a provider's error body read for its message.
const MAX_ERROR_BODY: usize = 64 * 1024;

/// An answer being read.
pub struct AnswerSource {
    id: String,
    queue: VecDeque<AnswerEvent>,
    from: Origin,
    /// The largest JSON answer read whole.
    max_bytes: usize,
}

enum Origin {
    Run(RunStream),
    /// The tunnel before its head.
    Head(TunnelStream),
    Events {
        events: Pin<Box<dyn Stream<Item = EventResult> + Send>>,
        chat: ChatStream,
        /// The answer's terminal, held until the tunnel ends.
        ending: Option<AnswerEvent>,
    },
    Ended,
}

type EventResult = Result<eventsource_stream::Event, EventStreamError<BodyError>>;

/// Why a tunnel body stopped before its end.
#[derive(Debug)]
enum BodyError {
    Tunnel(pb::TunnelError),
    EventTooLarge,
}

impl std::fmt::Display for BodyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BodyError::Tunnel(e) => write!(f, "{}", e.message),
            BodyError::EventTooLarge => write!(
                f,
                "the provider sent an event longer than {MAX_EVENT_BYTES} bytes"
            ),
        }
    }
}

impl AnswerSource {
    pub fn run(run: RunStream, max_bytes: usize) -> Self {
        Self {
            id: run.run_id().to_string(),
            queue: VecDeque::new(),
            from: Origin::Run(run),
            max_bytes,
        }
    }

    /// The tunnel's answer to a chat request; a JSON answer of more than `max_bytes`
    /// fails.
    pub fn chat(tunnel: TunnelStream, max_bytes: usize) -> Self {
        Self {
            id: tunnel.request_id().to_string(),
            queue: VecDeque::new(),
            from: Origin::Head(tunnel),
            max_bytes,
        }
    }

    /// The run or tunnel id, for the answer's id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The first event (the start, once the node or provider accepted the request), or
    /// the error the answer failed with before that (for an HTTP error status instead of
    /// a stream that fails at once).
    pub async fn first(&mut self) -> Result<AnswerEvent, ApiError> {
        match self.next().await {
            Some(AnswerEvent::Failed(e)) => Err(e),
            Some(e) => Ok(e),
            None => Err(ApiError::upstream(
                "upstream_error",
                "the answer ended without events",
            )),
        }
    }

    /// The next event; `None` after the terminal.
    pub async fn next(&mut self) -> Option<AnswerEvent> {
        loop {
            if let Some(e) = self.queue.pop_front() {
                if e.is_terminal() {
                    self.queue.clear();
                    self.from = Origin::Ended;
                }
                return Some(e);
            }
            match &mut self.from {
                Origin::Ended => return None,
                Origin::Run(run) => match run.next().await {
                    Some(event) => self.queue.extend(answer::from_run(event)),
                    None => {
                        self.from = Origin::Ended;
                        return None;
                    }
                },
                Origin::Head(_) => self.read_head().await,
                Origin::Events {
                    events,
                    chat,
                    ending,
                } => {
                    let mut out = Vec::new();
                    match events.next().await {
                        Some(Ok(event)) => {
                            if ending.is_none() {
                                chat.data(&event.data, &mut out);
                            }
                        }
                        Some(Err(e)) => {
                            let error = match e {
                                EventStreamError::Transport(BodyError::Tunnel(e)) => {
                                    ApiError::upstream(&e.code, &e.message)
                                }
                                other => {
                                    ApiError::upstream("provider_stream_error", &other.to_string())
                                }
                            };
                            out.push(AnswerEvent::Failed(error));
                        }
                        None => {
                            if ending.is_none() {
                                chat.end(&mut out);
                            }
                            out.extend(ending.take());
                            self.queue.extend(out);
                            continue;
                        }
                    }
                    for e in out {
                        match e {
                            // A failure ends the answer now (dropping the tunnel cancels it).
                            AnswerEvent::Failed(_) => {
                                self.queue.push_back(e);
                                break;
                            }
                            // The finish waits for the tunnel's end (and its usage).
                            AnswerEvent::Finished(_) => *ending = Some(e),
                            other => self.queue.push_back(other),
                        }
                    }
                }
            }
        }
    }

    /// Reads the tunnel's head, and then the whole body if it is not an event stream.
    async fn read_head(&mut self) {
        let Origin::Head(mut tunnel) = std::mem::replace(&mut self.from, Origin::Ended) else {
            return;
        };
        let mut status = None;
        let headers = loop {
            match tunnel.next().await {
                Some(TunnelItem::Status(s)) => status = Some(s),
                Some(TunnelItem::Headers(h)) => break h,
                Some(TunnelItem::Error(e)) => {
                    return self.fail(ApiError::upstream(&e.code, &e.message));
                }
                Some(TunnelItem::Body(_) | TunnelItem::End) | None => {
                    return self.fail(ApiError::upstream(
                        "upstream_error",
                        "the provider response ended before its headers",
                    ));
                }
            }
        };
        let status = status.unwrap_or(0);
        if !(200..300).contains(&status) {
            let body = read_body(&mut tunnel, MAX_ERROR_BODY).await;
            let body = body.as_deref().unwrap_or_default();
            return self.fail(chat_answer::provider_error(status as u16, body));
        }
        let is_sse = headers.iter().any(|h| {
            h.name.eq_ignore_ascii_case("content-type")
                && h.value
                    .to_ascii_lowercase()
                    .starts_with(b"text/event-stream")
        });
        self.queue.push_back(AnswerEvent::Started);
        if is_sse {
            self.from = Origin::Events {
                events: Box::pin(bounded_body(tunnel).eventsource()),
                chat: ChatStream::default(),
                ending: None,
            };
            return;
        }
        match read_body(&mut tunnel, self.max_bytes).await {
            Ok(body) => match serde_json::from_slice(&body) {
                Ok(value) => self.queue.extend(chat_answer::completion(&value)),
                Err(e) => self.fail(ApiError::upstream(
                    "bad_upstream_response",
                    &format!("the provider's chat answer is not JSON: {e}"),
                )),
            },
            Err(e) => self.fail(e),
        }
    }

    fn fail(&mut self, error: ApiError) {
        self.queue.push_back(AnswerEvent::Failed(error));
    }
}

/// The rest of a tunnel's body, at most `max` bytes (more is an error).
async fn read_body(tunnel: &mut TunnelStream, max: usize) -> Result<Vec<u8>, ApiError> {
    let mut body = Vec::new();
    loop {
        match tunnel.next().await {
            Some(TunnelItem::Body(bytes)) => {
                if body.len() + bytes.len() > max {
                    return Err(ApiError::new(
                        StatusCode::BAD_GATEWAY,
                        "upstream_error",
                        "response_too_large",
                        format!(
                            "the provider's answer is larger than this edge's limit of {max} bytes \
                             for a non-streamed response (limits.http.max_response_bytes); ask \
                             for fewer tokens or set \"stream\": true"
                        ),
                    ));
                }
                body.extend_from_slice(&bytes);
            }
            Some(TunnelItem::End) | None => return Ok(body),
            Some(TunnelItem::Error(e)) => return Err(ApiError::upstream(&e.code, &e.message)),
            Some(_) => {}
        }
    }
}

/// A tunnel's body bytes until its end, failing on a tunnel error or on an event longer
/// than [`MAX_EVENT_BYTES`] (counted from the last empty line).
fn bounded_body(tunnel: TunnelStream) -> impl Stream<Item = Result<Bytes, BodyError>> + Send {
    stream::unfold(
        (Some(tunnel), EventLength::default()),
        |(tunnel, mut length)| async move {
            let mut tunnel = tunnel?;
            loop {
                match tunnel.next().await {
                    Some(TunnelItem::Body(bytes)) => {
                        if !length.push(&bytes) {
                            return Some((Err(BodyError::EventTooLarge), (None, length)));
                        }
                        return Some((Ok(bytes), (Some(tunnel), length)));
                    }
                    Some(TunnelItem::Error(e)) => {
                        return Some((Err(BodyError::Tunnel(e)), (None, length)));
                    }
                    Some(TunnelItem::End) | None => return None,
                    Some(_) => {}
                }
            }
        },
    )
}

/// The length of the event being received: bytes since the last empty line.
#[derive(Debug, Default)]
struct EventLength {
    event: usize,
    /// Bytes of the current line so far (a lone CR does not count).
    line: usize,
}

impl EventLength {
    /// Takes the next bytes; false once an event is longer than [`MAX_EVENT_BYTES`].
    fn push(&mut self, bytes: &[u8]) -> bool {
        let mut from = 0;
        for at in memchr::memchr_iter(b'\n', bytes) {
            let line = &bytes[from..at];
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            self.line += line.len();
            if self.line == 0 {
                self.event = 0;
            } else {
                self.event += self.line + 1;
            }
            self.line = 0;
            from = at + 1;
        }
        let rest = &bytes[from..];
        self.line += rest.iter().filter(|b| **b != b'\r').count();
        self.event + self.line <= MAX_EVENT_BYTES
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use iop_proto::Outbound;
    use iop_proto::pb::provider_tunnel_frame::Frame;
    use tokio_util::sync::CancellationToken;

    use super::*;
    use crate::config::EdgeConfig;
    use crate::registry::Generation;
    use crate::service::{Edge, TunnelSpec};
    use crate::session::NodeSession;

    /// A tunnel whose frames the test delivers, and a way to deliver them.
    async fn open_tunnel() -> (
        TunnelStream,
        impl Fn(Frame),
        tokio::sync::mpsc::Receiver<pb::Envelope>,
    ) {
        let config = EdgeConfig::from_yaml("nodes: []\nmodel_groups: []\n", "test").unwrap();
        let (outbound, sent) = Outbound::channel(64);
        let session = Arc::new(NodeSession::new(
            "n1".into(),
            Generation(1),
            "peer".into(),
            outbound,
            CancellationToken::new(),
        ));
        let spec = TunnelSpec {
            adapter: "oa".into(),
            method: "POST".into(),
            path: "/chat/completions".into(),
            headers: vec![],
            body: Bytes::new(),
            usage_injected: false,
            ..Default::default()
        };
        let stream = Edge::new(config)
            .start_tunnel(
                session.clone(),
                spec,
                None,
                None,
                crate::service::stream::StreamLimits {
                    ack_timeout: std::time::Duration::from_secs(5),
                    idle_timeout: std::time::Duration::from_secs(30),
                },
            )
            .await
            .unwrap();
        let id = stream.request_id().to_string();
        let deliver = move |frame: Frame| {
            session.deliver_tunnel_frame(pb::ProviderTunnelFrame {
                request_id: id.clone(),
                frame: Some(frame),
            });
        };
        (stream, deliver, sent)
    }

    fn head(deliver: &impl Fn(Frame), status: u32, content_type: &str) {
        deliver(Frame::Status(status));
        deliver(Frame::Headers(pb::TunnelHeaders {
            headers: vec![pb::Header {
                name: "content-type".into(),
                value: content_type.as_bytes().to_vec(),
            }],
        }));
    }

    async fn all(source: &mut AnswerSource) -> Vec<AnswerEvent> {
        let mut out = Vec::new();
        while let Some(e) = source.next().await {
            out.push(e);
        }
        out
    }

    #[tokio::test]
    async fn a_chat_stream_split_anywhere_becomes_answer_events_ending_at_the_tunnel_end() {
        let stream = concat!(
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n",
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hel\"}}]}\r\n\r\n",
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"lo\"}}]}\n\n",
            "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":2,\"completion_tokens\":3}}\n\n",
            "data: [DONE]\n\n",
        );
        // (At most a credit window of frames: a node never sends more unread.)
        for size in [3, 7, 64, stream.len()] {
            let (tunnel, deliver, _sent) = open_tunnel().await;
            head(&deliver, 200, "text/event-stream; charset=utf-8");
            for piece in stream.as_bytes().chunks(size) {
                deliver(Frame::Body(Bytes::copy_from_slice(piece)));
            }
            deliver(Frame::End(pb::TunnelEnd {}));
            let mut source = AnswerSource::chat(tunnel, 1024);
            let events = all(&mut source).await;
            let text: String = events
                .iter()
                .filter_map(|e| match e {
                    AnswerEvent::Text(t) => Some(t.as_str()),
                    _ => None,
                })
                .collect();
            assert_eq!(text, "Hello", "split by {size}");
            assert!(matches!(events[0], AnswerEvent::Started));
            match events.last().unwrap() {
                AnswerEvent::Finished(f) => assert_eq!(f.usage.unwrap().output_tokens, 3),
                other => panic!("split by {size}: {other:?}"),
            }
        }
    }

    #[tokio::test]
    async fn the_finish_waits_for_the_tunnel_end() {
        let (tunnel, deliver, _sent) = open_tunnel().await;
        head(&deliver, 200, "text/event-stream");
        deliver(Frame::Body(Bytes::from_static(
            b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\"},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n",
        )));
        let mut source = AnswerSource::chat(tunnel, 1024);
        assert!(matches!(source.next().await, Some(AnswerEvent::Started)));
        assert!(matches!(source.next().await, Some(AnswerEvent::Text(_))));
        let pending =
            tokio::time::timeout(std::time::Duration::from_millis(50), source.next()).await;
        assert!(pending.is_err(), "the finish came before the tunnel ended");
        deliver(Frame::End(pb::TunnelEnd {}));
        assert!(matches!(
            source.next().await,
            Some(AnswerEvent::Finished(_))
        ));
        assert!(source.next().await.is_none());
    }

    #[tokio::test]
    async fn provider_errors_tunnel_errors_and_oversized_answers_fail() {
        // A provider's error answer keeps its status and message.
        let (tunnel, deliver, _sent) = open_tunnel().await;
        head(&deliver, 400, "application/json");
        deliver(Frame::Body(Bytes::from_static(
            br#"{"error":{"message":"no tools here","type":"invalid_request_error"}}"#,
        )));
        deliver(Frame::End(pb::TunnelEnd {}));
        let e = AnswerSource::chat(tunnel, 1024).first().await.unwrap_err();
        assert_eq!(
            (e.status.as_u16(), e.message.as_str()),
            (400, "no tools here")
        );

        // A JSON answer over the limit.
        let (tunnel, deliver, _sent) = open_tunnel().await;
        head(&deliver, 200, "application/json");
        deliver(Frame::Body(Bytes::from(vec![b' '; 2048])));
        deliver(Frame::End(pb::TunnelEnd {}));
        let events = all(&mut AnswerSource::chat(tunnel, 1024)).await;
        assert!(
            matches!(events.last(), Some(AnswerEvent::Failed(e)) if e.code == "response_too_large"),
            "{events:?}"
        );

        // The tunnel failing mid-stream.
        let (tunnel, deliver, _sent) = open_tunnel().await;
        head(&deliver, 200, "text/event-stream");
        deliver(Frame::Body(Bytes::from_static(
            b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\"}}]}\n\n",
        )));
        deliver(Frame::Error(pb::TunnelError::new(
            iop_proto::ErrorCode::BrokenStream,
            "connection reset",
        )));
        let events = all(&mut AnswerSource::chat(tunnel, 1024)).await;
        assert!(
            matches!(events.last(), Some(AnswerEvent::Failed(e)) if e.message == "connection reset"),
            "{events:?}"
        );

        // One event longer than the limit, with no end in sight.
        let (tunnel, deliver, mut sent) = open_tunnel().await;
        head(&deliver, 200, "text/event-stream");
        let chunk = Bytes::from(vec![b'a'; 64 * 1024]);
        deliver(Frame::Body(Bytes::from_static(b"data: ")));
        for _ in 0..(MAX_EVENT_BYTES / chunk.len() + 1) {
            deliver(Frame::Body(chunk.clone()));
        }
        let mut source = AnswerSource::chat(tunnel, 1024);
        let events = all(&mut source).await;
        assert!(
            matches!(events.last(), Some(AnswerEvent::Failed(e)) if e.message.contains("longer than")),
            "{events:?}"
        );
        drop(source);
        // Dropping the unfinished tunnel cancels it on the node.
        let cancelled = tokio::time::timeout(std::time::Duration::from_secs(5), async {
            while let Some(envelope) = sent.recv().await {
                if matches!(
                    envelope.message,
                    Some(pb::envelope::Message::CancelRequest(_))
                ) {
                    return true;
                }
            }
            false
        })
        .await;
        assert_eq!(cancelled, Ok(true));
    }

    #[test]
    fn event_length_resets_at_empty_lines_across_chunks() {
        let mut l = EventLength::default();
        assert!(l.push(b"data: abc\n"));
        assert_eq!(l.event, 10);
        assert!(l.push(b"\n"));
        assert_eq!(l.event, 0);
        assert!(l.push(b"data: x\r\n\r"));
        assert!(l.push(b"\n"));
        assert_eq!((l.event, l.line), (0, 0));
        let big = vec![b'a'; MAX_EVENT_BYTES / 2];
        assert!(l.push(&big));
        assert!(l.push(b"\n"));
        assert!(!l.push(&big), "one event over the limit");
        let mut l = EventLength::default();
        for _ in 0..10 {
            assert!(l.push(&big));
            assert!(l.push(b"\n\n"));
        }
    }
}
