//! OpenAI-compatible adapter (`openai_compat`, and `vllm` with vLLM's usage conventions):
//! a run is a streaming `POST /chat/completions` whose SSE chunks become delta,
//! reasoning-delta (from `reasoning_content` / `reasoning`) and complete-with-usage events.
//! The same endpoint serves the raw tunnel.

use async_trait::async_trait;
use eventsource_stream::Eventsource;
use futures::StreamExt;
use iop_proto::ErrorCode;
use serde_json::{Value, json};

use super::adapter::{Adapter, RunInput};
use super::error::AdapterError;
use super::http::HttpProvider;
use crate::http::HeadWait;
use crate::sink::RunSink;
use crate::usage::{UsageDialect, from_openai};

#[derive(Debug)]
pub struct OpenAiCompatAdapter {
    pub provider: HttpProvider,
    pub dialect: UsageDialect,
}

impl OpenAiCompatAdapter {
    pub fn new(provider: HttpProvider, dialect: UsageDialect) -> Self {
        Self { provider, dialect }
    }

    fn body(&self, input: &RunInput) -> Value {
        let mut body = input.options_json("max_tokens");
        body.insert("model".into(), json!(input.target));
        body.insert("messages".into(), json!(input.messages_json()));
        body.insert("stream".into(), json!(true));
        body.insert("stream_options".into(), json!({"include_usage": true}));
        Value::Object(body)
    }
}

#[async_trait]
impl Adapter for OpenAiCompatAdapter {
    async fn execute(&self, input: RunInput, sink: &mut RunSink) -> Result<(), AdapterError> {
        let request = self
            .provider
            .request(reqwest::Method::POST, "/chat/completions")
            .header("accept", "text/event-stream")
            .json(&self.body(&input));
        let request = self.provider.with_headers(request, &input.provider_headers);
        let response = self.provider.accepted(request, HeadWait::Streamed).await?;
        sink.start(&input.target).await?;
        let mut events = response.bytes_stream().eventsource();
        let mut usage = None;
        let mut finish = String::new();
        while let Some(event) = events.next().await {
            let event = event.map_err(|e| {
                AdapterError::new(
                    ErrorCode::BrokenStream,
                    format!("provider {} stream broke: {e}", self.provider.id),
                )
            })?;
            if event.data.trim() == "[DONE]" {
                break;
            }
            let Ok(chunk) = serde_json::from_str::<Value>(&event.data) else {
                continue;
            };
            if let Some(err) = chunk.get("error") {
                let message = err
                    .get("message")
                    .and_then(Value::as_str)
                    .unwrap_or("provider reported an error mid-stream");
                return Err(AdapterError::new(ErrorCode::ProviderError, message));
            }
            if let Some(u) = chunk
                .get("usage")
                .and_then(|u| from_openai(u, self.dialect))
            {
                usage = Some(u);
            }
            let Some(choice) = chunk.get("choices").and_then(|c| c.get(0)) else {
                continue;
            };
            if let Some(delta) = choice.get("delta") {
                let reasoning = delta
                    .get("reasoning_content")
                    .or_else(|| delta.get("reasoning"))
                    .and_then(Value::as_str);
                if let Some(text) = reasoning {
                    sink.reasoning(text).await?;
                }
                if let Some(text) = delta.get("content").and_then(Value::as_str) {
                    sink.delta(text).await?;
                }
            }
            if let Some(reason) = choice.get("finish_reason").and_then(Value::as_str) {
                finish = reason.to_string();
            }
        }
        sink.complete(usage, &finish).await?;
        Ok(())
    }
}
