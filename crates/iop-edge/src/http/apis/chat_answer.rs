//! An OpenAI chat-completions answer from a tunnelled provider as answer events: a
//! `chat.completion` JSON document ([`completion`]), a stream's `data:` payloads one by
//! one ([`ChatStream`]), or an error body ([`provider_error`]).
//!
//! Only the first choice is read (translated requests never ask for more). Tool calls
//! arrive in pieces in a stream (id and name first, the arguments in fragments); each is
//! emitted complete once the provider finishes the answer, in the order of their index.
//!
//! Pure: no I/O.

use std::collections::BTreeMap;

use axum::http::StatusCode;
use serde_json::Value;

use super::answer::{AnswerEvent, Finish, FinishReason, ToolCall, usage_from_openai};
use crate::http::error::ApiError;

/// Most tool calls one streamed answer may make, and most bytes of them held while they
/// are assembled; a provider sending more fails the answer.
pub const MAX_TOOL_CALLS: usize = 1024;
pub const MAX_TOOL_CALL_BYTES: usize = 8 * 1024 * 1024;

/// The reasoning text of a message or delta: `reasoning_content` (DeepSeek, llama.cpp,
/// older vLLM) or `reasoning` (newer vLLM, Ollama's OpenAI API).
fn reasoning_of(v: &Value) -> Option<&str> {
    v.get("reasoning_content")
        .or_else(|| v.get("reasoning"))
        .and_then(Value::as_str)
}

fn text(v: Option<&Value>) -> String {
    v.and_then(Value::as_str).unwrap_or_default().to_string()
}

/// A whole `chat.completion` document as answer events, ending with its finish.
pub fn completion(body: &Value) -> Vec<AnswerEvent> {
    if let Some(error) = body.get("error") {
        return vec![AnswerEvent::Failed(error_of(
            StatusCode::BAD_GATEWAY,
            error,
        ))];
    }
    let Some(choice) = body.get("choices").and_then(|c| c.get(0)) else {
        return vec![AnswerEvent::Failed(bad_answer(
            "the provider's answer has no choices",
        ))];
    };
    let mut out = Vec::new();
    let message = choice.get("message").unwrap_or(&Value::Null);
    if let Some(r) = reasoning_of(message).filter(|r| !r.is_empty()) {
        out.push(AnswerEvent::Reasoning(r.to_string()));
    }
    if let Some(t) = message
        .get("content")
        .and_then(Value::as_str)
        .filter(|t| !t.is_empty())
    {
        out.push(AnswerEvent::Text(t.to_string()));
    }
    for call in message
        .get("tool_calls")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let function = call.get("function");
        out.push(AnswerEvent::ToolCall(ToolCall {
            id: text(call.get("id")),
            name: text(function.and_then(|f| f.get("name"))),
            arguments: arguments_text(function.and_then(|f| f.get("arguments"))),
        }));
    }
    out.push(AnswerEvent::Finished(Finish {
        reason: FinishReason::from_openai(
            choice
                .get("finish_reason")
                .and_then(Value::as_str)
                .unwrap_or(""),
        ),
        usage: body.get("usage").and_then(usage_from_openai),
    }));
    out
}

/// Arguments as JSON text: a string as it is, an object (some servers send one) as JSON.
fn arguments_text(v: Option<&Value>) -> String {
    match v {
        Some(Value::String(s)) => s.clone(),
        None | Some(Value::Null) => String::new(),
        Some(other) => other.to_string(),
    }
}

/// A tool call being assembled from stream fragments.
#[derive(Debug, Default)]
struct PartialCall {
    id: String,
    name: String,
    arguments: String,
}

/// Reads a streamed chat answer's `data:` payloads in order.
#[derive(Debug, Default)]
pub struct ChatStream {
    calls: BTreeMap<u64, PartialCall>,
    /// Bytes held in `calls`.
    call_bytes: usize,
    finish: Option<FinishReason>,
    usage: Option<iop_proto::pb::Usage>,
    /// `[DONE]` came: later payloads are ignored.
    done: bool,
    failed: bool,
}

impl ChatStream {
    /// One event's `data`: appends the events it makes to `out`. Returns false once the
    /// answer failed (the caller stops reading).
    pub fn data(&mut self, data: &str, out: &mut Vec<AnswerEvent>) -> bool {
        if self.done || self.failed {
            return !self.failed;
        }
        if data.trim() == "[DONE]" {
            self.done = true;
            return true;
        }
        let chunk: Value = match serde_json::from_str(data) {
            Ok(v) => v,
            Err(e) => return self.fail(out, bad_answer(&format!("an unreadable event: {e}"))),
        };
        if let Some(error) = chunk.get("error") {
            return self.fail(out, error_of(StatusCode::BAD_GATEWAY, error));
        }
        if let Some(usage) = chunk.get("usage").and_then(usage_from_openai) {
            self.usage = Some(usage);
        }
        let Some(choice) = chunk
            .get("choices")
            .and_then(Value::as_array)
            .and_then(|c| {
                c.iter()
                    .find(|c| c.get("index").and_then(Value::as_u64).unwrap_or(0) == 0)
            })
        else {
            return true;
        };
        let delta = choice.get("delta").unwrap_or(&Value::Null);
        if let Some(r) = reasoning_of(delta).filter(|r| !r.is_empty()) {
            out.push(AnswerEvent::Reasoning(r.to_string()));
        }
        if let Some(t) = delta
            .get("content")
            .and_then(Value::as_str)
            .filter(|t| !t.is_empty())
        {
            out.push(AnswerEvent::Text(t.to_string()));
        }
        for (position, call) in delta
            .get("tool_calls")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .enumerate()
        {
            let index = call
                .get("index")
                .and_then(Value::as_u64)
                .unwrap_or(position as u64);
            if !self.calls.contains_key(&index) && self.calls.len() >= MAX_TOOL_CALLS {
                return self.fail(
                    out,
                    bad_answer(&format!(
                        "the answer makes more than {MAX_TOOL_CALLS} tool calls"
                    )),
                );
            }
            let function = call.get("function");
            let id = call.get("id").and_then(Value::as_str).unwrap_or_default();
            let name = function
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .unwrap_or_default();
            let arguments = arguments_text(function.and_then(|f| f.get("arguments")));
            self.call_bytes += id.len() + name.len() + arguments.len();
            if self.call_bytes > MAX_TOOL_CALL_BYTES {
                return self.fail(
                    out,
                    bad_answer(&format!(
                        "the answer's tool calls are longer than {MAX_TOOL_CALL_BYTES} bytes"
                    )),
                );
            }
            let partial = self.calls.entry(index).or_default();
            partial.id.push_str(id);
            partial.name.push_str(name);
            partial.arguments.push_str(&arguments);
        }
        if let Some(reason) = choice.get("finish_reason").and_then(Value::as_str) {
            self.finish = Some(FinishReason::from_openai(reason));
            self.flush_calls(out);
        }
        true
    }

    /// The provider's stream ended: the answer's ending. A stream that ends before it
    /// said why it finished (no finish reason, no `[DONE]`) was cut short.
    pub fn end(&mut self, out: &mut Vec<AnswerEvent>) {
        if self.failed {
            return;
        }
        self.flush_calls(out);
        match self.finish.take() {
            Some(reason) => out.push(AnswerEvent::Finished(Finish {
                reason,
                usage: self.usage.take(),
            })),
            None if self.done => out.push(AnswerEvent::Finished(Finish {
                reason: FinishReason::Stop,
                usage: self.usage.take(),
            })),
            None => {
                self.fail(
                    out,
                    ApiError::upstream(
                        "provider_stream_error",
                        "the provider's stream ended before the answer finished",
                    ),
                );
            }
        }
    }

    /// `[DONE]` or the finish came: what follows can only be usage.
    pub fn finished(&self) -> bool {
        self.done
    }

    fn flush_calls(&mut self, out: &mut Vec<AnswerEvent>) {
        self.call_bytes = 0;
        for (_, call) in std::mem::take(&mut self.calls) {
            out.push(AnswerEvent::ToolCall(ToolCall {
                id: call.id,
                name: call.name,
                arguments: call.arguments,
            }));
        }
    }

    fn fail(&mut self, out: &mut Vec<AnswerEvent>, error: ApiError) -> bool {
        self.failed = true;
        out.push(AnswerEvent::Failed(error));
        false
    }
}

fn bad_answer(message: &str) -> ApiError {
    ApiError::upstream(
        "bad_upstream_response",
        &format!("the provider's chat answer could not be read: {message}"),
    )
}

/// An OpenAI-style error object (or a bare message) as an error with `status`.
fn error_of(status: StatusCode, error: &Value) -> ApiError {
    let message = match error {
        Value::String(s) => s.clone(),
        _ => error
            .get("message")
            .and_then(Value::as_str)
            .unwrap_or("the provider failed without a message")
            .to_string(),
    };
    let code = error
        .get("code")
        .and_then(|c| {
            c.as_str()
                .map(String::from)
                .or_else(|| c.as_u64().map(|n| n.to_string()))
        })
        .unwrap_or_else(|| "upstream_error".into());
    let mut e = ApiError::new(
        status,
        if status.is_client_error() {
            "invalid_request_error"
        } else {
            "upstream_error"
        },
        &code,
        message,
    );
    e.param = error.get("param").and_then(Value::as_str).map(String::from);
    e
}

/// A provider's error answer (a non-2xx status): its status (5xx other than 503 and 504
/// become 502: the edge is the server the client talks to) and its message, from an
/// OpenAI `{"error": …}` body or whatever text it sent.
pub fn provider_error(status: u16, body: &[u8]) -> ApiError {
    let status = match StatusCode::from_u16(status) {
        Ok(s) if s.is_client_error() => s,
        Ok(s @ (StatusCode::SERVICE_UNAVAILABLE | StatusCode::GATEWAY_TIMEOUT)) => s,
        _ => StatusCode::BAD_GATEWAY,
    };
    match serde_json::from_slice::<Value>(body) {
        Ok(v) if v.get("error").is_some() => error_of(status, &v["error"]),
        Ok(v) if v.get("message").is_some() => error_of(status, &v),
        _ => {
            let text = String::from_utf8_lossy(&body[..body.len().min(512)]);
            error_of(
                status,
                &Value::String(format!("the provider answered {status}: {}", text.trim())),
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn feed(chunks: &[Value]) -> Vec<AnswerEvent> {
        let mut s = ChatStream::default();
        let mut out = Vec::new();
        for c in chunks {
            s.data(&c.to_string(), &mut out);
        }
        s.data("[DONE]", &mut out);
        s.end(&mut out);
        out
    }

    #[test]
    fn a_completion_document_becomes_its_parts_in_order() {
        let body = json!({"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
            "role": "assistant", "content": "let me look", "reasoning_content": "hmm",
            "tool_calls": [{"id": "call_1", "type": "function",
                            "function": {"name": "lookup", "arguments": "{\"q\":\"x\"}"}}]}}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 6}});
        let out = completion(&body);
        assert!(matches!(&out[0], AnswerEvent::Reasoning(r) if r == "hmm"));
        assert!(matches!(&out[1], AnswerEvent::Text(t) if t == "let me look"));
        assert!(
            matches!(&out[2], AnswerEvent::ToolCall(c) if c.id == "call_1" && c.arguments == "{\"q\":\"x\"}")
        );
        match &out[3] {
            AnswerEvent::Finished(f) => {
                assert_eq!(f.reason, FinishReason::ToolCalls);
                assert_eq!(f.usage.unwrap().input_tokens, 4);
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            &completion(&json!({"choices": []}))[..],
            [AnswerEvent::Failed(_)]
        ));
    }

    #[test]
    fn streamed_tool_calls_are_assembled_and_emitted_at_the_finish() {
        let out = feed(&[
            json!({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
            json!({"choices": [{"index": 0, "delta": {"content": "Hi"}}]}),
            json!({"choices": [{"index": 0, "delta": {"tool_calls": [
                {"index": 0, "id": "call_a", "type": "function", "function": {"name": "f", "arguments": ""}}]}}]}),
            json!({"choices": [{"index": 0, "delta": {"tool_calls": [
                {"index": 1, "id": "call_b", "function": {"name": "g", "arguments": "{\"y\""}}]}}]}),
            json!({"choices": [{"index": 0, "delta": {"tool_calls": [
                {"index": 0, "function": {"arguments": "{\"x\":"}}]}}]}),
            json!({"choices": [{"index": 0, "delta": {"tool_calls": [
                {"index": 0, "function": {"arguments": "1}"}}, {"index": 1, "function": {"arguments": ":2}"}}]}}]}),
            json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}], "usage": null}),
            json!({"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 9}}),
        ]);
        assert!(matches!(&out[0], AnswerEvent::Text(t) if t == "Hi"));
        assert!(
            matches!(&out[1], AnswerEvent::ToolCall(c) if c.id == "call_a" && c.name == "f" && c.arguments == "{\"x\":1}")
        );
        assert!(
            matches!(&out[2], AnswerEvent::ToolCall(c) if c.id == "call_b" && c.arguments == "{\"y\":2}")
        );
        match &out[3] {
            AnswerEvent::Finished(f) => {
                assert_eq!(f.reason, FinishReason::ToolCalls);
                assert_eq!(f.usage.unwrap().output_tokens, 9);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(out.len(), 4);
    }

    #[test]
    fn reasoning_errors_and_cut_streams() {
        let out = feed(&[json!({"choices": [{"index": 0, "delta": {"reasoning": "think"}}]})]);
        assert!(matches!(&out[0], AnswerEvent::Reasoning(r) if r == "think"));
        // [DONE] without a finish reason still ends normally.
        assert!(matches!(&out[1], AnswerEvent::Finished(f) if f.reason == FinishReason::Stop));

        let mut s = ChatStream::default();
        let mut out = Vec::new();
        assert!(s.data(
            r#"{"choices":[{"index":0,"delta":{"content":"a"}}]}"#,
            &mut out
        ));
        assert!(!s.data(
            r#"{"error":{"message":"boom","type":"server_error"}}"#,
            &mut out
        ));
        s.end(&mut out);
        assert_eq!(out.len(), 2, "{out:?}");
        assert!(matches!(&out[1], AnswerEvent::Failed(e) if e.message == "boom"));

        // The body ended before any finish: cut short.
        let mut s = ChatStream::default();
        let mut out = Vec::new();
        s.data(
            r#"{"choices":[{"index":0,"delta":{"content":"a"}}]}"#,
            &mut out,
        );
        s.end(&mut out);
        assert!(matches!(&out[1], AnswerEvent::Failed(e) if e.code == "provider_stream_error"));

        let mut s = ChatStream::default();
        let mut out = Vec::new();
        assert!(!s.data("{not json", &mut out));
        assert!(matches!(&out[0], AnswerEvent::Failed(e) if e.status == 502));
    }

    #[test]
    fn too_many_tool_calls_fail_the_answer() {
        let mut s = ChatStream::default();
        let mut out = Vec::new();
        for i in 0..=MAX_TOOL_CALLS {
            let chunk = json!({"choices": [{"index": 0, "delta": {"tool_calls": [
                {"index": i, "id": "c", "function": {"name": "f", "arguments": "{}"}}]}}]});
            if !s.data(&chunk.to_string(), &mut out) {
                break;
            }
        }
        assert!(matches!(out.last(), Some(AnswerEvent::Failed(_))));

        // Arguments that never end.
        let mut s = ChatStream::default();
        let mut out = Vec::new();
        let piece = "x".repeat(64 * 1024);
        let chunk = json!({"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "function": {"arguments": piece}}]}}]})
        .to_string();
        let mut sent = 0;
        while s.data(&chunk, &mut out) {
            sent += 1;
            assert!(sent <= MAX_TOOL_CALL_BYTES / piece.len() + 1, "no limit");
        }
        assert!(
            matches!(out.last(), Some(AnswerEvent::Failed(e)) if e.message.contains("longer than"))
        );
    }

    #[test]
    fn provider_errors_keep_client_statuses_and_messages() {
        let e = provider_error(
            400,
            br#"{"error":{"message":"bad tools","type":"invalid_request_error","param":"tools","code":"x"}}"#,
        );
        assert_eq!((e.status.as_u16(), e.message.as_str()), (400, "bad tools"));
        assert_eq!(e.param.as_deref(), Some("tools"));
        let e = provider_error(500, b"oops");
        assert_eq!(e.status, 502);
        assert!(e.message.contains("oops"), "{}", e.message);
        let e = provider_error(503, br#"{"message":"loading"}"#);
        assert_eq!((e.status.as_u16(), e.message.as_str()), (503, "loading"));
    }
}
