//! The native runs API as a codec: `POST /v1/runs` names an adapter (a provider id) on a
//! node and a target, with plain `input` or chat `messages`; decoding checks it strictly
//! (unknown and duplicate fields are errors naming the field) into a [`RunRequest`]. The
//! run's events go back as they are, one SSE `event:` per `RunEvent` ending with exactly
//! one terminal ([`event_json`], [`sse_event`]).
//!
//! Pure: no I/O.

use iop_proto::pb;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::canonical::ApiError;
use crate::canonical::json::parse_typed;
use crate::codec::RunSpec;
use crate::surfaces::openai::MAX_TOKENS_LIMIT;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RunBody {
    adapter: String,
    #[serde(default)]
    target: String,
    #[serde(default)]
    input: String,
    #[serde(default)]
    messages: Vec<MessageBody>,
    #[serde(default)]
    node: Option<String>,
    #[serde(default)]
    session_id: Option<String>,
    #[serde(default)]
    background: bool,
    #[serde(default)]
    max_tokens: Option<u32>,
    #[serde(default)]
    temperature: Option<f32>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct MessageBody {
    role: String,
    content: String,
}

/// A run as the client asked for it.
#[derive(Debug)]
pub struct RunRequest {
    /// The node named, if any (else the only ready node).
    pub node: Option<String>,
    /// The run; its session id as the client chose it (the service scopes it to the key).
    pub spec: RunSpec,
}

/// Reads and checks a `POST /v1/runs` body.
pub fn decode(body: &[u8]) -> Result<RunRequest, ApiError> {
    let request: RunBody = parse_typed(body)?;
    if request.adapter.is_empty() {
        return Err(ApiError::bad_request(
            "missing_adapter",
            "`adapter` must name an adapter of the node",
        )
        .with_param("adapter"));
    }
    if request.input.is_empty() && request.messages.is_empty() {
        return Err(
            ApiError::bad_request("missing_input", "give `input` or `messages`")
                .with_param("input"),
        );
    }
    if request
        .max_tokens
        .is_some_and(|n| u64::from(n) > MAX_TOKENS_LIMIT)
    {
        return Err(ApiError::invalid_param(
            "max_tokens",
            format!("`max_tokens` must be an integer from 0 to {MAX_TOKENS_LIMIT}"),
        ));
    }
    let spec = RunSpec {
        adapter: request.adapter,
        target: request.target,
        input: request.input,
        messages: request
            .messages
            .into_iter()
            .map(|m| pb::ChatMessage {
                role: m.role,
                content: m.content,
                ..Default::default()
            })
            .collect(),
        options: Some(pb::GenerationOptions {
            max_tokens: request.max_tokens,
            temperature: request.temperature,
            ..Default::default()
        }),
        session_id: request.session_id.unwrap_or_default(),
        background: request.background,
        ..Default::default()
    };
    Ok(RunRequest {
        node: request.node,
        spec,
    })
}

/// A RunEvent as JSON.
pub fn event_json(e: &pb::RunEvent) -> Value {
    let mut v = json!({"run_id": e.run_id, "seq": e.seq, "kind": e.kind().name()});
    if !e.text.is_empty() {
        v["text"] = json!(e.text);
    }
    if !e.model.is_empty() {
        v["model"] = json!(e.model);
    }
    if !e.finish_reason.is_empty() {
        v["finish_reason"] = json!(e.finish_reason);
    }
    if let Some(u) = &e.usage {
        let mut usage = json!({"input_tokens": u.input_tokens, "output_tokens": u.output_tokens});
        if let Some(r) = u.reasoning_tokens {
            usage["reasoning_tokens"] = json!(r);
        }
        if let Some(c) = u.cached_input_tokens {
            usage["cached_input_tokens"] = json!(c);
        }
        v["usage"] = usage;
    }
    if let Some(err) = &e.error {
        v["error"] = json!({"code": err.error_code().as_str(), "message": err.message});
    }
    if !e.tool_calls.is_empty() {
        v["tool_calls"] = e
            .tool_calls
            .iter()
            .map(|c| json!({"id": c.id, "name": c.name, "arguments": c.arguments}))
            .collect();
    }
    v
}

/// One run event as a server-sent event.
pub fn sse_event(e: &pb::RunEvent) -> Vec<u8> {
    format!("event: {}\ndata: {}\n\n", e.kind().name(), event_json(e)).into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_body_is_checked_strictly() {
        let r =
            decode(br#"{"adapter":"a","input":"hi","node":"n1","session_id":"s","max_tokens":4}"#)
                .unwrap();
        assert_eq!(r.node.as_deref(), Some("n1"));
        assert_eq!(
            (r.spec.adapter.as_str(), r.spec.session_id.as_str()),
            ("a", "s")
        );
        assert_eq!(r.spec.options.unwrap().max_tokens, Some(4));
        for (body, param) in [
            (&br#"{"adapter":"","input":"x"}"#[..], "adapter"),
            (br#"{"adapter":"a"}"#, "input"),
            (br#"{"adapter":"a","input":"x","bogus":1}"#, "bogus"),
            (
                br#"{"adapter":"a","input":"x","max_tokens":4294967295}"#,
                "max_tokens",
            ),
        ] {
            let e = decode(body).unwrap_err();
            assert_eq!(e.status, 400);
            assert_eq!(e.param.as_deref(), Some(param), "{}", e.message);
        }
    }

    #[test]
    fn events_are_named_by_their_kind() {
        let e = pb::RunEvent {
            run_id: "r".into(),
            seq: 3,
            kind: pb::RunEventKind::Delta as i32,
            text: "hi".into(),
            ..Default::default()
        };
        assert_eq!(
            String::from_utf8(sse_event(&e)).unwrap(),
            "event: delta\ndata: {\"kind\":\"delta\",\"run_id\":\"r\",\"seq\":3,\"text\":\"hi\"}\n\n"
        );
    }
}
