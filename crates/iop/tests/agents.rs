//! What coding agents and their SDKs send, through a translated group whose member is the
//! mock adapter (as in `iop demo`): Claude Code's first Messages request (context
//! management, system turns inside the conversation, cache hints, tools) and a tool round
//! trip, Codex's Responses request (client metadata, a built-in tool next to function
//! tools), Anthropic's token counter, the `HEAD /` check, and Ollama's API called the way
//! its documentation does, with `curl -d` (no JSON content type).

mod common;

use common::*;
use serde_json::{Value, json};

async fn setup() -> (tempfile::TempDir, EdgeProc, Proc) {
    let dir = tempdir();
    let config = r#"
nodes:
  - id: n1
    token: token-n1-0123456789
    providers:
      - {id: m, kind: mock, mock: {tokens: 6}}
model_groups:
  - {name: mock, members: [{node: n1, provider: m}]}
"#;
    let edge = start_edge(dir.path(), config).await;
    let node = start_node("n1", dir.path(), &edge.nodes, "token-n1-0123456789", "");
    wait_ready(&edge, "n1").await;
    (dir, edge, node)
}

async fn post(
    edge: &EdgeProc,
    path: &str,
    body: Value,
) -> (u16, reqwest::header::HeaderMap, Value) {
    let response = client()
        .post(edge.url(path))
        .header("anthropic-version", "2023-06-01")
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let text = response.text().await.unwrap();
    let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, headers, body)
}

fn bash_tool() -> Value {
    json!({
        "name": "Bash",
        "description": "Run a shell command",
        "input_schema": {
            "type": "object",
            "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}},
            "required": ["command"]
        },
        "cache_control": {"type": "ephemeral"}
    })
}

#[tokio::test]
async fn claude_codes_requests_and_a_tool_round_trip_are_served() {
    let (_dir, edge, _node) = setup().await;
    let first = json!({
        "model": "mock",
        "max_tokens": 32000,
        "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "list the files"}]},
            {"role": "system", "content": "The working directory is /src."}
        ],
        "tools": [bash_tool()],
        "metadata": {"user_id": "user_1_account_2_session_3"},
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}
    });
    let (status, _, answer) = post(&edge, "/v1/messages", first.clone()).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["stop_reason"], "tool_use", "{answer}");
    let call = answer["content"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["type"] == "tool_use")
        .unwrap_or_else(|| panic!("no tool_use in {answer}"))
        .clone();
    assert_eq!(call["name"], "Bash");
    assert_eq!(call["input"]["command"], "mock");

    // The tool's result goes back; the model answers in text.
    let mut second = first;
    second["messages"].as_array_mut().unwrap().extend([
        json!({"role": "assistant", "content": [call.clone()]}),
        json!({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call["id"], "content": "a.txt b.txt"}
        ]}),
    ]);
    let (status, _, answer) = post(&edge, "/v1/messages", second).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["stop_reason"], "end_turn", "{answer}");
    assert_eq!(answer["content"][0]["type"], "text");

    // What the client checks before it starts.
    let head = client().head(edge.url("/")).send().await.unwrap();
    assert_eq!(head.status(), 200);
}

#[tokio::test]
async fn the_token_counter_answers_with_an_estimate_in_anthropics_shape() {
    let (_dir, edge, _node) = setup().await;
    let (status, headers, answer) = post(
        &edge,
        "/v1/messages/count_tokens",
        json!({"model": "mock", "messages": [{"role": "user", "content": "how many tokens is this?"}], "tools": [bash_tool()]}),
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    assert!(answer["input_tokens"].as_u64().unwrap() > 10, "{answer}");
    assert_eq!(headers["x-iop-token-count"], "estimated");
    let (status, _, answer) = post(
        &edge,
        "/v1/messages/count_tokens",
        json!({"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    assert_eq!(status, 404);
    assert_eq!(answer["type"], "error", "{answer}");
    assert_eq!(answer["error"]["type"], "not_found_error", "{answer}");
}

#[tokio::test]
async fn codexs_request_is_served_without_the_built_in_tools() {
    let (_dir, edge, _node) = setup().await;
    let (status, headers, answer) = post(
        &edge,
        "/v1/responses",
        json!({
            "model": "mock",
            "instructions": "You are Codex.",
            "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "run ls"}]}],
            "tools": [
                {"type": "function", "name": "shell", "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}}, "required": ["command"]}, "strict": false},
                {"type": "web_search"}
            ],
            "tool_choice": "auto",
            "parallel_tool_calls": false,
            "reasoning": {"effort": "medium", "summary": "auto"},
            "store": false,
            "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "session-1",
            "client_metadata": {"originator": "codex_exec"}
        }),
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(headers["x-iop-dropped-tools"], "web_search");
    let call = answer["output"]
        .as_array()
        .unwrap()
        .iter()
        .find(|o| o["type"] == "function_call")
        .unwrap_or_else(|| panic!("no function_call in {answer}"));
    assert_eq!(call["name"], "shell");
    let arguments: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(arguments, json!({"command": []}));
}

#[tokio::test]
async fn ollamas_api_takes_a_body_sent_with_curl_d() {
    let (_dir, edge, _node) = setup().await;
    // `curl -d '{...}'` sends application/x-www-form-urlencoded.
    let response = client()
        .post(edge.url("/api/chat"))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(r#"{"model": "mock", "messages": [{"role": "user", "content": "hi"}], "stream": false}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let answer: Value = response.json().await.unwrap();
    assert_eq!(answer["done"], true, "{answer}");
    // The OpenAI API still says what it wants.
    let response = client()
        .post(edge.url("/v1/chat/completions"))
        .header("content-type", "text/plain")
        .body(r#"{"model": "mock", "messages": [{"role": "user", "content": "hi"}]}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 415);
}

/// A refusal to provoke: what, the method, headers and body, and the status and Anthropic
/// error type it must get.
type RefusalCase = (
    &'static str,
    reqwest::Method,
    Vec<(&'static str, &'static str)>,
    String,
    u16,
    &'static str,
);

/// Every way the edge refuses a request on an Anthropic route — auth, the wrong-key
/// throttle, body size, content type, method, malformed JSON, an unknown model, a key's
/// limit, no member online — answers in Anthropic's error shape with the type Anthropic
/// uses for that status, on `/v1/messages` and on its token counter.
#[tokio::test]
async fn every_refusal_on_the_anthropic_routes_is_in_anthropics_shape() {
    let dir = tempdir();
    let config = r#"
auth:
  keys:
    - {name: ops, role: admin, key: sk-right-0123456789}
    - {name: claude, role: client, key: sk-claude-0123456789, limits: {requests_per_minute: 2}}
limits: {max_body_bytes: 4096}
nodes:
  - id: n1
    token: token-n1-0123456789
    providers:
      - {id: m, kind: mock, mock: {tokens: 3}}
  - id: away
    token: token-away-0123456789
    providers:
      - {id: m, kind: mock}
model_groups:
  - {name: mock, members: [{node: n1, provider: m}]}
  - {name: offline, members: [{node: away, provider: m}]}
"#;
    assert!(
        config.contains(TEST_API_KEY),
        "wait_ready reads the status with it"
    );
    let edge = start_edge(dir.path(), config).await;
    let _node = start_node("n1", dir.path(), &edge.nodes, "token-n1-0123456789", "");
    wait_ready(&edge, "n1").await;
    let key = ("x-api-key", "sk-claude-0123456789");
    let body = |model: &str| {
        json!({"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})
            .to_string()
    };
    let huge = json!({"model": "mock", "x": "a".repeat(5000)}).to_string();
    let send = |path: &str,
                method: reqwest::Method,
                headers: Vec<(&'static str, &'static str)>,
                text: String| {
        let mut request = client()
            .request(method, edge.url(path))
            .header("anthropic-version", "2023-06-01")
            .body(text);
        for (name, value) in headers {
            request = request.header(name, value);
        }
        request.send()
    };
    let json = ("content-type", "application/json");
    for path in ["/v1/messages", "/v1/messages/count_tokens"] {
        let cases: Vec<RefusalCase> = vec![
            (
                "no key",
                reqwest::Method::POST,
                vec![json],
                body("mock"),
                401,
                "authentication_error",
            ),
            (
                "too large",
                reqwest::Method::POST,
                vec![json, key],
                huge.clone(),
                413,
                "request_too_large",
            ),
            (
                "not JSON",
                reqwest::Method::POST,
                vec![("content-type", "text/html"), key],
                body("mock"),
                415,
                "invalid_request_error",
            ),
            (
                "wrong method",
                reqwest::Method::GET,
                vec![key],
                String::new(),
                405,
                "invalid_request_error",
            ),
            (
                "malformed",
                reqwest::Method::POST,
                vec![json, key],
                "{\"model\":".into(),
                400,
                "invalid_request_error",
            ),
            (
                "unknown model",
                reqwest::Method::POST,
                vec![json, key],
                body("nope"),
                404,
                "not_found_error",
            ),
        ];
        for (what, method, headers, text, status, kind) in cases {
            let response = send(path, method, headers, text).await.unwrap();
            assert_eq!(response.status(), status, "{path}: {what}");
            let answer: Value = response.json().await.unwrap();
            assert_eq!(answer["type"], "error", "{path}: {what}: {answer}");
            assert_eq!(answer["error"]["type"], kind, "{path}: {what}: {answer}");
            assert!(
                answer["error"]["message"].is_string(),
                "{path}: {what}: {answer}"
            );
        }
    }
    // No member online, then the key's limit of two requests a minute; last, a wrong key
    // and the throttle it starts for its address.
    let wrong = ("x-api-key", "sk-wrong-0123456789");
    for (headers, model, status, kind) in [
        (vec![json, key], "offline", 503, "overloaded_error"),
        (vec![json, key], "mock", 200, ""),
        (vec![json, key], "mock", 429, "rate_limit_error"),
        (vec![json, wrong], "mock", 401, "authentication_error"),
        (vec![json, wrong], "mock", 429, "rate_limit_error"),
    ] {
        let response = send("/v1/messages", reqwest::Method::POST, headers, body(model))
            .await
            .unwrap();
        assert_eq!(response.status(), status, "{model}: {kind}");
        if status != 200 {
            let answer: Value = response.json().await.unwrap();
            assert_eq!(
                (&answer["type"], &answer["error"]["type"]),
                (&json!("error"), &json!(kind)),
                "{answer}"
            );
        }
    }
}
