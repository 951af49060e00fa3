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
//! Each provider has a [`super::tokenizer::Tokenizer`]: at most [`TOKENIZER_PLACES`] counts at once (a
//! count waits for a place at most [`COUNT_TIMEOUT`], then is refused as
//! `node_capacity`), and which of its endpoints counts a chat, learned by the first count
//! and used alone afterwards: one request per count (vLLM, Messages), two for
//! llama-server's template and tokenization. A provider without a tokenizer (`/tokenize`
//! answers 404) is not asked again for [`RETRY_MISSING_AFTER`]. A count's body is parsed
//! off the node's event loop.
//!
//! The answer is `{"input_tokens": N, "counted_by": "provider" | "tokenizer"}`; a provider
//! with none of these endpoints is an error, and the edge estimates instead.

use std::time::Instant;

use iop_proto::ErrorCode;
use reqwest::Method;
use serde_json::{Value, json};

use super::error::AdapterError;
use super::http::HttpProvider;

use super::tokenizer::{COUNT_TIMEOUT, Dialect, RETRY_MISSING_AFTER, TOKENIZER_PLACES};

/// Counts the tokens of `body` (JSON text): a Messages request when `api` is `messages`,
/// else a chat request.
pub async fn count(
    provider: &HttpProvider,
    api: &str,
    body: String,
) -> Result<Value, AdapterError> {
    let tokenizer = provider.tokenizer.clone();
    let Ok(Ok(_place)) = tokio::time::timeout(COUNT_TIMEOUT, tokenizer.places.acquire()).await
    else {
        return Err(AdapterError::new(
            ErrorCode::NodeCapacity,
            format!(
                "provider {}: {TOKENIZER_PLACES} token counts are under way; the edge estimates",
                provider.id
            ),
        ));
    };
    let dialect = *tokenizer.dialect.lock();
    if api != "messages"
        && let Dialect::Missing { until } = dialect
        && Instant::now() < until
    {
        return Err(AdapterError::not_supported(&format!(
            "token counts on provider {} (it has no /tokenize)",
            provider.id
        )));
    }
    let body = tokio::task::spawn_blocking(move || serde_json::from_str::<Value>(&body))
        .await
        .ok()
        .and_then(Result::ok)
        .ok_or_else(|| {
            AdapterError::new(ErrorCode::BadRequest, "tokens.count needs `body` (JSON)")
        })?;
    if api == "messages" {
        let answer = post(
            provider,
            provider.request(Method::POST, "/messages/count_tokens"),
            &body,
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
    if dialect != Dialect::Template {
        let vllm = post(
            provider,
            provider.root_request(Method::POST, "/tokenize"),
            &chat,
        )
        .await;
        match &vllm {
            Ok(answer) => match answer.get("count").and_then(Value::as_u64) {
                Some(n) => {
                    *tokenizer.dialect.lock() = Dialect::Tokenize;
                    return Ok(json!({"input_tokens": n, "counted_by": "tokenizer"}));
                }
                // A `/tokenize` that takes no messages: llama-server's.
                None => *tokenizer.dialect.lock() = Dialect::Template,
            },
            Err(e) if e.code == ErrorCode::UnknownTarget => {
                *tokenizer.dialect.lock() = Dialect::Missing {
                    until: Instant::now() + RETRY_MISSING_AFTER,
                };
                return Err(AdapterError::not_supported(&format!(
                    "token counts on provider {} (it has no /tokenize)",
                    provider.id
                )));
            }
            // Refused or failed: nothing learned, the template may still count.
            Err(_) => {}
        }
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
