//! Request dispatch with real processes: the node owns its capacity (no request ever meets
//! a full node gate, with the OpenAI SDK closing streams at `[DONE]`, a `max_concurrency`
//! below the capacity, or native runs filling a member), failover before the first byte,
//! the node's acknowledgement deadline, the provider's idle timeout, and `/metrics`
//! counting what clients received.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::node_wire::FakeNode;
use common::sdk::{self, run_python};
use common::*;
use iop_proto::pb::envelope::Message;
use serde_json::{Value, json};

const TOKEN: &str = "token-n1-0123456789";

/// An edge, one node and a mock provider serving `config` (with `{oa}` the mock's OpenAI
/// API root).
async fn setup(config: &str, mock_args: &[&str]) -> (tempfile::TempDir, MockProc, EdgeProc, Proc) {
    let dir = tempdir();
    let mock = start_mock(mock_args).await;
    let config = config.replace("{oa}", &mock.openai_base());
    let edge = start_edge(dir.path(), &config).await;
    let node = start_node("n1", dir.path(), &edge.nodes, TOKEN, "");
    wait_ready(&edge, "n1").await;
    (dir, mock, edge, node)
}

fn node_refused_for_capacity(node: &Proc) -> bool {
    node.has_line("max concurrency")
}

const CAPACITY: &str = r#"
nodes:
  - id: n1
    token: token-n1-0123456789
    providers:
      - {id: wide, kind: openai_compat, base_url: "{oa}", capacity: {normal: 4}}
      - {id: narrow, kind: openai_compat, base_url: "{oa}", capacity: {normal: 4}, max_concurrency: 1}
      - {id: busy, kind: mock, capacity: {normal: 2}, mock: {tokens: 8, token_delay_ms: 2}}
      - {id: spare, kind: openai_compat, base_url: "{oa}", capacity: {normal: 2}}
model_groups:
  - {name: wide, members: [{node: n1, provider: wide, model: lingering}]}
  - {name: narrow, members: [{node: n1, provider: narrow, model: lingering}]}
  - {name: shared, members: [{node: n1, provider: busy, model: m}, {node: n1, provider: spare, model: lingering}]}
"#;

#[tokio::test]
async fn the_openai_sdk_streaming_at_twice_the_capacity_never_meets_a_full_node_gate() {
    let Some(python) = sdk::python("the OpenAI SDK at twice a group's capacity", &["openai"])
    else {
        return;
    };
    let (_dir, _mock, edge, node) =
        setup(CAPACITY, &["--tokens", "8", "--token-delay-ms", "2"]).await;
    let base = edge.url("/v1");
    let sdk = |model: &'static str, concurrency: &'static str| {
        let (python, base) = (python.clone(), base.clone());
        async move {
            let (ok, stdout, stderr) = run_python(
                &python,
                "capacity_check.py",
                &[&base, model, "200", concurrency],
                Duration::from_secs(300),
            )
            .await;
            assert!(ok, "{model}: {stdout}\n{stderr}");
            let summary: Value = serde_json::from_str(stdout.trim()).unwrap();
            assert_eq!(summary["completed"], 200, "{model}: {summary}");
        }
    };
    // Capacity 4, eight SDK clients: the slot goes to the next stream only once the node
    // freed it, although the SDK closes each stream at [DONE], well before the provider
    // (`lingering`) ends its response and the node its tunnel.
    sdk("wide", "8").await;
    // Capacity 4 but the node's gate (max_concurrency) is 1: the edge never sends more,
    // and the status says so.
    sdk("narrow", "8").await;
    let s = status(&edge).await;
    let narrow = provider_of(&s, "n1", "narrow");
    assert_eq!(
        (&narrow["capacity"]["normal"], &narrow["max_in_flight"]),
        (&json!(4), &json!(1)),
        "{s}"
    );
    assert_eq!(provider_of(&s, "n1", "wide")["max_in_flight"], 4, "{s}");
    // Native runs fill one member of a two-member group: its requests go to the other.
    let mut hogs = Vec::new();
    for _ in 0..2 {
        let mut response = client()
            .post(edge.url("/v1/runs"))
            .json(&json!({"adapter": "busy", "target": "mock-hang", "input": "hold"}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let mut seen = String::new();
        read_until(&mut response, &mut seen, |s| s.contains("event: start")).await;
        hogs.push(response);
    }
    let s = status(&edge).await;
    assert_eq!(
        provider_of(&s, "n1", "busy")["in_flight"]["normal"],
        2,
        "{s}"
    );
    sdk("shared", "8").await;
    drop(hogs);
    wait_idle(&edge).await;
    assert!(
        !node_refused_for_capacity(&node),
        "the node's gate refused a request: {}",
        node.log()
    );
}

const DEADLINES: &str = r#"
nodes:
  - id: n1
    token: token-n1-0123456789
    providers:
      - {id: stall, kind: openai_compat, base_url: "{oa}", idle_timeout_sec: 1}
      - {id: hangs, kind: mock, idle_timeout_sec: 1}
model_groups:
  - {name: stall, members: [{node: n1, provider: stall, model: stall-after-head}]}
  - {name: hang-run, members: [{node: n1, provider: hangs, model: mock-hang}]}
"#;

#[tokio::test]
async fn a_provider_silent_after_its_head_ends_with_one_error_at_the_idle_timeout() {
    let (_dir, mock, edge, _node) = setup(DEADLINES, &[]).await;
    for (model, path) in [("stall", "tunnel"), ("hang-run", "run")] {
        let mut response = client()
            .post(edge.url("/v1/chat/completions"))
            .json(&json!({"model": model, "stream": true, "messages": [{"role": "user", "content": "hi"}]}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200, "{model}");
        let mut seen = String::new();
        read_until(&mut response, &mut seen, |s| s.contains("\"role\"")).await;
        // The stall is ended by the edge: one error event, no [DONE]. (A 1 s idle
        // timeout; the bound only keeps a broken edge from hanging the test.)
        read_to_end(&mut response, &mut seen, Duration::from_secs(15)).await;
        let errors: Vec<Value> = sse_events(&seen)
            .into_iter()
            .filter_map(|(_, d)| serde_json::from_str::<Value>(&d).ok())
            .filter(|v| v.get("error").is_some())
            .collect();
        assert_eq!(errors.len(), 1, "{model}: {seen}");
        assert_eq!(
            errors[0]["error"]["code"], "provider_idle_timeout",
            "{seen}"
        );
        assert!(!seen.contains("[DONE]"), "{seen}");
        // The slot is returned once the node confirmed the cancel.
        wait_idle(&edge).await;
        let metrics = get_text(&edge.url("/metrics")).await;
        let line = format!(
            "iop_requests_total{{model_group=\"{model}\",path=\"{path}\",outcome=\"provider_idle_timeout\"}} 1"
        );
        assert!(metrics.contains(&line), "{line}\n{metrics}");
    }
    // The stalled provider's connection was closed.
    mock.wait_aborted(1, Duration::from_secs(10)).await;
}

/// A fake node for `nodes[].id: fake` that hands each frame it receives to `on_frame`
/// (which returns false to drop the connection).
async fn fake_node(
    edge: &EdgeProc,
    on_frame: impl Fn(&Message) -> bool + Send + 'static,
) -> Arc<std::sync::Mutex<Vec<Message>>> {
    let (mut node, answer) =
        FakeNode::register("127.0.0.1", &edge.nodes, "token-fake-0123456789").await;
    assert!(answer.accepted, "{}", answer.reason);
    node.ready().await;
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = seen.clone();
    tokio::spawn(async move {
        while let Some(message) = node.next(Duration::from_secs(3600)).await {
            let keep = on_frame(&message);
            log.lock().unwrap().push(message);
            if !keep {
                return; // dropping the node closes its connection
            }
        }
    });
    seen
}

#[tokio::test]
async fn a_node_that_never_acknowledges_a_dispatch_fails_it_at_the_bound() {
    let dir = tempdir();
    let config = r#"
dispatch: {ack_timeout_sec: 1}
nodes:
  - id: fake
    token: token-fake-0123456789
    providers: [{id: p, kind: mock}]
model_groups:
  - {name: g, members: [{node: fake, provider: p}]}
"#;
    let edge = start_edge(dir.path(), config).await;
    let seen = fake_node(&edge, |_| true).await;
    wait_ready(&edge, "fake").await;
    let started = Instant::now();
    let response = client()
        .post(edge.url("/v1/chat/completions"))
        .json(&json!({"model": "g", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    let took = started.elapsed();
    assert_eq!(response.status(), 504);
    assert_eq!(response.headers()["x-iop-error"], "node_timeout");
    assert_eq!(response.headers()["x-iop-attempts"], "1");
    let body: Value = response.json().await.unwrap();
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("did not acknowledge"),
        "{body}"
    );
    assert!(took >= Duration::from_millis(900), "failed early: {took:?}");
    // The node was told to drop the run, and the slot came back after the bound.
    wait_idle(&edge).await;
    let frames = seen.lock().unwrap().clone();
    let run_id = frames
        .iter()
        .find_map(|m| match m {
            Message::RunRequest(r) => Some(r.run_id.clone()),
            _ => None,
        })
        .expect("the run reached the fake node");
    assert!(
        frames
            .iter()
            .any(|m| matches!(m, Message::CancelRequest(c) if c.run_id == run_id)),
        "{frames:?}"
    );
}

#[tokio::test]
async fn without_a_re_attach_wait_a_dispatch_whose_link_drops_before_the_accept_completes_on_another_member()
 {
    let dir = tempdir();
    let mock = start_mock(&[]).await;
    // With a re-attach wait (the default) the edge would wait for the fake node to come
    // back (tests/reattach.rs); without one, a dispatch the node had not acknowledged goes
    // to another member at once.
    let config = format!(
        r#"
dispatch: {{reattach_wait_sec: 0}}
nodes:
  - id: fake
    token: token-fake-0123456789
    providers: [{{id: oa, kind: openai_compat, base_url: "http://127.0.0.1:1/v1"}}]
  - id: n1
    token: token-n1-0123456789
    providers:
      - {{id: m, kind: mock, mock: {{tokens: 5}}}}
      - {{id: limited, kind: openai_compat, base_url: "{oa}"}}
model_groups:
  - {{name: g, members: [{{node: fake, provider: oa, model: x}}, {{node: n1, provider: m}}]}}
  - {{name: limited, members: [{{node: n1, provider: limited, model: rate-limit-429}}, {{node: n1, provider: m}}]}}
"#,
        oa = mock.openai_base()
    );
    let edge = start_edge(dir.path(), &config).await;
    let _node = start_node("n1", dir.path(), &edge.nodes, TOKEN, "");
    wait_ready(&edge, "n1").await;
    // The fake member goes away as soon as a request reaches it, before accepting it.
    let seen = fake_node(&edge, |m| !matches!(m, Message::ProviderTunnelRequest(_))).await;
    wait_ready(&edge, "fake").await;
    // Both members are idle: the first in the group's order gets the first request.
    let (status, attempts, body) = chat(&edge, "g").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(attempts, "2", "{body}");
    assert!(
        seen.lock()
            .unwrap()
            .iter()
            .any(|m| matches!(m, Message::ProviderTunnelRequest(_))),
        "the first attempt went to the fake member"
    );
    let answer: Value = serde_json::from_str(&body).unwrap();
    assert!(
        answer["choices"][0]["message"]["content"].is_string(),
        "{body}"
    );
    edge.proc
        .wait_line("code=\"node_disconnected\"", Duration::from_secs(5))
        .await;
    // A provider answering 429 with nothing streamed: the request goes to the other member.
    let (status, attempts, body) = chat(&edge, "limited").await;
    assert_eq!((status, attempts.as_str()), (200, "2"), "{body}");
    wait_idle(&edge).await;
}

/// One chat completion: status, `x-iop-attempts`, body.
async fn chat(edge: &EdgeProc, model: &str) -> (u16, String, String) {
    let response = client()
        .post(edge.url("/v1/chat/completions"))
        .json(&json!({"model": model, "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    let attempts = response
        .headers()
        .get("x-iop-attempts")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    (status, attempts, response.text().await.unwrap())
}

const MIXED: &str = r#"
nodes:
  - id: n1
    token: token-n1-0123456789
    providers:
      - {id: oa, kind: openai_compat, base_url: "{oa}"}
      - {id: m, kind: mock, mock: {tokens: 6}}
model_groups:
  - {name: ok-tunnel, members: [{node: n1, provider: oa, model: mock-model}]}
  - {name: ok-run, members: [{node: n1, provider: m}]}
  - {name: slow, members: [{node: n1, provider: oa, model: slow}]}
  - {name: fail, members: [{node: n1, provider: oa, model: fail-500}]}
  - {name: torn, members: [{node: n1, provider: oa, model: torn-mid-stream}]}
  - {name: run-error, members: [{node: n1, provider: m, model: mock-error}]}
"#;

/// What one client saw, as the outcome label it should be counted under.
async fn outcome_seen(edge: &EdgeProc, model: &str, stream: bool, abort: bool) -> String {
    let mut response = client()
        .post(edge.url("/v1/chat/completions"))
        .json(&json!({"model": model, "stream": stream, "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    if abort {
        let mut seen = String::new();
        read_until(&mut response, &mut seen, |s| s.contains("content")).await;
        return "client_abort".into();
    }
    let error_header = response
        .headers()
        .get("x-iop-error")
        .map(|v| v.to_str().unwrap().to_string());
    let body = response.text().await.unwrap();
    if status != 200 {
        // An error of the edge's names its reason; a provider's own answer is relayed.
        return error_header.unwrap_or_else(|| match status {
            500..=599 => "provider_error".into(),
            other => format!("status {other}"),
        });
    }
    if !stream {
        return "ok".into();
    }
    let events = sse_events(&body);
    for (_, data) in &events {
        if let Ok(v) = serde_json::from_str::<Value>(data)
            && let Some(code) = v["error"]["code"].as_str()
        {
            return code.to_string();
        }
    }
    assert!(body.contains("[DONE]"), "{model}: {body}");
    "ok".into()
}

/// `(model_group, path, outcome) → count` of `iop_requests_total`, and the sample counts of
/// the latency histograms by model group, from a Prometheus text exposition.
type Counts = HashMap<(String, String, String), u64>;

fn parse_metrics(text: &str) -> (Counts, HashMap<String, u64>, HashMap<String, u64>) {
    use openmetrics_parser::PrometheusValue;
    let exposition = openmetrics_parser::prometheus::parse_prometheus(text)
        .unwrap_or_else(|e| panic!("not Prometheus text: {e:?}\n{text}"));
    for (name, family) in &exposition.families {
        assert!(!family.help.is_empty(), "{name} has no help text");
    }
    let mut requests = Counts::new();
    for sample in exposition.families["iop_requests_total"].iter_samples() {
        let labels = sample.get_labelset().unwrap();
        let label = |k| labels.get_label_value(k).unwrap().to_string();
        let PrometheusValue::Counter(c) = &sample.value else {
            panic!("iop_requests_total is a counter")
        };
        requests.insert(
            (label("model_group"), label("path"), label("outcome")),
            c.value.as_f64() as u64,
        );
    }
    let histogram = |name: &str| -> HashMap<String, u64> {
        let Some(family) = exposition.families.get(name) else {
            return HashMap::new();
        };
        family
            .iter_samples()
            .map(|sample| {
                let group = sample
                    .get_labelset()
                    .unwrap()
                    .get_label_value("model_group")
                    .unwrap()
                    .to_string();
                let PrometheusValue::Histogram(h) = &sample.value else {
                    panic!("{name} is a histogram")
                };
                (group, h.count.unwrap_or(0))
            })
            .collect()
    };
    (
        requests,
        histogram("iop_request_duration_seconds"),
        histogram("iop_time_to_first_token_seconds"),
    )
}

#[tokio::test]
async fn metrics_parse_and_count_outcomes_as_clients_saw_them() {
    let (_dir, _mock, edge, _node) = setup(MIXED, &[]).await;
    // (model group, path, stream, abort, how many)
    let plan = [
        ("ok-tunnel", "tunnel", true, false, 3),
        ("ok-run", "run", false, false, 2),
        ("slow", "tunnel", true, true, 2),
        ("fail", "tunnel", false, false, 2),
        ("torn", "tunnel", true, false, 2),
        ("run-error", "run", true, false, 2),
    ];
    let mut expected = Counts::new();
    for (model, path, stream, abort, n) in plan {
        for _ in 0..n {
            let outcome = outcome_seen(&edge, model, stream, abort).await;
            *expected
                .entry((model.to_string(), path.to_string(), outcome))
                .or_default() += 1;
        }
    }
    // What clients saw covers every outcome the suite is about.
    let outcomes: std::collections::BTreeSet<&str> =
        expected.keys().map(|(_, _, o)| o.as_str()).collect();
    for wanted in ["ok", "client_abort", "provider_error", "broken_stream"] {
        assert!(outcomes.contains(wanted), "{outcomes:?}");
    }
    // Aborted streams are counted when the edge notices the client left: wait for that.
    let deadline = Instant::now() + Duration::from_secs(20);
    let (requests, durations, first_tokens) = loop {
        let text = get_text(&edge.url("/metrics")).await;
        let parsed = parse_metrics(&text);
        if parsed.0 == expected || Instant::now() > deadline {
            break parsed;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(requests, expected);
    for (model, _, _, _, n) in plan {
        assert_eq!(
            durations.get(model).copied(),
            Some(n),
            "{model}: {durations:?}"
        );
    }
    // Every group whose provider produced output has a time to first token.
    for model in ["ok-tunnel", "ok-run", "slow", "torn", "run-error"] {
        assert!(
            first_tokens.get(model).copied().unwrap_or(0) > 0,
            "{model}: {first_tokens:?}"
        );
    }
    // OpenMetrics when the scraper asks for it.
    let response = client()
        .get(edge.url("/metrics"))
        .header("accept", "application/openmetrics-text; version=1.0.0")
        .send()
        .await
        .unwrap();
    assert!(
        response.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("application/openmetrics-text"),
    );
    let text = response.text().await.unwrap();
    openmetrics_parser::openmetrics::parse_openmetrics(&text)
        .unwrap_or_else(|e| panic!("not OpenMetrics: {e:?}\n{text}"));
    wait_idle(&edge).await;
}
