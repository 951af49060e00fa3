//! Conformance against a real inference server: llama.cpp's `llama-server` (built by
//! `scripts/real-backend.sh`, found through `IOP_LLAMA_SERVER` and `IOP_LLAMA_MODEL`) with
//! an edge and a node in front of it. Every request is sent to the server directly and
//! through iop, and the answers must be the same once ids and timings are normalised:
//! models, chat, completions and embeddings (streamed and not), the Responses and Messages
//! APIs (tunnelled to a provider that serves them; translated to chat for one that does
//! not, where they must carry the server's own chat text and token counts), the Ollama API,
//! a client abort that stops the server's generation (chat, translated Messages, tunnelled
//! Responses), more concurrent requests than the server has slots (iop queues them), and
//! the server's own errors (context overflow, an unknown model) passing through unchanged.
//!
//! The cases share one server, edge and node and run one after another (see
//! `common::suite`). Without the environment variables the suite says it is skipped and
//! passes, unless `IOP_REQUIRE_REAL_BACKEND=1` (as in CI), which makes it fail instead.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::real_backend::{LlamaServer, start_llama_server};
use common::suite::{Report, notice};
use common::*;
use serde_json::{Value, json};

/// The model name llama-server answers to (`--alias`), and the member's upstream model.
const UPSTREAM: &str = "tiny";
/// The server's slots, and iop's capacity for it.
const SLOTS: usize = 2;
/// Total context; each slot gets its share. Larger than the model was trained for (the
/// server allows it): a slot's longest answer must take the server a few seconds even on an
/// idle machine (it generates thousands of tokens a second), so an abort or a queued
/// request always meets a generation still running.
const CONTEXT: usize = 32768;
/// The context the model was trained for (scripts/tiny_gguf.py), as the server reports it
/// and as the `tiny` group's config states it.
const TRAINED_CONTEXT: u64 = 4096;
/// Tokens per answer in the comparisons: small, and every answer runs to it (the model
/// never picks its end-of-turn token).
const MAX_TOKENS: u64 = 24;
const PROMPT: &str = "Say something about the edge and the node.";
/// What every request may take on a busy machine.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);

/// Everything the cases share.
struct Ctx {
    llama: LlamaServer,
    router: LlamaServer,
    edge: EdgeProc,
    _node: Proc,
    _dir: tempfile::TempDir,
}

impl Ctx {
    fn via(&self, path: &str) -> String {
        self.edge.url(path)
    }

    fn direct(&self, path: &str) -> String {
        self.llama.url(path)
    }
}

fn http() -> reqwest::Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder()
        .no_proxy()
        .timeout(REQUEST_TIMEOUT)
        .build()
        .unwrap()
}

/// Groups: `tiny` (an `openai_compat` provider with the default APIs: Responses and
/// Messages translated to chat), `tiny-vllm` (the same server as a `vllm` provider with
/// `tunnel_usage: off`: streams sent exactly as the client sent them),
/// `tiny-native` (a provider that lists every API llama-server serves: all tunnelled) and
/// `ghost` (a model the router server does not have).
fn edge_config(llama: &str, router: &str) -> String {
    let provider = |id: &str, kind: &str, base: &str, extra: &str| {
        format!(
            "      - {{id: {id}, kind: {kind}, base_url: \"{base}\", capacity: {{normal: {SLOTS}, long: 0}}, request_timeout_sec: 120{extra}}}\n"
        )
    };
    let group = |name: &str, provider: &str, model: &str, extra: &str| {
        format!(
            "  - {{name: {name}, members: [{{node: n1, provider: {provider}, model: {model}}}], queue: {{max_waiting: 64, timeout_sec: 300}}{extra}}}\n"
        )
    };
    let providers = provider("llama", "openai_compat", llama, "")
        + &provider("llama-vllm", "vllm", llama, ", tunnel_usage: off")
        + &provider(
            "llama-native",
            "openai_compat",
            llama,
            ", apis: [chat, completions, embeddings, responses, messages]",
        )
        + &provider("router", "openai_compat", router, "");
    let groups = group(
        "tiny",
        "llama",
        UPSTREAM,
        &format!(", context_length: {TRAINED_CONTEXT}, owned_by: llama.cpp"),
    ) + &group("tiny-vllm", "llama-vllm", UPSTREAM, "")
        + &group("tiny-native", "llama-native", UPSTREAM, "")
        + &group("ghost", "router", "no-such-model", "");
    format!(
        "limits: {{max_body_bytes: 1048576}}\nnodes:\n  - id: n1\n    token: token-n1-0123456789\n    providers:\n{providers}model_groups:\n{groups}"
    )
}

async fn setup(server: &Path, model: &Path) -> Ctx {
    let dir = tempdir();
    let model = model.to_str().unwrap();
    let ctx = CONTEXT.to_string();
    let slots = SLOTS.to_string();
    let llama = start_llama_server(
        "llama-server",
        server,
        &[
            "--model",
            model,
            "--alias",
            UPSTREAM,
            "--ctx-size",
            &ctx,
            "--parallel",
            &slots,
            // Embeddings from the same server: mean pooling over the tokens.
            "--embeddings",
            "--pooling",
            "mean",
            // Each request computed from scratch: the same bytes whoever asks first.
            "--no-cache-prompt",
            "--cache-ram",
            "0",
            "--slots",
            "--metrics",
            "--no-warmup",
        ],
    )
    .await;
    // The router mode serves the models of a directory by name, and refuses others: the
    // server behind the unknown-model case. This one has none.
    let models_dir = dir.path().join("router-models");
    std::fs::create_dir(&models_dir).unwrap();
    let router = start_llama_server(
        "llama-router",
        server,
        &[
            "--models-dir",
            models_dir.to_str().unwrap(),
            "--no-models-autoload",
        ],
    )
    .await;
    let edge = start_edge(dir.path(), &edge_config(&llama.base(), &router.base())).await;
    let node = start_node("n1", dir.path(), &edge.nodes, "token-n1-0123456789", "");
    wait_ready(&edge, "n1").await;
    Ctx {
        llama,
        router,
        edge,
        _node: node,
        _dir: dir,
    }
}

/// An answer with what differs between two identical requests (ids, clocks, timings)
/// replaced, so a direct and a relayed answer compare equal.
#[derive(Clone, Debug, PartialEq)]
struct Answer {
    status: u16,
    content_type: String,
    body: Body,
}

#[derive(Clone, Debug, PartialEq)]
enum Body {
    Json(Value),
    /// `(event name, data)`, data parsed when it is JSON.
    Events(Vec<(String, Value)>),
    Text(String),
}

impl Answer {
    fn json(&self) -> &Value {
        match &self.body {
            Body::Json(v) => v,
            other => panic!("not a JSON answer ({}): {other:?}", self.status),
        }
    }

    fn events(&self) -> &[(String, Value)] {
        match &self.body {
            Body::Events(e) => e,
            other => panic!("not an event stream ({}): {other:?}", self.status),
        }
    }

    /// The data of every event that is JSON.
    fn event_data(&self) -> Vec<&Value> {
        self.events()
            .iter()
            .map(|(_, d)| d)
            .filter(|d| d.is_object())
            .collect()
    }
}

const VOLATILE: &[&str] = &[
    "id",
    "created",
    "created_at",
    "completed_at",
    "system_fingerprint",
    "timings",
    "item_id",
    "response_id",
];

fn normalise(v: &mut Value) {
    match v {
        Value::Object(map) => {
            for (key, value) in map.iter_mut() {
                if VOLATILE.contains(&key.as_str()) {
                    *value = Value::String("<volatile>".into());
                } else {
                    normalise(value);
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(normalise),
        _ => {}
    }
}

async fn send(request: reqwest::RequestBuilder) -> Answer {
    let response = request.send().await.expect("request");
    let status = response.status().as_u16();
    let content_type = response
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    let text = response.text().await.expect("body");
    let body = if content_type.starts_with("text/event-stream") {
        Body::Events(
            sse_events(&text)
                .into_iter()
                .map(|(name, data)| {
                    let mut value =
                        serde_json::from_str(&data).unwrap_or(Value::String(data.clone()));
                    normalise(&mut value);
                    (name, value)
                })
                .collect(),
        )
    } else if let Ok(mut value) = serde_json::from_str::<Value>(&text) {
        normalise(&mut value);
        Body::Json(value)
    } else {
        Body::Text(text)
    };
    Answer {
        status,
        content_type,
        body,
    }
}

async fn post(url: &str, body: &Value) -> Answer {
    send(http().post(url).json(body)).await
}

fn with_model(body: &Value, model: &str) -> Value {
    let mut body = body.clone();
    body["model"] = json!(model);
    body
}

/// Sends `body` to the server's `path` directly (model `tiny`) and to the edge's `path`
/// for `group`; they must answer the same. Returns the direct answer.
async fn same_both_ways(ctx: &Ctx, path: &str, group: &str, body: &Value) -> Answer {
    let direct = post(&ctx.direct(path), &with_model(body, UPSTREAM)).await;
    let via = post(&ctx.via(path), &with_model(body, group)).await;
    assert_same(&via, &direct, &format!("{path} via group {group}"));
    direct
}

/// Fails with the first difference between iop's answer and the server's, if any.
fn assert_same(via: &Answer, direct: &Answer, what: &str) {
    if via == direct {
        return;
    }
    let first = match (&via.body, &direct.body) {
        (Body::Events(a), Body::Events(b)) => {
            let i = a.iter().zip(b).take_while(|(x, y)| x == y).count();
            format!(
                "event {i} of {} (iop) / {} (server): {:?} vs {:?}",
                a.len(),
                b.len(),
                a.get(i),
                b.get(i)
            )
        }
        (a, b) => format!("{a:?} vs {b:?}"),
    };
    panic!(
        "{what}: iop's answer differs from the server's (status {} vs {}, content-type {:?} vs {:?}); {first}",
        via.status, direct.status, via.content_type, direct.content_type
    );
}

fn chat_body(stream: bool, include_usage: bool) -> Value {
    let mut body = json!({
        "messages": [{"role": "user", "content": PROMPT}],
        "temperature": 0,
        "seed": 14,
        "max_tokens": MAX_TOKENS,
        "stream": stream,
    });
    if include_usage {
        body["stream_options"] = json!({"include_usage": true});
    }
    body
}

/// The text of a chat answer, streamed or not.
fn chat_text(answer: &Answer) -> String {
    match &answer.body {
        Body::Json(v) => v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or_else(|| panic!("no content: {v}"))
            .to_string(),
        Body::Events(_) => answer
            .event_data()
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect(),
        Body::Text(t) => panic!("not a chat answer: {t}"),
    }
}

/// The server's own answer to the suite's prompt: the text the translated APIs must give.
async fn reference_text(ctx: &Ctx) -> String {
    let direct = post(
        &ctx.direct("/v1/chat/completions"),
        &with_model(&chat_body(false, false), UPSTREAM),
    )
    .await;
    assert_eq!(direct.status, 200, "{direct:?}");
    let text = chat_text(&direct);
    assert!(!text.is_empty(), "the model said nothing: {direct:?}");
    text
}

async fn models_list(ctx: Arc<Ctx>) {
    let list = get_json(&ctx.via("/v1/models")).await;
    assert_eq!(list["object"], "list", "{list}");
    let ids: Vec<&str> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            assert_eq!(m["object"], "model", "{m}");
            m["id"].as_str().unwrap()
        })
        .collect();
    for group in ["tiny", "tiny-vllm", "ghost"] {
        assert!(ids.contains(&group), "{group} not in {ids:?}");
    }
    // The server lists its own model under the alias the members name.
    let direct = get_json(&ctx.direct("/v1/models")).await;
    assert!(
        direct["data"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m["id"] == UPSTREAM),
        "{direct}"
    );
}

async fn model_by_id(ctx: Arc<Ctx>) {
    let model = get_json(&ctx.via("/v1/models/tiny")).await;
    assert_eq!(
        (&model["id"], &model["object"]),
        (&json!("tiny"), &json!("model"))
    );
    assert_eq!(model["owned_by"], "llama.cpp", "{model}");
    // The context length the group states is the one the server reports for its model.
    let direct = get_json(&ctx.direct("/v1/models")).await;
    let served = direct["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["id"] == UPSTREAM)
        .unwrap_or_else(|| panic!("{direct}"))
        .clone();
    assert_eq!(served["meta"]["n_ctx_train"], TRAINED_CONTEXT, "{served}");
    assert_eq!(model["context_length"], TRAINED_CONTEXT, "{model}");
    let missing = send(http().get(ctx.via("/v1/models/no-such-group"))).await;
    assert_eq!(missing.status, 404, "{missing:?}");
    assert!(
        missing.json()["error"]["message"].is_string(),
        "{missing:?}"
    );
}

/// Chat through a tunnel, JSON and SSE, with and without usage in the stream: the same
/// answer as the server's. One documented difference: for a stream without
/// `stream_options.include_usage`, a provider with `tunnel_usage: inject` (the default) is
/// asked for usage anyway and the node removes the usage chunk; llama-server then puts its
/// `timings` on that chunk instead of the finish chunk, so the client's finish chunk has no
/// `timings`. With `tunnel_usage: off` the stream is the server's own.
async fn chat_same(ctx: Arc<Ctx>, group: &'static str, injects_usage: bool) {
    for (stream, usage) in [(false, false), (true, true), (true, false)] {
        let body = chat_body(stream, usage);
        let direct = post(
            &ctx.direct("/v1/chat/completions"),
            &with_model(&body, UPSTREAM),
        )
        .await;
        let via = post(&ctx.via("/v1/chat/completions"), &with_model(&body, group)).await;
        let mut expected = direct.clone();
        if stream && !usage && injects_usage {
            let Body::Events(events) = &mut expected.body else {
                panic!("not a stream: {direct:?}")
            };
            let with_timings = events
                .iter_mut()
                .filter_map(|(_, data)| data.as_object_mut()?.remove("timings"))
                .count();
            assert_eq!(with_timings, 1, "the server's timings: {direct:?}");
        }
        assert_same(
            &via,
            &expected,
            &format!("chat via {group}, stream={stream}, include_usage={usage}"),
        );
        let answer = direct;
        assert_eq!(answer.status, 200, "{answer:?}");
        assert!(!chat_text(&answer).is_empty(), "{answer:?}");
        if stream {
            assert_eq!(
                answer.events().last().unwrap().1,
                "[DONE]",
                "stream={stream}: {answer:?}"
            );
        } else {
            let v = answer.json();
            assert_eq!(v["usage"]["completion_tokens"], MAX_TOKENS, "{v}");
            assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
        }
    }
}

async fn completions_same(ctx: Arc<Ctx>) {
    for stream in [false, true] {
        let body = json!({
            "prompt": PROMPT, "temperature": 0, "seed": 14, "max_tokens": MAX_TOKENS, "stream": stream,
        });
        let answer = same_both_ways(&ctx, "/v1/completions", "tiny", &body).await;
        assert_eq!(answer.status, 200, "{answer:?}");
        let text: String = match &answer.body {
            Body::Json(v) => v["choices"][0]["text"].as_str().unwrap().to_string(),
            _ => answer
                .event_data()
                .iter()
                .filter_map(|c| c["choices"][0]["text"].as_str())
                .collect(),
        };
        assert!(!text.is_empty(), "{answer:?}");
    }
}

async fn embeddings_same(ctx: Arc<Ctx>) {
    for input in [
        json!("the edge"),
        json!(["the edge", "the node and the model"]),
    ] {
        let body = json!({"input": input});
        let answer = same_both_ways(&ctx, "/v1/embeddings", "tiny", &body).await;
        assert_eq!(answer.status, 200, "{answer:?}");
        let data = answer.json()["data"].as_array().unwrap();
        let n = if input.is_array() { 2 } else { 1 };
        assert_eq!(data.len(), n, "{answer:?}");
        assert!(
            data.iter()
                .all(|d| d["embedding"].as_array().is_some_and(|e| !e.is_empty())),
            "{answer:?}"
        );
    }
}

fn responses_body(stream: bool) -> Value {
    json!({"input": PROMPT, "max_output_tokens": MAX_TOKENS, "temperature": 0, "stream": stream})
}

fn messages_body(stream: bool) -> Value {
    json!({
        "max_tokens": MAX_TOKENS,
        "messages": [{"role": "user", "content": PROMPT}],
        "temperature": 0,
        "stream": stream,
    })
}

/// Responses and Messages requests tunnelled to a provider that serves them itself.
async fn native_apis_same(ctx: Arc<Ctx>, path: &'static str) {
    for stream in [false, true] {
        let body = if path == "/v1/responses" {
            responses_body(stream)
        } else {
            messages_body(stream)
        };
        let answer = same_both_ways(&ctx, path, "tiny-native", &body).await;
        assert_eq!(answer.status, 200, "{path} stream={stream}: {answer:?}");
    }
}

/// The Responses API translated to chat for a provider that does not list it: the same
/// text as the server's chat answer, in the Responses API's shape.
async fn responses_translated(ctx: Arc<Ctx>) {
    let expected = reference_text(&ctx).await;
    let answer = post(
        &ctx.via("/v1/responses"),
        &with_model(&responses_body(false), "tiny"),
    )
    .await;
    assert_eq!(answer.status, 200, "{answer:?}");
    let v = answer.json();
    assert_eq!(v["object"], "response", "{v}");
    let text: String = v["output"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|item| item["type"] == "message")
        .flat_map(|item| item["content"].as_array().unwrap().iter())
        .filter(|part| part["type"] == "output_text")
        .map(|part| part["text"].as_str().unwrap())
        .collect();
    assert_eq!(text, expected, "{v}");
    assert_eq!(v["usage"]["output_tokens"], MAX_TOKENS, "{v}");
    assert!(v["usage"]["input_tokens"].as_u64() > Some(0), "{v}");

    let answer = post(
        &ctx.via("/v1/responses"),
        &with_model(&responses_body(true), "tiny"),
    )
    .await;
    assert_eq!(answer.status, 200, "{answer:?}");
    let events = answer.events();
    assert_eq!(events[0].0, "response.created", "{events:?}");
    let (last, data) = events.last().unwrap();
    assert!(
        last == "response.completed" || last == "response.incomplete",
        "{events:?}"
    );
    assert_eq!(data["response"]["usage"]["output_tokens"], MAX_TOKENS);
    let streamed: String = events
        .iter()
        .filter(|(name, _)| name == "response.output_text.delta")
        .map(|(_, d)| d["delta"].as_str().unwrap())
        .collect();
    assert_eq!(streamed, expected, "{events:?}");
}

/// The Messages API translated to chat, likewise.
async fn messages_translated(ctx: Arc<Ctx>) {
    let expected = reference_text(&ctx).await;
    let answer = post(
        &ctx.via("/v1/messages"),
        &with_model(&messages_body(false), "tiny"),
    )
    .await;
    assert_eq!(answer.status, 200, "{answer:?}");
    let v = answer.json();
    assert_eq!(
        (&v["type"], &v["role"]),
        (&json!("message"), &json!("assistant")),
        "{v}"
    );
    let text: String = v["content"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["type"] == "text")
        .map(|b| b["text"].as_str().unwrap())
        .collect();
    assert_eq!(text, expected, "{v}");
    assert_eq!(v["stop_reason"], "max_tokens", "{v}");
    assert_eq!(v["usage"]["output_tokens"], MAX_TOKENS, "{v}");

    let answer = post(
        &ctx.via("/v1/messages"),
        &with_model(&messages_body(true), "tiny"),
    )
    .await;
    assert_eq!(answer.status, 200, "{answer:?}");
    let events = answer.events();
    assert_eq!(events[0].0, "message_start", "{events:?}");
    assert_eq!(events.last().unwrap().0, "message_stop", "{events:?}");
    let streamed: String = events
        .iter()
        .filter(|(name, _)| name == "content_block_delta")
        .filter_map(|(_, d)| d["delta"]["text"].as_str())
        .collect();
    assert_eq!(streamed, expected, "{events:?}");
    let delta = events
        .iter()
        .find(|(name, _)| name == "message_delta")
        .unwrap_or_else(|| panic!("no message_delta: {events:?}"));
    assert_eq!(delta.1["usage"]["output_tokens"], MAX_TOKENS, "{events:?}");
}

/// `/v1/messages/count_tokens` counted by the server: passed through to a member that
/// serves Messages (the server's own count), counted with its tokenizer for one that does
/// not (the translated chat rendered with the model's template), and the same count
/// through the `anthropic` SDK.
async fn count_tokens(ctx: Arc<Ctx>) {
    let body = json!({
        "model": UPSTREAM,
        "system": "You are terse.",
        "messages": [{"role": "user", "content": PROMPT}]
    });
    let direct = post(&ctx.direct("/v1/messages/count_tokens"), &body).await;
    assert_eq!(direct.status, 200, "{direct:?}");
    let expected = direct.json()["input_tokens"].as_u64().unwrap();
    for (group, counted_by) in [("tiny-native", "provider"), ("tiny", "tokenizer")] {
        let response = http()
            .post(ctx.via("/v1/messages/count_tokens"))
            .json(&with_model(&body, group))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200, "{group}");
        assert_eq!(
            response.headers()["x-iop-token-count"],
            counted_by,
            "{group}"
        );
        let answer: Value = response.json().await.unwrap();
        assert_eq!(answer["input_tokens"], expected, "{group}: {answer}");
    }
    let test = "the anthropic SDK's count_tokens against llama-server";
    if let Some(python) = common::sdk::python(test, &["anthropic"]) {
        for group in ["tiny", "tiny-native"] {
            common::sdk::run_check(
                &python,
                &common::sdk::check_script("python/count_tokens_check.py"),
                &[&ctx.via(""), group],
            )
            .await;
        }
    }
}

/// The Ollama API on the edge, translated to the server's chat and embeddings.
async fn ollama_api(ctx: Arc<Ctx>) {
    let tags = send(http().get(ctx.via("/api/tags"))).await;
    assert_eq!(tags.status, 200, "{tags:?}");
    assert!(
        tags.json()["models"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m["name"] == "tiny" || m["name"] == "tiny:latest"),
        "{tags:?}"
    );
    // /api/show of a group whose member is the server: what its /v1/models says.
    let show = post(&ctx.via("/api/show"), &json!({"model": "tiny"})).await;
    assert_eq!(show.status, 200, "{show:?}");
    let details = &show.json()["details"];
    assert_eq!(
        (
            &details["format"],
            &details["family"],
            &details["quantization_level"]
        ),
        (&json!("gguf"), &json!("tiny"), &json!("F32")),
        "{show:?}"
    );
    assert!(
        details["parameter_size"]
            .as_str()
            .is_some_and(|s| s.ends_with('K')),
        "{show:?}"
    );
    let expected = reference_text(&ctx).await;
    let body = |stream: bool| {
        json!({
            "model": "tiny",
            "messages": [{"role": "user", "content": PROMPT}],
            "stream": stream,
            "options": {"temperature": 0, "seed": 14, "num_predict": MAX_TOKENS},
        })
    };
    let answer = post(&ctx.via("/api/chat"), &body(false)).await;
    assert_eq!(answer.status, 200, "{answer:?}");
    let v = answer.json();
    assert_eq!(v["message"]["content"], expected, "{v}");
    assert_eq!(
        (&v["done"], &v["done_reason"]),
        (&json!(true), &json!("length")),
        "{v}"
    );
    assert_eq!(v["eval_count"], MAX_TOKENS, "{v}");

    let response = http()
        .post(ctx.via("/api/chat"))
        .json(&body(true))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let lines: Vec<Value> = response
        .text()
        .await
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    let streamed: String = lines
        .iter()
        .filter_map(|l| l["message"]["content"].as_str())
        .collect();
    assert_eq!(streamed, expected, "{lines:?}");
    assert_eq!(lines.last().unwrap()["done"], true, "{lines:?}");

    let inputs = json!(["the edge", "the node and the model"]);
    let direct = post(
        &ctx.direct("/v1/embeddings"),
        &json!({"model": UPSTREAM, "input": inputs}),
    )
    .await;
    let via = post(
        &ctx.via("/api/embed"),
        &json!({"model": "tiny", "input": inputs}),
    )
    .await;
    assert_eq!(via.status, 200, "{via:?}");
    let ollama = via.json()["embeddings"].as_array().unwrap().clone();
    let openai = direct.json()["data"].as_array().unwrap().clone();
    assert_eq!(ollama.len(), openai.len());
    for (a, b) in ollama.iter().zip(&openai) {
        let a: Vec<f64> = serde_json::from_value(a.clone()).unwrap();
        let b: Vec<f64> = serde_json::from_value(b["embedding"].clone()).unwrap();
        assert_eq!(a.len(), b.len());
        assert!(
            a.iter().zip(&b).all(|(x, y)| (x - y).abs() < 1e-6),
            "{a:?}\n{b:?}"
        );
    }
}

/// Waits until the server reports every slot idle.
async fn wait_slots_idle(llama: &LlamaServer) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let slots: Value = get_json(&llama.url("/slots")).await;
        let busy = slots
            .as_array()
            .unwrap_or_else(|| panic!("/slots: {slots}"))
            .iter()
            .filter(|s| s["is_processing"] == true)
            .count();
        if busy == 0 {
            return;
        }
        if Instant::now() > deadline {
            panic!("{busy} slot(s) still processing after 60 s: {slots}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Tokens a slot can still produce after the prompt: an answer this long takes a while.
const LONG_ANSWER: usize = CONTEXT / SLOTS - 100;

/// A client that goes away mid-stream (a `path` request for `group`, `body` asking for
/// `LONG_ANSWER` tokens): the server cancels the generation and frees its slot (it logs
/// `cancel task`) before the answer's end, and iop's lease is back.
async fn abort_stops_generation(
    ctx: Arc<Ctx>,
    path: &'static str,
    group: &'static str,
    body: Value,
) {
    let cancels_before = ctx.llama.proc.count_lines("cancel task");
    let from = ctx.llama.proc.line_count();
    let mut response = http()
        .post(ctx.via(path))
        .json(&with_model(&body, group))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let mut seen = String::new();
    read_until(&mut response, &mut seen, |s| {
        s.matches("data: ").count() >= 3
    })
    .await;
    drop(response);

    ctx.llama
        .proc
        .wait_line_count("cancel task", cancels_before + 1, Duration::from_secs(60))
        .await;
    wait_slots_idle(&ctx.llama).await;
    // The slot stopped well before the answer's end.
    let line = ctx
        .llama
        .proc
        .lines_since(from)
        .into_iter()
        .find(|l| l.contains("stop processing: n_tokens ="))
        .unwrap_or_else(|| panic!("the server logged no slot release"));
    let n: usize = line
        .split("n_tokens = ")
        .nth(1)
        .and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no count in {line:?}"));
    assert!(n < LONG_ANSWER, "the slot ran to the end: {line}");
    wait_idle(&ctx.edge).await;
}

/// More concurrent requests than the server has slots: iop holds the extra ones in its
/// queue (capacity = slots), and every one completes with the server's full answer.
async fn queued_beyond_slots(ctx: Arc<Ctx>) {
    // Two long answers hold both slots...
    let mut long = with_model(&chat_body(true, false), "tiny");
    long["max_tokens"] = json!(LONG_ANSWER);
    let mut holders = Vec::new();
    for _ in 0..SLOTS {
        let mut response = http()
            .post(ctx.via("/v1/chat/completions"))
            .json(&long)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let mut seen = String::new();
        read_until(&mut response, &mut seen, |s| s.contains("data: ")).await;
        holders.push((response, seen));
    }
    // ...while more arrive than the server has slots.
    let extra = SLOTS * 2;
    let mut waiters = Vec::new();
    for _ in 0..extra {
        let body = with_model(&chat_body(true, true), "tiny");
        let url = ctx.via("/v1/chat/completions");
        waiters.push(tokio::spawn(async move { post(&url, &body).await }));
    }
    // iop queues them: its status shows them waiting while the slots are held.
    wait_status(
        &ctx.edge,
        Duration::from_secs(60),
        "requests waiting for the tiny group",
        |s| group_of(s, "tiny")["waiting"]["normal"].as_u64() >= Some(1),
    )
    .await;
    for (mut response, mut seen) in holders {
        read_to_end(&mut response, &mut seen, REQUEST_TIMEOUT).await;
        let seen = without_event_ids(&seen);
        assert!(seen.trim_end().ends_with("data: [DONE]"), "{seen}");
    }
    let expected = post(
        &ctx.direct("/v1/chat/completions"),
        &with_model(&chat_body(true, true), UPSTREAM),
    )
    .await;
    for waiter in waiters {
        let answer = waiter.await.unwrap();
        assert_same(&answer, &expected, "a queued request");
    }
    wait_idle(&ctx.edge).await;
}

/// A prompt longer than a slot's context: the server's own 400 comes back unchanged.
async fn context_overflow_passes_through(ctx: Arc<Ctx>) {
    let long = "the ".repeat(CONTEXT);
    for stream in [false, true] {
        let body = json!({
            "messages": [{"role": "user", "content": long}],
            "max_tokens": MAX_TOKENS,
            "stream": stream,
        });
        let answer = same_both_ways(&ctx, "/v1/chat/completions", "tiny", &body).await;
        assert_eq!(answer.status, 400, "{answer:?}");
        assert_eq!(
            answer.json()["error"]["type"],
            "exceed_context_size_error",
            "{answer:?}"
        );
    }
}

/// A model the server does not have: its own error comes back unchanged.
async fn unknown_model_passes_through(ctx: Arc<Ctx>) {
    for stream in [false, true] {
        let body = chat_body(stream, false);
        let direct = post(
            &format!("{}/chat/completions", ctx.router.base()),
            &with_model(&body, "no-such-model"),
        )
        .await;
        let via = post(
            &ctx.via("/v1/chat/completions"),
            &with_model(&body, "ghost"),
        )
        .await;
        assert!(
            (400..500).contains(&direct.status),
            "the router accepted an unknown model: {direct:?}"
        );
        assert_same(&via, &direct, &format!("an unknown model, stream={stream}"));
    }
}

#[tokio::test]
async fn iop_answers_as_llama_server_does() {
    let Some((server, model)) = common::real_backend::from_env("conformance") else {
        return;
    };
    let ctx = Arc::new(setup(&server, &model).await);
    let mut report = Report::new("conformance");

    report
        .run(
            "models: /v1/models lists the groups",
            models_list(ctx.clone()),
        )
        .await;
    report
        .run(
            "models: /v1/models/{id} with the server's context length",
            model_by_id(ctx.clone()),
        )
        .await;
    report
        .run(
            "chat (openai_compat tunnel, usage injected)",
            chat_same(ctx.clone(), "tiny", true),
        )
        .await;
    report
        .run(
            "chat (vllm tunnel, tunnel_usage: off)",
            chat_same(ctx.clone(), "tiny-vllm", false),
        )
        .await;
    report
        .run("completions", completions_same(ctx.clone()))
        .await;
    report.run("embeddings", embeddings_same(ctx.clone())).await;
    report
        .run(
            "responses: tunnelled to a provider that serves them",
            native_apis_same(ctx.clone(), "/v1/responses"),
        )
        .await;
    report
        .run(
            "messages: tunnelled to a provider that serves them",
            native_apis_same(ctx.clone(), "/v1/messages"),
        )
        .await;
    report
        .run(
            "responses: translated to chat",
            responses_translated(ctx.clone()),
        )
        .await;
    report
        .run(
            "messages: translated to chat",
            messages_translated(ctx.clone()),
        )
        .await;
    report
        .run(
            "messages count_tokens: the server's count",
            count_tokens(ctx.clone()),
        )
        .await;
    report
        .run("ollama API: tags, chat, embed", ollama_api(ctx.clone()))
        .await;
    let mut chat = chat_body(true, false);
    chat["max_tokens"] = json!(LONG_ANSWER);
    report
        .run(
            "a client abort stops the generation (chat, tunnelled)",
            abort_stops_generation(ctx.clone(), "/v1/chat/completions", "tiny", chat),
        )
        .await;
    let mut messages = messages_body(true);
    messages["max_tokens"] = json!(LONG_ANSWER);
    report
        .run(
            "a client abort stops the generation (messages, translated)",
            abort_stops_generation(ctx.clone(), "/v1/messages", "tiny", messages),
        )
        .await;
    let mut responses = responses_body(true);
    responses["max_output_tokens"] = json!(LONG_ANSWER);
    report
        .run(
            "a client abort stops the generation (responses, tunnelled)",
            abort_stops_generation(ctx.clone(), "/v1/responses", "tiny-native", responses),
        )
        .await;
    report
        .run(
            "more requests than slots wait in iop's queue",
            queued_beyond_slots(ctx.clone()),
        )
        .await;
    report
        .run(
            "context overflow passes through",
            context_overflow_passes_through(ctx.clone()),
        )
        .await;
    report
        .run(
            "an unknown model passes through",
            unknown_model_passes_through(ctx.clone()),
        )
        .await;

    if report.has_failures() {
        notice(&format!(
            "----- llama-server, last lines -----\n{}\n----- edge, last lines -----\n{}",
            ctx.llama.proc.tail(200),
            ctx.edge.proc.tail(200)
        ));
    }
    report.finish();
}
