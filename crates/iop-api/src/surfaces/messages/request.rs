//! An Anthropic Messages API request as the chat request the edge dispatches: `system`
//! and `messages` (text, base64 or URL images, `tool_use` and `tool_result` blocks)
//! become chat `messages`; `max_tokens`, `temperature`, `top_p`, `top_k`,
//! `stop_sequences`, `tools` (name, description, input_schema), `tool_choice`,
//! `output_config.format` and `metadata.user_id` become their chat counterparts.
//!
//! Refused with a 400 naming the field: server tools (web search, code execution, …),
//! documents, search results, MCP servers, containers and anything the API does not
//! define. `thinking` is accepted (a model that reasons streams its reasoning as thinking
//! blocks) and so are cache-control hints and `context_management` (its edits only clear
//! old tool results once a context grows past a threshold; iop sends the whole
//! conversation); earlier thinking blocks in the conversation are dropped (a chat request
//! has no place for them). A `system` message inside `messages` (Claude Code sends them)
//! becomes a system turn in its place.

use serde_json::{Map, Value, json};

use crate::canonical::fields::{
    invalid, join, object, only_known, opt_array, opt_bool, opt_count, opt_string, present, string,
    unsupported,
};
use crate::canonical::{ApiError, ClientRequest, Decoded};
use crate::provider_api::ProviderApi;
use crate::surfaces::openai::MAX_TOKENS_LIMIT;
use crate::surfaces::translated::{self, Checked};

/// Every top-level field of the Messages API the edge accepts.
const KNOWN: &[&str] = &[
    "model",
    "messages",
    "system",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop_sequences",
    "stream",
    "tools",
    "tool_choice",
    "metadata",
    "thinking",
    "service_tier",
    "output_config",
    "cache_control",
    "container",
    "mcp_servers",
    "context_management",
];

/// Largest `top_k` accepted.
const MAX_TOP_K: u64 = 1_000_000;

/// What the edge itself reads of a Messages request, checked for every member:
/// `stream`, and `max_tokens` (required).
pub fn check(request: &ClientRequest) -> Result<Checked, ApiError> {
    let stream = translated::stream(request)?;
    let max_tokens = match request.typed::<u64>("max_tokens") {
        Ok(Some(n)) if (1..=MAX_TOKENS_LIMIT).contains(&n) => n,
        Ok(None) => {
            let why = "`max_tokens` is required (the most tokens the answer may have)";
            return Err(translated::missing("max_tokens", "missing_parameter", why));
        }
        _ => {
            let range = format!("an integer from 1 to {MAX_TOKENS_LIMIT}");
            return Err(invalid("max_tokens", &range));
        }
    };
    // Raw: counting the messages must not build them.
    match request.typed::<Vec<&serde_json::value::RawValue>>("messages") {
        Ok(Some(m)) if !m.is_empty() => {}
        Ok(None) => {
            let why = "`messages` is required (a non-empty array of messages)";
            return Err(translated::missing("messages", "missing_parameter", why));
        }
        _ => return Err(invalid("messages", "a non-empty array of messages")),
    }
    Ok(Checked {
        stream,
        max_output_tokens: Some(max_tokens),
    })
}

/// Client headers passed on to a provider that serves the Messages API itself.
const ANTHROPIC_HEADERS: &[&str] = &["anthropic-version", "anthropic-beta"];

/// The client headers a provider that serves the API itself gets.
fn forwarded(headers: &http::HeaderMap) -> Vec<iop_proto::pb::Header> {
    ANTHROPIC_HEADERS
        .iter()
        .flat_map(|name| {
            headers
                .get_all(*name)
                .iter()
                .map(|value| iop_proto::pb::Header {
                    name: name.to_string(),
                    value: value.as_bytes().to_vec(),
                })
        })
        .collect()
}

/// The Messages API as the edge reads it.
const API: translated::Api = translated::Api {
    api: ProviderApi::Messages,
    check,
    to_chat,
};

/// Reads and checks a request and translates it into the canonical (chat) form; a
/// translation that fails leaves the request to members that serve the API themselves.
pub fn decode<'a>(body: &'a [u8], headers: &http::HeaderMap) -> Result<Decoded<'a>, ApiError> {
    API.decode(body, forwarded(headers))
}

/// The chat request for `request` (whose `model` is kept: the dispatch rewrites it).
pub fn to_chat(request: &ClientRequest) -> Result<Map<String, Value>, ApiError> {
    let body = request.to_map();
    only_known(&body, KNOWN, "")?;
    for (key, what) in [
        ("container", "containers (server-side code execution)"),
        ("mcp_servers", "MCP servers"),
    ] {
        if present(&body, key).is_some() {
            return Err(unsupported(
                key,
                format!("{what} are not available through iop"),
            ));
        }
    }
    let mut chat = Map::new();
    chat.insert(
        "model".into(),
        body.get("model").cloned().unwrap_or(Value::Null),
    );
    let mut messages = Vec::new();
    if let Some(system) = system(&body)? {
        messages.push(json!({"role": "system", "content": system}));
    }
    let Some(Value::Array(input)) = body.get("messages") else {
        return Err(invalid("messages", "a non-empty array of messages"));
    };
    for (i, message) in input.iter().enumerate() {
        self::message(message, &format!("messages[{i}]"), &mut messages)?;
    }
    chat.insert("messages".into(), Value::Array(messages));
    sampling(&body, &mut chat)?;
    tools(&body, &mut chat)?;
    if let Some(metadata) = present(&body, "metadata") {
        let metadata = object(metadata, "metadata")?;
        only_known(metadata, &["user_id"], "metadata")?;
        if let Some(user) = opt_string(metadata, "user_id", "metadata")? {
            chat.insert("user".into(), user.into());
        }
    }
    if let Some(thinking) = present(&body, "thinking") {
        let thinking = object(thinking, "thinking")?;
        only_known(thinking, &["type", "budget_tokens", "display"], "thinking")?;
        string(thinking, "type", "thinking")?;
    }
    output_config(&body, &mut chat)?;
    opt_string(&body, "service_tier", "")?;
    Ok(chat)
}

/// The system prompt's text, if there is one: a string, or text blocks joined by lines.
fn system(body: &Map<String, Value>) -> Result<Option<String>, ApiError> {
    match present(body, "system") {
        None => Ok(None),
        some => system_text(some, "system").map(Some),
    }
}

/// System text at `at`: a string, or text blocks joined by lines (their `cache_control`
/// hints ignored).
fn system_text(content: Option<&Value>, at: &str) -> Result<String, ApiError> {
    match content {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(blocks)) => {
            let mut text = Vec::new();
            for (i, block) in blocks.iter().enumerate() {
                let at = format!("{at}[{i}]");
                let block = object(block, &at)?;
                if string(block, "type", &at)? != "text" {
                    return Err(invalid(&join(&at, "type"), "`text`"));
                }
                text.push(string(block, "text", &at)?);
            }
            Ok(text.join("\n"))
        }
        _ => Err(invalid(at, "a string or an array of text blocks")),
    }
}

/// `max_tokens`, `temperature`, `top_p`, `top_k`, `stop_sequences` and `stream`, checked.
fn sampling(body: &Map<String, Value>, chat: &mut Map<String, Value>) -> Result<(), ApiError> {
    if let Some(n) = opt_count(body, "max_tokens", "", 1, MAX_TOKENS_LIMIT)? {
        chat.insert("max_tokens".into(), n.into());
    }
    translated::temperature_and_top_p(body, chat)?;
    if let Some(k) = opt_count(body, "top_k", "", 0, MAX_TOP_K)? {
        chat.insert("top_k".into(), k.into());
    }
    if let Some(stops) = opt_array(body, "stop_sequences", "")? {
        if stops.iter().any(|s| !s.is_string()) {
            return Err(invalid("stop_sequences", "an array of strings"));
        }
        if !stops.is_empty() {
            chat.insert("stop".into(), Value::Array(stops.clone()));
        }
    }
    if let Some(stream) = opt_bool(body, "stream", "")? {
        chat.insert("stream".into(), stream.into());
    }
    Ok(())
}

/// `tools` and `tool_choice` as chat's functions and choice.
fn tools(body: &Map<String, Value>, chat: &mut Map<String, Value>) -> Result<(), ApiError> {
    translated::tools(body, chat, tool)?;
    let Some(choice) = present(body, "tool_choice") else {
        return Ok(());
    };
    let choice = object(choice, "tool_choice")?;
    only_known(
        choice,
        &["type", "name", "disable_parallel_tool_use"],
        "tool_choice",
    )?;
    let mapped = match string(choice, "type", "tool_choice")? {
        "auto" => json!("auto"),
        "any" => json!("required"),
        "none" => json!("none"),
        "tool" => {
            json!({"type": "function", "function": {"name": string(choice, "name", "tool_choice")?}})
        }
        other => {
            return Err(invalid(
                "tool_choice.type",
                &format!("one of auto, any, tool, none (not {other:?})"),
            ));
        }
    };
    chat.insert("tool_choice".into(), mapped);
    if opt_bool(choice, "disable_parallel_tool_use", "tool_choice")? == Some(true) {
        chat.insert("parallel_tool_calls".into(), json!(false));
    }
    Ok(())
}

/// `output_config`: a JSON schema becomes chat's `response_format`, the effort its
/// `reasoning_effort`.
fn output_config(body: &Map<String, Value>, chat: &mut Map<String, Value>) -> Result<(), ApiError> {
    let Some(config) = present(body, "output_config") else {
        return Ok(());
    };
    let config = object(config, "output_config")?;
    only_known(config, &["format", "effort"], "output_config")?;
    if let Some(format) = present(config, "format") {
        let format = object(format, "output_config.format")?;
        if string(format, "type", "output_config.format")? != "json_schema" {
            return Err(invalid("output_config.format.type", "`json_schema`"));
        }
        let schema = object(
            format.get("schema").unwrap_or(&Value::Null),
            "output_config.format.schema",
        )?;
        chat.insert(
            "response_format".into(),
            json!({"type": "json_schema", "json_schema": {"name": "output", "schema": schema, "strict": true}}),
        );
    }
    if let Some(effort) = opt_string(config, "effort", "output_config")? {
        chat.insert("reasoning_effort".into(), effort.into());
    }
    Ok(())
}

/// What one content block of a message becomes.
enum Block {
    /// A part of the chat message being built.
    Part(Value),
    /// One of the assistant's tool calls.
    Call(Value),
    /// A tool result: a `tool` message of its own.
    ToolMessage(Value),
    /// Nothing (earlier reasoning: a chat request has no place for it).
    Skip,
}

/// One message, appended to `messages` as chat messages: a user message's tool results
/// each become a `tool` message (in order with its other content).
fn message(message: &Value, at: &str, messages: &mut Vec<Value>) -> Result<(), ApiError> {
    let message = object(message, at)?;
    only_known(message, &["role", "content"], at)?;
    let role = match string(message, "role", at)? {
        r @ ("user" | "assistant") => r,
        // Mid-conversation instructions (Claude Code sends them): a system turn in place.
        "system" => {
            let text = system_text(message.get("content"), &join(at, "content"))?;
            messages.push(json!({"role": "system", "content": text}));
            return Ok(());
        }
        other => {
            return Err(invalid(
                &join(at, "role"),
                &format!("`user`, `assistant` or `system` (not {other:?})"),
            ));
        }
    };
    let blocks = match message.get("content") {
        Some(Value::String(s)) => {
            messages.push(json!({"role": role, "content": s}));
            return Ok(());
        }
        Some(Value::Array(blocks)) => blocks,
        _ => {
            return Err(invalid(
                &join(at, "content"),
                "a string or an array of content blocks",
            ));
        }
    };
    // Parts of the chat message being built, and the assistant's tool calls.
    let mut parts: Vec<Value> = Vec::new();
    let mut calls: Vec<Value> = Vec::new();
    let flush = |parts: &mut Vec<Value>, calls: &mut Vec<Value>, messages: &mut Vec<Value>| {
        if parts.is_empty() && calls.is_empty() {
            return;
        }
        let content = chat_content(std::mem::take(parts));
        let mut m = json!({"role": role, "content": content});
        if !calls.is_empty() {
            if m["content"] == "" {
                m["content"] = Value::Null;
            }
            m["tool_calls"] = Value::Array(std::mem::take(calls));
        }
        messages.push(m);
    };
    for (j, block) in blocks.iter().enumerate() {
        match self::block(block, role, &format!("{at}.content[{j}]"))? {
            Block::Part(part) => parts.push(part),
            Block::Call(call) => calls.push(call),
            Block::ToolMessage(m) => {
                flush(&mut parts, &mut calls, messages);
                messages.push(m);
            }
            Block::Skip => {}
        }
    }
    flush(&mut parts, &mut calls, messages);
    Ok(())
}

/// One content block of a `role` message at `path`.
fn block(block: &Value, role: &str, path: &str) -> Result<Block, ApiError> {
    let block = object(block, path)?;
    Ok(match string(block, "type", path)? {
        "text" => {
            only_known(block, &["type", "text", "cache_control", "citations"], path)?;
            Block::Part(json!({"type": "text", "text": string(block, "text", path)?}))
        }
        "image" if role == "user" => {
            only_known(block, &["type", "source", "cache_control"], path)?;
            Block::Part(json!({"type": "image_url", "image_url": {"url": image_url(block, path)?}}))
        }
        "tool_use" if role == "assistant" => {
            only_known(
                block,
                &["type", "id", "name", "input", "cache_control", "caller"],
                path,
            )?;
            let input = block.get("input").cloned().unwrap_or_else(|| json!({}));
            object(&input, &join(path, "input"))?;
            Block::Call(json!({
                "id": string(block, "id", path)?,
                "type": "function",
                "function": {"name": string(block, "name", path)?, "arguments": input.to_string()},
            }))
        }
        "tool_result" if role == "user" => {
            only_known(
                block,
                &[
                    "type",
                    "tool_use_id",
                    "content",
                    "is_error",
                    "cache_control",
                ],
                path,
            )?;
            let id = string(block, "tool_use_id", path)?;
            let mut text = tool_result_text(block.get("content"), &join(path, "content"))?;
            if opt_bool(block, "is_error", path)? == Some(true) {
                text = format!("Error: {text}");
            }
            Block::ToolMessage(json!({"role": "tool", "tool_call_id": id, "content": text}))
        }
        "thinking" | "redacted_thinking" if role == "assistant" => Block::Skip,
        other => {
            return Err(unsupported(
                &join(path, "type"),
                format!(
                    "`{other}` blocks are not supported in {role} messages: iop takes text, \
                     images and tool results from the user, text and tool use from the assistant"
                ),
            ));
        }
    })
}

/// Chat content for parts: text alone as one string, else the parts.
fn chat_content(parts: Vec<Value>) -> Value {
    if parts.iter().all(|p| p["type"] == "text") {
        let text: Vec<&str> = parts.iter().filter_map(|p| p["text"].as_str()).collect();
        return Value::String(text.join("\n"));
    }
    Value::Array(parts)
}

/// An image block's source as an image URL (a `data:` URL for base64 data).
fn image_url(block: &Map<String, Value>, at: &str) -> Result<String, ApiError> {
    let at = join(at, "source");
    let source = object(block.get("source").unwrap_or(&Value::Null), &at)?;
    match string(source, "type", &at)? {
        "base64" => {
            only_known(source, &["type", "media_type", "data"], &at)?;
            Ok(format!(
                "data:{};base64,{}",
                string(source, "media_type", &at)?,
                string(source, "data", &at)?
            ))
        }
        "url" => {
            only_known(source, &["type", "url"], &at)?;
            Ok(string(source, "url", &at)?.to_string())
        }
        other => Err(unsupported(
            &join(&at, "type"),
            format!("`{other}` image sources are not supported: send base64 data or a URL"),
        )),
    }
}

/// A tool result's content as text (text blocks joined).
fn tool_result_text(content: Option<&Value>, at: &str) -> Result<String, ApiError> {
    match content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(blocks)) => {
            let mut text = Vec::new();
            for (k, block) in blocks.iter().enumerate() {
                let path = format!("{at}[{k}]");
                let block = object(block, &path)?;
                match string(block, "type", &path)? {
                    "text" => text.push(string(block, "text", &path)?),
                    other => {
                        return Err(unsupported(
                            &join(&path, "type"),
                            format!("tool results can hold text blocks only here, not `{other}`"),
                        ));
                    }
                }
            }
            Ok(text.join("\n"))
        }
        Some(_) => Err(invalid(at, "a string or an array of content blocks")),
    }
}

/// A client tool as a chat function tool; server tools are refused.
fn tool(tool: &Value, at: &str) -> Result<Value, ApiError> {
    let t = object(tool, at)?;
    match opt_string(t, "type", at)? {
        None | Some("custom") => {}
        Some(other) => {
            return Err(unsupported(
                &join(at, "type"),
                format!(
                    "the server tool `{other}` is not available through iop: only client tools \
                     (name, description, input_schema) are"
                ),
            ));
        }
    }
    only_known(
        t,
        &[
            "type",
            "name",
            "description",
            "input_schema",
            "cache_control",
            "strict",
            "input_examples",
            "defer_loading",
            "allowed_callers",
            "eager_input_streaming",
        ],
        at,
    )?;
    let schema = object(
        t.get("input_schema").unwrap_or(&Value::Null),
        &join(at, "input_schema"),
    )?;
    translated::function_tool(t, at, Some(Value::Object(schema.clone())))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(v: Value) -> Result<Value, ApiError> {
        let body = v.to_string();
        to_chat(&ClientRequest::parse(body.as_bytes()).unwrap()).map(Value::Object)
    }

    fn checked(v: Value) -> Result<Checked, ApiError> {
        let body = v.to_string();
        check(&ClientRequest::parse(body.as_bytes()).unwrap())
    }

    #[test]
    fn system_messages_and_options_map_to_chat() {
        let c = chat(json!({"model": "g", "max_tokens": 64, "system": [
                {"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "be kind"}],
            "messages": [{"role": "user", "content": "hi"}],
            "temperature": 0.3, "top_p": 0.8, "top_k": 40, "stop_sequences": ["\n\nHuman:"],
            "stream": true, "metadata": {"user_id": "u1"}, "thinking": {"type": "enabled", "budget_tokens": 1024}}))
        .unwrap();
        assert_eq!(
            c,
            json!({"model": "g", "messages": [
                {"role": "system", "content": "be brief\nbe kind"},
                {"role": "user", "content": "hi"}],
                "max_tokens": 64, "temperature": 0.3, "top_p": 0.8, "top_k": 40,
                "stop": ["\n\nHuman:"], "stream": true, "user": "u1"})
        );
    }

    #[test]
    fn images_tool_use_and_tool_results_become_chat_messages() {
        let c = chat(json!({"model": "g", "max_tokens": 8, "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "what is this?"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
                {"type": "image", "source": {"type": "url", "url": "https://example.invalid/cat.png"}}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "s"},
                {"type": "text", "text": "let me look"},
                {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"q": "cat"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "a cat"}]},
                {"type": "text", "text": "thanks"}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_2", "name": "now", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "content": "timeout", "is_error": true}]},
        ]}))
        .unwrap();
        assert_eq!(
            c["messages"],
            json!([
                {"role": "user", "content": [
                    {"type": "text", "text": "what is this?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                    {"type": "image_url", "image_url": {"url": "https://example.invalid/cat.png"}}]},
                {"role": "assistant", "content": "let me look", "tool_calls": [
                    {"id": "toolu_1", "type": "function", "function": {"name": "lookup", "arguments": "{\"q\":\"cat\"}"}}]},
                {"role": "tool", "tool_call_id": "toolu_1", "content": "a cat"},
                {"role": "user", "content": "thanks"},
                {"role": "assistant", "content": null, "tool_calls": [
                    {"id": "toolu_2", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: timeout"},
            ])
        );
    }

    #[test]
    fn tools_and_tool_choices_map_to_functions() {
        let c = chat(json!({"model": "g", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}],
            "tools": [{"name": "lookup", "description": "Looks up", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "tool", "name": "lookup", "disable_parallel_tool_use": true},
            "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}))
        .unwrap();
        assert_eq!(
            c["tools"],
            json!([{"type": "function", "function": {"name": "lookup", "description": "Looks up",
                    "parameters": {"type": "object"}}}])
        );
        assert_eq!(
            c["tool_choice"],
            json!({"type": "function", "function": {"name": "lookup"}})
        );
        assert_eq!(c["parallel_tool_calls"], false);
        assert_eq!(
            c["response_format"]["json_schema"]["schema"],
            json!({"type": "object"})
        );
        for (choice, expected) in [("auto", "auto"), ("any", "required"), ("none", "none")] {
            let c = chat(json!({"model": "g", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}],
                "tool_choice": {"type": choice}}))
            .unwrap();
            assert_eq!(c["tool_choice"], expected);
        }
    }

    #[test]
    fn what_claude_code_sends_is_accepted() {
        // Its first request, as captured: context management, thinking with an effort,
        // cache hints everywhere, metadata, and system turns inside the conversation.
        let c = chat(json!({
            "model": "g",
            "max_tokens": 32000,
            "stream": true,
            "system": [
                {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "Be concise."}
            ],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]},
                {"role": "system", "content": "The user changed directory."},
                {"role": "user", "content": "list files"}
            ],
            "tools": [{"name": "Bash", "description": "run", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"}}],
            "metadata": {"user_id": "user_abc_session_1"},
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "output_config": {"effort": "high"},
            "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}
        }))
        .unwrap();
        let roles: Vec<&str> = c["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["role"].as_str().unwrap())
            .collect();
        assert_eq!(roles, ["system", "user", "system", "user"]);
        assert_eq!(
            c["messages"][0]["content"],
            "You are Claude Code.\nBe concise."
        );
        assert_eq!(c["messages"][2]["content"], "The user changed directory.");
        assert_eq!(c["user"], "user_abc_session_1");
        assert_eq!(c["reasoning_effort"], "high");
        assert!(c.get("context_management").is_none());
        assert_eq!(c["tools"][0]["function"]["name"], "Bash");
    }

    #[test]
    fn every_field_that_does_not_change_the_answer_is_accepted_and_left_out() {
        // docs/apis.md's table, row "accepted, ignored".
        let cached = json!({"type": "ephemeral"});
        for (field, value) in [
            (
                "context_management",
                json!({"edits": [{"type": "clear_thinking_20251015"}]}),
            ),
            ("thinking", json!({"type": "adaptive"})),
            ("service_tier", json!("auto")),
            (
                "system",
                json!([{"type": "text", "text": "s", "cache_control": cached}]),
            ),
            (
                "messages",
                json!([{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": cached}]}]),
            ),
            (
                "tools",
                json!([{"name": "f", "input_schema": {"type": "object"}, "cache_control": cached}]),
            ),
        ] {
            let mut body = json!({"model": "g", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]});
            body[field] = value;
            let c = chat(body.clone()).unwrap_or_else(|e| panic!("{body}: {}", e.message));
            let text = c.to_string();
            for key in [
                "cache_control",
                "context_management",
                "thinking",
                "service_tier",
            ] {
                let quoted = format!("\"{key}\"");
                assert!(
                    !text.contains(&quoted),
                    "{field}: {key} reached the backend: {text}"
                );
            }
        }
    }

    #[test]
    fn what_changes_the_answer_is_carried() {
        // docs/apis.md's table, row "carried".
        let c = chat(json!({
            "model": "g", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}],
            "metadata": {"user_id": "u1"},
            "output_config": {"effort": "low", "format": {"type": "json_schema", "schema": {"type": "object"}}},
            "stop_sequences": ["END"],
            "top_k": 5
        }))
        .unwrap();
        assert_eq!(c["user"], "u1");
        assert_eq!(c["reasoning_effort"], "low");
        assert_eq!(c["stop"], json!(["END"]));
        assert_eq!(c["top_k"], 5);
        assert_eq!(c["response_format"]["type"], "json_schema", "{:?}", c);
    }

    #[test]
    fn what_cannot_be_honoured_is_a_400_naming_the_field() {
        let base = |extra: Value| {
            let mut b = json!({"model": "g", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]});
            for (k, v) in extra.as_object().unwrap() {
                b[k] = v.clone();
            }
            b
        };
        for (body, param) in [
            (
                base(json!({"tools": [{"type": "web_search_20250305", "name": "web_search"}]})),
                "tools[0].type",
            ),
            (
                base(json!({"tools": [{"name": "f"}]})),
                "tools[0].input_schema",
            ),
            (base(json!({"mcp_servers": [{"url": "x"}]})), "mcp_servers"),
            (base(json!({"container": "c"})), "container"),
            (base(json!({"frobnicate": 1})), "frobnicate"),
            (
                base(json!({"tool_choice": {"type": "sometimes"}})),
                "tool_choice.type",
            ),
            (base(json!({"stop_sequences": [1]})), "stop_sequences"),
            (base(json!({"top_k": -1})), "top_k"),
            (base(json!({"system": 5})), "system"),
            (
                base(json!({"messages": [{"role": "tool", "content": "x"}]})),
                "messages[0].role",
            ),
            (
                base(json!({"messages": [{"role": "system", "content": 5}]})),
                "messages[0].content",
            ),
            (
                base(
                    json!({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}),
                ),
                "messages[0].content[0].type",
            ),
            (
                base(
                    json!({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]}),
                ),
                "messages[0].content[0].type",
            ),
            (
                base(
                    json!({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}]}]}),
                ),
                "messages[0].content[0].source.type",
            ),
            (
                base(
                    json!({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image", "source": {}}]}]}]}),
                ),
                "messages[0].content[0].content[0].type",
            ),
            (
                base(
                    json!({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "x"}]}]}),
                ),
                "messages[0].content[0].input",
            ),
        ] {
            let e = chat(body.clone()).unwrap_err();
            assert_eq!(e.status, 400, "{body}");
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
        }
    }

    #[test]
    fn only_the_anthropic_headers_reach_a_native_provider() {
        let mut h = http::HeaderMap::new();
        h.insert("anthropic-version", "2023-06-01".parse().unwrap());
        h.insert("x-api-key", "secret".parse().unwrap());
        h.insert("authorization", "Bearer secret".parse().unwrap());
        let forwarded = forwarded(&h);
        assert_eq!(forwarded.len(), 1);
        assert_eq!(forwarded[0].name, "anthropic-version");
        assert_eq!(forwarded[0].value, b"2023-06-01");
    }

    #[test]
    fn max_tokens_is_required_and_bounded() {
        let ok = json!({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "stream": true});
        assert_eq!(
            checked(ok).unwrap(),
            Checked {
                stream: true,
                max_output_tokens: Some(5)
            }
        );
        for (body, param) in [
            (
                json!({"messages": [{"role": "user", "content": "x"}]}),
                "max_tokens",
            ),
            (
                json!({"max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}),
                "max_tokens",
            ),
            (
                json!({"max_tokens": "5", "messages": [{"role": "user", "content": "x"}]}),
                "max_tokens",
            ),
            (json!({"max_tokens": 5}), "messages"),
            (json!({"max_tokens": 5, "messages": []}), "messages"),
            (
                json!({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "stream": 1}),
                "stream",
            ),
        ] {
            let e = checked(body.clone()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{body}");
        }
        let e = checked(json!({"messages": [{"role": "user", "content": "x"}]})).unwrap_err();
        assert!(e.message.contains("required"), "{}", e.message);
    }
}
