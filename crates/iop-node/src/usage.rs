//! Provider-reported token usage: conversion from OpenAI-style `usage` objects (with vLLM's
//! conventions), and the side observer that reads usage out of a tunnelled response
//! without touching its bytes.
//!
//! Only what the provider reports is carried: reasoning and cached-input counts stay
//! `None` unless the provider sent them. Nothing is estimated.

use iop_proto::pb;
use serde_json::Value;

/// Whose conventions a provider's `usage` follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UsageDialect {
    /// OpenAI: `completion_tokens_details.reasoning_tokens`, `prompt_tokens_details.cached_tokens`.
    OpenAi,
    /// vLLM: as OpenAI, plus a top-level `reasoning_tokens` (older releases) and usage
    /// possibly repeated in several chunks (the last one is complete).
    Vllm,
}

/// Converts an OpenAI-style `usage` object; `None` if it is absent or null.
pub fn from_openai(usage: &Value, dialect: UsageDialect) -> Option<pb::Usage> {
    let obj = usage.as_object()?;
    let count = |v: Option<&Value>| v.and_then(Value::as_u64);
    let mut reasoning = count(
        obj.get("completion_tokens_details")
            .and_then(|d| d.get("reasoning_tokens")),
    );
    if reasoning.is_none() && dialect == UsageDialect::Vllm {
        reasoning = count(obj.get("reasoning_tokens"));
    }
    Some(pb::Usage {
        input_tokens: count(obj.get("prompt_tokens")).unwrap_or(0),
        output_tokens: count(obj.get("completion_tokens")).unwrap_or(0),
        reasoning_tokens: reasoning,
        cached_input_tokens: count(
            obj.get("prompt_tokens_details")
                .and_then(|d| d.get("cached_tokens")),
        ),
    })
}

/// Largest non-streaming body the observer buffers to look for usage.
const MAX_JSON_BODY: usize = 8 * 1024 * 1024;

/// Watches a response body on the side and remembers the last usage it reports.
#[derive(Debug)]
pub struct UsageObserver {
    dialect: UsageDialect,
    sse: bool,
    /// SSE: the incomplete line carried to the next chunk. JSON: the body so far.
    buffer: Vec<u8>,
    overflowed: bool,
    usage: Option<pb::Usage>,
    model: Option<String>,
}

impl UsageObserver {
    pub fn new(sse: bool, dialect: UsageDialect) -> Self {
        Self {
            dialect,
            sse,
            buffer: Vec::new(),
            overflowed: false,
            usage: None,
            model: None,
        }
    }

    pub fn feed(&mut self, chunk: &[u8]) {
        if !self.sse {
            if self.buffer.len() + chunk.len() > MAX_JSON_BODY {
                self.overflowed = true;
                self.buffer = Vec::new();
            } else if !self.overflowed {
                self.buffer.extend_from_slice(chunk);
            }
            return;
        }
        let mut rest = chunk;
        while let Some(pos) = memchr::memchr(b'\n', rest) {
            let (line, tail) = rest.split_at(pos);
            rest = &tail[1..];
            if self.buffer.is_empty() {
                self.line(line);
            } else {
                let mut whole = std::mem::take(&mut self.buffer);
                whole.extend_from_slice(line);
                self.line(&whole);
            }
        }
        if !rest.is_empty() && self.buffer.len() + rest.len() <= MAX_JSON_BODY {
            self.buffer.extend_from_slice(rest);
        }
    }

    fn line(&mut self, line: &[u8]) {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(data) = line.strip_prefix(b"data:") else {
            return;
        };
        // Only chunks with a usage object (not `"usage":null`) or the first model name
        // are parsed.
        if self.model.is_some() && !has_usage_object(data) {
            return;
        }
        if let Ok(value) = serde_json::from_slice::<Value>(data.trim_ascii()) {
            self.observe(&value);
        }
    }

    fn observe(&mut self, value: &Value) {
        if self.model.is_none()
            && let Some(m) = value.get("model").and_then(Value::as_str)
        {
            self.model = Some(m.to_string());
        }
        if let Some(usage) = value
            .get("usage")
            .and_then(|u| from_openai(u, self.dialect))
        {
            self.usage = Some(usage);
        }
    }

    /// The last usage the body reported, once it is complete.
    pub fn finish(&mut self) -> Option<pb::Usage> {
        if !self.sse && !self.overflowed && !self.buffer.is_empty() {
            /// Only the observed fields; the rest of the document is skipped, not built.
            #[derive(serde::Deserialize)]
            struct Observed {
                model: Option<String>,
                usage: Option<Value>,
            }
            let body = std::mem::take(&mut self.buffer);
            if let Ok(seen) = serde_json::from_slice::<Observed>(&body) {
                if self.model.is_none() {
                    self.model = seen.model;
                }
                if let Some(usage) = seen.usage.and_then(|u| from_openai(&u, self.dialect)) {
                    self.usage = Some(usage);
                }
            }
        }
        self.usage.take()
    }

    /// The model the provider said it served, if seen.
    pub fn model(&self) -> Option<&str> {
        self.model.as_deref()
    }
}

/// Whether the bytes hold `"usage"` followed (after optional spaces and a colon) by `{`.
fn has_usage_object(data: &[u8]) -> bool {
    const KEY: &[u8] = b"\"usage\"";
    let mut rest = data;
    while let Some(pos) = memchr::memmem::find(rest, KEY) {
        let after = &rest[pos + KEY.len()..];
        let value = after
            .iter()
            .find(|b| !b.is_ascii_whitespace() && **b != b':');
        if value == Some(&b'{') {
            return true;
        }
        rest = after;
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn plain_usage_has_no_breakdown() {
        let u = from_openai(
            &json!({"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}),
            UsageDialect::OpenAi,
        )
        .unwrap();
        assert_eq!((u.input_tokens, u.output_tokens), (5, 7));
        assert_eq!(u.reasoning_tokens, None);
        assert_eq!(u.cached_input_tokens, None);
    }

    #[test]
    fn reported_details_are_carried() {
        let u = from_openai(
            &json!({"prompt_tokens": 5, "completion_tokens": 7,
                    "completion_tokens_details": {"reasoning_tokens": 3},
                    "prompt_tokens_details": {"cached_tokens": 2}}),
            UsageDialect::OpenAi,
        )
        .unwrap();
        assert_eq!(u.reasoning_tokens, Some(3));
        assert_eq!(u.cached_input_tokens, Some(2));
    }

    #[test]
    fn null_details_are_not_reported() {
        let u = from_openai(
            &json!({"prompt_tokens": 1, "completion_tokens": 1, "prompt_tokens_details": null}),
            UsageDialect::Vllm,
        )
        .unwrap();
        assert_eq!(u.cached_input_tokens, None);
    }

    #[test]
    fn vllm_top_level_reasoning_tokens() {
        let usage = json!({"prompt_tokens": 1, "completion_tokens": 9, "reasoning_tokens": 4});
        assert_eq!(
            from_openai(&usage, UsageDialect::Vllm)
                .unwrap()
                .reasoning_tokens,
            Some(4)
        );
        assert_eq!(
            from_openai(&usage, UsageDialect::OpenAi)
                .unwrap()
                .reasoning_tokens,
            None
        );
    }

    #[test]
    fn null_usage_is_none() {
        assert!(from_openai(&json!(null), UsageDialect::OpenAi).is_none());
    }

    #[test]
    fn sse_usage_split_across_chunks_is_found_and_the_last_wins() {
        let stream = concat!(
            "data: {\"model\":\"m\",\"choices\":[{\"delta\":{\"content\":\"hi\"}}],\"usage\":null}\n\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1}}\n\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2,\"prompt_tokens_details\":{\"cached_tokens\":1}}}\n\n",
            "data: [DONE]\n\n"
        );
        let mut o = UsageObserver::new(true, UsageDialect::Vllm);
        for piece in stream.as_bytes().chunks(7) {
            o.feed(piece);
        }
        assert_eq!(o.model(), Some("m"));
        let u = o.finish().unwrap();
        assert_eq!(
            (u.input_tokens, u.output_tokens, u.cached_input_tokens),
            (3, 2, Some(1))
        );
    }

    #[test]
    fn json_body_usage_is_read_at_the_end() {
        let body =
            br#"{"model":"m","choices":[],"usage":{"prompt_tokens":4,"completion_tokens":6}}"#;
        let mut o = UsageObserver::new(false, UsageDialect::OpenAi);
        for piece in body.chunks(5) {
            o.feed(piece);
        }
        let u = o.finish().unwrap();
        assert_eq!((u.input_tokens, u.output_tokens), (4, 6));
    }
}
