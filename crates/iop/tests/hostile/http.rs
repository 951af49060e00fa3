//! The edge's HTTP side against clients that ignore the rules, with real processes on
//! loopback: heads that never finish and bodies that never end, a full connection table,
//! random model names, API keys reaching for what is not theirs and guessing, malformed
//! requests, answers that never end and clients that stop reading.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use reqwest::StatusCode;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::common::*;

const NODE_TOKEN: &str = "node-token-0123456789";
const ALICE: &str = "alice-key-0123456789";
const BOB: &str = "bob-key-0123456789ab";

/// A node with the built-in mock adapter serving the model group `mock`.
fn mock_config(limits: &str, auth: &str) -> String {
    format!(
        r#"
{auth}
limits: {limits}
nodes:
  - id: n1
    token: {NODE_TOKEN}
    providers:
      - {{id: mock, kind: mock, capacity: {{normal: 8}}, mock: {{tokens: 4}}}}
model_groups:
  - {{name: mock, members: [{{node: n1, provider: mock}}]}}
"#
    )
}

async fn edge_with_node(dir: &std::path::Path, config: &str) -> (EdgeProc, Proc) {
    let edge = start_edge(dir, config).await;
    let node = start_node("n1", dir, &edge.nodes, NODE_TOKEN, "");
    wait_ready(&edge, "n1").await;
    (edge, node)
}

fn chat_body(model: &str) -> Value {
    json!({"model": model, "messages": [{"role": "user", "content": "hi"}]})
}

/// Resident memory of a process, in bytes.
fn rss_bytes(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap();
    kb * 1024
}

/// What became of one hostile connection.
#[derive(Debug, Clone)]
struct Closed {
    /// From connected to closed by the edge.
    lived: Duration,
    /// What the edge wrote before closing.
    answer: String,
}

/// Opens a connection, writes `head`, then `drip` every 200 ms until the edge closes it;
/// again and again until `stop`. Every closed connection is recorded.
async fn keep_dripping(
    addr: SocketAddr,
    head: &'static [u8],
    drip: &'static [u8],
    stop: Arc<AtomicBool>,
    closed: Arc<std::sync::Mutex<Vec<Closed>>>,
) {
    while !stop.load(Ordering::Relaxed) {
        let Ok(stream) = TcpStream::connect(addr).await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let opened = Instant::now();
        let (mut read, mut write) = stream.into_split();
        let reader = async move {
            let mut answer = Vec::new();
            let mut buf = [0u8; 1024];
            while let Ok(n) = read.read(&mut buf).await {
                if n == 0 {
                    break;
                }
                answer.extend_from_slice(&buf[..n]);
            }
            answer
        };
        let writer = async move {
            if write.write_all(head).await.is_ok() {
                loop {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    if write.write_all(drip).await.is_err() {
                        break;
                    }
                }
            }
            std::future::pending::<()>().await
        };
        let answer = tokio::select! {
            answer = reader => answer,
            _ = writer => unreachable!(),
        };
        closed.lock().unwrap().push(Closed {
            lived: opened.elapsed(),
            answer: String::from_utf8_lossy(&answer).into_owned(),
        });
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_heads_and_endless_bodies_are_cut_while_real_clients_are_served() {
    iop_edge::fdlimit::raise_open_files_limit().unwrap();
    let dir = tempdir();
    // A long idle timeout, so only the header and body deadlines can close these.
    let limits = "{http: {header_timeout_sec: 1, body_timeout_sec: 2, idle_timeout_sec: 30, max_connections: 5000, max_connections_per_address: 5000}}";
    let (edge, _node) = edge_with_node(dir.path(), &mock_config(limits, "")).await;
    let addr: SocketAddr = edge.http.parse().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let slow_heads = Arc::new(std::sync::Mutex::new(Vec::new()));
    let endless_bodies = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut attackers = tokio::task::JoinSet::new();
    for _ in 0..1000 {
        attackers.spawn(keep_dripping(
            addr,
            b"GET /healthz HTTP/1.1\r\nHost: edge\r\n",
            b"X-Slow: 1\r\n",
            stop.clone(),
            slow_heads.clone(),
        ));
    }
    for _ in 0..200 {
        attackers.spawn(keep_dripping(
            addr,
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: edge\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n1\r\n{\r\n",
            b"1\r\n \r\n",
            stop.clone(),
            endless_bodies.clone(),
        ));
    }
    // Every attacker has been cut off at least once and is back at it.
    let deadline = Instant::now() + Duration::from_secs(120);
    while slow_heads.lock().unwrap().len() < 1000 || endless_bodies.lock().unwrap().len() < 200 {
        assert!(
            Instant::now() < deadline,
            "hostile connections not closed: {} slow heads, {} endless bodies closed\n{}",
            slow_heads.lock().unwrap().len(),
            endless_bodies.lock().unwrap().len(),
            edge.proc.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Under the same attack, a real client is answered promptly.
    let c = client();
    for _ in 0..5 {
        let started = Instant::now();
        let response = c
            .post(edge.url("/v1/chat/completions"))
            .json(&chat_body("mock"))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let body: Value = response.json().await.unwrap();
        let took = started.elapsed();
        assert_eq!(body["object"], "chat.completion", "{body}");
        assert!(
            took < Duration::from_secs(1),
            "a real request took {took:?}"
        );
    }
    stop.store(true, Ordering::Relaxed);
    let drained = tokio::time::timeout(Duration::from_secs(60), async {
        while attackers.join_next().await.is_some() {}
    })
    .await;
    assert!(drained.is_ok(), "attackers still connected after the stop");
    // Each was closed by its deadline (1 s for the head, 2 s for the body), with a wide
    // margin for a busy machine; a slow head gets no answer, an endless body a 408.
    let margin = Duration::from_secs(10);
    for c in slow_heads.lock().unwrap().iter() {
        assert!(c.lived < Duration::from_secs(1) + margin, "{c:?}");
        assert!(c.answer.is_empty(), "{c:?}");
    }
    for c in endless_bodies.lock().unwrap().iter() {
        assert!(c.lived < Duration::from_secs(2) + margin, "{c:?}");
        assert!(c.answer.starts_with("HTTP/1.1 408"), "{c:?}");
        assert!(c.answer.contains("body_timeout_sec"), "{c:?}");
    }
}

#[tokio::test]
async fn an_idle_keep_alive_connection_is_closed_at_the_idle_timeout() {
    let dir = tempdir();
    let limits = "{http: {idle_timeout_sec: 1, header_timeout_sec: 30}}";
    let edge = start_edge(dir.path(), &mock_config(limits, "")).await;
    let mut socket = TcpStream::connect(edge.http.as_str()).await.unwrap();
    socket
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: edge\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    let mut buf = [0u8; 1024];
    let started = loop {
        let n = socket.read(&mut buf).await.unwrap();
        assert!(n > 0, "closed before answering");
        answer.extend_from_slice(&buf[..n]);
        if answer.ends_with(b"}") {
            break Instant::now();
        }
    };
    assert!(answer.starts_with(b"HTTP/1.1 200"));
    // Kept alive, then closed for idling (the head deadline is 30 s away).
    let rest = tokio::time::timeout(Duration::from_secs(15), socket.read(&mut buf))
        .await
        .expect("the idle connection was not closed");
    assert!(matches!(rest, Ok(0) | Err(_)), "{rest:?}");
    assert!(started.elapsed() >= Duration::from_millis(900));
}

#[tokio::test]
async fn an_oversized_request_head_is_refused() {
    let dir = tempdir();
    let edge = start_edge(dir.path(), &mock_config("{}", "")).await;
    let mut socket = TcpStream::connect(edge.http.as_str()).await.unwrap();
    let head = format!(
        "GET /healthz HTTP/1.1\r\nHost: edge\r\nX-Big: {}\r\n\r\n",
        "a".repeat(100 * 1024)
    );
    // The edge may stop reading before the whole head is written.
    let _ = socket.write_all(head.as_bytes()).await;
    let mut answer = String::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), socket.read_to_string(&mut answer)).await;
    assert!(answer.starts_with("HTTP/1.1 431"), "{answer}");
    // The edge serves on.
    assert_eq!(
        client()
            .get(edge.url("/healthz"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_address_holding_thousands_of_connections_locks_no_one_else_out() {
    iop_edge::fdlimit::raise_open_files_limit().unwrap();
    let dir = tempdir();
    // The default caps: 4096 connections, 1024 from one address.
    let (edge, _node) = edge_with_node(dir.path(), &mock_config("{}", "")).await;
    let addr = edge.http.clone();
    // 4,500 half-open connections from one address, each waiting to send its request.
    let mut held = Vec::new();
    let mut refused = 0;
    for _ in 0..4500 {
        let stream = crate::common::node_wire::connect_from("127.0.0.2", &addr)
            .await
            .unwrap();
        held.push(stream);
    }
    // Over the address's cap, the edge answers 503 at once and closes.
    for stream in held.iter_mut().skip(1024) {
        let mut answer = String::new();
        tokio::time::timeout(Duration::from_secs(10), stream.read_to_string(&mut answer))
            .await
            .expect("a connection over the address cap was not closed")
            .ok();
        assert!(answer.contains("max_connections_per_address"), "{answer}");
        refused += 1;
    }
    assert_eq!(refused, 4500 - 1024);
    // Another address is served at once, while those 1024 are still open.
    for _ in 0..10 {
        let response = client()
            .post(edge.url("/v1/chat/completions"))
            .json(&chat_body("mock"))
            .timeout(Duration::from_secs(10))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
    }
    edge.proc
        .wait_line(
            "limits.http.max_connections_per_address",
            Duration::from_secs(5),
        )
        .await;
    drop(held);
}

#[tokio::test]
async fn a_full_connection_table_refuses_at_once_and_does_not_starve_nodes() {
    let dir = tempdir();
    let limits = "{http: {max_connections: 20, header_timeout_sec: 60, body_timeout_sec: 60}}";
    let edge = start_edge(dir.path(), &mock_config(limits, "")).await;
    let addr: SocketAddr = edge.http.parse().unwrap();
    // Twenty requests whose bodies never come: connections in the middle of a request,
    // which a full table never closes to make room.
    let mut held = Vec::new();
    for _ in 0..20 {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream
            .write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: edge\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n")
            .await
            .unwrap();
        held.push(stream);
    }
    // Each head is read as soon as it is accepted; give the edge a moment to parse them.
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Connections are accepted in order: the 21st finds the table full.
    let mut extra = TcpStream::connect(addr).await.unwrap();
    let mut answer = String::new();
    tokio::time::timeout(Duration::from_secs(10), extra.read_to_string(&mut answer))
        .await
        .expect("the refused connection was not closed")
        .ok();
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(answer.contains("max_connections"), "{answer}");
    // A node connects and becomes ready while every HTTP slot is taken.
    let _node = start_node("n1", dir.path(), &edge.nodes, NODE_TOKEN, "");
    edge.proc
        .wait_line("node ready", Duration::from_secs(20))
        .await;
    edge.proc
        .wait_line("HTTP connection cap reached", Duration::from_secs(10))
        .await;
    drop(held);
    // The slots come back: a real request is served.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let response = client()
            .post(edge.url("/v1/chat/completions"))
            .json(&chat_body("mock"))
            .send()
            .await;
        if let Ok(r) = response
            && r.status() == 200
        {
            break;
        }
        assert!(Instant::now() < deadline, "slots never returned");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// From `source`, keeps one connection open with half a request head, dripping a header
/// line every 200 ms, opened again as soon as the edge closes it, until `stop`; counts
/// the connections the edge closed.
async fn hold_half_heads(
    source: String,
    addr: String,
    stop: Arc<AtomicBool>,
    closed: Arc<std::sync::atomic::AtomicU64>,
) {
    while !stop.load(Ordering::Relaxed) {
        let Ok(mut stream) = crate::common::node_wire::connect_from(&source, &addr).await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        if stream
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: edge\r\n")
            .await
            .is_err()
        {
            continue;
        }
        let mut buf = [0u8; 256];
        loop {
            if stop.load(Ordering::Relaxed) {
                return;
            }
            tokio::select! {
                read = stream.read(&mut buf) => {
                    if matches!(read, Ok(0) | Err(_)) {
                        break;
                    }
                }
                _ = tokio::time::sleep(Duration::from_millis(200)) => {
                    if stream.write_all(b"X-Slow: 1\r\n").await.is_err() {
                        break;
                    }
                }
            }
        }
        closed.fetch_add(1, Ordering::Relaxed);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_prefixes_holding_half_heads_leave_room_for_a_real_client() {
    iop_edge::fdlimit::raise_open_files_limit().unwrap();
    let dir = tempdir();
    // A table of 3,000; 18 networks (/24s) × 300 sockets that sent half a request head
    // and come back as soon as they are closed.
    let limits = "{http: {max_connections: 3000}}";
    let (edge, _node) = edge_with_node(dir.path(), &mock_config(limits, "")).await;
    let stop = Arc::new(AtomicBool::new(false));
    let closed = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut attackers = tokio::task::JoinSet::new();
    for prefix in 1..=18 {
        for _ in 0..300 {
            attackers.spawn(hold_half_heads(
                format!("127.0.{prefix}.1"),
                edge.http.clone(),
                stop.clone(),
                closed.clone(),
            ));
        }
    }
    // The table is full once newcomers start taking the places of half heads.
    edge.proc
        .wait_line("HTTP connection table full", Duration::from_secs(120))
        .await;
    // A real client, a new connection for each request, is served.
    let fresh = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap();
    let mut served = 0;
    let tries = 40;
    for i in 0..tries {
        let request = if i % 2 == 0 {
            fresh.get(edge.url("/healthz"))
        } else {
            fresh
                .post(edge.url("/v1/chat/completions"))
                .json(&chat_body("mock"))
        };
        if let Ok(response) = request.send().await
            && response.status() == 200
        {
            served += 1;
        }
    }
    stop.store(true, Ordering::Relaxed);
    let drained = tokio::time::timeout(Duration::from_secs(60), async {
        while attackers.join_next().await.is_some() {}
    })
    .await;
    assert!(drained.is_ok(), "attackers still connected after the stop");
    eprintln!(
        "half heads from 18 networks: {served} of {tries} real requests served, {} attacking connections closed",
        closed.load(Ordering::Relaxed)
    );
    assert!(
        served * 100 >= tries * 95,
        "{served} of {tries} served\n{}",
        edge.proc.log()
    );
}

/// The `/metrics` lines that are series (not comments).
async fn metric_series(edge: &EdgeProc) -> usize {
    get_text(&edge.url("/metrics"))
        .await
        .lines()
        .filter(|l| !l.starts_with('#'))
        .count()
}

#[tokio::test]
async fn random_model_names_leave_metrics_the_same_size() {
    let dir = tempdir();
    let (edge, _node) = edge_with_node(dir.path(), &mock_config("{}", "")).await;
    let c = client();
    let ok = c
        .post(edge.url("/v1/chat/completions"))
        .json(&chat_body("mock"))
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
    let before = metric_series(&edge).await;
    let url = edge.url("/v1/chat/completions");
    let requests = futures::stream::iter(0..3000).map(|i| {
        let c = c.clone();
        let url = url.clone();
        async move {
            let model = format!("random-{i}-{}", uuid_like(i));
            let r = c.post(&url).json(&chat_body(&model)).send().await.unwrap();
            assert_eq!(r.status(), 404);
        }
    });
    requests.buffer_unordered(32).collect::<Vec<_>>().await;
    let after = metric_series(&edge).await;
    let text = get_text(&edge.url("/metrics")).await;
    assert!(
        !text.contains("random-"),
        "a client-chosen name became a label"
    );
    assert!(text.contains("model_group=\"(unknown)\""), "{text}");
    assert!(
        after <= before + 3,
        "{before} series before, {after} after:\n{text}"
    );
}

fn uuid_like(i: u64) -> String {
    format!("{:x}", i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

const SESSION: &str = r#"n=0
last=""
while IFS= read -r line; do
  if [ "$line" = "<<<IOP-END>>>" ]; then
    n=$((n+1))
    echo "turn $n: $last from $IOP_SESSION_ID"
    echo "<<<IOP-END>>>"
  else
    last="$line"
  fi
done
"#;

/// An edge with an admin key, two client keys (bob only for `small`), and a node with a
/// mock adapter (groups `big` and `small`) and a CLI session program.
async fn keyed_setup(dir: &std::path::Path) -> (EdgeProc, Proc) {
    std::fs::write(dir.join("session.sh"), SESSION).unwrap();
    let config = format!(
        r#"
auth:
  keys:
    - {{name: ops, role: admin, key: {TEST_API_KEY}}}
    - {{name: alice, role: client, key: {ALICE}}}
    - {{name: bob, role: client, key: {BOB}, models: [small]}}
nodes:
  - id: n1
    token: {NODE_TOKEN}
    providers:
      - {{id: mock, kind: mock, mock: {{tokens: 4}}}}
      - {{id: slow, kind: mock, mock: {{tokens: 1000, token_delay_ms: 50}}}}
      - {{id: chat, kind: cli, cli: {{argv: [sh, "{d}/session.sh"]}}}}
model_groups:
  - {{name: big, members: [{{node: n1, provider: mock}}]}}
  - {{name: small, members: [{{node: n1, provider: mock}}]}}
"#,
        d = dir.display()
    );
    edge_with_node(dir, &config).await
}

/// Status and OpenAI-shaped error body of a request.
async fn send(request: reqwest::RequestBuilder) -> (StatusCode, Value) {
    let response = request.send().await.unwrap();
    let status = response.status();
    let text = response.text().await.unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

#[tokio::test]
async fn client_keys_reach_only_their_own_runs_and_sessions_and_no_admin_surface() {
    let dir = tempdir();
    let (edge, _node) = keyed_setup(dir.path()).await;
    let c = client();
    let get = |path: &str, key: &str| c.get(edge.url(path)).bearer_auth(key);

    // Admin-only surfaces: 403 in OpenAI's error shape for a client key, 200 for the admin.
    for path in [
        "/admin/status",
        "/admin/events",
        "/metrics",
        "/v1/nodes/n1/commands/usage",
        "/v1/nodes/n1/commands/runs",
        "/v1/nodes/n1/commands/sessions",
    ] {
        let (status, body) = send(get(path, BOB)).await;
        assert_eq!(status, 403, "{path}: {body}");
        assert_eq!(body["error"]["code"], "insufficient_permissions", "{path}");
        assert_eq!(body["error"]["type"], "permission_error", "{path}");
        if path != "/admin/events" {
            let (status, body) = send(get(path, TEST_API_KEY)).await;
            assert_eq!(status, 200, "{path}: {body}");
        }
    }
    let events = get("/admin/events", TEST_API_KEY).send().await.unwrap();
    assert_eq!(events.status(), 200);
    let mut events = events;

    // The allowlist: bob sees and uses only `small`.
    let (_, models) = send(get("/v1/models", BOB)).await;
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["small"]);
    let chat = |key: &str, model: &str| {
        c.post(edge.url("/v1/chat/completions"))
            .bearer_auth(key)
            .json(&chat_body(model))
    };
    let (status, body) = send(chat(BOB, "big")).await;
    assert_eq!(status, 404, "{body}");
    assert_eq!(body["error"]["code"], "model_not_found");
    assert_eq!(send(chat(BOB, "small")).await.0, 200);
    // Bob may run only the adapters of his groups on the runs API.
    let (status, body) = send(
        c.post(edge.url("/v1/runs"))
            .bearer_auth(BOB)
            .json(&json!({"adapter": "chat", "target": "agent", "input": "x"})),
    )
    .await;
    assert_eq!(status, 403, "{body}");

    // Usage events name the key.
    assert_eq!(send(chat(ALICE, "big")).await.0, 200);
    let mut seen = String::new();
    read_until(&mut events, &mut seen, |s| {
        s.contains("\"api_key\":\"alice\"")
    })
    .await;

    // Alice's run: bob cannot cancel it (404, as for no run), the admin can.
    let mut run = c
        .post(edge.url("/v1/runs"))
        .bearer_auth(ALICE)
        .json(&json!({"adapter": "slow", "target": "m", "input": "x"}))
        .send()
        .await
        .unwrap();
    assert_eq!(run.status(), 200);
    let run_id = run.headers()["x-iop-run-id"].to_str().unwrap().to_string();
    assert!(
        run_id.len() >= 24,
        "run ids carry at least 96 random bits: {run_id}"
    );
    let mut stream = String::new();
    read_until(&mut run, &mut stream, |s| s.contains("event: delta")).await;
    let cancel = |key: &str| {
        c.post(edge.url(&format!("/v1/runs/{run_id}/cancel")))
            .bearer_auth(key)
    };
    let (status, body) = send(cancel(BOB)).await;
    assert_eq!(status, 404, "{body}");
    assert_eq!(body["error"]["code"], "run_not_found");
    assert!(!stream.contains("event: cancelled"));
    let (status, body) = send(cancel(TEST_API_KEY)).await;
    assert_eq!(status, 200, "{body}");
    read_until(&mut run, &mut stream, |s| s.contains("event: cancelled")).await;
    // Alice cancels her own.
    let mut own = c
        .post(edge.url("/v1/runs"))
        .bearer_auth(ALICE)
        .json(&json!({"adapter": "slow", "target": "m", "input": "x"}))
        .send()
        .await
        .unwrap();
    let own_id = own.headers()["x-iop-run-id"].to_str().unwrap().to_string();
    let mut own_stream = String::new();
    read_until(&mut own, &mut own_stream, |s| s.contains("event: delta")).await;
    let (status, body) = send(
        c.post(edge.url(&format!("/v1/runs/{own_id}/cancel")))
            .bearer_auth(ALICE),
    )
    .await;
    assert_eq!(status, 200, "{body}");

    // Sessions: the same id names a different session per key; bob cannot end alice's.
    let turn = |key: &'static str, input: &'static str| {
        let c = c.clone();
        let url = edge.url("/v1/runs");
        async move {
            let response = c
                .post(url)
                .bearer_auth(key)
                .json(&json!({"adapter": "chat", "target": "agent", "input": input, "session_id": "s1"}))
                .send()
                .await
                .unwrap();
            assert_eq!(response.status(), 200);
            response.text().await.unwrap()
        }
    };
    assert!(
        turn(ALICE, "first")
            .await
            .contains("turn 1: first from alice:s1")
    );
    assert!(
        turn(ALICE, "second")
            .await
            .contains("turn 2: second from alice:s1")
    );
    let (status, body) = send(
        c.delete(edge.url("/v1/sessions/n1/chat/agent/s1"))
            .bearer_auth(BOB),
    )
    .await;
    assert_eq!(status, 404, "{body}");
    // Alice's session is untouched, and still hers alone.
    assert!(
        turn(ALICE, "third")
            .await
            .contains("turn 3: third from alice:s1")
    );
    let (_, sessions) = send(get("/v1/nodes/n1/commands/sessions", TEST_API_KEY)).await;
    assert!(sessions.to_string().contains("alice:s1"), "{sessions}");
    let (status, body) = send(
        c.delete(edge.url("/v1/sessions/n1/chat/agent/s1"))
            .bearer_auth(ALICE),
    )
    .await;
    assert_eq!(status, 200, "{body}");
}

#[tokio::test]
async fn guessing_keys_is_throttled_per_address_without_a_log_line_per_guess() {
    let dir = tempdir();
    let (edge, _node) = keyed_setup(dir.path()).await;
    let lines_before = edge.proc.log().lines().count();
    let c = client();
    let mut unauthorized = 0;
    let mut throttled = 0;
    for i in 0..300 {
        let response = c
            .get(edge.url("/v1/models"))
            .bearer_auth(format!("guess-{i:016}"))
            .send()
            .await
            .unwrap();
        match response.status().as_u16() {
            401 => unauthorized += 1,
            429 => {
                throttled += 1;
                let retry: u64 = response.headers()["retry-after"]
                    .to_str()
                    .unwrap()
                    .parse()
                    .unwrap();
                assert!((1..=30).contains(&retry), "{retry}");
                let body: Value = response.json().await.unwrap();
                assert_eq!(body["error"]["code"], "too_many_failed_attempts");
            }
            other => panic!("guess answered {other}"),
        }
    }
    // Only a few guesses are even checked; the rest wait.
    assert!(
        unauthorized <= 10,
        "{unauthorized} guesses checked, {throttled} throttled"
    );
    let new_lines = edge.proc.log().lines().count() - lines_before;
    assert!(
        new_lines < 20,
        "{new_lines} log lines for 300 guesses:\n{}",
        edge.proc.log()
    );
}

#[tokio::test]
async fn a_keyless_edge_refuses_a_non_loopback_address() {
    let dir = tempdir();
    let path = dir.path().join("edge.yaml");
    std::fs::write(&path, mock_config("{}", "")).unwrap();
    // 192.0.2.1 is a documentation address: were the check missing, binding it would fail
    // differently instead of exposing anything.
    let mut edge = Proc::spawn(
        "edge",
        &[
            "edge",
            "--config",
            path.to_str().unwrap(),
            "--listen-nodes",
            "127.0.0.1:0",
            "--listen-http",
            "192.0.2.1:8080",
        ],
    );
    let status = edge.wait_exit(Duration::from_secs(20)).await;
    assert_eq!(status.code(), Some(2), "{}", edge.log());
    let log = edge.log();
    assert!(
        log.contains("auth.keys")
            && log.contains("allow_anonymous")
            && log.contains("192.0.2.1:8080"),
        "{log}"
    );
}

#[tokio::test]
async fn malformed_requests_are_400s_naming_the_field_and_never_reach_the_node() {
    let dir = tempdir();
    let mock = start_mock(&[]).await;
    let config = format!(
        r#"
nodes:
  - id: n1
    token: {NODE_TOKEN}
    providers:
      - {{id: mock, kind: mock}}
      - {{id: oa, kind: openai_compat, base_url: "{base}"}}
model_groups:
  - {{name: rendered, members: [{{node: n1, provider: mock}}]}}
  - {{name: tunnel, members: [{{node: n1, provider: oa, model: mock-model}}]}}
"#,
        base = mock.openai_base()
    );
    let (edge, _node) = edge_with_node(dir.path(), &config).await;
    let c = client();
    let url = edge.url("/v1/chat/completions");
    let hi = r#"[{"role":"user","content":"hi"}]"#;
    let deep = format!(
        r#"{{"model":"MODEL","messages":{hi},"x":{}{}}}"#,
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    for model in ["rendered", "tunnel"] {
        let cases: Vec<(String, Option<&str>)> = vec![
            (
                format!(r#"{{"model":"{model}","model":"x","messages":{hi}}}"#),
                Some("model"),
            ),
            (
                format!(r#"{{"model":"{model}","messages":{hi},"stream":false,"stream":true}}"#),
                Some("stream"),
            ),
            (
                format!(r#"{{"model":"{model}","messages":{hi},"max_tokens":1,"max_tokens":-1}}"#),
                Some("max_tokens"),
            ),
            (format!(r#"{{"model":7,"messages":{hi}}}"#), Some("model")),
            (
                format!(r#"{{"model":"{model}","messages":{hi},"stream":"yes"}}"#),
                Some("stream"),
            ),
            (
                format!(r#"{{"model":"{model}","messages":{hi},"max_tokens":-1}}"#),
                Some("max_tokens"),
            ),
            (
                format!(
                    r#"{{"model":"{model}","messages":{hi},"max_tokens":9223372036854775808}}"#
                ),
                Some("max_tokens"),
            ),
            (
                format!(
                    r#"{{"model":"{model}","messages":{hi},"max_tokens":18446744073709551615}}"#
                ),
                Some("max_tokens"),
            ),
            (
                format!(r#"{{"model":"{model}","messages":{hi},"max_tokens":"5"}}"#),
                Some("max_tokens"),
            ),
            (
                format!(r#"{{"model":"{model}","messages":{hi},"max_completion_tokens":-1}}"#),
                Some("max_completion_tokens"),
            ),
            (
                format!(r#"{{"model":"{model}","messages":{hi},"n":1000000}}"#),
                Some("n"),
            ),
            (
                format!(r#"{{"model":"{model}","messages":[1,2]}}"#),
                Some("messages[0]"),
            ),
            (
                format!(r#"{{"model":"{model}","messages":"hi"}}"#),
                Some("messages"),
            ),
            (deep.replace("MODEL", model), None),
        ];
        for (body, param) in cases {
            let response = c
                .post(&url)
                .header("content-type", "application/json")
                .body(body.clone())
                .send()
                .await
                .unwrap();
            let status = response.status();
            let error: Value = response.json().await.unwrap();
            let shown = &body[..body.len().min(120)];
            assert_eq!(status, 400, "{shown}: {error}");
            assert!(error["error"]["message"].is_string(), "{error}");
            assert_eq!(error["error"]["param"].as_str(), param, "{shown}: {error}");
        }
        let response = c
            .post(&url)
            .header("content-type", "text/plain")
            .body(chat_body(model).to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 415);
        let error: Value = response.json().await.unwrap();
        assert_eq!(error["error"]["code"], "unsupported_media_type");
    }
    // The runs API is as strict.
    for (body, param) in [
        (
            r#"{"adapter":"mock","input":"x","max_tokens":-1}"#,
            "max_tokens",
        ),
        (
            r#"{"adapter":"mock","input":"x","max_tokens":"5"}"#,
            "max_tokens",
        ),
        (
            r#"{"adapter":"mock","adapter":"oa","input":"x"}"#,
            "adapter",
        ),
        (
            r#"{"adapter":"mock","input":"x","messages":[1]}"#,
            "messages[0]",
        ),
    ] {
        let response = c
            .post(edge.url("/v1/runs"))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 400, "{body}");
        let error: Value = response.json().await.unwrap();
        assert_eq!(error["error"]["param"], param, "{body}: {error}");
    }
    // Nothing reached the node or the provider.
    assert_eq!(mock.stats().await["requests"], 0);
    let usage = get_json(&edge.url("/v1/nodes/n1/commands/usage")).await;
    assert_eq!(usage["adapters"]["mock"]["runs"], 0, "{usage}");
    // The edge is fine and a well-formed request goes through.
    let ok = c
        .post(&url)
        .json(&chat_body("tunnel"))
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
    assert_eq!(mock.stats().await["requests"], 1);
}

/// An edge whose `endless` group's answer never ends (a mock of four billion 4 KiB tokens).
async fn endless_setup(dir: &std::path::Path, limits: &str) -> (EdgeProc, Proc) {
    let word = "x".repeat(4096);
    let config = format!(
        r#"
limits: {limits}
nodes:
  - id: n1
    token: {NODE_TOKEN}
    providers:
      - {{id: endless, kind: mock, capacity: {{normal: 2}}, mock: {{tokens: 4000000000, text: "{word}"}}}}
model_groups:
  - {{name: endless, members: [{{node: n1, provider: endless}}]}}
"#
    );
    edge_with_node(dir, &config).await
}

#[tokio::test]
async fn an_endless_answer_on_the_rendered_path_is_a_502_at_the_size_limit() {
    let dir = tempdir();
    let (edge, _node) = endless_setup(dir.path(), "{http: {max_response_bytes: 1048576}}").await;
    let rss_before = rss_bytes(edge.proc.pid());
    for _ in 0..3 {
        let response = client()
            .post(edge.url("/v1/chat/completions"))
            .json(&chat_body("endless"))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 502);
        let error: Value = response.json().await.unwrap();
        assert_eq!(error["error"]["code"], "response_too_large", "{error}");
        assert!(
            error["error"]["message"]
                .as_str()
                .unwrap()
                .contains("max_response_bytes"),
            "{error}"
        );
    }
    // Each run was cancelled and its slot returned.
    wait_idle(&edge).await;
    let grown = rss_bytes(edge.proc.pid()).saturating_sub(rss_before);
    assert!(grown < 64 << 20, "edge grew by {} MiB", grown >> 20);
}

#[tokio::test]
async fn a_client_that_stops_reading_is_cut_at_the_write_deadline_and_its_slot_returns() {
    let dir = tempdir();
    let (edge, _node) = endless_setup(dir.path(), "{http: {write_timeout_sec: 1}}").await;
    let addr: SocketAddr = edge.http.parse().unwrap();
    let body = json!({"model": "endless", "stream": true, "messages": [{"role": "user", "content": "hi"}]}).to_string();
    let mut socket = TcpStream::connect(addr).await.unwrap();
    socket
        .write_all(
            format!(
                "POST /v1/chat/completions HTTP/1.1\r\nHost: edge\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    // The stream starts and holds a slot ...
    wait_status(
        &edge,
        Duration::from_secs(20),
        "the stream in flight",
        |s| provider_of(s, "n1", "endless")["in_flight"]["normal"] == 1,
    )
    .await;
    // ... the client reads nothing: once the socket buffers fill, the edge cuts it.
    edge.proc
        .wait_line("accepted no response bytes", Duration::from_secs(60))
        .await;
    wait_idle(&edge).await;
    edge.proc
        .wait_line("client went away: cancelling run", Duration::from_secs(10))
        .await;
    drop(socket);
    // The edge serves on.
    let ok = client().get(edge.url("/healthz")).send().await.unwrap();
    assert_eq!(ok.status(), 200);
}
