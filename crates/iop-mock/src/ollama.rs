//! The Ollama half of the mock: `/api/chat` and `/api/generate` (NDJSON streams or one
//! JSON answer), `/api/tags`, `/api/ps` and `/api/show`.

use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::openai::paced;
use super::{Mock, bad_request, full_text, hang};

pub(crate) async fn ollama_chat(State(mock): State<Mock>, body: Bytes) -> Response {
    ollama(mock, body, true).await
}

pub(crate) async fn ollama_generate(State(mock): State<Mock>, body: Bytes) -> Response {
    ollama(mock, body, false).await
}

async fn ollama(mock: Mock, body: Bytes, chat: bool) -> Response {
    let (body, mut tracked, plan) = match mock.begin(&body) {
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
            v["eval_count"] = json!(plan.tokens);
            v["total_duration"] = json!(1000);
        }
        v
    };
    if !stream {
        for _ in 0..plan.tokens {
            if !plan.delay.is_zero() {
                tokio::time::sleep(plan.delay).await;
            }
        }
        tracked.finish();
        return axum::Json(line(&full_text(plan.tokens), None, true)).into_response();
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

pub(crate) async fn ollama_tags() -> Response {
    axum::Json(json!({"models": [{"name": "mock-model:latest", "model": "mock-model:latest", "size": 1, "digest": "0", "details": {"family": "mock"}}]})).into_response()
}

pub(crate) async fn ollama_ps() -> Response {
    axum::Json(json!({"models": []})).into_response()
}

pub(crate) async fn ollama_show(body: Bytes) -> Response {
    let model = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|v| v.get("model").and_then(Value::as_str).map(String::from))
        .unwrap_or_default();
    axum::Json(json!({"modelfile": format!("FROM {model}"), "details": {"family": "mock", "parameter_size": "0B"}, "model_info": {}})).into_response()
}
