//! The canonical answer as an OpenAI response: a `chat.completion` / `text_completion`
//! document, or `chat.completion.chunk` / `text_completion` SSE chunks ending in
//! `data: [DONE]`, with a usage chunk when `stream_options.include_usage` is set,
//! reasoning as `reasoning_content` and tool calls as `tool_calls`. Used for answers the
//! edge renders (runs); a tunnelled OpenAI provider's own answer passes through instead.
//!
//! Pure: the writer is fed events and returns what to send.

use iop_proto::pb;
use serde_json::{Value, json};

use super::error;
use crate::canonical::{AnswerEvent, Finish, Operation, ToolCall};

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

/// OpenAI `tool_calls` entries for `calls`, numbered from `first_index` on (a stream's
/// chunks carry the index, a document's message does not).
fn tool_calls_json(calls: &[ToolCall], first_index: Option<usize>) -> Vec<Value> {
    calls
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let mut call = json!({"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}});
            if let Some(first) = first_index {
                call["index"] = json!(first + i);
            }
            call
        })
        .collect()
}

/// Writes one answer as OpenAI's.
#[derive(Debug)]
pub struct OpenAiWriter {
    op: Operation,
    id: String,
    created: u64,
    /// The public model name (the group), as the client sent it.
    model: String,
    include_usage: bool,
    streaming: bool,
    sent_role: bool,
    content: String,
    reasoning: String,
    tool_calls: Vec<ToolCall>,
    done: Option<Value>,
}

impl OpenAiWriter {
    /// `id` is the run's; `created` in Unix seconds.
    pub fn new(
        op: Operation,
        id: &str,
        created: u64,
        model: String,
        include_usage: bool,
        streaming: bool,
    ) -> Self {
        let id = match op {
            Operation::Completion => format!("cmpl-{id}"),
            _ => format!("chatcmpl-{id}"),
        };
        Self {
            op,
            id,
            created,
            model,
            include_usage,
            streaming,
            sent_role: false,
            content: String::new(),
            reasoning: String::new(),
            tool_calls: Vec::new(),
            done: None,
        }
    }

    /// The whole answer, once it finished.
    pub fn document(&self) -> Option<&Value> {
        self.done.as_ref()
    }

    pub fn push(&mut self, event: AnswerEvent, out: &mut Vec<u8>) {
        if !self.streaming {
            return self.collect(event);
        }
        match event {
            AnswerEvent::Started | AnswerEvent::Embeddings(_) => self.role(out),
            AnswerEvent::Text(text) => {
                self.role(out);
                self.chunk(out, json!({"content": text}), None);
            }
            AnswerEvent::Reasoning(text) => {
                self.role(out);
                self.chunk(out, json!({"reasoning_content": text}), None);
            }
            AnswerEvent::ToolCalls(calls) if self.op == Operation::Chat => {
                self.role(out);
                let delta =
                    json!({"tool_calls": tool_calls_json(&calls, Some(self.tool_calls.len()))});
                self.tool_calls.extend(calls);
                self.chunk(out, delta, None);
            }
            AnswerEvent::ToolCalls(_) => {}
            AnswerEvent::Finished(finish) => {
                self.role(out);
                self.chunk(out, json!({}), Some(finish.reason.as_openai()));
                if self.include_usage
                    && let Some(usage) = &finish.usage
                {
                    let object = self.object(true);
                    data(
                        out,
                        &json!({
                            "id": self.id, "object": object, "created": self.created,
                            "model": self.model, "choices": [], "usage": usage_json(usage),
                        }),
                    );
                }
                out.extend_from_slice(b"data: [DONE]\n\n");
            }
            AnswerEvent::Failed(e) => data(out, &error::body(&e)),
        }
    }

    fn collect(&mut self, event: AnswerEvent) {
        match event {
            AnswerEvent::Text(t) => self.content.push_str(&t),
            AnswerEvent::Reasoning(t) => self.reasoning.push_str(&t),
            AnswerEvent::ToolCalls(calls) => self.tool_calls.extend(calls),
            AnswerEvent::Finished(finish) => self.done = Some(self.whole(finish)),
            AnswerEvent::Started | AnswerEvent::Embeddings(_) | AnswerEvent::Failed(_) => {}
        }
    }

    fn whole(&mut self, finish: Finish) -> Value {
        let usage = finish.usage.as_ref().map(usage_json).unwrap_or(Value::Null);
        let content = std::mem::take(&mut self.content);
        let choice = match self.op {
            Operation::Completion => json!({"index": 0, "text": content, "logprobs": null,
                                            "finish_reason": finish.reason.as_openai()}),
            _ => {
                let mut message = json!({"role": "assistant", "content": content});
                if !self.reasoning.is_empty() {
                    message["reasoning_content"] =
                        Value::String(std::mem::take(&mut self.reasoning));
                }
                if !self.tool_calls.is_empty() {
                    if message["content"] == "" {
                        message["content"] = Value::Null;
                    }
                    message["tool_calls"] = Value::Array(tool_calls_json(&self.tool_calls, None));
                }
                json!({"index": 0, "message": message, "logprobs": null,
                       "finish_reason": finish.reason.as_openai()})
            }
        };
        json!({
            "id": self.id, "object": self.object(false), "created": self.created,
            "model": self.model, "choices": [choice], "usage": usage,
        })
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.op, chunk) {
            (Operation::Completion, _) => "text_completion",
            (_, true) => "chat.completion.chunk",
            (_, false) => "chat.completion",
        }
    }

    /// The first chunk of a chat stream says who speaks.
    fn role(&mut self, out: &mut Vec<u8>) {
        if !self.sent_role && self.op == Operation::Chat {
            self.sent_role = true;
            self.chunk(out, json!({"role": "assistant", "content": ""}), None);
        }
    }

    fn chunk(&self, out: &mut Vec<u8>, delta: Value, finish: Option<&str>) {
        let choice = match self.op {
            Operation::Completion => json!({"index": 0,
                "text": delta.get("content").cloned().unwrap_or(json!("")),
                "logprobs": null, "finish_reason": finish}),
            _ => json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}),
        };
        data(
            out,
            &json!({"id": self.id, "object": self.object(true), "created": self.created,
                    "model": self.model, "choices": [choice]}),
        );
    }
}

/// One `data:` event.
fn data(out: &mut Vec<u8>, body: &Value) {
    out.extend_from_slice(b"data: ");
    serde_json::to_writer(&mut *out, body).expect("JSON values serialize");
    out.extend_from_slice(b"\n\n");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::canonical::{ApiError, FinishReason};

    fn finished(usage: Option<pb::Usage>) -> AnswerEvent {
        AnswerEvent::finished(FinishReason::Stop, usage)
    }

    fn usage() -> pb::Usage {
        pb::Usage {
            input_tokens: 3,
            output_tokens: 2,
            ..Default::default()
        }
    }

    fn stream(op: Operation, include_usage: bool, events: Vec<AnswerEvent>) -> Vec<Value> {
        let mut w = OpenAiWriter::new(op, "r1", 7, "g".into(), include_usage, true);
        let mut out = Vec::new();
        for e in events {
            w.push(e, &mut out);
        }
        let text = String::from_utf8(out).unwrap();
        assert!(text.ends_with("\n\n"), "{text}");
        text.split("\n\n")
            .filter(|e| !e.is_empty())
            .map(|e| {
                let data = e.strip_prefix("data: ").unwrap();
                if data == "[DONE]" {
                    json!("[DONE]")
                } else {
                    serde_json::from_str(data).unwrap()
                }
            })
            .collect()
    }

    #[test]
    fn a_chat_stream_is_role_deltas_finish_usage_done() {
        let chunks = stream(
            Operation::Chat,
            true,
            vec![
                AnswerEvent::Started,
                AnswerEvent::Text("Hel".into()),
                AnswerEvent::Reasoning("hm".into()),
                AnswerEvent::ToolCalls(vec![ToolCall {
                    id: "c1".into(),
                    name: "f".into(),
                    arguments: "{}".into(),
                }]),
                finished(Some(usage())),
            ],
        );
        assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(chunks[0]["id"], "chatcmpl-r1");
        assert_eq!(chunks[1]["choices"][0]["delta"]["content"], "Hel");
        assert_eq!(chunks[2]["choices"][0]["delta"]["reasoning_content"], "hm");
        assert_eq!(
            chunks[3]["choices"][0]["delta"]["tool_calls"][0],
            json!({"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}})
        );
        assert_eq!(chunks[4]["choices"][0]["finish_reason"], "stop");
        assert_eq!(chunks[5]["usage"]["total_tokens"], 5);
        assert_eq!(chunks[5]["choices"], json!([]));
        assert_eq!(chunks[6], "[DONE]");
        // Without include_usage there is no usage chunk; a failure is an error event.
        let chunks = stream(
            Operation::Completion,
            false,
            vec![
                AnswerEvent::Text("a".into()),
                AnswerEvent::Failed(ApiError::upstream("provider_error", "boom")),
            ],
        );
        assert_eq!(chunks[0]["object"], "text_completion");
        assert_eq!(chunks[0]["choices"][0]["text"], "a");
        assert_eq!(chunks[1]["error"]["message"], "boom");
    }

    #[test]
    fn a_whole_answer_is_one_document() {
        let mut w = OpenAiWriter::new(Operation::Chat, "r1", 7, "g".into(), false, false);
        let mut out = Vec::new();
        for e in [
            AnswerEvent::Started,
            AnswerEvent::Text("Hi".into()),
            AnswerEvent::ToolCalls(vec![ToolCall {
                id: "c1".into(),
                name: "f".into(),
                arguments: "{}".into(),
            }]),
        ] {
            w.push(e, &mut out);
            assert!(w.document().is_none());
        }
        w.push(finished(Some(usage())), &mut out);
        assert!(out.is_empty());
        let doc = w.document().unwrap();
        assert_eq!(doc["object"], "chat.completion");
        let message = &doc["choices"][0]["message"];
        assert_eq!(message["content"], "Hi");
        assert!(message["tool_calls"][0].get("index").is_none());
        assert_eq!(doc["usage"]["prompt_tokens"], 3);
        let mut w = OpenAiWriter::new(Operation::Completion, "r", 7, "g".into(), false, false);
        w.push(AnswerEvent::Text("x".into()), &mut out);
        w.push(finished(None), &mut out);
        let doc = w.document().unwrap();
        assert_eq!(
            (doc["id"].as_str(), doc["choices"][0]["text"].as_str()),
            (Some("cmpl-r"), Some("x"))
        );
        assert_eq!(doc["usage"], Value::Null);
    }

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
