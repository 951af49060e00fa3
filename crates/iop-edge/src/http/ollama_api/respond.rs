//! Turns an answer's events into the HTTP response: an NDJSON stream (one line per event,
//! `application/x-ndjson`) or one JSON object of at most `limits.http.max_response_bytes`
//! of text. A failure before any output is an HTTP error; after it, an error line ends
//! the stream. The event source (a run or a tunnel) lives in the response body, so a
//! client that goes away cancels the work and frees its slot.

use std::time::{Instant, SystemTime};

use axum::body::Body;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures::stream::{self, BoxStream, StreamExt};

use super::answer::{self, Event};
use super::render::{Collected, Renderer, ndjson};
use crate::http::error::ApiError;
use crate::service::RunStream;

pub const NDJSON: &str = "application/x-ndjson";

/// A run's events as answer events; a run that stops without a terminal ends failed.
pub fn run_events(run: RunStream) -> BoxStream<'static, Event> {
    stream::unfold(Some(run), |run| async move {
        let mut run = run?;
        loop {
            match run.next().await {
                Some(e) => {
                    if let Some(event) = answer::from_run_event(e) {
                        let next = (!event.is_end()).then_some(run);
                        return Some((event, next));
                    }
                }
                None => {
                    let e =
                        ApiError::upstream("upstream_error", "the run ended without a terminal");
                    return Some((Event::Failed(e), None));
                }
            }
        }
    })
    .boxed()
}

/// The response for an answer: streamed or whole.
pub async fn answer(
    mut events: BoxStream<'static, Event>,
    mut renderer: Renderer,
    stream: bool,
    max_bytes: usize,
) -> Result<Response, ApiError> {
    let first = match events.next().await {
        Some(Event::Failed(e)) => return Err(e),
        Some(e) => e,
        None => {
            return Err(ApiError::upstream(
                "upstream_error",
                "the answer ended before it began",
            ));
        }
    };
    if stream {
        return Ok(ndjson_stream(events, first, renderer));
    }
    let mut collected = Collected::default();
    let mut next = Some(first);
    loop {
        let event = match next.take() {
            Some(e) => e,
            None => events.next().await.unwrap_or_else(|| {
                Event::Failed(ApiError::upstream(
                    "upstream_error",
                    "the answer ended without its end",
                ))
            }),
        };
        match event {
            Event::Done { reason, counts } => {
                let body = renderer.done(
                    &collected,
                    &reason,
                    counts,
                    Instant::now(),
                    SystemTime::now(),
                );
                return Ok(axum::Json(body).into_response());
            }
            Event::Failed(e) => return Err(e),
            piece => {
                collected.add(piece);
                if collected.text_bytes() > max_bytes {
                    tracing::warn!(
                        max_bytes,
                        "non-streamed answer over limits.http.max_response_bytes: cancelling it"
                    );
                    return Err(ApiError::new(
                        StatusCode::BAD_GATEWAY,
                        "upstream_error",
                        "response_too_large",
                        format!(
                            "the answer grew past this edge's limit of {max_bytes} bytes for a \
                             non-streamed response (limits.http.max_response_bytes) and was \
                             cancelled; ask for fewer tokens (num_predict) or stream it"
                        ),
                    ));
                }
            }
        }
    }
}

fn ndjson_stream(events: BoxStream<'static, Event>, first: Event, renderer: Renderer) -> Response {
    struct State {
        events: BoxStream<'static, Event>,
        pending: Option<Event>,
        renderer: Renderer,
        done: bool,
    }
    let state = State {
        events,
        pending: Some(first),
        renderer,
        done: false,
    };
    let body = stream::unfold(state, |mut state| async move {
        loop {
            if state.done {
                return None;
            }
            let event = match state.pending.take() {
                Some(e) => e,
                None => state.events.next().await.unwrap_or_else(|| {
                    Event::Failed(ApiError::upstream(
                        "upstream_error",
                        "the answer ended without its end",
                    ))
                }),
            };
            state.done = event.is_end();
            if let Some(line) = state
                .renderer
                .line(&event, Instant::now(), SystemTime::now())
            {
                return Some((Ok::<_, std::io::Error>(ndjson(&line)), state));
            }
        }
    });
    ([(header::CONTENT_TYPE, NDJSON)], Body::from_stream(body)).into_response()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use http_body_util::BodyExt;
    use serde_json::Value;

    use super::super::render::{Endpoint, Timing};
    use super::*;

    fn renderer() -> Renderer {
        let now = Instant::now();
        Renderer::new(
            Endpoint::Chat,
            "g".into(),
            Timing {
                received: now,
                dispatched: now + Duration::from_millis(1),
            },
        )
    }

    fn events(list: Vec<Event>) -> BoxStream<'static, Event> {
        stream::iter(list).boxed()
    }

    async fn text(response: Response) -> String {
        let body = response.into_body().collect().await.unwrap().to_bytes();
        String::from_utf8(body.to_vec()).unwrap()
    }

    fn done() -> Event {
        Event::Done {
            reason: "stop".into(),
            counts: None,
        }
    }

    #[tokio::test]
    async fn a_stream_is_one_line_per_event_ending_done() {
        let list = vec![Event::Text("a".into()), Event::Text("b".into()), done()];
        let response = answer(events(list), renderer(), true, 1024).await.unwrap();
        assert_eq!(response.headers()[header::CONTENT_TYPE], NDJSON);
        let body = text(response).await;
        let lines: Vec<Value> = body
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 3);
        assert_eq!(lines[1]["message"]["content"], "b");
        assert_eq!(lines[2]["done"], true);
        assert!(body.ends_with('\n'));
    }

    #[tokio::test]
    async fn a_failure_mid_stream_is_an_error_line_and_before_it_an_http_error() {
        let list = vec![
            Event::Text("a".into()),
            Event::Failed(ApiError::upstream("provider_error", "boom")),
            Event::Text("never".into()),
        ];
        let body = text(answer(events(list), renderer(), true, 1024).await.unwrap()).await;
        assert_eq!(body.lines().last().unwrap(), r#"{"error":"boom"}"#);
        assert!(!body.contains("never"));
        let list = vec![Event::Failed(ApiError::upstream(
            "provider_rate_limited",
            "busy",
        ))];
        let e = answer(events(list), renderer(), true, 1024)
            .await
            .unwrap_err();
        assert_eq!(e.status, 429);
        // A stream that just stops is a failure too.
        let body = text(
            answer(
                events(vec![Event::Text("a".into())]),
                renderer(),
                true,
                1024,
            )
            .await
            .unwrap(),
        )
        .await;
        assert!(body.lines().last().unwrap().contains("error"));
    }

    #[tokio::test]
    async fn a_whole_answer_is_one_object_within_the_limit() {
        let list = vec![
            Event::Text("ab".into()),
            Event::Thinking("t".into()),
            done(),
        ];
        let response = answer(events(list), renderer(), false, 1024).await.unwrap();
        let v: Value = serde_json::from_str(&text(response).await).unwrap();
        assert_eq!(v["message"]["content"], "ab");
        assert_eq!(v["message"]["thinking"], "t");
        assert_eq!(v["done"], true);
        let list = vec![Event::Text("x".repeat(20)), done()];
        let e = answer(events(list), renderer(), false, 10)
            .await
            .unwrap_err();
        assert_eq!(
            (e.status.as_u16(), e.code.as_str()),
            (502, "response_too_large")
        );
    }
}
