//! The Ollama half of the mock's answers: `/api/chat` and `/api/generate` (NDJSON streams
//! or one JSON answer; a chat with no messages or a generate with no prompt only loads or,
//! with `keep_alive: 0`, unloads the model), `/api/embed` and `/api/embeddings`. The model
//! store is [`crate::ollama_models`].
//!
//! A chat with `tools` is answered by a tool call as `agent_turn` decides (arguments: the
//! last user message as `{"query": …}`), or, once the turn holds a tool result,
//! with text again. A request with `format` gets its answer as one JSON document
//! `{"answer": …}`.

use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::openai::paced;
use super::{Mock, bad_request, hang};

pub(crate) async fn ollama_chat(State(mock): State<Mock>, body: Bytes) -> Response {
    ollama(mock, body, true).await
}

pub(crate) async fn ollama_generate(State(mock): State<Mock>, body: Bytes) -> Response {
    ollama(mock, body, false).await
}

async fn ollama(mock: Mock, body: Bytes, chat: bool) -> Response {
    let cookie = super::wants_cookie(&body);
    let response = ollama_answer(mock, body, chat).await;
    if cookie {
        super::with_cookie(response)
    } else {
        response
    }
}

// Over 100 lines: the test backend's whole Ollama answer, each mode of the mock (faults,
// tools, embeddings, streaming) in turn, as a test reads it.
async fn ollama_answer(mock: Mock, body: Bytes, chat: bool) -> Response {
    let (body, mut tracked, plan) = match mock.begin(&body).await {
        Ok(begun) => begun,
        Err(e) => return bad_request(e),
    };
    if plan.model.contains("fail-500") || mock.faults.requests_fail() {
        tracked.finish();
        return (
            StatusCode::INTERNAL_SERVER_ERROR,
            axum::Json(json!({"error": "mock provider failure (model fail-500)"})),
        )
            .into_response();
    }
    if plan.model.contains("not-found") {
        tracked.finish();
        return (StatusCode::NOT_FOUND, axum::Json(json!({"error": format!("model \"{}\" not found, try pulling it first", plan.model)}))).into_response();
    }
    if plan.model.contains("hang") {
        return hang(tracked).await;
    }
    if let Some(reason) = mock.ollama.touch(&body, chat) {
        tracked.finish();
        return axum::Json(load_answer(&plan.model, chat, reason)).into_response();
    }
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(true);
    let line = |text: &str, thinking: Option<&str>, done: bool| -> Value {
        let mut v = if chat {
            let mut message = json!({"role": "assistant", "content": text});
            if let Some(t) = thinking {
                message["thinking"] = json!(t);
            }
            json!({"model": plan.model, "created_at": "2024-01-01T00:00:00Z", "message": message, "done": done})
        } else {
            json!({"model": plan.model, "created_at": "2024-01-01T00:00:00Z", "response": text, "done": done})
        };
        if done {
            v["done_reason"] = json!(plan.finish);
            v["prompt_eval_count"] = json!(plan.prompt_tokens);
            v["eval_count"] = json!(plan.tokens());
            v["total_duration"] = json!(1000);
            v["load_duration"] = json!(100);
            v["prompt_eval_duration"] = json!(200);
            v["eval_duration"] = json!(700);
        }
        v
    };
    if let Some(call) = chat.then(|| tool_call(&body)).flatten() {
        let mut called = line("", None, false);
        called["message"]["tool_calls"] = json!([call]);
        let events = vec![
            (plan.delay, format!("{called}\n")),
            (Duration::ZERO, format!("{}\n", line("", None, true))),
        ];
        if !stream {
            let mut answer = line("", None, true);
            answer["message"]["tool_calls"] = json!([call]);
            tracked.finish();
            return axum::Json(answer).into_response();
        }
        return (
            [(header::CONTENT_TYPE, "application/x-ndjson")],
            paced(events, tracked),
        )
            .into_response();
    }
    let formatted = body.get("format").is_some_and(|f| !f.is_null() && f != "");
    if formatted {
        let document = json!({"answer": plan.text()}).to_string();
        let events = vec![
            (plan.delay, format!("{}\n", line(&document, None, false))),
            (Duration::ZERO, format!("{}\n", line("", None, true))),
        ];
        if !stream {
            tracked.finish();
            return axum::Json(line(&document, None, true)).into_response();
        }
        return (
            [(header::CONTENT_TYPE, "application/x-ndjson")],
            paced(events, tracked),
        )
            .into_response();
    }
    if !stream {
        for _ in 0..plan.tokens() {
            if !plan.delay.is_zero() {
                tokio::time::sleep(plan.delay).await;
            }
        }
        tracked.finish();
        return axum::Json(line(&plan.text(), None, true)).into_response();
    }
    let mut events = Vec::new();
    if plan.reasoning {
        events.push((
            plan.delay,
            format!("{}\n", line("", Some("thinking hard"), false)),
        ));
    }
    let failed = plan.token_events(
        &mut events,
        |word| format!("{}\n", line(word, None, false)),
        || format!("{}\n", json!({"error": "mock provider failed mid-stream"})),
    );
    if !failed {
        events.push((Duration::ZERO, format!("{}\n", line("", None, true))));
    }
    (
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        paced(events, tracked),
    )
        .into_response()
}

/// The answer to a request that only loads or unloads a model (`done_reason` `load` or
/// `unload`), as Ollama documents it.
fn load_answer(model: &str, chat: bool, reason: &str) -> Value {
    let mut answer = json!({"model": model, "created_at": "2024-01-01T00:00:00Z", "done": true, "done_reason": reason});
    if chat {
        answer["message"] = json!({"role": "assistant", "content": ""});
    } else {
        answer["response"] = json!("");
    }
    answer
}

/// The call a chat with tools gets (see [`crate::agent_turn`]), with the last user message
/// as its query; `None` when it answers in text.
fn tool_call(body: &Value) -> Option<Value> {
    let name = crate::agent_turn::json_tool_call(body)?
        .get("name")?
        .as_str()?;
    let messages = body.get("messages")?.as_array()?;
    let query = messages
        .iter()
        .rev()
        .find(|m| m.get("role").and_then(Value::as_str) == Some("user"))
        .and_then(|m| m.get("content"))
        .cloned()
        .unwrap_or(Value::Null);
    Some(json!({"function": {"name": name, "arguments": {"query": query}}}))
}

pub(crate) async fn ollama_embed(State(mock): State<Mock>, body: Bytes) -> Response {
    ollama_embeddings_of(mock, body, true)
}

pub(crate) async fn ollama_embeddings(State(mock): State<Mock>, body: Bytes) -> Response {
    ollama_embeddings_of(mock, body, false)
}

/// `/api/embed` (`input`: a text or several → `embeddings`) or the older
/// `/api/embeddings` (`prompt` → `embedding`), with the OpenAI half's vectors.
fn ollama_embeddings_of(mock: Mock, body: Bytes, embed: bool) -> Response {
    let body = match super::parse(&body) {
        Ok(b) => b,
        Err(e) => {
            return (StatusCode::BAD_REQUEST, axum::Json(json!({"error": e}))).into_response();
        }
    };
    let mut tracked = super::Tracked::new(&mock.stats);
    let model = body.get("model").cloned().unwrap_or(json!("mock"));
    let texts: Vec<String> = match body.get(if embed { "input" } else { "prompt" }) {
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(Value::as_str)
            .map(String::from)
            .collect(),
        _ => Vec::new(),
    };
    let vectors: Vec<Value> = texts
        .iter()
        .map(|t| json!(super::openai::vector(t)))
        .collect();
    let tokens: u64 = texts
        .iter()
        .map(|t| t.split_whitespace().count() as u64)
        .sum();
    tracked.finish();
    let answer = if embed {
        json!({"model": model, "embeddings": vectors, "total_duration": 1000, "load_duration": 0, "prompt_eval_count": tokens})
    } else {
        json!({"embedding": vectors.first().cloned().unwrap_or(json!([]))})
    };
    axum::Json(answer).into_response()
}
