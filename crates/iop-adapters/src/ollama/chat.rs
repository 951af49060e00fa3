//! A run as Ollama's `POST /api/chat` body, and Ollama's tool calls back as run events.
//!
//! What the client asked in OpenAI's terms, in Ollama's:
//! - messages keep their role and text; `image_url` parts must be `data:` URLs, whose
//!   base64 goes into the message's `images` (Ollama does not fetch URLs);
//! - an assistant message's `tool_calls` become Ollama tool calls (`function.arguments`
//!   parsed from OpenAI's JSON text into the object Ollama takes, the id kept); a `tool`
//!   message keeps its `tool_call_id` and gets the `tool_name` Ollama matches results by
//!   (its `name`, or the name of the call with that id earlier in the conversation);
//! - `tools` pass as they are (Ollama takes OpenAI's function-tool shape); `tool_choice`
//!   `none` sends no tools, a named function sends only that tool, `auto` and `required`
//!   send them all (Ollama cannot force a call);
//! - `response_format` becomes `format`: `json_object` → `"json"`, `json_schema` → its
//!   schema, `text` → nothing;
//! - `n` above 1 is refused: Ollama answers one choice.
//!
//! What cannot be mapped is refused with `bad_request` (a 400 to the client) naming the
//! parameter, never dropped.

use iop_proto::pb;
use serde_json::{Map, Value, json};

use crate::adapter::RunInput;
use crate::error::AdapterError;

/// The `/api/chat` body for a run, or why the request cannot go to Ollama.
pub fn request_body(input: &RunInput) -> Result<Value, AdapterError> {
    let o = &input.options;
    if let Some(n) = o.n.filter(|n| *n > 1) {
        return Err(bad_request(format!(
            "`n` is {n}, but Ollama answers with one choice: send n = 1 (or leave it out)"
        )));
    }
    let mut body = json!({
        "model": input.target,
        "messages": messages(&input.chat_messages())?,
        "stream": true,
        "options": input.options_json("num_predict"),
    });
    if let Some(tools) = tools(&o.tools_json, &o.tool_choice_json)? {
        body["tools"] = tools;
    }
    if let Some(format) = format(&o.response_format_json)? {
        body["format"] = format;
    }
    Ok(body)
}

fn bad_request(message: String) -> AdapterError {
    AdapterError::new(iop_proto::ErrorCode::BadRequest, message)
}

fn messages(messages: &[pb::ChatMessage]) -> Result<Vec<Value>, AdapterError> {
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let mut out = json!({"role": m.role, "content": m.content});
            if !m.image_urls.is_empty() {
                let images = m
                    .image_urls
                    .iter()
                    .map(|url| inline_image(url))
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| {
                        bad_request(format!(
                            "`messages[{i}].content`: Ollama takes images inline only; give each \
                             `image_url` as a base64 data URL (data:image/png;base64,...)"
                        ))
                    })?;
                out["images"] = json!(images);
            }
            if !m.tool_calls.is_empty() {
                let calls = m
                    .tool_calls
                    .iter()
                    .enumerate()
                    .map(|(j, call)| tool_call(call).map_err(|e| {
                        bad_request(format!(
                            "`messages[{i}].tool_calls[{j}].function.arguments` must be a JSON object: {e}"
                        ))
                    }))
                    .collect::<Result<Vec<_>, _>>()?;
                out["tool_calls"] = Value::Array(calls);
            }
            if !m.tool_call_id.is_empty() {
                out["tool_call_id"] = json!(m.tool_call_id);
            }
            if m.role == "tool" {
                let name = if m.name.is_empty() {
                    called_name(&messages[..i], &m.tool_call_id)
                } else {
                    Some(m.name.as_str())
                };
                if let Some(name) = name {
                    out["tool_name"] = json!(name);
                }
            }
            Ok(out)
        })
        .collect()
}

/// The base64 of a `data:…;base64,` URL.
fn inline_image(url: &str) -> Option<&str> {
    let rest = url.strip_prefix("data:")?;
    let (meta, data) = rest.split_once(',')?;
    (meta.ends_with(";base64") || meta == "base64").then_some(data)
}

/// An OpenAI tool call (arguments as JSON text) as Ollama's (arguments as an object).
fn tool_call(call: &pb::ToolCall) -> Result<Value, String> {
    let arguments = if call.arguments.trim().is_empty() {
        Value::Object(Map::new())
    } else {
        match serde_json::from_str::<Value>(&call.arguments) {
            Ok(v @ Value::Object(_)) => v,
            Ok(_) => return Err("it is JSON, but not an object".into()),
            Err(e) => return Err(e.to_string()),
        }
    };
    let mut out = json!({"function": {"name": call.name, "arguments": arguments}});
    if !call.id.is_empty() {
        out["id"] = json!(call.id);
    }
    Ok(out)
}

/// The function name of the latest call with `id` among `earlier` messages.
fn called_name<'a>(earlier: &'a [pb::ChatMessage], id: &str) -> Option<&'a str> {
    if id.is_empty() {
        return None;
    }
    earlier
        .iter()
        .rev()
        .flat_map(|m| m.tool_calls.iter().rev())
        .find(|c| c.id == id)
        .map(|c| c.name.as_str())
}

/// The tools to send, after `tool_choice`.
fn tools(tools_json: &str, choice_json: &str) -> Result<Option<Value>, AdapterError> {
    if tools_json.is_empty() {
        return Ok(None);
    }
    let tools: Vec<Value> = serde_json::from_str(tools_json)
        .map_err(|_| bad_request("`tools` must be an array of tool objects".into()))?;
    for (i, tool) in tools.iter().enumerate() {
        if tool.get("type").and_then(Value::as_str) != Some("function")
            || tool
                .pointer("/function/name")
                .and_then(Value::as_str)
                .is_none()
        {
            return Err(bad_request(format!(
                "`tools[{i}]`: Ollama takes function tools only: \
                 {{\"type\": \"function\", \"function\": {{\"name\": ..., \"parameters\": ...}}}}"
            )));
        }
    }
    if tools.is_empty() {
        return Ok(None);
    }
    let choice: Value = if choice_json.is_empty() {
        Value::Null
    } else {
        serde_json::from_str(choice_json).unwrap_or(Value::Null)
    };
    match &choice {
        Value::Null => Ok(Some(Value::Array(tools))),
        Value::String(s) if s == "auto" || s == "required" => Ok(Some(Value::Array(tools))),
        Value::String(s) if s == "none" => Ok(None),
        Value::Object(_) => {
            let Some(name) = choice.pointer("/function/name").and_then(Value::as_str) else {
                return Err(bad_request(
                    "`tool_choice` must be \"none\", \"auto\", \"required\" or \
                     {\"type\": \"function\", \"function\": {\"name\": ...}}"
                        .into(),
                ));
            };
            let chosen: Vec<Value> = tools
                .into_iter()
                .filter(|t| t.pointer("/function/name").and_then(Value::as_str) == Some(name))
                .collect();
            if chosen.is_empty() {
                return Err(bad_request(format!(
                    "`tool_choice` names function {name:?}, which is not in `tools`"
                )));
            }
            Ok(Some(Value::Array(chosen)))
        }
        _ => Err(bad_request(
            "`tool_choice` must be \"none\", \"auto\", \"required\" or an object naming a function"
                .into(),
        )),
    }
}

/// Ollama's `format` for an OpenAI `response_format`.
fn format(response_format_json: &str) -> Result<Option<Value>, AdapterError> {
    if response_format_json.is_empty() {
        return Ok(None);
    }
    let format: Value = serde_json::from_str(response_format_json).unwrap_or(Value::Null);
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json!("json"))),
        Some("json_schema") => match format.pointer("/json_schema/schema") {
            Some(schema @ Value::Object(_)) => Ok(Some(schema.clone())),
            _ => Err(bad_request(
                "`response_format.json_schema.schema` must be a JSON schema object".into(),
            )),
        },
        Some(other) => Err(bad_request(format!(
            "`response_format.type` {other:?} is not supported by Ollama: use \"text\", \
             \"json_object\" or \"json_schema\""
        ))),
        None => Err(bad_request(
            "`response_format` must be an object with a `type`".into(),
        )),
    }
}

/// The tool calls of one answer line (`message.tool_calls`) as run-event tool calls.
/// A call without an id gets `call_<run>_<n>`, `n` counting the run's calls.
pub fn answer_tool_calls(message: &Value, run_id: &str, seen: &mut usize) -> Vec<pb::ToolCall> {
    let Some(calls) = message.get("tool_calls").and_then(Value::as_array) else {
        return Vec::new();
    };
    calls
        .iter()
        .map(|call| {
            let function = call.get("function");
            let id = match call.get("id").and_then(Value::as_str) {
                Some(id) if !id.is_empty() => id.to_string(),
                _ => format!("call_{run_id}_{seen}"),
            };
            *seen += 1;
            pb::ToolCall {
                id,
                name: function
                    .and_then(|f| f.get("name"))
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_string(),
                arguments: match function.and_then(|f| f.get("arguments")) {
                    Some(Value::String(s)) => s.clone(),
                    None | Some(Value::Null) => "{}".to_string(),
                    Some(other) => other.to_string(),
                },
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(role: &str, content: &str) -> pb::ChatMessage {
        pb::ChatMessage {
            role: role.into(),
            content: content.into(),
            ..Default::default()
        }
    }

    fn input(messages: Vec<pb::ChatMessage>, options: pb::GenerationOptions) -> RunInput {
        RunInput {
            run_id: "r1".into(),
            target: "llama3".into(),
            messages,
            options,
            ..Default::default()
        }
    }

    fn err(input: &RunInput) -> String {
        let e = request_body(input).unwrap_err();
        assert_eq!(e.code, iop_proto::ErrorCode::BadRequest);
        e.message
    }

    #[test]
    fn a_plain_chat_has_no_extra_fields() {
        let body = request_body(&input(
            vec![message("user", "hi")],
            pb::GenerationOptions {
                max_tokens: Some(5),
                stop: vec!["x".into()],
                ..Default::default()
            },
        ))
        .unwrap();
        assert_eq!(
            body,
            json!({"model": "llama3", "messages": [{"role": "user", "content": "hi"}],
                   "stream": true, "options": {"num_predict": 5, "stop": ["x"]}})
        );
    }

    #[test]
    fn images_go_inline_as_base64() {
        let mut m = message("user", "what is this?");
        m.image_urls = vec![
            "data:image/png;base64,iVBORw0KGgo=".into(),
            "data:;base64,AAAA".into(),
        ];
        let body = request_body(&input(vec![m.clone()], Default::default())).unwrap();
        assert_eq!(
            body["messages"][0],
            json!({"role": "user", "content": "what is this?", "images": ["iVBORw0KGgo=", "AAAA"]})
        );
        m.image_urls = vec!["https://example.invalid/cat.png".into()];
        let text = err(&input(vec![message("system", "s"), m], Default::default()));
        assert!(
            text.contains("messages[1].content") && text.contains("data URL"),
            "{text}"
        );
    }

    #[test]
    fn tool_calls_and_results_keep_their_ids_and_names() {
        let mut assistant = message("assistant", "");
        assistant.tool_calls = vec![
            pb::ToolCall {
                id: "call_a".into(),
                name: "get_weather".into(),
                arguments: r#"{"city":"Paris"}"#.into(),
            },
            pb::ToolCall {
                id: "call_b".into(),
                name: "now".into(),
                arguments: String::new(),
            },
        ];
        let mut result_a = message("tool", "sunny");
        result_a.tool_call_id = "call_a".into();
        let mut result_b = message("tool", "noon");
        result_b.tool_call_id = "call_b".into();
        result_b.name = "clock".into();
        let body = request_body(&input(
            vec![message("user", "weather?"), assistant, result_a, result_b],
            Default::default(),
        ))
        .unwrap();
        let m = &body["messages"];
        assert_eq!(
            m[1]["tool_calls"],
            json!([
                {"id": "call_a", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"id": "call_b", "function": {"name": "now", "arguments": {}}},
            ])
        );
        assert_eq!(
            m[2],
            json!({"role": "tool", "content": "sunny", "tool_call_id": "call_a", "tool_name": "get_weather"})
        );
        // An explicit name wins over the lookup.
        assert_eq!(m[3]["tool_name"], "clock");

        let mut bad = message("assistant", "");
        bad.tool_calls = vec![pb::ToolCall {
            id: "c".into(),
            name: "f".into(),
            arguments: "[1]".into(),
        }];
        let text = err(&input(vec![message("user", "x"), bad], Default::default()));
        assert!(
            text.contains("messages[1].tool_calls[0].function.arguments"),
            "{text}"
        );
    }

    #[test]
    fn tools_follow_tool_choice() {
        let tools = r#"[{"type":"function","function":{"name":"a","parameters":{"type":"object"}}},
                        {"type":"function","function":{"name":"b"}}]"#;
        let with = |choice: &str| {
            request_body(&input(
                vec![message("user", "x")],
                pb::GenerationOptions {
                    tools_json: tools.into(),
                    tool_choice_json: choice.into(),
                    ..Default::default()
                },
            ))
        };
        let names = |body: &Value| -> Vec<String> {
            body["tools"]
                .as_array()
                .map(|t| {
                    t.iter()
                        .map(|t| t["function"]["name"].as_str().unwrap().to_string())
                        .collect()
                })
                .unwrap_or_default()
        };
        let all = with("").unwrap();
        assert_eq!(names(&all), ["a", "b"]);
        // Passed as given.
        assert_eq!(
            all["tools"][0],
            json!({"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}})
        );
        assert_eq!(names(&with("\"auto\"").unwrap()), ["a", "b"]);
        assert_eq!(names(&with("\"required\"").unwrap()), ["a", "b"]);
        assert!(with("\"none\"").unwrap().get("tools").is_none());
        assert_eq!(
            names(&with(r#"{"type":"function","function":{"name":"b"}}"#).unwrap()),
            ["b"]
        );
        let e = with(r#"{"type":"function","function":{"name":"zz"}}"#).unwrap_err();
        assert!(e.message.contains("tool_choice"), "{}", e.message);
        let e = request_body(&input(
            vec![message("user", "x")],
            pb::GenerationOptions {
                tools_json: r#"[{"type":"code_interpreter"}]"#.into(),
                ..Default::default()
            },
        ))
        .unwrap_err();
        assert!(e.message.contains("tools[0]"), "{}", e.message);
    }

    #[test]
    fn response_format_becomes_format() {
        let with = |format: &str| {
            request_body(&input(
                vec![message("user", "x")],
                pb::GenerationOptions {
                    response_format_json: format.into(),
                    ..Default::default()
                },
            ))
        };
        assert_eq!(with(r#"{"type":"json_object"}"#).unwrap()["format"], "json");
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let body = with(
            &json!({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
                .to_string(),
        )
        .unwrap();
        assert_eq!(body["format"], schema);
        assert!(with(r#"{"type":"text"}"#).unwrap().get("format").is_none());
        for bad in [
            r#"{"type":"json_schema"}"#,
            r#"{"type":"grammar"}"#,
            r#""json""#,
        ] {
            let e = with(bad).unwrap_err();
            assert!(
                e.message.contains("response_format"),
                "{bad}: {}",
                e.message
            );
        }
    }

    #[test]
    fn more_than_one_choice_is_refused() {
        let text = err(&input(
            vec![message("user", "x")],
            pb::GenerationOptions {
                n: Some(2),
                ..Default::default()
            },
        ));
        assert!(text.contains("`n`"), "{text}");
        let one = pb::GenerationOptions {
            n: Some(1),
            ..Default::default()
        };
        request_body(&input(vec![message("user", "x")], one)).unwrap();
    }

    #[test]
    fn answer_tool_calls_become_openai_calls_with_ids() {
        let mut seen = 0;
        let calls = answer_tool_calls(
            &json!({"role": "assistant", "content": "", "tool_calls": [
                {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"id": "call_x", "function": {"index": 1, "name": "now", "arguments": {}}},
            ]}),
            "r1",
            &mut seen,
        );
        assert_eq!(
            calls,
            [
                pb::ToolCall {
                    id: "call_r1_0".into(),
                    name: "get_weather".into(),
                    arguments: r#"{"city":"Paris"}"#.into(),
                },
                pb::ToolCall {
                    id: "call_x".into(),
                    name: "now".into(),
                    arguments: "{}".into(),
                },
            ]
        );
        assert_eq!(seen, 2);
        assert!(answer_tool_calls(&json!({"content": "hi"}), "r1", &mut seen).is_empty());
    }
}
