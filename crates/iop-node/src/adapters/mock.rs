//! The mock adapter: deterministic, in-process, no backend. Emits a configurable number of
//! word tokens with an optional per-token delay, optional reasoning deltas, and usage.
//! For tests, benchmarks and `iop demo`; never the only path that works.
//!
//! It misbehaves on purpose by target name, for fault tests:
//! - a target containing `mock-error` fails with an error terminal halfway;
//! - `mock-no-terminal` returns after its tokens without a terminal (the run manager must
//!   synthesize one);
//! - `mock-hang` starts and then waits until cancelled.

use iop_proto::ErrorCode;
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

#[async_trait]
impl Adapter for MockAdapter {
    async fn execute(&self, input: RunInput, sink: &mut RunSink) -> Result<(), AdapterError> {
        let configured = if self.spec.tokens == 0 {
            DEFAULT_TOKENS
        } else {
            self.spec.tokens
        };
        let (tokens, finish) = match input.options.max_tokens {
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
            sink.delta(&token).await?;
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
            output_tokens: tokens as u64
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
