//! A deterministic backend that speaks both the OpenAI-compatible API (`/v1/models`,
//! `/v1/chat/completions`, `/v1/completions`, `/v1/embeddings`, streaming and not) and
//! Ollama's native API (`/api/chat`, `/api/generate`, `/api/tags`, `/api/ps`, `/api/show`).
//! For tests, benchmarks and `iop demo`.
//!
//! It misbehaves on purpose by model name, for fault tests:
//! - `fail-500`: answers 500 with an OpenAI error body;
//! - `error-mid-stream`: fails halfway through (an SSE error event / a broken NDJSON line);
//! - `hang`: never answers until the client goes away;
//! - `slow`: at least 400 tokens, 25 ms apart;
//! - `reasoning`: emits reasoning deltas (also on for every model with `--reasoning`).
//!
//! `GET /mock/stats` counts requests, completed responses and responses the client
//! abandoned before the end (the client closed its connection).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::stream;
use serde::Serialize;
use serde_json::{Value, json};
use tokio::net::TcpListener;

const WORDS: &[&str] = &[
    "Hello",
    "from",
    "the",
    "iop",
    "mock",
    "provider,",
    "streaming",
    "one",
    "token",
    "at",
    "a",
    "time",
    "over",
    "plain",
    "HTTP.",
];

/// How the mock answers.
#[derive(Debug, Clone)]
pub struct MockConfig {
    /// Output tokens per response (a request's `max_tokens` may lower it).
    pub tokens: u32,
    /// Delay before each token.
    pub token_delay: Duration,
    /// Emit reasoning deltas and report `reasoning_tokens` for every model.
    pub reasoning: bool,
    /// Report `prompt_tokens_details.cached_tokens` with this value.
    pub cached_tokens: Option<u64>,
}

impl Default for MockConfig {
    fn default() -> Self {
        Self {
            tokens: 16,
            token_delay: Duration::ZERO,
            reasoning: false,
            cached_tokens: None,
        }
    }
}

/// Counters a test can read from `/mock/stats` or directly.
#[derive(Debug, Default)]
pub struct MockStats {
    pub requests: AtomicU64,
    pub completed: AtomicU64,
    pub aborted: AtomicU64,
    pub in_flight: AtomicU64,
}

#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct StatsSnapshot {
    pub requests: u64,
    pub completed: u64,
    pub aborted: u64,
    pub in_flight: u64,
}

impl MockStats {
    pub fn snapshot(&self) -> StatsSnapshot {
        StatsSnapshot {
            requests: self.requests.load(Ordering::SeqCst),
            completed: self.completed.load(Ordering::SeqCst),
            aborted: self.aborted.load(Ordering::SeqCst),
            in_flight: self.in_flight.load(Ordering::SeqCst),
        }
    }
}

/// Counts one response: completed if it ran to its end, aborted if dropped before.
struct Tracked {
    stats: Arc<MockStats>,
    finished: bool,
}

impl Tracked {
    fn new(stats: &Arc<MockStats>) -> Self {
        stats.requests.fetch_add(1, Ordering::SeqCst);
        stats.in_flight.fetch_add(1, Ordering::SeqCst);
        Self {
            stats: stats.clone(),
            finished: false,
        }
    }

    fn finish(&mut self) {
        self.finished = true;
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.stats.in_flight.fetch_sub(1, Ordering::SeqCst);
        if self.finished {
            self.stats.completed.fetch_add(1, Ordering::SeqCst);
        } else {
            self.stats.aborted.fetch_add(1, Ordering::SeqCst);
        }
    }
}

#[derive(Clone)]
struct Mock {
    config: Arc<MockConfig>,
    stats: Arc<MockStats>,
}

/// What a request asks of the mock.
struct Plan {
    model: String,
    tokens: u32,
    delay: Duration,
    reasoning: bool,
    prompt_tokens: u64,
    finish: &'static str,
}

impl Mock {
    fn plan(&self, body: &Value, prompt: &str) -> Plan {
        let model = body
            .get("model")
            .and_then(Value::as_str)
            .unwrap_or("mock")
            .to_string();
        let mut tokens = self.config.tokens.max(1);
        let mut delay = self.config.token_delay;
        if model.contains("slow") {
            tokens = tokens.max(400);
            delay = delay.max(Duration::from_millis(25));
        }
        let max = body
            .get("max_completion_tokens")
            .or_else(|| body.get("max_tokens"))
            .or_else(|| body.pointer("/options/num_predict"))
            .and_then(Value::as_u64);
        let mut finish = "stop";
        if let Some(max) = max
            && (max as u32) < tokens
        {
            tokens = (max as u32).max(1);
            finish = "length";
        }
        Plan {
            reasoning: self.config.reasoning || model.contains("reasoning"),
            model,
            tokens,
            delay,
            prompt_tokens: prompt.split_whitespace().count() as u64,
            finish,
        }
    }

    fn usage(&self, plan: &Plan) -> Value {
        let reasoning = if plan.reasoning { 2 } else { 0 };
        let mut usage = json!({
            "prompt_tokens": plan.prompt_tokens,
            "completion_tokens": plan.tokens as u64 + reasoning,
            "total_tokens": plan.prompt_tokens + plan.tokens as u64 + reasoning,
        });
        if plan.reasoning {
            usage["completion_tokens_details"] = json!({"reasoning_tokens": reasoning});
        }
        if let Some(cached) = self.config.cached_tokens {
            usage["prompt_tokens_details"] = json!({"cached_tokens": cached});
        }
        usage
    }
}

fn word(i: u32, last: bool) -> String {
    let w = WORDS[i as usize % WORDS.len()];
    if last { w.to_string() } else { format!("{w} ") }
}

/// The whole answer text for `tokens` tokens.
fn full_text(tokens: u32) -> String {
    (0..tokens).map(|i| word(i, i + 1 == tokens)).collect()
}

pub fn router(config: MockConfig) -> (Router, Arc<MockStats>) {
    let stats = Arc::new(MockStats::default());
    let mock = Mock {
        config: Arc::new(config),
        stats: stats.clone(),
    };
    let router = Router::new()
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/embeddings", post(embeddings))
        .route("/api/chat", post(ollama_chat))
        .route("/api/generate", post(ollama_generate))
        .route("/api/tags", get(ollama_tags))
        .route("/api/ps", get(ollama_ps))
        .route("/api/show", post(ollama_show))
        .route("/mock/stats", get(stats_handler))
        .with_state(mock);
    (router, stats)
}

/// A running mock server.
pub struct MockServer {
    pub addr: SocketAddr,
    pub stats: Arc<MockStats>,
    task: tokio::task::JoinHandle<()>,
}

impl MockServer {
    pub async fn start(addr: SocketAddr, config: MockConfig) -> std::io::Result<Self> {
        let listener = TcpListener::bind(addr).await?;
        Self::serve(listener, config)
    }

    pub fn serve(listener: TcpListener, config: MockConfig) -> std::io::Result<Self> {
        use axum::serve::ListenerExt;
        let addr = listener.local_addr()?;
        let (app, stats) = router(config);
        let listener = listener.tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        });
        let task = tokio::spawn(async move {
            if let Err(err) = axum::serve(listener, app).await {
                tracing::error!(%err, "mock provider stopped");
            }
        });
        Ok(Self { addr, stats, task })
    }

    /// The OpenAI API root (`http://addr/v1`).
    pub fn openai_base(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// The Ollama API root (`http://addr`).
    pub fn ollama_base(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Serves until the server task ends.
    pub async fn wait(mut self) {
        let _ = (&mut self.task).await;
    }
}

impl Drop for MockServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn stats_handler(State(mock): State<Mock>) -> Response {
    axum::Json(mock.stats.snapshot()).into_response()
}

async fn models() -> Response {
    axum::Json(json!({
        "object": "list",
        "data": [{"id": "mock-model", "object": "model", "created": 0, "owned_by": "iop-mock"}],
    }))
    .into_response()
}

fn parse(body: &Bytes) -> Result<Value, String> {
    serde_json::from_slice(body).map_err(|e| format!("invalid JSON: {e}"))
}

fn bad_request(message: String) -> Response {
    (
        StatusCode::BAD_REQUEST,
        axum::Json(json!({"error": {"message": message, "type": "invalid_request_error", "param": null, "code": null}})),
    )
        .into_response()
}

fn openai_error(status: StatusCode, message: &str) -> Response {
    (
        status,
        axum::Json(json!({"error": {"message": message, "type": "server_error", "param": null, "code": null}})),
    )
        .into_response()
}

fn prompt_of(body: &Value) -> String {
    if let Some(messages) = body.get("messages").and_then(Value::as_array) {
        return messages
            .iter()
            .filter_map(|m| m.get("content").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join(" ");
    }
    match body.get("prompt").or_else(|| body.get("input")) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(Value::as_str)
            .collect::<Vec<_>>()
            .join(" "),
        _ => String::new(),
    }
}

async fn hang(mut tracked: Tracked) -> Response {
    std::future::pending::<()>().await;
    tracked.finish();
    unreachable!()
}

fn sse_response(body: Body) -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum OpenAiOp {
    Chat,
    Completion,
}

async fn chat(State(mock): State<Mock>, body: Bytes) -> Response {
    openai(mock, body, OpenAiOp::Chat).await
}

async fn completions(State(mock): State<Mock>, body: Bytes) -> Response {
    openai(mock, body, OpenAiOp::Completion).await
}

async fn openai(mock: Mock, body: Bytes, op: OpenAiOp) -> Response {
    let body = match parse(&body) {
        Ok(b) => b,
        Err(e) => return bad_request(e),
    };
    let mut tracked = Tracked::new(&mock.stats);
    let plan = mock.plan(&body, &prompt_of(&body));
    if plan.model.contains("fail-500") {
        tracked.finish();
        return openai_error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "mock provider failure (model fail-500)",
        );
    }
    if plan.model.contains("hang") {
        return hang(tracked).await;
    }
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let include_usage = body
        .pointer("/stream_options/include_usage")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    // Deterministic, so a response relayed through iop can be compared byte for byte.
    let id = match op {
        OpenAiOp::Chat => "chatcmpl-mock",
        OpenAiOp::Completion => "cmpl-mock",
    };
    let (object, chunk_object) = match op {
        OpenAiOp::Chat => ("chat.completion", "chat.completion.chunk"),
        OpenAiOp::Completion => ("text_completion", "text_completion"),
    };
    if !stream {
        for _ in 0..plan.tokens {
            if !plan.delay.is_zero() {
                tokio::time::sleep(plan.delay).await;
            }
        }
        if plan.model.contains("error-mid-stream") {
            tracked.finish();
            return openai_error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "mock provider failed mid-generation",
            );
        }
        let text = full_text(plan.tokens);
        let choice = match op {
            OpenAiOp::Chat => {
                let mut message = json!({"role": "assistant", "content": text});
                if plan.reasoning {
                    message["reasoning_content"] = json!("thinking hard");
                }
                json!({"index": 0, "message": message, "logprobs": null, "finish_reason": plan.finish})
            }
            OpenAiOp::Completion => {
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": plan.finish})
            }
        };
        tracked.finish();
        return axum::Json(json!({
            "id": id, "object": object, "created": 1700000000u64, "model": plan.model,
            "choices": [choice], "usage": mock.usage(&plan),
        }))
        .into_response();
    }
    // Streaming: one SSE event per token.
    let usage = mock.usage(&plan);
    let mut events: Vec<(Duration, String)> = Vec::new();
    let chunk = |delta: Value, finish: Value| -> String {
        let choice = match op {
            OpenAiOp::Chat => {
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
            }
            OpenAiOp::Completion => {
                json!({"index": 0, "text": delta.get("content").cloned().unwrap_or(json!("")), "logprobs": null, "finish_reason": finish})
            }
        };
        let mut c = json!({"id": id, "object": chunk_object, "created": 1700000000u64, "model": plan.model, "choices": [choice]});
        if include_usage {
            c["usage"] = Value::Null;
        }
        format!("data: {c}\n\n")
    };
    if op == OpenAiOp::Chat {
        events.push((
            Duration::ZERO,
            chunk(json!({"role": "assistant", "content": ""}), Value::Null),
        ));
    }
    if plan.reasoning {
        for r in ["thinking ", "hard"] {
            events.push((
                plan.delay,
                chunk(json!({"reasoning_content": r}), Value::Null),
            ));
        }
    }
    let fail_at = plan
        .model
        .contains("error-mid-stream")
        .then_some(plan.tokens / 2);
    for i in 0..plan.tokens {
        if Some(i) == fail_at {
            events.push((
                plan.delay,
                format!("data: {}\n\n", json!({"error": {"message": "mock provider failed mid-stream", "type": "server_error", "param": null, "code": null}})),
            ));
            break;
        }
        events.push((
            plan.delay,
            chunk(
                json!({"content": word(i, i + 1 == plan.tokens)}),
                Value::Null,
            ),
        ));
    }
    if fail_at.is_none() {
        events.push((Duration::ZERO, chunk(json!({}), json!(plan.finish))));
        if include_usage {
            let c = json!({"id": id, "object": chunk_object, "created": 1700000000u64, "model": plan.model, "choices": [], "usage": usage});
            events.push((Duration::ZERO, format!("data: {c}\n\n")));
        }
        events.push((Duration::ZERO, "data: [DONE]\n\n".to_string()));
    }
    sse_response(paced(events, tracked))
}

/// A body that sends each event after its delay and counts the response when it ends.
fn paced(events: Vec<(Duration, String)>, tracked: Tracked) -> Body {
    let state = (events.into_iter(), tracked);
    Body::from_stream(stream::unfold(
        state,
        |(mut events, mut tracked)| async move {
            match events.next() {
                Some((delay, text)) => {
                    if !delay.is_zero() {
                        tokio::time::sleep(delay).await;
                    }
                    Some((
                        Ok::<_, std::io::Error>(Bytes::from(text)),
                        (events, tracked),
                    ))
                }
                None => {
                    tracked.finish();
                    None
                }
            }
        },
    ))
}

async fn embeddings(State(mock): State<Mock>, body: Bytes) -> Response {
    let body = match parse(&body) {
        Ok(b) => b,
        Err(e) => return bad_request(e),
    };
    let mut tracked = Tracked::new(&mock.stats);
    let inputs: Vec<String> = match body.get("input") {
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| v.as_str().unwrap_or_default().to_string())
            .collect(),
        _ => vec![],
    };
    let data: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(i, text)| {
            let mut h: u64 = 1469598103934665603;
            for b in text.bytes() {
                h = (h ^ b as u64).wrapping_mul(1099511628211);
            }
            let vector: Vec<f64> = (0..8)
                .map(|k| ((h >> (k * 8)) & 0xff) as f64 / 255.0)
                .collect();
            json!({"object": "embedding", "index": i, "embedding": vector})
        })
        .collect();
    let tokens: u64 = inputs
        .iter()
        .map(|t| t.split_whitespace().count() as u64)
        .sum();
    tracked.finish();
    axum::Json(json!({
        "object": "list", "data": data, "model": body.get("model").cloned().unwrap_or(json!("mock")),
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }))
    .into_response()
}

async fn ollama_chat(State(mock): State<Mock>, body: Bytes) -> Response {
    ollama(mock, body, true).await
}

async fn ollama_generate(State(mock): State<Mock>, body: Bytes) -> Response {
    ollama(mock, body, false).await
}

async fn ollama(mock: Mock, body: Bytes, chat: bool) -> Response {
    let body = match parse(&body) {
        Ok(b) => b,
        Err(e) => return bad_request(e),
    };
    let mut tracked = Tracked::new(&mock.stats);
    let plan = mock.plan(&body, &prompt_of(&body));
    if plan.model.contains("fail-500") {
        tracked.finish();
        return (
            StatusCode::INTERNAL_SERVER_ERROR,
            axum::Json(json!({"error": "mock provider failure (model fail-500)"})),
        )
            .into_response();
    }
    if plan.model.contains("not-found") {
        tracked.finish();
        return (StatusCode::NOT_FOUND, axum::Json(json!({"error": format!("model \"{}\" not found, try pulling it first", plan.model)}))).into_response();
    }
    if plan.model.contains("hang") {
        return hang(tracked).await;
    }
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(true);
    let line = |text: &str, thinking: Option<&str>, done: bool| -> Value {
        let mut v = if chat {
            let mut message = json!({"role": "assistant", "content": text});
            if let Some(t) = thinking {
                message["thinking"] = json!(t);
            }
            json!({"model": plan.model, "created_at": "2024-01-01T00:00:00Z", "message": message, "done": done})
        } else {
            json!({"model": plan.model, "created_at": "2024-01-01T00:00:00Z", "response": text, "done": done})
        };
        if done {
            v["done_reason"] = json!(plan.finish);
            v["prompt_eval_count"] = json!(plan.prompt_tokens);
            v["eval_count"] = json!(plan.tokens);
            v["total_duration"] = json!(1000);
        }
        v
    };
    if !stream {
        for _ in 0..plan.tokens {
            if !plan.delay.is_zero() {
                tokio::time::sleep(plan.delay).await;
            }
        }
        tracked.finish();
        return axum::Json(line(&full_text(plan.tokens), None, true)).into_response();
    }
    let mut events = Vec::new();
    if plan.reasoning {
        events.push((
            plan.delay,
            format!("{}\n", line("", Some("thinking hard"), false)),
        ));
    }
    let fail_at = plan
        .model
        .contains("error-mid-stream")
        .then_some(plan.tokens / 2);
    for i in 0..plan.tokens {
        if Some(i) == fail_at {
            events.push((
                plan.delay,
                format!("{}\n", json!({"error": "mock provider failed mid-stream"})),
            ));
            break;
        }
        events.push((
            plan.delay,
            format!("{}\n", line(&word(i, i + 1 == plan.tokens), None, false)),
        ));
    }
    if fail_at.is_none() {
        events.push((Duration::ZERO, format!("{}\n", line("", None, true))));
    }
    (
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        paced(events, tracked),
    )
        .into_response()
}

async fn ollama_tags() -> Response {
    axum::Json(json!({"models": [{"name": "mock-model:latest", "model": "mock-model:latest", "size": 1, "digest": "0", "details": {"family": "mock"}}]})).into_response()
}

async fn ollama_ps() -> Response {
    axum::Json(json!({"models": []})).into_response()
}

async fn ollama_show(body: Bytes) -> Response {
    let model = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|v| v.get("model").and_then(Value::as_str).map(String::from))
        .unwrap_or_default();
    axum::Json(json!({"modelfile": format!("FROM {model}"), "details": {"family": "mock", "parameter_size": "0B"}, "model_info": {}})).into_response()
}
