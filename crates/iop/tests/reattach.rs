//! Re-attach instead of re-run: requests in flight on a node whose link to the edge drops
//! — reset at a random point 0–100 ms after dispatch, or frozen until the heartbeat
//! judges it — go on on the node and are re-attached when the node is back. Real edge,
//! node and mock provider processes, a cuttable TCP proxy on the link. Every row checks
//! that no request ran twice (the provider and the node count what they executed) and
//! that every client got its whole answer, identical to an uncut one.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use nix::sys::signal::Signal;
use serde_json::{Value, json};

const FAST_RECONNECT: &str = "reconnect: {max_attempts: 0, interval_sec: 1}";
const TOKEN_N1: &str = "token-n1-0123456789";
const TOKEN_N2: &str = "token-n2-0123456789";
/// Concurrent requests per round.
const CONCURRENT: usize = 8;

fn config(mock: &MockProc, wait_sec: u32) -> String {
    let oa = |id: &str| {
        format!(
            "{{id: {id}, kind: openai_compat, base_url: \"{}\", capacity: {{normal: 16}}, max_concurrency: 16}}",
            mock.openai_base()
        )
    };
    format!(
        r#"
dispatch: {{reattach_wait_sec: {wait_sec}}}
nodes:
  - id: n1
    token: {TOKEN_N1}
    providers:
      - {oa1}
      - {{id: runner, kind: mock, capacity: {{normal: 16}}, max_concurrency: 16, mock: {{tokens: 20, token_delay_ms: 10}}}}
  - id: n2
    token: {TOKEN_N2}
    providers: [{oa2}]
model_groups:
  - {{name: solo, members: [{{node: n1, provider: oa, model: mock-model}}], queue: {{wait_for_reconnect_sec: 30, timeout_sec: 60}}}}
  - {{name: pair, members: [{{node: n1, provider: oa, model: mock-model}}, {{node: n2, provider: oa2, model: mock-model}}]}}
  - {{name: runs, members: [{{node: n1, provider: runner}}], queue: {{wait_for_reconnect_sec: 30, timeout_sec: 60}}}}
"#,
        oa1 = oa("oa"),
        oa2 = oa("oa2"),
    )
}

struct Fabric {
    edge: Arc<EdgeProc>,
    proxy: CuttableProxy,
    mock: MockProc,
    n1: Proc,
    _n2: Proc,
    _dir: tempfile::TempDir,
}

async fn fabric(wait_sec: u32) -> Fabric {
    let dir = tempdir();
    // 20 tokens 10 ms apart: a request runs about 200 ms, so cuts land before the accept,
    // around the head and mid-stream.
    let mock = start_mock(&["--tokens", "20", "--token-delay-ms", "10"]).await;
    let edge = start_edge(dir.path(), &config(&mock, wait_sec)).await;
    let proxy = CuttableProxy::start(&edge.nodes).await;
    let n1 = start_node("n1", dir.path(), &proxy.addr, TOKEN_N1, FAST_RECONNECT);
    let n2 = start_node("n2", dir.path(), &edge.nodes, TOKEN_N2, FAST_RECONNECT);
    wait_ready(&edge, "n1").await;
    wait_ready(&edge, "n2").await;
    n1.wait_line("dispatch-ready", Duration::from_secs(10))
        .await;
    Fabric {
        edge: Arc::new(edge),
        proxy,
        mock,
        n1,
        _n2: n2,
        _dir: dir,
    }
}

/// What one client got: its status and the answer's text (streamed deltas joined, or the
/// message), or the error.
#[derive(Debug, Clone, PartialEq)]
struct Got {
    status: u16,
    text: String,
    error: String,
    complete: bool,
}

async fn ask(edge: &EdgeProc, model: &str, stream: bool) -> Got {
    let response = client()
        .post(edge.url("/v1/chat/completions"))
        .json(&json!({"model": model, "stream": stream, "messages": [{"role": "user", "content": "tell me"}]}))
        .send()
        .await;
    let response = match response {
        Ok(response) => response,
        Err(e) => {
            return Got {
                status: 0,
                text: String::new(),
                error: format!("the request failed: {e}"),
                complete: false,
            };
        }
    };
    let status = response.status().as_u16();
    let body = match response.text().await {
        Ok(body) => body,
        Err(e) => format!("the body broke off: {e}"),
    };
    let mut got = Got {
        status,
        text: String::new(),
        error: String::new(),
        complete: false,
    };
    if !stream {
        let v: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
        got.text = v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        got.error = v["error"]["message"].as_str().unwrap_or_default().into();
        got.complete = v["choices"][0]["finish_reason"].is_string();
        return got;
    }
    for (_, data) in sse_events(&body) {
        if data == "[DONE]" {
            got.complete = true;
            continue;
        }
        let v: Value = serde_json::from_str(&data).unwrap();
        if let Some(message) = v["error"]["message"].as_str() {
            got.error = message.to_string();
        }
        if let Some(t) = v["choices"][0]["delta"]["content"].as_str() {
            got.text.push_str(t);
        }
    }
    got
}

/// Executions so far: requests the mock provider received, runs the node's mock adapter
/// ran.
async fn executions(f: &Fabric) -> (u64, u64) {
    let requests = f.mock.stats().await["requests"].as_u64().unwrap();
    let runs =
        get_json(&f.edge.url("/v1/nodes/n1/commands/usage")).await["adapters"]["runner"]["runs"]
            .as_u64()
            .unwrap_or(0);
    (requests, runs)
}

/// A small deterministic generator for the cut points (the seed is printed).
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}

/// How the link goes down in a round.
#[derive(Debug, Clone, Copy)]
enum Cut {
    /// Reset at a point after dispatch, then the node reconnects at once.
    Reset,
    /// The node freezes (SIGSTOP) past the edge's heartbeat timeout, then goes on.
    Frozen,
}

/// Sends `CONCURRENT` requests to `model`, cuts the link as `cut` says, and returns what
/// the clients got.
async fn round(f: &Fabric, model: &str, stream: bool, cut: Cut, rng: &mut Lcg) -> Vec<Got> {
    let clients: Vec<_> = (0..CONCURRENT)
        .map(|_| {
            let edge = f.edge.clone();
            let model = model.to_string();
            tokio::spawn(async move { ask(&edge, &model, stream).await })
        })
        .collect();
    // The cut comes after the edge dispatched to n1 (it has requests in flight there),
    // at a random point 0–100 ms later: before the provider answered, around its head,
    // or mid-answer (an answer takes about 200 ms).
    let provider = if model == "runs" { "runner" } else { "oa" };
    wait_status(
        &f.edge,
        Duration::from_secs(30),
        "a request in flight on n1",
        |s| {
            provider_of(s, "n1", provider)["in_flight"]["normal"]
                .as_u64()
                .is_some_and(|n| n > 0)
        },
    )
    .await;
    match cut {
        Cut::Reset => {
            tokio::time::sleep(Duration::from_millis(rng.below(100))).await;
            f.proxy.cut();
            f.proxy.restore();
        }
        Cut::Frozen => {
            tokio::time::sleep(Duration::from_millis(rng.below(50))).await;
            f.n1.signal(Signal::SIGSTOP);
            // Past the edge's heartbeat timeout (5 s): the edge judges the link gone.
            wait_status(&f.edge, Duration::from_secs(20), "n1 judged gone", |s| {
                node_status(s, "n1")["connected"] == false
            })
            .await;
            f.n1.signal(Signal::SIGCONT);
        }
    }
    let mut got = Vec::new();
    for client in clients {
        got.push(
            tokio::time::timeout(Duration::from_secs(60), client)
                .await
                .expect("every client gets an answer")
                .unwrap(),
        );
    }
    wait_ready(&f.edge, "n1").await;
    got
}

async fn matrix_row(wait_sec: u32, model: &str, stream: bool, cut: Cut, rounds: usize) {
    let f = fabric(wait_sec).await;
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    println!("cut points seeded with {seed}");
    let mut rng = Lcg(seed);
    // An uncut answer to compare with.
    let reference = ask(&f.edge, model, stream).await;
    assert!(
        reference.status == 200 && reference.complete,
        "{reference:?}"
    );
    let before = executions(&f).await;
    for r in 0..rounds {
        let got = round(&f, model, stream, cut, &mut rng).await;
        for g in &got {
            assert_eq!(
                g,
                &reference,
                "round {r}: every client gets the whole answer, as uncut\nedge log:\n{}\nnode log:\n{}",
                f.edge.proc.log(),
                f.n1.log()
            );
        }
    }
    let after = executions(&f).await;
    let asked = (rounds * CONCURRENT) as u64;
    let executed = if model == "runs" {
        after.1 - before.1
    } else {
        after.0 - before.0
    };
    assert_eq!(
        executed, asked,
        "each request executed exactly once (no second run after a cut)"
    );
    assert!(
        f.edge.proc.has_line("re-attaching its requests"),
        "the cuts landed while requests ran: {}",
        f.edge.proc.log()
    );
}

#[tokio::test]
async fn a_reset_link_re_attaches_tunnelled_requests_on_one_member() {
    matrix_row(15, "solo", false, Cut::Reset, 3).await;
}

#[tokio::test]
async fn a_reset_link_re_attaches_tunnelled_streams_on_one_member() {
    matrix_row(15, "solo", true, Cut::Reset, 3).await;
}

#[tokio::test]
async fn a_reset_link_re_attaches_tunnelled_requests_of_a_two_member_group() {
    matrix_row(15, "pair", false, Cut::Reset, 3).await;
}

#[tokio::test]
async fn a_reset_link_re_attaches_runs() {
    matrix_row(15, "runs", true, Cut::Reset, 3).await;
}

#[tokio::test]
async fn a_frozen_link_is_judged_by_the_heartbeat_and_its_requests_re_attached() {
    matrix_row(15, "pair", false, Cut::Frozen, 1).await;
}

#[tokio::test]
async fn a_node_gone_for_good_fails_its_requests_as_may_have_run_and_no_other_member_runs_them() {
    let f = fabric(2).await;
    let before = executions(&f).await;
    let clients: Vec<_> = (0..4)
        .map(|_| {
            let edge = f.edge.clone();
            tokio::spawn(async move { ask(&edge, "pair", false).await })
        })
        .collect();
    // Once the provider has every request, the link is cut for good.
    let deadline = Instant::now() + Duration::from_secs(20);
    while executions(&f).await.0 < before.0 + 4 {
        assert!(Instant::now() < deadline, "the provider never got them");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    f.proxy.cut();
    let mut on_n1 = 0;
    for client in clients {
        let got = tokio::time::timeout(Duration::from_secs(30), client)
            .await
            .unwrap()
            .unwrap();
        if got.status == 200 {
            assert_eq!(got.text.split_whitespace().count(), 20, "{got:?}");
            continue;
        }
        on_n1 += 1;
        assert_eq!(got.status, 503, "{got:?}");
        assert!(got.error.contains("may have run"), "{got:?}");
        assert!(got.error.contains("within 2s"), "{got:?}");
    }
    // Whatever waited for n1 was not sent to n2: the provider saw each request once.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(executions(&f).await.0, before.0 + 4);
    assert!(on_n1 > 0, "some requests ran on n1 when its link went");
}
