//! The canonical request as a node run, and a run's events as canonical answer events:
//! for adapters that are not tunnelled (Ollama, CLI, mock), the node gets a normalized run
//! ([`RunSpec`]): each message with its text, image parts, tool calls and tool-call id,
//! and `max_tokens`, `temperature`, `top_p`, `stop`, `seed`, `n`, `tools`, `tool_choice`
//! and `response_format` as generation options.
//!
//! Nothing is decided here: the adapter maps what its backend can do and refuses, with a
//! 400 naming the parameter, what it cannot.
//!
//! Pure: no I/O.

use iop_proto::pb::{self, RunEventKind};
use serde_json::{Map, Value};

use crate::canonical::{AnswerEvent, ApiError, ClientRequest, FinishReason, Operation, ToolCall};

/// A surface-neutral run submission.
#[derive(Debug, Clone, Default)]
pub struct RunSpec {
    pub adapter: String,
    pub target: String,
    pub input: String,
    pub messages: Vec<pb::ChatMessage>,
    pub options: Option<pb::GenerationOptions>,
    pub session_id: String,
    pub background: bool,
    /// The name of the API key that started the run; only it (and admins) may cancel it,
    /// and the node caps CLI sessions per owner.
    pub owner: Option<String>,
    /// The client's request id (`x-request-id`), for the node's logs.
    pub client_request_id: String,
    /// Headers the adapter adds to its provider requests (see `http::forward`).
    pub provider_headers: Vec<pb::Header>,
    /// How to bill it should its edge not receive its end.
    pub billing: Option<pb::Billing>,
}

/// The run for the canonical `request` (an `op` request) on `adapter`, for `target` (the
/// upstream model).
pub fn run_spec(request: &ClientRequest, op: Operation, adapter: &str, target: &str) -> RunSpec {
    let request = request.to_map();
    let (messages, input) = match op {
        Operation::Chat => {
            let messages = request
                .get("messages")
                .and_then(Value::as_array)
                .map(|ms| ms.iter().map(chat_message).collect())
                .unwrap_or_default();
            (messages, String::new())
        }
        _ => (Vec::new(), text_of(request.get("prompt"))),
    };
    let stop = match request.get("stop") {
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(Value::as_str)
            .map(String::from)
            .collect(),
        _ => Vec::new(),
    };
    let number = |key: &str| request.get(key).and_then(Value::as_f64).map(|t| t as f32);
    let mut options = pb::GenerationOptions {
        max_tokens: request
            .get("max_completion_tokens")
            .or_else(|| request.get("max_tokens"))
            .and_then(Value::as_u64)
            .map(|n| n.min(u32::MAX as u64) as u32),
        temperature: number("temperature"),
        top_p: number("top_p"),
        stop,
        seed: request.get("seed").and_then(Value::as_u64),
        ..Default::default()
    };
    tool_options(&request, &mut options);
    RunSpec {
        adapter: adapter.to_string(),
        target: target.to_string(),
        input,
        messages,
        options: Some(options),
        ..Default::default()
    }
}

/// A string, or the strings of an array joined by newlines.
fn text_of(value: Option<&Value>) -> String {
    match value {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(items)) => items
            .iter()
            .filter_map(Value::as_str)
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

/// A run event as answer events (none for the node's acknowledgement).
pub fn answer_events(event: pb::RunEvent) -> Vec<AnswerEvent> {
    match event.kind() {
        RunEventKind::Delta => vec![AnswerEvent::Text(event.text)],
        RunEventKind::ReasoningDelta => vec![AnswerEvent::Reasoning(event.text)],
        RunEventKind::ToolCall => vec![AnswerEvent::ToolCalls(
            event
                .tool_calls
                .into_iter()
                .map(|c| ToolCall {
                    id: c.id,
                    name: c.name,
                    arguments: c.arguments,
                })
                .collect(),
        )],
        RunEventKind::Complete => vec![AnswerEvent::finished(
            FinishReason::from_openai(&event.finish_reason),
            event.usage,
        )],
        RunEventKind::Error => vec![AnswerEvent::Failed(ApiError::from_run_error(
            event.error.as_ref(),
        ))],
        RunEventKind::Cancelled => vec![AnswerEvent::Failed(ApiError::of(
            iop_proto::ErrorCode::Cancelled,
            "the run was cancelled",
        ))],
        RunEventKind::Start => vec![AnswerEvent::Started],
        // The node's acknowledgement never reaches a consumer; nothing to show either way.
        RunEventKind::Unspecified | RunEventKind::Accepted => Vec::new(),
    }
}

/// One OpenAI chat message on the run wire. Text parts of a multi-part content are joined;
/// `image_url` parts keep their URL (a `data:` URL or a plain one) in order.
fn chat_message(message: &Value) -> pb::ChatMessage {
    let text = |v: Option<&Value>| v.and_then(Value::as_str).unwrap_or_default().to_string();
    let mut out = pb::ChatMessage {
        role: message
            .get("role")
            .and_then(Value::as_str)
            .unwrap_or("user")
            .to_string(),
        tool_call_id: text(message.get("tool_call_id")),
        name: text(message.get("name")),
        ..Default::default()
    };
    match message.get("content") {
        Some(Value::String(s)) => out.content = s.clone(),
        Some(Value::Array(parts)) => {
            for part in parts {
                if let Some(t) = part.get("text").and_then(Value::as_str) {
                    out.content.push_str(t);
                }
                // `{"image_url": {"url": …}}`, or the older `{"image_url": "…"}`.
                let image = part.get("image_url");
                if let Some(url) = image
                    .and_then(|i| i.get("url"))
                    .or(image)
                    .and_then(Value::as_str)
                {
                    out.image_urls.push(url.to_string());
                }
            }
        }
        _ => {}
    }
    if let Some(calls) = message.get("tool_calls").and_then(Value::as_array) {
        out.tool_calls = calls
            .iter()
            .map(|call| {
                let function = call.get("function");
                pb::ToolCall {
                    id: text(call.get("id")),
                    name: text(function.and_then(|f| f.get("name"))),
                    // A string holding JSON, as OpenAI sends it; a client that sent the
                    // object itself gets it as text.
                    arguments: match function.and_then(|f| f.get("arguments")) {
                        Some(Value::String(s)) => s.clone(),
                        None | Some(Value::Null) => String::new(),
                        Some(other) => other.to_string(),
                    },
                }
            })
            .collect();
    }
    out
}

/// Sets `n`, `tools`, `tool_choice` and `response_format` from the request (absent or
/// `null` leaves them unset).
fn tool_options(request: &Map<String, Value>, options: &mut pb::GenerationOptions) {
    let json = |key: &str| match request.get(key) {
        None | Some(Value::Null) => String::new(),
        Some(v) => v.to_string(),
    };
    options.tools_json = json("tools");
    options.tool_choice_json = json("tool_choice");
    options.response_format_json = json("response_format");
    options.n = request
        .get("n")
        .and_then(Value::as_u64)
        .map(|n| n.min(u32::MAX as u64) as u32);
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn parts_images_and_tool_calls_reach_the_wire() {
        let m = chat_message(&json!({"role": "user", "content": [
            {"type": "text", "text": "what is "},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            {"type": "text", "text": "this?"},
            {"type": "image_url", "image_url": "https://example.invalid/cat.png"},
        ]}));
        assert_eq!(m.content, "what is this?");
        assert_eq!(
            m.image_urls,
            [
                "data:image/png;base64,AAAA",
                "https://example.invalid/cat.png"
            ]
        );

        let m = chat_message(
            &json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}},
                {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": {}}},
            ]}),
        );
        assert_eq!(m.content, "");
        assert_eq!(m.tool_calls.len(), 2);
        assert_eq!(
            (
                m.tool_calls[0].id.as_str(),
                m.tool_calls[0].name.as_str(),
                m.tool_calls[0].arguments.as_str()
            ),
            ("call_1", "get_weather", "{\"city\":\"Paris\"}")
        );
        assert_eq!(m.tool_calls[1].arguments, "{}");

        let m = chat_message(
            &json!({"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny"}),
        );
        assert_eq!(
            (m.role.as_str(), m.tool_call_id.as_str(), m.name.as_str()),
            ("tool", "call_1", "get_weather")
        );
    }

    #[test]
    fn run_spec_carries_messages_and_options() {
        let body = json!({
            "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
            "max_tokens": 5, "temperature": 0.5, "stop": "x", "seed": 3
        })
        .to_string();
        let request = ClientRequest::parse(body.as_bytes()).unwrap();
        let spec = run_spec(&request, Operation::Chat, "ollama", "llama3");
        assert_eq!(spec.messages.len(), 2);
        assert_eq!(spec.messages[0].role, "system");
        let o = spec.options.unwrap();
        assert_eq!(o.max_tokens, Some(5));
        assert_eq!(o.stop, vec!["x".to_string()]);
        assert_eq!(o.seed, Some(3));
        assert_eq!(
            (spec.adapter.as_str(), spec.target.as_str()),
            ("ollama", "llama3")
        );
        let body = json!({"prompt": ["a", "b"]}).to_string();
        let request = ClientRequest::parse(body.as_bytes()).unwrap();
        assert_eq!(
            run_spec(&request, Operation::Completion, "m", "t").input,
            "a\nb"
        );
    }

    #[test]
    fn run_events_become_answer_events() {
        let event = |kind: RunEventKind| pb::RunEvent {
            kind: kind as i32,
            ..Default::default()
        };
        assert_eq!(
            answer_events(event(RunEventKind::Start)),
            [AnswerEvent::Started]
        );
        assert!(answer_events(event(RunEventKind::Accepted)).is_empty());
        let mut delta = event(RunEventKind::Delta);
        delta.text = "hi".into();
        assert_eq!(answer_events(delta), [AnswerEvent::Text("hi".into())]);
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
        assert!(
            matches!(&answer_events(calls)[..], [AnswerEvent::ToolCalls(c)] if c.len() == 2 && c[1].name == "g")
        );
        let mut done = event(RunEventKind::Complete);
        done.finish_reason = "length".into();
        done.usage = Some(pb::Usage {
            input_tokens: 3,
            output_tokens: 4,
            ..Default::default()
        });
        match &answer_events(done)[..] {
            [AnswerEvent::Finished(f)] => {
                assert_eq!(f.reason, FinishReason::Length);
                assert_eq!(f.usage.unwrap().output_tokens, 4);
            }
            other => panic!("{other:?}"),
        }
        let mut failed = event(RunEventKind::Error);
        failed.error = Some(pb::RunError::new(iop_proto::ErrorCode::BadRequest, "no"));
        assert!(matches!(&answer_events(failed)[..], [AnswerEvent::Failed(e)] if e.status == 400));
        assert!(
            matches!(&answer_events(event(RunEventKind::Cancelled))[..], [AnswerEvent::Failed(e)] if e.code() == "cancelled")
        );
    }

    #[test]
    fn tool_fields_travel_as_json_text() {
        let request = json!({
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
            "tool_choice": "auto",
            "response_format": {"type": "json_object"},
            "n": 2,
        });
        let mut options = pb::GenerationOptions::default();
        tool_options(request.as_object().unwrap(), &mut options);
        let back: Value = serde_json::from_str(&options.tools_json).unwrap();
        assert_eq!(back, request["tools"]);
        assert_eq!(options.tool_choice_json, "\"auto\"");
        assert_eq!(options.response_format_json, r#"{"type":"json_object"}"#);
        assert_eq!(options.n, Some(2));

        let mut options = pb::GenerationOptions::default();
        tool_options(json!({"tools": null}).as_object().unwrap(), &mut options);
        assert!(options.tools_json.is_empty() && options.n.is_none());
    }
}
