//! Answers in Ollama's shape: one NDJSON line per piece of a streamed `/api/chat`
//! (`message`) or `/api/generate` (`response`) answer, a final `done: true` line with
//! `done_reason`, the token counts and the durations, or the whole answer as one JSON
//! object; an error mid-stream is an `{"error": …}` line, as Ollama sends it.
//!
//! Durations are in nanoseconds, measured by the edge (the provider's own timings are not
//! known on these paths): `load_duration` is the wait for a slot and a member (queueing
//! included), `prompt_eval_duration` from dispatch to the first output, `eval_duration`
//! from the first output to the end, `total_duration` the whole request. Token counts are
//! the provider's; they are left out when it reported none.
//!
//! Pure: the clock readings come in as arguments.

use std::time::{Duration, Instant, SystemTime};

use serde_json::{Map, Value, json};

use super::answer::{Counts, Event, ToolCall};

/// Which endpoint's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Generate,
}

/// When the request arrived and when it was dispatched.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    pub received: Instant,
    pub dispatched: Instant,
}

/// Ollama's `created_at`: RFC 3339 in UTC with the fraction of a second.
pub fn timestamp(at: SystemTime) -> String {
    time::OffsetDateTime::from(at)
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_else(|_| "1970-01-01T00:00:00Z".into())
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// Renders one answer's events.
#[derive(Debug)]
pub struct Renderer {
    endpoint: Endpoint,
    /// The public model name (the group).
    model: String,
    timing: Timing,
    first_output: Option<Instant>,
}

/// What a non-streamed answer collected.
#[derive(Debug, Default)]
pub struct Collected {
    pub content: String,
    pub thinking: String,
    pub tool_calls: Vec<ToolCall>,
}

impl Collected {
    /// Bytes of text collected (content and thinking).
    pub fn text_bytes(&self) -> usize {
        self.content.len() + self.thinking.len()
    }

    /// Adds a piece; ignores endings.
    pub fn add(&mut self, event: Event) {
        match event {
            Event::Text(t) => self.content.push_str(&t),
            Event::Thinking(t) => self.thinking.push_str(&t),
            Event::ToolCalls(calls) => self.tool_calls.extend(calls),
            Event::Done { .. } | Event::Failed(_) => {}
        }
    }
}

fn tool_calls_json(calls: &[ToolCall]) -> Value {
    Value::Array(
        calls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let mut call =
                    json!({"function": {"index": i, "name": c.name, "arguments": c.arguments}});
                if !c.id.is_empty() {
                    call["id"] = json!(c.id);
                }
                call
            })
            .collect(),
    )
}

impl Renderer {
    pub fn new(endpoint: Endpoint, model: String, timing: Timing) -> Self {
        Self {
            endpoint,
            model,
            timing,
            first_output: None,
        }
    }

    /// The object for one event at `now` (`wall` for `created_at`); `None` for an event
    /// that renders to nothing (tool calls on `/api/generate`).
    pub fn line(&mut self, event: &Event, now: Instant, wall: SystemTime) -> Option<Value> {
        if matches!(
            event,
            Event::Text(_) | Event::Thinking(_) | Event::ToolCalls(_)
        ) {
            self.first_output.get_or_insert(now);
        }
        match event {
            Event::Text(t) => Some(self.piece(t, None, None, wall)),
            Event::Thinking(t) => Some(self.piece("", Some(t), None, wall)),
            Event::ToolCalls(calls) if self.endpoint == Endpoint::Chat => {
                Some(self.piece("", None, Some(calls), wall))
            }
            Event::ToolCalls(_) => None,
            Event::Done { reason, counts } => {
                Some(self.done(&Collected::default(), reason, *counts, now, wall))
            }
            Event::Failed(e) => Some(json!({"error": e.message})),
        }
    }

    fn piece(
        &self,
        text: &str,
        thinking: Option<&str>,
        calls: Option<&[ToolCall]>,
        wall: SystemTime,
    ) -> Value {
        let mut out = Map::new();
        out.insert("model".into(), json!(self.model));
        out.insert("created_at".into(), json!(timestamp(wall)));
        match self.endpoint {
            Endpoint::Chat => {
                let mut message = json!({"role": "assistant", "content": text});
                if let Some(t) = thinking {
                    message["thinking"] = json!(t);
                }
                if let Some(calls) = calls {
                    message["tool_calls"] = tool_calls_json(calls);
                }
                out.insert("message".into(), message);
            }
            Endpoint::Generate => {
                out.insert("response".into(), json!(text));
                if let Some(t) = thinking {
                    out.insert("thinking".into(), json!(t));
                }
            }
        }
        out.insert("done".into(), json!(false));
        Value::Object(out)
    }

    /// The final object: for a stream, with an empty message; for a whole answer, with
    /// everything `collected`.
    pub fn done(
        &mut self,
        collected: &Collected,
        reason: &str,
        counts: Option<Counts>,
        now: Instant,
        wall: SystemTime,
    ) -> Value {
        let mut out = Map::new();
        out.insert("model".into(), json!(self.model));
        out.insert("created_at".into(), json!(timestamp(wall)));
        match self.endpoint {
            Endpoint::Chat => {
                let mut message = json!({"role": "assistant", "content": collected.content});
                if !collected.thinking.is_empty() {
                    message["thinking"] = json!(collected.thinking);
                }
                if !collected.tool_calls.is_empty() {
                    message["tool_calls"] = tool_calls_json(&collected.tool_calls);
                }
                out.insert("message".into(), message);
            }
            Endpoint::Generate => {
                out.insert("response".into(), json!(collected.content));
                if !collected.thinking.is_empty() {
                    out.insert("thinking".into(), json!(collected.thinking));
                }
            }
        }
        out.insert("done".into(), json!(true));
        out.insert("done_reason".into(), json!(reason));
        let Timing {
            received,
            dispatched,
        } = self.timing;
        let first = *self.first_output.get_or_insert(now);
        let span = |from: Instant, to: Instant| json!(nanos(to.saturating_duration_since(from)));
        out.insert("total_duration".into(), span(received, now));
        out.insert("load_duration".into(), span(received, dispatched));
        if let Some(c) = counts {
            out.insert("prompt_eval_count".into(), json!(c.input));
        }
        out.insert("prompt_eval_duration".into(), span(dispatched, first));
        if let Some(c) = counts {
            out.insert("eval_count".into(), json!(c.output));
        }
        out.insert("eval_duration".into(), span(first, now));
        Value::Object(out)
    }
}

/// An NDJSON line: the object and a newline.
pub fn ndjson(value: &Value) -> bytes::Bytes {
    let mut out = serde_json::to_vec(value).expect("JSON values serialize");
    out.push(b'\n');
    out.into()
}

/// A request with nothing to answer (no messages, no prompt): Ollama answers that it
/// loaded the model, or with `keep_alive: 0` that it unloaded it (`unload`).
pub fn loaded(endpoint: Endpoint, model: &str, unload: bool, wall: SystemTime) -> Value {
    let mut out = json!({"model": model, "created_at": timestamp(wall)});
    match endpoint {
        Endpoint::Chat => out["message"] = json!({"role": "assistant", "content": ""}),
        Endpoint::Generate => out["response"] = json!(""),
    }
    out["done_reason"] = json!(if unload { "unload" } else { "load" });
    out["done"] = json!(true);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::error::ApiError;

    fn renderer(endpoint: Endpoint, t0: Instant) -> Renderer {
        Renderer::new(
            endpoint,
            "group".into(),
            Timing {
                received: t0,
                dispatched: t0 + Duration::from_millis(5),
            },
        )
    }

    #[test]
    fn timestamps_are_rfc3339_utc() {
        let at = SystemTime::UNIX_EPOCH + Duration::new(1_722_000_000, 123_456_000);
        assert_eq!(timestamp(at), "2024-07-26T13:20:00.123456Z");
        assert_eq!(
            timestamp(SystemTime::UNIX_EPOCH + Duration::from_secs(1)),
            "1970-01-01T00:00:01Z"
        );
    }

    #[test]
    fn chat_pieces_and_the_done_line() {
        let t0 = Instant::now();
        let wall = SystemTime::UNIX_EPOCH;
        let mut r = renderer(Endpoint::Chat, t0);
        let first = r
            .line(
                &Event::Text("Hi".into()),
                t0 + Duration::from_millis(20),
                wall,
            )
            .unwrap();
        assert_eq!(
            first,
            json!({"model": "group", "created_at": "1970-01-01T00:00:00Z",
                   "message": {"role": "assistant", "content": "Hi"}, "done": false})
        );
        let thinking = r.line(&Event::Thinking("hmm".into()), t0, wall).unwrap();
        assert_eq!(thinking["message"]["thinking"], "hmm");
        assert_eq!(thinking["message"]["content"], "");
        let calls = r
            .line(
                &Event::ToolCalls(vec![ToolCall {
                    id: "c1".into(),
                    name: "f".into(),
                    arguments: json!({"a": 1}),
                }]),
                t0,
                wall,
            )
            .unwrap();
        assert_eq!(
            calls["message"]["tool_calls"],
            json!([{"id": "c1", "function": {"index": 0, "name": "f", "arguments": {"a": 1}}}])
        );
        let done = r
            .line(
                &Event::Done {
                    reason: "stop".into(),
                    counts: Some(Counts {
                        input: 3,
                        output: 7,
                    }),
                },
                t0 + Duration::from_millis(120),
                wall,
            )
            .unwrap();
        assert_eq!(done["done"], true);
        assert_eq!(done["done_reason"], "stop");
        assert_eq!(done["message"], json!({"role": "assistant", "content": ""}));
        assert_eq!(done["prompt_eval_count"], 3);
        assert_eq!(done["eval_count"], 7);
        assert_eq!(done["total_duration"], 120_000_000);
        assert_eq!(done["load_duration"], 5_000_000);
        assert_eq!(done["prompt_eval_duration"], 15_000_000);
        assert_eq!(done["eval_duration"], 100_000_000);
    }

    #[test]
    fn generate_uses_response_and_skips_tool_calls() {
        let t0 = Instant::now();
        let mut r = renderer(Endpoint::Generate, t0);
        let line = r
            .line(&Event::Text("x".into()), t0, SystemTime::now())
            .unwrap();
        assert_eq!(line["response"], "x");
        assert!(line.get("message").is_none());
        assert!(
            r.line(&Event::ToolCalls(vec![]), t0, SystemTime::now())
                .is_none()
        );
        let mut all = Collected::default();
        all.add(Event::Text("ab".into()));
        all.add(Event::Thinking("t".into()));
        let done = r.done(&all, "length", None, t0, SystemTime::now());
        assert_eq!(
            (done["response"].as_str(), done["thinking"].as_str()),
            (Some("ab"), Some("t"))
        );
        assert!(
            done.get("eval_count").is_none(),
            "no counts reported: none rendered"
        );
    }

    #[test]
    fn errors_are_error_lines_and_lines_end_with_a_newline() {
        let t0 = Instant::now();
        let mut r = renderer(Endpoint::Chat, t0);
        let e = r
            .line(
                &Event::Failed(ApiError::upstream("provider_error", "boom")),
                t0,
                SystemTime::now(),
            )
            .unwrap();
        assert_eq!(e, json!({"error": "boom"}));
        assert_eq!(&ndjson(&e)[..], b"{\"error\":\"boom\"}\n");
        let l = loaded(Endpoint::Chat, "g", false, SystemTime::UNIX_EPOCH);
        assert_eq!(l["done_reason"], "load");
        let l = loaded(Endpoint::Generate, "g", true, SystemTime::UNIX_EPOCH);
        assert_eq!(
            (l["done_reason"].as_str(), l["response"].as_str()),
            (Some("unload"), Some(""))
        );
    }
}
