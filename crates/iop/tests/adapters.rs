//! Rendered members with real processes: an Ollama member passes tools, tool results,
//! `response_format` and images to Ollama and renders its tool calls as OpenAI
//! `tool_calls`; what a member cannot do (`n` > 1, remote images, tools on the mock
//! adapter) is a 400 naming it; the mock adapter honours `stop`.

mod common;

use common::*;
use serde_json::{Value, json};

struct Setup {
    _dir: tempfile::TempDir,
    _mock: MockProc,
    edge: EdgeProc,
    _node: Proc,
}

async fn setup() -> Setup {
    let dir = tempdir();
    let mock = start_mock(&[]).await;
    let config = format!(
        r#"
nodes:
  - id: n1
    token: token-n1-0123456789
    providers:
      - {{id: ol, kind: ollama, base_url: "{o}"}}
      - {{id: m, kind: mock}}
model_groups:
  - {{name: ollama, members: [{{node: n1, provider: ol, model: mock-model}}]}}
  - {{name: mock, members: [{{node: n1, provider: m}}]}}
"#,
        o = mock.ollama_base(),
    );
    let edge = start_edge(dir.path(), &config).await;
    let node = start_node("n1", dir.path(), &edge.nodes, "token-n1-0123456789", "");
    wait_ready(&edge, "n1").await;
    Setup {
        _dir: dir,
        _mock: mock,
        edge,
        _node: node,
    }
}

async fn chat(s: &Setup, body: Value) -> (u16, String) {
    let response = client()
        .post(s.edge.url("/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    (response.status().as_u16(), response.text().await.unwrap())
}

fn tools() -> Value {
    json!([{"type": "function", "function": {"name": "lookup", "description": "Looks things up",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}])
}

#[tokio::test]
async fn ollama_tool_calls_come_back_as_openai_tool_calls() {
    let s = setup().await;
    let ask = json!({"model": "ollama", "tools": tools(),
                     "messages": [{"role": "user", "content": "cats"}]});
    let (status, body) = chat(&s, ask.clone()).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    assert_eq!(choice["message"]["content"], Value::Null, "{v}");
    let call = &choice["message"]["tool_calls"][0];
    assert_eq!(call["type"], "function");
    assert_eq!(call["function"]["name"], "lookup");
    let arguments: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(arguments, json!({"query": "cats"}));
    let id = call["id"].as_str().unwrap().to_string();
    assert!(!id.is_empty());
    assert!(call.get("index").is_none(), "{call}");

    // Streamed: one delta with the call, then the finish.
    let mut streamed = ask.clone();
    streamed["stream"] = json!(true);
    let (status, body) = chat(&s, streamed).await;
    assert_eq!(status, 200, "{body}");
    let chunks: Vec<Value> = sse_events(&body)
        .iter()
        .filter(|(_, d)| d != "[DONE]")
        .map(|(_, d)| serde_json::from_str(d).unwrap())
        .collect();
    let calls: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"].get("tool_calls"))
        .collect();
    assert_eq!(calls.len(), 1, "{body}");
    assert_eq!(calls[0][0]["index"], 0);
    assert_eq!(calls[0][0]["function"]["name"], "lookup");
    assert!(calls[0][0]["id"].as_str().is_some_and(|i| !i.is_empty()));
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "tool_calls"
    );

    // The tool's result (by call id) goes back, and the model answers in text.
    let follow_up = json!({"model": "ollama", "tools": tools(), "messages": [
        {"role": "user", "content": "cats"},
        {"role": "assistant", "content": null, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": id, "content": "meow"},
    ]});
    let (status, body) = chat(&s, follow_up).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    assert!(v["choices"][0]["message"].get("tool_calls").is_none());
    assert!(
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .starts_with("Hello")
    );
}

#[tokio::test]
async fn ollama_format_images_and_refusals() {
    let s = setup().await;
    // JSON mode reaches Ollama as `format`.
    let (status, body) = chat(
        &s,
        json!({"model": "ollama", "response_format": {"type": "json_object"}, "max_tokens": 2,
               "messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    let document: Value =
        serde_json::from_str(v["choices"][0]["message"]["content"].as_str().unwrap()).unwrap();
    assert_eq!(document, json!({"answer": "Hello from"}));

    // An inline image is accepted; a remote one is a 400 that says what to send.
    let image = |url: &str| {
        json!({"model": "ollama", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": url}},
        ]}]})
    };
    let (status, body) = chat(&s, image("data:image/png;base64,iVBORw0KGgo=")).await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = chat(&s, image("https://example.invalid/cat.png")).await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("data URL"), "{body}");

    let (status, body) = chat(
        &s,
        json!({"model": "ollama", "n": 2, "messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("`n`"), "{body}");
}

#[tokio::test]
async fn the_mock_adapter_honours_stop_calls_tools_and_refuses_what_it_cannot_do() {
    let s = setup().await;
    let (status, body) = chat(
        &s,
        json!({"model": "mock", "stop": ["brown"], "messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "The quick ");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    // The tokens generated, the one that completed the stop sequence included.
    assert_eq!(v["usage"]["completion_tokens"], 3);
    // Offered tools, it calls the first; after the tool's result it answers in text.
    let mut body =
        json!({"model": "mock", "tools": tools(), "messages": [{"role": "user", "content": "x"}]});
    let (status, text) = chat(&s, body.clone()).await;
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{text}");
    let call = v["choices"][0]["message"]["tool_calls"][0].clone();
    assert_eq!(call["type"], "function", "{text}");
    body["messages"].as_array_mut().unwrap().extend([
        json!({"role": "assistant", "content": null, "tool_calls": [call.clone()]}),
        json!({"role": "tool", "tool_call_id": call["id"], "content": "done"}),
    ]);
    let (status, text) = chat(&s, body).await;
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{text}");
    for (extra, param) in [
        (
            json!({"response_format": {"type": "json_object"}}),
            "`response_format`",
        ),
        (json!({"n": 2}), "`n`"),
    ] {
        let mut body = json!({"model": "mock", "messages": [{"role": "user", "content": "x"}]});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let (status, text) = chat(&s, body).await;
        assert_eq!(status, 400, "{extra}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["error"]["type"], "invalid_request_error", "{text}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains(param),
            "{text}"
        );
    }
}
