//! Provider-reported token usage: conversion from OpenAI-style `usage` objects (with vLLM's
//! conventions), and the side observer that reads usage out of a tunnelled response
//! without touching its bytes.
//!
//! Only what the provider reports is carried: reasoning and cached-input counts stay
//! `None` unless the provider sent them. Nothing is estimated.

use std::borrow::Cow;
use std::sync::LazyLock;

use iop_proto::pb;
use memchr::memmem;
use serde::Deserialize;
use serde::de::{Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
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

/// An OpenAI-style `usage` object: only the fields read, each tolerated when it is not a
/// count (it then counts as not reported), the rest skipped without being built.
#[derive(Debug, Default, Deserialize)]
struct OpenAiUsage {
    #[serde(default, deserialize_with = "count")]
    prompt_tokens: Option<u64>,
    #[serde(default, deserialize_with = "count")]
    completion_tokens: Option<u64>,
    /// vLLM's older top-level field.
    #[serde(default, deserialize_with = "count")]
    reasoning_tokens: Option<u64>,
    #[serde(default, deserialize_with = "lenient")]
    completion_tokens_details: Option<CompletionDetails>,
    #[serde(default, deserialize_with = "lenient")]
    prompt_tokens_details: Option<PromptDetails>,
}

#[derive(Debug, Deserialize)]
struct CompletionDetails {
    #[serde(default, deserialize_with = "count")]
    reasoning_tokens: Option<u64>,
}

#[derive(Debug, Deserialize)]
struct PromptDetails {
    #[serde(default, deserialize_with = "count")]
    cached_tokens: Option<u64>,
}

impl OpenAiUsage {
    fn into_pb(self, dialect: UsageDialect) -> pb::Usage {
        let mut reasoning = self
            .completion_tokens_details
            .and_then(|d| d.reasoning_tokens);
        if reasoning.is_none() && dialect == UsageDialect::Vllm {
            reasoning = self.reasoning_tokens;
        }
        pb::Usage {
            input_tokens: self.prompt_tokens.unwrap_or(0),
            output_tokens: self.completion_tokens.unwrap_or(0),
            reasoning_tokens: reasoning,
            cached_input_tokens: self.prompt_tokens_details.and_then(|d| d.cached_tokens),
        }
    }
}

/// `Some` for a value of the expected shape, `None` for `null` or anything else (a
/// provider's odd field costs that field, not the whole observation).
fn lenient<'de, D, T>(deserializer: D) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Shape<T> {
        Expected(T),
        Other(IgnoredAny),
    }
    Ok(match Option::<Shape<T>>::deserialize(deserializer)? {
        Some(Shape::Expected(value)) => Some(value),
        _ => None,
    })
}

/// A token count: `Some` for a non-negative integer, `None` for anything else (skipped
/// without being built).
fn count<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<u64>, D::Error> {
    struct Count;
    impl<'de> Visitor<'de> for Count {
        type Value = Option<u64>;

        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a token count")
        }
        fn visit_u64<E>(self, n: u64) -> Result<Option<u64>, E> {
            Ok(Some(n))
        }
        fn visit_i64<E>(self, n: i64) -> Result<Option<u64>, E> {
            Ok(u64::try_from(n).ok())
        }
        fn visit_f64<E>(self, _: f64) -> Result<Option<u64>, E> {
            Ok(None)
        }
        fn visit_bool<E>(self, _: bool) -> Result<Option<u64>, E> {
            Ok(None)
        }
        fn visit_str<E>(self, _: &str) -> Result<Option<u64>, E> {
            Ok(None)
        }
        fn visit_unit<E>(self) -> Result<Option<u64>, E> {
            Ok(None)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Option<u64>, A::Error> {
            IgnoredAny.visit_seq(seq).map(|_| None)
        }
        fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Option<u64>, A::Error> {
            IgnoredAny.visit_map(map).map(|_| None)
        }
    }
    deserializer.deserialize_any(Count)
}

/// Converts an OpenAI-style `usage` object; `None` if it is absent or null.
pub fn from_openai(usage: &Value, dialect: UsageDialect) -> Option<pb::Usage> {
    if !usage.is_object() {
        return None;
    }
    OpenAiUsage::deserialize(usage)
        .ok()
        .map(|u| u.into_pb(dialect))
}

/// What the observer reads of a response document or an SSE event.
#[derive(Deserialize)]
struct Observed<'a> {
    #[serde(borrow, default, deserialize_with = "lenient")]
    model: Option<Cow<'a, str>>,
    #[serde(default, deserialize_with = "lenient")]
    usage: Option<OpenAiUsage>,
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
        let Some(last) = memchr::memrchr(b'\n', chunk) else {
            self.carry(chunk);
            return;
        };
        let (complete, rest) = chunk.split_at(last + 1);
        if self.buffer.is_empty() {
            self.lines(complete);
        } else {
            let mut whole = std::mem::take(&mut self.buffer);
            whole.extend_from_slice(complete);
            self.lines(&whole);
        }
        self.carry(rest);
    }

    /// Keeps an incomplete line for the next chunk.
    fn carry(&mut self, partial: &[u8]) {
        if !partial.is_empty() && self.buffer.len() + partial.len() <= MAX_JSON_BODY {
            self.buffer.extend_from_slice(partial);
        }
    }

    /// Complete lines: every event is parsed until one names the model; after that only
    /// the lines holding a usage object, found by one search over all of them.
    fn lines(&mut self, mut text: &[u8]) {
        while self.model.is_none() {
            let Some(end) = memchr::memchr(b'\n', text) else {
                return;
            };
            self.line(&text[..end]);
            text = &text[end + 1..];
        }
        let mut parsed_to = 0;
        for at in usage_objects(text) {
            if at < parsed_to {
                continue;
            }
            let start = memchr::memrchr(b'\n', &text[..at]).map_or(0, |p| p + 1);
            let end = memchr::memchr(b'\n', &text[at..]).map_or(text.len(), |p| at + p);
            self.line(&text[start..end]);
            parsed_to = end;
        }
    }

    fn line(&mut self, line: &[u8]) {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(data) = line.strip_prefix(b"data:") else {
            return;
        };
        if let Ok(seen) = serde_json::from_slice::<Observed>(data.trim_ascii()) {
            self.observe(seen);
        }
    }

    fn observe(&mut self, seen: Observed) {
        if self.model.is_none() {
            self.model = seen.model.map(Cow::into_owned);
        }
        if let Some(usage) = seen.usage {
            self.usage = Some(usage.into_pb(self.dialect));
        }
    }

    /// The last usage the body reported, once it is complete.
    pub fn finish(&mut self) -> Option<pb::Usage> {
        if !self.sse && !self.overflowed && !self.buffer.is_empty() {
            let body = std::mem::take(&mut self.buffer);
            if let Ok(seen) = serde_json::from_slice::<Observed>(&body) {
                self.observe(seen);
            }
        }
        self.usage.take()
    }

    /// The model the provider said it served, if seen.
    pub fn model(&self) -> Option<&str> {
        self.model.as_deref()
    }
}

/// Where `"usage"` is followed (after optional spaces and a colon) by `{`: the key of a
/// usage object, not `"usage":null`. A `"usage"` inside a JSON string is escaped
/// (`\"usage\"`) and never matches.
fn usage_objects(text: &[u8]) -> impl Iterator<Item = usize> + '_ {
    static KEY: LazyLock<memmem::Finder<'static>> =
        LazyLock::new(|| memmem::Finder::new(b"\"usage\""));
    KEY.find_iter(text).filter(move |&pos| {
        text[pos + KEY.needle().len()..]
            .iter()
            .find(|b| !b.is_ascii_whitespace() && **b != b':')
            == Some(&b'{')
    })
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
    fn odd_fields_cost_only_themselves() {
        let u = from_openai(
            &json!({"prompt_tokens": "many", "completion_tokens": 7,
                    "prompt_tokens_details": "n/a", "completion_tokens_details": {"reasoning_tokens": 2}}),
            UsageDialect::OpenAi,
        )
        .unwrap();
        assert_eq!((u.input_tokens, u.output_tokens), (0, 7));
        assert_eq!((u.reasoning_tokens, u.cached_input_tokens), (Some(2), None));

        let mut o = UsageObserver::new(true, UsageDialect::OpenAi);
        o.feed(b"data: {\"model\":\"m\",\"usage\":5}\n\n");
        assert_eq!(o.model(), Some("m"));
        assert!(o.finish().is_none());
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
    fn a_burst_in_one_chunk_reports_its_last_usage_object() {
        let burst = concat!(
            "data: {\"model\":\"m\",\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":1}}\n\n",
            "data: {\"choices\":[],\"usage\":null}\n\n",
            "data: {\"choices\":[],\"usage\" : {\"prompt_tokens\":1,\"completion_tokens\":4}}\n\n",
            "data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}],\"usage\":null}\n\n",
            "data: [DONE]\n\n"
        );
        let mut o = UsageObserver::new(true, UsageDialect::Vllm);
        o.feed(burst.as_bytes());
        assert_eq!(o.model(), Some("m"));
        assert_eq!(o.finish().map(|u| u.output_tokens), Some(4));
    }

    #[test]
    fn events_arriving_whole_are_skipped_until_one_has_usage() {
        let mut o = UsageObserver::new(true, UsageDialect::OpenAi);
        o.feed(b"data: {\"model\":\"m\",\"choices\":[],\"usage\":null}\n\n");
        o.feed(b"data: {\"model\":\"other\",\"choices\":[],\"usage\":null}\n\n");
        assert_eq!(o.model(), Some("m"));
        o.feed(concat!(
            "data: {\"choices\":[{\"delta\":{\"content\":\"\\\"usage\\\": {\"}}],\"usage\":null}\n\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":2,\"completion_tokens\":5}}\n\n",
            "data: [DO"
        ).as_bytes());
        o.feed(b"NE]\n\n");
        let u = o.finish().unwrap();
        assert_eq!((u.input_tokens, u.output_tokens), (2, 5));
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
