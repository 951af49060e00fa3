//! Provider health with real processes: nodes probe their providers and report changes,
//! the edge ejects members whose requests fail and stops sending them new requests, and a
//! group none of whose members is connected answers 503 at once.

mod common;

use std::time::{Duration, Instant};

use common::health::*;
use common::*;
use serde_json::{Value, json};

const TOKEN: &str = "token-n1-0123456789";

/// One node with two OpenAI-compatible providers (two mock processes) in one group.
fn two_member_config(a: &MockProc, b: &MockProc, base_sec: u32) -> String {
    format!(
        r#"
health:
  interval_sec: 0.5
  timeout_sec: 1
  ejection: {{consecutive_failures: 3, base_sec: {base_sec}, max_sec: 60}}
nodes:
  - id: n1
    token: {TOKEN}
    providers:
      - {{id: a, kind: openai_compat, base_url: "{}", capacity: {{normal: 8}}}}
      - {{id: b, kind: openai_compat, base_url: "{}", capacity: {{normal: 8}}}}
model_groups:
  - name: pool
    members:
      - {{node: n1, provider: a, model: mock-model}}
      - {{node: n1, provider: b, model: mock-model}}
"#,
        a.openai_base(),
        b.openai_base()
    )
}

/// Sends `n` chat completions one after another; returns the failed ones' `(status, body)`.
async fn send_sequentially(edge: &EdgeProc, n: usize) -> Vec<(u16, String)> {
    send_counting_attempts(edge, n).await.0
}

/// [`send_sequentially`], also returning how many requests took more than one attempt
/// (`x-iop-attempts` above 1: a member failed them before another served them).
async fn send_counting_attempts(edge: &EdgeProc, n: usize) -> (Vec<(u16, String)>, usize) {
    let mut failed = Vec::new();
    let mut retried = 0;
    for i in 0..n {
        let response = client()
            .post(edge.url("/v1/chat/completions"))
            .json(&json!({
                "model": "pool",
                "max_tokens": 2,
                "messages": [{"role": "user", "content": format!("request {i}")}],
            }))
            .send()
            .await
            .unwrap();
        let status = response.status().as_u16();
        let attempts: u32 = response
            .headers()
            .get("x-iop-attempts")
            .and_then(|v| v.to_str().ok()?.parse().ok())
            .unwrap_or(0);
        if attempts > 1 {
            retried += 1;
        }
        let body = response.text().await.unwrap_or_default();
        if status != 200 {
            failed.push((status, body));
        }
    }
    (failed, retried)
}

async fn start_two_members(
    dir: &std::path::Path,
    base_sec: u32,
) -> (MockProc, MockProc, EdgeProc, Proc) {
    let a = start_mock(&[]).await;
    let b = start_mock(&[]).await;
    let edge = start_edge(dir, &two_member_config(&a, &b, base_sec)).await;
    let node = start_node("n1", dir, &edge.nodes, TOKEN, "");
    wait_ready(&edge, "n1").await;
    for p in ["a", "b"] {
        wait_health(&edge, "n1", p, "healthy", Duration::from_secs(10)).await;
    }
    (a, b, edge, node)
}

#[tokio::test]
async fn a_killed_provider_is_ejected_shown_unhealthy_and_readmitted_when_it_returns() {
    let dir = tempdir();
    let (a, mut b, edge, node) = start_two_members(dir.path(), 60).await;
    // Both members serve while both are up.
    assert!(send_sequentially(&edge, 10).await.is_empty());
    assert!(requests(&b).await > 0, "b served nothing");

    let b_addr = b.addr.clone();
    b.proc.kill9();
    let killed = Instant::now();
    let a_before = requests(&a).await;
    // 100 requests right after the kill all succeed: an attempt that finds b unreachable
    // is sent to a before anything reached the client. At most the 3 consecutive failures
    // that eject b took a second attempt; after that b is not tried at all.
    let (failed, retried) = send_counting_attempts(&edge, 100).await;
    eprintln!("right after the kill: failed {failed:?}, {retried} of 100 took a second attempt");
    assert!(failed.is_empty(), "{failed:?}");
    assert!(retried <= 3, "{retried} requests were tried on b first");
    assert_eq!(requests(&a).await - a_before, 100);

    // The probes find it dead within 10 s, and the status says so with the probe's error.
    wait_health(&edge, "n1", "b", "unhealthy", Duration::from_secs(10)).await;
    assert!(killed.elapsed() < Duration::from_secs(10));
    let s = status(&edge).await;
    let pb = provider_of(&s, "n1", "b");
    assert!(
        pb["last_error"]
            .as_str()
            .unwrap()
            .starts_with("GET /models: cannot connect"),
        "{pb}"
    );
    assert!(pb["last_error_unix_ms"].as_u64().unwrap() > 0, "{pb}");
    if retried == 3 {
        assert!(
            pb["ejected"]["reason"]
                .as_str()
                .unwrap()
                .contains("provider_unreachable"),
            "{pb}"
        );
    }
    assert_eq!(provider_of(&s, "n1", "a")["health"], "healthy");
    // Now every request goes to a, at its first attempt: b receives no dispatches.
    let a_before = requests(&a).await;
    let (failed, retried) = send_counting_attempts(&edge, 100).await;
    assert!(failed.is_empty(), "{failed:?}");
    assert_eq!(retried, 0, "b was dispatched to while unhealthy");
    assert_eq!(requests(&a).await - a_before, 100);

    // Back on the same address: healthy within 10 s (which ends its ejection) and serving.
    let b = start_mock_on(&b_addr).await;
    let took = wait_health(&edge, "n1", "b", "healthy", Duration::from_secs(10)).await;
    eprintln!("b healthy again {took:?} after its restart");
    let s = status(&edge).await;
    assert!(provider_of(&s, "n1", "b")["ejected"].is_null(), "{s}");
    assert!(send_sequentially(&edge, 20).await.is_empty());
    assert!(
        requests(&b).await >= 5,
        "b gets its share again: {}",
        b.stats().await
    );
    assert!(
        node.has_line("provider is unhealthy"),
        "the node logs the change: {}",
        node.log()
    );
    wait_idle(&edge).await;
}

#[tokio::test]
async fn a_provider_failing_every_request_is_ejected_and_gets_none_until_its_time_is_up() {
    let dir = tempdir();
    let (a, b, edge, _node) = start_two_members(dir.path(), 5).await;
    set_faults(&b, json!({"requests": true})).await;
    let b_before = requests(&b).await;
    // Requests alternate between the members: b fails three in a row and is ejected.
    let failed = send_sequentially(&edge, 6).await;
    assert_eq!(failed.len(), 3, "{failed:?}");
    for (status, body) in &failed {
        assert_eq!(*status, 500, "the provider's own answer: {body}");
    }
    assert_eq!(requests(&b).await - b_before, 3);
    let s = status(&edge).await;
    let ejected = &provider_of(&s, "n1", "b")["ejected"];
    assert!(
        ejected["reason"].as_str().unwrap().contains("HTTP 500"),
        "{s}"
    );
    assert_eq!(ejected["times"], 1, "{s}");
    // Its probes still pass: ejection is what keeps it out, not health.
    assert_eq!(provider_of(&s, "n1", "b")["health"], "healthy");
    // While it is ejected, b receives nothing.
    let a_before = requests(&a).await;
    let failed = send_sequentially(&edge, 20).await;
    let still_ejected = provider_of(&status(&edge).await, "n1", "b")["ejected"].is_object();
    assert!(failed.is_empty(), "{failed:?}");
    if still_ejected {
        assert_eq!(
            requests(&b).await - b_before,
            3,
            "b got requests while ejected"
        );
        assert_eq!(requests(&a).await - a_before, 20);
    }
    // Fixed, it rejoins when the ejection time is up and gets its share again.
    set_faults(&b, json!({"requests": false})).await;
    wait_status(&edge, Duration::from_secs(20), "b back in rotation", |s| {
        provider_of(s, "n1", "b")["ejected"].is_null()
    })
    .await;
    let b_back = requests(&b).await;
    assert!(send_sequentially(&edge, 10).await.is_empty());
    assert!(requests(&b).await - b_back >= 3, "b serves again");
    edge.proc
        .wait_line("provider ejected", Duration::from_secs(10))
        .await;
}

#[tokio::test]
async fn with_every_members_node_offline_clients_get_503_at_once_naming_them() {
    let dir = tempdir();
    let config = r#"
nodes:
  - id: n1
    token: token-n1-0123456789
    providers:
      - {id: m, kind: mock}
  - id: n2
    token: token-n2-0123456789
    providers:
      - {id: m, kind: mock}
model_groups:
  - name: pool
    members: [{node: n1, provider: m}, {node: n2, provider: m}]
    queue: {timeout_sec: 30}
"#;
    let edge = start_edge(dir.path(), config).await;
    let check = |status: u16, body: &str, took: Duration| {
        assert_eq!(status, 503, "{body}");
        // Far below the 30 s queue timeout: nothing waits.
        assert!(took < Duration::from_secs(10), "took {took:?}");
        let v: Value = serde_json::from_str(body).unwrap();
        let message = v["error"]["message"].as_str().unwrap();
        assert_eq!(v["error"]["code"], "model_unavailable", "{body}");
        assert!(
            message.contains("none of its members is connected"),
            "{message}"
        );
        assert!(
            message.contains("n1/m") && message.contains("n2/m"),
            "{message}"
        );
        assert!(
            !message.contains("http") && !message.contains("127.0.0.1"),
            "{message}"
        );
    };
    // Never connected.
    let started = Instant::now();
    let (code, body) = chat_completion(&edge, "pool", "hi", json!({})).await;
    check(code, &body, started.elapsed());
    // Connected, then gone.
    let mut n1 = start_node("n1", dir.path(), &edge.nodes, TOKEN, "");
    wait_ready(&edge, "n1").await;
    let (code, body) = chat_completion(&edge, "pool", "hi", json!({})).await;
    assert_eq!(code, 200, "{body}");
    n1.kill9();
    wait_status(&edge, Duration::from_secs(5), "n1 offline", |s| {
        node_status(s, "n1")["connected"] == false
    })
    .await;
    let started = Instant::now();
    let (code, body) = chat_completion(&edge, "pool", "hi", json!({"stream": true})).await;
    check(code, &body, started.elapsed());
    let s = status(&edge).await;
    assert_eq!(provider_of(&s, "n1", "m")["health"], "offline", "{s}");
    wait_idle(&edge).await;
}

#[tokio::test]
async fn a_cli_provider_whose_program_is_missing_is_unhealthy() {
    let dir = tempdir();
    let config = format!(
        r#"
health: {{interval_sec: 0.3}}
nodes:
  - id: n1
    token: {TOKEN}
    providers:
      - {{id: agent, kind: cli, cli: {{argv: ["{}/no-such-agent"]}}}}
      - {{id: shell, kind: cli, cli: {{argv: [sh, -c, "cat"]}}}}
"#,
        dir.path().display()
    );
    let edge = start_edge(dir.path(), &config).await;
    let _node = start_node("n1", dir.path(), &edge.nodes, TOKEN, "");
    wait_ready(&edge, "n1").await;
    wait_health(&edge, "n1", "agent", "unhealthy", Duration::from_secs(10)).await;
    wait_health(&edge, "n1", "shell", "healthy", Duration::from_secs(10)).await;
    let s = status(&edge).await;
    let error = provider_of(&s, "n1", "agent")["last_error"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(error.ends_with("no-such-agent: no such file"), "{error}");
    // `iop status` shows it too (the edge named by IOP_URL, as `--url` would).
    let out = std::process::Command::new(IOP)
        .arg("status")
        .env("IOP_URL", edge.url(""))
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&out.stdout);
    eprintln!("{table}");
    assert!(out.status.success(), "{table}");
    let row = table.lines().find(|l| l.contains(" agent ")).unwrap();
    assert!(row.contains("unhealthy"), "{table}");
    assert!(
        table.contains("n1/agent: last failed probe") && table.contains("no such file"),
        "{table}"
    );
}
