//! Turns a rendered answer into the HTTP response, for every surface alike: a stream (the
//! surface's renderer writes each canonical event's bytes as it comes) or one JSON
//! document of at most `limits.http.max_response_bytes` of output. A failure before any
//! output is an HTTP error in the surface's shape; after it, the renderer's own error
//! event ends the stream. The answer source lives in the response body, so a client that
//! goes away cancels the work and frees its slot.

use std::time::{Instant, SystemTime};

use axum::body::{Body, Bytes};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use futures::stream;
use iop_proto::ErrorCode;

use crate::canonical::{AnswerEvent, ApiError};
use crate::service::answer::{AnswerSource, too_large};
use crate::surfaces::Renderer;

/// The response for an answer: streamed or whole, its output bounded by `max_bytes`
/// where the edge holds it (a whole answer, or a stream whose API repeats it).
pub async fn respond(
    mut source: AnswerSource,
    renderer: Renderer,
    stream: bool,
    max_bytes: usize,
) -> Result<Response, ApiError> {
    let first = source.first().await?;
    if stream {
        return Ok(streamed(source, first, renderer, max_bytes));
    }
    whole(source, first, renderer, max_bytes).await
}

/// Reads the whole answer into one JSON document. A longer one than `max_bytes` ends
/// with a 502 and is cancelled.
async fn whole(
    mut source: AnswerSource,
    first: AnswerEvent,
    mut renderer: Renderer,
    max_bytes: usize,
) -> Result<Response, ApiError> {
    let mut size = 0usize;
    let mut event = Some(first);
    let mut none = Vec::new();
    while let Some(e) = event.take() {
        size += e.output_bytes();
        if size > max_bytes {
            tracing::warn!(
                id = source.id(),
                max_bytes,
                "non-streamed answer over limits.http.max_response_bytes: cancelling it"
            );
            source.fail(ErrorCode::ResponseTooLarge);
            return Err(too_large(max_bytes));
        }
        if let AnswerEvent::Failed(error) = e {
            return Err(error);
        }
        renderer.push(e, Instant::now(), SystemTime::now(), &mut none);
        if let Some(document) = renderer.document() {
            return Ok(axum::Json(document).into_response());
        }
        event = source.next().await;
    }
    Err(ended_early())
}

fn ended_early() -> ApiError {
    ApiError::of(
        ErrorCode::ProviderError,
        "the answer ended without a terminal",
    )
}

struct StreamState {
    source: AnswerSource,
    renderer: Renderer,
    first: Option<AnswerEvent>,
    started: bool,
    done: bool,
    /// Output bytes so far, and the most the renderer may hold (`None`: it holds none).
    size: usize,
    max_bytes: Option<usize>,
}

/// Streams the answer in the renderer's shape. Dropping the body (the client went away)
/// drops the source, which cancels the run or tunnel and frees its slot.
fn streamed(
    source: AnswerSource,
    first: AnswerEvent,
    renderer: Renderer,
    max_bytes: usize,
) -> Response {
    let content_type = renderer.stream_type();
    let state = StreamState {
        max_bytes: renderer.holds_answer().then_some(max_bytes),
        source,
        renderer,
        first: Some(first),
        started: false,
        done: false,
        size: 0,
    };
    let body = stream::unfold(state, |mut state| async move {
        let mut out = Vec::new();
        if !state.started {
            state.started = true;
            state.renderer.open(&mut out);
        }
        while (out.is_empty() || state.first.is_some()) && !state.done {
            let event = match state.first.take() {
                Some(e) => e,
                None => state
                    .source
                    .next()
                    .await
                    .unwrap_or_else(|| AnswerEvent::Failed(ended_early())),
            };
            let event = state.bounded(event);
            state.done = event.is_terminal();
            state
                .renderer
                .push(event, Instant::now(), SystemTime::now(), &mut out);
        }
        if out.is_empty() {
            return None;
        }
        Some((Ok::<_, std::io::Error>(Bytes::from(out)), state))
    });
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(body),
    )
        .into_response()
}

impl StreamState {
    /// The event, or the failure of an answer that grew past what the renderer may hold.
    fn bounded(&mut self, event: AnswerEvent) -> AnswerEvent {
        self.size += event.output_bytes();
        match self.max_bytes {
            Some(max) if self.size > max => {
                tracing::warn!(
                    id = self.source.id(),
                    max_bytes = max,
                    "streamed answer over limits.http.max_response_bytes: cancelling it"
                );
                self.source.fail(ErrorCode::ResponseTooLarge);
                AnswerEvent::Failed(too_large(max))
            }
            _ => event,
        }
    }
}
