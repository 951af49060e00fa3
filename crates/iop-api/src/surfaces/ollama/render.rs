//! The canonical answer in Ollama's shape: one NDJSON line per piece of a streamed
//! `/api/chat` (`message`) or `/api/generate` (`response`) answer, a final `done: true`
//! line with `done_reason`, the token counts and the durations, or the whole answer as
//! one JSON object; an error mid-stream is an `{"error": …}` line, as Ollama sends it.
//!
//! Durations are in nanoseconds, measured by the edge (the provider's own timings are not
//! known on these paths): `load_duration` is the wait for a slot and a member (queueing
//! included), `prompt_eval_duration` from dispatch to the first output, `eval_duration`
//! from the first output to the end, `total_duration` the whole request. Token counts are
//! the provider's; they are left out when it reported none.
//!
//! Pure: the clock readings come in as arguments.

use std::time::{Duration, Instant, SystemTime};

use iop_proto::pb;
use serde_json::{Map, Value, json};

use super::error;
use crate::canonical::{AnswerEvent, FinishReason, ToolCall};

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

pub fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// Ollama's `done_reason`: `length` stays, everything else that ends an answer normally
/// (`stop`, tool calls, a content filter) is `stop`.
fn done_reason(reason: &FinishReason) -> &'static str {
    match reason {
        FinishReason::Length => "length",
        _ => "stop",
    }
}

/// What a whole answer collected.
#[derive(Debug, Default)]
struct Collected {
    content: String,
    thinking: String,
    tool_calls: Vec<ToolCall>,
}

/// Ollama's tool calls: the arguments as an object (text that is not one becomes `{}`).
fn tool_calls_json(calls: &[ToolCall]) -> Value {
    Value::Array(
        calls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let arguments = c.arguments_object().unwrap_or_else(|| {
                    tracing::debug!(
                        arguments = %c.arguments,
                        "tool-call arguments that are not a JSON object: passed as {{}}"
                    );
                    json!({})
                });
                let mut call =
                    json!({"function": {"index": i, "name": c.name, "arguments": arguments}});
                if !c.id.is_empty() {
                    call["id"] = json!(c.id);
                }
                call
            })
            .collect(),
    )
}

/// Writes one answer in Ollama's shape.
#[derive(Debug)]
pub struct OllamaWriter {
    endpoint: Endpoint,
    /// The public model name (the group).
    model: String,
    timing: Timing,
    streaming: bool,
    first_output: Option<Instant>,
    collected: Collected,
    done: Option<Value>,
}

impl OllamaWriter {
    pub fn new(endpoint: Endpoint, model: String, timing: Timing, streaming: bool) -> Self {
        Self {
            endpoint,
            model,
            timing,
            streaming,
            first_output: None,
            collected: Collected::default(),
            done: None,
        }
    }

    /// The whole answer, once it finished.
    pub fn document(&self) -> Option<&Value> {
        self.done.as_ref()
    }

    /// One event at `now` (`wall` for `created_at`): a stream's line goes to `out`.
    pub fn push(&mut self, event: AnswerEvent, now: Instant, wall: SystemTime, out: &mut Vec<u8>) {
        if event.is_output() {
            self.first_output.get_or_insert(now);
        }
        let line = match event {
            AnswerEvent::Started | AnswerEvent::Embeddings(_) => None,
            AnswerEvent::Finished(finish) => {
                let collected = std::mem::take(&mut self.collected);
                let done = self.done_object(&collected, &finish.reason, finish.usage, now, wall);
                if !self.streaming {
                    self.done = Some(done);
                    return;
                }
                Some(done)
            }
            AnswerEvent::Failed(e) => Some(json!({"error": error::message(&e)})),
            piece if !self.streaming => {
                self.collect(piece);
                None
            }
            AnswerEvent::Text(t) => Some(self.piece(&t, None, None, wall)),
            AnswerEvent::Reasoning(t) => Some(self.piece("", Some(&t), None, wall)),
            AnswerEvent::ToolCalls(calls) if self.endpoint == Endpoint::Chat => {
                Some(self.piece("", None, Some(&calls), wall))
            }
            AnswerEvent::ToolCalls(_) => None,
        };
        if let Some(line) = line.filter(|_| self.streaming) {
            ndjson(&line, out);
        }
    }

    fn collect(&mut self, event: AnswerEvent) {
        match event {
            AnswerEvent::Text(t) => self.collected.content.push_str(&t),
            AnswerEvent::Reasoning(t) => self.collected.thinking.push_str(&t),
            AnswerEvent::ToolCalls(calls) => self.collected.tool_calls.extend(calls),
            _ => {}
        }
    }

    fn piece(
        &self,
        text: &str,
        thinking: Option<&str>,
        calls: Option<&[ToolCall]>,
        wall: SystemTime,
    ) -> Value {
        let collected = Collected {
            content: text.to_string(),
            thinking: thinking.unwrap_or_default().to_string(),
            tool_calls: calls.unwrap_or_default().to_vec(),
        };
        let mut out = self.head(&collected, wall);
        out.insert("done".into(), json!(false));
        Value::Object(out)
    }

    /// `model`, `created_at` and the message (chat) or response (generate).
    fn head(&self, collected: &Collected, wall: SystemTime) -> Map<String, Value> {
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
        out
    }

    /// The final object: for a stream with an empty message, for a whole answer with
    /// everything collected.
    fn done_object(
        &mut self,
        collected: &Collected,
        reason: &FinishReason,
        usage: Option<pb::Usage>,
        now: Instant,
        wall: SystemTime,
    ) -> Value {
        let mut out = self.head(collected, wall);
        out.insert("done".into(), json!(true));
        out.insert("done_reason".into(), json!(done_reason(reason)));
        let Timing {
            received,
            dispatched,
        } = self.timing;
        let first = *self.first_output.get_or_insert(now);
        let span = |from: Instant, to: Instant| json!(nanos(to.saturating_duration_since(from)));
        out.insert("total_duration".into(), span(received, now));
        out.insert("load_duration".into(), span(received, dispatched));
        if let Some(u) = &usage {
            out.insert("prompt_eval_count".into(), json!(u.input_tokens));
        }
        out.insert("prompt_eval_duration".into(), span(dispatched, first));
        if let Some(u) = &usage {
            out.insert("eval_count".into(), json!(u.output_tokens));
        }
        out.insert("eval_duration".into(), span(first, now));
        Value::Object(out)
    }
}

/// Appends an NDJSON line: the object and a newline.
pub fn ndjson(value: &Value, out: &mut Vec<u8>) {
    serde_json::to_writer(&mut *out, value).expect("JSON values serialize");
    out.push(b'\n');
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
    use crate::canonical::ApiError;

    fn writer(endpoint: Endpoint, t0: Instant, streaming: bool) -> OllamaWriter {
        OllamaWriter::new(
            endpoint,
            "group".into(),
            Timing {
                received: t0,
                dispatched: t0 + Duration::from_millis(5),
            },
            streaming,
        )
    }

    fn lines(out: &[u8]) -> Vec<Value> {
        std::str::from_utf8(out)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    fn finished(reason: FinishReason, usage: Option<pb::Usage>) -> AnswerEvent {
        AnswerEvent::finished(reason, usage)
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
        let mut w = writer(Endpoint::Chat, t0, true);
        let mut out = Vec::new();
        w.push(AnswerEvent::Started, t0, wall, &mut out);
        assert!(out.is_empty());
        w.push(
            AnswerEvent::Text("Hi".into()),
            t0 + Duration::from_millis(20),
            wall,
            &mut out,
        );
        w.push(AnswerEvent::Reasoning("hmm".into()), t0, wall, &mut out);
        let call = ToolCall {
            id: "c1".into(),
            name: "f".into(),
            arguments: "{\"a\":1}".into(),
        };
        w.push(AnswerEvent::ToolCalls(vec![call]), t0, wall, &mut out);
        let usage = pb::Usage {
            input_tokens: 3,
            output_tokens: 7,
            ..Default::default()
        };
        w.push(
            finished(FinishReason::ToolCalls, Some(usage)),
            t0 + Duration::from_millis(120),
            wall,
            &mut out,
        );
        assert!(out.ends_with(b"\n"));
        let l = lines(&out);
        assert_eq!(
            l[0],
            json!({"model": "group", "created_at": "1970-01-01T00:00:00Z",
                   "message": {"role": "assistant", "content": "Hi"}, "done": false})
        );
        assert_eq!(l[1]["message"]["thinking"], "hmm");
        assert_eq!(l[1]["message"]["content"], "");
        assert_eq!(
            l[2]["message"]["tool_calls"],
            json!([{"id": "c1", "function": {"index": 0, "name": "f", "arguments": {"a": 1}}}])
        );
        let done = &l[3];
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
    fn generate_uses_response_skips_tool_calls_and_collects_a_whole_answer() {
        let t0 = Instant::now();
        let mut w = writer(Endpoint::Generate, t0, true);
        let mut out = Vec::new();
        w.push(
            AnswerEvent::Text("x".into()),
            t0,
            SystemTime::now(),
            &mut out,
        );
        w.push(
            AnswerEvent::ToolCalls(vec![]),
            t0,
            SystemTime::now(),
            &mut out,
        );
        let l = lines(&out);
        assert_eq!(l.len(), 1);
        assert_eq!(l[0]["response"], "x");
        assert!(l[0].get("message").is_none());

        let mut w = writer(Endpoint::Generate, t0, false);
        let mut out = Vec::new();
        for e in [
            AnswerEvent::Text("ab".into()),
            AnswerEvent::Reasoning("t".into()),
            finished(FinishReason::Length, None),
        ] {
            w.push(e, t0, SystemTime::now(), &mut out);
        }
        assert!(out.is_empty());
        let done = w.document().unwrap();
        assert_eq!(
            (
                done["response"].as_str(),
                done["thinking"].as_str(),
                done["done_reason"].as_str()
            ),
            (Some("ab"), Some("t"), Some("length"))
        );
        assert!(
            done.get("eval_count").is_none(),
            "no counts reported: none rendered"
        );
    }

    #[test]
    fn errors_are_error_lines_and_nothing_to_answer_is_a_load() {
        let t0 = Instant::now();
        let mut w = writer(Endpoint::Chat, t0, true);
        let mut out = Vec::new();
        let e = ApiError::upstream("provider_error", "boom");
        w.push(AnswerEvent::Failed(e), t0, SystemTime::now(), &mut out);
        assert_eq!(out, b"{\"error\":\"boom\"}\n");
        let l = loaded(Endpoint::Chat, "g", false, SystemTime::UNIX_EPOCH);
        assert_eq!(l["done_reason"], "load");
        let l = loaded(Endpoint::Generate, "g", true, SystemTime::UNIX_EPOCH);
        assert_eq!(
            (l["done_reason"].as_str(), l["response"].as_str()),
            (Some("unload"), Some(""))
        );
    }
}
