//! An OpenAI embeddings answer in Ollama's shapes: `/api/embed`'s `{"model",
//! "embeddings": [[…]], "total_duration", "load_duration", "prompt_eval_count"}` and the
//! older `/api/embeddings`' `{"embedding": […]}`. The vectors keep the order of the
//! inputs (OpenAI's `index`), whatever order the provider listed them in.
//!
//! Pure.

use std::time::Instant;

use serde_json::{Value, json};

use super::render::Timing;
use crate::http::error::ApiError;

/// The vectors of an OpenAI embeddings answer, in input order, and its prompt tokens.
pub fn vectors(answer: &Value) -> Result<(Vec<Value>, Option<u64>), ApiError> {
    let bad = || {
        ApiError::upstream(
            "bad_upstream_response",
            "the provider's embeddings answer has no `data` list of embeddings",
        )
    };
    let data = answer
        .get("data")
        .and_then(Value::as_array)
        .ok_or_else(bad)?;
    let mut indexed: Vec<(u64, Value)> = data
        .iter()
        .enumerate()
        .map(|(i, item)| {
            let vector = item.get("embedding").filter(|e| e.is_array()).cloned();
            let index = item
                .get("index")
                .and_then(Value::as_u64)
                .unwrap_or(i as u64);
            vector.map(|v| (index, v)).ok_or_else(bad)
        })
        .collect::<Result<_, _>>()?;
    indexed.sort_by_key(|(i, _)| *i);
    let tokens = answer
        .pointer("/usage/prompt_tokens")
        .and_then(Value::as_u64);
    Ok((indexed.into_iter().map(|(_, v)| v).collect(), tokens))
}

/// `/api/embed`'s answer.
pub fn embed(
    model: &str,
    vectors: Vec<Value>,
    tokens: Option<u64>,
    timing: Timing,
    now: Instant,
) -> Value {
    let nanos = |d: std::time::Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
    let mut out = json!({
        "model": model,
        "embeddings": vectors,
        "total_duration": nanos(now.saturating_duration_since(timing.received)),
        "load_duration": nanos(timing.dispatched.saturating_duration_since(timing.received)),
    });
    if let Some(n) = tokens {
        out["prompt_eval_count"] = json!(n);
    }
    out
}

/// `/api/embeddings`' answer: the one vector.
pub fn embedding(mut vectors: Vec<Value>) -> Value {
    let first = if vectors.is_empty() {
        json!([])
    } else {
        vectors.swap_remove(0)
    };
    json!({"embedding": first})
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn vectors_come_in_input_order_with_the_token_count() {
        let answer = json!({"object": "list", "data": [
            {"object": "embedding", "index": 1, "embedding": [0.5, 0.25]},
            {"object": "embedding", "index": 0, "embedding": [1.0, -1.0]},
        ], "usage": {"prompt_tokens": 4, "total_tokens": 4}});
        let (v, tokens) = vectors(&answer).unwrap();
        assert_eq!(v, vec![json!([1.0, -1.0]), json!([0.5, 0.25])]);
        assert_eq!(tokens, Some(4));
        let t0 = Instant::now();
        let timing = Timing {
            received: t0,
            dispatched: t0 + Duration::from_millis(2),
        };
        let out = embed(
            "g",
            v.clone(),
            tokens,
            timing,
            t0 + Duration::from_millis(10),
        );
        assert_eq!(out["embeddings"][1], json!([0.5, 0.25]));
        assert_eq!(out["prompt_eval_count"], 4);
        assert_eq!(out["total_duration"], 10_000_000);
        assert_eq!(embedding(v)["embedding"], json!([1.0, -1.0]));
        assert!(vectors(&json!({"data": [{"embedding": "base64"}]})).is_err());
        assert!(vectors(&json!({"error": "x"})).is_err());
    }
}
