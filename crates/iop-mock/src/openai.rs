//! The OpenAI-compatible half of the mock: `/v1/models`, `/v1/chat/completions`,
//! `/v1/completions` (streaming and not) and `/v1/embeddings`.

use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures::{StreamExt, stream};
use serde_json::{Value, json};

use super::{Mock, Tracked, bad_param, bad_request, hang, parse};

/// Most choices (`n`) a request may ask for, as OpenAI's API.
const MAX_CHOICES: u64 = 128;

pub(crate) async fn models() -> Response {
    axum::Json(json!({
        "object": "list",
        "data": [{"id": "mock-model", "object": "model", "created": 0, "owned_by": "iop-mock"}],
    }))
    .into_response()
}

fn openai_error(status: StatusCode, message: &str) -> Response {
    (
        status,
        axum::Json(json!({"error": {"message": message, "type": "server_error", "param": null, "code": null}})),
    )
        .into_response()
}

pub(crate) fn sse_response(body: Body) -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum OpenAiOp {
    Chat,
    Completion,
}

pub(crate) async fn chat(State(mock): State<Mock>, body: Bytes) -> Response {
    openai(mock, body, OpenAiOp::Chat).await
}

pub(crate) async fn completions(State(mock): State<Mock>, body: Bytes) -> Response {
    openai(mock, body, OpenAiOp::Completion).await
}

async fn openai(mock: Mock, body: Bytes, op: OpenAiOp) -> Response {
    let cookie = super::wants_cookie(&body);
    let response = openai_answer(mock, body, op).await;
    if cookie {
        super::with_cookie(response)
    } else {
        response
    }
}

// Over 100 lines: the test backend's whole OpenAI answer, each mode of the mock (faults,
// tools, embeddings, completions, streaming) in turn, as a test reads it.
async fn openai_answer(mock: Mock, body: Bytes, op: OpenAiOp) -> Response {
    let (body, mut tracked, plan) = match mock.begin(&body).await {
        Ok(begun) => begun,
        Err(e) => return bad_request(e),
    };
    if plan.model.contains("fail-500") || plan.poisoned || mock.faults.requests_fail() {
        tracked.finish();
        return openai_error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "mock provider failure (model fail-500)",
        );
    }
    let choices = match unsupported(&body) {
        Ok(n) => n,
        Err((param, message)) => {
            tracked.finish();
            return bad_param(param, message);
        }
    };
    if plan.model.contains("hang") {
        return hang(tracked).await;
    }
    if plan.model.contains("rate-limit-429") {
        tracked.finish();
        let mut response = openai_error(
            StatusCode::TOO_MANY_REQUESTS,
            "mock provider rate limit (model rate-limit-429)",
        );
        response
            .headers_mut()
            .insert("retry-after", axum::http::HeaderValue::from_static("30"));
        return response;
    }
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let include_usage = body
        .pointer("/stream_options/include_usage")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    if op == OpenAiOp::Chat
        && let Some(call) = tool_call(&body)
    {
        tracked.finish();
        return tool_call_answer(&mock, &plan, call, stream.then_some(include_usage));
    }
    // Deterministic, so a response relayed through iop can be compared byte for byte.
    let id = match op {
        OpenAiOp::Chat => "chatcmpl-mock",
        OpenAiOp::Completion => "cmpl-mock",
    };
    let (object, chunk_object) = match op {
        OpenAiOp::Chat => ("chat.completion", "chat.completion.chunk"),
        OpenAiOp::Completion => ("text_completion", "text_completion"),
    };
    if !stream {
        for _ in 0..plan.tokens() {
            if !plan.delay.is_zero() {
                tokio::time::sleep(plan.delay).await;
            }
        }
        if plan.model.contains("error-mid-stream") {
            tracked.finish();
            return openai_error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "mock provider failed mid-generation",
            );
        }
        let text = plan.text();
        let choice = |index: u32| match op {
            OpenAiOp::Chat => {
                let mut message = json!({"role": "assistant", "content": text});
                if plan.reasoning {
                    message["reasoning_content"] = json!("thinking hard");
                }
                json!({"index": index, "message": message, "logprobs": null, "finish_reason": plan.finish})
            }
            OpenAiOp::Completion => {
                json!({"index": index, "text": text, "logprobs": null, "finish_reason": plan.finish})
            }
        };
        let choices: Vec<Value> = (0..choices).map(choice).collect();
        tracked.finish();
        return axum::Json(json!({
            "id": id, "object": object, "created": 1700000000u64, "model": plan.model,
            "choices": choices, "usage": mock.usage(&plan, choices.len() as u64),
        }))
        .into_response();
    }
    // Streaming: one SSE event per token and choice (choices take turns, as OpenAI's).
    let usage = mock.usage(&plan, choices as u64);
    let mut events: Vec<(Duration, String)> = Vec::new();
    let one_chunk = |index: u32, delta: &Value, finish: &Value| -> String {
        let choice = match op {
            OpenAiOp::Chat => {
                json!({"index": index, "delta": delta, "logprobs": null, "finish_reason": finish})
            }
            OpenAiOp::Completion => {
                json!({"index": index, "text": delta.get("content").cloned().unwrap_or(json!("")), "logprobs": null, "finish_reason": finish})
            }
        };
        let mut c = json!({"id": id, "object": chunk_object, "created": 1700000000u64, "model": plan.model, "choices": [choice]});
        if include_usage {
            c["usage"] = Value::Null;
        }
        format!("data: {c}\n\n")
    };
    let chunk = |delta: Value, finish: Value| -> String {
        (0..choices)
            .map(|index| one_chunk(index, &delta, &finish))
            .collect()
    };
    if op == OpenAiOp::Chat {
        events.push((
            Duration::ZERO,
            chunk(json!({"role": "assistant", "content": ""}), Value::Null),
        ));
    }
    if plan.reasoning {
        for r in ["thinking ", "hard"] {
            events.push((
                plan.delay,
                chunk(json!({"reasoning_content": r}), Value::Null),
            ));
        }
    }
    let failed = plan.token_events(
        &mut events,
        |word| chunk(json!({"content": word}), Value::Null),
        || format!("data: {}\n\n", json!({"error": {"message": "mock provider failed mid-stream", "type": "server_error", "param": null, "code": null}})),
    );
    if !failed {
        events.push((Duration::ZERO, chunk(json!({}), json!(plan.finish))));
        if include_usage {
            let c = json!({"id": id, "object": chunk_object, "created": 1700000000u64, "model": plan.model, "choices": [], "usage": usage});
            events.push((Duration::ZERO, format!("data: {c}\n\n")));
        }
        events.push((Duration::ZERO, "data: [DONE]\n\n".to_string()));
        if plan.model.contains("lingering") {
            // The body ends a while after its last event, as servers that finish a chunked
            // response late: a client that stops at [DONE] is gone before the end.
            events.push((Duration::from_millis(100), String::new()));
        }
    }
    if plan.model.contains("torn-mid-stream") {
        return sse_response(torn(events, tracked));
    }
    if plan.model.contains("stall-after-head") {
        // The head and the first two events, then silence until the client goes away.
        events.truncate(2);
        let head = stream::iter(
            events
                .into_iter()
                .map(|(_, text)| Ok::<_, std::io::Error>(Bytes::from(text))),
        );
        let silence = stream::once(async move {
            let _tracked = tracked;
            std::future::pending::<Result<Bytes, std::io::Error>>().await
        });
        return sse_response(Body::from_stream(head.chain(silence)));
    }
    sse_response(paced(events, tracked))
}

/// The first half of the events, then half of the next one (cut inside its JSON), then a
/// broken connection: a backend that died mid-line.
fn torn(mut events: Vec<(Duration, String)>, tracked: Tracked) -> Body {
    let keep = events.len() / 2;
    let (delay, next) = events[keep].clone();
    events.truncate(keep);
    events.push((delay, next[..next.len() / 2].to_string()));
    let broken = stream::once(async {
        // Let what was written reach the client first: an error in the body drops the
        // connection with whatever is still buffered.
        tokio::time::sleep(Duration::from_millis(100)).await;
        Err(std::io::Error::other(
            "mock provider died mid-event (model torn-mid-stream)",
        ))
    });
    Body::from_stream(paced_stream(events, tracked).chain(broken))
}

/// A body that sends each event after its delay and counts the response when it ends.
pub(crate) fn paced(events: Vec<(Duration, String)>, tracked: Tracked) -> Body {
    Body::from_stream(paced_stream(events, tracked))
}

fn paced_stream(
    events: Vec<(Duration, String)>,
    tracked: Tracked,
) -> impl futures::Stream<Item = Result<Bytes, std::io::Error>> {
    let state = (events.into_iter(), tracked);
    stream::unfold(state, |(mut events, mut tracked)| async move {
        match events.next() {
            Some((delay, text)) => {
                if !delay.is_zero() {
                    tokio::time::sleep(delay).await;
                }
                Some((
                    Ok::<_, std::io::Error>(Bytes::from(text)),
                    (events, tracked),
                ))
            }
            None => {
                tracked.finish();
                None
            }
        }
    })
}

/// The call a chat with tools gets (see [`crate::agent_turn`]), with arguments that fit
/// the tool's schema (each required property: `"mock"`, `1`, `true`, `[]`, an object built
/// the same way, an enum's first value); `None` when it answers in text.
fn tool_call(body: &Value) -> Option<Value> {
    let function = crate::agent_turn::json_tool_call(body)?;
    let name = function.get("name")?.as_str()?;
    let arguments = function
        .get("parameters")
        .map_or_else(|| json!({}), crate::schema::fitting_value);
    Some(json!({
        "id": "call_mock_0", "type": "function",
        "function": {"name": name, "arguments": arguments.to_string()}
    }))
}

fn tool_call_answer(
    mock: &Mock,
    plan: &super::Plan,
    call: Value,
    streamed: Option<bool>,
) -> Response {
    let usage = mock.usage(plan, 1);
    let base = |object: &str| json!({"id": "chatcmpl-mock", "object": object, "created": 1700000000u64, "model": plan.model});
    let Some(include_usage) = streamed else {
        let mut answer = base("chat.completion");
        answer["choices"] = json!([{
            "index": 0, "logprobs": null, "finish_reason": "tool_calls",
            "message": {"role": "assistant", "content": null, "tool_calls": [call]}
        }]);
        answer["usage"] = usage;
        return axum::Json(answer).into_response();
    };
    let mut indexed = call;
    indexed["index"] = json!(0);
    let chunk = |delta: Value, finish: Value| {
        let mut c = base("chat.completion.chunk");
        c["choices"] =
            json!([{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}]);
        format!("data: {c}\n\n")
    };
    let mut body = chunk(
        json!({"role": "assistant", "content": null, "tool_calls": [indexed]}),
        Value::Null,
    );
    body.push_str(&chunk(json!({}), json!("tool_calls")));
    if include_usage {
        let mut last = base("chat.completion.chunk");
        last["choices"] = json!([]);
        last["usage"] = usage;
        body.push_str(&format!("data: {last}\n\n"));
    }
    body.push_str("data: [DONE]\n\n");
    (
        [(axum::http::header::CONTENT_TYPE, "text/event-stream")],
        body,
    )
        .into_response()
}

/// What the mock cannot honour, as the parameter and a message for a 400; the number of
/// choices to answer otherwise.
fn unsupported(body: &Value) -> Result<u32, (&'static str, String)> {
    match body.get("response_format") {
        None | Some(Value::Null) => {}
        Some(format) if format.get("type").and_then(Value::as_str) == Some("text") => {}
        Some(format) => {
            return Err((
                "response_format",
                format!(
                    "the mock provider answers plain text only and cannot honour `response_format` {format}"
                ),
            ));
        }
    }
    match body.get("n") {
        None | Some(Value::Null) => Ok(1),
        Some(n) => match n.as_u64() {
            Some(n) if (1..=MAX_CHOICES).contains(&n) => Ok(n as u32),
            _ => Err((
                "n",
                format!("`n` must be an integer from 1 to {MAX_CHOICES}, not {n}"),
            )),
        },
    }
}

/// The mock's embedding of a text: 8 numbers from a hash of it.
pub(crate) fn vector(text: &str) -> Vec<f64> {
    let mut h: u64 = 1469598103934665603;
    for b in text.bytes() {
        h = (h ^ b as u64).wrapping_mul(1099511628211);
    }
    (0..8)
        .map(|k| ((h >> (k * 8)) & 0xff) as f64 / 255.0)
        .collect()
}

pub(crate) async fn embeddings(State(mock): State<Mock>, body: Bytes) -> Response {
    let body = match parse(&body) {
        Ok(b) => b,
        Err(e) => return bad_request(e),
    };
    let mut tracked = Tracked::new(&mock.stats);
    let model = body.get("model").and_then(Value::as_str).unwrap_or("mock");
    if model.contains("fail-500") || mock.faults.requests_fail() {
        tracked.finish();
        return openai_error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "mock provider failure (model fail-500)",
        );
    }
    let inputs: Vec<String> = match body.get("input") {
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| v.as_str().unwrap_or_default().to_string())
            .collect(),
        _ => vec![],
    };
    let data: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(i, text)| json!({"object": "embedding", "index": i, "embedding": vector(text)}))
        .collect();
    let tokens: u64 = inputs
        .iter()
        .map(|t| t.split_whitespace().count() as u64)
        .sum();
    tracked.finish();
    axum::Json(json!({
        "object": "list", "data": data, "model": body.get("model").cloned().unwrap_or(json!("mock")),
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }))
    .into_response()
}
