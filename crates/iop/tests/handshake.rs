//! Registration, readiness, heartbeat and framing faults with real `iop edge` and
//! `iop node` processes on loopback.

mod common;

use std::time::{Duration, Instant};

use common::*;
use nix::sys::signal::Signal;

const CONFIG: &str = r#"
nodes:
  - id: n1
    token: token-one-0123456789
    providers:
      - {id: mock, kind: mock, capacity: {normal: 2, long: 1}}
  - id: n2
    token: token-two-0123456789
    providers:
      - {id: mock, kind: mock}
"#;

fn provider<'a>(status: &'a serde_json::Value, node: &str, id: &str) -> &'a serde_json::Value {
    node_status(status, node)["providers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["id"] == id)
        .unwrap()
}

#[tokio::test]
async fn register_then_ready_shows_in_status_and_offline_nodes_stay_listed() {
    let dir = tempdir();
    let edge = start_edge(dir.path(), CONFIG).await;
    let s = status(&edge).await;
    for id in ["n1", "n2"] {
        let n = node_status(&s, id);
        assert_eq!(n["connected"], false, "{s}");
        let p = provider(&s, id, "mock");
        assert_eq!(p["status"], "unavailable");
        assert_eq!(p["health"], "offline");
        assert_eq!(p["capacity"], serde_json::json!({"normal": 0, "long": 0}));
        assert_eq!(p["in_flight"], serde_json::json!({"normal": 0, "long": 0}));
    }
    let _node = start_node("n1", dir.path(), &edge.nodes, "token-one-0123456789", "");
    wait_ready(&edge, "n1").await;
    // The mock needs no probe: the node reports it healthy once it is ready.
    let s = status(&edge).await;
    let p = provider(&s, "n1", "mock");
    assert_eq!(p["status"], "available", "{s}");
    wait_status(&edge, Duration::from_secs(5), "n1/mock healthy", |s| {
        provider(s, "n1", "mock")["health"] == "healthy"
    })
    .await;
    assert_eq!(p["capacity"], serde_json::json!({"normal": 2, "long": 1}));
    assert_eq!(node_status(&s, "n2")["connected"], false);
    edge.proc
        .wait_line("node ready", Duration::from_secs(5))
        .await;
    // The healthz and readyz probes answer.
    let health = client().get(edge.url("/healthz")).send().await.unwrap();
    assert_eq!(health.status(), 200);
    let ready = client().get(edge.url("/readyz")).send().await.unwrap();
    assert_eq!(ready.status(), 200);
}

#[tokio::test]
async fn a_wrong_token_is_fatal_for_the_node_and_an_event_on_the_edge() {
    let dir = tempdir();
    let edge = start_edge(dir.path(), CONFIG).await;
    let mut events = client()
        .get(edge.url("/admin/events"))
        .send()
        .await
        .unwrap();
    let mut node = start_node("intruder", dir.path(), &edge.nodes, "not-a-token", "");
    let status = node.wait_exit(Duration::from_secs(15)).await;
    assert!(!status.success(), "node must exit non-zero");
    assert_eq!(status.code(), Some(2), "{status:?}: {}", node.log());
    assert!(
        node.has_line("rejected this node's token"),
        "{}",
        node.log()
    );
    edge.proc
        .wait_line("node registration rejected", Duration::from_secs(5))
        .await;
    assert!(edge.proc.has_line("unknown node token"));
    let mut seen = String::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    while !seen.contains("\"kind\":\"rejected\"") {
        assert!(Instant::now() < deadline, "no rejected event; got {seen}");
        if let Ok(Ok(Some(chunk))) =
            tokio::time::timeout(Duration::from_secs(1), events.chunk()).await
        {
            seen.push_str(&String::from_utf8_lossy(&chunk));
        }
    }
    assert!(seen.contains("unknown node token"), "{seen}");
}

#[tokio::test]
async fn a_second_connection_for_a_live_node_is_rejected_as_duplicate() {
    let dir = tempdir();
    let edge = start_edge(dir.path(), CONFIG).await;
    let _first = start_node("first", dir.path(), &edge.nodes, "token-one-0123456789", "");
    wait_ready(&edge, "n1").await;
    let mut second = start_node(
        "second",
        dir.path(),
        &edge.nodes,
        "token-one-0123456789",
        "reconnect: {max_attempts: 1, interval_sec: 0.1}",
    );
    let status = second.wait_exit(Duration::from_secs(15)).await;
    assert!(!status.success());
    assert!(second.has_line("duplicate connection"), "{}", second.log());
    edge.proc
        .wait_line("duplicate connection", Duration::from_secs(5))
        .await;
    // The first owner is untouched.
    let s = common::status(&edge).await;
    assert_eq!(node_status(&s, "n1")["ready"], true, "{s}");
}

#[tokio::test]
async fn kill_9_of_the_node_shows_disconnected_before_a_heartbeat_could_notice() {
    let dir = tempdir();
    let edge = start_edge(dir.path(), CONFIG).await;
    let mut node = start_node("n1", dir.path(), &edge.nodes, "token-one-0123456789", "");
    wait_ready(&edge, "n1").await;
    node.kill9();
    // The closed socket ends the connection at once; the heartbeat would take 5 s.
    let took = wait_status(&edge, Duration::from_secs(4), "n1 disconnected", |s| {
        node_status(s, "n1")["connected"] == false
    })
    .await;
    assert!(took < Duration::from_secs(4), "took {took:?}");
    let s = common::status(&edge).await;
    assert_eq!(provider(&s, "n1", "mock")["health"], "offline");
}

#[tokio::test]
async fn a_stopped_node_is_detected_by_heartbeat_timeout() {
    let dir = tempdir();
    let edge = start_edge(dir.path(), CONFIG).await;
    let node = start_node("n1", dir.path(), &edge.nodes, "token-one-0123456789", "");
    wait_ready(&edge, "n1").await;
    node.signal(Signal::SIGSTOP);
    let took = wait_status(&edge, Duration::from_secs(6), "n1 disconnected", |s| {
        node_status(s, "n1")["connected"] == false
    })
    .await;
    node.signal(Signal::SIGCONT);
    assert!(took <= Duration::from_secs(6), "took {took:?}");
    assert!(
        took >= Duration::from_secs(3),
        "a silent peer is not a closed one: {took:?}"
    );
    edge.proc
        .wait_line("heartbeat timeout", Duration::from_secs(2))
        .await;
}

/// Sends raw bytes inside TLS on a fresh node connection and returns whether the edge
/// closed it.
async fn edge_closes_after(addr: &str, bytes: &[u8]) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut tls = common::tls::raw_tls_connect(addr).await;
    tls.write_all(bytes).await.unwrap();
    tls.flush().await.unwrap();
    let mut buf = [0u8; 64];
    match tokio::time::timeout(Duration::from_secs(5), tls.read(&mut buf)).await {
        Ok(Ok(0)) => true,
        Ok(Err(e)) => matches!(
            e.kind(),
            std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::UnexpectedEof
        ),
        Ok(Ok(_)) | Err(_) => false,
    }
}

#[tokio::test]
async fn garbage_and_oversized_frames_close_only_their_connection() {
    let dir = tempdir();
    let edge = start_edge(dir.path(), CONFIG).await;
    let _node = start_node("n1", dir.path(), &edge.nodes, "token-one-0123456789", "");
    wait_ready(&edge, "n1").await;

    let mut garbage = 6u32.to_be_bytes().to_vec();
    garbage.extend_from_slice(&[0xff; 6]);
    assert!(
        edge_closes_after(&edge.nodes, &garbage).await,
        "garbage frame must close the connection"
    );
    edge.proc
        .wait_line("undecodable frame", Duration::from_secs(5))
        .await;

    let oversized = (64u32 * 1024 * 1024).to_be_bytes();
    assert!(
        edge_closes_after(&edge.nodes, &oversized).await,
        "oversized frame must close the connection"
    );
    edge.proc
        .wait_line("exceeds the", Duration::from_secs(5))
        .await;

    // The registered node kept its connection and still serves runs.
    let s = common::status(&edge).await;
    assert_eq!(node_status(&s, "n1")["ready"], true, "{s}");
    let body = client()
        .post(edge.url("/v1/runs"))
        .json(&serde_json::json!({"node": "n1", "adapter": "mock", "target": "m", "input": "hi"}))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(body.contains("event: complete"), "{body}");
}

#[tokio::test]
async fn sigterm_stops_the_edge_promptly_even_with_open_streams() {
    let dir = tempdir();
    let mut edge = start_edge(dir.path(), CONFIG).await;
    let _events = client()
        .get(edge.url("/admin/events"))
        .send()
        .await
        .unwrap();
    let started = std::time::Instant::now();
    edge.proc.signal(Signal::SIGTERM);
    let status = edge.proc.wait_exit(Duration::from_secs(8)).await;
    assert!(status.success(), "{}", edge.proc.log());
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "took {:?}",
        started.elapsed()
    );
}
