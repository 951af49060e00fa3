//! The native runs API end to end: each adapter kind against a real backend (the mock
//! provider, a shell program), cancel, terminal synthesis, concurrency limits, sessions,
//! node commands and the node's run store.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{Value, json};

const ECHO: &str = r#"input=$(cat)
echo "you said: $input"
echo "second line"
echo "@@iop-usage $IOP_USAGE_NONCE {\"input_tokens\":3,\"output_tokens\":2}"
"#;

const TICKER: &str = r#"echo $$ > "$PIDDIR/ticker.pid"
sleep 1000 &
echo $! > "$PIDDIR/child.pid"
while true; do echo tick; sleep 0.05; done
"#;

const SESSION: &str = r#"n=0
last=""
while IFS= read -r line; do
  if [ "$line" = "<<<IOP-END>>>" ]; then
    n=$((n+1))
    echo "turn $n: $last"
    echo "<<<IOP-END>>>"
  else
    last="$line"
  fi
done
"#;

const FAILING: &str = "echo partial; echo 'bad things' >&2; exit 3\n";

/// Writes numbered lines as fast as it is allowed to, recording how many it wrote.
const FIREHOSE: &str = r#"i=0
while true; do
  echo "line $i with some padding to make it longer"
  i=$((i+1))
  if [ $((i % 100)) -eq 0 ]; then echo $i > "$PIDDIR/written"; fi
done
"#;

struct Setup {
    _dir: tempfile::TempDir,
    dir: std::path::PathBuf,
    mock: MockProc,
    edge: EdgeProc,
    node: Proc,
}

async fn setup() -> Setup {
    let dir = tempdir();
    let path = dir.path().to_path_buf();
    for (name, body) in [
        ("echo.sh", ECHO),
        ("ticker.sh", TICKER),
        ("session.sh", SESSION),
        ("failing.sh", FAILING),
        ("firehose.sh", FIREHOSE),
    ] {
        std::fs::write(path.join(name), body).unwrap();
    }
    let mock = start_mock(&[]).await;
    let d = path.display();
    let config = format!(
        r#"
nodes:
  - id: n1
    token: token-n1-0123456789
    providers:
      - {{id: mock, kind: mock, mock: {{tokens: 5, reasoning: true}}}}
      - {{id: slowmock, kind: mock, max_concurrency: 1, mock: {{tokens: 40, token_delay_ms: 25}}}}
      - {{id: oa, kind: openai_compat, base_url: "{oa}"}}
      - {{id: vl, kind: vllm, base_url: "{oa}"}}
      - {{id: ol, kind: ollama, base_url: "{ol}"}}
      - {{id: echo, kind: cli, cli: {{argv: [sh, "{d}/echo.sh"]}}}}
      - {{id: failing, kind: cli, cli: {{argv: [sh, "{d}/failing.sh"]}}}}
      - {{id: firehose, kind: cli, cli: {{argv: [sh, "{d}/firehose.sh"], env: {{PIDDIR: "{d}"}}}}}}
      - {{id: ticker, kind: cli, cli: {{argv: [sh, "{d}/ticker.sh"], env: {{PIDDIR: "{d}"}}}}}}
      - {{id: chat, kind: cli, cli: {{argv: [sh, "{d}/session.sh"]}}}}
"#,
        oa = mock.openai_base(),
        ol = mock.ollama_base(),
    );
    let edge = start_edge(&path, &config).await;
    let node = start_node("n1", &path, &edge.nodes, "token-n1-0123456789", "");
    wait_ready(&edge, "n1").await;
    Setup {
        dir: path,
        _dir: dir,
        mock,
        edge,
        node,
    }
}

/// Submits a run and collects its SSE events as `(kind, data)`.
async fn run(edge: &EdgeProc, request: Value) -> Vec<(String, Value)> {
    let response = client()
        .post(edge.url("/v1/runs"))
        .json(&request)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200, "{}", response.text().await.unwrap());
    let body = response.text().await.unwrap();
    sse_events(&body)
        .into_iter()
        .map(|(k, d)| (k, serde_json::from_str(&d).unwrap()))
        .collect()
}

/// Checks ordering and the single terminal; returns the concatenated delta text.
fn check_stream(events: &[(String, Value)], terminal: &str) -> String {
    assert!(!events.is_empty());
    let seqs: Vec<u64> = events
        .iter()
        .map(|(_, d)| d["seq"].as_u64().unwrap())
        .collect();
    assert!(
        seqs.windows(2).all(|w| w[1] > w[0]),
        "seq out of order: {seqs:?}"
    );
    let terminals: Vec<&str> = events
        .iter()
        .map(|(k, _)| k.as_str())
        .filter(|k| matches!(*k, "complete" | "error" | "cancelled"))
        .collect();
    assert_eq!(terminals, [terminal], "events: {events:?}");
    assert_eq!(events.last().unwrap().0, terminal);
    events
        .iter()
        .filter(|(k, _)| k == "delta")
        .map(|(_, d)| d["text"].as_str().unwrap().to_string())
        .collect()
}

fn usage(events: &[(String, Value)]) -> Value {
    events.last().unwrap().1["usage"].clone()
}

#[tokio::test]
async fn every_adapter_kind_streams_in_order_and_ends_with_one_terminal_with_usage() {
    let s = setup().await;
    // mock (in-process on the node)
    let events = run(
        &s.edge,
        json!({"node": "n1", "adapter": "mock", "target": "m", "input": "two words"}),
    )
    .await;
    let text = check_stream(&events, "complete");
    assert_eq!(text.split_whitespace().count(), 5, "{text}");
    assert_eq!(events[0].0, "start");
    assert!(events.iter().any(|(k, _)| k == "reasoning_delta"));
    assert_eq!(usage(&events)["input_tokens"], 2);
    assert_eq!(usage(&events)["reasoning_tokens"], 3);

    // openai_compat and vllm against the mock provider's OpenAI API
    for adapter in ["oa", "vl"] {
        let events = run(
            &s.edge,
            json!({"adapter": adapter, "target": "mock-model", "input": "hello there"}),
        )
        .await;
        let text = check_stream(&events, "complete");
        assert!(
            text.starts_with("Hello from the iop mock provider"),
            "{adapter}: {text}"
        );
        let u = usage(&events);
        assert_eq!(
            (u["input_tokens"].as_u64(), u["output_tokens"].as_u64()),
            (Some(2), Some(16)),
            "{u}"
        );
        assert!(
            u.get("reasoning_tokens").is_none(),
            "not reported, not invented: {u}"
        );
    }
    // reasoning deltas from reasoning_content
    let events = run(
        &s.edge,
        json!({"adapter": "oa", "target": "reasoning-model", "input": "x"}),
    )
    .await;
    check_stream(&events, "complete");
    assert!(events.iter().any(|(k, _)| k == "reasoning_delta"));
    assert_eq!(usage(&events)["reasoning_tokens"], 2);

    // ollama against the mock provider's native API
    let events = run(
        &s.edge,
        json!({"adapter": "ol", "target": "mock-model", "input": "hi"}),
    )
    .await;
    let text = check_stream(&events, "complete");
    assert!(text.starts_with("Hello from"), "{text}");
    assert_eq!(usage(&events)["output_tokens"], 16);
    assert_eq!(events.last().unwrap().1["finish_reason"], "stop");

    // cli: a shell program, stdin in, stdout lines out
    let events = run(
        &s.edge,
        json!({"adapter": "echo", "target": "t", "input": "ping"}),
    )
    .await;
    let text = check_stream(&events, "complete");
    assert_eq!(text, "you said: ping\nsecond line\n");
    assert_eq!(usage(&events)["output_tokens"], 2);
}

#[tokio::test]
async fn provider_and_program_failures_end_with_an_error_terminal() {
    let s = setup().await;
    let events = run(&s.edge, json!({"adapter": "failing", "input": "x"})).await;
    check_stream(&events, "error");
    let err = &events.last().unwrap().1["error"];
    assert_eq!(err["code"], "cli_exit");
    assert!(
        err["message"].as_str().unwrap().contains("bad things"),
        "{err}"
    );

    let events = run(
        &s.edge,
        json!({"adapter": "oa", "target": "fail-500", "input": "x"}),
    )
    .await;
    check_stream(&events, "error");
    assert!(
        events.last().unwrap().1["error"]["message"]
            .as_str()
            .unwrap()
            .contains("500")
    );

    // An adapter the node does not have is refused by the edge before anything is sent.
    let response = client()
        .post(s.edge.url("/v1/runs"))
        .json(&json!({"adapter": "nope", "input": "x"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 404);
    assert_eq!(response.headers()["x-iop-error"], "not_found");
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], "unknown_adapter", "{body}");
    assert_eq!(body["error"]["param"], "adapter", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("slowmock"),
        "the message lists the adapters it has: {body}"
    );
}

#[tokio::test]
async fn an_adapter_that_returns_without_a_terminal_gets_one_synthesized() {
    let s = setup().await;
    let events = run(
        &s.edge,
        json!({"adapter": "mock", "target": "mock-no-terminal", "input": "x"}),
    )
    .await;
    let text = check_stream(&events, "complete");
    assert_eq!(text.split_whitespace().count(), 5);
    s.node
        .wait_line(
            "adapter returned without a terminal event",
            Duration::from_secs(5),
        )
        .await;
}

/// Reads a run's SSE stream until `deltas` deltas arrived; returns the run id and the rest.
async fn start_streaming(
    edge: &EdgeProc,
    request: Value,
    deltas: usize,
) -> (String, reqwest::Response, String) {
    let mut response = client()
        .post(edge.url("/v1/runs"))
        .json(&request)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let run_id = response.headers()["x-iop-run-id"]
        .to_str()
        .unwrap()
        .to_string();
    let mut seen = String::new();
    read_until(&mut response, &mut seen, |s| {
        s.matches("event: delta").count() >= deltas
    })
    .await;
    (run_id, response, seen)
}

async fn rest(mut response: reqwest::Response, mut seen: String) -> Vec<(String, Value)> {
    read_to_end(&mut response, &mut seen, Duration::from_secs(10)).await;
    sse_events(&seen)
        .into_iter()
        .map(|(k, d)| (k, serde_json::from_str(&d).unwrap()))
        .collect()
}

#[tokio::test]
async fn cancel_mid_stream_ends_cancelled_and_closes_the_provider_connection() {
    let s = setup().await;
    let (run_id, response, seen) = start_streaming(
        &s.edge,
        json!({"adapter": "oa", "target": "slow", "input": "x"}),
        3,
    )
    .await;
    let cancel = client()
        .post(s.edge.url(&format!("/v1/runs/{run_id}/cancel")))
        .send()
        .await
        .unwrap();
    assert_eq!(cancel.status(), 200, "{}", cancel.text().await.unwrap());
    let events = rest(response, seen).await;
    check_stream(&events, "cancelled");
    s.mock.wait_aborted(1, Duration::from_secs(5)).await;

    // Cancelling an unknown run is a 404 in OpenAI's error shape.
    let missing = client()
        .post(s.edge.url("/v1/runs/nope/cancel"))
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), 404);
    let body: Value = missing.json().await.unwrap();
    assert_eq!(body["error"]["code"], "run_not_found");
}

fn pid_alive(path: &Path) -> bool {
    let pid: i32 = std::fs::read_to_string(path)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None).is_ok()
}

#[tokio::test]
async fn cancel_kills_the_cli_process_group() {
    let s = setup().await;
    let (run_id, response, seen) =
        start_streaming(&s.edge, json!({"adapter": "ticker", "input": "x"}), 2).await;
    assert!(pid_alive(&s.dir.join("ticker.pid")));
    assert!(pid_alive(&s.dir.join("child.pid")));
    client()
        .post(s.edge.url(&format!("/v1/runs/{run_id}/cancel")))
        .send()
        .await
        .unwrap();
    check_stream(&rest(response, seen).await, "cancelled");
    let deadline = Instant::now() + Duration::from_secs(5);
    while pid_alive(&s.dir.join("ticker.pid")) || pid_alive(&s.dir.join("child.pid")) {
        assert!(
            Instant::now() < deadline,
            "the program or its child outlived the cancel"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn runs_beyond_max_concurrency_wait_for_the_slot_instead_of_failing() {
    let s = setup().await;
    let (_id, first, seen) =
        start_streaming(&s.edge, json!({"adapter": "slowmock", "input": "x"}), 1).await;
    // The edge's account for slowmock is bounded by its max_concurrency (1): the second run
    // waits at the edge for the slot rather than reaching the node's full gate.
    let edge = std::sync::Arc::new(s.edge);
    let second = {
        let edge = edge.clone();
        tokio::spawn(async move { run(&edge, json!({"adapter": "slowmock", "input": "y"})).await })
    };
    let snapshot = status(&edge).await;
    assert_eq!(
        provider_of(&snapshot, "n1", "slowmock")["in_flight"]["normal"],
        1,
        "{snapshot}"
    );
    check_stream(&rest(first, seen).await, "complete");
    let events = tokio::time::timeout(Duration::from_secs(20), second)
        .await
        .expect("the waiting run got the slot")
        .unwrap();
    check_stream(&events, "complete");
    assert!(
        !s.node.has_line("max concurrency"),
        "the node's gate never refused: {}",
        s.node.log()
    );
}

#[tokio::test]
async fn cli_sessions_keep_their_process_and_terminate_on_request() {
    let s = setup().await;
    let turn = |input: &'static str, session: &'static str| {
        let edge = &s.edge;
        async move {
            let events = run(edge, json!({"adapter": "chat", "target": "agent", "input": input, "session_id": session})).await;
            check_stream(&events, "complete")
        }
    };
    assert_eq!(turn("first", "s1").await, "turn 1: first\n");
    assert_eq!(turn("second", "s1").await, "turn 2: second\n");
    assert_eq!(turn("other", "s2").await, "turn 1: other\n");
    let sessions = get_json(&s.edge.url("/v1/nodes/n1/commands/sessions")).await;
    assert_eq!(
        sessions["sessions"].as_array().unwrap().len(),
        2,
        "{sessions}"
    );

    let terminate = client()
        .delete(s.edge.url("/v1/sessions/n1/chat/agent/s1"))
        .send()
        .await
        .unwrap();
    assert_eq!(
        terminate.status(),
        200,
        "{}",
        terminate.text().await.unwrap()
    );
    // A fresh process: the count starts again.
    assert_eq!(turn("again", "s1").await, "turn 1: again\n");

    let unknown = client()
        .delete(s.edge.url("/v1/sessions/n1/chat/agent/nope"))
        .send()
        .await
        .unwrap();
    assert_eq!(unknown.status(), 404);
    let refused = client()
        .delete(s.edge.url("/v1/sessions/n1/mock/m/s1"))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 501);
    let body: Value = refused.json().await.unwrap();
    assert_eq!(body["error"]["code"], "not_supported", "{body}");
}

#[tokio::test]
async fn every_node_command_answers() {
    let s = setup().await;
    run(&s.edge, json!({"adapter": "mock", "input": "count me"})).await;
    let cmd = |name: &str| s.edge.url(&format!("/v1/nodes/n1/commands/{name}"));
    let caps = get_json(&cmd("capabilities")).await;
    let kinds: Vec<&str> = caps["adapters"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["kind"].as_str().unwrap())
        .collect();
    for kind in ["mock", "openai_compat", "vllm", "ollama", "cli"] {
        assert!(kinds.contains(&kind), "{caps}");
    }
    let slow = caps["adapters"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["id"] == "slowmock")
        .unwrap();
    assert_eq!(slow["max_concurrency"], 1);
    let transport = get_json(&cmd("transport")).await;
    assert_eq!(transport["state"], "ready", "{transport}");
    assert_eq!(transport["heartbeat"]["interval_sec"], 2);
    let usage = get_json(&cmd("usage")).await;
    assert_eq!(usage["adapters"]["mock"]["runs"], 1, "{usage}");
    assert_eq!(usage["adapters"]["mock"]["output_tokens"], 8);
    assert!(get_json(&cmd("sessions")).await["sessions"].is_array());
    assert!(get_json(&cmd("runs")).await["runs"].is_array());
    let tags = get_json(&format!("{}?adapter=ol", cmd("ollama.tags"))).await;
    assert_eq!(tags["models"][0]["name"], "mock-model:latest", "{tags}");
    let ps = get_json(&format!("{}?adapter=ol", cmd("ollama.ps"))).await;
    assert!(ps["models"].is_array());
    let show = get_json(&format!(
        "{}?adapter=ol&model=mock-model",
        cmd("ollama.show")
    ))
    .await;
    assert_eq!(show["modelfile"], "FROM mock-model");
    // Errors are clear.
    let wrong = client()
        .get(format!("{}?adapter=mock", cmd("ollama.tags")))
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), 501);
    let unknown = client().get(cmd("frobnicate")).send().await.unwrap();
    let body: Value = unknown.json().await.unwrap();
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("unknown command"),
        "{body}"
    );
    let offline = client()
        .get(s.edge.url("/v1/nodes/ghost/commands/capabilities"))
        .send()
        .await
        .unwrap();
    assert_eq!(offline.status(), 404);
}

#[tokio::test]
async fn the_store_holds_one_row_per_run_with_its_final_status() {
    let s = setup().await;
    let ok = run(
        &s.edge,
        json!({"adapter": "mock", "target": "m", "input": "x"}),
    )
    .await;
    let failed = run(
        &s.edge,
        json!({"adapter": "failing", "target": "f", "input": "x", "background": true}),
    )
    .await;
    let (cancel_id, response, seen) = start_streaming(
        &s.edge,
        json!({"adapter": "slowmock", "input": "x", "session_id": "sess"}),
        1,
    )
    .await;
    client()
        .post(s.edge.url(&format!("/v1/runs/{cancel_id}/cancel")))
        .send()
        .await
        .unwrap();
    rest(response, seen).await;
    let id = |events: &[(String, Value)]| events[0].1["run_id"].as_str().unwrap().to_string();
    let (ok_id, failed_id) = (id(&ok), id(&failed));
    let deadline = Instant::now() + Duration::from_secs(5);
    let rows = loop {
        let rows =
            get_json(&s.edge.url("/v1/nodes/n1/commands/runs?limit=10")).await["runs"].clone();
        let done = rows
            .as_array()
            .unwrap()
            .iter()
            .all(|r| r["status"] != "running");
        if rows.as_array().unwrap().len() == 3 && done {
            break rows;
        }
        assert!(Instant::now() < deadline, "rows: {rows}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let row = |id: &str| {
        rows.as_array()
            .unwrap()
            .iter()
            .find(|r| r["run_id"] == id)
            .unwrap()
            .clone()
    };
    assert_eq!(row(&ok_id)["status"], "completed");
    assert_eq!(row(&ok_id)["adapter"], "mock");
    assert_eq!(row(&ok_id)["target"], "m");
    assert!(
        row(&ok_id)["finished_at_ms"].as_i64().unwrap()
            >= row(&ok_id)["started_at_ms"].as_i64().unwrap()
    );
    assert_eq!(row(&failed_id)["status"], "failed");
    assert_eq!(row(&failed_id)["background"], true);
    assert!(
        row(&failed_id)["error"]
            .as_str()
            .unwrap()
            .contains("exited")
    );
    assert_eq!(row(&cancel_id)["status"], "cancelled");
    assert_eq!(row(&cancel_id)["session_id"], "sess");
    // The same rows are in the SQLite file itself.
    let db = rusqlite::Connection::open(s.dir.join("n1.db")).unwrap();
    let count: i64 = db
        .query_row("SELECT COUNT(*) FROM runs", [], |r| r.get(0))
        .unwrap();
    assert_eq!(count, 3);
}

#[tokio::test]
async fn a_failing_store_is_logged_and_runs_still_complete() {
    let s = setup().await;
    run(&s.edge, json!({"adapter": "mock", "input": "before"})).await;
    // Break the store under the running node.
    let db = rusqlite::Connection::open(s.dir.join("n1.db")).unwrap();
    db.execute_batch("DROP TABLE runs;").unwrap();
    drop(db);
    let events = run(&s.edge, json!({"adapter": "mock", "input": "after"})).await;
    check_stream(&events, "complete");
    s.node
        .wait_line("run store write failed", Duration::from_secs(5))
        .await;
}

#[tokio::test]
async fn a_client_that_stops_reading_stops_the_producer_instead_of_filling_memory() {
    let s = setup().await;
    let written = || -> u64 {
        std::fs::read_to_string(s.dir.join("written"))
            .ok()
            .and_then(|t| t.trim().parse().ok())
            .unwrap_or(0)
    };
    let mut response = client()
        .post(s.edge.url("/v1/runs"))
        .json(&json!({"adapter": "firehose", "input": "go"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    // Read a little, then stop reading: the program must soon be held up.
    let mut seen = String::new();
    read_until(&mut response, &mut seen, |t| t.contains("line 10 ")).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    let stalled_at = loop {
        let before = written();
        tokio::time::sleep(Duration::from_millis(700)).await;
        let after = written();
        if after == before && after > 0 {
            break after;
        }
        assert!(
            Instant::now() < deadline,
            "the program never slowed down: {after} lines"
        );
    };
    // Held by flow control: a few windows and socket buffers' worth, not everything.
    assert!(stalled_at < 2_000_000, "{stalled_at} lines buffered");
    eprintln!("producer held after {stalled_at} lines");
    // Reading again lets it go on.
    let mut more = 0;
    while written() <= stalled_at + 1000 {
        let chunk = tokio::time::timeout(Duration::from_secs(10), response.chunk())
            .await
            .expect("the stream moves again")
            .unwrap()
            .expect("the stream is still open");
        more += chunk.len();
    }
    assert!(more > 0);
    let run_id = seen
        .lines()
        .find_map(|l| l.strip_prefix("data: "))
        .and_then(|d| serde_json::from_str::<Value>(d).ok())
        .and_then(|v| v["run_id"].as_str().map(String::from))
        .unwrap();
    client()
        .post(s.edge.url(&format!("/v1/runs/{run_id}/cancel")))
        .send()
        .await
        .unwrap();
}

/// A run's stream is kept alive (`limits.http.stream_keepalive_sec`) while it waits for
/// its slot and while the run is silent: SSE comments every client ignores, then the
/// run's events as ever.
#[tokio::test]
async fn a_waiting_or_silent_run_is_kept_alive() {
    let dir = tempdir();
    let config = r#"
limits: {http: {stream_keepalive_sec: 1}}
nodes:
  - id: n1
    token: token-n1-0123456789
    providers:
      - {id: slow, kind: mock, max_concurrency: 1, mock: {tokens: 3, token_delay_ms: 1500}}
"#;
    let edge = std::sync::Arc::new(start_edge(dir.path(), config).await);
    let _node = start_node("n1", dir.path(), &edge.nodes, "token-n1-0123456789", "");
    wait_ready(&edge, "n1").await;
    let body = |input: &str| json!({"adapter": "slow", "input": input});
    let (_id, first, seen) = start_streaming(&edge, body("x"), 1).await;
    // The second waits for the slot the first holds.
    let second = {
        let edge = edge.clone();
        tokio::spawn(async move {
            let response = client()
                .post(edge.url("/v1/runs"))
                .json(&json!({"adapter": "slow", "input": "y"}))
                .send()
                .await
                .unwrap();
            assert_eq!(response.status(), 200);
            response.text().await.unwrap()
        })
    };
    check_stream(&rest(first, seen).await, "complete");
    let text = second.await.unwrap();
    assert!(
        text.starts_with(": keepalive\n\n"),
        "kept alive while it waited: {text}"
    );
    let events: Vec<(String, Value)> = sse_events(&text)
        .into_iter()
        .map(|(k, d)| (k, serde_json::from_str(&d).unwrap()))
        .collect();
    check_stream(&events, "complete");
    // Between its tokens (1.5 s apart) too.
    let after_start = &text[text.find("event: ").unwrap()..];
    assert!(
        after_start.contains(": keepalive\n\n"),
        "kept alive while silent: {text}"
    );
}
