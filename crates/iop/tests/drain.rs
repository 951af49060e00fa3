//! SIGTERM drains the edge before it stops: `/readyz` turns 503 and new client requests
//! get a 503 saying so, while the streams in progress run to their end — bounded by
//! `shutdown.grace_sec`, and cut short by a second signal. Real processes; every wait is
//! on what the edge logs or answers, with wide bounds.

mod common;

use std::time::Duration;

use common::*;
use nix::sys::signal::Signal;
use serde_json::{Value, json};

fn config(grace_sec: u64) -> String {
    format!(
        r#"
shutdown: {{grace_sec: {grace_sec}}}
nodes:
  - id: n1
    token: token-n1-0123456789
    providers:
      - {{id: m, kind: mock, capacity: {{normal: 4, long: 0}}, mock: {{tokens: 50, token_delay_ms: 100}}}}
model_groups:
  - {{name: slow, members: [{{node: n1, provider: m}}]}}
  - {{name: hang, members: [{{node: n1, provider: m, model: mock-hang}}]}}
"#
    )
}

/// A streamed chat to `model` whose first chunk has arrived.
async fn stream_started(edge: &EdgeProc, model: &str) -> (reqwest::Response, String) {
    let mut response = client()
        .post(edge.url("/v1/chat/completions"))
        .json(&json!({"model": model, "stream": true,
                      "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let mut seen = String::new();
    read_until(&mut response, &mut seen, |s| s.contains("data: ")).await;
    (response, seen)
}

/// Waits (bounded) until `/readyz` answers 503 with `draining`.
async fn wait_draining(edge: &EdgeProc) -> Value {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let response = client().get(edge.url("/readyz")).send().await.unwrap();
        if response.status() == 503 {
            let body: Value = response.json().await.unwrap();
            if body["draining"] == true {
                return body;
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "/readyz never said draining:\n{}",
            edge.proc.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_stream_in_progress_finishes_while_new_requests_are_refused() {
    let dir = tempdir();
    let mut edge = start_edge(dir.path(), &config(60)).await;
    let _node = start_node("n1", dir.path(), &edge.nodes, "token-n1-0123456789", "");
    wait_ready(&edge, "n1").await;
    let (mut stream, mut seen) = stream_started(&edge, "slow").await;

    edge.proc.signal(Signal::SIGTERM);
    let ready = wait_draining(&edge).await;
    assert_eq!(ready["ready"], false, "{ready}");
    // The admin API still answers, and says what the edge waits for.
    let s = status(&edge).await;
    assert_eq!(
        (&s["draining"], &s["requests_in_progress"]),
        (&json!(true), &json!(1)),
        "{s}"
    );

    // A new request is refused in its API's shape, with a hint to send it again.
    let refused = client()
        .post(edge.url("/v1/chat/completions"))
        .json(&json!({"model": "slow", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 503);
    assert_eq!(refused.headers()["x-iop-error"], "unavailable");
    assert_eq!(refused.headers()["retry-after"], "1");
    let body: Value = refused.json().await.unwrap();
    assert_eq!(body["error"]["code"], "edge_draining", "{body}");
    let anthropic = client()
        .post(edge.url("/v1/messages"))
        .json(&json!({"model": "slow", "max_tokens": 8,
                      "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(anthropic.status(), 503);
    let body: Value = anthropic.json().await.unwrap();
    assert_eq!(body["type"], "error", "{body}");

    // Ending work is not refused: a cancel reaches the runs API (which knows no such run).
    let cancel = client()
        .post(edge.url("/v1/runs/no-such-run/cancel"))
        .send()
        .await
        .unwrap();
    assert_eq!(cancel.status(), 404);

    // The stream that was running ends as it would have: every token, then [DONE].
    read_until(&mut stream, &mut seen, |s| s.contains("data: [DONE]")).await;
    let tokens = seen.lines().filter(|l| l.contains("\"content\":")).count();
    assert!(tokens >= 50, "{tokens} tokens:\n{seen}");
    let status = edge.proc.wait_exit(Duration::from_secs(60)).await;
    assert!(status.success(), "{}", edge.proc.log());
    assert!(edge.proc.log().contains("drained"), "{}", edge.proc.log());
}

#[tokio::test]
async fn the_grace_period_bounds_the_drain() {
    let dir = tempdir();
    let mut edge = start_edge(dir.path(), &config(1)).await;
    let _node = start_node("n1", dir.path(), &edge.nodes, "token-n1-0123456789", "");
    wait_ready(&edge, "n1").await;
    let (_stream, _) = stream_started(&edge, "hang").await;
    edge.proc.signal(Signal::SIGTERM);
    // Far more than the grace period, far less than a stream that never ends.
    let status = edge.proc.wait_exit(Duration::from_secs(40)).await;
    assert!(status.success(), "{}", edge.proc.log());
    assert!(
        edge.proc
            .log()
            .contains("still in progress after 1s (shutdown.grace_sec)"),
        "{}",
        edge.proc.log()
    );
}

#[tokio::test]
async fn a_second_signal_stops_the_drain_at_once() {
    let dir = tempdir();
    let mut edge = start_edge(dir.path(), &config(3600)).await;
    let _node = start_node("n1", dir.path(), &edge.nodes, "token-n1-0123456789", "");
    wait_ready(&edge, "n1").await;
    let (_stream, _) = stream_started(&edge, "hang").await;
    edge.proc.signal(Signal::SIGTERM);
    edge.proc
        .wait_line("draining: refusing new requests", Duration::from_secs(20))
        .await;
    edge.proc.signal(Signal::SIGTERM);
    let status = edge.proc.wait_exit(Duration::from_secs(40)).await;
    assert!(status.success(), "{}", edge.proc.log());
    assert!(
        edge.proc.log().contains("stopping at once (second signal)"),
        "{}",
        edge.proc.log()
    );
}
