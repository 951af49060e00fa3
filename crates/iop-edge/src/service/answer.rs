//! Where a rendered answer comes from: a node run, or the raw tunnel's answer to a
//! canonical request (a JSON document, an event stream or an error), read through the
//! provider codecs as canonical [`AnswerEvent`]s ending in exactly one terminal.
//!
//! The source owns the run or tunnel: dropping it before its end cancels the request on
//! the node and returns the provider slot. A tunnelled stream is read to its end even
//! after the answer finished, so that the usage the node reports after the last bytes is
//! recorded and the request ends as the clean end it was.

use std::collections::VecDeque;
use std::pin::Pin;

use bytes::Bytes;
use eventsource_stream::{EventStreamError, Eventsource};
use futures::{Stream, StreamExt, stream};
use iop_proto::{ErrorCode, pb};

use super::run::RunStream;
use super::tunnel::{TunnelItem, TunnelStream};
use crate::canonical::{AnswerEvent, ApiError, Operation};
use crate::codec::openai_answer::{self, StreamReader};
use crate::codec::run::answer_events;

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
    op: Operation,
    /// The largest JSON answer read whole.
    max_bytes: usize,
    /// The request's record, once this answer is the request's.
    recorder: Option<crate::ledger::RequestRecorder>,
}

impl std::fmt::Debug for AnswerSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AnswerSource")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

enum Origin {
    Run(RunStream),
    /// The tunnel before its head.
    Head(TunnelStream),
    Events {
        events: Pin<Box<dyn Stream<Item = EventResult> + Send>>,
        reader: StreamReader,
        /// The answer's terminal, held until the tunnel ends.
        ending: Option<AnswerEvent>,
    },
    Ended,
}

type EventResult = Result<eventsource_stream::Event, EventStreamError<BodyError>>;

/// Why a tunnel body stopped before its end.
#[derive(Debug)]
pub(crate) enum BodyError {
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
    /// A run's events.
    pub fn run(run: RunStream) -> Self {
        Self {
            id: run.core.id.clone(),
            queue: VecDeque::new(),
            from: Origin::Run(run),
            op: Operation::Chat,
            max_bytes: usize::MAX,
            recorder: None,
        }
    }

    /// The tunnel's answer to a canonical `op` request; a JSON answer of more than
    /// `max_bytes` fails.
    pub fn tunnel(tunnel: TunnelStream, op: Operation, max_bytes: usize) -> Self {
        Self {
            id: tunnel.core.id.clone(),
            queue: VecDeque::new(),
            from: Origin::Head(tunnel),
            op,
            max_bytes,
            recorder: None,
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
            None => Err(ApiError::of(
                ErrorCode::ProviderError,
                "the answer ended without events",
            )),
        }
    }

    /// The next event; `None` after the terminal.
    pub async fn next(&mut self) -> Option<AnswerEvent> {
        loop {
            if let Some(e) = self.queue.pop_front() {
                if let AnswerEvent::Failed(error) = &e {
                    // Why it failed is the request's outcome (unless its stream said first).
                    self.fail(error.reason);
                }
                if e.is_terminal() {
                    self.queue.clear();
                    self.from = Origin::Ended;
                }
                return Some(e);
            }
            match &mut self.from {
                Origin::Ended => return None,
                Origin::Run(run) => match run.next().await {
                    Some(event) => self.queue.extend(answer_events(event)),
                    None => {
                        self.from = Origin::Ended;
                        return None;
                    }
                },
                Origin::Head(_) => self.read_head().await,
                Origin::Events {
                    events,
                    reader,
                    ending,
                } => {
                    let next = events.next().await;
                    let out = read_event(next, reader, ending);
                    self.queue.extend(out);
                }
            }
        }
    }

    /// Reads the tunnel's head, and then the whole body if it is not an event stream.
    async fn read_head(&mut self) {
        let Origin::Head(mut tunnel) = std::mem::replace(&mut self.from, Origin::Ended) else {
            return;
        };
        let head = match tunnel.head().await {
            Ok(head) => head,
            Err(e) => return self.failed(ApiError::from_tunnel_error(&e)),
        };
        if !(200..300).contains(&head.status) {
            let body = read_body(&mut tunnel, MAX_ERROR_BODY, false).await;
            let body = body.as_deref().unwrap_or_default();
            return self.failed(openai_answer::provider_error(head.status as u16, body));
        }
        let is_sse = head.headers.iter().any(|h| {
            h.name.eq_ignore_ascii_case("content-type")
                && h.value
                    .to_ascii_lowercase()
                    .starts_with(crate::codec::EVENT_STREAM.as_bytes())
        });
        self.queue.push_back(AnswerEvent::Started);
        if is_sse {
            self.from = Origin::Events {
                events: Box::pin(bounded_body(tunnel).eventsource()),
                reader: StreamReader::default(),
                ending: None,
            };
            return;
        }
        match read_body(&mut tunnel, self.max_bytes, true).await {
            Ok(body) => match serde_json::from_slice(&body) {
                Ok(value) => self.queue.extend(openai_answer::document(&value, self.op)),
                Err(e) => self.failed(ApiError::upstream(
                    "bad_upstream_response",
                    &format!("the provider's answer is not JSON: {e}"),
                )),
            },
            Err(e) => self.failed(e),
        }
    }

    fn failed(&mut self, error: ApiError) {
        self.queue.push_back(AnswerEvent::Failed(error));
    }

    /// Makes the answer's outcome and usage the client request's.
    pub fn serve(&mut self, recorder: crate::ledger::RequestRecorder) {
        match &mut self.from {
            Origin::Run(run) => run.serve(recorder.clone()),
            Origin::Head(tunnel) => tunnel.serve(recorder.clone()),
            Origin::Events { .. } | Origin::Ended => {}
        }
        self.recorder = Some(recorder);
    }

    /// Says why the answer is given up (before it is dropped): what the request's record
    /// keeps instead of `client_abort`.
    pub fn fail(&mut self, code: ErrorCode) {
        match &mut self.from {
            Origin::Run(run) => run.fail(code),
            Origin::Head(tunnel) => tunnel.fail(code),
            Origin::Events { .. } | Origin::Ended => {}
        }
        if let Some(recorder) = &self.recorder {
            recorder.stream_ended(Some(code));
        }
    }

    /// Drops an answer the dispatcher will not relay, recording why.
    pub fn give_up(mut self, code: ErrorCode) {
        self.fail(code);
    }
}

/// The events one event of a provider's stream makes: its answer events (the finish is
/// held in `ending` until the stream ends, for the usage that follows it), a failure, or
/// at the end the held finish.
fn read_event(
    next: Option<EventResult>,
    reader: &mut StreamReader,
    ending: &mut Option<AnswerEvent>,
) -> Vec<AnswerEvent> {
    let mut out = Vec::new();
    match next {
        Some(Ok(event)) => {
            if ending.is_none() {
                reader.data(&event.data, &mut out);
            }
        }
        Some(Err(e)) => {
            let error = match e {
                EventStreamError::Transport(BodyError::Tunnel(e)) => {
                    ApiError::from_tunnel_error(&e)
                }
                other => ApiError::upstream("broken_stream", &other.to_string()),
            };
            return vec![AnswerEvent::Failed(error)];
        }
        None => {
            if ending.is_none() {
                reader.end(&mut out);
            }
            out.extend(ending.take());
            return out;
        }
    }
    let mut kept = Vec::with_capacity(out.len());
    for e in out {
        match e {
            // A failure ends the answer now (dropping the tunnel cancels it).
            AnswerEvent::Failed(_) => {
                kept.push(e);
                break;
            }
            // The finish waits for the tunnel's end (and its usage).
            AnswerEvent::Finished(_) => *ending = Some(e),
            other => kept.push(other),
        }
    }
    kept
}

/// The rest of a tunnel's body, at most `max` bytes: more is an error (`fail_over`), or
/// what came within it (an error body, read only for its message).
async fn read_body(
    tunnel: &mut TunnelStream,
    max: usize,
    fail_over: bool,
) -> Result<Vec<u8>, ApiError> {
    let mut body = Vec::new();
    loop {
        match tunnel.next().await {
            Some(TunnelItem::Body(bytes)) => {
                if body.len() + bytes.len() > max {
                    if !fail_over {
                        body.extend_from_slice(&bytes[..max - body.len()]);
                        return Ok(body);
                    }
                    return Err(too_large(max));
                }
                body.extend_from_slice(&bytes);
            }
            Some(TunnelItem::End) | None => return Ok(body),
            Some(TunnelItem::Error(e)) => return Err(ApiError::from_tunnel_error(&e)),
            Some(_) => {}
        }
    }
}

/// The error of a provider's whole answer larger than the edge reads.
pub fn too_large(max: usize) -> ApiError {
    ApiError::of(
        ErrorCode::ResponseTooLarge,
        format!(
            "the answer is larger than this edge's limit of {max} bytes for an answer it \
             assembles (limits.http.max_response_bytes) and was cancelled; ask for fewer \
             tokens or stream it"
        ),
    )
}

/// A tunnel's body bytes until its end, failing on a tunnel error or on an event longer
/// than [`MAX_EVENT_BYTES`] (counted from the last empty line).
pub(crate) fn bounded_body(
    tunnel: TunnelStream,
) -> impl Stream<Item = Result<Bytes, BodyError>> + Send {
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
mod tests;
