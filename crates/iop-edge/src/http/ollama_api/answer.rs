//! A model's answer as the Ollama renderer takes it: text, thinking and tool calls as they
//! come, then one ending (done with a reason and token counts, or failed). Read from a
//! run's events ([`from_run_event`]) or from an OpenAI-compatible provider's chat or
//! completions answer — its SSE chunks ([`OpenAiChunks`]) or its JSON document
//! ([`from_openai_json`]).
//!
//! OpenAI streams tool calls in fragments (the name first, the arguments in pieces, by
//! `index`); they are put together here and given out whole, before the ending, since
//! Ollama's tool calls carry their arguments as one object.
//!
//! Pure: no I/O.

use std::collections::BTreeMap;

use iop_proto::pb::{self, RunEventKind};
use serde_json::{Map, Value};

use crate::http::error::ApiError;

#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// An object (Ollama's shape).
    pub arguments: Value,
}

/// Token counts the provider reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Counts {
    pub input: u64,
    pub output: u64,
}

#[derive(Debug, Clone)]
pub enum Event {
    Text(String),
    Thinking(String),
    ToolCalls(Vec<ToolCall>),
    Done {
        /// Ollama's `done_reason`.
        reason: String,
        counts: Option<Counts>,
    },
    Failed(ApiError),
}

impl Event {
    pub fn is_end(&self) -> bool {
        matches!(self, Event::Done { .. } | Event::Failed(_))
    }
}

/// An OpenAI finish reason as Ollama's `done_reason`: `length` stays, everything else that
/// ends an answer normally (`stop`, `tool_calls`, `content_filter`, none) is `stop`.
pub fn done_reason(finish: &str) -> String {
    match finish {
        "length" => "length".into(),
        _ => "stop".into(),
    }
}

/// Arguments given as JSON text, as the object Ollama carries: the parsed object, or,
/// for text that is not a JSON object, an empty object (logged).
pub fn arguments_object(text: &str) -> Value {
    if text.trim().is_empty() {
        return Value::Object(Map::new());
    }
    match serde_json::from_str::<Value>(text) {
        Ok(v @ Value::Object(_)) => v,
        _ => {
            tracing::debug!(
                arguments = text,
                "tool-call arguments that are not a JSON object: passed as {{}}"
            );
            Value::Object(Map::new())
        }
    }
}

/// One run event as answer events (none for a start).
pub fn from_run_event(event: pb::RunEvent) -> Option<Event> {
    Some(match event.kind() {
        RunEventKind::Delta => Event::Text(event.text),
        RunEventKind::ReasoningDelta => Event::Thinking(event.text),
        RunEventKind::ToolCall => Event::ToolCalls(
            event
                .tool_calls
                .iter()
                .map(|c| ToolCall {
                    id: c.id.clone(),
                    name: c.name.clone(),
                    arguments: arguments_object(&c.arguments),
                })
                .collect(),
        ),
        RunEventKind::Complete => Event::Done {
            reason: done_reason(&event.finish_reason),
            counts: event.usage.map(|u| Counts {
                input: u.input_tokens,
                output: u.output_tokens,
            }),
        },
        RunEventKind::Error => Event::Failed(ApiError::from_run_error(event.error.as_ref())),
        RunEventKind::Cancelled => {
            Event::Failed(ApiError::upstream("cancelled", "the run was cancelled"))
        }
        RunEventKind::Start | RunEventKind::Unspecified | RunEventKind::Accepted => return None,
    })
}

/// Token counts from an OpenAI `usage` object.
fn counts(usage: Option<&Value>) -> Option<Counts> {
    let usage = usage?.as_object()?;
    let n = |k: &str| usage.get(k).and_then(Value::as_u64).unwrap_or(0);
    Some(Counts {
        input: n("prompt_tokens"),
        output: n("completion_tokens"),
    })
}

/// The message of an OpenAI error object (or whatever the provider put in `error`).
fn error_message(error: &Value) -> String {
    error
        .get("message")
        .and_then(Value::as_str)
        .map(String::from)
        .or_else(|| error.as_str().map(String::from))
        .unwrap_or_else(|| error.to_string())
}

/// A tool call being streamed.
#[derive(Debug, Default)]
struct PartialCall {
    id: String,
    name: String,
    arguments: String,
}

/// The events of an OpenAI chat or completions event stream, chunk by chunk.
#[derive(Debug, Default)]
pub struct OpenAiChunks {
    calls: BTreeMap<u64, PartialCall>,
    finish: Option<String>,
    counts: Option<Counts>,
    ended: bool,
}

impl OpenAiChunks {
    /// The events of one SSE event's data (`[DONE]` ends the answer).
    pub fn data(&mut self, data: &str) -> Vec<Event> {
        if self.ended {
            return Vec::new();
        }
        let data = data.trim();
        if data == "[DONE]" {
            return self.end();
        }
        let Ok(chunk) = serde_json::from_str::<Value>(data) else {
            return Vec::new();
        };
        if let Some(error) = chunk.get("error") {
            self.ended = true;
            return vec![Event::Failed(ApiError::upstream(
                "provider_error",
                &error_message(error),
            ))];
        }
        if let Some(c) = counts(chunk.get("usage")) {
            self.counts = Some(c);
        }
        let mut out = Vec::new();
        let Some(choice) = chunk.pointer("/choices/0") else {
            return out;
        };
        let delta = choice.get("delta");
        let text = |key: &str| {
            delta
                .and_then(|d| d.get(key))
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
        };
        if let Some(t) = text("reasoning_content").or_else(|| text("reasoning")) {
            out.push(Event::Thinking(t.to_string()));
        }
        // Chat deltas carry `content`, completions chunks `text`.
        let content = text("content").or_else(|| {
            choice
                .get("text")
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
        });
        if let Some(t) = content {
            out.push(Event::Text(t.to_string()));
        }
        if let Some(calls) = delta
            .and_then(|d| d.get("tool_calls"))
            .and_then(Value::as_array)
        {
            for (i, call) in calls.iter().enumerate() {
                let index = call
                    .get("index")
                    .and_then(Value::as_u64)
                    .unwrap_or(i as u64);
                let partial = self.calls.entry(index).or_default();
                fn s(v: Option<&Value>) -> &str {
                    v.and_then(Value::as_str).unwrap_or_default()
                }
                if partial.id.is_empty() {
                    partial.id = s(call.get("id")).to_string();
                }
                let function = call.get("function");
                partial
                    .name
                    .push_str(s(function.and_then(|f| f.get("name"))));
                partial
                    .arguments
                    .push_str(s(function.and_then(|f| f.get("arguments"))));
            }
        }
        if let Some(reason) = choice.get("finish_reason").and_then(Value::as_str) {
            self.finish = Some(reason.to_string());
        }
        out
    }

    /// The end of the stream: the tool calls put together, then done.
    pub fn end(&mut self) -> Vec<Event> {
        if self.ended {
            return Vec::new();
        }
        self.ended = true;
        let mut out = Vec::new();
        let calls: Vec<ToolCall> = std::mem::take(&mut self.calls)
            .into_values()
            .map(|c| ToolCall {
                id: c.id,
                name: c.name,
                arguments: arguments_object(&c.arguments),
            })
            .collect();
        if !calls.is_empty() {
            out.push(Event::ToolCalls(calls));
        }
        out.push(Event::Done {
            reason: done_reason(self.finish.as_deref().unwrap_or("stop")),
            counts: self.counts,
        });
        out
    }

    /// Whether the answer has ended (`[DONE]`, an error).
    pub fn ended(&self) -> bool {
        self.ended
    }
}

/// The events of a whole OpenAI chat or completions JSON answer.
pub fn from_openai_json(answer: &Value) -> Vec<Event> {
    if let Some(error) = answer.get("error") {
        return vec![Event::Failed(ApiError::upstream(
            "provider_error",
            &error_message(error),
        ))];
    }
    let mut out = Vec::new();
    let choice = answer.pointer("/choices/0");
    let message = choice.and_then(|c| c.get("message"));
    let text = |v: Option<&Value>, key: &str| {
        v.and_then(|m| m.get(key))
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
            .map(String::from)
    };
    if let Some(t) = text(message, "reasoning_content").or_else(|| text(message, "reasoning")) {
        out.push(Event::Thinking(t));
    }
    if let Some(t) = text(message, "content").or_else(|| text(choice, "text")) {
        out.push(Event::Text(t));
    }
    if let Some(calls) = message
        .and_then(|m| m.get("tool_calls"))
        .and_then(Value::as_array)
        .filter(|c| !c.is_empty())
    {
        let s = |v: Option<&Value>| v.and_then(Value::as_str).unwrap_or_default().to_string();
        out.push(Event::ToolCalls(
            calls
                .iter()
                .map(|c| {
                    let f = c.get("function");
                    ToolCall {
                        id: s(c.get("id")),
                        name: s(f.and_then(|f| f.get("name"))),
                        arguments: arguments_object(&s(f.and_then(|f| f.get("arguments")))),
                    }
                })
                .collect(),
        ));
    }
    let finish = choice
        .and_then(|c| c.get("finish_reason"))
        .and_then(Value::as_str)
        .unwrap_or("stop");
    out.push(Event::Done {
        reason: done_reason(finish),
        counts: counts(answer.get("usage")),
    });
    out
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn texts(events: &[Event]) -> String {
        events
            .iter()
            .filter_map(|e| match e {
                Event::Text(t) => Some(t.as_str()),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_streamed_chat_gives_text_then_done_with_usage() {
        let mut c = OpenAiChunks::default();
        let mut events = Vec::new();
        for data in [
            r#"{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"reasoning_content":"hmm"}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"content":"Hel"}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"content":"lo"},"finish_reason":"length"}]}"#,
            r#"{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}"#,
            "[DONE]",
        ] {
            events.extend(c.data(data));
        }
        assert_eq!(texts(&events), "Hello");
        assert!(matches!(&events[0], Event::Thinking(t) if t == "hmm"));
        match events.last().unwrap() {
            Event::Done { reason, counts } => {
                assert_eq!(reason, "length");
                assert_eq!(
                    *counts,
                    Some(Counts {
                        input: 3,
                        output: 2
                    })
                );
            }
            other => panic!("{other:?}"),
        }
        assert!(c.ended() && c.data("{}").is_empty() && c.end().is_empty());
    }

    #[test]
    fn streamed_tool_call_fragments_are_joined() {
        let mut c = OpenAiChunks::default();
        let mut events = Vec::new();
        for data in [
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"id":"call_a","type":"function","function":{"name":"get_weather","arguments":""}}]}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"city\":"}}]}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":1,"id":"call_b","function":{"name":"now","arguments":"{}"}}]}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments":"\"Paris\"}"}}]},"finish_reason":"tool_calls"}]}"#,
        ] {
            events.extend(c.data(data));
        }
        assert!(events.is_empty(), "{events:?}");
        let events = c.end();
        let Event::ToolCalls(calls) = &events[0] else {
            panic!("{events:?}")
        };
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].id, "call_a");
        assert_eq!(calls[0].name, "get_weather");
        assert_eq!(calls[0].arguments, json!({"city": "Paris"}));
        assert_eq!(calls[1].name, "now");
        assert!(matches!(&events[1], Event::Done { reason, .. } if reason == "stop"));
    }

    #[test]
    fn an_error_event_fails_the_answer() {
        let mut c = OpenAiChunks::default();
        let events = c.data(r#"{"error":{"message":"boom","type":"server_error"}}"#);
        assert!(matches!(&events[0], Event::Failed(e) if e.message == "boom"));
        assert!(c.ended());
    }

    #[test]
    fn completions_chunks_carry_text() {
        let mut c = OpenAiChunks::default();
        let events = c.data(r#"{"choices":[{"index":0,"text":"def","finish_reason":null}]}"#);
        assert_eq!(texts(&events), "def");
    }

    #[test]
    fn a_json_answer_gives_the_same_events() {
        let events = from_openai_json(&json!({
            "choices": [{"message": {"role": "assistant", "content": "hi", "reasoning_content": "r",
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\":1}"}}]},
                "finish_reason": "tool_calls"}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 6},
        }));
        assert_eq!(events.len(), 4);
        assert_eq!(texts(&events), "hi");
        assert!(matches!(&events[2], Event::ToolCalls(c) if c[0].arguments == json!({"a": 1})));
        assert!(
            matches!(&events[3], Event::Done { counts: Some(Counts { input: 4, output: 6 }), reason } if reason == "stop")
        );
        let events =
            from_openai_json(&json!({"choices": [{"text": "raw", "finish_reason": "length"}]}));
        assert_eq!(texts(&events), "raw");
    }

    #[test]
    fn run_events_map_one_to_one() {
        let e = |kind: RunEventKind| pb::RunEvent {
            kind: kind as i32,
            text: "t".into(),
            ..Default::default()
        };
        assert!(from_run_event(e(RunEventKind::Start)).is_none());
        assert!(matches!(
            from_run_event(e(RunEventKind::Delta)),
            Some(Event::Text(_))
        ));
        assert!(matches!(
            from_run_event(e(RunEventKind::ReasoningDelta)),
            Some(Event::Thinking(_))
        ));
        let mut call = e(RunEventKind::ToolCall);
        call.tool_calls = vec![pb::ToolCall {
            id: "c".into(),
            name: "f".into(),
            arguments: "not json".into(),
        }];
        assert!(
            matches!(from_run_event(call), Some(Event::ToolCalls(c)) if c[0].arguments == json!({}))
        );
        let mut done = e(RunEventKind::Complete);
        done.finish_reason = "tool_calls".into();
        done.usage = Some(pb::Usage {
            input_tokens: 1,
            output_tokens: 2,
            ..Default::default()
        });
        assert!(
            matches!(from_run_event(done), Some(Event::Done { reason, counts: Some(_) }) if reason == "stop")
        );
        assert!(matches!(
            from_run_event(e(RunEventKind::Error)),
            Some(Event::Failed(_))
        ));
    }
}
