//! The Ollama API on the edge with real processes: the model groups as Ollama models,
//! `/api/chat`, `/api/generate` (streamed by default, and not) and `/api/embed` against
//! a group of each member kind — an OpenAI-compatible provider (translated), an Ollama
//! server (its own answer through the tunnel) and the node's mock adapter (a run) —
//! with usage accounted, slots returned, errors in Ollama's shape, and the official
//! `ollama` Python client listing models and chatting.

mod common;

use std::time::Duration;

use common::ollama_api::{ndjson, usage_tokens};
use common::*;
use serde_json::{Value, json};

struct Setup {
    _dir: tempfile::TempDir,
    mock: MockProc,
    edge: EdgeProc,
    _node: Proc,
}

/// The groups: one per member kind, plus failing and slow ones.
const KINDS: [&str; 3] = ["openai", "ollama", "mock"];

async fn setup_with(auth: &str) -> Setup {
    let dir = tempdir();
    let mock = start_mock(&[]).await;
    let config = format!(
        r#"
{auth}
limits: {{max_body_bytes: 65536}}
nodes:
  - id: n1
    token: token-n1-0123456789
    providers:
      - {{id: oa, kind: openai_compat, base_url: "{a}"}}
      - {{id: ol, kind: ollama, base_url: "{o}"}}
      - {{id: mk, kind: mock, mock: {{tokens: 6}}}}
model_groups:
  - {{name: openai, members: [{{node: n1, provider: oa, model: mock-model}}], context_length: 8192, owned_by: acme}}
  - {{name: ollama, members: [{{node: n1, provider: ol, model: mock-model}}]}}
  - {{name: mock, members: [{{node: n1, provider: mk}}]}}
  - {{name: openai-fail, members: [{{node: n1, provider: oa, model: fail-500}}]}}
  - {{name: ollama-fail, members: [{{node: n1, provider: ol, model: fail-500}}]}}
  - {{name: slow, members: [{{node: n1, provider: oa, model: slow}}]}}
  - {{name: midfail, members: [{{node: n1, provider: oa, model: error-mid-stream}}]}}
"#,
        a = mock.openai_base(),
        o = mock.ollama_base(),
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

async fn post(edge: &EdgeProc, path: &str, body: &Value) -> (u16, String, String) {
    let response = client()
        .post(edge.url(path))
        .json(body)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    let content_type = response
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    (status, content_type, response.text().await.unwrap())
}

fn chat(model: &str) -> Value {
    json!({"model": model, "messages": [{"role": "user", "content": "Say hello to everyone"}]})
}

#[tokio::test]
async fn the_model_groups_are_listed_shown_and_running_as_ollama_models() {
    let s = setup().await;
    let version = get_json(&s.edge.url("/api/version")).await;
    assert!(version["version"].as_str().is_some(), "{version}");

    let tags = get_json(&s.edge.url("/api/tags")).await;
    let models = tags["models"].as_array().unwrap();
    let names: Vec<&str> = models.iter().map(|m| m["name"].as_str().unwrap()).collect();
    for kind in KINDS {
        assert!(names.contains(&kind), "{tags}");
    }
    let openai = models.iter().find(|m| m["name"] == "openai").unwrap();
    assert_eq!(openai["model"], "openai");
    assert_eq!(openai["size"], 0);
    assert_eq!(openai["digest"].as_str().unwrap().len(), 64);
    assert!(openai["modified_at"].as_str().unwrap().ends_with('Z'));
    assert!(openai["details"].is_object());

    // From the config: the context length.
    let (status, _, body) = post(&s.edge, "/api/show", &json!({"model": "openai"})).await;
    assert_eq!(status, 200, "{body}");
    let show: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(show["model_info"]["iop.context_length"], 8192, "{show}");
    assert_eq!(show["capabilities"], json!(["completion"]));
    // From the Ollama member itself: its details.
    let (status, _, body) = post(&s.edge, "/api/show", &json!({"model": "ollama:latest"})).await;
    assert_eq!(status, 200, "{body}");
    let show: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(show["details"]["family"], "mock", "{show}");
    assert_eq!(
        show["modelfile"], "",
        "the node's modelfile stays on the node"
    );
    let (status, _, body) = post(&s.edge, "/api/show", &json!({"model": "nope"})).await;
    assert_eq!(status, 404);
    assert!(serde_json::from_str::<Value>(&body).unwrap()["error"].is_string());

    let ps = get_json(&s.edge.url("/api/ps")).await;
    assert_eq!(ps["models"].as_array().unwrap().len(), models.len(), "{ps}");

    // The OpenAI model list carries the same metadata.
    let model = get_json(&s.edge.url("/v1/models/openai")).await;
    assert_eq!(
        (model["owned_by"].as_str(), model["context_length"].as_u64()),
        (Some("acme"), Some(8192))
    );
    assert!(model["created"].as_u64().unwrap() > 0);
}

#[tokio::test]
async fn chat_streams_by_default_and_answers_whole_for_every_member_kind() {
    let s = setup().await;
    for kind in KINDS {
        let before = usage_tokens(&s.edge, kind, "output").await;
        let (status, content_type, body) = post(&s.edge, "/api/chat", &chat(kind)).await;
        assert_eq!(status, 200, "{kind}: {body}");
        assert!(
            content_type.starts_with("application/x-ndjson"),
            "{kind}: {content_type}"
        );
        let lines = ndjson(&body);
        assert!(lines.len() > 2, "{kind}: {body}");
        let text: String = lines
            .iter()
            .filter_map(|l| l["message"]["content"].as_str())
            .collect();
        assert!(text.split_whitespace().count() >= 3, "{kind}: {text:?}");
        for line in &lines[..lines.len() - 1] {
            assert_eq!(line["done"], false, "{kind}: {line}");
            assert_eq!(line["message"]["role"], "assistant");
            assert!(line["created_at"].is_string());
        }
        let last = lines.last().unwrap();
        assert_eq!(last["done"], true, "{kind}: {last}");
        assert_eq!(last["done_reason"], "stop", "{kind}: {last}");
        assert!(last["eval_count"].as_u64().unwrap() > 0, "{kind}: {last}");
        assert!(last["prompt_eval_count"].is_u64(), "{kind}: {last}");
        for field in ["total_duration", "prompt_eval_duration", "eval_duration"] {
            assert!(last[field].is_u64(), "{kind}: {field} in {last}");
        }
        if kind != "ollama" {
            // Translated answers name the group.
            assert_eq!(last["model"], kind);
        }

        let mut whole = chat(kind);
        whole["stream"] = json!(false);
        whole["options"] = json!({"num_predict": 3, "temperature": 0.1});
        let (status, content_type, body) = post(&s.edge, "/api/chat", &whole).await;
        assert_eq!(status, 200, "{kind}: {body}");
        assert!(
            content_type.starts_with("application/json"),
            "{kind}: {content_type}"
        );
        let answer: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(answer["done"], true, "{kind}: {answer}");
        assert_eq!(
            answer["done_reason"], "length",
            "{kind}: num_predict reached {answer}"
        );
        assert_eq!(answer["eval_count"], 3, "{kind}: {answer}");
        let content = answer["message"]["content"].as_str().unwrap();
        assert_eq!(content.split_whitespace().count(), 3, "{kind}: {answer}");
        assert!(
            usage_tokens(&s.edge, kind, "output").await >= before + 3,
            "{kind}: the usage was accounted"
        );
    }
    wait_idle(&s.edge).await;
}

#[tokio::test]
async fn generate_streams_and_answers_for_every_member_kind() {
    let s = setup().await;
    for kind in KINDS {
        let request =
            json!({"model": kind, "prompt": "Why is the sky blue?", "system": "Be brief."});
        let (status, _, body) = post(&s.edge, "/api/generate", &request).await;
        assert_eq!(status, 200, "{kind}: {body}");
        let lines = ndjson(&body);
        let text: String = lines
            .iter()
            .filter_map(|l| l["response"].as_str())
            .collect();
        assert!(!text.trim().is_empty(), "{kind}: {body}");
        let last = lines.last().unwrap();
        assert_eq!(
            (last["done"].as_bool(), last["done_reason"].as_str()),
            (Some(true), Some("stop")),
            "{kind}: {last}"
        );

        let whole = json!({"model": kind, "prompt": "Why?", "stream": false, "options": {"stop": ["mock"]}});
        let (status, _, body) = post(&s.edge, "/api/generate", &whole).await;
        assert_eq!(status, 200, "{kind}: {body}");
        let answer: Value = serde_json::from_str(&body).unwrap();
        let response = answer["response"].as_str().unwrap();
        assert!(
            !response.is_empty() && !response.contains("mock"),
            "{kind}: stop honoured: {answer}"
        );
        assert_eq!(answer["done"], true);
    }
    // A prompt-less generate only "loads" the model.
    let (status, _, body) = post(&s.edge, "/api/generate", &json!({"model": "openai"})).await;
    assert_eq!(status, 200);
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap()["done_reason"],
        "load"
    );
    wait_idle(&s.edge).await;
}

#[tokio::test]
async fn embeddings_come_from_tunnelled_and_ollama_members_only() {
    let s = setup().await;
    for kind in ["openai", "ollama"] {
        let request = json!({"model": kind, "input": ["first text", "second text here"]});
        let (status, _, body) = post(&s.edge, "/api/embed", &request).await;
        assert_eq!(status, 200, "{kind}: {body}");
        let answer: Value = serde_json::from_str(&body).unwrap();
        let vectors = answer["embeddings"].as_array().unwrap();
        assert_eq!(vectors.len(), 2, "{kind}: {answer}");
        assert_eq!(vectors[0].as_array().unwrap().len(), 8);
        assert_ne!(vectors[0], vectors[1]);
        assert_eq!(answer["prompt_eval_count"], 5, "{kind}: {answer}");

        let (status, _, body) = post(
            &s.edge,
            "/api/embeddings",
            &json!({"model": kind, "prompt": "first text"}),
        )
        .await;
        assert_eq!(status, 200, "{kind}: {body}");
        let legacy: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            legacy["embedding"], vectors[0],
            "{kind}: the same vector for the same text"
        );
    }
    let (status, _, body) = post(
        &s.edge,
        "/api/embed",
        &json!({"model": "mock", "input": "x"}),
    )
    .await;
    assert_eq!(status, 400, "{body}");
    let error: Value = serde_json::from_str(&body).unwrap();
    assert!(
        error["error"].as_str().unwrap().contains("embeddings"),
        "{error}"
    );
    wait_idle(&s.edge).await;
}

#[tokio::test]
async fn errors_come_in_ollama_shape_with_their_status() {
    let s = setup().await;
    let error_of = |body: &str| -> String {
        let v: Value = serde_json::from_str(body).unwrap_or_else(|_| panic!("not JSON: {body}"));
        assert_eq!(v.as_object().unwrap().len(), 1, "only `error`: {v}");
        v["error"].as_str().unwrap().to_string()
    };
    let (status, _, body) = post(&s.edge, "/api/chat", &chat("no-such-model")).await;
    assert_eq!(status, 404);
    assert!(error_of(&body).contains("no-such-model"));
    let mut bad = chat("openai");
    bad["options"] = json!({"temperature": "hot"});
    let (status, _, body) = post(&s.edge, "/api/chat", &bad).await;
    assert_eq!(status, 400);
    assert!(error_of(&body).contains("options.temperature"), "{body}");
    let (status, _, body) = post(&s.edge, "/api/chat", &json!({"messages": []})).await;
    assert_eq!(status, 400);
    assert!(error_of(&body).contains("model"), "{body}");
    // A provider's failure keeps its status; translated or passed through.
    for group in ["openai-fail", "ollama-fail"] {
        let (status, _, body) = post(&s.edge, "/api/chat", &chat(group)).await;
        assert_eq!(status, 500, "{group}: {body}");
        assert!(
            error_of(&body).contains("mock provider failure"),
            "{group}: {body}"
        );
    }
    // A failure mid-stream ends the stream with an error line.
    let (status, _, body) = post(&s.edge, "/api/chat", &chat("midfail")).await;
    assert_eq!(status, 200);
    let lines = ndjson(&body);
    assert!(lines.last().unwrap()["error"].is_string(), "{body}");
    // Bodies over the limit, nested too deep or naming a field twice go no further.
    let mut huge = chat("openai");
    huge["messages"][0]["content"] = json!("x".repeat(70_000));
    let (status, _, body) = post(&s.edge, "/api/chat", &huge).await;
    assert_eq!(status, 413, "{body}");
    assert!(error_of(&body).contains("max_body_bytes"), "{body}");
    let deep = format!(
        r#"{{"model":"openai","messages":[],"x":{}{}}}"#,
        "[".repeat(100),
        "]".repeat(100)
    );
    let response = client()
        .post(s.edge.url("/api/chat"))
        .header("content-type", "application/json")
        .body(deep)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 400);
    assert!(error_of(&response.text().await.unwrap()).contains("nested"));
    let response = client()
        .post(s.edge.url("/api/chat"))
        .header("content-type", "application/json")
        .body(r#"{"model":"openai","model":"ollama","messages":[]}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 400);
    assert!(error_of(&response.text().await.unwrap()).contains("duplicate"));
    let (status, _, body) = post(&s.edge, "/api/push", &json!({"model": "llama3"})).await;
    assert_eq!(status, 501);
    error_of(&body);
    let response = client().get(s.edge.url("/api/nope")).send().await.unwrap();
    assert_eq!(response.status(), 404);
    error_of(&response.text().await.unwrap());
    wait_idle(&s.edge).await;
}

#[tokio::test]
async fn tools_reach_every_model_and_come_back_as_ollama_tool_calls() {
    let s = setup().await;
    let tools = json!([{"type": "function", "function": {"name": "lookup",
        "description": "look something up", "parameters": {"type": "object"}}}]);
    let mut request = chat("ollama");
    request["tools"] = tools.clone();
    request["stream"] = json!(false);
    let (status, _, body) = post(&s.edge, "/api/chat", &request).await;
    assert_eq!(status, 200, "{body}");
    let answer: Value = serde_json::from_str(&body).unwrap();
    let call = &answer["message"]["tool_calls"][0]["function"];
    assert_eq!(call["name"], "lookup", "{answer}");
    assert!(call["arguments"].is_object(), "{answer}");
    // The tool's answer goes back with the conversation.
    request["messages"] = json!([
        {"role": "user", "content": "cats"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "lookup", "arguments": {"query": "cats"}}}]},
        {"role": "tool", "tool_name": "lookup", "content": "cats purr"},
    ]);
    let (status, _, body) = post(&s.edge, "/api/chat", &request).await;
    assert_eq!(status, 200, "{body}");
    let answer: Value = serde_json::from_str(&body).unwrap();
    assert!(
        answer["message"]["content"].as_str().unwrap().len() > 3,
        "{answer}"
    );
    // The mock adapter calls the first tool it is offered, and so does the mock's OpenAI
    // API, through the translation.
    for group in ["mock", "openai"] {
        let mut request = chat(group);
        request["tools"] = tools.clone();
        request["stream"] = json!(false);
        let (status, _, body) = post(&s.edge, "/api/chat", &request).await;
        assert_eq!(status, 200, "{group}: {body}");
        let answer: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            answer["message"]["tool_calls"][0]["function"]["name"], "lookup",
            "{group}: {answer}"
        );
    }
    // An unload request answers at once.
    let (status, _, body) = post(
        &s.edge,
        "/api/generate",
        &json!({"model": "mock", "keep_alive": 0}),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap()["done_reason"],
        "unload"
    );
    wait_idle(&s.edge).await;
}

#[tokio::test]
async fn a_client_that_goes_away_cancels_the_request_and_frees_its_slot() {
    let s = setup().await;
    let mut response = client()
        .post(s.edge.url("/api/chat"))
        .json(&chat("slow"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let mut seen = String::new();
    read_until(&mut response, &mut seen, |s| s.lines().count() >= 2).await;
    drop(response);
    s.mock.wait_aborted(1, Duration::from_secs(10)).await;
    wait_idle(&s.edge).await;
}

#[tokio::test]
async fn keys_guard_the_ollama_api_and_allowlists_limit_its_models() {
    let auth = format!(
        r#"
auth:
  keys:
    - {{name: ops, role: admin, key: "{TEST_API_KEY}"}}
    - {{name: team, role: client, key: team-key-0123456789, models: [mock]}}
"#
    );
    let s = setup_with(&auth).await;
    let response = client().get(s.edge.url("/api/tags")).send().await.unwrap();
    assert_eq!(response.status(), 401);
    let body: Value = response.json().await.unwrap();
    assert!(
        body["error"].as_str().unwrap().contains("API key"),
        "{body}"
    );
    let tags: Value = client()
        .get(s.edge.url("/api/tags"))
        .bearer_auth("team-key-0123456789")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let names: Vec<&str> = tags["models"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["mock"]);
    let response = client()
        .post(s.edge.url("/api/chat"))
        .bearer_auth("team-key-0123456789")
        .json(&chat("openai"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 404, "another key's model is not found");
    let mut whole = chat("mock");
    whole["stream"] = json!(false);
    let response = client()
        .post(s.edge.url("/api/chat"))
        .bearer_auth("team-key-0123456789")
        .json(&whole)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
}

#[tokio::test]
async fn the_ollama_python_client_lists_models_and_chats() {
    let test = "the ollama Python client against the Ollama API";
    let Some(python) = common::sdk::python(test, &["ollama"]) else {
        return;
    };
    let s = setup().await;
    common::sdk::run_check(
        &python,
        &common::sdk::check_script("python/ollama_client_check.py"),
        &[
            &format!("http://{}", s.edge.http),
            "--chat=openai,ollama,mock",
            "--embed=openai,ollama",
            "--context=openai=8192",
        ],
    )
    .await;
    wait_idle(&s.edge).await;
}
