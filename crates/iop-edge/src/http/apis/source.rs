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
    from: From,
    /// The largest JSON answer read whole.
    max_bytes: usize,
}

enum From {
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
            from: From::Run(run),
            max_bytes,
        }
    }

    /// The tunnel's answer to a chat request; a JSON answer of more than `max_bytes`
    /// fails.
    pub fn chat(tunnel: TunnelStream, max_bytes: usize) -> Self {
        Self {
            id: tunnel.request_id().to_string(),
            queue: VecDeque::new(),
            from: From::Head(tunnel),
            max_bytes,
        }
    }

    /// The run or tunnel id, for the answer's id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The first event, or the error the answer failed with before any output (for an
    /// HTTP error status instead of a stream that fails at once).
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
                    self.from = From::Ended;
                }
                return Some(e);
            }
            match &mut self.from {
                From::Ended => return None,
                From::Run(run) => match run.next().await {
                    Some(event) => self.queue.extend(answer::from_run(event)),
                    None => {
                        self.from = From::Ended;
                        return None;
                    }
                },
                From::Head(_) => self.read_head().await,
                From::Events {
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
        let From::Head(mut tunnel) = std::mem::replace(&mut self.from, From::Ended) else {
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
        if is_sse {
            self.from = From::Events {
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
    use super::*;

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
