//! An OpenAI-compatible provider's answer read from its tunnel for translation: the
//! response head, a whole body (bounded), an error body as an error with the provider's
//! status and message, and an event stream as answer events (parsed with
//! `eventsource-stream`; one event may hold at most [`MAX_EVENT_BYTES`]).
//!
//! The tunnel travels inside what is returned: dropping it before the end cancels the
//! provider request on the node.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::http::StatusCode;
use bytes::{Bytes, BytesMut};
use eventsource_stream::{EventStreamError, Eventsource};
use futures::stream::{self, BoxStream, StreamExt};
use iop_proto::{ErrorCode, pb};
use serde_json::Value;

use super::answer::{Event, OpenAiChunks};
use crate::http::error::ApiError;
use crate::service::{TunnelItem, TunnelStream};

/// Largest single event (or unfinished line) read from a provider's event stream.
pub const MAX_EVENT_BYTES: usize = 4 * 1024 * 1024;
/// Most bytes of an error body read for its message.
pub const MAX_ERROR_BODY: usize = 64 * 1024;

/// The provider's status and whether its body is an event stream.
#[derive(Debug, Clone, Copy)]
pub struct Head {
    pub status: u16,
    pub sse: bool,
}

impl Head {
    pub fn is_success(&self) -> bool {
        (200..300).contains(&self.status)
    }
}

/// Waits for the response head.
pub async fn head(tunnel: &mut TunnelStream) -> Result<Head, ApiError> {
    let mut status = None;
    loop {
        match tunnel.next().await {
            Some(TunnelItem::Status(s)) => status = Some(s),
            Some(TunnelItem::Headers(headers)) => {
                let status = status
                    .and_then(|s| u16::try_from(s).ok())
                    .filter(|s| (200..=599).contains(s))
                    .ok_or_else(|| {
                        ApiError::upstream(
                            "bad_upstream_response",
                            "the provider answered without a valid final status",
                        )
                    })?;
                let sse = headers.iter().any(|h| {
                    h.name.eq_ignore_ascii_case("content-type")
                        && h.value.starts_with(b"text/event-stream")
                });
                return Ok(Head { status, sse });
            }
            Some(TunnelItem::Error(e)) => return Err(ApiError::upstream(&e.code, &e.message)),
            Some(TunnelItem::Body(_) | TunnelItem::End) | None => {
                return Err(ApiError::upstream(
                    "upstream_error",
                    "the provider response ended before its headers",
                ));
            }
        }
    }
}

/// The rest of the body, at most `max` bytes (a longer one is an error, and the tunnel
/// is cancelled when the caller drops it).
pub async fn body(tunnel: &mut TunnelStream, max: usize) -> Result<Bytes, ApiError> {
    let mut out = BytesMut::new();
    loop {
        match tunnel.next().await {
            Some(TunnelItem::Body(bytes)) => {
                if out.len() + bytes.len() > max {
                    return Err(ApiError::new(
                        StatusCode::BAD_GATEWAY,
                        "upstream_error",
                        "response_too_large",
                        format!(
                            "the provider's answer is larger than this edge's limit of {max} \
                             bytes for a non-streamed response (limits.http.max_response_bytes); \
                             ask for less or stream it"
                        ),
                    ));
                }
                out.extend_from_slice(&bytes);
            }
            Some(TunnelItem::End) | None => return Ok(out.freeze()),
            Some(TunnelItem::Error(e)) => return Err(ApiError::upstream(&e.code, &e.message)),
            Some(TunnelItem::Status(_) | TunnelItem::Headers(_)) => {}
        }
    }
}

/// The start of an error answer's body (at most [`MAX_ERROR_BODY`] bytes; the rest is
/// not waited for), empty if the body broke off.
pub async fn error_body(tunnel: &mut TunnelStream) -> Bytes {
    let mut out = BytesMut::new();
    while out.len() < MAX_ERROR_BODY {
        match tunnel.next().await {
            Some(TunnelItem::Body(bytes)) => {
                let room = MAX_ERROR_BODY - out.len();
                out.extend_from_slice(&bytes[..bytes.len().min(room)]);
            }
            Some(TunnelItem::Status(_) | TunnelItem::Headers(_)) => {}
            Some(TunnelItem::End | TunnelItem::Error(_)) | None => break,
        }
    }
    out.freeze()
}

/// The error for a provider's non-success answer: its status (a 502 for anything that is
/// not an error status) and the message its body gives (OpenAI's `error.message`, an
/// `error` or `message` or `detail` string, or the start of the text).
pub fn provider_error(status: u16, body: &[u8]) -> ApiError {
    let parsed = serde_json::from_slice::<Value>(body).ok();
    let from_json = parsed.as_ref().and_then(|v| {
        [
            v.pointer("/error/message"),
            v.get("error"),
            v.get("message"),
            v.get("detail"),
        ]
        .into_iter()
        .flatten()
        .find_map(|m| m.as_str().map(String::from))
    });
    let message = from_json.unwrap_or_else(|| {
        let text: String = String::from_utf8_lossy(body).chars().take(300).collect();
        if text.trim().is_empty() {
            format!("the provider answered {status}")
        } else {
            text
        }
    });
    let status = StatusCode::from_u16(status)
        .ok()
        .filter(|s| s.is_client_error() || s.is_server_error())
        .unwrap_or(StatusCode::BAD_GATEWAY);
    let kind = if status.is_client_error() {
        "invalid_request_error"
    } else {
        "upstream_error"
    };
    ApiError::new(status, kind, "provider_error", message)
}

/// The items a tunnel has left, as a stream (the tunnel travels inside it).
fn items(tunnel: TunnelStream) -> BoxStream<'static, TunnelItem> {
    stream::unfold(tunnel, |mut tunnel| async move {
        tunnel.next().await.map(|item| (item, tunnel))
    })
    .boxed()
}

/// The body of a tunnel's items as an error-or-bytes stream, failing when more than
/// [`MAX_EVENT_BYTES`] arrive without an event being read.
fn body_stream(
    items: BoxStream<'static, TunnelItem>,
    unread: Arc<AtomicUsize>,
) -> BoxStream<'static, Result<Bytes, pb::TunnelError>> {
    stream::unfold(Some(items), move |items| {
        let unread = unread.clone();
        async move {
            let mut tunnel = items?;
            loop {
                match tunnel.next().await {
                    Some(TunnelItem::Body(bytes)) => {
                        let held = unread.fetch_add(bytes.len(), Ordering::Relaxed) + bytes.len();
                        if held > MAX_EVENT_BYTES {
                            let e = pb::TunnelError::new(
                                ErrorCode::BadUpstreamResponse,
                                format!(
                                    "the provider sent an event larger than {MAX_EVENT_BYTES} bytes"
                                ),
                            );
                            return Some((Err(e), None));
                        }
                        return Some((Ok(bytes), Some(tunnel)));
                    }
                    Some(TunnelItem::Error(e)) => return Some((Err(e), None)),
                    Some(TunnelItem::End) | None => return None,
                    Some(TunnelItem::Status(_) | TunnelItem::Headers(_)) => {}
                }
            }
        }
    })
    .boxed()
}

/// The answer events of a provider's chat or completions event stream.
pub fn sse_events(tunnel: TunnelStream) -> BoxStream<'static, Event> {
    events_of(items(tunnel))
}

/// The answer events of the rest of a tunnel's items (its body an event stream).
fn events_of(items: BoxStream<'static, TunnelItem>) -> BoxStream<'static, Event> {
    let unread = Arc::new(AtomicUsize::new(0));
    let events = body_stream(items, unread.clone()).eventsource();
    struct State<S> {
        events: S,
        chunks: OpenAiChunks,
        queued: std::collections::VecDeque<Event>,
        unread: Arc<AtomicUsize>,
        failed: bool,
    }
    let state = State {
        events,
        chunks: OpenAiChunks::default(),
        queued: Default::default(),
        unread,
        failed: false,
    };
    stream::unfold(state, |mut state| async move {
        loop {
            if let Some(event) = state.queued.pop_front() {
                return Some((event, state));
            }
            if state.chunks.ended() || state.failed {
                return None;
            }
            match state.events.next().await {
                Some(Ok(event)) => {
                    state.unread.store(0, Ordering::Relaxed);
                    state.queued.extend(state.chunks.data(&event.data));
                }
                Some(Err(err)) => {
                    let error = match err {
                        EventStreamError::Transport(e) => ApiError::upstream(&e.code, &e.message),
                        EventStreamError::Utf8(e) => ApiError::upstream(
                            "bad_upstream_response",
                            &format!("the provider's event stream is not UTF-8: {e}"),
                        ),
                        EventStreamError::Parser(e) => ApiError::upstream(
                            "bad_upstream_response",
                            &format!("the provider's event stream is malformed: {e}"),
                        ),
                    };
                    // Nothing after a failure.
                    state.failed = true;
                    state.queued.clear();
                    return Some((Event::Failed(error), state));
                }
                // A stream that ends without `[DONE]` ends the answer all the same.
                None => state.queued.extend(state.chunks.end()),
            }
        }
    })
    .boxed()
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn events(items: Vec<TunnelItem>) -> Vec<Event> {
        events_of(stream::iter(items).boxed()).collect().await
    }

    fn body(text: &str) -> TunnelItem {
        TunnelItem::Body(Bytes::from(text.to_string()))
    }

    #[tokio::test]
    async fn events_split_anywhere_give_the_answer() {
        let stream = concat!(
            "data: {\"choices\":[{\"delta\":{\"content\":\"Hel\"}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"content\":\"lo\"},\"finish_reason\":\"stop\"}]}\r\n\r\n",
            "data: [DONE]\n\n",
        );
        for size in [1, 7, stream.len()] {
            let mut items: Vec<TunnelItem> = stream
                .as_bytes()
                .chunks(size)
                .map(|c| TunnelItem::Body(Bytes::copy_from_slice(c)))
                .collect();
            items.push(TunnelItem::End);
            let got = events(items).await;
            let text: String = got
                .iter()
                .filter_map(|e| match e {
                    Event::Text(t) => Some(t.as_str()),
                    _ => None,
                })
                .collect();
            assert_eq!(text, "Hello", "chunks of {size}");
            assert!(matches!(got.last(), Some(Event::Done { .. })), "{got:?}");
        }
    }

    #[tokio::test]
    async fn a_tunnel_error_mid_stream_fails_the_answer_after_what_came() {
        let got = events(vec![
            body("data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n"),
            TunnelItem::Error(pb::TunnelError::new(ErrorCode::BrokenStream, "reset")),
        ])
        .await;
        assert!(matches!(&got[0], Event::Text(t) if t == "a"));
        assert!(matches!(&got[1], Event::Failed(e) if e.message == "reset"));
        assert_eq!(got.len(), 2);
    }

    #[tokio::test]
    async fn an_endless_event_is_cut_off_at_the_limit() {
        let piece = "x".repeat(64 * 1024);
        let mut items = vec![body("data: ")];
        items.extend((0..(MAX_EVENT_BYTES / piece.len() + 2)).map(|_| body(&piece)));
        items.push(body("\n\n"));
        let got = events(items).await;
        assert_eq!(got.len(), 1, "{:?}", got.len());
        assert!(
            matches!(&got[0], Event::Failed(e) if e.message.contains("larger than")),
            "{got:?}"
        );
    }

    #[test]
    fn provider_errors_keep_status_and_message() {
        let e = provider_error(400, br#"{"error":{"message":"bad tools","type":"x"}}"#);
        assert_eq!((e.status.as_u16(), e.message.as_str()), (400, "bad tools"));
        let e = provider_error(404, br#"{"error":"model not found"}"#);
        assert_eq!(
            (e.status.as_u16(), e.message.as_str()),
            (404, "model not found")
        );
        let e = provider_error(422, br#"{"detail":"field required"}"#);
        assert_eq!(e.message, "field required");
        let e = provider_error(500, b"internal oops");
        assert_eq!(
            (e.status.as_u16(), e.message.as_str()),
            (500, "internal oops")
        );
        let e = provider_error(302, b"");
        assert_eq!(e.status, 502);
        assert!(e.message.contains("302"));
    }
}
