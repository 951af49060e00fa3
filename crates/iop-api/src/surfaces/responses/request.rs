//! A Responses API request as the chat request the edge dispatches: `instructions` and
//! `input` (a string, or items: messages with text and image parts, function calls and
//! their outputs) become `messages`; `max_output_tokens`, `temperature`, `top_p`,
//! function `tools`, `tool_choice`, `parallel_tool_calls`, `text.format`,
//! `reasoning.effort` and `user` become their chat counterparts.
//!
//! What iop cannot honour is refused with a 400 naming the field: `previous_response_id`
//! and `conversation` (iop keeps no response store: send the whole conversation),
//! `background`, file inputs, `prompt` templates, a `tool_choice` that requires a built-in
//! tool, and anything the API does not define. Built-in tools (web search, file search, …)
//! offered in `tools` are left out and named in the response's `x-iop-dropped-tools`: the
//! model answers without them. A `namespace` tool's function tools are offered to the
//! backend as `<namespace>__<name>`, and its calls come back as `name` + `namespace`. Fields that only ask for something to be kept or reported
//! (`store`, `include`, `metadata`, `client_metadata`, `service_tier`, prompt-cache hints)
//! are accepted; nothing is stored. Reasoning items from earlier turns are dropped
//! (a chat request has no place for them).

use serde_json::{Map, Value, json};

use crate::canonical::fields::{
    invalid, join, object, only_known, opt_bool, opt_count, opt_string, present, string,
    unsupported,
};
use crate::canonical::{ApiError, ClientRequest, Decoded};
use crate::provider_api::ProviderApi;
use crate::surfaces::openai::MAX_TOKENS_LIMIT;
use crate::surfaces::translated::{self, Checked};

/// Every top-level field of the Responses API the edge accepts.
const KNOWN: &[&str] = &[
    "model",
    "input",
    "instructions",
    "max_output_tokens",
    "temperature",
    "top_p",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "stream",
    "stream_options",
    "text",
    "reasoning",
    "user",
    "store",
    "include",
    "metadata",
    "service_tier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "client_metadata",
    "safety_identifier",
    "truncation",
    "top_logprobs",
    "max_tool_calls",
    "previous_response_id",
    "conversation",
    "background",
    "prompt",
];

/// What the edge itself reads of a Responses request, checked for every member (a
/// provider that serves the API itself gets the request as it is): `stream`,
/// `max_output_tokens`, and that there is an `input`.
pub fn check(request: &ClientRequest) -> Result<Checked, ApiError> {
    let stream = translated::stream(request)?;
    let max_output_tokens = match request.typed::<u64>("max_output_tokens") {
        Ok(n) if n.is_none_or(|n| n <= MAX_TOKENS_LIMIT) => n,
        _ => {
            let range = format!("an integer from 0 to {MAX_TOKENS_LIMIT}");
            return Err(invalid("max_output_tokens", &range));
        }
    };
    match request.typed::<Value>("input") {
        Ok(Some(Value::String(_) | Value::Array(_))) => {}
        Ok(None) => {
            let why = "you must provide `input` (a string or an array of input items)";
            return Err(translated::missing("input", "missing_input", why));
        }
        _ => return Err(invalid("input", "a string or an array of input items")),
    }
    Ok(Checked {
        stream,
        max_output_tokens,
    })
}

/// The Responses API as the edge reads it.
const API: translated::Api = translated::Api {
    api: ProviderApi::Responses,
    check,
    to_chat,
};

/// Reads and checks a request and translates it into the canonical (chat) form; a
/// translation that fails leaves the request to members that serve the API themselves.
pub fn decode<'a>(body: &'a [u8], _headers: &http::HeaderMap) -> Result<Decoded<'a>, ApiError> {
    API.decode(body, Vec::new())
}

/// The chat request for `request` (whose `model` is kept: the dispatch rewrites it).
pub fn to_chat(request: &ClientRequest) -> Result<Map<String, Value>, ApiError> {
    let body = request.to_map();
    only_known(&body, KNOWN, "")?;
    refuse_unsupported(&body)?;
    let mut chat = Map::new();
    chat.insert(
        "model".into(),
        body.get("model").cloned().unwrap_or(Value::Null),
    );
    let mut messages = Vec::new();
    if let Some(instructions) = opt_string(&body, "instructions", "")? {
        messages.push(json!({"role": "system", "content": instructions}));
    }
    match body.get("input") {
        Some(Value::String(s)) => messages.push(json!({"role": "user", "content": s})),
        Some(Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                input_item(item, &format!("input[{i}]"), &mut messages)?;
            }
        }
        _ => return Err(invalid("input", "a string or an array of input items")),
    }
    if messages.is_empty() {
        return Err(invalid(
            "input",
            "a non-empty string or array of input items",
        ));
    }
    chat.insert("messages".into(), Value::Array(messages));
    if let Some(n) = opt_count(&body, "max_output_tokens", "", 0, MAX_TOKENS_LIMIT)? {
        chat.insert("max_tokens".into(), n.into());
    }
    translated::temperature_and_top_p(&body, &mut chat)?;
    if let Some(parallel) = opt_bool(&body, "parallel_tool_calls", "")? {
        chat.insert("parallel_tool_calls".into(), parallel.into());
    }
    if let Some(stream) = opt_bool(&body, "stream", "")? {
        chat.insert("stream".into(), stream.into());
    }
    if let Some(user) = opt_string(&body, "user", "")? {
        chat.insert("user".into(), user.into());
    }
    tools(&body, &mut chat)?;
    if let Some(choice) = present(&body, "tool_choice") {
        chat.insert("tool_choice".into(), tool_choice(choice)?);
    }
    if let Some(text) = present(&body, "text")
        && let Some(format) = response_format(text)?
    {
        chat.insert("response_format".into(), format);
    }
    if let Some(reasoning) = present(&body, "reasoning") {
        let reasoning = object(reasoning, "reasoning")?;
        only_known(
            reasoning,
            &["effort", "summary", "generate_summary"],
            "reasoning",
        )?;
        if let Some(effort) = opt_string(reasoning, "effort", "reasoning")? {
            chat.insert("reasoning_effort".into(), effort.into());
        }
    }
    Ok(chat)
}

/// The fields whose meaning iop cannot provide.
fn refuse_unsupported(body: &Map<String, Value>) -> Result<(), ApiError> {
    for key in ["previous_response_id", "conversation"] {
        if present(body, key).is_some() {
            return Err(unsupported(
                key,
                format!(
                    "`{key}` is not supported: iop keeps no response store; send the whole \
                     conversation in `input` (earlier outputs as input items)"
                ),
            ));
        }
    }
    if opt_bool(body, "background", "")? == Some(true) {
        return Err(unsupported(
            "background",
            "background responses are not supported: iop keeps no response store; \
             stream the response instead",
        ));
    }
    if present(body, "prompt").is_some() {
        return Err(unsupported(
            "prompt",
            "prompt templates are not supported: send the prompt in `instructions` and `input`",
        ));
    }
    match opt_string(body, "truncation", "")? {
        None | Some("disabled") => {}
        Some(other) => {
            return Err(unsupported(
                "truncation",
                format!("`truncation: {other}` is not supported: iop never drops input items"),
            ));
        }
    }
    if opt_count(body, "top_logprobs", "", 0, 20)?.is_some_and(|n| n > 0) {
        return Err(unsupported(
            "top_logprobs",
            "`top_logprobs` is not supported on this endpoint",
        ));
    }
    if present(body, "max_tool_calls").is_some() {
        return Err(unsupported(
            "max_tool_calls",
            "`max_tool_calls` is not supported: it limits built-in tools, which iop does not run",
        ));
    }
    for key in [
        "store",
        "metadata",
        "include",
        "stream_options",
        "client_metadata",
    ] {
        match (key, present(body, key)) {
            (_, None) => {}
            ("store", Some(v)) if !v.is_boolean() => return Err(invalid(key, "a boolean")),
            ("metadata" | "stream_options" | "client_metadata", Some(v)) if !v.is_object() => {
                return Err(invalid(key, "an object"));
            }
            ("include", Some(v)) if !v.is_array() => return Err(invalid(key, "an array")),
            _ => {}
        }
    }
    Ok(())
}

/// One input item, appended to `messages` as chat messages.
fn input_item(item: &Value, at: &str, messages: &mut Vec<Value>) -> Result<(), ApiError> {
    let item = object(item, at)?;
    match opt_string(item, "type", at)? {
        None | Some("message") => messages.push(message_item(item, at)?),
        Some("function_call") => function_call(item, at, messages)?,
        Some("function_call_output") => {
            only_known(item, &["type", "call_id", "output", "id", "status"], at)?;
            let call_id = string(item, "call_id", at)?;
            let output = call_output(item.get("output"), at)?;
            messages.push(json!({"role": "tool", "tool_call_id": call_id, "content": output}));
        }
        // Earlier reasoning: a chat request has no place for it.
        Some("reasoning") => {}
        Some("item_reference") => {
            return Err(unsupported(
                &join(at, "type"),
                "item references are not supported: iop keeps no response store; send the item itself",
            ));
        }
        Some(other) => {
            return Err(unsupported(
                &join(at, "type"),
                format!(
                    "`{other}` input items are not supported: iop serves messages, function calls \
                     and function call outputs"
                ),
            ));
        }
    }
    Ok(())
}

/// A `message` item as a chat message.
fn message_item(item: &Map<String, Value>, at: &str) -> Result<Value, ApiError> {
    only_known(
        item,
        &["type", "role", "content", "id", "status", "phase"],
        at,
    )?;
    let role = match string(item, "role", at)? {
        "user" => "user",
        "assistant" => "assistant",
        "system" | "developer" => "system",
        other => {
            return Err(invalid(
                &join(at, "role"),
                &format!("one of user, assistant, system, developer (not {other:?})"),
            ));
        }
    };
    let content = message_content(item.get("content"), &join(at, "content"), role)?;
    Ok(json!({"role": role, "content": content}))
}

/// A `function_call` item: a tool call of the assistant message right before it, or of
/// a new one.
fn function_call(
    item: &Map<String, Value>,
    at: &str,
    messages: &mut Vec<Value>,
) -> Result<(), ApiError> {
    only_known(
        item,
        &[
            "type",
            "call_id",
            "name",
            "arguments",
            "id",
            "status",
            "namespace",
        ],
        at,
    )?;
    let name = string(item, "name", at)?;
    let name = match opt_string(item, "namespace", at)? {
        Some(namespace) => qualified_name(namespace, name),
        None => name.to_string(),
    };
    let call = json!({
        "id": string(item, "call_id", at)?,
        "type": "function",
        "function": {
            "name": name,
            "arguments": opt_string(item, "arguments", at)?.unwrap_or("{}"),
        },
    });
    match messages.last_mut() {
        Some(last) if last["role"] == "assistant" => {
            let calls = last
                .as_object_mut()
                .expect("messages are objects")
                .entry("tool_calls")
                .or_insert_with(|| Value::Array(Vec::new()));
            if let Value::Array(calls) = calls {
                calls.push(call);
            }
        }
        _ => messages.push(json!({"role": "assistant", "content": null, "tool_calls": [call]})),
    }
    Ok(())
}

/// A `function_call_output` item's output as text: a string, or its text parts joined.
fn call_output(output: Option<&Value>, at: &str) -> Result<String, ApiError> {
    match output {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (j, part) in parts.iter().enumerate() {
                let path = format!("{at}.output[{j}]");
                let part = object(part, &path)?;
                match opt_string(part, "type", &path)? {
                    Some("input_text" | "output_text") => {
                        text.push_str(string(part, "text", &path)?);
                    }
                    other => {
                        return Err(unsupported(
                            &join(&path, "type"),
                            format!(
                                "function call outputs can hold text parts only, not {}",
                                other.unwrap_or("untyped parts")
                            ),
                        ));
                    }
                }
            }
            Ok(text)
        }
        _ => Err(invalid(
            &join(at, "output"),
            "a string or an array of text parts",
        )),
    }
}

/// A message's content as chat content: a string as it is; parts as chat parts (a single
/// text part as a plain string, which every backend reads).
fn message_content(content: Option<&Value>, at: &str, role: &str) -> Result<Value, ApiError> {
    let parts = match content {
        Some(Value::String(s)) => return Ok(Value::String(s.clone())),
        Some(Value::Array(parts)) => parts,
        _ => return Err(invalid(at, "a string or an array of content parts")),
    };
    let mut out = Vec::with_capacity(parts.len());
    for (j, part) in parts.iter().enumerate() {
        let path = format!("{at}[{j}]");
        let part = object(part, &path)?;
        match string(part, "type", &path)? {
            "input_text" | "output_text" => {
                out.push(json!({"type": "text", "text": string(part, "text", &path)?}));
            }
            "refusal" => {
                out.push(json!({"type": "text", "text": string(part, "refusal", &path)?}));
            }
            "input_image" if role == "user" => {
                if present(part, "file_id").is_some() {
                    return Err(unsupported(
                        &join(&path, "file_id"),
                        "images by file id are not supported: iop keeps no files; send `image_url` (a data: URL or a URL)",
                    ));
                }
                let url = string(part, "image_url", &path)?;
                let mut image = json!({"url": url});
                if let Some(detail) = opt_string(part, "detail", &path)? {
                    image["detail"] = detail.into();
                }
                out.push(json!({"type": "image_url", "image_url": image}));
            }
            other => {
                return Err(unsupported(
                    &join(&path, "type"),
                    format!(
                        "`{other}` content parts are not supported here: iop takes text parts, and \
                         images in user messages"
                    ),
                ));
            }
        }
    }
    if out.iter().all(|p| p["type"] == "text") {
        let text: String = out
            .iter()
            .filter_map(|p| p["text"].as_str())
            .collect::<Vec<_>>()
            .join("");
        return Ok(Value::String(text));
    }
    Ok(Value::Array(out))
}

/// Built-in tools the backend runs for OpenAI (iop's backends run none): a request that
/// offers them is served without them, and the response says which were dropped
/// (`x-iop-dropped-tools`). One that *requires* one (`tool_choice`) is still refused.
const HOSTED_TOOLS: &[&str] = &[
    "web_search",
    "web_search_preview",
    "web_search_preview_2025_03_11",
    "file_search",
    "code_interpreter",
    "image_generation",
    "computer_use_preview",
    "local_shell",
    "mcp",
];

/// The built-in tools `request` offers, which its translation leaves out.
pub fn dropped_tools(request: &ClientRequest) -> Vec<String> {
    let Ok(Some(tools)) = request.typed::<Vec<Value>>("tools") else {
        return Vec::new();
    };
    tools
        .iter()
        .filter_map(|t| t.get("type")?.as_str())
        .filter(|t| HOSTED_TOOLS.contains(t))
        .map(String::from)
        .collect()
}

/// The chat tools for the request's `tools`: function tools as they are, the function
/// tools of a `namespace` under their qualified names ([`qualified_name`]), built-in tools
/// left out.
fn tools(body: &Map<String, Value>, chat: &mut Map<String, Value>) -> Result<(), ApiError> {
    let Some(tools) = crate::canonical::fields::opt_array(body, "tools", "")? else {
        return Ok(());
    };
    let mut out = Vec::new();
    for (i, t) in tools.iter().enumerate() {
        let at = format!("tools[{i}]");
        let kind = t.get("type").and_then(Value::as_str);
        if kind.is_some_and(|kind| HOSTED_TOOLS.contains(&kind)) {
            continue;
        }
        if kind == Some("namespace") {
            namespace_tools(object(t, &at)?, &at, &mut out)?;
        } else {
            out.push(tool(t, &at)?);
        }
    }
    let mut seen = std::collections::HashSet::new();
    for (i, t) in out.iter().enumerate() {
        let name = t["function"]["name"].as_str().unwrap_or_default();
        if !seen.insert(name) {
            return Err(invalid(
                "tools",
                &format!(
                    "tools with distinct names (`{name}` is offered twice; tool {i} after qualification)"
                ),
            ));
        }
    }
    if !out.is_empty() {
        chat.insert("tools".into(), Value::Array(out));
    }
    Ok(())
}

/// Between a namespace and a tool's name in the name the backend sees.
const NAMESPACE_SEPARATOR: &str = "__";

/// The name a backend sees for the tool `name` of the namespace `namespace`: both joined
/// by `__` (a chat tool name has no namespace; the answer's calls are turned back into
/// `namespace` + `name` with [`namespaced_names`]).
pub fn qualified_name(namespace: &str, name: &str) -> String {
    format!("{namespace}{NAMESPACE_SEPARATOR}{name}")
}

/// A `namespace` tool's function tools, appended to `out` as chat tools under their
/// qualified names.
fn namespace_tools(t: &Map<String, Value>, at: &str, out: &mut Vec<Value>) -> Result<(), ApiError> {
    only_known(t, &["type", "name", "description", "tools"], at)?;
    let namespace = string(t, "name", at)?;
    let inner = crate::canonical::fields::opt_array(t, "tools", at)?;
    for (j, inner) in inner.into_iter().flatten().enumerate() {
        let at = format!("{at}.tools[{j}]");
        let mut chat_tool = tool(inner, &at)?;
        let name = chat_tool["function"]["name"].as_str().unwrap_or_default();
        chat_tool["function"]["name"] = qualified_name(namespace, name).into();
        out.push(chat_tool);
    }
    Ok(())
}

/// For each tool offered inside a `namespace`: its qualified name (what a backend calls)
/// with the namespace and the name the client knows it by.
pub fn namespaced_names(request: &Map<String, Value>) -> Vec<(String, String, String)> {
    let Some(Value::Array(tools)) = request.get("tools") else {
        return Vec::new();
    };
    let mut names = Vec::new();
    for t in tools {
        if t.get("type").and_then(Value::as_str) != Some("namespace") {
            continue;
        }
        let Some(namespace) = t.get("name").and_then(Value::as_str) else {
            continue;
        };
        let inner = t
            .get("tools")
            .and_then(Value::as_array)
            .into_iter()
            .flatten();
        for name in inner.filter_map(|i| i.get("name").and_then(Value::as_str)) {
            let qualified = qualified_name(namespace, name);
            names.push((qualified, namespace.to_string(), name.to_string()));
        }
    }
    names
}

/// A Responses function tool as a chat tool; other kinds are refused.
fn tool(tool: &Value, at: &str) -> Result<Value, ApiError> {
    let t = object(tool, at)?;
    match string(t, "type", at)? {
        "function" => {
            only_known(
                t,
                &[
                    "type",
                    "name",
                    "description",
                    "parameters",
                    "strict",
                    "defer_loading",
                ],
                at,
            )?;
            let parameters = present(t, "parameters");
            if let Some(p) = parameters {
                object(p, &join(at, "parameters"))?;
            }
            translated::function_tool(t, at, parameters.cloned())
        }
        other => Err(unsupported(
            &join(at, "type"),
            format!(
                "the tool type `{other}` is not available through iop: only function tools \
                 (the client runs them) are, and built-in tools are left out"
            ),
        )),
    }
}

fn tool_choice(choice: &Value) -> Result<Value, ApiError> {
    match choice {
        Value::String(s) if matches!(s.as_str(), "auto" | "none" | "required") => {
            Ok(choice.clone())
        }
        Value::Object(o) if o.get("type").and_then(Value::as_str) == Some("function") => {
            let name = string(o, "name", "tool_choice")?;
            Ok(json!({"type": "function", "function": {"name": name}}))
        }
        Value::Object(_) => Err(unsupported(
            "tool_choice",
            "only `auto`, `none`, `required` and {\"type\": \"function\", \"name\": …} are supported",
        )),
        _ => Err(invalid(
            "tool_choice",
            "`auto`, `none`, `required` or a function choice object",
        )),
    }
}

/// `text.format` as a chat `response_format` (`None` for plain text).
fn response_format(text: &Value) -> Result<Option<Value>, ApiError> {
    let text = object(text, "text")?;
    only_known(text, &["format", "verbosity"], "text")?;
    let Some(format) = present(text, "format") else {
        return Ok(None);
    };
    let format = object(format, "text.format")?;
    match string(format, "type", "text.format")? {
        "text" => Ok(None),
        "json_object" => Ok(Some(json!({"type": "json_object"}))),
        "json_schema" => {
            only_known(
                format,
                &["type", "name", "schema", "strict", "description"],
                "text.format",
            )?;
            let mut schema = json!({
                "name": string(format, "name", "text.format")?,
                "schema": object(format.get("schema").unwrap_or(&Value::Null), "text.format.schema")?,
            });
            if let Some(s) = opt_bool(format, "strict", "text.format")? {
                schema["strict"] = s.into();
            }
            if let Some(d) = opt_string(format, "description", "text.format")? {
                schema["description"] = d.into();
            }
            Ok(Some(json!({"type": "json_schema", "json_schema": schema})))
        }
        other => Err(invalid(
            "text.format.type",
            &format!("one of text, json_object, json_schema (not {other:?})"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(v: Value) -> Result<Value, ApiError> {
        let body = v.to_string();
        let request = ClientRequest::parse(body.as_bytes()).unwrap();
        to_chat(&request).map(Value::Object)
    }

    /// The names of the chat tools a translation offers.
    fn tool_names(chat: &Value) -> Vec<&str> {
        chat["tools"]
            .as_array()
            .map(|tools| {
                tools
                    .iter()
                    .map(|t| t["function"]["name"].as_str().unwrap())
                    .collect()
            })
            .unwrap_or_default()
    }

    fn checked(v: Value) -> Result<Checked, ApiError> {
        let body = v.to_string();
        check(&ClientRequest::parse(body.as_bytes()).unwrap())
    }

    #[test]
    fn a_string_input_with_instructions_and_options() {
        let c = chat(json!({"model": "g", "input": "hi", "instructions": "be brief",
            "max_output_tokens": 50, "temperature": 0.2, "top_p": 0.9, "stream": true,
            "user": "u1", "store": true, "metadata": {"k": "v"}, "include": ["reasoning.encrypted_content"],
            "reasoning": {"effort": "low", "summary": "auto"}, "parallel_tool_calls": false}))
        .unwrap();
        assert_eq!(
            c,
            json!({"model": "g", "messages": [
                {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
                "max_tokens": 50, "temperature": 0.2, "top_p": 0.9, "parallel_tool_calls": false,
                "stream": true, "user": "u1", "reasoning_effort": "low"})
        );
    }

    #[test]
    fn items_become_messages_with_images_tool_calls_and_outputs() {
        let c = chat(json!({"model": "g", "input": [
            {"role": "developer", "content": "rules"},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "what is "},
                {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "low"},
            ]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "checking", "annotations": []}]},
            {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": "{\"q\":1}"},
            {"type": "function_call", "call_id": "call_2", "name": "now", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "42"},
            {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "noon"}]},
            {"type": "function_call", "call_id": "call_3", "name": "again"},
        ]}))
        .unwrap();
        assert_eq!(
            c["messages"],
            json!([
                {"role": "system", "content": "rules"},
                {"role": "user", "content": [
                    {"type": "text", "text": "what is "},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "low"}}]},
                {"role": "assistant", "content": "checking", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": "{\"q\":1}"}},
                    {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "42"},
                {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
                {"role": "assistant", "content": null, "tool_calls": [
                    {"id": "call_3", "type": "function", "function": {"name": "again", "arguments": "{}"}}]},
            ])
        );
    }

    #[test]
    fn function_tools_choices_and_formats_map_to_chat() {
        let c = chat(json!({"model": "g", "input": "x",
            "tools": [{"type": "function", "name": "f", "description": "d",
                       "parameters": {"type": "object"}, "strict": true}],
            "tool_choice": {"type": "function", "name": "f"},
            "text": {"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}, "strict": true}}}))
        .unwrap();
        assert_eq!(
            c["tools"],
            json!([{"type": "function", "function": {"name": "f", "description": "d",
                    "parameters": {"type": "object"}, "strict": true}}])
        );
        assert_eq!(
            c["tool_choice"],
            json!({"type": "function", "function": {"name": "f"}})
        );
        assert_eq!(
            c["response_format"],
            json!({"type": "json_schema", "json_schema": {"name": "out", "schema": {"type": "object"}, "strict": true}})
        );
        let c = chat(
            json!({"model": "g", "input": "x", "tool_choice": "required",
            "text": {"format": {"type": "json_object"}}}),
        )
        .unwrap();
        assert_eq!(c["tool_choice"], "required");
        assert_eq!(c["response_format"], json!({"type": "json_object"}));
        let c = chat(json!({"model": "g", "input": "x", "text": {"format": {"type": "text"}}}))
            .unwrap();
        assert!(c.get("response_format").is_none());
    }

    #[test]
    fn what_codex_sends_is_accepted_and_built_in_tools_are_left_out() {
        let body = json!({
            "model": "g",
            "instructions": "You are Codex.",
            "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
            "tools": [
                {"type": "function", "name": "shell", "parameters": {"type": "object"}, "strict": false},
                {"type": "web_search"},
                {"type": "file_search", "vector_store_ids": ["v"]}
            ],
            "tool_choice": "auto",
            "parallel_tool_calls": false,
            "reasoning": {"effort": "medium", "summary": "auto"},
            "store": false,
            "stream": true,
            "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "session-1",
            "client_metadata": {"originator": "codex_exec"}
        });
        let c = chat(body.clone()).unwrap();
        let names = tool_names(&c);
        assert_eq!(names, ["shell"]);
        assert!(c.get("client_metadata").is_none());
        let bytes = serde_json::to_vec(&body).unwrap();
        let request = ClientRequest::parse(&bytes).unwrap();
        assert_eq!(dropped_tools(&request), ["web_search", "file_search"]);
    }

    #[test]
    fn namespace_tools_are_offered_qualified_and_their_calls_read_back() {
        let body = json!({
            "model": "g",
            "input": [
                {"type": "message", "role": "user", "content": "spawn one"},
                {"type": "function_call", "call_id": "c1", "name": "spawn_agent",
                 "namespace": "multi_agent_v1", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "ok"}
            ],
            "tools": [
                {"type": "function", "name": "exec_command", "parameters": {"type": "object"}},
                {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.",
                 "tools": [
                     {"type": "function", "name": "spawn_agent", "strict": false,
                      "parameters": {"type": "object", "properties": {}}},
                     {"type": "function", "name": "close_agent"}
                 ]}
            ]
        });
        let c = chat(body.clone()).unwrap();
        let names = tool_names(&c);
        assert_eq!(
            names,
            [
                "exec_command",
                "multi_agent_v1__spawn_agent",
                "multi_agent_v1__close_agent"
            ]
        );
        assert_eq!(
            c["messages"][1]["tool_calls"][0]["function"]["name"],
            "multi_agent_v1__spawn_agent"
        );
        let names = namespaced_names(body.as_object().unwrap());
        assert_eq!(
            names[0],
            (
                "multi_agent_v1__spawn_agent".to_string(),
                "multi_agent_v1".to_string(),
                "spawn_agent".to_string()
            )
        );
        // A qualified name that collides with another tool's is refused, naming `tools`.
        let clash = json!({"input": "x", "tools": [
            {"type": "function", "name": "a__b"},
            {"type": "namespace", "name": "a", "description": "", "tools": [{"type": "function", "name": "b"}]}
        ]});
        assert_eq!(chat(clash).unwrap_err().param.as_deref(), Some("tools"));
        // Inside a namespace, only function tools.
        let custom = json!({"input": "x", "tools": [
            {"type": "namespace", "name": "a", "description": "", "tools": [{"type": "custom", "name": "b"}]}
        ]});
        assert_eq!(
            chat(custom).unwrap_err().param.as_deref(),
            Some("tools[0].tools[0].type")
        );
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(200))]
        /// Any mix of function tools and namespaces: every tool the backend is offered
        /// maps back to the client's own name (and namespace), or the request is refused
        /// naming `tools` because two tools would share a name.
        #[test]
        fn namespaced_tool_names_map_back_or_are_refused(
            top in proptest::collection::vec("[a-c_]{1,5}", 0..4),
            spaces in proptest::collection::vec(
                ("[a-c]{1,3}", proptest::collection::vec("[a-c_]{1,3}", 1..4)),
                0..3,
            ),
        ) {
            let mut tools: Vec<Value> = top
                .iter()
                .map(|n| json!({"type": "function", "name": n}))
                .collect();
            for (space, names) in &spaces {
                let inner: Vec<Value> =
                    names.iter().map(|n| json!({"type": "function", "name": n})).collect();
                tools.push(json!({"type": "namespace", "name": space, "description": "", "tools": inner}));
            }
            let body = json!({"input": "x", "tools": tools});
            let mut offered: Vec<(Option<&str>, &str)> =
                top.iter().map(|n| (None, n.as_str())).collect();
            for (space, names) in &spaces {
                offered.extend(names.iter().map(|n| (Some(space.as_str()), n.as_str())));
            }
            let qualified: Vec<String> = offered
                .iter()
                .map(|(space, name)| space.map_or_else(|| name.to_string(), |s| qualified_name(s, name)))
                .collect();
            let distinct = qualified.iter().collect::<std::collections::HashSet<_>>().len() == qualified.len();
            match chat(body.clone()) {
                Ok(c) => {
                    proptest::prop_assert!(distinct);
                    let names = namespaced_names(body.as_object().unwrap());
                    let sent = tool_names(&c);
                    proptest::prop_assert_eq!(sent.len(), offered.len());
                    for (sent, (space, name)) in sent.iter().zip(&offered) {
                        let back = names.iter().find(|(q, _, _)| q == sent);
                        match space {
                            Some(space) => {
                                let (_, ns, n) = back.expect("a namespaced tool maps back");
                                proptest::prop_assert_eq!((ns.as_str(), n.as_str()), (*space, *name));
                            }
                            None => proptest::prop_assert!(back.is_none() && sent == name),
                        }
                    }
                }
                Err(e) => {
                    proptest::prop_assert!(!distinct, "{}", e.message);
                    proptest::prop_assert_eq!(e.param.as_deref(), Some("tools"));
                }
            }
        }
    }

    #[test]
    fn every_field_that_does_not_change_the_answer_is_accepted_and_left_out() {
        // docs/apis.md's table, row "accepted, ignored".
        for (field, value) in [
            ("client_metadata", json!({"originator": "codex_exec"})),
            ("metadata", json!({"team": "a"})),
            ("store", json!(true)),
            ("include", json!(["reasoning.encrypted_content"])),
            ("prompt_cache_key", json!("session-1")),
            ("prompt_cache_retention", json!("24h")),
            ("safety_identifier", json!("user-1")),
            ("service_tier", json!("auto")),
            ("stream_options", json!({"include_obfuscation": false})),
            ("text", json!({"verbosity": "low"})),
            ("reasoning", json!({"summary": "auto"})),
        ] {
            let mut body = json!({"model": "g", "input": "x"});
            body[field] = value;
            let c = chat(body.clone()).unwrap_or_else(|e| panic!("{body}: {}", e.message));
            let carried: Vec<&String> = c
                .as_object()
                .unwrap()
                .keys()
                .filter(|k| !matches!(k.as_str(), "model" | "messages"))
                .collect();
            assert!(
                carried.is_empty(),
                "{field} must not reach the backend: {c}"
            );
        }
    }

    #[test]
    fn what_cannot_be_honoured_is_a_400_naming_the_field() {
        for (body, param) in [
            (json!({"input": "x", "max_tool_calls": 3}), "max_tool_calls"),
            (json!({"input": "x", "top_logprobs": 2}), "top_logprobs"),
            (
                json!({"input": "x", "previous_response_id": "resp_1"}),
                "previous_response_id",
            ),
            (
                json!({"input": "x", "conversation": "conv_1"}),
                "conversation",
            ),
            (json!({"input": "x", "background": true}), "background"),
            (json!({"input": "x", "prompt": {"id": "p"}}), "prompt"),
            (json!({"input": "x", "truncation": "auto"}), "truncation"),
            (
                json!({"input": "x", "tools": [{"type": "crystal_ball"}]}),
                "tools[0].type",
            ),
            (
                json!({"input": "x", "tool_choice": {"type": "web_search"}}),
                "tool_choice",
            ),
            (
                json!({"input": "x", "client_metadata": "codex"}),
                "client_metadata",
            ),
            (json!({"input": "x", "frobnicate": 1}), "frobnicate"),
            (
                json!({"input": [{"type": "item_reference", "id": "msg_1"}]}),
                "input[0].type",
            ),
            (
                json!({"input": [{"type": "web_search_call", "id": "w"}]}),
                "input[0].type",
            ),
            (
                json!({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}),
                "input[0].content[0].type",
            ),
            (
                json!({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]}),
                "input[0].content[0].file_id",
            ),
            (
                json!({"input": [{"role": "robot", "content": "x"}]}),
                "input[0].role",
            ),
            (
                json!({"input": [{"role": "user", "content": 5}]}),
                "input[0].content",
            ),
            (
                json!({"input": [{"type": "function_call", "name": "f"}]}),
                "input[0].call_id",
            ),
            (
                json!({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]}),
                "input[0].output",
            ),
            (json!({"input": [3]}), "input[0]"),
            (json!({"input": []}), "input"),
            (json!({"input": "x", "temperature": "hot"}), "temperature"),
            (
                json!({"input": "x", "text": {"format": {"type": "yaml"}}}),
                "text.format.type",
            ),
            (
                json!({"input": "x", "tools": [{"type": "function"}]}),
                "tools[0].name",
            ),
        ] {
            let e = chat(body.clone()).unwrap_err();
            assert_eq!(e.status, 400, "{body}");
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
        }
        let e = chat(json!({"input": "x", "previous_response_id": "r"})).unwrap_err();
        assert!(e.message.contains("no response store"), "{}", e.message);
    }

    #[test]
    fn the_checked_fields_hold_for_every_member() {
        assert_eq!(
            checked(json!({"input": "x", "stream": true, "max_output_tokens": 5})).unwrap(),
            Checked {
                stream: true,
                max_output_tokens: Some(5)
            }
        );
        assert_eq!(
            checked(json!({"input": "x", "max_output_tokens": null})).unwrap(),
            Checked {
                stream: false,
                max_output_tokens: None
            }
        );
        for (body, param) in [
            (json!({"input": "x", "stream": "yes"}), "stream"),
            (
                json!({"input": "x", "max_output_tokens": -1}),
                "max_output_tokens",
            ),
            (
                json!({"input": "x", "max_output_tokens": u64::MAX}),
                "max_output_tokens",
            ),
            (json!({"model": "m"}), "input"),
            (json!({"input": 5}), "input"),
        ] {
            let e = checked(body.clone()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{body}");
        }
    }
}
