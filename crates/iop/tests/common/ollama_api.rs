//! Helpers for the Ollama API and header tests: processes started with a chosen log
//! filter (to find debug lines carrying request ids), NDJSON bodies, usage from
//! `/metrics`.

use std::path::Path;
use std::time::Duration;

use serde_json::Value;

use super::{EdgeProc, Proc, TEST_API_KEY, client};

/// An edge on ephemeral ports whose process gets `env` (e.g. `RUST_LOG`).
pub async fn start_edge_env(dir: &Path, config: &str, env: &[(&str, &str)]) -> EdgeProc {
    let path = dir.join("edge.yaml");
    std::fs::write(&path, config).unwrap();
    let args = [
        "edge",
        "--config",
        path.to_str().unwrap(),
        "--listen-nodes",
        "127.0.0.1:0",
        "--listen-http",
        "127.0.0.1:0",
    ];
    let proc = Proc::spawn_with_env("edge", &args, env);
    let line = proc
        .wait_line("iop edge listening:", Duration::from_secs(20))
        .await;
    let field = |key: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(key))
            .unwrap_or_else(|| panic!("no {key} in {line:?}"))
            .to_string()
    };
    EdgeProc {
        nodes: field("nodes="),
        http: field("http="),
        proc,
        config: path,
    }
}

/// A node like `start_node`'s whose process gets `env`.
pub fn start_node_env(
    name: &str,
    dir: &Path,
    edge_nodes: &str,
    token: &str,
    env: &[(&str, &str)],
) -> Proc {
    let config = dir.join(format!("{name}.yaml"));
    let db = dir.join(format!("{name}.db"));
    std::fs::write(
        &config,
        format!(
            "edge: \"{edge_nodes}\"\ntoken: \"{token}\"\ndb: \"{}\"\n",
            db.display()
        ),
    )
    .unwrap();
    Proc::spawn_with_env(name, &["node", "--config", config.to_str().unwrap()], env)
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
    let text = client()
        .get(edge.url("/metrics"))
        .bearer_auth(TEST_API_KEY)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let group = format!("model_group=\"{group}\"");
    let kind = format!("kind=\"{kind}\"");
    text.lines()
        .filter(|l| {
            l.starts_with("iop_usage_tokens_total{") && l.contains(&group) && l.contains(&kind)
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}
