//! A model's answer as normalized events, whatever produced it: its start, text and
//! reasoning deltas, complete tool calls, then exactly one ending — finished (with the reason and
//! the provider's usage) or failed. The Responses and Messages renderers read these; a
//! node run's events ([`from_run`]) and an OpenAI chat answer ([`super::chat_answer`])
//! become these.
//!
//! Pure: no I/O.

use iop_proto::pb::{self, RunEventKind};
use serde_json::Value;

use crate::http::error::ApiError;

/// One step of an answer.
#[derive(Debug, Clone)]
pub enum AnswerEvent {
    /// The node or provider accepted the request and the answer begins (renders to
    /// nothing; it lets a stream start before the first token).
    Started,
    Text(String),
    Reasoning(String),
    /// A complete call of a function tool.
    ToolCall(ToolCall),
    /// The answer ended normally (terminal).
    Finished(Finish),
    /// The answer failed (terminal).
    Failed(ApiError),
}

impl AnswerEvent {
    pub fn is_terminal(&self) -> bool {
        matches!(self, AnswerEvent::Finished(_) | AnswerEvent::Failed(_))
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// The arguments as JSON text, as OpenAI carries them.
    pub arguments: String,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Finish {
    pub reason: FinishReason,
    /// The counts the provider reported, if it did.
    pub usage: Option<pb::Usage>,
}

/// Why the model stopped, in OpenAI's terms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FinishReason {
    /// A natural end or a stop sequence.
    Stop,
    /// The token limit.
    Length,
    ToolCalls,
    ContentFilter,
    Other(String),
}

impl FinishReason {
    /// From an OpenAI `finish_reason` (or a run's), `stop` when empty.
    pub fn from_openai(reason: &str) -> Self {
        match reason {
            "" | "stop" | "end_turn" => FinishReason::Stop,
            "length" | "max_tokens" => FinishReason::Length,
            "tool_calls" | "function_call" => FinishReason::ToolCalls,
            "content_filter" => FinishReason::ContentFilter,
            other => FinishReason::Other(other.to_string()),
        }
    }
}

/// A run event as answer events.
pub fn from_run(event: pb::RunEvent) -> Vec<AnswerEvent> {
    match event.kind() {
        RunEventKind::Delta => vec![AnswerEvent::Text(event.text)],
        RunEventKind::ReasoningDelta => vec![AnswerEvent::Reasoning(event.text)],
        RunEventKind::ToolCall => event
            .tool_calls
            .into_iter()
            .map(|c| {
                AnswerEvent::ToolCall(ToolCall {
                    id: c.id,
                    name: c.name,
                    arguments: c.arguments,
                })
            })
            .collect(),
        RunEventKind::Complete => vec![AnswerEvent::Finished(Finish {
            reason: FinishReason::from_openai(&event.finish_reason),
            usage: event.usage,
        })],
        RunEventKind::Error => vec![AnswerEvent::Failed(ApiError::from_run_error(
            event.error.as_ref(),
        ))],
        RunEventKind::Cancelled => vec![AnswerEvent::Failed(ApiError::upstream(
            "cancelled",
            "the run was cancelled",
        ))],
        RunEventKind::Start => vec![AnswerEvent::Started],
        // The node's acknowledgement never reaches a consumer; nothing to show either way.
        RunEventKind::Unspecified | RunEventKind::Accepted => Vec::new(),
    }
}

/// An OpenAI `usage` object's counts; `None` if it is not an object. Counts that are
/// missing or not counts read as 0 (details as not reported).
pub fn usage_from_openai(usage: &Value) -> Option<pb::Usage> {
    let usage = usage.as_object()?;
    let count = |v: Option<&Value>| v.and_then(Value::as_u64);
    Some(pb::Usage {
        input_tokens: count(usage.get("prompt_tokens")).unwrap_or(0),
        output_tokens: count(usage.get("completion_tokens")).unwrap_or(0),
        reasoning_tokens: count(
            usage
                .get("completion_tokens_details")
                .and_then(|d| d.get("reasoning_tokens")),
        )
        .or_else(|| count(usage.get("reasoning_tokens"))),
        cached_input_tokens: count(
            usage
                .get("prompt_tokens_details")
                .and_then(|d| d.get("cached_tokens")),
        ),
    })
}

/// Tool-call arguments as a JSON object: the arguments when they are one, `{}` when
/// empty. Anything else (a model that wrote broken JSON) is kept as a string under
/// `"arguments"`, so nothing the model said is lost and the client still gets an object.
pub fn arguments_object(arguments: &str) -> Value {
    if arguments.trim().is_empty() {
        return Value::Object(Default::default());
    }
    match serde_json::from_str::<Value>(arguments) {
        Ok(v @ Value::Object(_)) => v,
        _ => serde_json::json!({"arguments": arguments}),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn run_events_become_answer_events() {
        let event = |kind: RunEventKind| pb::RunEvent {
            kind: kind as i32,
            ..Default::default()
        };
        assert!(matches!(
            &from_run(event(RunEventKind::Start))[..],
            [AnswerEvent::Started]
        ));
        assert!(from_run(event(RunEventKind::Unspecified)).is_empty());
        let mut delta = event(RunEventKind::Delta);
        delta.text = "hi".into();
        assert!(matches!(&from_run(delta)[..], [AnswerEvent::Text(t)] if t == "hi"));
        let mut calls = event(RunEventKind::ToolCall);
        calls.tool_calls = vec![
            pb::ToolCall {
                id: "a".into(),
                name: "f".into(),
                arguments: "{}".into(),
            },
            pb::ToolCall {
                id: "b".into(),
                name: "g".into(),
                arguments: "{\"x\":1}".into(),
            },
        ];
        let out = from_run(calls);
        assert_eq!(out.len(), 2);
        assert!(matches!(&out[1], AnswerEvent::ToolCall(c) if c.id == "b" && c.name == "g"));
        let mut done = event(RunEventKind::Complete);
        done.finish_reason = "length".into();
        done.usage = Some(pb::Usage {
            input_tokens: 3,
            output_tokens: 4,
            ..Default::default()
        });
        match &from_run(done)[..] {
            [AnswerEvent::Finished(f)] => {
                assert_eq!(f.reason, FinishReason::Length);
                assert_eq!(f.usage.unwrap().output_tokens, 4);
            }
            other => panic!("{other:?}"),
        }
        let mut failed = event(RunEventKind::Error);
        failed.error = Some(pb::RunError::new(iop_proto::ErrorCode::BadRequest, "no"));
        assert!(matches!(&from_run(failed)[..], [AnswerEvent::Failed(e)] if e.status == 400));
        assert!(
            matches!(&from_run(event(RunEventKind::Cancelled))[..], [AnswerEvent::Failed(e)] if e.code == "cancelled")
        );
    }

    #[test]
    fn openai_usage_with_and_without_details() {
        let u = usage_from_openai(&json!({"prompt_tokens": 5, "completion_tokens": 7,
            "completion_tokens_details": {"reasoning_tokens": 2},
            "prompt_tokens_details": {"cached_tokens": 1}}))
        .unwrap();
        assert_eq!(
            (
                u.input_tokens,
                u.output_tokens,
                u.reasoning_tokens,
                u.cached_input_tokens
            ),
            (5, 7, Some(2), Some(1))
        );
        let u = usage_from_openai(&json!({"prompt_tokens": "x", "completion_tokens": 1})).unwrap();
        assert_eq!((u.input_tokens, u.reasoning_tokens), (0, None));
        assert!(usage_from_openai(&json!(null)).is_none());
    }

    #[test]
    fn finish_reasons_and_arguments() {
        assert_eq!(FinishReason::from_openai(""), FinishReason::Stop);
        assert_eq!(
            FinishReason::from_openai("tool_calls"),
            FinishReason::ToolCalls
        );
        assert_eq!(
            FinishReason::from_openai("weird"),
            FinishReason::Other("weird".into())
        );
        assert_eq!(arguments_object(""), json!({}));
        assert_eq!(arguments_object("{\"a\":1}"), json!({"a": 1}));
        assert_eq!(arguments_object("[1]"), json!({"arguments": "[1]"}));
        assert_eq!(arguments_object("{oops"), json!({"arguments": "{oops"}));
    }
}
