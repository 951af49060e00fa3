//! The control plane under data-plane load: one client key sending many large, costly
//! bodies at once must not starve the node links (heartbeats) or the health probes.

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

/// Starts three nodes, sends `n` costly bodies at once from one key while probing
/// `/healthz`, and checks that no node was dropped.
async fn costly_bodies_leave_the_control_plane_alone(n: usize, edge_args: &[&str]) {
    let dir = tempdir();
    let mock = start_mock(&[]).await;
    let edge = start_edge_with(dir.path(), &config(&mock), edge_args).await;
    let mut nodes = Vec::new();
    for i in 1..=3 {
        let id = format!("n{i}");
        let token = format!("token-n{i}-0123456789");
        nodes.push(start_node(&id, dir.path(), &edge.nodes, &token, ""));
    }
    for i in 1..=3 {
        wait_ready(&edge, &format!("n{i}")).await;
    }
    let generations = |s: &Value| {
        (1..=3)
            .map(|i| node_status(s, &format!("n{i}"))["generation"].clone())
            .collect::<Vec<_>>()
    };
    let before = generations(&status(&edge).await);
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
    let after = generations(&status(&edge).await);
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
    let mut requests = tokio::task::JoinSet::new();
    for _ in 0..n {
        let (url, body) = (edge.url("/v1/messages"), body.clone());
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
