//! Cache-affine routing with real processes: a conversation's turns (named by `user`, or
//! by nothing but a long shared system prompt) all reach one member of a two-member
//! group, different conversations reach both, and the edge says so on `/metrics`, in
//! `/admin/status` and in the usage ledger.

mod common;

use std::collections::BTreeMap;

use common::*;
use serde_json::json;

const CONFIG: &str = r#"
nodes:
  - id: n1
    token: token-n1-0123456789
    providers: [{id: p, kind: mock, capacity: {normal: 4, long: 0}}]
  - id: n2
    token: token-n2-0123456789
    providers: [{id: p, kind: mock, capacity: {normal: 4, long: 0}}]
model_groups:
  - {name: sticky, members: [{node: n1, provider: p}, {node: n2, provider: p}]}
  - {name: spread, routing: least_in_flight, members: [{node: n1, provider: p}, {node: n2, provider: p}]}
"#;

/// Requests of `group` each node served, from the edge's usage metrics.
async fn served(edge: &EdgeProc, group: &str) -> BTreeMap<String, f64> {
    let text = admin_get(edge, "/metrics").await.text().await.unwrap();
    let mut by_node = BTreeMap::new();
    for line in text
        .lines()
        .filter(|l| l.starts_with("iop_usage_tokens_total{"))
    {
        if !line.contains(&format!("model_group=\"{group}\"")) || !line.contains("kind=\"output\"")
        {
            continue;
        }
        let node = line
            .split("node=\"")
            .nth(1)
            .unwrap()
            .split('"')
            .next()
            .unwrap();
        let value: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
        *by_node.entry(node.to_string()).or_default() += value;
    }
    by_node
}

/// The edge with both nodes ready.
async fn two_nodes() -> (tempfile::TempDir, EdgeProc, [Proc; 2]) {
    let dir = tempdir();
    let edge = start_edge(dir.path(), CONFIG).await;
    let n1 = start_node("n1", dir.path(), &edge.nodes, "token-n1-0123456789", "");
    let n2 = start_node("n2", dir.path(), &edge.nodes, "token-n2-0123456789", "");
    wait_ready(&edge, "n1").await;
    wait_ready(&edge, "n2").await;
    (dir, edge, [n1, n2])
}

fn metric(text: &str, prefix: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum()
}

#[tokio::test]
async fn a_conversation_stays_on_one_member_and_the_edge_counts_it() {
    let (_dir, edge, _nodes) = two_nodes().await;

    // Twelve turns of one conversation, named by `user`: one member serves them all.
    for turn in 0..12 {
        let (status, body) = chat_completion(
            &edge,
            "sticky",
            &format!("turn {turn}"),
            json!({"user": "alice"}),
        )
        .await;
        assert_eq!(status, 200, "{body}");
    }
    let after_alice = served(&edge, "sticky").await;
    assert_eq!(
        after_alice.len(),
        1,
        "one conversation, two members: {after_alice:?}"
    );

    // Sixteen conversations: both members serve some.
    for user in 0..16 {
        let (status, _) = chat_completion(
            &edge,
            "sticky",
            "hello",
            json!({"user": format!("user-{user}")}),
        )
        .await;
        assert_eq!(status, 200);
    }
    assert_eq!(served(&edge, "sticky").await.len(), 2);

    // No key, but a long shared system prompt: every request after the first goes where
    // the first went.
    let system = "You are a meticulous reviewer of Rust code. ".repeat(60);
    let before = served(&edge, "sticky").await;
    for turn in 0..8 {
        let messages = json!([
            {"role": "system", "content": system},
            {"role": "user", "content": format!("question {turn}")}
        ]);
        let (status, _) = chat_completion(&edge, "sticky", "", json!({"messages": messages})).await;
        assert_eq!(status, 200);
    }
    let after = served(&edge, "sticky").await;
    let moved: Vec<&String> = after
        .iter()
        .filter(|(node, n)| before.get(*node).copied().unwrap_or(0.0) < **n)
        .map(|(node, _)| node)
        .collect();
    assert_eq!(moved.len(), 1, "a shared prefix went to {moved:?}");

    // What the operator sees.
    let text = admin_get(&edge, "/metrics").await.text().await.unwrap();
    let hits = metric(
        &text,
        "iop_routing_decisions_total{model_group=\"sticky\",affinity=\"session\",outcome=\"hit\"}",
    );
    assert!(hits >= 11.0 + 16.0, "session hits: {hits}\n{text}");
    let prefix_hits = metric(
        &text,
        "iop_routing_decisions_total{model_group=\"sticky\",affinity=\"prefix\",outcome=\"hit\"}",
    );
    assert_eq!(prefix_hits, 7.0, "{text}");
    let cold = metric(
        &text,
        "iop_routing_decisions_total{model_group=\"sticky\",affinity=\"prefix\",outcome=\"cold\"}",
    );
    assert_eq!(cold, 1.0);
    let s = status(&edge).await;
    let routing = &group_of(&s, "sticky")["routing"];
    assert_eq!(routing["policy"], "session_prefix");
    assert!(routing["hit_ratio"].as_f64().unwrap() > 0.9, "{routing}");
    assert_eq!(
        group_of(&s, "spread")["routing"]["policy"],
        "least_in_flight"
    );

    // And the usage ledger, per request: summed per routing decision.
    let by_routing = ledger_by_routing(&edge, "sticky", 12 + 16 + 8).await;
    assert!(by_routing["session/hit"] >= 11 + 16, "{by_routing:?}");
    assert_eq!(by_routing["prefix/hit"], 7, "{by_routing:?}");
    assert_eq!(by_routing["prefix/cold"], 1, "{by_routing:?}");
}

/// The requests of `group` in the usage ledger per routing decision, once it holds `n`.
async fn ledger_by_routing(edge: &EdgeProc, group: &str, n: u64) -> BTreeMap<String, u64> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let body: serde_json::Value =
            admin_get(edge, &format!("/admin/usage?per=routing&group={group}"))
                .await
                .json()
                .await
                .unwrap();
        let rows: BTreeMap<String, u64> = body["rows"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                let routing = r["routing"].as_str().unwrap().to_string();
                (routing, r["requests"].as_u64().unwrap())
            })
            .collect();
        if rows.values().sum::<u64>() >= n {
            return rows;
        }
        assert!(std::time::Instant::now() < deadline, "{body}");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn least_in_flight_spreads_one_conversation() {
    let (_dir, edge, _nodes) = two_nodes().await;
    for turn in 0..6 {
        let (status, _) = chat_completion(
            &edge,
            "spread",
            &format!("turn {turn}"),
            json!({"user": "alice"}),
        )
        .await;
        assert_eq!(status, 200);
    }
    assert_eq!(
        served(&edge, "spread").await.len(),
        2,
        "round-robin over idle members"
    );
}
