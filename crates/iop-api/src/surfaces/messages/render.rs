//! Answer events as the Messages API's `message` object and its stream: content blocks
//! (`thinking`, `text`, `tool_use`), the `stop_reason` and `usage`; the stream sends
//! `message_start` and a `ping`, then per block `content_block_start`, its deltas
//! (`text_delta`, `thinking_delta`, `input_json_delta`) and `content_block_stop`, and
//! ends with `message_delta` (stop reason and usage) and `message_stop`, or an `error`
//! event.
//!
//! Usage in Anthropic's terms: `input_tokens` counts the prompt tokens not read from a
//! cache, `cache_read_input_tokens` those that were (when the provider reports them).
//! Translated answers learn their usage at the end, so `message_start` carries zeros and
//! `message_delta` the counts (input tokens included, as the API allows).
//!
//! Pure: the writer is fed events and returns what to send.

use iop_proto::pb;
use serde_json::{Value, json};

use super::error;
use crate::canonical::{AnswerEvent, Finish, FinishReason, ToolCall};
use crate::surfaces::sse::{EventWriter, SseEvent};

/// The Messages `usage` object.
pub fn usage_json(usage: &pb::Usage) -> Value {
    let cached = usage.cached_input_tokens;
    let mut u = json!({
        "input_tokens": usage.input_tokens.saturating_sub(cached.unwrap_or(0)),
        "output_tokens": usage.output_tokens,
    });
    if let Some(cached) = cached {
        u["cache_read_input_tokens"] = json!(cached);
    }
    u
}

/// Anthropic's `stop_reason`.
pub fn stop_reason(reason: &FinishReason) -> &'static str {
    match reason {
        FinishReason::Length => "max_tokens",
        FinishReason::ToolCalls => "tool_use",
        FinishReason::ContentFilter => "refusal",
        FinishReason::Stop | FinishReason::Other(_) => "end_turn",
    }
}

#[derive(Debug)]
enum Open {
    Text(String),
    Thinking(String),
}

/// Builds one message from answer events.
#[derive(Debug)]
pub struct MessageWriter {
    /// `msg_…`
    id: String,
    model: String,
    streaming: bool,
    content: Vec<Value>,
    open: Option<Open>,
    done: Option<Value>,
}

impl MessageWriter {
    pub fn new(id: String, model: String, streaming: bool) -> Self {
        Self {
            id,
            model,
            streaming,
            content: Vec::new(),
            open: None,
            done: None,
        }
    }

    fn tool_use(&mut self, call: ToolCall, out: &mut Vec<SseEvent>) {
        // Arguments that are not a JSON object (a model that wrote broken JSON) are kept
        // as a string, so nothing the model said is lost and the client still gets an
        // object.
        let input = call
            .arguments_object()
            .unwrap_or_else(|| json!({"arguments": call.arguments}));
        let id = if call.id.is_empty() {
            format!("toolu_{}_{}", self.base(), self.content.len())
        } else {
            call.id
        };
        let block = json!({"type": "tool_use", "id": id, "name": call.name, "input": {}});
        self.block_start(out, block.clone());
        let delta = json!({"type": "input_json_delta", "partial_json": input.to_string()});
        self.delta(out, delta);
        let mut block = block;
        block["input"] = input;
        self.block_stop(out, block);
    }

    fn close(&mut self, out: &mut Vec<SseEvent>) {
        let block = match self.open.take() {
            None => return,
            Some(Open::Text(text)) => json!({"type": "text", "text": text}),
            Some(Open::Thinking(thinking)) => {
                json!({"type": "thinking", "thinking": thinking, "signature": ""})
            }
        };
        self.block_stop(out, block);
    }

    fn finish(&mut self, finish: Finish, out: &mut Vec<SseEvent>) {
        let stop = stop_reason(&finish.reason);
        let usage = finish
            .usage
            .as_ref()
            .map(usage_json)
            .unwrap_or_else(|| json!({"input_tokens": 0, "output_tokens": 0}));
        self.emit(
            out,
            "message_delta",
            json!({"delta": {"stop_reason": stop, "stop_sequence": null}, "usage": usage}),
        );
        self.emit(out, "message_stop", json!({}));
        self.done = Some(self.object(json!(stop), usage));
    }

    fn object(&self, stop_reason: Value, usage: Value) -> Value {
        json!({
            "id": self.id, "type": "message", "role": "assistant", "model": self.model,
            "content": if stop_reason.is_null() { json!([]) } else { Value::Array(self.content.clone()) },
            "stop_reason": stop_reason, "stop_sequence": null, "usage": usage,
        })
    }

    fn base(&self) -> &str {
        self.id.strip_prefix("msg_").unwrap_or(&self.id)
    }

    fn block_start(&mut self, out: &mut Vec<SseEvent>, block: Value) {
        let index = self.content.len();
        self.emit(
            out,
            "content_block_start",
            json!({"index": index, "content_block": block}),
        );
    }

    fn delta(&mut self, out: &mut Vec<SseEvent>, delta: Value) {
        let index = self.content.len();
        self.emit(
            out,
            "content_block_delta",
            json!({"index": index, "delta": delta}),
        );
    }

    fn block_stop(&mut self, out: &mut Vec<SseEvent>, block: Value) {
        let index = self.content.len();
        self.emit(out, "content_block_stop", json!({"index": index}));
        self.content.push(block);
    }

    fn emit(&mut self, out: &mut Vec<SseEvent>, name: &'static str, data: Value) {
        if !self.streaming {
            return;
        }
        let mut data = data;
        data["type"] = json!(name);
        out.push(SseEvent::new(name, data));
    }
}

impl EventWriter for MessageWriter {
    /// The events that open a stream.
    fn start(&mut self, out: &mut Vec<SseEvent>) {
        let message = self.object(Value::Null, json!({"input_tokens": 0, "output_tokens": 0}));
        self.emit(out, "message_start", json!({"message": message}));
        self.emit(out, "ping", json!({}));
    }

    /// The message object, once the answer finished (`None` before, and after a failure).
    fn finished(&self) -> Option<&Value> {
        self.done.as_ref()
    }

    fn push(&mut self, event: AnswerEvent, out: &mut Vec<SseEvent>) {
        match event {
            AnswerEvent::Started | AnswerEvent::Embeddings(_) => {}
            AnswerEvent::Text(text) => {
                if !matches!(self.open, Some(Open::Text(_))) {
                    self.close(out);
                    self.block_start(out, json!({"type": "text", "text": ""}));
                    self.open = Some(Open::Text(String::new()));
                }
                let delta = json!({"type": "text_delta", "text": text});
                self.delta(out, delta);
                // A stream sends the text as it comes; only a JSON answer keeps it.
                if let Some(Open::Text(all)) = &mut self.open
                    && !self.streaming
                {
                    all.push_str(&text);
                }
            }
            AnswerEvent::Reasoning(text) => {
                if !matches!(self.open, Some(Open::Thinking(_))) {
                    self.close(out);
                    let block = json!({"type": "thinking", "thinking": "", "signature": ""});
                    self.block_start(out, block);
                    self.open = Some(Open::Thinking(String::new()));
                }
                let delta = json!({"type": "thinking_delta", "thinking": text});
                self.delta(out, delta);
                if let Some(Open::Thinking(all)) = &mut self.open
                    && !self.streaming
                {
                    all.push_str(&text);
                }
            }
            AnswerEvent::ToolCalls(calls) => {
                self.close(out);
                for call in calls {
                    self.tool_use(call, out);
                }
            }
            AnswerEvent::Finished(finish) => {
                self.close(out);
                self.finish(finish, out);
            }
            AnswerEvent::Failed(e) => {
                if self.streaming {
                    out.push(error::event(&e));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::canonical::ApiError;

    fn usage() -> pb::Usage {
        pb::Usage {
            input_tokens: 10,
            output_tokens: 4,
            reasoning_tokens: None,
            cached_input_tokens: Some(3),
        }
    }

    fn run(events: Vec<AnswerEvent>, streaming: bool) -> (Vec<SseEvent>, Option<Value>) {
        MessageWriter::new("msg_m1".into(), "g".into(), streaming).render(events, streaming)
    }

    fn finished(reason: FinishReason) -> AnswerEvent {
        AnswerEvent::finished(reason, Some(usage()))
    }

    #[test]
    fn a_json_answer_has_its_blocks_stop_reason_and_usage() {
        let (events, m) = run(
            vec![
                AnswerEvent::Reasoning("hmm".into()),
                AnswerEvent::Text("Hi".into()),
                AnswerEvent::ToolCalls(vec![ToolCall {
                    id: "call_1".into(),
                    name: "lookup".into(),
                    arguments: "{\"q\":\"x\"}".into(),
                }]),
                finished(FinishReason::ToolCalls),
            ],
            false,
        );
        assert!(events.is_empty());
        assert_eq!(
            m.unwrap(),
            json!({"id": "msg_m1", "type": "message", "role": "assistant", "model": "g",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": ""},
                    {"type": "text", "text": "Hi"},
                    {"type": "tool_use", "id": "call_1", "name": "lookup", "input": {"q": "x"}}],
                "stop_reason": "tool_use", "stop_sequence": null,
                "usage": {"input_tokens": 7, "output_tokens": 4, "cache_read_input_tokens": 3}})
        );
    }

    #[test]
    fn the_stream_is_the_golden_event_sequence() {
        let (events, _) = run(
            vec![
                AnswerEvent::Text("Hel".into()),
                AnswerEvent::Text("lo".into()),
                AnswerEvent::ToolCalls(vec![ToolCall {
                    id: String::new(),
                    name: "f".into(),
                    arguments: String::new(),
                }]),
                finished(FinishReason::Length),
            ],
            true,
        );
        let names: Vec<&str> = events.iter().map(|e| e.name).collect();
        assert_eq!(
            names,
            [
                "message_start",
                "ping",
                "content_block_start",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop",
            ]
        );
        for e in &events {
            assert_eq!(e.data["type"], e.name);
        }
        let start = &events[0].data["message"];
        assert_eq!(start["content"], json!([]));
        assert_eq!(start["stop_reason"], Value::Null);
        assert_eq!(
            start["usage"],
            json!({"input_tokens": 0, "output_tokens": 0})
        );
        assert_eq!(
            events[2].data["content_block"],
            json!({"type": "text", "text": ""})
        );
        assert_eq!(
            events[3].data["delta"],
            json!({"type": "text_delta", "text": "Hel"})
        );
        assert_eq!(events[5].data["index"], 0);
        assert_eq!(
            events[6].data["content_block"],
            json!({"type": "tool_use", "id": "toolu_m1_1", "name": "f", "input": {}})
        );
        assert_eq!(
            events[7].data["delta"],
            json!({"type": "input_json_delta", "partial_json": "{}"})
        );
        assert_eq!(events[8].data["index"], 1);
        assert_eq!(
            events[9].data["delta"],
            json!({"stop_reason": "max_tokens", "stop_sequence": null})
        );
        assert_eq!(events[9].data["usage"]["output_tokens"], 4);
    }

    #[test]
    fn thinking_streams_as_thinking_deltas_and_failures_as_error_events() {
        let (events, m) = run(
            vec![
                AnswerEvent::Reasoning("a".into()),
                AnswerEvent::Failed(ApiError::upstream("provider_stream_error", "boom")),
            ],
            true,
        );
        assert!(m.is_none());
        assert_eq!(
            events[2].data["content_block"],
            json!({"type": "thinking", "thinking": "", "signature": ""})
        );
        assert_eq!(
            events[3].data["delta"],
            json!({"type": "thinking_delta", "thinking": "a"})
        );
        let last = events.last().unwrap();
        assert_eq!(last.name, "error");
        assert_eq!(
            last.data,
            json!({"type": "error", "error": {"type": "api_error", "message": "boom"}})
        );
    }

    #[test]
    fn stop_reasons_and_usage_without_cache() {
        assert_eq!(stop_reason(&FinishReason::Stop), "end_turn");
        assert_eq!(stop_reason(&FinishReason::Length), "max_tokens");
        assert_eq!(stop_reason(&FinishReason::ToolCalls), "tool_use");
        let u = usage_json(&pb::Usage {
            input_tokens: 5,
            output_tokens: 2,
            ..Default::default()
        });
        assert_eq!(u, json!({"input_tokens": 5, "output_tokens": 2}));
    }
}
