//! The canonical answer: a model's answer as one stream of events, whatever produced it
//! (a node run, a tunnelled OpenAI-compatible answer) and whichever API the client
//! speaks. It starts, carries text and reasoning deltas and complete tool calls (or an
//! embeddings answer's vectors), then ends exactly once — finished (with the reason and
//! the provider's usage) or failed.
//!
//! Provider codecs (`codec::run`, `codec::openai_answer`) produce these; every surface's
//! renderer reads them.
//!
//! Pure: no I/O.

use iop_proto::pb;
use serde_json::Value;

use super::error::ApiError;

/// One step of an answer.
#[derive(Debug, Clone, PartialEq)]
pub enum AnswerEvent {
    /// The node or provider accepted the request and the answer begins (renders to
    /// nothing; it lets a stream start before the first token).
    Started,
    Text(String),
    Reasoning(String),
    /// Complete calls of function tools, in the order the model made them.
    ToolCalls(Vec<ToolCall>),
    /// An embeddings answer's vectors, in the order of the inputs.
    Embeddings(Vec<Value>),
    /// The answer ended normally (terminal).
    Finished(Finish),
    /// The answer failed (terminal).
    Failed(ApiError),
}

impl AnswerEvent {
    /// The normal end, for `reason`, with the usage the provider reported.
    pub fn finished(reason: FinishReason, usage: Option<pb::Usage>) -> Self {
        AnswerEvent::Finished(Finish { reason, usage })
    }

    pub fn is_terminal(&self) -> bool {
        matches!(self, AnswerEvent::Finished(_) | AnswerEvent::Failed(_))
    }

    /// Whether the event carries generated output (what a client that leaves early was
    /// sent, counted as an estimate when the provider reports no usage).
    pub fn is_output(&self) -> bool {
        matches!(
            self,
            AnswerEvent::Text(_) | AnswerEvent::Reasoning(_) | AnswerEvent::ToolCalls(_)
        )
    }

    /// Bytes of output the event adds to an answer (what a whole answer holds).
    pub fn output_bytes(&self) -> usize {
        match self {
            AnswerEvent::Text(t) | AnswerEvent::Reasoning(t) => t.len(),
            AnswerEvent::ToolCalls(calls) => calls
                .iter()
                .map(|c| c.id.len() + c.name.len() + c.arguments.len())
                .sum(),
            _ => 0,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// The arguments as JSON text, as OpenAI carries them.
    pub arguments: String,
}

impl ToolCall {
    /// The arguments as a JSON object: `{}` when empty, `None` when they are not an object
    /// (a model that wrote broken JSON; each API decides what to show then).
    pub fn arguments_object(&self) -> Option<Value> {
        if self.arguments.trim().is_empty() {
            return Some(Value::Object(Default::default()));
        }
        match serde_json::from_str::<Value>(&self.arguments) {
            Ok(v @ Value::Object(_)) => Some(v),
            _ => None,
        }
    }
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

    /// OpenAI's `finish_reason`.
    pub fn as_openai(&self) -> &str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::ToolCalls => "tool_calls",
            FinishReason::ContentFilter => "content_filter",
            FinishReason::Other(other) => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn finish_reasons_round_trip_and_arguments_read_as_objects() {
        for reason in ["stop", "length", "tool_calls", "content_filter", "weird"] {
            assert_eq!(FinishReason::from_openai(reason).as_openai(), reason);
        }
        assert_eq!(FinishReason::from_openai(""), FinishReason::Stop);
        let call = |arguments: &str| ToolCall {
            id: "c".into(),
            name: "f".into(),
            arguments: arguments.into(),
        };
        assert_eq!(call("").arguments_object(), Some(json!({})));
        assert_eq!(call("{\"a\":1}").arguments_object(), Some(json!({"a": 1})));
        assert_eq!(call("[1]").arguments_object(), None);
        assert_eq!(call("{oops").arguments_object(), None);
        let calls = AnswerEvent::ToolCalls(vec![call("{}")]);
        assert!(calls.is_output() && !calls.is_terminal());
        assert_eq!(calls.output_bytes(), 4);
    }
}
