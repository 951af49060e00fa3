//! One finished request as the ledger keeps it ([`UsageRecord`]), and the names its
//! fields take (the API a request came in on, how it reached its provider).

use serde::Serialize;

pub use crate::surfaces::ClientApi;

/// The name recorded for requests on an edge without API keys.
pub const ANONYMOUS_KEY: &str = "anonymous";

/// The outcome of a request that succeeded.
pub const OUTCOME_OK: &str = "ok";

/// The outcome of a request whose edge did not receive its end (the edge died while it
/// ran), recorded from its node's report by another edge.
pub const EDGE_LOST: &str = "edge_lost";

/// One finished request: who asked, what served it, what it cost and how it ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct UsageRecord {
    /// When the request arrived, in milliseconds since the Unix epoch.
    pub time_ms: i64,
    /// The API key's name, or [`ANONYMOUS_KEY`].
    pub key: String,
    /// The model group asked for: a configured group's name, `(unknown) <hash>` for a name
    /// no group has (never the name itself), or empty when the request named none the edge
    /// could read. A native run's is `node/adapter`.
    pub group: String,
    /// The node and provider that served it (empty when it never reached one).
    pub node: String,
    pub provider: String,
    /// `tunnel`, `run` or `none` (answered by the edge itself).
    pub path: &'static str,
    /// `openai`, `responses`, `messages`, `ollama` or `runs`.
    pub api: &'static str,
    /// What the provider reported (0 when it reported nothing).
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub reasoning_tokens: u64,
    pub cached_tokens: u64,
    /// When the provider reported no usage but the request was sent to it: the input
    /// estimated from the prompt and the output counted from what was relayed (one token
    /// per streamed delta). Estimates, never mixed with reported counts.
    pub est_input_tokens: Option<u64>,
    pub est_output_tokens: Option<u64>,
    /// From arrival to the end of the response.
    pub latency_ms: u64,
    /// From arrival to the first token (body bytes or a delta), when there was one.
    pub ttft_ms: Option<u64>,
    /// `ok`, or the error code the request ended with (`client_abort` when the client
    /// left first).
    pub outcome: String,
    /// The HTTP status the client got.
    pub status: u16,
    /// Members tried.
    pub attempts: u32,
    /// How the member that took it was picked: `<affinity>/<outcome>` as on
    /// `iop_routing_decisions_total` (`session/hit`, `prefix/cold`, `session/over_bound`,
    /// `none/unsteered`, …), or empty when no member was picked (refused before routing,
    /// a native run).
    pub routing: &'static str,
}

/// Milliseconds since the Unix epoch now.
pub fn unix_ms_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

#[cfg(test)]
impl UsageRecord {
    /// A served request of `key` to `group` at `time_ms`, for tests: 3 input tokens,
    /// `output` output tokens, 1 reasoning token, 12 ms (4 to the first token).
    pub fn sample(key: &str, group: &str, time_ms: i64, outcome: &str, output: u64) -> Self {
        UsageRecord {
            time_ms,
            key: key.into(),
            group: group.into(),
            node: "n1".into(),
            provider: "p1".into(),
            path: "tunnel",
            api: "openai",
            input_tokens: 3,
            output_tokens: output,
            reasoning_tokens: 1,
            est_input_tokens: None,
            est_output_tokens: None,
            cached_tokens: 0,
            latency_ms: 12,
            ttft_ms: Some(4),
            outcome: outcome.into(),
            status: if outcome == "ok" { 200 } else { 502 },
            attempts: 1,
            routing: "none/unsteered",
        }
    }
}

impl UsageRecord {
    pub fn is_ok(&self) -> bool {
        self.outcome == OUTCOME_OK
    }

    /// Whether the provider reported usage.
    pub fn reported(&self) -> bool {
        self.input_tokens > 0 || self.output_tokens > 0
    }

    /// What `tokens_per_day` limits count: input plus output as reported, or as estimated
    /// when the provider reported nothing.
    pub fn billed_tokens(&self) -> u64 {
        if self.reported() {
            return self.input_tokens.saturating_add(self.output_tokens);
        }
        let estimate = |n: Option<u64>| n.unwrap_or(0);
        estimate(self.est_input_tokens).saturating_add(estimate(self.est_output_tokens))
    }
}

/// The label a model name no configured group has is recorded and shown as: never the
/// name itself (a client chooses it, of any length), but `(unknown)` and a short hash of
/// it, so repeated mistakes can still be told apart.
pub fn unknown_model_label(name: &str) -> String {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(name.as_bytes());
    format!("(unknown) {}", hex::encode(&digest[..4]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_names_are_short_hashes_and_budgets_count_estimates_only_without_usage() {
        let long = "x".repeat(3 << 20);
        let label = unknown_model_label(&long);
        assert!(
            label.starts_with("(unknown) ") && label.len() == 18,
            "{label}"
        );
        assert_eq!(label, unknown_model_label(&long));
        assert_ne!(label, unknown_model_label("y"));
        let mut r = UsageRecord {
            time_ms: 0,
            key: "k".into(),
            group: "g".into(),
            node: String::new(),
            provider: String::new(),
            path: "tunnel",
            api: "openai",
            input_tokens: 0,
            output_tokens: 0,
            reasoning_tokens: 0,
            cached_tokens: 0,
            est_input_tokens: Some(10),
            est_output_tokens: Some(5),
            latency_ms: 0,
            ttft_ms: None,
            outcome: "client_abort".into(),
            status: 200,
            attempts: 1,
            routing: "",
        };
        assert_eq!(r.billed_tokens(), 15);
        r.output_tokens = 7;
        assert_eq!(r.billed_tokens(), 7);
    }
}
