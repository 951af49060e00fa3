//! An OpenAI-compatible provider's answer as canonical answer events: a whole
//! `chat.completion` / `text_completion` / embeddings document ([`document`]), a
//! stream's `data:` payloads one by one ([`StreamReader`]), or an error answer
//! ([`provider_error`]).
//!
//! Only the first choice is read (the edge never asks a translated request for more).
//! Tool calls arrive in pieces in a stream (id and name first, the arguments in
//! fragments); they are emitted complete, in the order of their index, once the provider
//! finishes the answer. Reasoning is read from `reasoning_content` (DeepSeek, llama.cpp,
//! older vLLM) or `reasoning` (newer vLLM, Ollama's OpenAI API).
//!
//! Pure: no I/O.

use std::collections::BTreeMap;

use iop_proto::pb;
use serde_json::Value;

use crate::canonical::{AnswerEvent, ApiError, FinishReason, Operation, ToolCall};

/// Most tool calls one streamed answer may make, and most bytes of them held while they
/// are assembled; a provider sending more fails the answer.
pub const MAX_TOOL_CALLS: usize = 1024;
pub const MAX_TOOL_CALL_BYTES: usize = 8 * 1024 * 1024;

/// An OpenAI `usage` object's counts; `None` if it is not an object. Counts that are
/// missing or not counts read as 0 (details as not reported); a top-level
/// `reasoning_tokens` counts when the details carry none.
fn usage_from_openai(usage: &Value) -> Option<pb::Usage> {
    iop_proto::usage::from_openai(usage, iop_proto::usage::OpenAiDialect::Vllm)
}

/// A non-empty string member of `v`.
fn text<'v>(v: Option<&'v Value>, key: &str) -> Option<&'v str> {
    v.and_then(|v| v.get(key))
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
}

/// The reasoning text of a message or delta.
fn reasoning(v: Option<&Value>) -> Option<&str> {
    text(v, "reasoning_content").or_else(|| text(v, "reasoning"))
}

/// Arguments as JSON text: a string as it is, an object (some servers send one) as JSON.
fn arguments_text(v: Option<&Value>) -> String {
    match v {
        Some(Value::String(s)) => s.clone(),
        None | Some(Value::Null) => String::new(),
        Some(other) => other.to_string(),
    }
}

/// A whole answer document for `op` as answer events, ending with its finish.
pub fn document(body: &Value, op: Operation) -> Vec<AnswerEvent> {
    if let Some(error) = body.get("error") {
        return vec![AnswerEvent::Failed(error_of(502, error))];
    }
    let usage = body.get("usage").and_then(usage_from_openai);
    if op == Operation::Embedding {
        return embeddings(body, usage);
    }
    let Some(choice) = body.get("choices").and_then(|c| c.get(0)) else {
        return vec![AnswerEvent::Failed(bad_answer(
            "the provider's answer has no choices",
        ))];
    };
    let mut out = Vec::new();
    let message = choice.get("message");
    if let Some(r) = reasoning(message) {
        out.push(AnswerEvent::Reasoning(r.to_string()));
    }
    // Chat answers carry `message.content`, completions `text`.
    if let Some(t) = text(message, "content").or_else(|| text(Some(choice), "text")) {
        out.push(AnswerEvent::Text(t.to_string()));
    }
    let calls: Vec<ToolCall> = message
        .and_then(|m| m.get("tool_calls"))
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .map(|call| {
            let function = call.get("function");
            let name = |key: &str| {
                function
                    .and_then(|f| f.get(key))
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_string()
            };
            ToolCall {
                id: call
                    .get("id")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_string(),
                name: name("name"),
                arguments: arguments_text(function.and_then(|f| f.get("arguments"))),
            }
        })
        .collect();
    if !calls.is_empty() {
        out.push(AnswerEvent::ToolCalls(calls));
    }
    let reason = choice
        .get("finish_reason")
        .and_then(Value::as_str)
        .unwrap_or("");
    out.push(AnswerEvent::finished(
        FinishReason::from_openai(reason),
        usage,
    ));
    out
}

/// An embeddings answer's vectors, in input order (OpenAI's `index`), whatever order the
/// provider listed them in.
fn embeddings(body: &Value, usage: Option<pb::Usage>) -> Vec<AnswerEvent> {
    let bad = || {
        vec![AnswerEvent::Failed(bad_answer(
            "the provider's embeddings answer has no `data` list of embeddings",
        ))]
    };
    let Some(data) = body.get("data").and_then(Value::as_array) else {
        return bad();
    };
    let mut indexed = Vec::with_capacity(data.len());
    for (i, item) in data.iter().enumerate() {
        let Some(vector) = item.get("embedding").filter(|e| e.is_array()) else {
            return bad();
        };
        let index = item
            .get("index")
            .and_then(Value::as_u64)
            .unwrap_or(i as u64);
        indexed.push((index, vector.clone()));
    }
    indexed.sort_by_key(|(i, _)| *i);
    vec![
        AnswerEvent::Embeddings(indexed.into_iter().map(|(_, v)| v).collect()),
        AnswerEvent::finished(FinishReason::Stop, usage),
    ]
}

/// A tool call being assembled from stream fragments.
#[derive(Debug, Default)]
struct PartialCall {
    id: String,
    name: String,
    arguments: String,
}

/// Reads a streamed chat or completions answer's `data:` payloads in order.
#[derive(Debug, Default)]
pub struct StreamReader {
    calls: BTreeMap<u64, PartialCall>,
    /// Bytes held in `calls`.
    call_bytes: usize,
    finish: Option<FinishReason>,
    usage: Option<pb::Usage>,
    /// `[DONE]` came: later payloads are ignored.
    done: bool,
    failed: bool,
}

impl StreamReader {
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
            return self.fail(out, error_of(502, error));
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
        let delta = choice.get("delta");
        if let Some(r) = reasoning(delta) {
            out.push(AnswerEvent::Reasoning(r.to_string()));
        }
        // Chat deltas carry `content`, completions chunks `text`.
        if let Some(t) = text(delta, "content").or_else(|| text(Some(choice), "text")) {
            out.push(AnswerEvent::Text(t.to_string()));
        }
        let calls = delta
            .and_then(|d| d.get("tool_calls"))
            .and_then(Value::as_array);
        for (position, call) in calls.into_iter().flatten().enumerate() {
            if let Err(error) = self.call_fragment(position, call) {
                return self.fail(out, error);
            }
        }
        if let Some(reason) = choice.get("finish_reason").and_then(Value::as_str) {
            self.finish = Some(FinishReason::from_openai(reason));
            self.flush_calls(out);
        }
        true
    }

    /// Adds one tool-call fragment, within the limits.
    fn call_fragment(&mut self, position: usize, call: &Value) -> Result<(), ApiError> {
        let index = call
            .get("index")
            .and_then(Value::as_u64)
            .unwrap_or(position as u64);
        if !self.calls.contains_key(&index) && self.calls.len() >= MAX_TOOL_CALLS {
            return Err(bad_answer(&format!(
                "the answer makes more than {MAX_TOOL_CALLS} tool calls"
            )));
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
            return Err(bad_answer(&format!(
                "the answer's tool calls are longer than {MAX_TOOL_CALL_BYTES} bytes"
            )));
        }
        let partial = self.calls.entry(index).or_default();
        partial.id.push_str(id);
        partial.name.push_str(name);
        partial.arguments.push_str(&arguments);
        Ok(())
    }

    /// The provider's stream ended: the answer's ending. A stream that ends before it
    /// said why it finished (no finish reason, no `[DONE]`) was cut short.
    pub fn end(&mut self, out: &mut Vec<AnswerEvent>) {
        if self.failed {
            return;
        }
        self.flush_calls(out);
        let reason = match self.finish.take() {
            Some(reason) => reason,
            None if self.done => FinishReason::Stop,
            None => {
                self.fail(
                    out,
                    ApiError::upstream(
                        "broken_stream",
                        "the provider's stream ended before the answer finished",
                    ),
                );
                return;
            }
        };
        out.push(AnswerEvent::finished(reason, self.usage.take()));
    }

    fn flush_calls(&mut self, out: &mut Vec<AnswerEvent>) {
        self.call_bytes = 0;
        let calls: Vec<ToolCall> = std::mem::take(&mut self.calls)
            .into_values()
            .map(|c| ToolCall {
                id: c.id,
                name: c.name,
                arguments: c.arguments,
            })
            .collect();
        if !calls.is_empty() {
            out.push(AnswerEvent::ToolCalls(calls));
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
        &format!("the provider's answer could not be read: {message}"),
    )
}

/// An OpenAI-style error object (or a bare message) a provider answered with `status`.
fn error_of(status: u16, error: &Value) -> ApiError {
    let message = match error {
        Value::String(s) => s.clone(),
        _ => error
            .get("message")
            .and_then(Value::as_str)
            .unwrap_or("the provider failed without a message")
            .to_string(),
    };
    let code = error.get("code").and_then(|c| {
        c.as_str()
            .map(String::from)
            .or_else(|| c.as_u64().map(|n| n.to_string()))
    });
    let mut e = ApiError::provider_answer(status, code, message);
    e.param = error.get("param").and_then(Value::as_str).map(String::from);
    e
}

/// Most bytes of a provider's error body quoted when it is not JSON.
const QUOTED_ERROR_BYTES: usize = 512;

/// A provider's error answer (a non-2xx status): the error its status stands for, with
/// its message, from an OpenAI `{"error": …}` body, a `{"message": …}` body (Ollama's,
/// vLLM's) or whatever text it sent.
pub fn provider_error(status: u16, body: &[u8]) -> ApiError {
    match serde_json::from_slice::<Value>(body) {
        Ok(v) if v.get("error").is_some() => error_of(status, &v["error"]),
        Ok(v) if v.get("message").is_some() => error_of(status, &v),
        _ => {
            let text = String::from_utf8_lossy(&body[..body.len().min(QUOTED_ERROR_BYTES)]);
            let message = format!("the provider answered {status}: {}", text.trim());
            error_of(status, &Value::String(message))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn feed(chunks: &[Value]) -> Vec<AnswerEvent> {
        let mut s = StreamReader::default();
        let mut out = Vec::new();
        for c in chunks {
            s.data(&c.to_string(), &mut out);
        }
        s.data("[DONE]", &mut out);
        s.end(&mut out);
        out
    }

    fn finished(event: &AnswerEvent) -> &crate::canonical::Finish {
        match event {
            AnswerEvent::Finished(f) => f,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_document_becomes_its_parts_in_order() {
        let body = json!({"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
            "role": "assistant", "content": "let me look", "reasoning_content": "hmm",
            "tool_calls": [{"id": "call_1", "type": "function",
                            "function": {"name": "lookup", "arguments": "{\"q\":\"x\"}"}}]}}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 6,
                      "completion_tokens_details": {"reasoning_tokens": 2},
                      "prompt_tokens_details": {"cached_tokens": 1}}});
        let out = document(&body, Operation::Chat);
        assert_eq!(out[0], AnswerEvent::Reasoning("hmm".into()));
        assert_eq!(out[1], AnswerEvent::Text("let me look".into()));
        assert!(
            matches!(&out[2], AnswerEvent::ToolCalls(c) if c[0].id == "call_1" && c[0].arguments == "{\"q\":\"x\"}")
        );
        let f = finished(&out[3]);
        assert_eq!(f.reason, FinishReason::ToolCalls);
        let u = f.usage.unwrap();
        assert_eq!(
            (
                u.input_tokens,
                u.output_tokens,
                u.reasoning_tokens,
                u.cached_input_tokens
            ),
            (4, 6, Some(2), Some(1))
        );
        assert!(matches!(
            &document(&json!({"choices": []}), Operation::Chat)[..],
            [AnswerEvent::Failed(_)]
        ));
        let out = document(
            &json!({"choices": [{"text": "raw", "finish_reason": "length"}]}),
            Operation::Completion,
        );
        assert_eq!(out[0], AnswerEvent::Text("raw".into()));
        assert_eq!(finished(&out[1]).reason, FinishReason::Length);
    }

    #[test]
    fn embeddings_come_back_in_input_order() {
        let out = document(
            &json!({"data": [{"index": 1, "embedding": [2.0]}, {"index": 0, "embedding": [1.0]}],
                    "usage": {"prompt_tokens": 3}}),
            Operation::Embedding,
        );
        assert_eq!(
            out[0],
            AnswerEvent::Embeddings(vec![json!([1.0]), json!([2.0])])
        );
        assert_eq!(finished(&out[1]).usage.unwrap().input_tokens, 3);
        assert!(matches!(
            &document(&json!({"data": [{"index": 0}]}), Operation::Embedding)[..],
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
        assert_eq!(out[0], AnswerEvent::Text("Hi".into()));
        let AnswerEvent::ToolCalls(calls) = &out[1] else {
            panic!("{out:?}")
        };
        assert_eq!(
            calls
                .iter()
                .map(|c| (c.id.as_str(), c.name.as_str(), c.arguments.as_str()))
                .collect::<Vec<_>>(),
            [("call_a", "f", "{\"x\":1}"), ("call_b", "g", "{\"y\":2}")]
        );
        let f = finished(&out[2]);
        assert_eq!(f.reason, FinishReason::ToolCalls);
        assert_eq!(f.usage.unwrap().output_tokens, 9);
        assert_eq!(out.len(), 3);
    }

    #[test]
    fn reasoning_completions_text_errors_and_cut_streams() {
        let out = feed(&[
            json!({"choices": [{"index": 0, "delta": {"reasoning": "think"}}]}),
            json!({"choices": [{"index": 0, "text": "def", "finish_reason": null}]}),
        ]);
        assert_eq!(out[0], AnswerEvent::Reasoning("think".into()));
        assert_eq!(out[1], AnswerEvent::Text("def".into()));
        // [DONE] without a finish reason still ends normally.
        assert_eq!(finished(&out[2]).reason, FinishReason::Stop);

        let mut s = StreamReader::default();
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
        let mut s = StreamReader::default();
        let mut out = Vec::new();
        s.data(
            r#"{"choices":[{"index":0,"delta":{"content":"a"}}]}"#,
            &mut out,
        );
        s.end(&mut out);
        assert!(matches!(&out[1], AnswerEvent::Failed(e) if e.code() == "broken_stream"));

        let mut s = StreamReader::default();
        let mut out = Vec::new();
        assert!(!s.data("{not json", &mut out));
        assert!(matches!(&out[0], AnswerEvent::Failed(e) if e.status == 502));
    }

    #[test]
    fn too_many_tool_calls_fail_the_answer() {
        let mut s = StreamReader::default();
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
        let mut s = StreamReader::default();
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
        assert_eq!((e.param.as_deref(), e.code()), (Some("tools"), "x"));
        let e = provider_error(500, b"oops");
        assert_eq!(e.status, 500);
        assert!(e.message.contains("oops"), "{}", e.message);
        let e = provider_error(503, br#"{"message":"loading"}"#);
        assert_eq!((e.status.as_u16(), e.message.as_str()), (503, "loading"));
        let e = provider_error(429, br#"{"error":"slow down"}"#);
        assert_eq!((e.status.as_u16(), e.message.as_str()), (429, "slow down"));
    }

    mod split {
        use futures::StreamExt;
        use proptest::prelude::*;

        use super::*;

        /// A provider's chat stream: deltas of text, reasoning and tool-call fragments, a
        /// finish, usage and `[DONE]`, as SSE with LF or CRLF line ends.
        fn stream() -> impl Strategy<Value = String> {
            let piece = prop_oneof![
                "[a-zA-Z ]{0,12}".prop_map(|t| json!({"choices": [{"index": 0, "delta": {"content": t}}]})),
                "[a-z]{1,8}".prop_map(|t| json!({"choices": [{"index": 0, "delta": {"reasoning_content": t}}]})),
                (0u64..3, "[a-z]{0,4}", "[{}:a-z0-9\\\"]{0,10}").prop_map(|(i, name, args)| json!({"choices": [{"index": 0,
                    "delta": {"tool_calls": [{"index": i, "id": format!("call_{i}"), "function": {"name": name, "arguments": args}}]}}]})),
            ];
            (prop::collection::vec(piece, 0..20), any::<bool>(), any::<bool>()).prop_map(
                |(pieces, crlf, usage)| {
                    let end = if crlf { "\r\n" } else { "\n" };
                    let mut out = String::new();
                    let mut event = |data: &str| out.push_str(&format!("data: {data}{end}{end}"));
                    for p in &pieces {
                        event(&p.to_string());
                    }
                    event(&json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}).to_string());
                    if usage {
                        event(&json!({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}).to_string());
                    }
                    event("[DONE]");
                    out
                },
            )
        }

        /// The answer events of `body` delivered in `chunks`.
        fn read(chunks: Vec<Vec<u8>>) -> Vec<AnswerEvent> {
            futures::executor::block_on(async move {
                let body = futures::stream::iter(
                    chunks
                        .into_iter()
                        .map(|c| Ok::<_, std::convert::Infallible>(bytes::Bytes::from(c))),
                );
                let mut events = eventsource_stream::Eventsource::eventsource(body);
                let mut reader = StreamReader::default();
                let mut out = Vec::new();
                while let Some(Ok(event)) = events.next().await {
                    reader.data(&event.data, &mut out);
                }
                reader.end(&mut out);
                out
            })
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(200))]
            /// However the provider's bytes are split into reads, the answer is the same.
            #[test]
            fn a_stream_split_anywhere_reads_the_same(body in stream(), cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..12)) {
                let bytes = body.into_bytes();
                let whole = read(vec![bytes.clone()]);
                prop_assert!(matches!(whole.last(), Some(AnswerEvent::Finished(_))), "{whole:?}");
                let mut points: Vec<usize> = cuts.iter().map(|i| i.index(bytes.len() + 1)).collect();
                points.sort_unstable();
                points.dedup();
                let mut chunks = Vec::new();
                let mut from = 0;
                for p in points {
                    chunks.push(bytes[from..p].to_vec());
                    from = p;
                }
                chunks.push(bytes[from..].to_vec());
                prop_assert_eq!(read(chunks), whole);
            }
        }
    }
}
