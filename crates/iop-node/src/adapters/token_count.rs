//! Counting a prompt's tokens with the provider's own tokenizer, for the edge's
//! `/v1/messages/count_tokens` (the `tokens.count` node command), on an OpenAI-compatible
//! provider:
//!
//! - a provider that serves Anthropic's Messages API gets the request as it is, at
//!   `POST /v1/messages/count_tokens` (llama-server serves it);
//! - otherwise the chat request is counted: `POST /tokenize` with `messages` (vLLM renders
//!   them with the model's chat template and counts), else `POST /apply-template` and
//!   `POST /tokenize` of the prompt it renders (llama-server).
//!
//! The answer is `{"input_tokens": N, "counted_by": "provider" | "tokenizer"}`; a provider
//! with none of these endpoints is an error, and the edge estimates instead.

use std::time::Duration;

use iop_proto::ErrorCode;
use reqwest::Method;
use serde_json::{Value, json};

use super::AdapterError;
use super::http::HttpProvider;

/// How long each counting request may take: counting is quick, and the client is waiting.
const COUNT_TIMEOUT: Duration = Duration::from_secs(5);

/// Counts the tokens of `body`: a Messages request when `api` is `messages`, else a chat
/// request.
pub async fn count(
    provider: &HttpProvider,
    api: &str,
    body: &Value,
) -> Result<Value, AdapterError> {
    if api == "messages" {
        let answer = post(
            provider,
            provider.request(Method::POST, "/messages/count_tokens"),
            body,
        )
        .await?;
        let tokens = answer.get("input_tokens").and_then(Value::as_u64);
        return match tokens {
            Some(n) => Ok(json!({"input_tokens": n, "counted_by": "provider"})),
            None => Err(unreadable(provider, "/v1/messages/count_tokens")),
        };
    }
    let mut chat = json!({"messages": body.get("messages").cloned().unwrap_or(json!([]))});
    for key in ["model", "tools"] {
        if let Some(v) = body.get(key) {
            chat[key] = v.clone();
        }
    }
    let vllm = post(
        provider,
        provider.root_request(Method::POST, "/tokenize"),
        &chat,
    )
    .await;
    if let Some(n) = vllm
        .as_ref()
        .ok()
        .and_then(|a| a.get("count"))
        .and_then(Value::as_u64)
    {
        return Ok(json!({"input_tokens": n, "counted_by": "tokenizer"}));
    }
    let template = provider.root_request(Method::POST, "/apply-template");
    let prompt = post(provider, template, &chat).await?;
    let Some(prompt) = prompt.get("prompt").and_then(Value::as_str) else {
        return Err(unreadable(provider, "/apply-template"));
    };
    let tokenize = provider.root_request(Method::POST, "/tokenize");
    let tokens = post(
        provider,
        tokenize,
        &json!({"content": prompt, "add_special": true}),
    )
    .await?;
    match tokens.get("tokens").and_then(Value::as_array) {
        Some(tokens) => Ok(json!({"input_tokens": tokens.len(), "counted_by": "tokenizer"})),
        None => Err(unreadable(provider, "/tokenize")),
    }
}

/// Sends `body` and reads a 2xx JSON answer.
async fn post(
    provider: &HttpProvider,
    request: reqwest::RequestBuilder,
    body: &Value,
) -> Result<Value, AdapterError> {
    provider
        .json_lookup(request.json(body), COUNT_TIMEOUT, "counting")
        .await
}

fn unreadable(provider: &HttpProvider, path: &str) -> AdapterError {
    AdapterError::new(
        ErrorCode::BadUpstreamResponse,
        format!("provider {}: {path} answered without a count", provider.id),
    )
}
