//! The OpenAI-compatible surface with real processes: raw-tunnel passthrough, rendered
//! responses from an Ollama member, usage events, client aborts, provider failures and
//! client errors in OpenAI's error shape.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::{Value, json};

struct Setup {
    _dir: tempfile::TempDir,
    plain: MockProc,
    cached: MockProc,
    edge: EdgeProc,
    node: Proc,
}

async fn setup_with(auth: &str) -> Setup {
    let dir = tempdir();
    let plain = start_mock(&[]).await;
    let cached = start_mock(&["--cached-tokens", "7"]).await;
    let config = format!(
        r#"
{auth}
limits: {{max_body_bytes: 4096}}
nodes:
  - id: n1
    token: token-n1-0123456789
    providers:
      - {{id: oa, kind: openai_compat, base_url: "{a}"}}
      - {{id: oac, kind: vllm, base_url: "{c}"}}
      - {{id: ol, kind: ollama, base_url: "{o}"}}
      - {{id: dead, kind: openai_compat, base_url: "http://127.0.0.1:9/v1"}}
      - {{id: impatient, kind: openai_compat, base_url: "{a}", request_timeout_sec: 1, stream_head_timeout_sec: 2}}
model_groups:
  - {{name: tunnel, members: [{{node: n1, provider: oa, model: mock-model}}]}}
  - {{name: cached, members: [{{node: n1, provider: oac, model: mock-model}}]}}
  - {{name: reasoning, members: [{{node: n1, provider: oa, model: reasoning-model}}]}}
  - {{name: ollama, members: [{{node: n1, provider: ol, model: mock-model}}]}}
  - {{name: dead, members: [{{node: n1, provider: dead, model: x}}]}}
  - {{name: hang, members: [{{node: n1, provider: impatient, model: hang}}]}}
  - {{name: fail, members: [{{node: n1, provider: oa, model: fail-500}}]}}
  - {{name: ollama-fail, members: [{{node: n1, provider: ol, model: fail-500}}]}}
  - {{name: slow-tunnel, members: [{{node: n1, provider: oa, model: slow}}]}}
  - {{name: slow-ollama, members: [{{node: n1, provider: ol, model: slow}}]}}
  - {{name: midfail-tunnel, members: [{{node: n1, provider: oa, model: error-mid-stream}}]}}
  - {{name: midfail-ollama, members: [{{node: n1, provider: ol, model: error-mid-stream}}]}}
"#,
        a = plain.openai_base(),
        c = cached.openai_base(),
        o = plain.ollama_base(),
    );
    let edge = start_edge(dir.path(), &config).await;
    let node = start_node("n1", dir.path(), &edge.nodes, "token-n1-0123456789", "");
    wait_ready(&edge, "n1").await;
    Setup {
        _dir: dir,
        plain,
        cached,
        edge,
        node,
    }
}

async fn setup() -> Setup {
    setup_with("").await
}

fn chat(model: &str, stream: bool) -> Value {
    let mut body = json!({"model": model, "messages": [{"role": "user", "content": "Hi there"}], "stream": stream});
    if stream {
        body["stream_options"] = json!({"include_usage": true});
    }
    body
}

async fn post(url: &str, body: &Value) -> (u16, String, String) {
    let response = client().post(url).json(body).send().await.unwrap();
    let status = response.status().as_u16();
    let content_type = response
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    (status, content_type, response.text().await.unwrap())
}

#[tokio::test]
async fn tunnelled_responses_are_the_providers_bytes() {
    let s = setup().await;
    for stream in [false, true] {
        for (path, body_direct, body_iop) in [
            (
                "/chat/completions",
                chat("mock-model", stream),
                chat("tunnel", stream),
            ),
            (
                "/completions",
                json!({"model": "mock-model", "prompt": "Once", "stream": stream}),
                json!({"model": "tunnel", "prompt": "Once", "stream": stream}),
            ),
        ] {
            let direct = post(&format!("{}{path}", s.plain.openai_base()), &body_direct).await;
            let mut via = post(&s.edge.url(&format!("/v1{path}")), &body_iop).await;
            assert_eq!(via.0, 200, "{}", via.2);
            if stream {
                // The only addition: each event's id, for a client's resume.
                assert!(via.2.contains("\nid: "), "{}", via.2);
                via.2 = without_event_ids(&via.2);
            }
            assert_eq!(
                via, direct,
                "{path} stream={stream}: the edge changed the provider's response"
            );
        }
    }
    let direct = post(
        &format!("{}/embeddings", s.plain.openai_base()),
        &json!({"model": "mock-model", "input": ["a b", "c"]}),
    )
    .await;
    let via = post(
        &s.edge.url("/v1/embeddings"),
        &json!({"model": "tunnel", "input": ["a b", "c"]}),
    )
    .await;
    assert_eq!(via, direct);
}

/// The edge and the node run one event-loop thread by default; with `--threads 2` they
/// run thread pools, and the relay must answer exactly the same.
#[tokio::test]
async fn edge_and_node_on_thread_pools_relay_the_same() {
    let dir = tempdir();
    let mock = start_mock(&[]).await;
    let config = format!(
        r#"
nodes:
  - id: n1
    token: token-n1-0123456789
    providers:
      - {{id: oa, kind: openai_compat, base_url: "{a}"}}
      - {{id: m, kind: mock}}
model_groups:
  - {{name: tunnel, members: [{{node: n1, provider: oa, model: mock-model}}]}}
  - {{name: rendered, members: [{{node: n1, provider: m}}]}}
"#,
        a = mock.openai_base(),
    );
    let edge = start_edge_with(dir.path(), &config, &["--threads", "2"]).await;
    let _node = start_node_with(
        "n1",
        dir.path(),
        &edge.nodes,
        "token-n1-0123456789",
        "",
        &["--threads", "2"],
    );
    wait_ready(&edge, "n1").await;
    for stream in [false, true] {
        let direct = post(
            &format!("{}/chat/completions", mock.openai_base()),
            &chat("mock-model", stream),
        )
        .await;
        let mut via = post(&edge.url("/v1/chat/completions"), &chat("tunnel", stream)).await;
        assert_eq!(via.0, 200, "{}", via.2);
        via.2 = without_event_ids(&via.2);
        assert_eq!(via, direct, "stream={stream}");
        let (status, _, body) =
            post(&edge.url("/v1/chat/completions"), &chat("rendered", stream)).await;
        assert_eq!(status, 200, "{body}");
        if stream {
            assert!(body.ends_with("data: [DONE]\n\n"), "{body}");
        } else {
            let v: Value = serde_json::from_str(&body).unwrap();
            assert_eq!(v["object"], "chat.completion");
        }
    }
}

#[tokio::test]
async fn an_ollama_member_answers_in_openai_shape() {
    let s = setup().await;
    let (status, content_type, body) =
        post(&s.edge.url("/v1/chat/completions"), &chat("ollama", false)).await;
    assert_eq!(
        (status, content_type.as_str()),
        (200, "application/json"),
        "{body}"
    );
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], "ollama");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert!(
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .starts_with("Hello from")
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["usage"]["completion_tokens"], 16);
    assert_eq!(v["usage"]["prompt_tokens"], 2);
    assert_eq!(v["usage"]["total_tokens"], 18);

    let (status, content_type, body) =
        post(&s.edge.url("/v1/chat/completions"), &chat("ollama", true)).await;
    assert_eq!((status, content_type.as_str()), (200, "text/event-stream"));
    let events = sse_events(&body);
    assert_eq!(events.last().unwrap().1, "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|(_, d)| serde_json::from_str(d).unwrap())
        .collect();
    assert!(
        chunks
            .iter()
            .all(|c| c["object"] == "chat.completion.chunk")
    );
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert!(text.starts_with("Hello from"), "{text}");
    let usage_chunk = chunks.last().unwrap();
    assert_eq!(usage_chunk["choices"], json!([]));
    assert_eq!(usage_chunk["usage"]["completion_tokens"], 16);
    let finish = &chunks[chunks.len() - 2]["choices"][0]["finish_reason"];
    assert_eq!(finish, "stop");

    // Without include_usage there is no usage chunk.
    let mut body = chat("ollama", true);
    body.as_object_mut().unwrap().remove("stream_options");
    let (_, _, text) = post(&s.edge.url("/v1/chat/completions"), &body).await;
    assert!(!text.contains("\"usage\""), "{text}");

    // Legacy completions are rendered too.
    let (status, _, body) = post(
        &s.edge.url("/v1/completions"),
        &json!({"model": "ollama", "prompt": "Once"}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["object"], "text_completion");
    assert!(
        v["choices"][0]["text"]
            .as_str()
            .unwrap()
            .starts_with("Hello")
    );
    // Embeddings are not served by an Ollama member: a clear 400.
    let (status, _, body) = post(
        &s.edge.url("/v1/embeddings"),
        &json!({"model": "ollama", "input": "x"}),
    )
    .await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body.contains("embeddings are served by openai_compat and vllm providers only"),
        "{body}"
    );
}

/// Collects usage events from the edge's event stream until `n` arrived.
async fn usage_events(mut events: reqwest::Response, n: usize) -> Vec<Value> {
    let mut text = String::new();
    let deadline = Instant::now() + Duration::from_secs(10);
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
            "only {} usage events: {text}",
            found.len()
        );
        if let Ok(Ok(Some(chunk))) =
            tokio::time::timeout(Duration::from_millis(500), events.chunk()).await
        {
            text.push_str(&String::from_utf8_lossy(&chunk));
        }
    }
}

#[tokio::test]
async fn usage_events_carry_the_provider_reported_breakdown() {
    let s = setup().await;
    let events = client()
        .get(s.edge.url("/admin/events"))
        .send()
        .await
        .unwrap();
    let requests = [
        chat("tunnel", false),
        chat("tunnel", true),
        chat("reasoning", true),
        chat("cached", false),
        chat("ollama", false),
    ];
    for body in &requests {
        let (status, _, text) = post(&s.edge.url("/v1/chat/completions"), body).await;
        assert_eq!(status, 200, "{text}");
    }
    let usage = usage_events(events, requests.len()).await;
    let by = |i: usize| &usage[i];
    // Plain: input/output only; nothing invented.
    for i in [0, 1] {
        assert_eq!(by(i)["model_group"], "tunnel");
        assert_eq!(
            (
                by(i)["input_tokens"].as_u64(),
                by(i)["output_tokens"].as_u64()
            ),
            (Some(2), Some(16)),
            "{}",
            by(i)
        );
        assert!(
            by(i).get("reasoning_tokens").is_none() && by(i).get("cached_input_tokens").is_none(),
            "{}",
            by(i)
        );
        assert_eq!(
            (by(i)["node_id"].as_str(), by(i)["provider_id"].as_str()),
            (Some("n1"), Some("oa"))
        );
        assert_eq!(by(i)["path"], "tunnel");
        // The model the provider's response named (the member's upstream model).
        assert_eq!(by(i)["served_model"], "mock-model", "{}", by(i));
    }
    assert_eq!(by(2)["reasoning_tokens"], 2, "{}", by(2));
    assert!(by(2).get("cached_input_tokens").is_none());
    assert_eq!(by(3)["cached_input_tokens"], 7, "{}", by(3));
    assert_eq!(by(3)["provider_id"], "oac");
    assert_eq!(by(4)["path"], "run");
    assert_eq!(by(4)["output_tokens"], 16);
    assert_eq!(by(4)["served_model"], "mock-model", "{}", by(4));
    assert_eq!(by(2)["served_model"], "reasoning-model", "{}", by(2));
    // The same counts reach /metrics.
    let metrics = get_text(&s.edge.url("/metrics")).await;
    assert!(metrics.contains("iop_usage_tokens_total{model_group=\"cached\",node=\"n1\",provider=\"oac\",api_key=\"(none)\",kind=\"cached_input\"} 7"), "{metrics}");
    let _ = &s.cached;
}

/// Starts a streaming request, reads a few chunks, and drops the connection.
async fn drop_mid_stream(url: &str, model: &str) {
    let mut response = client()
        .post(url)
        .json(&chat(model, true))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let mut seen = 0;
    while seen < 3 {
        response.chunk().await.unwrap().expect("stream ended early");
        seen += 1;
    }
    drop(response);
}

#[tokio::test]
async fn a_client_that_drops_mid_stream_closes_the_provider_connection() {
    let s = setup().await;
    drop_mid_stream(&s.edge.url("/v1/chat/completions"), "slow-tunnel").await;
    s.plain.wait_aborted(1, Duration::from_secs(5)).await;
    drop_mid_stream(&s.edge.url("/v1/chat/completions"), "slow-ollama").await;
    s.plain.wait_aborted(2, Duration::from_secs(5)).await;
    // Nothing keeps a slot: in-flight is back to 0.
    wait_status(&s.edge, Duration::from_secs(5), "in_flight 0", |st| {
        node_status(st, "n1")["providers"]
            .as_array()
            .unwrap()
            .iter()
            .all(|p| p["in_flight"] == json!({"normal": 0, "long": 0}))
    })
    .await;
}

fn error_of(body: &str) -> Value {
    let v: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"));
    let e = v["error"].clone();
    assert!(
        e["message"].is_string() && e["type"].is_string() && e.get("code").is_some(),
        "not OpenAI's error shape: {body}"
    );
    e
}

#[tokio::test]
async fn client_errors_come_back_in_openai_error_shape() {
    let s = setup_with(&format!(
        "auth: {{keys: [{{name: tester, role: admin, key: {TEST_API_KEY}}}]}}"
    ))
    .await;
    let url = s.edge.url("/v1/chat/completions");
    let c = client();
    let missing = c
        .post(&url)
        .json(&chat("tunnel", false))
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), 401);
    assert!(
        error_of(&missing.text().await.unwrap())["message"]
            .as_str()
            .unwrap()
            .contains("Bearer")
    );
    let models = c.get(s.edge.url("/v1/models")).send().await.unwrap();
    assert_eq!(models.status(), 401);

    let authed = |b: reqwest::RequestBuilder| b.bearer_auth(TEST_API_KEY);
    let ok = authed(c.post(&url))
        .json(&chat("tunnel", false))
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
    let models: Value = authed(c.get(s.edge.url("/v1/models")))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["object"], "list");
    assert!(
        models["data"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m["id"] == "tunnel" && m["object"] == "model")
    );

    let unknown = authed(c.post(&url))
        .json(&chat("gpt-17", false))
        .send()
        .await
        .unwrap();
    assert_eq!(unknown.status(), 404);
    let e = error_of(&unknown.text().await.unwrap());
    assert_eq!(e["code"], "model_not_found");
    assert!(e["message"].as_str().unwrap().contains("gpt-17"));

    let invalid = authed(c.post(&url))
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(invalid.status(), 400);
    assert_eq!(
        error_of(&invalid.text().await.unwrap())["code"],
        "invalid_json"
    );

    let no_model = authed(c.post(&url))
        .json(&json!({"messages": []}))
        .send()
        .await
        .unwrap();
    assert_eq!(no_model.status(), 400);
    assert!(
        error_of(&no_model.text().await.unwrap())["message"]
            .as_str()
            .unwrap()
            .contains("model")
    );

    let big =
        json!({"model": "tunnel", "messages": [{"role": "user", "content": "x".repeat(10_000)}]});
    let too_large = authed(c.post(&url)).json(&big).send().await.unwrap();
    assert_eq!(too_large.status(), 413);
    assert!(
        error_of(&too_large.text().await.unwrap())["message"]
            .as_str()
            .unwrap()
            .contains("4096")
    );

    let nowhere = authed(c.get(s.edge.url("/v2/nothing")))
        .send()
        .await
        .unwrap();
    assert_eq!(nowhere.status(), 404);
    error_of(&nowhere.text().await.unwrap());

    // Last: a wrong key also slows its address down for a moment (see tests/hostile).
    let wrong = c
        .post(&url)
        .bearer_auth("sk-wrong")
        .json(&chat("tunnel", false))
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), 401);
    assert_eq!(
        error_of(&wrong.text().await.unwrap())["code"],
        "invalid_api_key"
    );
}

#[tokio::test]
async fn provider_failures_become_useful_errors() {
    let s = setup().await;
    let url = s.edge.url("/v1/chat/completions");
    // Connection refused: the message names the provider and the cause, never its
    // internal address (the node logs that). The group's only member failed, so there was
    // nothing to retry on.
    let response = client()
        .post(&url)
        .json(&chat("dead", false))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 502);
    assert_eq!(response.headers()["x-iop-error"], "provider_unreachable");
    assert_eq!(response.headers()["x-iop-attempts"], "1");
    let body = response.text().await.unwrap();
    let e = error_of(&body);
    assert_eq!(e["code"], "provider_unreachable");
    let message = e["message"].as_str().unwrap();
    assert!(
        !message.contains("127.0.0.1") && !message.contains(":9") && !message.contains("http://"),
        "{e}"
    );
    assert!(message.contains("provider dead: cannot connect"), "{e}");
    assert_eq!(message.matches("refused").count(), 1, "{e}");
    s.node
        .wait_line("127.0.0.1:9", Duration::from_secs(5))
        .await;
    // Timeout waiting for the provider.
    let (status, _, body) = post(&url, &chat("hang", false)).await;
    assert_eq!(status, 504, "{body}");
    assert_eq!(error_of(&body)["code"], "provider_timeout");
    // A streamed request waits for its head the stream timeout, then times out alike.
    let (status, _, body) = post(&url, &chat("hang", true)).await;
    assert_eq!(status, 504, "{body}");
    assert!(
        error_of(&body)["message"]
            .as_str()
            .unwrap()
            .contains("did not answer within 2s"),
        "{body}"
    );
    // A provider 5xx through the tunnel is the provider's own response.
    let (status, _, body) = post(&url, &chat("fail", false)).await;
    assert_eq!(status, 500);
    assert!(
        error_of(&body)["message"]
            .as_str()
            .unwrap()
            .contains("fail-500")
    );
    // Through a normalized run it becomes a 502 naming the provider.
    let (status, _, body) = post(&url, &chat("ollama-fail", false)).await;
    assert_eq!(status, 502, "{body}");
    assert!(
        error_of(&body)["message"].as_str().unwrap().contains("500"),
        "{body}"
    );
    // Once streaming has begun, failures arrive as an SSE error event.
    for model in ["midfail-tunnel", "midfail-ollama"] {
        let (status, _, body) = post(&url, &chat(model, true)).await;
        assert_eq!(status, 200);
        let last = sse_events(&body).last().cloned().unwrap();
        let v: Value = serde_json::from_str(&last.1).unwrap();
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("mid-stream"),
            "{model}: {body}"
        );
    }
}
