//! The mock honours `stop` and `n` and refuses what it cannot do (`tools`,
//! `response_format`) with a 400 naming the parameter; its Ollama API answers tools with a
//! call and `format` with a JSON document. Over a real socket on loopback.

use iop_mock::{MockConfig, MockServer};
use serde_json::{Value, json};

async fn mock() -> MockServer {
    MockServer::start("127.0.0.1:0".parse().unwrap(), MockConfig::default())
        .await
        .unwrap()
}

fn client() -> reqwest::Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder()
        .no_proxy()
        .timeout(std::time::Duration::from_secs(10))
        .build()
        .unwrap()
}

async fn post(url: String, body: Value) -> (u16, String) {
    let response = client().post(url).json(&body).send().await.unwrap();
    (response.status().as_u16(), response.text().await.unwrap())
}

fn chat(extra: Value) -> Value {
    let mut body =
        json!({"model": "mock-model", "messages": [{"role": "user", "content": "Hi there"}]});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

/// The `data:` payloads of an event stream, `[DONE]` left out.
fn chunks(body: &str) -> Vec<Value> {
    body.split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

#[tokio::test]
async fn stop_ends_the_answer_before_the_sequence() {
    let m = mock().await;
    let url = format!("{}/chat/completions", m.openai_base());
    let (status, body) = post(url.clone(), chat(json!({"stop": ["mock", "zebra"]}))).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "Hello from the iop ");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    // Usage counts the tokens generated, the one that completed the stop sequence included.
    assert_eq!(v["usage"]["completion_tokens"], 5);

    // Streamed, and as a single string that falls inside a token.
    let (_, body) = post(url, chat(json!({"stop": "m th", "stream": true}))).await;
    let text: String = chunks(&body)
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, "Hello fro");
    let last = chunks(&body).pop().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "stop");

    // Completions too.
    let (_, body) = post(
        format!("{}/completions", m.openai_base()),
        json!({"model": "mock-model", "prompt": "x", "stop": ["iop"]}),
    )
    .await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["choices"][0]["text"], "Hello from the ");
}

#[tokio::test]
async fn n_answers_that_many_choices() {
    let m = mock().await;
    let url = format!("{}/chat/completions", m.openai_base());
    let (status, body) = post(url.clone(), chat(json!({"n": 3, "max_tokens": 4}))).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(c["message"]["content"], "Hello from the iop");
        assert_eq!(c["finish_reason"], "length");
    }
    assert_eq!(v["usage"]["completion_tokens"], 12);

    let body = chat(
        json!({"n": 2, "max_tokens": 3, "stream": true, "stream_options": {"include_usage": true}}),
    );
    let (_, text) = post(url, body).await;
    let chunks = chunks(&text);
    for index in 0..2 {
        let mine: Vec<&Value> = chunks
            .iter()
            .filter(|c| c["choices"][0]["index"] == index)
            .collect();
        let content: String = mine
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect();
        assert_eq!(content, "Hello from the", "choice {index}");
        assert_eq!(
            mine.last().unwrap()["choices"][0]["finish_reason"],
            "length"
        );
    }
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 6);
}

#[tokio::test]
async fn what_the_mock_cannot_do_is_a_400_naming_the_parameter_and_tools_are_called() {
    let m = mock().await;
    let url = format!("{}/chat/completions", m.openai_base());
    for (extra, param) in [
        (
            json!({"response_format": {"type": "json_object"}}),
            "response_format",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}),
            "response_format",
        ),
        (json!({"n": 0}), "n"),
        (json!({"n": 129}), "n"),
        (json!({"n": "2"}), "n"),
    ] {
        let (status, body) = post(url.clone(), chat(extra.clone())).await;
        assert_eq!(status, 400, "{extra}: {body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["error"]["param"], param, "{extra}: {body}");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert!(
            v["error"]["message"].as_str().unwrap().contains(param),
            "{body}"
        );
    }
    // Offered tools, it calls the first, with arguments that fit its schema; after the
    // tool's result it answers in text.
    let tool = json!([{"type": "function", "function": {"name": "f", "parameters":
        {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]);
    let (status, body) = post(url.clone(), chat(json!({"tools": tool}))).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{body}");
    let call = &v["choices"][0]["message"]["tool_calls"][0];
    assert_eq!(call["function"]["name"], "f");
    assert_eq!(call["function"]["arguments"], r#"{"path":"mock"}"#);
    let (status, body) = post(url.clone(), chat(json!({"tools": tool, "stream": true}))).await;
    assert_eq!(status, 200, "{body}");
    assert!(
        body.contains("\"tool_calls\"") && body.ends_with("data: [DONE]\n\n"),
        "{body}"
    );
    let answered = json!({"model": "m", "tools": tool, "messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": null, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "ok"}
    ]});
    let (status, body) = post(url.clone(), answered).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{body}");
    // What it can honour passes.
    for extra in [
        json!({"tools": []}),
        json!({"tools": null, "response_format": {"type": "text"}, "n": 1}),
    ] {
        let (status, body) = post(url.clone(), chat(extra.clone())).await;
        assert_eq!(status, 200, "{extra}: {body}");
    }
    // A refused request is a finished one, not an abandoned one.
    let stats = m.stats.snapshot();
    assert_eq!(stats.aborted, 0, "{stats:?}");
}

#[tokio::test]
async fn the_ollama_api_calls_tools_honours_format_and_stop() {
    let m = mock().await;
    let url = format!("{}/api/chat", m.ollama_base());
    let tools = json!([{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]);
    let (status, body) = post(
        url.clone(),
        json!({"model": "m", "messages": [{"role": "user", "content": "cats"}], "tools": tools}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let lines: Vec<Value> = body
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(
        lines[0]["message"]["tool_calls"],
        json!([{"function": {"name": "lookup", "arguments": {"query": "cats"}}}])
    );
    assert_eq!(lines.last().unwrap()["done"], true);
    // After the tool's result, text again.
    let (_, body) = post(
        url.clone(),
        json!({"model": "m", "stream": false, "tools": tools, "messages": [
            {"role": "user", "content": "cats"},
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "lookup", "arguments": {"query": "cats"}}}]},
            {"role": "tool", "content": "meow", "tool_name": "lookup"},
        ]}),
    )
    .await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert!(v["message"].get("tool_calls").is_none(), "{v}");
    assert!(
        v["message"]["content"]
            .as_str()
            .unwrap()
            .starts_with("Hello")
    );

    let (_, body) = post(
        url.clone(),
        json!({"model": "m", "stream": false, "format": "json", "options": {"num_predict": 2},
               "messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    let v: Value = serde_json::from_str(&body).unwrap();
    let document: Value = serde_json::from_str(v["message"]["content"].as_str().unwrap()).unwrap();
    assert_eq!(document, json!({"answer": "Hello from"}));

    let (_, body) = post(
        url,
        json!({"model": "m", "stream": false, "options": {"stop": ["the"]},
               "messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["message"]["content"], "Hello from ");
    assert_eq!(v["done_reason"], "stop");
}
