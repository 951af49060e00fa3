//! Usage in the shapes of the APIs some providers serve besides OpenAI chat: the OpenAI
//! Responses API (`usage` of the response object: `input_tokens`, `output_tokens` and
//! their details, at the top of a JSON answer or inside `response.completed`) and the
//! Anthropic Messages API (`usage` of the message: `input_tokens` and the cache counts in
//! `message_start`, running `output_tokens` totals in `message_delta`).
//!
//! Counts are merged as they come (a later count replaces an earlier one of the same
//! field), then converted to the wire's terms: Anthropic's `input_tokens` leave out cached
//! prompt tokens, so the wire's input is their sum with the cache counts.

use std::borrow::Cow;

use iop_proto::pb;
use serde::Deserialize;

use iop_proto::usage::fields::{count, lenient};

/// An API whose usage has its own shape, by the tunnel path that reaches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NativeApi {
    Responses,
    Messages,
}

impl NativeApi {
    /// The API a tunnel path (below the provider's API root) belongs to, if not chat's.
    pub fn of_path(path: &str) -> Option<Self> {
        let path = path.split('?').next().unwrap_or(path).trim_end_matches('/');
        match path {
            "/responses" => Some(NativeApi::Responses),
            "/messages" => Some(NativeApi::Messages),
            _ => None,
        }
    }
}

/// What is read of a document or an event: its own `model` and `usage`, or those of the
/// `response` (Responses stream) or `message` (Messages `message_start`) it carries.
#[derive(Deserialize)]
pub(super) struct Observed<'a> {
    #[serde(borrow, default, deserialize_with = "lenient")]
    model: Option<Cow<'a, str>>,
    #[serde(default, deserialize_with = "lenient")]
    usage: Option<Counts>,
    #[serde(borrow, default, deserialize_with = "lenient")]
    response: Option<Inner<'a>>,
    #[serde(borrow, default, deserialize_with = "lenient")]
    message: Option<Inner<'a>>,
}

#[derive(Deserialize)]
struct Inner<'a> {
    #[serde(borrow, default, deserialize_with = "lenient")]
    model: Option<Cow<'a, str>>,
    #[serde(default, deserialize_with = "lenient")]
    usage: Option<Counts>,
}

/// The counts both APIs use, each `None` until reported.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Deserialize)]
pub struct Counts {
    #[serde(default, deserialize_with = "count")]
    input_tokens: Option<u64>,
    #[serde(default, deserialize_with = "count")]
    output_tokens: Option<u64>,
    #[serde(default, deserialize_with = "lenient")]
    input_tokens_details: Option<InputDetails>,
    #[serde(default, deserialize_with = "lenient")]
    output_tokens_details: Option<OutputDetails>,
    #[serde(default, deserialize_with = "count")]
    cache_read_input_tokens: Option<u64>,
    #[serde(default, deserialize_with = "count")]
    cache_creation_input_tokens: Option<u64>,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Deserialize)]
struct InputDetails {
    #[serde(default, deserialize_with = "count")]
    cached_tokens: Option<u64>,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Deserialize)]
struct OutputDetails {
    #[serde(default, deserialize_with = "count")]
    reasoning_tokens: Option<u64>,
}

impl Counts {
    /// Takes the counts `later` reports over these.
    fn merge(&mut self, later: Counts) {
        fn over<T>(a: &mut Option<T>, b: Option<T>) {
            if b.is_some() {
                *a = b;
            }
        }
        over(&mut self.input_tokens, later.input_tokens);
        over(&mut self.output_tokens, later.output_tokens);
        over(
            &mut self.cache_read_input_tokens,
            later.cache_read_input_tokens,
        );
        over(
            &mut self.cache_creation_input_tokens,
            later.cache_creation_input_tokens,
        );
        if let Some(d) = later
            .input_tokens_details
            .filter(|d| d.cached_tokens.is_some())
        {
            self.input_tokens_details = Some(d);
        }
        if let Some(d) = later
            .output_tokens_details
            .filter(|d| d.reasoning_tokens.is_some())
        {
            self.output_tokens_details = Some(d);
        }
    }

    /// The wire's usage, once anything was reported.
    pub fn to_pb(self, api: NativeApi) -> Option<pb::Usage> {
        if self.input_tokens.is_none() && self.output_tokens.is_none() {
            return None;
        }
        let input = self.input_tokens.unwrap_or(0);
        let output = self.output_tokens.unwrap_or(0);
        Some(match api {
            NativeApi::Responses => pb::Usage {
                input_tokens: input,
                output_tokens: output,
                reasoning_tokens: self.output_tokens_details.and_then(|d| d.reasoning_tokens),
                cached_input_tokens: self.input_tokens_details.and_then(|d| d.cached_tokens),
            },
            NativeApi::Messages => {
                let read = self.cache_read_input_tokens;
                pb::Usage {
                    input_tokens: input
                        .saturating_add(read.unwrap_or(0))
                        .saturating_add(self.cache_creation_input_tokens.unwrap_or(0)),
                    output_tokens: output,
                    reasoning_tokens: None,
                    cached_input_tokens: read,
                }
            }
        })
    }
}

/// The usage and model seen so far.
#[derive(Debug, Default)]
pub struct Tally {
    pub counts: Counts,
    pub model: Option<String>,
}

impl Tally {
    /// Reads one JSON document or event.
    pub fn observe(&mut self, json: &[u8]) {
        let Ok(seen) = serde_json::from_slice::<Observed>(json) else {
            return;
        };
        let inner = seen.response.or(seen.message);
        let (inner_model, inner_usage) = match inner {
            Some(i) => (i.model, i.usage),
            None => (None, None),
        };
        if self.model.is_none() {
            self.model = seen.model.or(inner_model).map(Cow::into_owned);
        }
        for usage in [inner_usage, seen.usage].into_iter().flatten() {
            self.counts.merge(usage);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tally(events: &[&str]) -> Tally {
        let mut t = Tally::default();
        for e in events {
            t.observe(e.as_bytes());
        }
        t
    }

    #[test]
    fn paths_name_their_api() {
        assert_eq!(NativeApi::of_path("/responses"), Some(NativeApi::Responses));
        assert_eq!(
            NativeApi::of_path("/messages?beta=true"),
            Some(NativeApi::Messages)
        );
        assert_eq!(NativeApi::of_path("/chat/completions"), None);
    }

    #[test]
    fn a_responses_answer_and_stream() {
        let t = tally(&[
            r#"{"id":"resp_1","object":"response","model":"m","output":[],"usage":{"input_tokens":9,"input_tokens_details":{"cached_tokens":4},"output_tokens":5,"output_tokens_details":{"reasoning_tokens":2},"total_tokens":14}}"#,
        ]);
        let u = t.counts.to_pb(NativeApi::Responses).unwrap();
        assert_eq!(
            (
                u.input_tokens,
                u.output_tokens,
                u.reasoning_tokens,
                u.cached_input_tokens
            ),
            (9, 5, Some(2), Some(4))
        );
        assert_eq!(t.model.as_deref(), Some("m"));
        let t = tally(&[
            r#"{"type":"response.created","response":{"model":"m2","usage":null}}"#,
            r#"{"type":"response.output_text.delta","delta":"\"usage\":{\"input_tokens\":99}"}"#,
            r#"{"type":"response.completed","response":{"model":"m2","usage":{"input_tokens":3,"output_tokens":7}}}"#,
        ]);
        let u = t.counts.to_pb(NativeApi::Responses).unwrap();
        assert_eq!((u.input_tokens, u.output_tokens), (3, 7));
        assert_eq!(t.model.as_deref(), Some("m2"));
    }

    #[test]
    fn a_messages_stream_merges_start_and_delta_counts() {
        let t = tally(&[
            r#"{"type":"message_start","message":{"model":"claude","usage":{"input_tokens":10,"cache_read_input_tokens":6,"output_tokens":1}}}"#,
            r#"{"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":15}}"#,
        ]);
        let u = t.counts.to_pb(NativeApi::Messages).unwrap();
        assert_eq!(
            (u.input_tokens, u.output_tokens, u.cached_input_tokens),
            (16, 15, Some(6))
        );
        assert_eq!(t.model.as_deref(), Some("claude"));
        assert!(
            tally(&[r#"{"type":"ping"}"#])
                .counts
                .to_pb(NativeApi::Messages)
                .is_none()
        );
    }
}
