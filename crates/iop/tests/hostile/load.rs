//! The control plane under data-plane load: one client key sending many large, costly
//! bodies at once — to the model endpoints and to the token counter — must not starve the
//! node links (heartbeats) or the health probes; and a token count is admitted, bounded
//! and recorded like any request.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::common::node_wire::RssPeak;
use crate::common::*;

const KEY: &str = "client-key-0123456789";
const MIB: u64 = 1024 * 1024;

fn config(mock: &MockProc) -> String {
    let base = mock.openai_base();
    let mut nodes = String::new();
    for n in 1..=3 {
        nodes.push_str(&format!(
            "  - {{id: n{n}, token: token-n{n}-0123456789, providers: [{{id: oa, kind: openai_compat, base_url: \"{base}\", capacity: {{normal: 32}}}}]}}\n"
        ));
    }
    format!(
        r#"
auth:
  keys:
    - {{name: ops, role: admin, key: {TEST_API_KEY}}}
    - {{name: c, role: client, key: {KEY}}}
nodes:
{nodes}model_groups:
  - {{name: m, members: [{{node: n1, provider: oa}}, {{node: n2, provider: oa}}, {{node: n3, provider: oa}}]}}
"#
    )
}

/// A Messages request of `blocks` text blocks of `chars` characters each.
fn messages_body(blocks: usize, chars: usize) -> bytes::Bytes {
    let text = "a".repeat(chars);
    let blocks: Vec<Value> = (0..blocks)
        .map(|_| json!({"type": "text", "text": text}))
        .collect();
    let body = serde_json::to_vec(&json!({
        "model": "m",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": blocks}],
    }))
    .unwrap();
    bytes::Bytes::from(body)
}

/// Polls `/healthz` until stopped; the slowest answer.
async fn slowest_health(url: String, stop: Arc<AtomicBool>) -> Duration {
    let client = client();
    let mut slowest = Duration::ZERO;
    while !stop.load(Ordering::Relaxed) {
        let started = Instant::now();
        let status = client
            .get(&url)
            .timeout(Duration::from_secs(30))
            .send()
            .await
            .map(|r| r.status().as_u16());
        assert_eq!(status.ok(), Some(200), "/healthz failed");
        slowest = slowest.max(started.elapsed());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    slowest
}

/// Starts nodes n1..n3 on `edge` and waits until they are ready.
async fn three_nodes(edge: &EdgeProc, dir: &std::path::Path) -> Vec<Proc> {
    let mut nodes = Vec::new();
    for i in 1..=3 {
        let token = format!("token-n{i}-0123456789");
        nodes.push(start_node(&format!("n{i}"), dir, &edge.nodes, &token, ""));
    }
    for i in 1..=3 {
        wait_ready(edge, &format!("n{i}")).await;
    }
    nodes
}

/// The generation of each of n1..n3 (a node that reconnected has a new one).
async fn generations(edge: &EdgeProc) -> Vec<Value> {
    let s = status(edge).await;
    (1..=3)
        .map(|i| node_status(&s, &format!("n{i}"))["generation"].clone())
        .collect()
}

/// Starts three nodes, sends `n` costly bodies at once from one key while probing
/// `/healthz`, and checks that no node was dropped.
async fn costly_bodies_leave_the_control_plane_alone(n: usize, edge_args: &[&str]) {
    let dir = tempdir();
    let mock = start_mock(&[]).await;
    let edge = start_edge_with(dir.path(), &config(&mock), edge_args).await;
    let nodes = three_nodes(&edge, dir.path()).await;
    let before = generations(&edge).await;
    let baseline = crate::common::node_wire::rss_bytes(edge.proc.pid());
    let peak = RssPeak::start(edge.proc.pid());

    let stop = Arc::new(AtomicBool::new(false));
    let health = tokio::spawn(slowest_health(edge.url("/healthz"), stop.clone()));
    // The attack as reported: 140,000 one-character blocks (3.6 MiB), refused from the
    // count of their objects before anything is built from them (or, over the key's share
    // of large bodies, before they are read).
    let tiny_blocks = messages_body(140_000, 1);
    assert!(tiny_blocks.len() > 3 * MIB as usize && tiny_blocks.len() < 4 * MIB as usize);
    let mut refused_as_invalid = 0;
    for (status, body) in send_all(&edge, n, tiny_blocks).await {
        match status {
            400 => {
                assert!(body.contains("JSON arrays and objects"), "{body}");
                refused_as_invalid += 1;
            }
            429 => assert!(body.contains("large_bodies_per_key"), "{body}"),
            _ => panic!("{status}: {body}"),
        }
    }
    assert!(refused_as_invalid >= 8, "{refused_as_invalid}");
    // Bodies of the same size that are served: 40,000 blocks, each decoded and translated.
    let costly = messages_body(40_000, 66);
    assert!(costly.len() > 3 * MIB as usize && costly.len() < 4 * MIB as usize);
    let answers = send_all(&edge, n, costly).await;
    let mut served = 0;
    for (status, body) in answers {
        match status {
            200 => served += 1,
            // Over the key's share of large bodies: refused at once, in Anthropic's shape.
            429 => assert!(
                body.contains("large_bodies_per_key") && body.contains("rate_limit_error"),
                "{body}"
            ),
            _ => panic!("{status}: {body}"),
        }
    }
    stop.store(true, Ordering::Relaxed);
    let slowest = health.await.unwrap();
    let grew = peak.peak().saturating_sub(baseline);
    eprintln!(
        "{n} costly bodies: {served} served, slowest /healthz {slowest:?}, edge RSS +{} MiB",
        grew / MIB
    );
    assert!(served >= 4, "only {served} of {n} served");
    assert!(
        slowest < Duration::from_secs(1),
        "/healthz took {slowest:?} while the bodies were decoded"
    );
    assert!(
        grew < 400 * MIB,
        "edge RSS grew by {} MiB for {n} bodies",
        grew / MIB
    );
    let after = generations(&edge).await;
    assert_eq!(before, after, "a node reconnected:\n{}", edge.proc.log());
    assert!(
        !edge.proc.has_line("heartbeat timeout"),
        "{}",
        edge.proc.log()
    );
    for node in &nodes {
        assert!(!node.has_line("heartbeat timeout"), "{}", node.log());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_costly_bodies_from_one_key_drop_no_node() {
    costly_bodies_leave_the_control_plane_alone(30, &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eighty_costly_bodies_on_two_threads_drop_no_node() {
    costly_bodies_leave_the_control_plane_alone(80, &["--threads", "2"]).await;
}

/// Sends `n` copies of a Messages `body` at once from the client key; every answer.
async fn send_all(edge: &EdgeProc, n: usize, body: bytes::Bytes) -> Vec<(u16, String)> {
    send_all_to(edge, "/v1/messages", n, body).await
}

/// Sends `n` copies of a Messages `body` to `path` at once from the client key.
async fn send_all_to(
    edge: &EdgeProc,
    path: &str,
    n: usize,
    body: bytes::Bytes,
) -> Vec<(u16, String)> {
    let mut requests = tokio::task::JoinSet::new();
    for _ in 0..n {
        let (url, body) = (edge.url(path), body.clone());
        requests.spawn(async move {
            let response = client()
                .post(url)
                .header("x-api-key", KEY)
                .header("anthropic-version", "2023-06-01")
                .header("content-type", "application/json")
                .body(body)
                .timeout(Duration::from_secs(300))
                .send()
                .await
                .expect("answered");
            let status = response.status().as_u16();
            (status, response.text().await.unwrap_or_default())
        });
    }
    let mut answers = Vec::new();
    while let Some(done) = requests.join_next().await {
        answers.push(done.unwrap());
    }
    answers
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_large_token_counts_from_one_key_drop_no_node() {
    let dir = tempdir();
    let mock = start_mock(&[]).await;
    let edge = start_edge(dir.path(), &config(&mock)).await;
    let nodes = three_nodes(&edge, dir.path()).await;
    let before = generations(&edge).await;
    let stop = Arc::new(AtomicBool::new(false));
    let health = tokio::spawn(slowest_health(edge.url("/healthz"), stop.clone()));
    // 3.6 MiB of 40,000 blocks: each counted one is decoded, translated and sent on.
    let costly = messages_body(40_000, 66);
    assert!(costly.len() > 3 * MIB as usize && costly.len() < 4 * MIB as usize);
    let mut counted = 0;
    for (status, body) in send_all_to(&edge, "/v1/messages/count_tokens", 100, costly).await {
        match status {
            200 => {
                let answer: Value = serde_json::from_str(&body).unwrap();
                assert!(answer["input_tokens"].as_u64().unwrap() > 600_000, "{body}");
                counted += 1;
            }
            // Over the key's share of large bodies, in Anthropic's shape.
            429 => assert!(
                body.contains("large_bodies_per_key") && body.contains("rate_limit_error"),
                "{body}"
            ),
            _ => panic!("{status}: {body}"),
        }
    }
    stop.store(true, Ordering::Relaxed);
    let slowest = health.await.unwrap();
    eprintln!("100 large token counts: {counted} counted, slowest /healthz {slowest:?}");
    assert!(counted >= 4, "only {counted} of 100 counted");
    assert!(
        slowest < Duration::from_secs(1),
        "/healthz took {slowest:?} while the counts were decoded"
    );
    let after = generations(&edge).await;
    assert_eq!(before, after, "a node reconnected:\n{}", edge.proc.log());
    for node in &nodes {
        assert!(!node.has_line("heartbeat timeout"), "{}", node.log());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_counts_are_admitted_by_the_keys_limits_and_recorded() {
    let dir = tempdir();
    let mock = start_mock(&[]).await;
    let base = mock.openai_base();
    let config = format!(
        r#"
auth:
  keys:
    - {{name: ops, role: admin, key: {TEST_API_KEY}}}
    - {{name: c, role: client, key: {KEY}, limits: {{requests_per_minute: 10, max_concurrent: 2}}}}
nodes:
  - {{id: n1, token: token-n1-0123456789, providers: [{{id: a, kind: openai_compat, base_url: "{base}", capacity: {{normal: 18}}}}, {{id: b, kind: openai_compat, base_url: "{base}", capacity: {{normal: 18}}}}]}}
model_groups:
  - {{name: m, members: [{{node: n1, provider: a}}, {{node: n1, provider: b}}]}}
"#
    );
    let edge = start_edge(dir.path(), &config).await;
    let _node = start_node("n1", dir.path(), &edge.nodes, "token-n1-0123456789", "");
    wait_ready(&edge, "n1").await;
    // A 1 MiB prompt, thirty times at once.
    let body = messages_body(1, 1 << 20);
    let answers = send_all_to(&edge, "/v1/messages/count_tokens", 30, body).await;
    let ok = answers.iter().filter(|(s, _)| *s == 200).count();
    for (status, body) in &answers {
        match status {
            200 => {}
            // The key's limits, or its share of large bodies (1 MiB is one).
            429 => assert!(
                body.contains("max_concurrent")
                    || body.contains("requests_per_minute")
                    || body.contains("large_bodies_per_key"),
                "{body}"
            ),
            _ => panic!("{status}: {body}"),
        }
    }
    assert!(
        (1..=10).contains(&ok),
        "{ok} of 30 counted under 10 a minute"
    );
    let stats = mock.stats().await;
    // Two at once at most (the key's max_concurrent), each asking one member once.
    assert!(
        stats["peak_tokenize_in_flight"].as_u64().unwrap() <= 2,
        "{stats}"
    );
    assert!(
        stats["tokenize_requests"].as_u64().unwrap() <= ok as u64,
        "{ok} counts made {stats}"
    );
    // Every call is in the ledger, as a count that billed nothing.
    let deadline = Instant::now() + Duration::from_secs(20);
    let records = loop {
        let body: Value = admin_get(&edge, "/admin/usage/records?limit=100")
            .await
            .json()
            .await
            .unwrap();
        let records = body["records"].as_array().unwrap().clone();
        if records.len() >= 30 || Instant::now() > deadline {
            break records;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(records.len(), 30, "{records:?}");
    for record in &records {
        assert_eq!(record["api"], "count_tokens", "{record}");
        assert_eq!(record["key"], "c", "{record}");
        assert_eq!(record["input_tokens"], 0, "{record}");
        assert!(record["est_input_tokens"].is_null(), "{record}");
    }
    let counted = records.iter().filter(|r| r["status"] == 200).count();
    assert_eq!(counted, ok, "{records:?}");
    assert!(
        records
            .iter()
            .filter(|r| r["status"] == 200)
            .all(|r| r["node"] == "n1"),
        "{records:?}"
    );
}

#[tokio::test]
async fn a_prompt_larger_than_what_is_left_of_a_day_s_budget_is_refused_before_dispatch() {
    let dir = tempdir();
    let mock = start_mock(&[]).await;
    let base = mock.openai_base();
    let config = format!(
        r#"
auth:
  keys:
    - {{name: ops, role: admin, key: {TEST_API_KEY}}}
    - {{name: c, role: client, key: {KEY}, limits: {{tokens_per_day: 100}}}}
nodes:
  - {{id: n1, token: token-n1-0123456789, providers: [{{id: oa, kind: openai_compat, base_url: "{base}"}}]}}
model_groups:
  - {{name: m, members: [{{node: n1, provider: oa}}]}}
"#
    );
    let edge = start_edge(dir.path(), &config).await;
    let _node = start_node("n1", dir.path(), &edge.nodes, "token-n1-0123456789", "");
    wait_ready(&edge, "n1").await;
    let chat = |content: String| {
        client()
            .post(edge.url("/v1/chat/completions"))
            .bearer_auth(KEY)
            .json(&json!({"model": "m", "max_tokens": 4,
                "messages": [{"role": "user", "content": content}]}))
            .send()
    };
    let small = chat("hi".into()).await.unwrap();
    assert_eq!(small.status(), 200);
    // About 25,000 tokens of prompt against what is left of 100: refused, never sent.
    let before = mock.stats().await["requests"].as_u64().unwrap();
    let large = chat("word ".repeat(20_000)).await.unwrap();
    assert_eq!(large.status(), 429);
    let body: Value = large.json().await.unwrap();
    assert_eq!(body["error"]["code"], "tokens_per_day_exceeded", "{body}");
    assert_eq!(mock.stats().await["requests"].as_u64().unwrap(), before);
    // A small one still fits.
    assert_eq!(chat("hi".into()).await.unwrap().status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_run_bodies_and_many_medium_bodies_from_one_key_stay_under_its_share() {
    let dir = tempdir();
    let mock = start_mock(&[]).await;
    let edge = start_edge(dir.path(), &config(&mock)).await;
    let _node = start_node("n1", dir.path(), &edge.nodes, "token-n1-0123456789", "");
    wait_ready(&edge, "n1").await;
    let stop = Arc::new(AtomicBool::new(false));
    let health = tokio::spawn(slowest_health(edge.url("/healthz"), stop.clone()));
    // 40 native runs of 3.6 MiB each at once: at most the key's share of large bodies is
    // read and decoded at a time, the rest are refused at once.
    let input = "a".repeat(3_600_000);
    let run = bytes::Bytes::from(
        serde_json::to_vec(&json!({"node": "n1", "adapter": "oa", "target": "m", "input": input}))
            .unwrap(),
    );
    let mut refused = 0;
    let mut runs = tokio::task::JoinSet::new();
    for _ in 0..40 {
        let (url, run) = (edge.url("/v1/runs"), run.clone());
        runs.spawn(async move {
            let sent = client()
                .post(url)
                .bearer_auth(KEY)
                .header("content-type", "application/json")
                .body(run)
                .timeout(Duration::from_secs(300))
                .send()
                .await;
            match sent {
                Ok(response) => {
                    let status = response.status().as_u16();
                    (status, response.text().await.unwrap_or_default())
                }
                Err(e) => (0, e.to_string()),
            }
        });
    }
    let mut answers = Vec::new();
    while let Some(done) = runs.join_next().await {
        answers.push(done.unwrap());
    }
    for (status, body) in answers {
        if status == 0 {
            panic!("{body}\n{}", edge.proc.log());
        }
        match status {
            200 => {}
            429 => {
                assert!(body.contains("large_bodies_per_key"), "{body}");
                refused += 1;
            }
            _ => panic!("{status}: {body}"),
        }
    }
    // A share of 8 at once (a run that ended early makes room for one more).
    assert!(refused >= 20, "{refused} of 40 refused over a share of 8");
    // Bodies just under the large-body size (decoded on a worker, not the event loop):
    // 40 at once, 5 rounds.
    let medium = messages_body(5_000, 22);
    assert!(
        medium.len() > 200 * 1024 && medium.len() < 256 * 1024,
        "{}",
        medium.len()
    );
    for _ in 0..5 {
        for (status, body) in send_all(&edge, 40, medium.clone()).await {
            assert!(status == 200 || status == 400, "{status}: {body}");
        }
    }
    stop.store(true, Ordering::Relaxed);
    let slowest = health.await.unwrap();
    eprintln!("large runs and medium bodies: slowest /healthz {slowest:?}");
    assert!(
        slowest < Duration::from_secs(1),
        "/healthz took {slowest:?}"
    );
}
