//! Helpers for the Ollama API and header tests: processes started with a chosen log
//! filter (to find debug lines carrying request ids), NDJSON bodies, usage from
//! `/metrics`.

use std::path::Path;

use serde_json::Value;

use super::{EdgeProc, Proc, admin_get};

/// A node like `start_node`'s whose process gets `env`.
pub fn start_node_env(
    name: &str,
    dir: &Path,
    edge_nodes: &str,
    token: &str,
    env: &[(&str, &str)],
) -> Proc {
    super::start_node_with_env(name, dir, edge_nodes, token, "", &[], env)
}

/// The objects of an NDJSON body, one per line.
pub fn ndjson(body: &str) -> Vec<Value> {
    body.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l:?}\n{body}")))
        .collect()
}

/// The provider-reported tokens of `kind` (`input`, `output`) recorded for a model group.
pub async fn usage_tokens(edge: &EdgeProc, group: &str, kind: &str) -> u64 {
    let text = admin_get(edge, "/metrics").await.text().await.unwrap();
    let group = format!("model_group=\"{group}\"");
    let kind = format!("kind=\"{kind}\"");
    text.lines()
        .filter(|l| {
            l.starts_with("iop_usage_tokens_total{") && l.contains(&group) && l.contains(&kind)
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}
