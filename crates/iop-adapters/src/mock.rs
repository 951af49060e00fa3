//! The mock adapter: deterministic, in-process, no backend. Emits a configurable number of
//! word tokens with an optional per-token delay, optional reasoning deltas, and usage.
//! For tests, benchmarks and `iop demo`; never the only path that works.
//!
//! It misbehaves on purpose by target name, for fault tests:
//! - a target containing `mock-error` fails with an error terminal halfway;
//! - `mock-no-terminal` returns after its tokens without a terminal (the run manager must
//!   synthesize one);
//! - `mock-hang` starts and then waits until cancelled;
//! - `mock-panic` panics once started (the run manager must end the run with an error).
//!
//! A configured `text` without words answers with the default text.
//!
//! It honours `max_tokens` and `stop` (the answer ends before the first stop sequence,
//! finish reason `stop`), and refuses with `bad_request` what it cannot do: a
//! `response_format` other than `text`, and `n` above 1.
//!
//! Offered `tools`, it plays an agent's model, deterministically, so an agent can run a
//! whole turn against it (`iop_mock_model::agent_turn`): one tool call per turn — the tool the
//! prompt names, else the first offered — with arguments that fit its schema (each
//! required property: a string `"mock"`, a number `1`, `true`, `[]`, an object built the
//! same way, or an enum's first value), finish reason `tool_calls`; once the turn holds a
//! tool result it answers with its text.

use iop_proto::ErrorCode;
use std::time::Duration;

use async_trait::async_trait;
use iop_proto::pb;
use serde_json::{Value, json};

use super::adapter::{Adapter, RunInput};
use super::error::AdapterError;
use crate::sink::RunSink;

pub const DEFAULT_TOKENS: u32 = 16;
const DEFAULT_TEXT: &str =
    "The quick brown fox jumps over the lazy dog while iop relays every token.";
const REASONING_DELTAS: u64 = 3;

#[derive(Debug)]
pub struct MockAdapter {
    spec: pb::MockSpec,
}

impl MockAdapter {
    pub fn new(spec: pb::MockSpec) -> Self {
        Self { spec }
    }
}

/// Refuses what the mock cannot honour, naming the parameter.
fn refuse_unsupported(options: &pb::GenerationOptions) -> Result<(), AdapterError> {
    let refuse =
        |message: String| Err(AdapterError::new(iop_proto::ErrorCode::BadRequest, message));
    if let Some(n) = options.n.filter(|n| *n > 1) {
        return refuse(format!(
            "`n` is {n}, but the mock adapter answers with one choice: send n = 1 (or leave it out)"
        ));
    }
    if !options.response_format_json.is_empty() {
        let format: serde_json::Value =
            serde_json::from_str(&options.response_format_json).unwrap_or_default();
        if format.get("type").and_then(serde_json::Value::as_str) != Some("text") {
            return refuse(format!(
                "`response_format`: the mock adapter answers plain text only and cannot honour {}",
                options.response_format_json
            ));
        }
    }
    Ok(())
}

/// The tool call the mock makes for `input` (one per turn, see `iop_mock_model::agent_turn`), or
/// `None` when it answers in text.
fn tool_call(input: &RunInput) -> Option<pb::ToolCall> {
    let tools: Value = serde_json::from_str(&input.options.tools_json).ok()?;
    let messages: Vec<Value> = input
        .chat_messages()
        .iter()
        .map(|m| {
            let calls = (!m.tool_calls.is_empty()).then(|| json!([{}]));
            json!({"role": m.role, "content": m.content, "tool_calls": calls})
        })
        .collect();
    let conversation = json!({"tools": tools, "messages": messages});
    let function = iop_mock_model::agent_turn::json_tool_call(&conversation)?;
    let name = function.get("name")?.as_str()?.to_string();
    let arguments = function
        .get("parameters")
        .map_or_else(|| json!({}), iop_mock_model::schema::fitting_value);
    let id: String = input
        .run_id
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .take(12)
        .collect();
    Some(pb::ToolCall {
        id: format!("call_{id}"),
        name,
        arguments: arguments.to_string(),
    })
}

/// Ends an answer generated token by token before the first stop sequence, holding back
/// text that may be the beginning of one (nothing is held without stop sequences).
#[derive(Debug)]
struct StopScanner<'a> {
    stops: Vec<&'a str>,
    held: String,
}

impl<'a> StopScanner<'a> {
    fn new(stops: &'a [String]) -> Self {
        Self {
            stops: stops
                .iter()
                .map(String::as_str)
                .filter(|s| !s.is_empty())
                .collect(),
            held: String::new(),
        }
    }

    /// Takes the next token: the text to send now, and whether a stop sequence ended the
    /// answer (nothing after it is sent).
    fn push(&mut self, token: &str) -> (String, bool) {
        if self.stops.is_empty() {
            return (token.to_string(), false);
        }
        self.held.push_str(token);
        if let Some(at) = self.stops.iter().filter_map(|s| self.held.find(s)).min() {
            self.held.truncate(at);
            return (std::mem::take(&mut self.held), true);
        }
        let keep = self
            .stops
            .iter()
            .map(|s| prefix_at_end(&self.held, s))
            .max()
            .unwrap_or(0);
        let rest = self.held.split_off(self.held.len() - keep);
        (std::mem::replace(&mut self.held, rest), false)
    }

    /// The text still held when the answer ends without a stop sequence.
    fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

/// The length of the longest proper prefix of `stop` that `text` ends with.
fn prefix_at_end(text: &str, stop: &str) -> usize {
    (1..stop.len())
        .rev()
        .find(|&n| stop.is_char_boundary(n) && text.ends_with(&stop[..n]))
        .unwrap_or(0)
}

#[async_trait]
impl Adapter for MockAdapter {
    async fn execute(&self, input: RunInput, sink: &mut RunSink) -> Result<(), AdapterError> {
        refuse_unsupported(&input.options)?;
        let configured = if self.spec.tokens == 0 {
            DEFAULT_TOKENS
        } else {
            self.spec.tokens
        };
        let (tokens, mut finish) = match input.options.max_tokens {
            Some(max) if max < configured => (max, "length"),
            _ => (configured, "stop"),
        };
        let delay = Duration::from_millis(self.spec.token_delay_ms as u64);
        let text = if self.spec.text.is_empty() {
            DEFAULT_TEXT
        } else {
            &self.spec.text
        };
        let mut words: Vec<&str> = text.split_whitespace().collect();
        if words.is_empty() {
            words = DEFAULT_TEXT.split_whitespace().collect();
        }
        sink.start(&input.target).await?;
        if input.target.contains("mock-hang") {
            std::future::pending::<()>().await;
        }
        if input.target.contains("mock-panic") {
            panic!("mock-panic asked for (target {})", input.target);
        }
        if self.spec.reasoning {
            for i in 0..REASONING_DELTAS {
                sink.reasoning(&format!("thinking-{i} ")).await?;
            }
        }
        if let Some(call) = tool_call(&input) {
            let output_tokens = call.arguments.len().div_ceil(4) as u64;
            sink.tool_calls(vec![call]).await?;
            let usage = pb::Usage {
                input_tokens: prompt_words(&input),
                output_tokens,
                reasoning_tokens: None,
                cached_input_tokens: None,
            };
            sink.complete(Some(usage), "tool_calls").await?;
            return Ok(());
        }
        let mut stop = StopScanner::new(&input.options.stop);
        let mut generated = 0u64;
        for i in 0..tokens {
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            if input.target.contains("mock-error") && i == tokens / 2 {
                return Err(AdapterError::new(
                    ErrorCode::ProviderError,
                    format!("mock failure after {i} tokens (target {})", input.target),
                ));
            }
            let word = words[i as usize % words.len()];
            let token = if i + 1 == tokens {
                word.to_string()
            } else {
                format!("{word} ")
            };
            generated += 1;
            let (text, stopped) = stop.push(&token);
            sink.delta(&text).await?;
            if stopped {
                finish = "stop";
                break;
            }
        }
        sink.delta(&stop.finish()).await?;
        if input.target.contains("mock-no-terminal") {
            return Ok(());
        }
        let usage = pb::Usage {
            input_tokens: prompt_words(&input),
            output_tokens: generated
                + if self.spec.reasoning {
                    REASONING_DELTAS
                } else {
                    0
                },
            reasoning_tokens: self.spec.reasoning.then_some(REASONING_DELTAS),
            cached_input_tokens: None,
        };
        sink.complete(Some(usage), finish).await?;
        Ok(())
    }
}

/// The prompt's words, the mock's count of input tokens.
fn prompt_words(input: &RunInput) -> u64 {
    input
        .chat_messages()
        .iter()
        .map(|m| m.content.split_whitespace().count() as u64)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a scanner sends for `tokens`, one string per token, and whether it stopped.
    fn scan(tokens: &[&str], stops: &[&str]) -> (Vec<String>, bool) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut scanner = StopScanner::new(&stops);
        let mut sent = Vec::new();
        for token in tokens {
            let (text, stopped) = scanner.push(token);
            sent.push(text);
            if stopped {
                return (sent, true);
            }
        }
        sent.push(scanner.finish());
        (sent, false)
    }

    #[test]
    fn the_answer_ends_before_the_first_stop_sequence() {
        let answer = ["The ", "quick ", "brown ", "fox"];
        let text = |s: &[&str]| {
            let (sent, stopped) = scan(&answer, s);
            (sent.concat(), stopped)
        };
        assert_eq!(text(&["brown"]), ("The quick ".into(), true));
        // Inside a token, and the earliest of several.
        assert_eq!(text(&["fox", "ick"]), ("The qu".into(), true));
        // Across tokens: what might begin it is held back, never sent past it.
        assert_eq!(text(&["k b"]), ("The quic".into(), true));
        assert_eq!(scan(&answer, &["k b"]).0, ["The ", "quic", ""]);
        assert_eq!(text(&["The"]), (String::new(), true));
        // Without a match everything is sent, token by token where nothing is held.
        assert_eq!(
            scan(&answer, &["zebra", ""]),
            (
                ["The ", "quick ", "brown ", "fox", ""]
                    .map(String::from)
                    .to_vec(),
                false
            )
        );
        assert_eq!(text(&["fox!"]), ("The quick brown fox".into(), false));
    }

    #[test]
    fn what_the_mock_cannot_honour_is_refused_naming_it() {
        let refused = |options: pb::GenerationOptions| {
            let e = refuse_unsupported(&options).unwrap_err();
            assert_eq!(e.code, iop_proto::ErrorCode::BadRequest);
            e.message
        };
        assert!(
            refused(pb::GenerationOptions {
                n: Some(3),
                ..Default::default()
            })
            .contains("`n`")
        );
        assert!(
            refused(pb::GenerationOptions {
                response_format_json: r#"{"type":"json_object"}"#.into(),
                ..Default::default()
            })
            .contains("`response_format`")
        );
        for fine in [
            pb::GenerationOptions::default(),
            pb::GenerationOptions {
                n: Some(1),
                tools_json: r#"[{"type":"function","function":{"name":"f"}}]"#.into(),
                response_format_json: r#"{"type":"text"}"#.into(),
                ..Default::default()
            },
        ] {
            refuse_unsupported(&fine).unwrap();
        }
    }
}
