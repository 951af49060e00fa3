//! Bytes while a streamed request waits. A request for an event stream (OpenAI, Responses,
//! Messages, the native runs API) that has no answer after
//! `limits.http.stream_keepalive_sec` — it waits in the queue, or its provider is still
//! reading a long prompt — is answered there and then: `200` with the stream's head and an
//! SSE comment, then a comment at the same interval until the answer begins, so reverse
//! proxies, load balancers and CDNs that cut silent connections leave it alone; every SSE
//! client ignores comments. What the answer brings then follows in the same stream; a
//! failure arrives as the API's own error event ([`ErrorEvents`]), since the status went
//! out already. Ollama's streams are JSON lines, which have no comment to send: they are
//! never kept alive this way. A run's events are kept alive the same way while the run is
//! silent ([`super::runs`]).

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use tracing::Instrument;

use iop_proto::pb;

use crate::canonical::ApiError;
use crate::codec::EVENT_STREAM;
use crate::ledger::RequestRecorder;
use crate::service::Edge;
use crate::surfaces::Surface;

/// What one keepalive sends: an SSE comment.
pub const KEEPALIVE: &[u8] = b": keepalive\n\n";

/// Most bytes of a provider's late error read to say what it was.
const MAX_ERROR_BODY: usize = 64 * 1024;

/// How often a request is kept alive while it waits: streamed requests of the event
/// stream APIs, when the edge keeps streams alive at all.
pub fn interval(edge: &Edge, surface: Surface, stream: bool) -> Option<Duration> {
    let event_stream = !matches!(surface, Surface::Ollama(_));
    if !(stream && event_stream) {
        return None;
    }
    edge.config().limits.http.stream_keepalive()
}

type Answering = Pin<Box<dyn Future<Output = Result<Response, ApiError>> + Send>>;

/// Whose error event ends a kept-alive stream whose request fails before its answer.
#[derive(Debug, Clone, Copy)]
pub enum ErrorEvents {
    /// The API's own (`Surface::native_stream_error`).
    Api(Surface),
    /// A run's `error` event.
    Runs,
}

impl ErrorEvents {
    fn render(self, error: &ApiError) -> Option<Vec<u8>> {
        match self {
            ErrorEvents::Api(surface) => surface.native_stream_error(error),
            ErrorEvents::Runs => Some(crate::surfaces::runs::sse_event(&pb::RunEvent {
                kind: pb::RunEventKind::Error as i32,
                error: Some(pb::RunError::new(error.reason, error.message.clone())),
                ..Default::default()
            })),
        }
    }
}

/// The answer's response if it comes within `every`; else a stream kept alive every
/// `every` until it comes, then carrying it.
pub async fn answer_or_keep_alive(
    answering: impl Future<Output = Result<Response, ApiError>> + Send + 'static,
    every: Duration,
    errors: ErrorEvents,
    recorder: &RequestRecorder,
) -> Result<Response, ApiError> {
    // The answer may go on after the handler returned: in the request's span still.
    let mut answering: Answering = Box::pin(answering.in_current_span());
    tokio::select! {
        answered = &mut answering => return answered,
        () = tokio::time::sleep(every) => {}
    }
    tracing::debug!(
        every_sec = every.as_secs(),
        "streamed request still waiting for its answer: keeping it alive"
    );
    let state = Waiting {
        answering: Some(answering),
        body: None,
        every,
        errors,
        recorder: recorder.clone(),
        sent_first: false,
    };
    let body = futures::stream::unfold(state, |mut state| async move {
        let bytes = state.next().await?;
        Some((Ok::<_, std::io::Error>(bytes), state))
    });
    Ok((
        [
            (header::CONTENT_TYPE, EVENT_STREAM),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(body),
    )
        .into_response())
}

/// A kept-alive stream: waiting for its answer, then relaying the answer's body.
struct Waiting {
    answering: Option<Answering>,
    body: Option<axum::body::BodyDataStream>,
    every: Duration,
    errors: ErrorEvents,
    recorder: RequestRecorder,
    sent_first: bool,
}

impl Waiting {
    /// The stream's next bytes; `None` once it ended.
    async fn next(&mut self) -> Option<Bytes> {
        if !self.sent_first {
            // At once: the head and the first bytes leave together.
            self.sent_first = true;
            return Some(Bytes::from_static(KEEPALIVE));
        }
        if let Some(answering) = self.answering.as_mut() {
            let answered = tokio::select! {
                answered = answering => answered,
                () = tokio::time::sleep(self.every) => return Some(Bytes::from_static(KEEPALIVE)),
            };
            self.answering = None;
            match answered {
                Ok(response) if response.status().is_success() => {
                    self.body = Some(response.into_body().into_data_stream());
                }
                Ok(response) => return self.late_error(late_failure(response).await),
                Err(e) => return self.late_error(e),
            }
        }
        let body = self.body.as_mut()?;
        match body.next().await? {
            Ok(bytes) => Some(bytes),
            Err(e) => {
                // The answer's own body failed mid-way: as a relayed stream ends.
                tracing::warn!(%e, "kept-alive stream: the answer's body failed");
                self.body = None;
                None
            }
        }
    }

    /// Ends the stream with `error` in the API's own shape, and records it.
    fn late_error(&mut self, error: ApiError) -> Option<Bytes> {
        self.recorder.failed(error.reason, error.status.as_u16());
        self.errors.render(&error).map(Bytes::from)
    }
}

/// What a response that is not a success (a provider's own error for a natively served
/// request) says, as an error: read as every provider error is
/// ([`crate::codec::openai_answer::provider_error`]).
async fn late_failure(response: Response) -> ApiError {
    let status = response.status().as_u16();
    let body = axum::body::to_bytes(response.into_body(), MAX_ERROR_BODY)
        .await
        .unwrap_or_default();
    crate::codec::openai_answer::provider_error(status, &body)
}

#[cfg(test)]
mod tests {
    use axum::http::StatusCode;

    use super::*;

    fn response(status: u16, body: &'static str) -> Response {
        Response::builder()
            .status(status)
            .body(Body::from(body))
            .unwrap()
    }

    #[tokio::test]
    async fn a_late_provider_error_keeps_its_status_and_message() {
        let e = late_failure(response(
            400,
            r#"{"error": {"message": "context too long", "type": "invalid_request_error"}}"#,
        ))
        .await;
        assert_eq!(
            (e.status.as_u16(), e.message.as_str()),
            (400, "context too long")
        );
        let e = late_failure(response(503, r#"{"error": "model is loading"}"#)).await;
        assert_eq!(
            (e.status.as_u16(), e.message.as_str()),
            (503, "model is loading")
        );
        let e = late_failure(response(500, "")).await;
        assert!(e.message.contains("500"), "{}", e.message);
        // Not an error status, not a success either: the gateway's fault.
        let e = late_failure(response(302, "moved")).await;
        assert_eq!(e.status, StatusCode::BAD_GATEWAY);
        // A body past MAX_ERROR_BODY is not read whole: the status still says what failed.
        let huge = Response::builder()
            .status(500)
            .body(Body::from(vec![b'x'; MAX_ERROR_BODY * 2]))
            .unwrap();
        let e = late_failure(huge).await;
        assert_eq!(e.status.as_u16(), 500);
        assert!(e.message.len() < 1024, "{}", e.message.len());
    }

    #[test]
    fn ollama_streams_and_whole_answers_are_never_kept_alive() {
        let edge = Edge::new(crate::EdgeConfig::from_yaml("{}", "test").unwrap());
        let chat = Surface::OpenAi(crate::canonical::Operation::Chat);
        assert_eq!(interval(&edge, chat, true), Some(Duration::from_secs(15)));
        assert_eq!(interval(&edge, chat, false), None);
        assert_eq!(
            interval(&edge, Surface::Messages, true),
            Some(Duration::from_secs(15))
        );
        let ollama = Surface::Ollama(crate::surfaces::ollama::Endpoint::Chat);
        assert_eq!(interval(&edge, ollama, true), None);
    }
}
