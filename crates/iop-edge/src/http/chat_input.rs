//! An OpenAI chat request's conversation and tool fields as the run wire carries them to
//! adapters that are not tunnelled (Ollama, CLI, mock): each message with its text, image
//! parts, tool calls and tool-call id, and `n`, `tools`, `tool_choice` and
//! `response_format` as generation options.
//!
//! Nothing is decided here: the adapter maps what its backend can do and refuses, with a
//! 400 naming the parameter, what it cannot.

use iop_proto::pb;
use serde_json::{Map, Value};

/// One OpenAI chat message on the run wire. Text parts of a multi-part content are joined;
/// `image_url` parts keep their URL (a `data:` URL or a plain one) in order.
pub fn chat_message(message: &Value) -> pb::ChatMessage {
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
pub fn tool_options(request: &Map<String, Value>, options: &mut pb::GenerationOptions) {
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
