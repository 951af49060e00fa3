//! The OpenAI API as a codec: `POST /v1/chat/completions`, `/v1/completions` and
//! `/v1/embeddings` requests are the canonical form already, so decoding reads and checks
//! them ([`decode`]) and they go on as they are; answers the edge renders are written by
//! [`render`], errors by [`error`].
//!
//! `model` names a model group. Only the fields the edge itself reads are checked (a
//! mistake gets a 400 naming the field here rather than an opaque failure upstream, and
//! the edge and the backend can never read a field differently); every other field
//! passes to the backend untouched.
//!
//! Pure: no I/O.

pub mod error;
pub mod render;

use serde_json::value::RawValue;
use serde_json::{Map, Value};

use crate::canonical::json::WrongType;
use crate::canonical::{ApiError, ClientRequest, Decoded, Operation};

/// Reads and checks a request for `op`.
pub fn decode(op: Operation, body: &[u8]) -> Result<Decoded<'_>, ApiError> {
    let request = ClientRequest::parse(body)?;
    let model = requested_group(&request)?;
    validate(&request, op)?;
    let stream = op.generates() && request.get::<bool>("stream").unwrap_or(false);
    Ok(Decoded::openai(model, op, stream, request))
}

/// Whether a request asked for a usage chunk at the end of its stream.
pub fn include_usage(request: &ClientRequest) -> bool {
    crate::codec::openai_request::client_asked(request)
}

/// The model group `request` names (`model`).
pub fn requested_group(request: &ClientRequest) -> Result<String, ApiError> {
    match request.typed::<String>("model") {
        Ok(Some(m)) if !m.is_empty() => Ok(m),
        Ok(None) if !request.has("model") => Err(ApiError::bad_request(
            "missing_model",
            "you must provide a `model` parameter",
        )
        .with_param("model")),
        _ => Err(
            ApiError::bad_request("invalid_model", "`model` must be a non-empty string")
                .with_param("model"),
        ),
    }
}

/// Largest `max_tokens` / `max_completion_tokens` accepted.
pub const MAX_TOKENS_LIMIT: u64 = i32::MAX as u64;
/// Largest `n` (choices per request) accepted, as OpenAI's API.
pub const MAX_CHOICES: u64 = 128;

/// The parameters the edge itself reads, checked.
pub fn validate(request: &ClientRequest, op: Operation) -> Result<(), ApiError> {
    match op {
        Operation::Chat => validate_messages(request)?,
        Operation::Completion => validate_text_input(request, "prompt")?,
        Operation::Embedding => validate_text_input(request, "input")?,
    }
    let wrong = |param: &str, what: &str| {
        ApiError::invalid_param(param, format!("`{param}` must be {what}"))
    };
    if request.typed::<bool>("stream").is_err() {
        return Err(wrong("stream", "a boolean").with_detail("invalid_stream"));
    }
    for key in ["max_tokens", "max_completion_tokens"] {
        match request.typed::<u64>(key) {
            Ok(Some(n)) if n > MAX_TOKENS_LIMIT => {}
            Ok(_) => continue,
            Err(WrongType) => {}
        }
        return Err(wrong(
            key,
            &format!("an integer from 0 to {MAX_TOKENS_LIMIT}"),
        ));
    }
    match request.typed::<u64>("n") {
        Ok(Some(n)) if !(1..=MAX_CHOICES).contains(&n) => {
            return Err(wrong("n", &format!("an integer from 1 to {MAX_CHOICES}")));
        }
        Err(WrongType) => return Err(wrong("n", &format!("an integer from 1 to {MAX_CHOICES}"))),
        Ok(_) => {}
    }
    for key in ["temperature", "top_p"] {
        if request.typed::<f64>(key).is_err() {
            return Err(wrong(key, "a number"));
        }
    }
    match request.typed::<serde_json::Number>("seed") {
        Ok(Some(n)) if !(n.is_i64() || n.is_u64()) => return Err(wrong("seed", "an integer")),
        Err(WrongType) => return Err(wrong("seed", "an integer")),
        _ => {}
    }
    match request.typed::<Value>("stop") {
        Ok(None | Some(Value::String(_))) => {}
        Ok(Some(Value::Array(items))) if items.iter().all(Value::is_string) => {}
        _ => return Err(wrong("stop", "a string or an array of strings")),
    }
    match request.typed::<Map<String, Value>>("stream_options") {
        Ok(None) => {}
        Ok(Some(options)) => {
            if !matches!(
                options.get("include_usage"),
                None | Some(Value::Null | Value::Bool(_))
            ) {
                return Err(wrong("stream_options.include_usage", "a boolean"));
            }
        }
        Err(WrongType) => return Err(wrong("stream_options", "an object")),
    }
    Ok(())
}

/// `messages`: a non-empty array of objects, each with a string `role` and a `content`
/// that is a string, an array of content parts (objects) or absent.
fn validate_messages(request: &ClientRequest) -> Result<(), ApiError> {
    let messages = match request.typed::<Vec<&RawValue>>("messages") {
        Ok(Some(m)) if !m.is_empty() => m,
        Ok(None) if !request.has("messages") => {
            return Err(ApiError::bad_request(
                "missing_messages",
                "you must provide a `messages` parameter",
            )
            .with_param("messages"));
        }
        _ => {
            return Err(ApiError::bad_request(
                "invalid_messages",
                "`messages` must be a non-empty array of message objects",
            )
            .with_param("messages"));
        }
    };
    for (i, raw) in messages.iter().enumerate() {
        let at = format!("messages[{i}]");
        let Ok(message) = serde_json::from_str::<Map<String, Value>>(raw.get()) else {
            return Err(ApiError::invalid_param(
                &at,
                format!("`{at}` must be a message object"),
            ));
        };
        if !matches!(message.get("role"), Some(Value::String(_))) {
            let param = format!("{at}.role");
            return Err(ApiError::invalid_param(
                &param,
                format!("`{param}` must be a string"),
            ));
        }
        match message.get("content") {
            None | Some(Value::Null | Value::String(_)) => {}
            Some(Value::Array(parts)) => {
                if let Some(j) = parts.iter().position(|p| !p.is_object()) {
                    let param = format!("{at}.content[{j}]");
                    return Err(ApiError::invalid_param(
                        &param,
                        format!("`{param}` must be a content part object"),
                    ));
                }
            }
            Some(_) => {
                let param = format!("{at}.content");
                return Err(ApiError::invalid_param(
                    &param,
                    format!("`{param}` must be a string or an array of content parts"),
                ));
            }
        }
    }
    Ok(())
}

/// `prompt` / `input`: a string or an array (of strings or token ids).
fn validate_text_input(request: &ClientRequest, key: &str) -> Result<(), ApiError> {
    match request.typed::<Value>(key) {
        Ok(Some(Value::String(_) | Value::Array(_))) => Ok(()),
        Ok(None) if !request.has(key) => Err(ApiError::bad_request(
            &format!("missing_{key}"),
            format!("you must provide the `{key}` parameter (a string or an array)"),
        )
        .with_param(key)),
        _ => Err(ApiError::invalid_param(
            key,
            format!("`{key}` must be a string or an array"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn check(v: Value, op: Operation) -> Result<(), ApiError> {
        let body = v.to_string();
        validate(&ClientRequest::parse(body.as_bytes()).unwrap(), op)
    }

    #[test]
    fn validation_names_the_parameter() {
        let e = check(json!({"model": "m"}), Operation::Chat).unwrap_err();
        assert!(e.message.contains("messages"));
        let e = check(json!({"model": "m", "messages": []}), Operation::Chat).unwrap_err();
        assert!(e.message.contains("non-empty"));
        let hi = json!([{"role": "user", "content": "hi"}]);
        let e = check(json!({"messages": hi, "stream": "yes"}), Operation::Chat).unwrap_err();
        assert!(e.message.contains("stream"));
        assert_eq!(e.param.as_deref(), Some("stream"));
        assert!(check(json!({"messages": hi, "stream": null}), Operation::Chat).is_ok());
        assert!(check(json!({"input": "x"}), Operation::Embedding).is_ok());
        assert!(check(json!({"input": 3}), Operation::Embedding).is_err());
    }

    #[test]
    fn every_malformed_field_is_a_400_naming_it() {
        let hi = json!([{"role": "user", "content": "hi"}]);
        let cases = [
            (json!({"messages": hi, "max_tokens": -1}), "max_tokens"),
            (
                json!({"messages": hi, "max_tokens": 9223372036854775808u64}),
                "max_tokens",
            ),
            (
                json!({"messages": hi, "max_tokens": u64::MAX}),
                "max_tokens",
            ),
            (json!({"messages": hi, "max_tokens": "5"}), "max_tokens"),
            (json!({"messages": hi, "max_tokens": 5.5}), "max_tokens"),
            (
                json!({"messages": hi, "max_completion_tokens": -1}),
                "max_completion_tokens",
            ),
            (json!({"messages": hi, "n": 1_000_000}), "n"),
            (json!({"messages": hi, "n": 0}), "n"),
            (json!({"messages": hi, "n": "2"}), "n"),
            (json!({"messages": hi, "stream": 1}), "stream"),
            (json!({"messages": hi, "temperature": "hot"}), "temperature"),
            (json!({"messages": hi, "top_p": [1]}), "top_p"),
            (json!({"messages": hi, "seed": 1.5}), "seed"),
            (json!({"messages": hi, "stop": [1]}), "stop"),
            (
                json!({"messages": hi, "stream_options": true}),
                "stream_options",
            ),
            (
                json!({"messages": hi, "stream_options": {"include_usage": "yes"}}),
                "stream_options.include_usage",
            ),
            (json!({"messages": [1, 2]}), "messages[0]"),
            (json!({"messages": "hi"}), "messages"),
            (json!({"messages": [{"content": "hi"}]}), "messages[0].role"),
            (
                json!({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": 5}]}),
                "messages[1].content",
            ),
            (
                json!({"messages": [{"role": "user", "content": ["text"]}]}),
                "messages[0].content[0]",
            ),
        ];
        for (body, param) in cases {
            let e = check(body.clone(), Operation::Chat).unwrap_err();
            assert_eq!(e.status, 400, "{body}");
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
        }
        let e = check(json!({"prompt": {"x": 1}}), Operation::Completion).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("prompt"));
        // What the OpenAI API accepts still passes.
        let ok = json!({
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                {"role": "assistant", "content": null, "tool_calls": []},
            ],
            "max_tokens": 0, "max_completion_tokens": MAX_TOKENS_LIMIT, "n": 128,
            "temperature": 0, "top_p": 0.5, "seed": -3, "stop": ["a", "b"],
            "stream": true, "stream_options": {"include_usage": true},
        });
        check(ok, Operation::Chat).unwrap();
        check(
            json!({"prompt": [1, 2, 3], "stop": null}),
            Operation::Completion,
        )
        .unwrap();
    }
}
