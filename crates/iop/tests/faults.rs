//! The fault suite: network drops, kill -9, SIGSTOP, edge restarts, slow starts and a
//! mixed load with client aborts and a node restart — real `iop` processes on loopback,
//! with assertions on what clients received and on `/admin/status`.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use nix::sys::signal::Signal;
use serde_json::{Value, json};

fn config(tokens: u32, delay_ms: u32, normal: u32) -> String {
    format!(
        r#"
nodes:
  - id: n1
    token: token-n1-0123456789
    providers:
      - {{id: mock, kind: mock, capacity: {{normal: {normal}, long: 0}}, mock: {{tokens: {tokens}, token_delay_ms: {delay_ms}}}}}
model_groups:
  - {{name: pool, members: [{{node: n1, provider: mock}}]}}
"#
    )
}

/// `config` with a group that waits up to 20 s for its node to reconnect (instead of
/// failing at once while the node is away).
fn waiting_config(tokens: u32, delay_ms: u32, normal: u32) -> String {
    config(tokens, delay_ms, normal).replace(
        "{name: pool, members: [{node: n1, provider: mock}]}",
        "{name: pool, members: [{node: n1, provider: mock}], queue: {wait_for_reconnect_sec: 20}}",
    )
}

const FAST_RECONNECT: &str = "reconnect: {max_attempts: 0, interval_sec: 1}";

/// What one streaming client received.
#[derive(Debug, Default)]
struct StreamEnding {
    done: usize,
    errors: usize,
    /// The code of the (last) error event.
    error_code: String,
    finishes: usize,
    text: String,
    status: u16,
}

async fn stream_to_end(response: reqwest::Response) -> StreamEnding {
    let status = response.status().as_u16();
    let body = response.text().await.unwrap_or_default();
    StreamEnding {
        status,
        ..stream_to_end_of(&body)
    }
}

/// What a stream's body (as read so far) says.
fn stream_to_end_of(body: &str) -> StreamEnding {
    let mut ending = StreamEnding::default();
    for (_, data) in sse_events(body) {
        if data == "[DONE]" {
            ending.done += 1;
            continue;
        }
        let v: Value = serde_json::from_str(&data).unwrap();
        if v.get("error").is_some() {
            ending.errors += 1;
            ending.error_code = v["error"]["code"].as_str().unwrap_or_default().to_string();
        }
        if let Some(t) = v["choices"][0]["delta"]["content"].as_str() {
            ending.text.push_str(t);
        }
        if v["choices"][0]["finish_reason"].is_string() {
            ending.finishes += 1;
        }
    }
    ending
}

fn streaming(edge: &EdgeProc, model: &str) -> reqwest::RequestBuilder {
    client().post(edge.url("/v1/chat/completions")).json(
        &json!({"model": model, "stream": true, "messages": [{"role": "user", "content": "go"}]}),
    )
}

async fn node_runs(edge: &EdgeProc) -> u64 {
    get_json(&edge.url("/v1/nodes/n1/commands/usage")).await["adapters"]["mock"]["runs"]
        .as_u64()
        .unwrap()
}

#[tokio::test]
async fn a_waiter_queued_across_a_reconnect_is_dispatched_exactly_once() {
    let dir = tempdir();
    let edge = start_edge(dir.path(), &waiting_config(5, 10, 1)).await;
    let proxy = CuttableProxy::start(&edge.nodes).await;
    let node = start_node(
        "n1",
        dir.path(),
        &proxy.addr,
        "token-n1-0123456789",
        FAST_RECONNECT,
    );
    wait_ready(&edge, "n1").await;
    // The node's side of the handshake done too, so the cut is a lost connection.
    node.wait_line("dispatch-ready", Duration::from_secs(10))
        .await;

    proxy.cut();
    wait_status(&edge, Duration::from_secs(10), "n1 disconnected", |s| {
        node_status(s, "n1")["connected"] == false
    })
    .await;
    let edge = Arc::new(edge);
    let waiter = {
        let edge = edge.clone();
        tokio::spawn(
            async move { stream_to_end(streaming(&edge, "pool").send().await.unwrap()).await },
        )
    };
    wait_status(&edge, Duration::from_secs(5), "a waiter", |s| {
        group_of(s, "pool")["waiting"]["normal"] == 1
    })
    .await;
    proxy.restore();
    let ending = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(ending.status, 200);
    assert_eq!(
        (ending.done, ending.errors, ending.finishes),
        (1, 0, 1),
        "{ending:?}"
    );
    assert_eq!(ending.text.split_whitespace().count(), 5, "{ending:?}");
    wait_idle(&edge).await;
    assert_eq!(node_runs(&edge).await, 1, "dispatched exactly once");
    let s = status(&edge).await;
    assert_eq!(s["leases"]["acquired"], 1, "{s}");
    // The edge saw two generations of the node; the node logged the reconnect.
    assert!(
        edge.proc.log().matches("node ready").count() >= 2,
        "{}",
        edge.proc.log()
    );
    assert!(
        node.has_line("connection to the edge lost"),
        "{}",
        node.log()
    );
}

#[tokio::test]
async fn the_node_stops_a_run_no_edge_re_attaches_within_the_wait() {
    let dir = tempdir();
    std::fs::write(
        dir.path().join("ticker.sh"),
        "echo $$ > \"$PIDDIR/ticker.pid\"\nwhile true; do echo tick; sleep 0.05; done\n",
    )
    .unwrap();
    let config = format!(
        r#"
dispatch: {{reattach_wait_sec: 1}}
nodes:
  - id: n1
    token: token-n1-0123456789
    providers:
      - {{id: ticker, kind: cli, cli: {{argv: [sh, "{d}/ticker.sh"], env: {{PIDDIR: "{d}"}}}}}}
"#,
        d = dir.path().display()
    );
    let edge = start_edge(dir.path(), &config).await;
    let proxy = CuttableProxy::start(&edge.nodes).await;
    let _node = start_node(
        "n1",
        dir.path(),
        &proxy.addr,
        "token-n1-0123456789",
        FAST_RECONNECT,
    );
    wait_ready(&edge, "n1").await;
    let mut run = client()
        .post(edge.url("/v1/runs"))
        .json(&json!({"adapter": "ticker", "input": "x"}))
        .send()
        .await
        .unwrap();
    let mut seen = String::new();
    read_until(&mut run, &mut seen, |s| s.contains("tick")).await;
    let pid: i32 = std::fs::read_to_string(dir.path().join("ticker.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    // The link goes for good: the node keeps the run going for an edge to re-attach it.
    proxy.cut();
    // The client's stream ends with exactly one error terminal once the edge's re-attach
    // wait (1 s) passed, saying the run may have run.
    read_to_end(&mut run, &mut seen, Duration::from_secs(10)).await;
    let terminals: Vec<String> = sse_events(&seen)
        .into_iter()
        .map(|(k, _)| k)
        .filter(|k| matches!(k.as_str(), "complete" | "error" | "cancelled"))
        .collect();
    assert_eq!(terminals, ["error"], "{seen}");
    assert!(seen.contains("may have run"), "{seen}");
    // And the node killed the program once no edge re-attached it within its hold (the
    // edge's wait and a few seconds more).
    let deadline = Instant::now() + Duration::from_secs(20);
    while nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None).is_ok() {
        assert!(Instant::now() < deadline, "the run outlived its session");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn kill_9_mid_stream_errors_the_client_after_the_re_attach_wait_and_returns_the_lease() {
    let dir = tempdir();
    let config = format!("dispatch: {{reattach_wait_sec: 1}}\n{}", config(200, 20, 2));
    let edge = start_edge(dir.path(), &config).await;
    let mut node = start_node("n1", dir.path(), &edge.nodes, "token-n1-0123456789", "");
    wait_ready(&edge, "n1").await;
    let mut response = streaming(&edge, "pool").send().await.unwrap();
    let mut seen = String::new();
    read_until(&mut response, &mut seen, |s| {
        s.matches("content").count() >= 5
    })
    .await;
    node.kill9();
    // The bound only keeps a broken edge from hanging the test; what matters is why the
    // stream ended, which the error says: the closed socket, not the heartbeat (5 s).
    read_to_end(&mut response, &mut seen, Duration::from_secs(10)).await;
    let events = sse_events(&seen);
    let errors: Vec<&String> = events
        .iter()
        .map(|(_, d)| d)
        .filter(|d| d.contains("\"error\""))
        .collect();
    assert_eq!(errors.len(), 1, "{seen}");
    assert!(errors[0].contains("node_disconnected"), "{seen}");
    assert!(
        errors[0].contains("connection closed by the node"),
        "noticed by the closed socket: {seen}"
    );
    assert!(
        errors[0].contains("did not come back within 1s"),
        "after the re-attach wait: {seen}"
    );
    assert!(!seen.contains("[DONE]"));
    let s = status(&edge).await;
    assert!(all_idle(&s), "{s}");
    assert_eq!(s["leases"]["acquired"], 1);
}

#[tokio::test]
async fn sigstop_mid_stream_is_judged_by_the_heartbeat_and_the_stream_goes_on_when_the_node_returns()
 {
    let dir = tempdir();
    let edge = start_edge(dir.path(), &config(200, 25, 2)).await;
    let node = start_node(
        "n1",
        dir.path(),
        &edge.nodes,
        "token-n1-0123456789",
        FAST_RECONNECT,
    );
    wait_ready(&edge, "n1").await;
    let mut response = streaming(&edge, "pool").send().await.unwrap();
    let mut seen = String::new();
    read_until(&mut response, &mut seen, |s| {
        s.matches("content").count() >= 3
    })
    .await;
    node.signal(Signal::SIGSTOP);
    // The edge judges the frozen link by the heartbeat (5 s) and waits for the node.
    wait_status(&edge, Duration::from_secs(15), "n1 judged gone", |s| {
        node_status(s, "n1")["connected"] == false
    })
    .await;
    node.signal(Signal::SIGCONT);
    // The node reconnects as a new generation and the stream is re-attached: it ends
    // complete, every token once.
    read_to_end(&mut response, &mut seen, Duration::from_secs(30)).await;
    let ending = stream_to_end_of(&seen);
    assert_eq!(
        (ending.done, ending.errors, ending.finishes),
        (1, 0, 1),
        "{seen}"
    );
    assert_eq!(ending.text.split_whitespace().count(), 200, "{seen}");
    edge.proc
        .wait_line("generation=g2", Duration::from_secs(10))
        .await;
    assert!(edge.proc.has_line("re-attaching its requests"));
    let (code, body) = chat_completion(&edge, "pool", "again", json!({"max_tokens": 3})).await;
    assert_eq!(code, 200, "{body}");
    wait_idle(&edge).await;
}

#[tokio::test]
async fn after_an_edge_restart_every_node_is_ready_again_within_its_interval() {
    let dir = tempdir();
    let mut edge = start_edge(dir.path(), &config(3, 0, 2)).await;
    let _node = start_node(
        "n1",
        dir.path(),
        &edge.nodes,
        "token-n1-0123456789",
        FAST_RECONNECT,
    );
    wait_ready(&edge, "n1").await;
    let (nodes, http) = (edge.nodes.clone(), edge.http.clone());
    edge.proc.kill9();
    let config_text = std::fs::read_to_string(&edge.config).unwrap();
    let restarted_at = Instant::now();
    edge = start_edge_on(dir.path(), &config_text, &nodes, &http).await;
    let took = wait_ready(&edge, "n1").await
        + restarted_at
            .elapsed()
            .saturating_sub(Duration::from_secs(0));
    assert!(
        restarted_at.elapsed() < Duration::from_secs(3),
        "ready again after {took:?} (interval 1 s + 2 s)"
    );
    let (code, body) = chat_completion(&edge, "pool", "hello", json!({})).await;
    assert_eq!(code, 200, "{body}");
}

#[tokio::test]
async fn a_node_started_before_its_edge_retries_until_the_edge_is_up() {
    let dir = tempdir();
    let nodes = free_addr();
    let node = start_node(
        "n1",
        dir.path(),
        &nodes,
        "token-n1-0123456789",
        "reconnect: {max_attempts: 0, interval_sec: 0.5}",
    );
    node.wait_line("connection attempt failed", Duration::from_secs(5))
        .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let edge = start_edge_on(dir.path(), &config(3, 0, 1), &nodes, "127.0.0.1:0").await;
    wait_ready(&edge, "n1").await;
    let (code, _) = chat_completion(&edge, "pool", "hi", json!({})).await;
    assert_eq!(code, 200);
}

#[tokio::test]
async fn a_finite_retry_budget_ends_the_node_non_zero() {
    let dir = tempdir();
    let mut node = start_node(
        "n1",
        dir.path(),
        &free_addr(),
        "token-n1-0123456789",
        "reconnect: {max_attempts: 2, interval_sec: 0.2}",
    );
    let status = node.wait_exit(Duration::from_secs(10)).await;
    assert_eq!(status.code(), Some(3), "{}", node.log());
    let log = node.log();
    assert_eq!(log.matches("connection attempt failed").count(), 2, "{log}");
    assert!(
        log.contains("giving up after 2 failed connection attempts"),
        "{log}"
    );
}

#[tokio::test]
async fn sigterm_ends_the_node_cleanly_after_closing_its_runs() {
    let dir = tempdir();
    let edge = start_edge(dir.path(), &config(400, 25, 2)).await;
    let mut node = start_node("n1", dir.path(), &edge.nodes, "token-n1-0123456789", "");
    wait_ready(&edge, "n1").await;
    let mut response = streaming(&edge, "pool").send().await.unwrap();
    let mut seen = String::new();
    read_until(&mut response, &mut seen, |s| s.contains("content")).await;
    node.signal(Signal::SIGTERM);
    let status = node.wait_exit(Duration::from_secs(5)).await;
    assert_eq!(status.code(), Some(0), "{}", node.log());
    read_to_end(&mut response, &mut seen, Duration::from_secs(10)).await;
    let errors = sse_events(&seen)
        .iter()
        .filter(|(_, d)| d.contains("\"error\""))
        .count();
    assert_eq!(errors, 1, "the client gets exactly one ending: {seen}");
    assert!(all_idle(&common::status(&edge).await));
}

/// A small deterministic generator, so a failure can be replayed.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    Completed,
    /// Failed with this error code; `began`: the response had started (status 200).
    Failed {
        code: String,
        began: bool,
    },
    Aborted,
}

#[tokio::test]
async fn two_hundred_requests_with_aborts_and_a_node_restart_leave_nothing_behind() {
    const CAPACITY: usize = 4;
    const CLIENTS: usize = 16;
    let dir = tempdir();
    let edge = Arc::new(start_edge(dir.path(), &waiting_config(8, 5, CAPACITY as u32)).await);
    let mut node = start_node("n1", dir.path(), &edge.nodes, "token-n1-0123456789", "");
    wait_ready(&edge, "n1").await;
    let mut rng = Lcg(0x1f0b);
    let mut tasks = tokio::task::JoinSet::new();
    let gate = Arc::new(tokio::sync::Semaphore::new(CLIENTS));
    let mut restarted = None;
    for i in 0..200u64 {
        if i == 100 {
            // Mid-way: the node dies and a new node process takes its place.
            node.kill9();
            node = start_node(
                "n1-again",
                dir.path(),
                &edge.nodes,
                "token-n1-0123456789",
                "",
            );
            restarted = Some(Instant::now());
        }
        let stream = rng.next().is_multiple_of(2);
        let abort_after = (rng.next() % 10 < 3).then(|| Duration::from_millis(rng.next() % 60));
        let permit = gate.clone().acquire_owned().await.unwrap();
        let edge = edge.clone();
        tasks.spawn(async move {
            let _permit = permit;
            let body = json!({"model": "pool", "stream": stream, "messages": [{"role": "user", "content": format!("request {i}")}]});
            let request = client().post(edge.url("/v1/chat/completions")).json(&body).send();
            let work = async move {
                let response = request.await.unwrap();
                let status = response.status().as_u16();
                if stream && status == 200 {
                    let ending = stream_to_end(response).await;
                    // Exactly one ending: [DONE] after one finish, or one error event.
                    match (ending.done, ending.errors) {
                        (1, 0) => {
                            assert_eq!(ending.finishes, 1, "{ending:?}");
                            Outcome::Completed
                        }
                        (0, 1) => Outcome::Failed {
                            code: ending.error_code.clone(),
                            began: true,
                        },
                        _ => panic!("request {i}: not exactly one ending: {ending:?}"),
                    }
                } else {
                    let text = response.text().await.unwrap();
                    let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("request {i}: {e}: {text}"));
                    if status == 200 {
                        assert!(v["choices"][0]["message"]["content"].is_string(), "{text}");
                        Outcome::Completed
                    } else {
                        assert!(v["error"]["message"].is_string(), "{text}");
                        Outcome::Failed {
                            code: v["error"]["code"].as_str().unwrap_or_default().to_string(),
                            began: false,
                        }
                    }
                }
            };
            match abort_after {
                Some(after) => tokio::time::timeout(after, work).await.unwrap_or(Outcome::Aborted),
                None => work.await,
            }
        });
    }
    let mut outcomes = Vec::new();
    while let Some(result) = tasks.join_next().await {
        outcomes.push(result.expect("a client saw a broken response"));
    }
    assert_eq!(outcomes.len(), 200);
    let completed = outcomes
        .iter()
        .filter(|o| **o == Outcome::Completed)
        .count();
    let aborted = outcomes.iter().filter(|o| **o == Outcome::Aborted).count();
    let failures: Vec<&Outcome> = outcomes
        .iter()
        .filter(|o| matches!(o, Outcome::Failed { .. }))
        .collect();
    eprintln!(
        "completed {completed}, failed {}, aborted {aborted}: {failures:?}",
        failures.len()
    );
    // What the kill may fail, and only that: a request whose run had begun on the killed
    // node (it held one of its CAPACITY slots: it is never retried, the provider was at
    // work), and a request that found no member live for it (the group waits 20 s for a
    // reconnect, so that needs the new node to be slower than that). Waiters and requests
    // sent after the kill wait for the new node; a request dispatched into the dying
    // connection before the edge noticed is retried and served by the new node.
    let mut in_flight = 0;
    for failure in &failures {
        let Outcome::Failed { code, began } = failure else {
            unreachable!()
        };
        match code.as_str() {
            "node_disconnected" => in_flight += 1,
            "model_unavailable" => assert!(!began, "{failure:?}"),
            other => panic!("a failure the kill does not explain: {other} ({failures:?})"),
        }
    }
    assert!(in_flight <= CAPACITY, "{failures:?}");
    assert!(failures.len() <= CLIENTS, "{failures:?}");
    assert!(completed > 0);
    assert!(restarted.is_some());
    wait_ready(&edge, "n1").await;
    wait_idle(&edge).await;
    let s = status(&edge).await;
    assert_eq!(s["leases"]["acquired"], s["leases"]["released"], "{s}");
    drop(node);
}

#[tokio::test]
async fn reaching_ready_resets_the_retry_budget() {
    let dir = tempdir();
    let edge = start_edge(dir.path(), &config(3, 0, 1)).await;
    let proxy = CuttableProxy::start(&edge.nodes).await;
    let node = start_node(
        "n1",
        dir.path(),
        &proxy.addr,
        "token-n1-0123456789",
        "reconnect: {max_attempts: 2, interval_sec: 0.3}",
    );
    wait_ready(&edge, "n1").await;
    // As below: the first session counts as ready on the node a moment after the edge
    // shows it; a cut before that is not the failure after a ready session this test needs.
    node.wait_line("dispatch-ready", Duration::from_secs(10))
        .await;
    for failures in 1..=3 {
        proxy.cut();
        let deadline = Instant::now() + Duration::from_secs(5);
        while node.log().matches("connection attempt failed").count() < failures {
            assert!(Instant::now() < deadline, "{}", node.log());
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        proxy.restore();
        wait_status(&edge, Duration::from_secs(5), "ready again", |s| {
            node_status(s, "n1")["ready"] == true
        })
        .await;
        // The node counts the session as ready once it read the edge's ack, a moment
        // after the edge shows it: cut only then.
        while node.log().matches("dispatch-ready").count() < failures + 1 {
            assert!(Instant::now() < deadline, "{}", node.log());
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    // Three failures in all, but never two in a row: the node is still serving.
    let (code, _) = chat_completion(&edge, "pool", "still here", json!({})).await;
    assert_eq!(code, 200);
    assert!(!node.has_line("giving up"), "{}", node.log());
}
