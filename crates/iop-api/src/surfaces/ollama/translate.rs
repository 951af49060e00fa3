//! An Ollama request in the canonical form: an OpenAI chat / completions / embeddings
//! request, which openai_compat and vLLM providers get through the tunnel and mock and CLI
//! providers as a normalized run (`codec`). Ollama members get the client's own body with
//! only `model` rewritten instead.
//!
//! The mapping, Ollama → OpenAI:
//! - messages keep role and text; `images` (base64) become `image_url` parts with a
//!   `data:` URL; an assistant's `tool_calls` (arguments an object) become OpenAI calls
//!   (arguments as JSON text) with their `id`, or `call_<message>_<call>` when they have
//!   none; a `tool` message gets the `tool_call_id` of the call it answers (its own, or the
//!   first unanswered earlier call of its `tool_name`);
//! - `options`: `temperature`, `top_p`, `seed`, `stop`, `frequency_penalty`,
//!   `presence_penalty` as they are, `num_predict` as `max_tokens` (a negative one —
//!   Ollama's "no limit" — is left out); other options reach Ollama members only;
//! - `format`: `"json"` → `response_format: {"type": "json_object"}`, a schema object →
//!   `{"type": "json_schema", …}`;
//! - `tools` as they are (Ollama takes OpenAI's function-tool shape);
//! - `think`: a level (`"low"`, `"medium"`, `"high"`) → `reasoning_effort`; `true`/`false`
//!   leave the provider's default;
//! - `/api/generate`: `system` and `prompt` (and `images`) as a chat; with `raw: true`, the
//!   prompt (and `suffix`) go to `/completions` untemplated.
//!
//! Pure: parsed requests in, canonical JSON bodies out.

use serde_json::{Map, Value, json};

use super::request::{
    ChatRequest, EmbedRequest, EmbeddingsRequest, GenerateRequest, Generation, Message, Options,
    ToolCall, response_format, think_level,
};
use crate::canonical::{ApiError, Operation};

impl Options {
    /// The OpenAI fields for these options.
    fn openai_fields(&self, body: &mut Map<String, Value>) {
        let mut set = |key: &str, value: Option<Value>| {
            if let Some(v) = value {
                body.insert(key.into(), v);
            }
        };
        set("temperature", self.temperature.map(|v| json!(v)));
        set("top_p", self.top_p.map(|v| json!(v)));
        set("seed", self.seed.map(|v| json!(v)));
        set("max_tokens", self.max_tokens.map(|v| json!(v)));
        set(
            "frequency_penalty",
            self.frequency_penalty.map(|v| json!(v)),
        );
        set("presence_penalty", self.presence_penalty.map(|v| json!(v)));
        if !self.stop.is_empty() {
            body.insert("stop".into(), json!(self.stop));
        }
    }
}

/// The media type of base64 image data, from its first bytes (PNG when unknown).
fn image_media_type(base64: &str) -> &'static str {
    let prefixes = [
        ("/9j/", "image/jpeg"),
        ("iVBOR", "image/png"),
        ("R0lGOD", "image/gif"),
        ("UklGR", "image/webp"),
        ("Qk", "image/bmp"),
    ];
    prefixes
        .iter()
        .find(|(p, _)| base64.starts_with(p))
        .map_or("image/png", |(_, t)| t)
}

/// A base64 image as a `data:` URL.
pub fn image_url(base64: &str) -> String {
    let base64 = base64.trim();
    format!("data:{};base64,{base64}", image_media_type(base64))
}

/// Tool-call ids for a conversation: each assistant call's own id or a made-up one, and
/// for each tool message the id of the call it answers.
#[derive(Debug, Default)]
struct CallIds {
    /// `(id, name, answered)` of the calls made so far.
    calls: Vec<(String, String, bool)>,
}

impl CallIds {
    fn call(&mut self, message: usize, index: usize, call: &ToolCall) -> String {
        let id = if call.id.is_empty() {
            format!("call_{message}_{index}")
        } else {
            call.id.clone()
        };
        self.calls
            .push((id.clone(), call.function.name.clone(), false));
        id
    }

    /// The id a tool message answers: its own, else the first unanswered call of its
    /// tool's name (or of any name when it names none).
    fn answer(&mut self, message: &Message) -> String {
        if !message.tool_call_id.is_empty() {
            if let Some(c) = self.calls.iter_mut().find(|c| c.0 == message.tool_call_id) {
                c.2 = true;
            }
            return message.tool_call_id.clone();
        }
        let name = message.tool_name.as_str();
        let found = self
            .calls
            .iter_mut()
            .find(|c| !c.2 && (name.is_empty() || c.1 == name));
        match found {
            Some(c) => {
                c.2 = true;
                c.0.clone()
            }
            None => String::new(),
        }
    }
}

/// A call's arguments as OpenAI's JSON text.
fn arguments_text(arguments: &Value) -> String {
    match arguments {
        Value::Null => "{}".into(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Ollama messages as OpenAI chat messages.
fn openai_messages(messages: &[Message]) -> Vec<Value> {
    let mut ids = CallIds::default();
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let mut out = Map::new();
            out.insert("role".into(), json!(m.role));
            if m.images.is_empty() {
                out.insert("content".into(), json!(m.content));
            } else {
                let mut parts = vec![json!({"type": "text", "text": m.content})];
                parts.extend(
                    m.images
                        .iter()
                        .map(|img| json!({"type": "image_url", "image_url": {"url": image_url(img)}})),
                );
                out.insert("content".into(), Value::Array(parts));
            }
            if !m.tool_calls.is_empty() {
                let calls: Vec<Value> = m
                    .tool_calls
                    .iter()
                    .enumerate()
                    .map(|(j, c)| {
                        json!({
                            "id": ids.call(i, j, c),
                            "type": "function",
                            "function": {"name": c.function.name, "arguments": arguments_text(&c.function.arguments)},
                        })
                    })
                    .collect();
                if m.content.is_empty() {
                    out.insert("content".into(), Value::Null);
                }
                out.insert("tool_calls".into(), Value::Array(calls));
            }
            if m.role == "tool" {
                let id = ids.answer(m);
                if !id.is_empty() {
                    out.insert("tool_call_id".into(), json!(id));
                }
                if !m.tool_name.is_empty() {
                    out.insert("name".into(), json!(m.tool_name));
                }
            }
            Value::Object(out)
        })
        .collect()
}

impl Generation {
    /// The OpenAI fields every request gets: model, stream, options, response format and
    /// reasoning effort.
    fn openai_common(&self) -> Result<Map<String, Value>, ApiError> {
        let mut body = Map::new();
        body.insert("model".into(), json!(self.model));
        body.insert("stream".into(), json!(self.stream()));
        self.options()?.openai_fields(&mut body);
        if let Some(format) = response_format(self.format.as_ref())? {
            body.insert("response_format".into(), format);
        }
        if let Some(level) = think_level(self.think.as_ref())? {
            body.insert("reasoning_effort".into(), json!(level));
        }
        Ok(body)
    }
}

impl ChatRequest {
    /// The canonical chat request.
    pub fn canonical(&self) -> Result<Value, ApiError> {
        let mut body = self.generation.openai_common()?;
        body.insert(
            "messages".into(),
            Value::Array(openai_messages(&self.fields.messages)),
        );
        if let Some(tools) = self.fields.tools.as_ref().filter(|t| !t.is_empty()) {
            body.insert("tools".into(), Value::Array(tools.clone()));
        }
        Ok(Value::Object(body))
    }
}

impl GenerateRequest {
    /// The conversation a templated generate stands for: the system prompt, then the
    /// prompt (with its images) as the user's message.
    fn messages(&self) -> Vec<Message> {
        let mut messages = Vec::new();
        if let Some(system) = self.fields.system.as_ref().filter(|s| !s.is_empty()) {
            messages.push(Message {
                role: "system".into(),
                content: system.clone(),
                ..Default::default()
            });
        }
        messages.push(Message {
            role: "user".into(),
            content: self.fields.prompt.clone(),
            images: self.fields.images.clone(),
            ..Default::default()
        });
        messages
    }

    /// The canonical request: a chat, or with `raw` the untemplated prompt as a
    /// completion.
    pub fn canonical(&self) -> Result<(Operation, Value), ApiError> {
        let mut body = self.generation.openai_common()?;
        if self.fields.raw {
            if !self.fields.images.is_empty() {
                return Err(ApiError::invalid_param(
                    "images",
                    "`raw` prompts cannot carry images for this model: send them without `raw`",
                ));
            }
            body.insert("prompt".into(), json!(self.fields.prompt));
            if let Some(suffix) = &self.fields.suffix {
                body.insert("suffix".into(), json!(suffix));
            }
            return Ok((Operation::Completion, Value::Object(body)));
        }
        body.insert(
            "messages".into(),
            Value::Array(openai_messages(&self.messages())),
        );
        Ok((Operation::Chat, Value::Object(body)))
    }
}

impl EmbedRequest {
    /// The canonical embeddings request.
    pub fn canonical(&self) -> Value {
        let mut body =
            json!({"model": self.model, "input": self.texts(), "encoding_format": "float"});
        if let Some(d) = self.dimensions {
            body["dimensions"] = json!(d);
        }
        body
    }
}

impl EmbeddingsRequest {
    pub fn canonical(&self) -> Value {
        json!({"model": self.model, "input": [self.prompt], "encoding_format": "float"})
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::super::request::{ChatRequest, GenerateRequest};
    use super::*;

    fn chat(v: Value) -> ChatRequest {
        ChatRequest::parse(v.to_string().as_bytes()).unwrap()
    }

    #[test]
    fn options_map_to_openai_fields() {
        let r = chat(
            json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "options": {"temperature": 0.5, "top_p": 0.9, "num_predict": 7, "stop": ["x"], "seed": 3,
                        "num_ctx": 4096, "presence_penalty": 1}}),
        );
        let body = r.canonical().unwrap();
        assert_eq!(body["model"], "m");
        assert_eq!(body["stream"], true);
        assert!(body.get("stream_options").is_none());
        assert_eq!(body["temperature"], 0.5);
        assert_eq!(body["top_p"], 0.9);
        assert_eq!(body["max_tokens"], 7);
        assert_eq!(body["stop"], json!(["x"]));
        assert_eq!(body["seed"], 3);
        assert_eq!(body["presence_penalty"], 1.0);
        assert!(body.get("num_ctx").is_none());
        // No limit: no max_tokens.
        let r = chat(json!({"model": "m", "stream": false, "options": {"num_predict": -1}}));
        let body = r.canonical().unwrap();
        assert!(body.get("max_tokens").is_none());
    }

    #[test]
    fn format_think_and_tools_map() {
        let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {}}}]);
        let r = chat(json!({"model": "m", "format": "json", "think": "high", "tools": tools}));
        let body = r.canonical().unwrap();
        assert_eq!(body["response_format"], json!({"type": "json_object"}));
        assert_eq!(body["reasoning_effort"], "high");
        assert_eq!(body["tools"], tools);
        let schema = json!({"type": "object", "properties": {"a": {"type": "string"}}});
        let r = chat(json!({"model": "m", "format": schema, "think": true}));
        let body = r.canonical().unwrap();
        assert_eq!(body["response_format"]["json_schema"]["schema"], schema);
        assert!(body.get("reasoning_effort").is_none());
        let r = chat(json!({"model": "m", "format": "yaml"}));
        assert_eq!(r.canonical().unwrap_err().param.as_deref(), Some("format"));
        let r = chat(json!({"model": "m", "think": "max"}));
        assert_eq!(r.canonical().unwrap_err().param.as_deref(), Some("think"));
    }

    #[test]
    fn images_and_tool_calls_become_openai_parts_and_calls() {
        let r = chat(json!({"model": "m", "messages": [
            {"role": "user", "content": "what is this?", "images": ["iVBORw0KGgo="]},
            {"role": "assistant", "content": "", "tool_calls": [
                {"function": {"name": "look", "arguments": {"q": "cat"}}},
                {"id": "given", "function": {"name": "zoom", "arguments": {}}}]},
            {"role": "tool", "tool_name": "zoom", "content": "2x"},
            {"role": "tool", "tool_name": "look", "content": "a cat"},
        ]}));
        let body = r.canonical().unwrap();
        let m = body["messages"].as_array().unwrap();
        assert_eq!(
            m[0]["content"][0],
            json!({"type": "text", "text": "what is this?"})
        );
        assert_eq!(
            m[0]["content"][1]["image_url"]["url"],
            "data:image/png;base64,iVBORw0KGgo="
        );
        assert_eq!(m[1]["content"], Value::Null);
        assert_eq!(m[1]["tool_calls"][0]["id"], "call_1_0");
        assert_eq!(
            m[1]["tool_calls"][0]["function"]["arguments"],
            r#"{"q":"cat"}"#
        );
        assert_eq!(m[1]["tool_calls"][1]["id"], "given");
        assert_eq!(m[2]["tool_call_id"], "given");
        assert_eq!(m[3]["tool_call_id"], "call_1_0");
        assert_eq!(m[3]["name"], "look");
    }

    #[test]
    fn as_runs_they_carry_messages_options_and_tools() {
        let r = chat(json!({"model": "m", "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi", "images": ["/9j/4AAQ"]}],
            "options": {"num_predict": 5, "seed": 9}, "format": "json",
            "tools": [{"type": "function", "function": {"name": "f"}}]}));
        let body = r.canonical().unwrap().to_string();
        let canonical = crate::canonical::ClientRequest::parse(body.as_bytes()).unwrap();
        let spec = crate::codec::run::run_spec(&canonical, Operation::Chat, "mock", "target");
        assert_eq!(spec.messages.len(), 2);
        assert_eq!(
            spec.messages[1].image_urls,
            ["data:image/jpeg;base64,/9j/4AAQ"]
        );
        let o = spec.options.unwrap();
        assert_eq!((o.max_tokens, o.seed), (Some(5), Some(9)));
        assert_eq!(o.response_format_json, r#"{"type":"json_object"}"#);
        assert!(o.tools_json.contains("\"f\""));
    }

    #[test]
    fn generate_is_a_chat_or_a_raw_completion() {
        let g = GenerateRequest::parse(
            json!({"model": "m", "prompt": "hi", "system": "sys", "images": ["R0lGODlh"]})
                .to_string()
                .as_bytes(),
        )
        .unwrap();
        let (op, body) = g.canonical().unwrap();
        assert_eq!(op, Operation::Chat);
        assert_eq!(
            body["messages"][0],
            json!({"role": "system", "content": "sys"})
        );
        assert_eq!(
            body["messages"][1]["content"][1]["image_url"]["url"],
            "data:image/gif;base64,R0lGODlh"
        );
        let g = GenerateRequest::parse(
            br#"{"model": "m", "prompt": "def f(", "suffix": "return 1", "raw": true, "stream": false}"#,
        )
        .unwrap();
        let (op, body) = g.canonical().unwrap();
        assert_eq!(op, Operation::Completion);
        assert_eq!(
            (body["prompt"].as_str(), body["suffix"].as_str()),
            (Some("def f("), Some("return 1"))
        );
        let text = body.to_string();
        let canonical = crate::canonical::ClientRequest::parse(text.as_bytes()).unwrap();
        let spec = crate::codec::run::run_spec(&canonical, op, "cli", "t");
        assert_eq!(spec.input, "def f(");
        assert!(spec.messages.is_empty());
    }
}
