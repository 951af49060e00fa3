//! Reloading the edge config with SIGHUP while nodes are connected and requests wait.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use nix::sys::signal::Signal;
use serde_json::json;

fn config(capacity: u32, extra: bool) -> String {
    let mut c = format!(
        r#"
nodes:
  - id: n1
    token: token-n1-0123456789
    providers:
      - {{id: mock, kind: mock, capacity: {{normal: {capacity}, long: 0}}, mock: {{tokens: 20, token_delay_ms: 50}}}}
"#
    );
    if extra {
        c.push_str("      - {id: fresh, kind: mock, mock: {tokens: 3}}\n");
    }
    c.push_str("model_groups:\n  - {name: pool, members: [{node: n1, provider: mock}]}\n");
    if extra {
        c.push_str("  - {name: extra, members: [{node: n1, provider: fresh}]}\n");
    }
    c
}

#[tokio::test]
async fn sighup_applies_new_capacity_groups_and_providers_without_dropping_anyone() {
    let dir = tempdir();
    let edge = Arc::new(start_edge(dir.path(), &config(1, false)).await);
    let _node = start_node("n1", dir.path(), &edge.nodes, "token-n1-0123456789", "");
    wait_ready(&edge, "n1").await;
    let first = {
        let edge = edge.clone();
        tokio::spawn(async move { chat_completion(&edge, "pool", "first", json!({})).await })
    };
    wait_status(&edge, Duration::from_secs(5), "first running", |s| {
        provider_of(s, "n1", "mock")["in_flight"]["normal"] == 1
    })
    .await;
    let second = {
        let edge = edge.clone();
        tokio::spawn(async move { chat_completion(&edge, "pool", "second", json!({})).await })
    };
    wait_status(&edge, Duration::from_secs(5), "second waiting", |s| {
        group_of(s, "pool")["waiting"]["normal"] == 1
    })
    .await;

    // A broken file is refused and the running config stays.
    std::fs::write(&edge.config, "nodes: [{id: n1, tokn: typo}]\n").unwrap();
    edge.proc.signal(Signal::SIGHUP);
    edge.proc
        .wait_line("config reload failed", Duration::from_secs(5))
        .await;
    assert_eq!(
        group_of(&status(&edge).await, "pool")["waiting"]["normal"],
        1
    );

    // More capacity dispatches the waiter at once, long before the first run ends.
    std::fs::write(&edge.config, config(2, true)).unwrap();
    edge.proc.signal(Signal::SIGHUP);
    edge.proc
        .wait_line("config reloaded", Duration::from_secs(5))
        .await;
    wait_status(&edge, Duration::from_secs(10), "both running", |s| {
        provider_of(s, "n1", "mock")["in_flight"]["normal"] == 2
            && group_of(s, "pool")["waiting"]["normal"] == 0
    })
    .await;
    let (a, b) = (first.await.unwrap(), second.await.unwrap());
    assert_eq!((a.0, b.0), (200, 200), "{a:?} {b:?}");

    // The node got the new provider: the new group answers, and the node stayed connected.
    let (code, body) = chat_completion(&edge, "extra", "hi", json!({})).await;
    assert_eq!(code, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 3);
    assert_eq!(
        edge.proc.log().matches("node ready").count(),
        1,
        "the node never reconnected"
    );
    wait_idle(&edge).await;
}
