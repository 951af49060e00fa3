//! An embeddings answer in Ollama's shapes: `/api/embed`'s `{"model", "embeddings":
//! [[…]], "total_duration", "load_duration", "prompt_eval_count"}` and the older
//! `/api/embeddings`' `{"embedding": […]}` (the first vector).
//!
//! Pure.

use std::time::Instant;

use serde_json::{Value, json};

use super::render::{Timing, nanos};
use crate::canonical::AnswerEvent;

/// Which embeddings endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Embeddings {
    /// `/api/embed`: several inputs, `embeddings`.
    Embed,
    /// `/api/embeddings`: one prompt, `embedding`.
    Legacy,
}

/// Collects an embeddings answer into its document.
#[derive(Debug)]
pub struct EmbedWriter {
    which: Embeddings,
    model: String,
    timing: Timing,
    vectors: Vec<Value>,
    done: Option<Value>,
}

impl EmbedWriter {
    pub fn new(which: Embeddings, model: String, timing: Timing) -> Self {
        Self {
            which,
            model,
            timing,
            vectors: Vec::new(),
            done: None,
        }
    }

    pub fn document(&self) -> Option<&Value> {
        self.done.as_ref()
    }

    pub fn push(&mut self, event: AnswerEvent, now: Instant) {
        match event {
            AnswerEvent::Embeddings(vectors) => self.vectors.extend(vectors),
            AnswerEvent::Finished(finish) => {
                let vectors = std::mem::take(&mut self.vectors);
                let tokens = finish.usage.map(|u| u.input_tokens);
                self.done = Some(match self.which {
                    Embeddings::Embed => embed(&self.model, vectors, tokens, self.timing, now),
                    Embeddings::Legacy => embedding(vectors),
                });
            }
            _ => {}
        }
    }
}

/// `/api/embed`'s answer.
pub fn embed(
    model: &str,
    vectors: Vec<Value>,
    tokens: Option<u64>,
    timing: Timing,
    now: Instant,
) -> Value {
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

    use iop_proto::pb;

    use super::*;
    use crate::canonical::{Finish, FinishReason};

    #[test]
    fn vectors_come_with_the_token_count_and_durations() {
        let t0 = Instant::now();
        let timing = Timing {
            received: t0,
            dispatched: t0 + Duration::from_millis(2),
        };
        let vectors = vec![json!([1.0, -1.0]), json!([0.5, 0.25])];
        let finish = AnswerEvent::Finished(Finish {
            reason: FinishReason::Stop,
            usage: Some(pb::Usage {
                input_tokens: 4,
                ..Default::default()
            }),
        });
        let mut w = EmbedWriter::new(Embeddings::Embed, "g".into(), timing);
        w.push(AnswerEvent::Embeddings(vectors.clone()), t0);
        assert!(w.document().is_none());
        w.push(finish.clone(), t0 + Duration::from_millis(10));
        let out = w.document().unwrap();
        assert_eq!(out["embeddings"][1], json!([0.5, 0.25]));
        assert_eq!(out["prompt_eval_count"], 4);
        assert_eq!(out["total_duration"], 10_000_000);
        let mut w = EmbedWriter::new(Embeddings::Legacy, "g".into(), timing);
        w.push(AnswerEvent::Embeddings(vectors), t0);
        w.push(finish, t0);
        assert_eq!(w.document().unwrap(), &json!({"embedding": [1.0, -1.0]}));
        assert_eq!(embedding(vec![])["embedding"], json!([]));
    }
}
