//! The mock adapter: deterministic, in-process, no backend. Emits a configurable number of
//! word tokens with an optional per-token delay, optional reasoning deltas, and usage.
//! For tests, benchmarks and `iop demo`; never the only path that works.
//!
//! It misbehaves on purpose by target name, for fault tests:
//! - a target containing `mock-error` fails with an error terminal halfway;
//! - `mock-no-terminal` returns after its tokens without a terminal (the run manager must
//!   synthesize one);
//! - `mock-hang` starts and then waits until cancelled.
//!
//! It honours `max_tokens` and `stop` (the answer ends before the first stop sequence,
//! finish reason `stop`), and refuses with `bad_request` what it cannot do: `tools`, a
//! `response_format` other than `text`, and `n` above 1.

use std::time::Duration;

use async_trait::async_trait;
use iop_proto::pb;

use super::{Adapter, AdapterError, RunInput};
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
    let refuse = |message: String| Err(AdapterError::new("bad_request", message));
    if let Some(n) = options.n.filter(|n| *n > 1) {
        return refuse(format!(
            "`n` is {n}, but the mock adapter answers with one choice: send n = 1 (or leave it out)"
        ));
    }
    let tools: Option<Vec<serde_json::Value>> = serde_json::from_str(&options.tools_json).ok();
    if !options.tools_json.is_empty() && tools.is_none_or(|t| !t.is_empty()) {
        return refuse("`tools`: the mock adapter cannot call tools; leave `tools` out".into());
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

/// The answer's tokens cut before the first of `stops` in their text; whether one was
/// found.
fn cut_at_stop(tokens: Vec<String>, stops: &[String]) -> (Vec<String>, bool) {
    let text: String = tokens.concat();
    let Some(cut) = stops
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| text.find(s.as_str()))
        .min()
    else {
        return (tokens, false);
    };
    let mut kept = Vec::new();
    let mut at = 0;
    for token in tokens {
        if at + token.len() <= cut {
            at += token.len();
            kept.push(token);
            continue;
        }
        if cut > at {
            kept.push(token[..cut - at].to_string());
        }
        break;
    }
    (kept, true)
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
        let words: Vec<&str> = text.split_whitespace().collect();
        sink.start(&input.target).await?;
        if input.target.contains("mock-hang") {
            std::future::pending::<()>().await;
        }
        if self.spec.reasoning {
            for i in 0..REASONING_DELTAS {
                sink.reasoning(&format!("thinking-{i} ")).await?;
            }
        }
        let answer: Vec<String> = (0..tokens as usize)
            .map(|i| {
                let word = words[i % words.len()];
                if i + 1 == tokens as usize {
                    word.to_string()
                } else {
                    format!("{word} ")
                }
            })
            .collect();
        let (answer, stopped) = cut_at_stop(answer, &input.options.stop);
        if stopped {
            finish = "stop";
        }
        for (i, token) in answer.iter().enumerate() {
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            if input.target.contains("mock-error") && i == tokens as usize / 2 {
                return Err(AdapterError::new(
                    "provider_error",
                    format!("mock failure after {i} tokens (target {})", input.target),
                ));
            }
            sink.delta(token).await?;
        }
        if input.target.contains("mock-no-terminal") {
            return Ok(());
        }
        let prompt_words = input
            .chat_messages()
            .iter()
            .map(|m| m.content.split_whitespace().count() as u64)
            .sum();
        let usage = pb::Usage {
            input_tokens: prompt_words,
            output_tokens: answer.len() as u64
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

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens(words: &[&str]) -> Vec<String> {
        words.iter().map(|w| w.to_string()).collect()
    }

    #[test]
    fn the_answer_ends_before_the_first_stop_sequence() {
        let answer = tokens(&["The ", "quick ", "brown ", "fox"]);
        let stop = |s: &[&str]| cut_at_stop(answer.clone(), &tokens(s));
        assert_eq!(stop(&["brown"]), (tokens(&["The ", "quick "]), true));
        // Inside a token, and the earliest of several.
        assert_eq!(stop(&["fox", "ick"]), (tokens(&["The ", "qu"]), true));
        // Across tokens.
        assert_eq!(stop(&["k b"]), (tokens(&["The ", "quic"]), true));
        assert_eq!(stop(&["The"]), (vec![], true));
        assert_eq!(stop(&["zebra", ""]), (answer.clone(), false));
    }

    #[test]
    fn what_the_mock_cannot_honour_is_refused_naming_it() {
        let refused = |options: pb::GenerationOptions| {
            let e = refuse_unsupported(&options).unwrap_err();
            assert_eq!(e.code, "bad_request");
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
                tools_json: r#"[{"type":"function","function":{"name":"f"}}]"#.into(),
                ..Default::default()
            })
            .contains("`tools`")
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
                tools_json: "[]".into(),
                response_format_json: r#"{"type":"text"}"#.into(),
                ..Default::default()
            },
        ] {
            refuse_unsupported(&fine).unwrap();
        }
    }
}
