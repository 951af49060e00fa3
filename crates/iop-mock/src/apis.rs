//! The mock's Responses API (`POST /v1/responses`) and Anthropic Messages API
//! (`POST /v1/messages`), streaming and not, as a server that serves them itself (e.g.
//! llama.cpp's `llama-server`) answers: the same deterministic words as the chat API,
//! `max_output_tokens` / `max_tokens` honoured, usage in each API's fields, errors in each
//! API's shape. Tools are refused with a 400, as on the chat API.
//!
//! The misbehaving models work here too: `fail-500`, `error-mid-stream` (an `error` event
//! halfway), `hang`, `slow`.

use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::openai::{paced, sse_response};
use super::{Mock, Tracked, hang, parse};

/// Which API a request came in.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Api {
    Responses,
    Messages,
}

pub(crate) async fn responses(State(mock): State<Mock>, body: Bytes) -> Response {
    serve(mock, body, Api::Responses).await
}

pub(crate) async fn messages(State(mock): State<Mock>, body: Bytes) -> Response {
    serve(mock, body, Api::Messages).await
}

fn error(api: Api, status: StatusCode, kind: &str, message: &str) -> Response {
    let body = match api {
        Api::Responses => {
            json!({"error": {"message": message, "type": kind, "param": null, "code": null}})
        }
        Api::Messages => json!({"type": "error", "error": {"type": kind, "message": message}}),
    };
    (status, axum::Json(body)).into_response()
}

/// The text of a string, or of the text parts / items of an array (recursively).
fn text_of(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Array(items) => items
            .iter()
            .map(|i| match i {
                Value::Object(o) => o
                    .get("text")
                    .or_else(|| o.get("content"))
                    .map(text_of)
                    .unwrap_or_default(),
                other => text_of(other),
            })
            .filter(|t| !t.is_empty())
            .collect::<Vec<_>>()
            .join(" "),
        _ => String::new(),
    }
}

// Over 100 lines: the test backend's whole Responses/Messages answer, every mode of the
// mock (tools, reasoning, faults, streaming) in the order a reader checks them against a test.
async fn serve(mock: Mock, body: Bytes, api: Api) -> Response {
    let body = match parse(&body) {
        Ok(b) => b,
        Err(e) => return error(api, StatusCode::BAD_REQUEST, "invalid_request_error", &e),
    };
    if body
        .get("tools")
        .and_then(Value::as_array)
        .is_some_and(|t| !t.is_empty())
    {
        return error(
            api,
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "the mock provider cannot call tools: leave `tools` out",
        );
    }
    let prompt = match api {
        Api::Responses => text_of(body.get("input").unwrap_or(&Value::Null)),
        Api::Messages => text_of(body.get("messages").unwrap_or(&Value::Null)),
    };
    // The plan reads the chat names of the limits.
    let mut planned = body.clone();
    let max = match api {
        Api::Responses => body.get("max_output_tokens"),
        Api::Messages => body.get("max_tokens"),
    };
    planned["max_tokens"] = max.cloned().unwrap_or(Value::Null);
    planned["stop"] = body.get("stop_sequences").cloned().unwrap_or(Value::Null);
    let mut tracked = Tracked::new(&mock.stats);
    let plan = mock.plan(&planned, &prompt);
    if plan.model.contains("fail-500") {
        tracked.finish();
        let kind = match api {
            Api::Responses => "server_error",
            Api::Messages => "api_error",
        };
        return error(
            api,
            StatusCode::INTERNAL_SERVER_ERROR,
            kind,
            "mock provider failure (model fail-500)",
        );
    }
    if plan.model.contains("hang") {
        return hang(tracked).await;
    }
    let output = plan.tokens() as u64;
    let input = plan.prompt_tokens;
    let text = plan.text();
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    if !stream {
        for _ in 0..plan.tokens() {
            if !plan.delay.is_zero() {
                tokio::time::sleep(plan.delay).await;
            }
        }
        tracked.finish();
        return axum::Json(match api {
            Api::Responses => response_object(&plan.model, &text, "completed", input, output),
            Api::Messages => json!({
                "id": "msg_mock", "type": "message", "role": "assistant", "model": plan.model,
                "content": [{"type": "text", "text": text}],
                "stop_reason": stop_reason(plan.finish), "stop_sequence": null,
                "usage": {"input_tokens": input, "output_tokens": output},
            }),
        })
        .into_response();
    }
    let mut events: Vec<(Duration, String)> = Vec::new();
    let event = |name: &str, data: Value| format!("event: {name}\ndata: {data}\n\n");
    match api {
        Api::Responses => {
            let mut seq = 0u64;
            let mut next = |name: &str, mut data: Value| {
                data["type"] = json!(name);
                data["sequence_number"] = json!(seq);
                seq += 1;
                event(name, data)
            };
            let started = response_object(&plan.model, "", "in_progress", 0, 0);
            let item = json!({"type": "message", "id": "msg_mock", "status": "in_progress", "role": "assistant", "content": []});
            let part = json!({"type": "output_text", "text": "", "annotations": []});
            let mut head = String::new();
            head.push_str(&next("response.created", json!({"response": started})));
            head.push_str(&next("response.in_progress", json!({"response": started})));
            head.push_str(&next(
                "response.output_item.added",
                json!({"output_index": 0, "item": item}),
            ));
            head.push_str(&next(
                "response.content_part.added",
                json!({"item_id": "msg_mock", "output_index": 0, "content_index": 0, "part": part}),
            ));
            events.push((Duration::ZERO, head));
            let deltas: Vec<String> = plan
                .pieces
                .iter()
                .map(|w| next("response.output_text.delta", json!({"item_id": "msg_mock", "output_index": 0, "content_index": 0, "delta": w, "logprobs": []})))
                .collect();
            let failed_at = plan
                .model
                .contains("error-mid-stream")
                .then_some(deltas.len() / 2);
            for (i, d) in deltas.into_iter().enumerate() {
                if Some(i) == failed_at {
                    events.push((plan.delay, next("error", json!({"code": "server_error", "message": "mock provider failed mid-stream", "param": null}))));
                    return sse_response(paced(events, tracked));
                }
                events.push((plan.delay, d));
            }
            let part = json!({"type": "output_text", "text": text, "annotations": []});
            let done = response_object(&plan.model, &text, "completed", input, output);
            let mut tail = String::new();
            tail.push_str(&next("response.output_text.done", json!({"item_id": "msg_mock", "output_index": 0, "content_index": 0, "text": text, "logprobs": []})));
            tail.push_str(&next(
                "response.content_part.done",
                json!({"item_id": "msg_mock", "output_index": 0, "content_index": 0, "part": part}),
            ));
            tail.push_str(&next(
                "response.output_item.done",
                json!({"output_index": 0, "item": done["output"][0]}),
            ));
            tail.push_str(&next("response.completed", json!({"response": done})));
            events.push((Duration::ZERO, tail));
        }
        Api::Messages => {
            let start = json!({"type": "message_start", "message": {
                "id": "msg_mock", "type": "message", "role": "assistant", "model": plan.model,
                "content": [], "stop_reason": null, "stop_sequence": null,
                "usage": {"input_tokens": input, "output_tokens": 1}}});
            let mut head = event("message_start", start);
            head.push_str(&event("content_block_start", json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})));
            head.push_str(&event("ping", json!({"type": "ping"})));
            events.push((Duration::ZERO, head));
            let failed = plan.token_events(
                &mut events,
                |w| event("content_block_delta", json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": w}})),
                || event("error", json!({"type": "error", "error": {"type": "api_error", "message": "mock provider failed mid-stream"}})),
            );
            if !failed {
                let mut tail = event(
                    "content_block_stop",
                    json!({"type": "content_block_stop", "index": 0}),
                );
                tail.push_str(&event(
                    "message_delta",
                    json!({"type": "message_delta",
                    "delta": {"stop_reason": stop_reason(plan.finish), "stop_sequence": null},
                    "usage": {"output_tokens": output}}),
                ));
                tail.push_str(&event("message_stop", json!({"type": "message_stop"})));
                events.push((Duration::ZERO, tail));
            }
        }
    }
    sse_response(paced(events, tracked))
}

fn stop_reason(finish: &str) -> &'static str {
    if finish == "length" {
        "max_tokens"
    } else {
        "end_turn"
    }
}

/// A Responses API `response` object with one message.
fn response_object(model: &str, text: &str, status: &str, input: u64, output: u64) -> Value {
    let (output_items, usage) = if status == "in_progress" {
        (json!([]), Value::Null)
    } else {
        (
            json!([{"type": "message", "id": "msg_mock", "status": "completed", "role": "assistant",
                    "content": [{"type": "output_text", "text": text, "annotations": []}]}]),
            json!({"input_tokens": input, "input_tokens_details": {"cached_tokens": 0},
                   "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
                   "total_tokens": input + output}),
        )
    };
    json!({
        "id": "resp_mock", "object": "response", "created_at": 1700000000u64, "status": status,
        "error": null, "incomplete_details": null, "model": model, "output": output_items,
        "parallel_tool_calls": true, "tool_choice": "auto", "tools": [], "usage": usage,
    })
}
