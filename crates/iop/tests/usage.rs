//! Usage for every tunnelled stream, with real processes: a streamed request whose client
//! did not ask for usage is accounted with the provider's counts, while the client gets
//! exactly the bytes the provider sends for the request it made; a client that asked
//! still gets its usage chunk; a provider with `tunnel_usage: off` is sent the request
//! unchanged.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::{Value, json};

struct Setup {
    _dir: tempfile::TempDir,
    burst: MockProc,
    paced: MockProc,
    edge: EdgeProc,
    _node: Proc,
}

async fn setup() -> Setup {
    let dir = tempdir();
    // Answers in one burst (many events per frame) ...
    let burst = start_mock(&[]).await;
    // ... and one event at a time (an event per frame), reporting cached tokens.
    let paced = start_mock(&["--token-delay-ms", "3", "--cached-tokens", "3"]).await;
    let config = format!(
        r#"
nodes:
  - id: n1
    token: token-n1-0123456789
    providers:
      - {{id: oa, kind: openai_compat, base_url: "{b}"}}
      - {{id: vl, kind: vllm, base_url: "{p}"}}
      - {{id: plain, kind: openai_compat, base_url: "{b}", tunnel_usage: off}}
model_groups:
  - {{name: burst, members: [{{node: n1, provider: oa, model: mock-model}}]}}
  - {{name: paced, members: [{{node: n1, provider: vl, model: mock-model}}]}}
  - {{name: off, members: [{{node: n1, provider: plain, model: mock-model}}]}}
"#,
        b = burst.openai_base(),
        p = paced.openai_base(),
    );
    let edge = start_edge(dir.path(), &config).await;
    let node = start_node("n1", dir.path(), &edge.nodes, "token-n1-0123456789", "");
    wait_ready(&edge, "n1").await;
    Setup {
        _dir: dir,
        burst,
        paced,
        edge,
        _node: node,
    }
}

/// Status, content type and body of a POST.
async fn post(url: &str, body: &Value) -> (u16, String, String) {
    let response = client().post(url).json(body).send().await.unwrap();
    let status = response.status().as_u16();
    let content_type = response
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    // The edge adds each relayed event's id (for resuming), nothing else.
    let body = without_event_ids(&response.text().await.unwrap());
    (status, content_type, body)
}

/// The edge's event stream, open before the requests it should see.
async fn events(edge: &EdgeProc) -> reqwest::Response {
    let events = client()
        .get(edge.url("/admin/events"))
        .send()
        .await
        .unwrap();
    assert_eq!(events.status(), 200);
    events
}

/// Reads usage events until `n` arrived (bounded).
async fn usage_events(events: &mut reqwest::Response, n: usize) -> Vec<Value> {
    let mut text = String::new();
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let found: Vec<Value> = sse_events(&text)
            .into_iter()
            .filter(|(k, _)| k == "usage")
            .map(|(_, d)| serde_json::from_str(&d).unwrap())
            .collect();
        if found.len() >= n {
            return found;
        }
        assert!(
            Instant::now() < deadline,
            "only {} of {n} usage events: {text}",
            found.len()
        );
        if let Ok(Ok(Some(chunk))) =
            tokio::time::timeout(Duration::from_millis(500), events.chunk()).await
        {
            text.push_str(&String::from_utf8_lossy(&chunk));
        }
    }
}

fn chat(model: &str, include_usage: Option<bool>) -> Value {
    let mut body = json!({"model": model, "messages": [{"role": "user", "content": "Hi there"}], "stream": true});
    if let Some(include) = include_usage {
        body["stream_options"] = json!({"include_usage": include});
    }
    body
}

fn completion(model: &str) -> Value {
    json!({"model": model, "prompt": "Once upon a time", "stream": true})
}

#[tokio::test]
async fn a_stream_without_include_usage_is_accounted_and_byte_exact() {
    let s = setup().await;
    let mut events = events(&s.edge).await;
    let cases = [
        (
            &s.burst,
            "burst",
            "/chat/completions",
            chat("mock-model", None),
            chat("burst", None),
        ),
        (
            &s.burst,
            "burst",
            "/chat/completions",
            chat("mock-model", Some(false)),
            chat("burst", Some(false)),
        ),
        (
            &s.burst,
            "burst",
            "/completions",
            completion("mock-model"),
            completion("burst"),
        ),
        (
            &s.paced,
            "paced",
            "/chat/completions",
            chat("mock-model", None),
            chat("paced", None),
        ),
        (
            &s.paced,
            "paced",
            "/completions",
            completion("mock-model"),
            completion("paced"),
        ),
    ];
    for (mock, _, path, direct_body, iop_body) in &cases {
        let direct = post(&format!("{}{path}", mock.openai_base()), direct_body).await;
        assert!(
            !direct.2.contains("\"usage\""),
            "the mock added usage unasked: {}",
            direct.2
        );
        let via = post(&s.edge.url(&format!("/v1{path}")), iop_body).await;
        assert_eq!(via.0, 200, "{}", via.2);
        assert_eq!(
            via, direct,
            "{path} via {iop_body}: the client's bytes differ from the provider's direct answer"
        );
    }
    let usage = usage_events(&mut events, cases.len()).await;
    for (i, (_, group, path, _, _)) in cases.iter().enumerate() {
        let u = &usage[i];
        assert_eq!(u["model_group"], *group, "{u}");
        assert_eq!(u["path"], "tunnel", "{u}");
        let prompt_words = if path.contains("chat") { 2 } else { 4 };
        assert_eq!(
            (u["input_tokens"].as_u64(), u["output_tokens"].as_u64()),
            (Some(prompt_words), Some(16)),
            "{u}"
        );
        assert_eq!(u["served_model"], "mock-model", "{u}");
    }
    // The provider's breakdown comes through too.
    assert_eq!(usage[3]["cached_input_tokens"], 3, "{}", usage[3]);
}

#[tokio::test]
async fn a_client_that_asks_for_usage_gets_its_usage_chunk() {
    let s = setup().await;
    let mut events = events(&s.edge).await;
    for (mock, group) in [(&s.burst, "burst"), (&s.paced, "paced")] {
        let direct = post(
            &format!("{}/chat/completions", mock.openai_base()),
            &chat("mock-model", Some(true)),
        )
        .await;
        let via = post(
            &s.edge.url("/v1/chat/completions"),
            &chat(group, Some(true)),
        )
        .await;
        assert_eq!(via, direct, "{group}");
        let chunks = sse_events(&via.2);
        let usage_chunk: Value = serde_json::from_str(&chunks[chunks.len() - 2].1).unwrap();
        assert_eq!(usage_chunk["choices"], json!([]));
        assert_eq!(usage_chunk["usage"]["completion_tokens"], 16);
    }
    let usage = usage_events(&mut events, 2).await;
    assert_eq!(usage[0]["output_tokens"], 16);
    assert_eq!(usage[1]["output_tokens"], 16);
}

#[tokio::test]
async fn with_tunnel_usage_off_nothing_is_injected() {
    let s = setup().await;
    let mut events = events(&s.edge).await;
    // Off: the provider gets the request unchanged, so the stream has no usage at all
    // and none is recorded ...
    let direct = post(
        &format!("{}/chat/completions", s.burst.openai_base()),
        &chat("mock-model", None),
    )
    .await;
    let via = post(&s.edge.url("/v1/chat/completions"), &chat("off", None)).await;
    assert_eq!(via, direct);
    // ... while a client asking for usage still gets it, and it is recorded: the first
    // usage event is that request's (5 tokens), not the earlier one's (16).
    let mut body = chat("off", Some(true));
    body["max_tokens"] = json!(5);
    let asked = post(&s.edge.url("/v1/chat/completions"), &body).await;
    assert!(asked.2.contains("\"usage\":{"), "{}", asked.2);
    let usage = usage_events(&mut events, 1).await;
    assert_eq!(usage[0]["model_group"], "off");
    assert_eq!(
        usage[0]["output_tokens"], 5,
        "the stream without include_usage recorded usage: {usage:?}"
    );
}
