//! The usage ledger and per-key limits with real processes: every request — served,
//! failed by its provider, refused, or left by its client — is in `/admin/usage` and
//! `/admin/usage/records` after an edge restart, with the tokens the clients were told;
//! a key over its requests-per-minute limit gets 429 with `Retry-After`; a tokens-per-day
//! budget trips once the ledger's count passes it and still holds after a restart.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::{Value, json};

const ALICE: &str = "sk-alice-0123456789";
const BOB: &str = "sk-bob-0123456789abc";
const LIMITED: &str = "sk-limited-0123456789";
const BUDGET: &str = "sk-budget-0123456789";
const SINGLE: &str = "sk-single-0123456789";

struct Setup {
    dir: tempfile::TempDir,
    edge: EdgeProc,
    _node: Proc,
    _mock: MockProc,
}

fn config(mock: &MockProc) -> String {
    format!(
        r#"
auth:
  keys:
    - {{name: ops, role: admin, key: {TEST_API_KEY}}}
    - {{name: alice, role: client, key: {ALICE}}}
    - {{name: bob, role: client, key: {BOB}}}
    - {{name: limited, role: client, key: {LIMITED}, limits: {{requests_per_minute: 10}}}}
    - {{name: budget, role: client, key: {BUDGET}, limits: {{tokens_per_day: 40}}}}
    - {{name: single, role: client, key: {SINGLE}, limits: {{max_concurrent: 1}}}}
nodes:
  - id: n1
    token: token-n1-0123456789
    providers:
      - {{id: oa, kind: openai_compat, base_url: "{b}", capacity: {{normal: 8}}}}
      - {{id: bad, kind: openai_compat, base_url: "{b}"}}
model_groups:
  - {{name: chat, members: [{{node: n1, provider: oa, model: mock-model}}]}}
  - {{name: slow, members: [{{node: n1, provider: oa, model: slow}}]}}
  - {{name: broken, members: [{{node: n1, provider: bad, model: fail-500}}]}}
"#,
        b = mock.openai_base(),
    )
}

async fn setup() -> Setup {
    let dir = tempdir();
    let mock = start_mock(&[]).await;
    let edge = start_edge(dir.path(), &config(&mock)).await;
    let node = start_node(
        "n1",
        dir.path(),
        &edge.nodes,
        "token-n1-0123456789",
        "reconnect: {max_attempts: 0, interval_sec: 1}",
    );
    wait_ready(&edge, "n1").await;
    Setup {
        dir,
        edge,
        _node: node,
        _mock: mock,
    }
}

/// Stops the edge cleanly (its ledger commits what is queued) and starts it again on the
/// same addresses and state directory.
async fn restart(s: &mut Setup) {
    let (nodes, http) = (s.edge.nodes.clone(), s.edge.http.clone());
    s.edge.proc.signal(nix::sys::signal::Signal::SIGTERM);
    let status = s.edge.proc.wait_exit(Duration::from_secs(30)).await;
    assert!(
        status.success(),
        "edge exit: {status}\n{}",
        s.edge.proc.log()
    );
    assert!(
        s.edge.proc.has_line("usage ledger closed"),
        "{}",
        s.edge.proc.log()
    );
    let text = std::fs::read_to_string(&s.edge.config).unwrap();
    s.edge = start_edge_on(s.dir.path(), &text, &nodes, &http).await;
}

async fn admin_get(edge: &EdgeProc, path: &str) -> Value {
    let response = client()
        .get(edge.url(path))
        .bearer_auth(TEST_API_KEY)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200, "{path}");
    response.json().await.unwrap()
}

/// Waits until the ledger holds `n` records.
async fn wait_records(edge: &EdgeProc, n: usize) -> Vec<Value> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let body = admin_get(edge, "/admin/usage/records?limit=1000").await;
        let records = body["records"].as_array().unwrap().clone();
        if records.len() >= n {
            assert_eq!(records.len(), n, "{body}");
            return records;
        }
        assert!(
            Instant::now() < deadline,
            "{} of {n} records: {body}",
            records.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What the clients were told, per key: (requests, ok, failed, input, output).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Told {
    requests: u64,
    ok: u64,
    failed: u64,
    input: u64,
    output: u64,
}

impl Told {
    fn served(&mut self, input: &Value, output: &Value) {
        self.requests += 1;
        self.ok += 1;
        self.input += input.as_u64().unwrap();
        self.output += output.as_u64().unwrap();
    }

    fn failed(&mut self) {
        self.requests += 1;
        self.failed += 1;
    }
}

async fn post(key: &str, path_url: String, body: Value) -> (u16, Value) {
    let response = client()
        .post(path_url)
        .bearer_auth(key)
        .header("x-api-key", key)
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

fn hi(model: &str) -> Value {
    json!({"model": model, "messages": [{"role": "user", "content": "Hi there, mock"}]})
}

#[tokio::test]
async fn every_request_is_in_the_ledger_after_a_restart_with_the_tokens_clients_were_told() {
    let mut s = setup().await;
    let chat_url = s.edge.url("/v1/chat/completions");
    let (mut alice, mut bob) = (Told::default(), Told::default());

    // alice: three answers on the OpenAI API, one on the Ollama API.
    for _ in 0..3 {
        let (status, body) = post(ALICE, chat_url.clone(), hi("chat")).await;
        assert_eq!(status, 200, "{body}");
        alice.served(
            &body["usage"]["prompt_tokens"],
            &body["usage"]["completion_tokens"],
        );
    }
    let mut ollama = hi("chat");
    ollama["stream"] = json!(false);
    let (status, body) = post(ALICE, s.edge.url("/api/chat"), ollama).await;
    assert_eq!(status, 200, "{body}");
    alice.served(&body["prompt_eval_count"], &body["eval_count"]);

    // bob: two streams that ask for usage, one Anthropic Messages answer.
    for _ in 0..2 {
        let mut body = hi("chat");
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
        let response = client()
            .post(&chat_url)
            .bearer_auth(BOB)
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let text = response.text().await.unwrap();
        let usage = sse_events(&text)
            .into_iter()
            .filter_map(|(_, data)| serde_json::from_str::<Value>(&data).ok())
            .find(|v| v["usage"].is_object())
            .unwrap_or_else(|| panic!("no usage chunk: {text}"));
        bob.served(
            &usage["usage"]["prompt_tokens"],
            &usage["usage"]["completion_tokens"],
        );
    }
    let mut messages = hi("chat");
    messages["max_tokens"] = json!(64);
    let (status, body) = post(BOB, s.edge.url("/v1/messages"), messages).await;
    assert_eq!(status, 200, "{body}");
    bob.served(
        &body["usage"]["input_tokens"],
        &body["usage"]["output_tokens"],
    );

    // bob: the provider fails (500, relayed).
    let (status, _) = post(BOB, chat_url.clone(), hi("broken")).await;
    assert_eq!(status, 500);
    bob.failed();
    // alice: a model that does not exist (refused before admission).
    let (status, _) = post(ALICE, chat_url.clone(), hi("nope")).await;
    assert_eq!(status, 404);
    alice.failed();
    // alice: a long stream she leaves after its first bytes.
    let mut body = hi("slow");
    body["stream"] = json!(true);
    let mut response = client()
        .post(&chat_url)
        .bearer_auth(ALICE)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let mut seen = String::new();
    read_until(&mut response, &mut seen, |t| t.contains("data:")).await;
    drop(response);
    alice.failed();

    let before = wait_records(&s.edge, 10).await;
    restart(&mut s).await;
    let records = wait_records(&s.edge, 10).await;
    assert_eq!(records, before, "the same records after the restart");

    // The summary per key says what the clients were told.
    let summary = admin_get(&s.edge, "/admin/usage?per=key").await;
    assert_eq!(summary["per"], json!(["key"]));
    assert_eq!(summary["by"], "total");
    assert_eq!(summary["dropped_records"], 0);
    for (name, told) in [("alice", alice), ("bob", bob)] {
        let row = summary["rows"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["key"] == name)
            .unwrap_or_else(|| panic!("no row for {name}: {summary}"));
        let got = Told {
            requests: row["requests"].as_u64().unwrap(),
            ok: row["ok"].as_u64().unwrap(),
            failed: row["failed"].as_u64().unwrap(),
            input: row["input_tokens"].as_u64().unwrap(),
            output: row["output_tokens"].as_u64().unwrap(),
        };
        assert_eq!(got, told, "{name}: {summary}");
    }

    // The raw records say how each ended.
    let of = |outcome: &str| -> Vec<&Value> {
        records.iter().filter(|r| r["outcome"] == outcome).collect()
    };
    assert_eq!(of("ok").len(), 7);
    let broken = of("provider_error");
    assert_eq!(broken.len(), 1, "{records:?}");
    assert_eq!(
        (&broken[0]["key"], &broken[0]["group"], &broken[0]["status"]),
        (&json!("bob"), &json!("broken"), &json!(500))
    );
    assert_eq!(
        (&broken[0]["node"], &broken[0]["provider"]),
        (&json!("n1"), &json!("bad"))
    );
    let refused = of("model_not_found");
    assert_eq!(refused.len(), 1, "{records:?}");
    assert_eq!(
        (&refused[0]["path"], &refused[0]["status"]),
        (&json!("none"), &json!(404))
    );
    let aborted = of("client_abort");
    assert_eq!(aborted.len(), 1, "{records:?}");
    assert_eq!(
        (&aborted[0]["group"], &aborted[0]["key"]),
        (&json!("slow"), &json!("alice"))
    );
    assert!(aborted[0]["ttft_ms"].is_u64(), "{:?}", aborted[0]);
    let apis: std::collections::BTreeSet<&str> =
        records.iter().map(|r| r["api"].as_str().unwrap()).collect();
    assert_eq!(
        apis.into_iter().collect::<Vec<_>>(),
        ["messages", "ollama", "openai"]
    );
    for r in of("ok") {
        assert_eq!(
            (&r["path"], &r["attempts"], &r["status"]),
            (&json!("tunnel"), &json!(1), &json!(200))
        );
        assert!(r["ttft_ms"].is_u64() && r["latency_ms"].is_u64(), "{r}");
    }
    // Filters and the failures the status page shows.
    let failed = admin_get(&s.edge, "/admin/usage/records?outcome=failed&limit=50").await;
    assert_eq!(failed["records"].as_array().unwrap().len(), 3);
    let bobs = admin_get(&s.edge, "/admin/usage?key=bob&per=group&by=hour").await;
    let rows = bobs["rows"].as_array().unwrap();
    assert!(rows.iter().all(|r| r["start"].is_string()), "{bobs}");
    let requests: u64 = rows.iter().map(|r| r["requests"].as_u64().unwrap()).sum();
    assert_eq!(requests, 4, "{bobs}");

    // `iop usage` prints the same as CSV.
    let (ok, out, err) =
        tls::iop_admin(&s.edge, &["usage", "--per", "key", "--format", "csv"]).await;
    assert!(ok, "{err}");
    let line = out
        .lines()
        .find(|l| l.starts_with("bob,"))
        .unwrap_or_else(|| panic!("{out}"));
    assert_eq!(
        line,
        format!("bob,4,3,1,{},{},0,0", bob.input, bob.output),
        "{out}"
    );
    let (ok, out, err) = tls::iop_admin(&s.edge, &["usage"]).await;
    assert!(ok, "{err}");
    assert!(
        out.starts_with("KEY") && out.contains("alice") && out.contains("slow"),
        "{out}"
    );

    // Bad parameters are 400s naming them.
    for (query, param) in [
        ("by=week", "by"),
        ("per=colour", "per"),
        ("since=yesterday", "since"),
        ("bogus=1", "bogus"),
        // No fleet: this edge has no shared store.
        ("scope=fleet", "scope"),
        ("scope=world", "scope"),
    ] {
        let response = client()
            .get(s.edge.url(&format!("/admin/usage?{query}")))
            .bearer_auth(TEST_API_KEY)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 400, "{query}");
        let body: Value = response.json().await.unwrap();
        assert_eq!(body["error"]["param"], param, "{body}");
    }
    let response = client()
        .get(s.edge.url("/admin/usage/records?limit=5000"))
        .bearer_auth(TEST_API_KEY)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 400);
    // Client keys may not read usage.
    let response = client()
        .get(s.edge.url("/admin/usage"))
        .bearer_auth(ALICE)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 403);
}

#[tokio::test]
async fn the_eleventh_request_in_a_minute_gets_429_with_retry_after() {
    let s = setup().await;
    let chat_url = s.edge.url("/v1/chat/completions");
    for i in 0..10 {
        let (status, body) = post(LIMITED, chat_url.clone(), hi("chat")).await;
        assert_eq!(status, 200, "request {i}: {body}");
    }
    let response = client()
        .post(&chat_url)
        .bearer_auth(LIMITED)
        .json(&hi("chat"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 429);
    let retry: u64 = response.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=60).contains(&retry), "Retry-After {retry}");
    let body: Value = response.json().await.unwrap();
    assert_eq!(
        body["error"]["code"], "requests_per_minute_exceeded",
        "{body}"
    );
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("10 requests per minute"),
        "{body}"
    );
    // In the shape of the API the request came in on.
    let response = client()
        .post(s.edge.url("/v1/messages"))
        .header("x-api-key", LIMITED)
        .json(&json!({"model": "chat", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 429);
    assert!(response.headers().contains_key("retry-after"));
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["type"], "error", "{body}");
    assert_eq!(body["error"]["type"], "rate_limit_error", "{body}");
    let response = client()
        .post(s.edge.url("/api/chat"))
        .bearer_auth(LIMITED)
        .json(&hi("chat"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 429);
    assert!(response.headers().contains_key("retry-after"));
    let body: Value = response.json().await.unwrap();
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains("requests per minute"),
        "{body}"
    );
    // Other keys are not limited; the refusals are in the ledger.
    let (status, _) = post(ALICE, chat_url, hi("chat")).await;
    assert_eq!(status, 200);
    let records = wait_records(&s.edge, 14).await;
    let refused = records
        .iter()
        .filter(|r| r["outcome"] == "requests_per_minute_exceeded")
        .count();
    assert_eq!(refused, 3, "{records:?}");
}

#[tokio::test]
async fn a_token_budget_trips_after_the_ledger_count_passes_it_and_holds_after_a_restart() {
    let mut s = setup().await;
    let chat_url = s.edge.url("/v1/chat/completions");
    let mut used = 0;
    let mut served = 0;
    // Each answer costs the same; the budget of 40 lets requests through until the count
    // reaches it (a request admitted below the budget may pass it), or until what is left
    // is less than a request's prompt.
    loop {
        let (status, body) = post(BUDGET, chat_url.clone(), hi("chat")).await;
        if status == 429 {
            assert_eq!(body["error"]["code"], "tokens_per_day_exceeded", "{body}");
            assert!(
                body["error"]["message"]
                    .as_str()
                    .unwrap()
                    .contains("40 tokens per day"),
                "{body}"
            );
            break;
        }
        assert_eq!(status, 200, "{body}");
        used += body["usage"]["total_tokens"].as_u64().unwrap();
        served += 1;
        assert!(served <= 40, "never refused");
        // The next request is asked after the ledger counted this one.
        wait_records(&s.edge, served).await;
    }
    let previous_cost = used / served as u64;
    assert!(
        used + previous_cost > 40,
        "refused at {used} tokens, with room for another request"
    );
    assert!(
        used - previous_cost < 40,
        "admitted only below the budget: {used}"
    );
    restart(&mut s).await;
    let response = client()
        .post(&chat_url)
        .bearer_auth(BUDGET)
        .json(&hi("chat"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 429, "the budget holds after a restart");
    let retry: u64 = response.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=86_400).contains(&retry), "until UTC midnight: {retry}");
    // Other keys still pass.
    wait_ready(&s.edge, "n1").await;
    let (status, body) = post(ALICE, chat_url, hi("chat")).await;
    assert_eq!(status, 200, "{body}");
}

#[tokio::test]
async fn a_concurrency_place_comes_back_when_the_client_leaves() {
    let s = setup().await;
    let chat_url = s.edge.url("/v1/chat/completions");
    let mut slow = hi("slow");
    slow["stream"] = json!(true);
    let mut first = client()
        .post(&chat_url)
        .bearer_auth(SINGLE)
        .json(&slow)
        .send()
        .await
        .unwrap();
    assert_eq!(first.status(), 200);
    let mut seen = String::new();
    read_until(&mut first, &mut seen, |t| t.contains("data:")).await;
    let (status, body) = post(SINGLE, chat_url.clone(), hi("chat")).await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(body["error"]["code"], "max_concurrent_exceeded", "{body}");
    // The client leaves the stream: once the edge recorded its end, the place is free.
    drop(first);
    let records = wait_records(&s.edge, 2).await;
    assert!(
        records.iter().any(|r| r["outcome"] == "client_abort"),
        "{records:?}"
    );
    let (status, body) = post(SINGLE, chat_url, hi("chat")).await;
    assert_eq!(status, 200, "{body}");
}
