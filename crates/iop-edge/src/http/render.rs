//! Renders a normalized run's events as OpenAI responses: a `chat.completion` /
//! `text_completion` JSON document, or `chat.completion.chunk` / `text_completion` SSE
//! chunks ending in `data: [DONE]`, with a usage chunk when `stream_options.include_usage`
//! is set, reasoning deltas as `reasoning_content` and tool-call events as `tool_calls`.

use axum::body::{Body, Bytes};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use futures::stream;
use iop_proto::ErrorCode;
use iop_proto::pb::{self, RunEventKind};
use serde_json::{Value, json};

use super::error::ApiError;
use super::openai::Operation;
use crate::service::RunStream;

fn cancelled() -> ApiError {
    ApiError::of(ErrorCode::Cancelled, "the run was cancelled")
}

/// What the client asked to get back.
#[derive(Debug, Clone)]
pub struct Shape {
    pub op: Operation,
    /// The public model name (the group), as the client sent it.
    pub model: String,
    pub include_usage: bool,
}

fn created() -> u64 {
    crate::events::unix_ms() / 1000
}

/// Reads the run's first event (at once when the dispatcher already received it) so a
/// failure before any output becomes an HTTP error.
pub async fn first_event(run: &mut RunStream) -> Result<pb::RunEvent, ApiError> {
    match run.next().await {
        Some(e) if e.kind() == RunEventKind::Error => {
            Err(ApiError::from_run_error(e.error.as_ref()))
        }
        Some(e) if e.kind() == RunEventKind::Cancelled => {
            Err(ApiError::of(ErrorCode::Cancelled, "the run was cancelled"))
        }
        Some(e) => Ok(e),
        None => Err(ApiError::of(
            ErrorCode::ProviderError,
            "the run ended without events",
        )),
    }
}

/// The OpenAI `usage` object from provider-reported counts.
pub fn usage_json(usage: &pb::Usage) -> Value {
    let mut u = json!({
        "prompt_tokens": usage.input_tokens,
        "completion_tokens": usage.output_tokens,
        "total_tokens": usage.input_tokens.saturating_add(usage.output_tokens),
    });
    if let Some(r) = usage.reasoning_tokens {
        u["completion_tokens_details"] = json!({"reasoning_tokens": r});
    }
    if let Some(c) = usage.cached_input_tokens {
        u["prompt_tokens_details"] = json!({"cached_tokens": c});
    }
    u
}

/// OpenAI `tool_calls` entries for `calls`, numbered from `first_index` on.
fn tool_calls_json(calls: &[pb::ToolCall], first_index: usize) -> Vec<Value> {
    calls
        .iter()
        .enumerate()
        .map(|(i, c)| {
            json!({"index": first_index + i, "id": c.id, "type": "function",
                   "function": {"name": c.name, "arguments": c.arguments}})
        })
        .collect()
}

fn finish_reason(event: &pb::RunEvent) -> String {
    if event.finish_reason.is_empty() {
        "stop".into()
    } else {
        event.finish_reason.clone()
    }
}

/// Collects the whole run into one JSON response of at most `max_bytes` of text. A longer
/// answer ends with a 502; the run is dropped, which cancels it on the node and returns
/// its provider slot.
pub async fn json(
    mut run: RunStream,
    first: pb::RunEvent,
    shape: Shape,
    max_bytes: usize,
) -> Result<Response, ApiError> {
    let id = response_id(&shape, run.run_id());
    let mut content = String::new();
    let mut reasoning = String::new();
    let mut tool_calls: Vec<Value> = Vec::new();
    let mut event = Some(first);
    let complete = loop {
        let Some(e) = event.take() else {
            run.fail(ErrorCode::ProviderError);
            return Err(ApiError::of(
                ErrorCode::ProviderError,
                "the run ended without a terminal",
            ));
        };
        if matches!(e.kind(), RunEventKind::Delta | RunEventKind::ReasoningDelta)
            && content.len() + reasoning.len() + e.text.len() > max_bytes
        {
            tracing::warn!(
                run_id = run.run_id(),
                node_id = run.node_id(),
                max_bytes,
                "non-streamed answer over limits.http.max_response_bytes: cancelling the run"
            );
            run.fail(ErrorCode::ResponseTooLarge);
            return Err(ApiError::of(
                ErrorCode::ResponseTooLarge,
                format!(
                    "the answer grew past this edge's limit of {max_bytes} bytes for a \
                     non-streamed response (limits.http.max_response_bytes) and was cancelled; \
                     ask for fewer tokens (max_tokens) or set \"stream\": true"
                ),
            ));
        }
        match e.kind() {
            RunEventKind::Delta => content.push_str(&e.text),
            RunEventKind::ReasoningDelta => reasoning.push_str(&e.text),
            RunEventKind::ToolCall => {
                let calls = tool_calls_json(&e.tool_calls, tool_calls.len());
                tool_calls.extend(calls);
            }
            RunEventKind::Complete => break e,
            RunEventKind::Error => return Err(ApiError::from_run_error(e.error.as_ref())),
            RunEventKind::Cancelled => return Err(cancelled()),
            RunEventKind::Start | RunEventKind::Unspecified | RunEventKind::Accepted => {}
        }
        event = run.next().await;
    };
    let usage = complete
        .usage
        .as_ref()
        .map(usage_json)
        .unwrap_or_else(|| json!(null));
    let finish = finish_reason(&complete);
    let body = match shape.op {
        Operation::Completion => json!({
            "id": id, "object": "text_completion", "created": created(), "model": shape.model,
            "choices": [{"index": 0, "text": content, "logprobs": null, "finish_reason": finish}],
            "usage": usage,
        }),
        _ => {
            let no_content = content.is_empty();
            let mut message = json!({"role": "assistant", "content": content});
            if !reasoning.is_empty() {
                message["reasoning_content"] = Value::String(reasoning);
            }
            if !tool_calls.is_empty() {
                for call in &mut tool_calls {
                    call.as_object_mut().map(|c| c.remove("index"));
                }
                if no_content {
                    message["content"] = Value::Null;
                }
                message["tool_calls"] = Value::Array(tool_calls);
            }
            json!({
                "id": id, "object": "chat.completion", "created": created(), "model": shape.model,
                "choices": [{"index": 0, "message": message, "logprobs": null, "finish_reason": finish}],
                "usage": usage,
            })
        }
    };
    Ok(axum::Json(body).into_response())
}

fn response_id(shape: &Shape, run_id: &str) -> String {
    match shape.op {
        Operation::Completion => format!("cmpl-{run_id}"),
        _ => format!("chatcmpl-{run_id}"),
    }
}

struct SseState {
    run: RunStream,
    pending: Option<pb::RunEvent>,
    shape: Shape,
    id: String,
    created: u64,
    sent_role: bool,
    /// Tool calls rendered so far (the next one's `index`).
    tool_calls: usize,
    done: bool,
}

impl SseState {
    fn chunk(&self, delta: Value, finish: Option<String>) -> Bytes {
        let body = match self.shape.op {
            Operation::Completion => json!({
                "id": self.id, "object": "text_completion", "created": self.created, "model": self.shape.model,
                "choices": [{"index": 0, "text": delta.get("content").cloned().unwrap_or(json!("")),
                             "logprobs": null, "finish_reason": finish}],
            }),
            _ => json!({
                "id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.shape.model,
                "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
            }),
        };
        data(&body)
    }

    fn usage_chunk(&self, usage: &pb::Usage) -> Bytes {
        let object = match self.shape.op {
            Operation::Completion => "text_completion",
            _ => "chat.completion.chunk",
        };
        data(&json!({
            "id": self.id, "object": object, "created": self.created, "model": self.shape.model,
            "choices": [], "usage": usage_json(usage),
        }))
    }

    /// The bytes for one event; empty for events that render to nothing.
    fn render(&mut self, e: pb::RunEvent) -> Bytes {
        let mut out = Vec::new();
        let role = |s: &mut Self, out: &mut Vec<u8>| {
            if !s.sent_role && s.shape.op == Operation::Chat {
                s.sent_role = true;
                out.extend_from_slice(&s.chunk(json!({"role": "assistant", "content": ""}), None));
            }
        };
        match e.kind() {
            RunEventKind::Start | RunEventKind::Unspecified => role(self, &mut out),
            RunEventKind::Accepted => {}
            RunEventKind::Delta => {
                role(self, &mut out);
                out.extend_from_slice(&self.chunk(json!({"content": e.text}), None));
            }
            RunEventKind::ReasoningDelta => {
                role(self, &mut out);
                out.extend_from_slice(&self.chunk(json!({"reasoning_content": e.text}), None));
            }
            RunEventKind::ToolCall if self.shape.op == Operation::Chat => {
                role(self, &mut out);
                let calls = tool_calls_json(&e.tool_calls, self.tool_calls);
                self.tool_calls += calls.len();
                out.extend_from_slice(&self.chunk(json!({"tool_calls": calls}), None));
            }
            RunEventKind::ToolCall => {}
            RunEventKind::Complete => {
                role(self, &mut out);
                out.extend_from_slice(&self.chunk(json!({}), Some(finish_reason(&e))));
                if self.shape.include_usage
                    && let Some(usage) = &e.usage
                {
                    out.extend_from_slice(&self.usage_chunk(usage));
                }
                out.extend_from_slice(b"data: [DONE]\n\n");
                self.done = true;
            }
            RunEventKind::Error => {
                out.extend_from_slice(&data(&ApiError::from_run_error(e.error.as_ref()).body()));
                self.done = true;
            }
            RunEventKind::Cancelled => {
                out.extend_from_slice(&data(&cancelled().body()));
                self.done = true;
            }
        }
        Bytes::from(out)
    }
}

fn data(body: &Value) -> Bytes {
    let mut out = Vec::with_capacity(256);
    out.extend_from_slice(b"data: ");
    serde_json::to_writer(&mut out, body).expect("JSON values serialize");
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
}

/// Streams the run as SSE chunks.
pub fn sse(run: RunStream, first: pb::RunEvent, shape: Shape) -> Response {
    let state = SseState {
        id: response_id(&shape, run.run_id()),
        run,
        pending: Some(first),
        shape,
        created: created(),
        sent_role: false,
        tool_calls: 0,
        done: false,
    };
    let body = stream::unfold(state, |mut state| async move {
        loop {
            if state.done {
                return None;
            }
            let event = match state.pending.take() {
                Some(e) => e,
                None => match state.run.next().await {
                    Some(e) => e,
                    None => return None,
                },
            };
            let bytes = state.render(event);
            if !bytes.is_empty() {
                return Some((Ok::<_, std::io::Error>(bytes), state));
            }
        }
    });
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(body),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_totals_saturate() {
        let usage = pb::Usage {
            input_tokens: u64::MAX,
            output_tokens: 5,
            ..Default::default()
        };
        assert_eq!(usage_json(&usage)["total_tokens"], u64::MAX);
    }
}
