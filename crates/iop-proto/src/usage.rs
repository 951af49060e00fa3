//! A provider's usage as the wire carries it ([`pb::Usage`]), read from an OpenAI-style
//! `usage` object (OpenAI's, vLLM's, llama-server's…): only the fields read, each on its
//! own and leniently ([`fields`]), so an odd field costs that field, never the whole
//! count. Both daemons read usage this way: the node from what its providers answer, the
//! edge from a tunnelled provider's answer it translates.

pub mod fields;

use serde::Deserialize;
use serde_json::Value;

use crate::pb;
use fields::{count, lenient};

/// Where an OpenAI-style `usage` object may put the reasoning tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenAiDialect {
    /// OpenAI: `completion_tokens_details.reasoning_tokens` only.
    OpenAi,
    /// vLLM: as OpenAI, else a top-level `reasoning_tokens` (older releases).
    Vllm,
}

/// An OpenAI-style `usage` object: only the fields read, each tolerated when it is not a
/// count (it then counts as not reported), the rest skipped without being built.
#[derive(Debug, Default, Deserialize)]
pub struct OpenAiUsage {
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
    pub fn into_usage(self, dialect: OpenAiDialect) -> pb::Usage {
        let mut reasoning = self
            .completion_tokens_details
            .and_then(|d| d.reasoning_tokens);
        if reasoning.is_none() && dialect == OpenAiDialect::Vllm {
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

/// Converts an OpenAI-style `usage` object; `None` if it is absent or null.
pub fn from_openai(usage: &Value, dialect: OpenAiDialect) -> Option<pb::Usage> {
    if !usage.is_object() {
        return None;
    }
    OpenAiUsage::deserialize(usage)
        .ok()
        .map(|u| u.into_usage(dialect))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn plain_usage_has_no_breakdown() {
        let u = from_openai(
            &json!({"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}),
            OpenAiDialect::OpenAi,
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
            OpenAiDialect::OpenAi,
        )
        .unwrap();
        assert_eq!(u.reasoning_tokens, Some(3));
        assert_eq!(u.cached_input_tokens, Some(2));
    }

    #[test]
    fn null_details_are_not_reported() {
        let u = from_openai(
            &json!({"prompt_tokens": 1, "completion_tokens": 1, "prompt_tokens_details": null}),
            OpenAiDialect::Vllm,
        )
        .unwrap();
        assert_eq!(u.cached_input_tokens, None);
    }

    #[test]
    fn vllm_top_level_reasoning_tokens() {
        let usage = json!({"prompt_tokens": 1, "completion_tokens": 9, "reasoning_tokens": 4});
        assert_eq!(
            from_openai(&usage, OpenAiDialect::Vllm)
                .unwrap()
                .reasoning_tokens,
            Some(4)
        );
        assert_eq!(
            from_openai(&usage, OpenAiDialect::OpenAi)
                .unwrap()
                .reasoning_tokens,
            None
        );
    }

    #[test]
    fn only_non_negative_integers_are_counts() {
        let u = from_openai(
            &json!({"prompt_tokens": -3, "completion_tokens": 2.5, "reasoning_tokens": [1, 2],
                    "prompt_tokens_details": {"cached_tokens": 4}}),
            OpenAiDialect::Vllm,
        )
        .unwrap();
        assert_eq!((u.input_tokens, u.output_tokens), (0, 0));
        assert_eq!((u.reasoning_tokens, u.cached_input_tokens), (None, Some(4)));
    }

    #[test]
    fn odd_fields_cost_only_themselves() {
        let u = from_openai(
            &json!({"prompt_tokens": "many", "completion_tokens": 7,
                    "prompt_tokens_details": "n/a", "completion_tokens_details": {"reasoning_tokens": 2}}),
            OpenAiDialect::OpenAi,
        )
        .unwrap();
        assert_eq!((u.input_tokens, u.output_tokens), (0, 7));
        assert_eq!((u.reasoning_tokens, u.cached_input_tokens), (Some(2), None));
    }
}
