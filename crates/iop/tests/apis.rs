//! The Responses API (`/v1/responses`) and the Anthropic Messages API (`/v1/messages`)
//! with real processes, on every member kind: a tunnelled provider that serves chat only
//! (translated), one that serves both APIs itself (native: the provider's bytes), Ollama,
//! a CLI program and the mock adapter (translated from node runs). Each answers streamed
//! and not, well-formed and with usage, and the usage is recorded; a client that goes
//! away mid-stream frees the provider slot; `/v1/messages` takes Anthropic's `x-api-key`
//! and answers errors in Anthropic's shape.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::{Value, json};

const ECHO: &str = r#"input=$(cat)
echo "you said: $input"
echo "second line"
echo "@@iop-usage $IOP_USAGE_NONCE {\"input_tokens\":3,\"output_tokens\":2}"
"#;

const TICKER: &str = r#"while true; do echo tick; sleep 0.05; done
"#;

/// Every member kind, by the model group that reaches it.
const KINDS: [&str; 5] = ["tunnel", "native", "ollama", "cli", "mock"];

struct Setup {
    _dir: tempfile::TempDir,
    mock: MockProc,
    edge: EdgeProc,
    _node: Proc,
}

async fn setup_with(auth: &str) -> Setup {
    let dir = tempdir();
    let d = dir.path().display().to_string();
    std::fs::write(dir.path().join("echo.sh"), ECHO).unwrap();
    std::fs::write(dir.path().join("ticker.sh"), TICKER).unwrap();
    let mock = start_mock(&[]).await;
    let config = format!(
        r#"
{auth}
nodes:
  - id: n1
    token: token-n1-0123456789
    providers:
      - {{id: oa, kind: openai_compat, base_url: "{oa}"}}
      - {{id: native, kind: openai_compat, base_url: "{oa}", apis: [chat, responses, messages]}}
      - {{id: ol, kind: ollama, base_url: "{ol}"}}
      - {{id: echo, kind: cli, cli: {{argv: [sh, "{d}/echo.sh"]}}}}
      - {{id: ticker, kind: cli, cli: {{argv: [sh, "{d}/ticker.sh"]}}}}
      - {{id: m, kind: mock, mock: {{tokens: 6, reasoning: true}}}}
      - {{id: slowmock, kind: mock, mock: {{tokens: 400, token_delay_ms: 25}}}}
model_groups:
  - {{name: tunnel, members: [{{node: n1, provider: oa, model: mock-model}}]}}
  - {{name: native, members: [{{node: n1, provider: native, model: mock-model}}]}}
  - {{name: ollama, members: [{{node: n1, provider: ol, model: mock-model}}]}}
  - {{name: cli, members: [{{node: n1, provider: echo}}]}}
  - {{name: mock, members: [{{node: n1, provider: m}}]}}
  - {{name: tunnel-slow, members: [{{node: n1, provider: oa, model: slow}}]}}
  - {{name: native-slow, members: [{{node: n1, provider: native, model: slow}}]}}
  - {{name: ollama-slow, members: [{{node: n1, provider: ol, model: slow}}]}}
  - {{name: cli-slow, members: [{{node: n1, provider: ticker}}]}}
  - {{name: mock-slow, members: [{{node: n1, provider: slowmock}}]}}
"#,
        oa = mock.openai_base(),
        ol = mock.ollama_base(),
    );
    let edge = start_edge(dir.path(), &config).await;
    let node = start_node("n1", dir.path(), &edge.nodes, "token-n1-0123456789", "");
    wait_ready(&edge, "n1").await;
    Setup {
        _dir: dir,
        mock,
        edge,
        _node: node,
    }
}

async fn setup() -> Setup {
    setup_with("").await
}

/// POSTs `body` to `path`; `(status, content type, body)`.
async fn post(url: &str, body: &Value, headers: &[(&str, &str)]) -> (u16, String, String) {
    let mut request = client().post(url).json(body);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    let content_type = response
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    (status, content_type, response.text().await.unwrap())
}

fn responses_request(model: &str, stream: bool) -> Value {
    json!({"model": model, "input": "Say hello to the world", "stream": stream})
}

fn messages_request(model: &str, stream: bool) -> Value {
    json!({"model": model, "max_tokens": 64, "stream": stream,
           "messages": [{"role": "user", "content": "Say hello to the world"}]})
}

/// The `(event, data)` pairs of an event stream, the data parsed.
fn parse_events(body: &str) -> Vec<(String, Value)> {
    sse_events(body)
        .into_iter()
        .map(|(name, data)| {
            let data = serde_json::from_str(&data)
                .unwrap_or_else(|e| panic!("event {name} is not JSON ({e}): {data}"));
            (name, data)
        })
        .collect()
}

/// Checks a Responses object: completed, with a message of text and usage; its text.
fn check_response(r: &Value, kind: &str) -> String {
    assert_eq!(r["object"], "response", "{kind}: {r}");
    assert!(
        r["id"].as_str().unwrap().starts_with("resp_"),
        "{kind}: {r}"
    );
    assert_eq!(r["status"], "completed", "{kind}: {r}");
    let message = r["output"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["type"] == "message")
        .unwrap_or_else(|| panic!("{kind}: no message in {r}"));
    assert_eq!(message["role"], "assistant", "{kind}: {r}");
    let text = message["content"][0]["text"].as_str().unwrap().to_string();
    assert_eq!(message["content"][0]["type"], "output_text", "{kind}: {r}");
    assert!(!text.is_empty(), "{kind}: {r}");
    let usage = &r["usage"];
    assert!(usage["output_tokens"].as_u64().unwrap() > 0, "{kind}: {r}");
    assert!(usage["input_tokens"].as_u64().is_some(), "{kind}: {r}");
    assert_eq!(
        usage["total_tokens"].as_u64().unwrap(),
        usage["input_tokens"].as_u64().unwrap() + usage["output_tokens"].as_u64().unwrap(),
        "{kind}: {r}"
    );
    text
}

/// Checks a Messages object: an end_turn message with text and usage; its text.
fn check_message(m: &Value, kind: &str) -> String {
    assert_eq!(m["type"], "message", "{kind}: {m}");
    assert_eq!(m["role"], "assistant", "{kind}: {m}");
    assert!(m["id"].as_str().unwrap().starts_with("msg_"), "{kind}: {m}");
    assert_eq!(m["stop_reason"], "end_turn", "{kind}: {m}");
    let text: String = m["content"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["type"] == "text")
        .map(|b| b["text"].as_str().unwrap())
        .collect();
    assert!(!text.is_empty(), "{kind}: {m}");
    assert!(
        m["usage"]["output_tokens"].as_u64().unwrap() > 0,
        "{kind}: {m}"
    );
    assert!(m["usage"]["input_tokens"].as_u64().is_some(), "{kind}: {m}");
    text
}

/// The edge's event stream, open before the requests it should see.
async fn edge_events(edge: &EdgeProc) -> reqwest::Response {
    let events = client()
        .get(edge.url("/admin/events"))
        .bearer_auth(TEST_API_KEY)
        .send()
        .await
        .unwrap();
    assert_eq!(events.status(), 200);
    events
}

/// Reads usage events until `n` arrived (bounded).
async fn usage_events(events: &mut reqwest::Response, n: usize) -> Vec<Value> {
    let mut text = String::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let found: Vec<Value> = sse_events(&text)
            .into_iter()
            .filter(|(k, _)| k == "usage")
            // The last event may still be arriving.
            .filter_map(|(_, d)| serde_json::from_str(&d).ok())
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

#[tokio::test]
async fn every_member_kind_answers_the_responses_api_with_usage() {
    let s = setup().await;
    let mut usage = edge_events(&s.edge).await;
    let url = s.edge.url("/v1/responses");
    for kind in KINDS {
        let (status, content_type, body) = post(&url, &responses_request(kind, false), &[]).await;
        assert_eq!(status, 200, "{kind}: {body}");
        assert!(content_type.starts_with("application/json"), "{kind}");
        let r: Value = serde_json::from_str(&body).unwrap();
        let text = check_response(&r, kind);
        if kind != "native" {
            assert_eq!(r["model"], kind, "{r}");
        }

        let (status, content_type, body) = post(&url, &responses_request(kind, true), &[]).await;
        assert_eq!(status, 200, "{kind}: {body}");
        assert!(content_type.starts_with("text/event-stream"), "{kind}");
        let events = parse_events(&body);
        let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names[0], "response.created", "{kind}: {body}");
        assert_eq!(names[1], "response.in_progress", "{kind}: {body}");
        assert_eq!(
            *names.last().unwrap(),
            "response.completed",
            "{kind}: {body}"
        );
        for name in [
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
        ] {
            assert!(names.contains(&name), "{kind}: no {name} in {names:?}");
        }
        for (i, (name, data)) in events.iter().enumerate() {
            assert_eq!(data["type"], *name, "{kind}: {data}");
            assert_eq!(data["sequence_number"], i as u64, "{kind}: {data}");
        }
        let streamed: String = events
            .iter()
            .filter(|(n, _)| n == "response.output_text.delta")
            .map(|(_, d)| d["delta"].as_str().unwrap())
            .collect();
        let done = &events.last().unwrap().1["response"];
        assert_eq!(check_response(done, kind), streamed, "{kind}");
        if kind != "cli" {
            // The answers are deterministic (the CLI echoes its input either way).
            assert_eq!(streamed, text, "{kind}");
        }
    }
    // Every request was accounted, with the member's counts.
    let seen = usage_events(&mut usage, 2 * KINDS.len()).await;
    for (i, kind) in KINDS.iter().enumerate() {
        for u in &seen[2 * i..2 * i + 2] {
            assert_eq!(u["model_group"], *kind, "{u}");
            assert!(u["output_tokens"].as_u64().unwrap() > 0, "{u}");
        }
    }
    wait_idle(&s.edge).await;
}

#[tokio::test]
async fn every_member_kind_answers_the_messages_api_with_usage() {
    let s = setup().await;
    let mut usage = edge_events(&s.edge).await;
    let url = s.edge.url("/v1/messages");
    let anthropic = [("anthropic-version", "2023-06-01")];
    for kind in KINDS {
        let (status, content_type, body) =
            post(&url, &messages_request(kind, false), &anthropic).await;
        assert_eq!(status, 200, "{kind}: {body}");
        assert!(content_type.starts_with("application/json"), "{kind}");
        let m: Value = serde_json::from_str(&body).unwrap();
        let text = check_message(&m, kind);

        let (status, content_type, body) =
            post(&url, &messages_request(kind, true), &anthropic).await;
        assert_eq!(status, 200, "{kind}: {body}");
        assert!(content_type.starts_with("text/event-stream"), "{kind}");
        let events = parse_events(&body);
        let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names[0], "message_start", "{kind}: {body}");
        assert_eq!(names[names.len() - 2], "message_delta", "{kind}: {body}");
        assert_eq!(names[names.len() - 1], "message_stop", "{kind}: {body}");
        for name in [
            "ping",
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
        ] {
            assert!(names.contains(&name), "{kind}: no {name} in {names:?}");
        }
        for (name, data) in &events {
            assert_eq!(data["type"], *name, "{kind}: {data}");
        }
        // Blocks open and close in order, one at a time.
        let mut open: Option<u64> = None;
        let mut next = 0;
        for (name, data) in &events {
            match name.as_str() {
                "content_block_start" => {
                    assert_eq!((open, data["index"].as_u64()), (None, Some(next)), "{body}");
                    open = Some(next);
                }
                "content_block_delta" => assert_eq!(data["index"].as_u64(), open, "{body}"),
                "content_block_stop" => {
                    assert_eq!(data["index"].as_u64(), open, "{body}");
                    open = None;
                    next += 1;
                }
                _ => {}
            }
        }
        let streamed: String = events
            .iter()
            .filter(|(_, d)| d["delta"]["type"] == "text_delta")
            .map(|(_, d)| d["delta"]["text"].as_str().unwrap())
            .collect();
        let delta = &events[events.len() - 2].1;
        assert_eq!(delta["delta"]["stop_reason"], "end_turn", "{kind}: {body}");
        assert!(
            delta["usage"]["output_tokens"].as_u64().unwrap() > 0,
            "{kind}: {body}"
        );
        if kind != "cli" {
            assert_eq!(streamed, text, "{kind}");
        }
        if kind == "mock" {
            // The mock adapter reasons first: a thinking block before the text.
            assert_eq!(m["content"][0]["type"], "thinking", "{m}");
            assert!(
                events
                    .iter()
                    .any(|(_, d)| d["delta"]["type"] == "thinking_delta"),
                "{body}"
            );
        }
    }
    let seen = usage_events(&mut usage, 2 * KINDS.len()).await;
    for (i, kind) in KINDS.iter().enumerate() {
        for u in &seen[2 * i..2 * i + 2] {
            assert_eq!(u["model_group"], *kind, "{u}");
            assert!(u["output_tokens"].as_u64().unwrap() > 0, "{u}");
            assert!(u["input_tokens"].as_u64().unwrap() > 0, "{u}");
        }
    }
    wait_idle(&s.edge).await;
}

#[tokio::test]
async fn a_native_provider_gets_the_request_and_returns_its_own_bytes() {
    let s = setup().await;
    for (path, stream) in [
        ("/responses", false),
        ("/responses", true),
        ("/messages", false),
        ("/messages", true),
    ] {
        let (direct_body, via_body) = if path == "/responses" {
            (
                responses_request("mock-model", stream),
                responses_request("native", stream),
            )
        } else {
            (
                messages_request("mock-model", stream),
                messages_request("native", stream),
            )
        };
        let direct = post(
            &format!("{}{path}", s.mock.openai_base()),
            &direct_body,
            &[],
        )
        .await;
        let mut via = post(&s.edge.url(&format!("/v1{path}")), &via_body, &[]).await;
        assert_eq!(via.0, 200, "{path}: {}", via.2);
        if stream {
            // The only addition: each event's id, for a client's resume.
            assert!(via.2.contains("\nid: n1."), "{}", via.2);
            via.2 = without_event_ids(&via.2);
        }
        assert_eq!(
            via, direct,
            "{path} stream={stream}: not the provider's bytes"
        );
    }
    // A field the translation refuses goes to a native provider as it is.
    let mut body = responses_request("native", false);
    body["previous_response_id"] = json!("resp_earlier");
    let (status, _, text) = post(&s.edge.url("/v1/responses"), &body, &[]).await;
    assert_eq!(status, 200, "{text}");
    wait_idle(&s.edge).await;
}

#[tokio::test]
async fn a_client_that_leaves_mid_stream_frees_the_slot_on_every_member_kind() {
    let s = setup().await;
    for (kind, provider) in [
        ("tunnel", "oa"),
        ("native", "native"),
        ("ollama", "ol"),
        ("cli", "ticker"),
        ("mock", "slowmock"),
    ] {
        let group = format!("{kind}-slow");
        for (path, body) in [
            ("/v1/responses", responses_request(&group, true)),
            ("/v1/messages", messages_request(&group, true)),
        ] {
            let mut body = body;
            if path == "/v1/messages" {
                body["max_tokens"] = json!(1000);
            }
            let mut response = client()
                .post(s.edge.url(path))
                .json(&body)
                .send()
                .await
                .unwrap();
            assert_eq!(response.status(), 200, "{group} {path}");
            let mut seen = String::new();
            read_until(&mut response, &mut seen, |s| {
                s.contains("output_text.delta") || s.contains("text_delta")
            })
            .await;
            let busy = status(&s.edge).await;
            assert_eq!(
                provider_of(&busy, "n1", provider)["in_flight"]["normal"],
                1,
                "{group} {path}: {busy}"
            );
            drop(response);
            wait_idle(&s.edge).await;
        }
    }
    // The tunnelled and Ollama requests were cancelled at the provider too.
    s.mock.wait_aborted(6, Duration::from_secs(10)).await;
}

#[tokio::test]
async fn what_cannot_be_honoured_is_refused_in_each_apis_error_shape() {
    let s = setup().await;
    let responses = s.edge.url("/v1/responses");
    for (body, param) in [
        (
            json!({"model": "tunnel", "input": "x", "previous_response_id": "resp_1"}),
            "previous_response_id",
        ),
        (
            json!({"model": "mock", "input": "x", "tools": [{"type": "crystal_ball"}]}),
            "tools[0].type",
        ),
        (
            json!({"model": "mock", "input": "x", "tool_choice": {"type": "web_search"}}),
            "tool_choice",
        ),
        (
            json!({"model": "ollama", "input": "x", "background": true}),
            "background",
        ),
        (json!({"model": "cli", "input": 5}), "input"),
        (
            json!({"model": "cli", "input": "x", "stream": "yes"}),
            "stream",
        ),
    ] {
        let (status, _, text) = post(&responses, &body, &[]).await;
        assert_eq!(status, 400, "{body}: {text}");
        let e: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(e["error"]["type"], "invalid_request_error", "{text}");
        assert_eq!(e["error"]["param"], param, "{text}");
        assert!(!e["error"]["message"].as_str().unwrap().is_empty());
    }
    let (status, _, text) = post(&responses, &responses_request("nope", false), &[]).await;
    assert_eq!(status, 404, "{text}");

    let messages = s.edge.url("/v1/messages");
    let anthropic_error = |text: &str, kind: &str| {
        let e: Value = serde_json::from_str(text).unwrap();
        assert_eq!(e["type"], "error", "{text}");
        assert_eq!(e["error"]["type"], kind, "{text}");
        assert!(
            !e["error"]["message"].as_str().unwrap().is_empty(),
            "{text}"
        );
    };
    let mut no_max = messages_request("tunnel", false);
    no_max.as_object_mut().unwrap().remove("max_tokens");
    let (status, _, text) = post(&messages, &no_max, &[]).await;
    assert_eq!(status, 400, "{text}");
    anthropic_error(&text, "invalid_request_error");
    assert!(text.contains("max_tokens"), "{text}");
    let mut server_tool = messages_request("mock", false);
    server_tool["tools"] = json!([{"type": "web_search_20250305", "name": "web_search"}]);
    let (status, _, text) = post(&messages, &server_tool, &[]).await;
    assert_eq!(status, 400, "{text}");
    anthropic_error(&text, "invalid_request_error");
    let (status, _, text) = post(&messages, &messages_request("nope", false), &[]).await;
    assert_eq!(status, 404, "{text}");
    anthropic_error(&text, "not_found_error");
    let (status, _, text) = post(&messages, &json!([1]), &[]).await;
    assert_eq!(status, 400, "{text}");
    anthropic_error(&text, "invalid_request_error");
    // Parsing is as strict as for chat: a key given twice, nesting too deep.
    for raw in [
        r#"{"model":"mock","model":"tunnel","max_tokens":8,"messages":[{"role":"user","content":"x"}]}"#
            .to_string(),
        format!(
            r#"{{"model":"mock","max_tokens":8,"messages":[{{"role":"user","content":"x"}}],"metadata":{}{}}}"#,
            "[".repeat(100),
            "]".repeat(100)
        ),
    ] {
        for url in [&messages, &responses] {
            let response = client()
                .post(url.as_str())
                .header("content-type", "application/json")
                .body(raw.clone())
                .send()
                .await
                .unwrap();
            assert_eq!(response.status(), 400, "{url}");
            let text = response.text().await.unwrap();
            if url == &messages {
                anthropic_error(&text, "invalid_request_error");
            } else {
                let e: Value = serde_json::from_str(&text).unwrap();
                assert_eq!(e["error"]["type"], "invalid_request_error", "{text}");
            }
        }
    }
    // A provider's own refusal comes back in the client's API shape.
    let mut format = messages_request("tunnel", false);
    format["output_config"] =
        json!({"format": {"type": "json_schema", "schema": {"type": "object"}}});
    let (status, _, text) = post(&messages, &format, &[]).await;
    assert_eq!(status, 400, "{text}");
    anthropic_error(&text, "invalid_request_error");
    assert!(text.contains("plain text only"), "{text}");
    wait_idle(&s.edge).await;
}

#[tokio::test]
async fn errors_mid_stream_end_each_stream_on_its_own_event() {
    let dir = tempdir();
    let mock = start_mock(&[]).await;
    let config = format!(
        r#"
nodes:
  - id: n1
    token: token-n1-0123456789
    providers:
      - {{id: oa, kind: openai_compat, base_url: "{oa}"}}
      - {{id: ol, kind: ollama, base_url: "{ol}"}}
model_groups:
  - {{name: tunnel, members: [{{node: n1, provider: oa, model: error-mid-stream}}]}}
  - {{name: ollama, members: [{{node: n1, provider: ol, model: error-mid-stream}}]}}
"#,
        oa = mock.openai_base(),
        ol = mock.ollama_base(),
    );
    let edge = start_edge(dir.path(), &config).await;
    let _node = start_node("n1", dir.path(), &edge.nodes, "token-n1-0123456789", "");
    wait_ready(&edge, "n1").await;
    for group in ["tunnel", "ollama"] {
        let (status, _, body) = post(
            &edge.url("/v1/responses"),
            &responses_request(group, true),
            &[],
        )
        .await;
        assert_eq!(status, 200, "{body}");
        assert!(body.ends_with("\n\n"), "{body}");
        let events = parse_events(&body);
        let (name, last) = events.last().unwrap();
        assert_eq!(name, "response.failed", "{group}: {body}");
        assert_eq!(last["response"]["status"], "failed", "{body}");
        assert!(last["response"]["error"]["message"].is_string(), "{body}");

        let (status, _, body) = post(
            &edge.url("/v1/messages"),
            &messages_request(group, true),
            &[],
        )
        .await;
        assert_eq!(status, 200, "{body}");
        let events = parse_events(&body);
        let (name, last) = events.last().unwrap();
        assert_eq!(name, "error", "{group}: {body}");
        assert_eq!(last["type"], "error", "{body}");
        assert!(last["error"]["message"].is_string(), "{body}");
        assert!(!events.iter().any(|(n, _)| n == "message_stop"), "{body}");
    }
    wait_idle(&edge).await;
}

#[tokio::test]
async fn messages_take_x_api_key_and_answer_auth_errors_in_anthropic_shape() {
    let s = setup_with(&format!(
        "auth:\n  keys:\n    - {{name: ops, role: admin, key: {TEST_API_KEY}}}\n    - {{name: claude, role: client, key: sk-claude-0123456789}}\n"
    ))
    .await;
    let messages = s.edge.url("/v1/messages");
    let body = messages_request("mock", false);
    let (status, _, text) = post(&messages, &body, &[]).await;
    assert_eq!(status, 401, "{text}");
    let e: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(e["type"], "error", "{text}");
    assert_eq!(e["error"]["type"], "authentication_error", "{text}");
    assert!(text.contains("x-api-key"), "{text}");
    for header in [
        ("x-api-key", "sk-claude-0123456789"),
        ("authorization", "Bearer sk-claude-0123456789"),
    ] {
        let (status, _, text) = post(
            &messages,
            &body,
            &[header, ("anthropic-version", "2023-06-01")],
        )
        .await;
        assert_eq!(status, 200, "{header:?}: {text}");
        check_message(&serde_json::from_str(&text).unwrap(), "mock");
    }
    // The Responses API is OpenAI's: a bearer key, OpenAI's error shape.
    let responses = s.edge.url("/v1/responses");
    let (status, _, text) = post(
        &responses,
        &responses_request("mock", false),
        &[("x-api-key", "sk-claude-0123456789")],
    )
    .await;
    assert_eq!(status, 401, "{text}");
    assert_eq!(
        serde_json::from_str::<Value>(&text).unwrap()["error"]["code"],
        "invalid_api_key"
    );
    let (status, _, text) = post(
        &responses,
        &responses_request("mock", false),
        &[("authorization", "Bearer sk-claude-0123456789")],
    )
    .await;
    assert_eq!(status, 200, "{text}");
    // Last: a wrong key slows its address down for a moment.
    let (status, _, text) = post(&messages, &body, &[("x-api-key", "sk-wrong-0123456789")]).await;
    assert_eq!(status, 401, "{text}");
    assert_eq!(
        serde_json::from_str::<Value>(&text).unwrap()["error"]["type"],
        "authentication_error"
    );
}

#[tokio::test]
async fn tool_calls_round_trip_through_both_apis() {
    let s = setup().await;
    let schema = json!({"type": "object", "properties": {"query": {"type": "string"}}});

    // Responses: a function_call item, then its output back as input.
    let tools = json!([{"type": "function", "name": "lookup", "description": "Looks things up",
                        "parameters": schema}]);
    let ask = json!({"model": "ollama", "input": "cats", "tools": tools});
    let (status, _, body) = post(&s.edge.url("/v1/responses"), &ask, &[]).await;
    assert_eq!(status, 200, "{body}");
    let r: Value = serde_json::from_str(&body).unwrap();
    let call = &r["output"][0];
    assert_eq!(call["type"], "function_call", "{r}");
    assert_eq!(call["name"], "lookup", "{r}");
    let arguments: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(arguments, json!({"query": "cats"}));
    let call_id = call["call_id"].as_str().unwrap();
    assert!(!call_id.is_empty());
    let mut streamed = ask.clone();
    streamed["stream"] = json!(true);
    let (status, _, body) = post(&s.edge.url("/v1/responses"), &streamed, &[]).await;
    assert_eq!(status, 200, "{body}");
    let events = parse_events(&body);
    let done = events
        .iter()
        .find(|(n, _)| n == "response.function_call_arguments.done")
        .unwrap_or_else(|| panic!("no arguments done: {body}"));
    assert_eq!(done.1["arguments"], call["arguments"], "{body}");
    let follow_up = json!({"model": "ollama", "tools": tools, "input": [
        {"role": "user", "content": "cats"},
        {"type": "function_call", "call_id": call_id, "name": "lookup", "arguments": call["arguments"]},
        {"type": "function_call_output", "call_id": call_id, "output": "meow"},
    ]});
    let (status, _, body) = post(&s.edge.url("/v1/responses"), &follow_up, &[]).await;
    assert_eq!(status, 200, "{body}");
    check_response(&serde_json::from_str(&body).unwrap(), "ollama");

    // Messages: a tool_use block, then a tool_result.
    let tools =
        json!([{"name": "lookup", "description": "Looks things up", "input_schema": schema}]);
    let ask = json!({"model": "ollama", "max_tokens": 64, "tools": tools,
                     "messages": [{"role": "user", "content": "cats"}]});
    let (status, _, body) = post(&s.edge.url("/v1/messages"), &ask, &[]).await;
    assert_eq!(status, 200, "{body}");
    let m: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(m["stop_reason"], "tool_use", "{m}");
    let block = &m["content"][0];
    assert_eq!(block["type"], "tool_use", "{m}");
    assert_eq!(block["name"], "lookup", "{m}");
    assert_eq!(block["input"], json!({"query": "cats"}), "{m}");
    let mut streamed = ask.clone();
    streamed["stream"] = json!(true);
    let (status, _, body) = post(&s.edge.url("/v1/messages"), &streamed, &[]).await;
    assert_eq!(status, 200, "{body}");
    let events = parse_events(&body);
    let partial: String = events
        .iter()
        .filter(|(_, d)| d["delta"]["type"] == "input_json_delta")
        .map(|(_, d)| d["delta"]["partial_json"].as_str().unwrap())
        .collect();
    assert_eq!(
        serde_json::from_str::<Value>(&partial).unwrap(),
        json!({"query": "cats"}),
        "{body}"
    );
    let follow_up = json!({"model": "ollama", "max_tokens": 64, "tools": tools, "messages": [
        {"role": "user", "content": "cats"},
        {"role": "assistant", "content": [block]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block["id"], "content": "meow"}]},
    ]});
    let (status, _, body) = post(&s.edge.url("/v1/messages"), &follow_up, &[]).await;
    assert_eq!(status, 200, "{body}");
    check_message(&serde_json::from_str(&body).unwrap(), "ollama");

    // An image goes to Ollama as the run's image.
    let image = json!({"model": "ollama", "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
        {"type": "text", "text": "what is this?"}]}]});
    let (status, _, body) = post(&s.edge.url("/v1/messages"), &image, &[]).await;
    assert_eq!(status, 200, "{body}");
    wait_idle(&s.edge).await;
}

#[tokio::test]
async fn answers_the_edge_assembles_are_limited_and_free_their_slot() {
    let dir = tempdir();
    let mock = start_mock(&["--tokens", "400"]).await;
    let config = format!(
        r#"
limits:
  http: {{max_response_bytes: 1024}}
nodes:
  - id: n1
    token: token-n1-0123456789
    providers:
      - {{id: oa, kind: openai_compat, base_url: "{oa}"}}
      - {{id: m, kind: mock, mock: {{tokens: 400}}}}
model_groups:
  - {{name: tunnel, members: [{{node: n1, provider: oa, model: mock-model}}]}}
  - {{name: mock, members: [{{node: n1, provider: m}}]}}
"#,
        oa = mock.openai_base(),
    );
    let edge = start_edge(dir.path(), &config).await;
    let _node = start_node("n1", dir.path(), &edge.nodes, "token-n1-0123456789", "");
    wait_ready(&edge, "n1").await;
    for group in ["tunnel", "mock"] {
        let (status, _, body) = post(
            &edge.url("/v1/responses"),
            &responses_request(group, false),
            &[],
        )
        .await;
        assert_eq!(status, 502, "{group}: {body}");
        assert!(body.contains("max_response_bytes"), "{body}");
        let mut long = messages_request(group, false);
        long["max_tokens"] = json!(1000);
        let (status, _, body) = post(&edge.url("/v1/messages"), &long, &[]).await;
        assert_eq!(status, 502, "{group}: {body}");
        let e: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(e["error"]["type"], "api_error", "{body}");
        // A Messages stream holds nothing, so it has no such limit ...
        long["stream"] = json!(true);
        let (status, _, body) = post(&edge.url("/v1/messages"), &long, &[]).await;
        assert_eq!(status, 200, "{group}: {body}");
        assert!(body.contains("message_stop"), "{body}");
        // ... while a Responses stream repeats the whole answer at its end: it fails.
        let (status, _, body) = post(
            &edge.url("/v1/responses"),
            &responses_request(group, true),
            &[],
        )
        .await;
        assert_eq!(status, 200, "{group}: {body}");
        let events = parse_events(&body);
        let (name, last) = events.last().unwrap();
        assert_eq!(name, "response.failed", "{body}");
        assert_eq!(
            last["response"]["error"]["code"], "response_too_large",
            "{body}"
        );
    }
    wait_idle(&edge).await;
}
