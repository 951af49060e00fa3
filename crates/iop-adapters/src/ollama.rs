//! Ollama adapter: a run is a streaming `POST /api/chat` ([`chat`] maps the request: tools,
//! images, tool calls, `format`) whose NDJSON lines become delta, reasoning-delta
//! (`message.thinking`) and tool-call (`message.tool_calls`) events, ending with the final
//! line's eval counts as usage (finish reason `tool_calls` when the model called tools).
//! Also answers the `ollama.tags`, `ollama.ps` and `ollama.show` commands; [`manage`]
//! pulls, deletes, copies, creates, loads and unloads models.

mod chat;
pub mod manage;

use async_trait::async_trait;
use futures::StreamExt;
use iop_proto::ErrorCode;
use iop_proto::pb;
use serde_json::{Value, json};

use super::adapter::{Adapter, RunInput};
use super::error::AdapterError;
use super::http::HttpProvider;
use crate::http::HeadWait;
use crate::sink::RunSink;

#[derive(Debug, Clone)]
pub struct OllamaAdapter {
    pub provider: HttpProvider,
}

/// How long a query of the server's models may take.
pub const QUERY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

impl OllamaAdapter {
    pub fn new(provider: HttpProvider) -> Self {
        Self { provider }
    }

    /// `GET /api/tags`, `GET /api/ps`, or `POST /api/show {model}`, as JSON (at most
    /// [`super::http::MAX_LOOKUP_BYTES`], within [`QUERY_TIMEOUT`]).
    pub async fn query(&self, what: &str, model: Option<&str>) -> Result<Value, AdapterError> {
        let request = match what {
            "tags" => self.provider.request(reqwest::Method::GET, "/api/tags"),
            "ps" => self.provider.request(reqwest::Method::GET, "/api/ps"),
            "show" => {
                let model = model.ok_or_else(|| {
                    AdapterError::new(
                        ErrorCode::BadRequest,
                        "ollama.show needs a `model` argument",
                    )
                })?;
                self.provider
                    .request(reqwest::Method::POST, "/api/show")
                    .json(&json!({"model": model}))
            }
            other => {
                return Err(AdapterError::not_supported(&format!(
                    "unknown ollama command {other:?}"
                )));
            }
        };
        // At most `MAX_LOOKUP_BYTES` of answer: a server listing without end is refused.
        self.provider
            .json_lookup(request, QUERY_TIMEOUT, &format!("/api/{what}"))
            .await
    }
}

#[async_trait]
impl Adapter for OllamaAdapter {
    async fn execute(&self, input: RunInput, sink: &mut RunSink) -> Result<(), AdapterError> {
        let request = self
            .provider
            .request(reqwest::Method::POST, "/api/chat")
            .json(&chat::request_body(&input)?);
        let request = self.provider.with_headers(request, &input.provider_headers);
        let response = self.provider.accepted(request, HeadWait::Streamed).await?;
        sink.start(&input.target).await?;
        let mut answer = Answer {
            run_id: &input.run_id,
            tool_calls: 0,
        };
        let mut body = response.bytes_stream();
        let mut pending: Vec<u8> = Vec::new();
        loop {
            let chunk = match body.next().await {
                Some(Ok(chunk)) => chunk,
                Some(Err(e)) => return Err(self.provider.transport_error(&e)),
                None => break,
            };
            pending.extend_from_slice(&chunk);
            while let Some(pos) = pending.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = pending.drain(..=pos).collect();
                if let Some(done) = self.line(&line, &mut answer, sink).await? {
                    sink.complete(Some(done.0), &done.1).await?;
                    return Ok(());
                }
            }
        }
        if !pending.is_empty()
            && let Some(done) = self.line(&pending, &mut answer, sink).await?
        {
            sink.complete(Some(done.0), &done.1).await?;
            return Ok(());
        }
        Err(AdapterError::new(
            ErrorCode::BrokenStream,
            format!(
                "provider {} ended the stream without a final `done` line",
                self.provider.id
            ),
        ))
    }
}

/// What the lines of one answer so far said.
struct Answer<'a> {
    run_id: &'a str,
    /// Tool calls relayed (the next generated id's number).
    tool_calls: usize,
}

impl OllamaAdapter {
    /// Handles one NDJSON line; returns the usage and done reason on the final one.
    async fn line(
        &self,
        line: &[u8],
        answer: &mut Answer<'_>,
        sink: &mut RunSink,
    ) -> Result<Option<(pb::Usage, String)>, AdapterError> {
        let line = line.trim_ascii();
        if line.is_empty() {
            return Ok(None);
        }
        let value: Value = serde_json::from_slice(line).map_err(|e| {
            AdapterError::new(
                ErrorCode::BrokenStream,
                format!("provider {} sent a bad line: {e}", self.provider.id),
            )
        })?;
        if let Some(err) = value.get("error").and_then(Value::as_str) {
            return Err(AdapterError::new(
                ErrorCode::ProviderError,
                format!("provider {}: {err}", self.provider.id),
            ));
        }
        if let Some(message) = value.get("message") {
            if let Some(thinking) = message.get("thinking").and_then(Value::as_str) {
                sink.reasoning(thinking).await?;
            }
            if let Some(content) = message.get("content").and_then(Value::as_str) {
                sink.delta(content).await?;
            }
            let calls = chat::answer_tool_calls(message, answer.run_id, &mut answer.tool_calls);
            sink.tool_calls(calls).await?;
        }
        if value.get("done").and_then(Value::as_bool) == Some(true) {
            let count = |k: &str| value.get(k).and_then(Value::as_u64).unwrap_or(0);
            let usage = pb::Usage {
                input_tokens: count("prompt_eval_count"),
                output_tokens: count("eval_count"),
                reasoning_tokens: None,
                cached_input_tokens: None,
            };
            // As OpenAI says it: an answer that called tools finished for that.
            let reason = if answer.tool_calls > 0 {
                "tool_calls".to_string()
            } else {
                value
                    .get("done_reason")
                    .and_then(Value::as_str)
                    .unwrap_or("stop")
                    .to_string()
            };
            return Ok(Some((usage, reason)));
        }
        Ok(None)
    }
}
