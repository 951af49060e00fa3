//! Provider-reported token usage: conversion from OpenAI-style `usage` objects (with vLLM's
//! conventions; read as the edge reads them, `iop_proto::usage`), from the Responses and Messages APIs' own ([`native`]) and from Ollama's
//! eval counts ([`ollama`]), and the side observer that reads usage out of a tunnelled
//! response without touching its bytes — or, when the edge asked the provider for usage
//! the client did not ask for, removes exactly what that added ([`strip`]).
//!
//! Only what the provider reports is carried: reasoning and cached-input counts stay
//! `None` unless the provider sent them. Nothing is estimated.

mod find;
mod native;
mod ollama;
mod strip;

use std::borrow::Cow;

use bytes::Bytes;
use iop_proto::pb;
use serde::Deserialize;
use serde_json::Value;

use find::{usage_keys, value_start};
use iop_proto::usage::fields::{element_count, lenient, text};
use iop_proto::usage::{OpenAiDialect, OpenAiUsage};

/// Whose conventions a provider's `usage` follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UsageDialect {
    /// OpenAI: `completion_tokens_details.reasoning_tokens`, `prompt_tokens_details.cached_tokens`.
    OpenAi,
    /// vLLM: as OpenAI, plus a top-level `reasoning_tokens` (older releases) and usage
    /// possibly repeated in several chunks (the last one is complete).
    Vllm,
    /// Ollama's native API: `prompt_eval_count` / `eval_count` on the final NDJSON line or
    /// the JSON answer ([`ollama`]).
    Ollama,
}

impl UsageDialect {
    /// How an OpenAI-style `usage` object of this dialect is read.
    pub fn openai(self) -> OpenAiDialect {
        match self {
            UsageDialect::Vllm => OpenAiDialect::Vllm,
            UsageDialect::OpenAi | UsageDialect::Ollama => OpenAiDialect::OpenAi,
        }
    }
}

/// Converts an OpenAI-style `usage` object; `None` if it is absent or null.
pub fn from_openai(usage: &Value, dialect: UsageDialect) -> Option<pb::Usage> {
    iop_proto::usage::from_openai(usage, dialect.openai())
}

/// What the observer reads of a response document or an SSE event.
#[derive(Deserialize)]
struct Observed<'a> {
    #[serde(borrow, default, deserialize_with = "text")]
    model: Option<Cow<'a, str>>,
    #[serde(default, deserialize_with = "lenient")]
    usage: Option<OpenAiUsage>,
    /// How many choices the event has (each skipped, not built).
    #[serde(default, deserialize_with = "element_count")]
    choices: Option<usize>,
}

impl Observed<'_> {
    /// A usage object in an event without choices: the separate usage event of the
    /// OpenAI convention (`"choices": [], "usage": {…}`).
    fn is_usage_event(&self) -> bool {
        self.usage.is_some() && self.choices.unwrap_or(0) == 0
    }
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
    /// Set when the injected usage is removed from what is relayed.
    strip: Option<strip::Stripper>,
    /// Set when the body is another API's answer (see [`native`]), read in its terms.
    native: Option<(native::NativeApi, native::Tally)>,
    /// Set for Ollama's native answers, which are read line by line instead.
    ollama: Option<ollama::OllamaLines>,
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
            strip: None,
            native: None,
            ollama: (dialect == UsageDialect::Ollama).then(ollama::OllamaLines::default),
        }
    }

    /// Reads usage in the shape of the API `path` (the tunnel's, below the provider's API
    /// root) belongs to: the Responses and Messages APIs have their own.
    pub fn for_path(mut self, path: &str) -> Self {
        self.native = native::NativeApi::of_path(path).map(|api| (api, Default::default()));
        self
    }

    /// Also removes what the edge's `stream_options.include_usage` added to an event
    /// stream (see [`strip`]); [`Self::relay`] then returns complete lines only, holding an
    /// incomplete last line back until its end arrives. Only for event streams.
    pub fn removing_injected_usage(mut self) -> Self {
        if self.sse && self.ollama.is_none() {
            self.strip = Some(strip::Stripper::default());
        }
        self
    }

    /// Observes one chunk and returns the bytes to relay for it: the chunk itself, or,
    /// when removing injected usage, its complete lines (after whatever was held back)
    /// without that usage.
    pub fn relay(&mut self, chunk: Bytes) -> Bytes {
        let Some(mut stripper) = self.strip.take() else {
            self.feed(&chunk);
            return chunk;
        };
        let Some(last) = memchr::memrchr(b'\n', &chunk) else {
            if self.buffer.len() + chunk.len() > strip::MAX_HELD_LINE {
                return self.give_up_stripping(&chunk);
            }
            self.buffer.extend_from_slice(&chunk);
            self.strip = Some(stripper);
            return Bytes::new();
        };
        let complete = chunk.slice(..last + 1);
        let held = std::mem::take(&mut self.buffer);
        let whole: Cow<[u8]> = if held.is_empty() {
            Cow::Borrowed(&complete)
        } else {
            let mut whole = held;
            whole.extend_from_slice(&complete);
            Cow::Owned(whole)
        };
        stripper.begin(&whole);
        self.lines(&whole, Some(&mut stripper));
        let kept = stripper.apply(&whole);
        let out = match (kept, whole) {
            (Some(kept), _) => Bytes::from(kept),
            (None, Cow::Owned(whole)) => Bytes::from(whole),
            (None, Cow::Borrowed(_)) => complete.clone(),
        };
        self.buffer.extend_from_slice(&chunk[last + 1..]);
        self.strip = Some(stripper);
        out
    }

    /// The bytes held back (an incomplete last line), to send when the body ends.
    pub fn take_held(&mut self) -> Bytes {
        if self.strip.is_none() {
            return Bytes::new();
        }
        Bytes::from(std::mem::take(&mut self.buffer))
    }

    /// A line longer than the stripper holds: relay everything held and this chunk as
    /// they are, and only observe the rest of the stream (its injected usage reaches the
    /// client).
    fn give_up_stripping(&mut self, chunk: &[u8]) -> Bytes {
        tracing::debug!(
            "an event-stream line longer than {} bytes: the rest of the stream is relayed as it is",
            strip::MAX_HELD_LINE
        );
        let mut out = std::mem::take(&mut self.buffer);
        out.extend_from_slice(chunk);
        Bytes::from(out)
    }

    pub fn feed(&mut self, chunk: &[u8]) {
        if let Some(lines) = self.ollama.as_mut() {
            lines.feed(chunk);
            return;
        }
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
            self.lines(complete, None);
        } else {
            let mut whole = std::mem::take(&mut self.buffer);
            whole.extend_from_slice(complete);
            self.lines(&whole, None);
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
    /// the lines holding a usage object, found by one search over all of them. When
    /// stripping, the same search finds the `"usage": null` members to remove.
    fn lines(&mut self, text: &[u8], mut strip: Option<&mut strip::Stripper>) {
        let mut from = 0;
        while self.model.is_none() {
            let Some(end) = memchr::memchr(b'\n', &text[from..]).map(|e| from + e) else {
                return;
            };
            let usage_event = self.line(&text[from..end]);
            if let Some(strip) = strip.as_deref_mut() {
                strip.line(text, from, end, usage_event);
            }
            from = end + 1;
        }
        let mut parsed_to = from;
        for at in usage_keys(&text[from..]).map(|at| at + from) {
            if at < parsed_to {
                continue;
            }
            let value = value_start(text, at);
            match text.get(value) {
                Some(b'{') => {
                    let start = memchr::memrchr(b'\n', &text[..at]).map_or(0, |p| p + 1);
                    let end = memchr::memchr(b'\n', &text[at..]).map_or(text.len(), |p| at + p);
                    let usage_event = self.line(&text[start..end]);
                    if let Some(strip) = strip.as_deref_mut() {
                        strip.line(text, start, end, usage_event);
                    }
                    parsed_to = end;
                }
                Some(b'n') => {
                    if let Some(strip) = strip.as_deref_mut() {
                        strip.null_member(text, at, value);
                    }
                }
                _ => {}
            }
        }
    }

    /// Observes one line; whether it is a separate usage event.
    fn line(&mut self, line: &[u8]) -> bool {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(data) = line.strip_prefix(b"data:") else {
            return false;
        };
        if let Some((_, tally)) = &mut self.native {
            tally.observe(data.trim_ascii());
            if self.model.is_none() {
                self.model = tally.model.clone();
            }
            return false;
        }
        match serde_json::from_slice::<Observed>(data.trim_ascii()) {
            Ok(seen) => {
                let usage_event = seen.is_usage_event();
                self.observe(seen);
                usage_event
            }
            Err(_) => false,
        }
    }

    fn observe(&mut self, seen: Observed) {
        if self.model.is_none() {
            self.model = seen.model.map(Cow::into_owned);
        }
        if let Some(usage) = seen.usage {
            self.usage = Some(usage.into_usage(self.dialect.openai()));
        }
    }

    /// The last usage the body reported, once it is complete.
    pub fn finish(&mut self) -> Option<pb::Usage> {
        if let Some(lines) = self.ollama.as_mut() {
            return lines.finish();
        }
        if let Some((api, tally)) = &mut self.native {
            if !self.sse && !self.overflowed && !self.buffer.is_empty() {
                tally.observe(&std::mem::take(&mut self.buffer));
                if self.model.is_none() {
                    self.model = tally.model.clone();
                }
            }
            return std::mem::take(&mut tally.counts).to_pb(*api);
        }
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
        match &self.ollama {
            Some(lines) => lines.model(),
            None => self.model.as_deref(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn odd_model_and_choices_values_cost_only_themselves() {
        let seen: Observed = serde_json::from_str(
            r#"{"model":5,"choices":{"a":[1]},"usage":{"prompt_tokens":2,"completion_tokens":1}}"#,
        )
        .unwrap();
        assert!(seen.is_usage_event());
        assert_eq!((seen.model, seen.choices), (None, None));
        let seen: Observed = serde_json::from_str(
            r#"{"model":"m\u0021","choices":[{"x":[1,{"y":2}]},{}],"usage":null}"#,
        )
        .unwrap();
        assert_eq!(seen.model.as_deref(), Some("m!"));
        assert_eq!(seen.choices, Some(2));
        assert!(!seen.is_usage_event());
    }

    #[test]
    fn an_odd_usage_field_costs_only_itself() {
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
    fn native_api_answers_are_read_in_their_own_shape() {
        let stream = concat!(
            "event: message_start\n",
            "data: {\"type\":\"message_start\",\"message\":{\"model\":\"m\",\"usage\":{\"input_tokens\":4,\"output_tokens\":1}}}\n\n",
            "event: message_delta\n",
            "data: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":9}}\n\n",
        );
        let mut o = UsageObserver::new(true, UsageDialect::OpenAi).for_path("/messages");
        for piece in stream.as_bytes().chunks(9) {
            o.feed(piece);
        }
        assert_eq!(o.model(), Some("m"));
        let u = o.finish().unwrap();
        assert_eq!((u.input_tokens, u.output_tokens), (4, 9));

        let body = br#"{"model":"m","output":[],"usage":{"input_tokens":2,"output_tokens":3,"total_tokens":5}}"#;
        let mut o = UsageObserver::new(false, UsageDialect::OpenAi).for_path("/responses");
        o.feed(body);
        let u = o.finish().unwrap();
        assert_eq!((u.input_tokens, u.output_tokens), (2, 3));
        assert_eq!(o.model(), Some("m"));
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
