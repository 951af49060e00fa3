//! A deterministic backend that speaks the OpenAI-compatible API (`/v1/models`,
//! `/v1/chat/completions`, `/v1/completions`, `/v1/embeddings`, streaming and not), the
//! Responses and Anthropic Messages APIs (`/v1/responses`, `/v1/messages`) and Ollama's
//! native API (`/api/chat`, `/api/generate`, `/api/embed`, `/api/embeddings`,
//! `/api/tags`, `/api/ps`, `/api/show`, and model management — `/api/pull`,
//! `/api/delete`, `/api/copy`, `/api/create`, loading and unloading — on a model store
//! that follows Ollama's documentation, see [`ollama_models`]). For tests, benchmarks and
//! `iop demo`.
//!
//! It misbehaves on purpose by model name, for fault tests:
//! - `fail-500`: answers 500 with an OpenAI error body (embeddings too); so does any
//!   request whose prompt holds `mock:fail-500` (a request that crashes its backend, as a
//!   client could send one);
//! - `error-mid-stream`: fails halfway through (an SSE error event / a broken NDJSON line);
//! - `torn-mid-stream`: streams half its events and half of the next one (cut inside its
//!   JSON), then breaks the connection (OpenAI API, streaming);
//! - `hang`: never answers until the client goes away;
//! - `stall-after-head`: streams its head and first events, then nothing until the client
//!   goes away (OpenAI API, streaming);
//! - `rate-limit-429`: answers 429 with `Retry-After: 30` and an OpenAI error body (OpenAI
//!   API);
//! - `lingering`: ends its event stream 100 ms after `data: [DONE]` (OpenAI API);
//! - `slow`: at least 400 tokens, 25 ms apart;
//! - `reasoning`: emits reasoning deltas (also on for every model with `--reasoning`);
//! - `set-cookie`: answers with a `set-cookie` header (chat and completions, both APIs).
//!
//! It honours what it can and refuses the rest with a 400 in the API's error shape, never
//! ignoring a parameter: `max_tokens`, `stop` (the answer ends before the first stop
//! sequence, finish reason `stop`) and `n` (that many identical choices) are honoured;
//! a `response_format` other than `text` is refused on the OpenAI API. A chat with `tools`
//! is answered as an agent's model would, one tool call per turn ([`agent_turn`]): on the
//! OpenAI API with arguments that fit the tool's schema, on the Ollama API with the last
//! user message as its `query`. One with Ollama's `format` gets a JSON document.
//!
//! `POST /tokenize` counts a prompt as vLLM's does ([`tokenize`]).
//!
//! `GET /mock/stats` counts requests, completed responses and responses the client
//! abandoned before the end (the client closed its connection), the most in flight at
//! once, and the tracing headers of the last request that had any (`x-*`, `traceparent`,
//! `tracestate`) as `last_headers`.
//!
//! Health checks find vLLM's `GET /health` and Ollama's `GET /api/version` here too;
//! `POST /mock/faults` makes requests or health checks fail until switched back
//! (`health`).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Serialize;
use serde_json::{Value, json};
use tokio::net::TcpListener;

mod apis;
mod health;
mod ollama;
pub mod ollama_models;
mod openai;
pub mod prefix_cache;
mod tokenize;

pub use iop_mock_model::{agent_turn, schema};

pub use health::Faults;

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
    /// The pause before each progress line of an Ollama `/api/pull`.
    pub pull_step: Duration,
    /// Model a prefix (KV) cache: the time to first token grows with the uncached part of
    /// the prompt ([`prefix_cache`]).
    pub prefix_cache: Option<prefix_cache::PrefixCacheConfig>,
}

impl Default for MockConfig {
    fn default() -> Self {
        Self {
            tokens: 16,
            token_delay: Duration::ZERO,
            reasoning: false,
            cached_tokens: None,
            pull_step: Duration::from_millis(50),
            prefix_cache: None,
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
    /// The most requests in flight at once so far.
    pub peak_in_flight: AtomicU64,
    /// `/tokenize` calls, in flight, and the most in flight at once.
    pub tokenize_requests: AtomicU64,
    pub tokenize_in_flight: AtomicU64,
    pub peak_tokenize_in_flight: AtomicU64,
    /// The tracing headers of the last request that had any: `x-*`, `traceparent`,
    /// `tracestate`.
    pub last_headers: Mutex<BTreeMap<String, String>>,
}

#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct StatsSnapshot {
    pub requests: u64,
    pub completed: u64,
    pub aborted: u64,
    pub in_flight: u64,
    pub peak_in_flight: u64,
    pub tokenize_requests: u64,
    pub peak_tokenize_in_flight: u64,
    pub last_headers: BTreeMap<String, String>,
}

impl MockStats {
    pub fn snapshot(&self) -> StatsSnapshot {
        StatsSnapshot {
            requests: self.requests.load(Ordering::SeqCst),
            completed: self.completed.load(Ordering::SeqCst),
            aborted: self.aborted.load(Ordering::SeqCst),
            in_flight: self.in_flight.load(Ordering::SeqCst),
            peak_in_flight: self.peak_in_flight.load(Ordering::SeqCst),
            tokenize_requests: self.tokenize_requests.load(Ordering::SeqCst),
            peak_tokenize_in_flight: self.peak_tokenize_in_flight.load(Ordering::SeqCst),
            last_headers: self.last_headers.lock().expect("not poisoned").clone(),
        }
    }
}

/// Whether a request header is recorded in `last_headers`.
fn is_traced(name: &str) -> bool {
    name.starts_with("x-") || name == "traceparent" || name == "tracestate"
}

/// Records the request's tracing headers (a request with none, such as a node's health
/// probe, leaves the last ones); answers of `set-cookie` models get a cookie.
async fn observe_headers(State(mock): State<Mock>, request: Request, next: Next) -> Response {
    if request.uri().path() != "/mock/stats" {
        let seen: BTreeMap<String, String> = request
            .headers()
            .iter()
            .filter(|(name, _)| is_traced(name.as_str()))
            .map(|(name, value)| {
                (
                    name.to_string(),
                    String::from_utf8_lossy(value.as_bytes()).into_owned(),
                )
            })
            .collect();
        if !seen.is_empty() {
            *mock.stats.last_headers.lock().expect("not poisoned") = seen;
        }
    }
    next.run(request).await
}

/// Whether a request names a `set-cookie` model (a scan of the raw body: no second parse).
pub(crate) fn wants_cookie(body: &[u8]) -> bool {
    body.windows(b"set-cookie".len())
        .any(|w| w == b"set-cookie")
}

/// Adds a cookie to an answer (the `set-cookie` model).
pub(crate) fn with_cookie(mut response: Response) -> Response {
    response.headers_mut().append(
        axum::http::header::SET_COOKIE,
        HeaderValue::from_static("mock_session=secret; Path=/; HttpOnly"),
    );
    response
}

/// Counts one response: completed if it ran to its end, aborted if dropped before.
struct Tracked {
    stats: Arc<MockStats>,
    finished: bool,
}

impl Tracked {
    fn new(stats: &Arc<MockStats>) -> Self {
        stats.requests.fetch_add(1, Ordering::SeqCst);
        let now = stats.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        stats.peak_in_flight.fetch_max(now, Ordering::SeqCst);
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
    faults: Arc<Faults>,
    ollama: Arc<ollama_models::OllamaModels>,
    prefix_cache: Option<Arc<prefix_cache::PrefixCache>>,
}

/// What a request asks of the mock.
struct Plan {
    model: String,
    /// The answer, token by token (a word and its trailing space), already cut at a stop
    /// sequence.
    pieces: Vec<String>,
    /// Tokens generated: the pieces, or up to the one that completed a stop sequence.
    generated: u32,
    delay: Duration,
    reasoning: bool,
    prompt_tokens: u64,
    /// Cached prompt tokens to report (the prefix cache model's, else the configured).
    cached_tokens: Option<u64>,
    finish: &'static str,
    /// The prompt asks for a 500 (`mock:fail-500`).
    poisoned: bool,
}

impl Plan {
    fn tokens(&self) -> u32 {
        self.generated
    }

    /// The whole answer text.
    fn text(&self) -> String {
        self.pieces.concat()
    }

    /// Appends one event per token, each after the token delay: `token` renders one
    /// token's text (a word and its trailing space). A model named `error-mid-stream`
    /// gets `error()` in place of its middle token and nothing after it. Returns whether
    /// the stream failed that way.
    fn token_events(
        &self,
        events: &mut Vec<(Duration, String)>,
        token: impl Fn(&str) -> String,
        error: impl FnOnce() -> String,
    ) -> bool {
        let fail_at = self
            .model
            .contains("error-mid-stream")
            .then_some(self.pieces.len() / 2);
        for (i, piece) in self.pieces.iter().enumerate() {
            if Some(i) == fail_at {
                events.push((self.delay, error()));
                return true;
            }
            events.push((self.delay, token(piece)));
        }
        false
    }
}

impl Mock {
    /// Parses a request and starts counting it: the body, its tracker and its plan, or why
    /// the body is not JSON.
    /// With a prefix cache model, the prompt's prefill time passes here, before the
    /// response begins.
    async fn begin(&self, body: &Bytes) -> Result<(Value, Tracked, Plan), String> {
        let body = parse(body)?;
        let tracked = Tracked::new(&self.stats);
        let prompt = prompt_of(&body);
        let mut plan = self.plan(&body, &prompt);
        if let Some(cache) = &self.prefix_cache {
            let prefill = cache.prefill(&prompt);
            plan.prompt_tokens = prefill.prompt_tokens;
            plan.cached_tokens = Some(prefill.cached_tokens);
            tokio::time::sleep(prefill.delay).await;
        }
        Ok((body, tracked, plan))
    }

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
        let pieces = (0..tokens).map(|i| word(i, i + 1 == tokens)).collect();
        let stops = stop_sequences(body.get("stop").or_else(|| body.pointer("/options/stop")));
        let (pieces, generated, stopped) = cut_at_stop(pieces, &stops);
        if stopped {
            finish = "stop";
        }
        Plan {
            poisoned: prompt.contains("mock:fail-500"),
            reasoning: self.config.reasoning || model.contains("reasoning"),
            model,
            pieces,
            generated,
            delay,
            prompt_tokens: prompt.split_whitespace().count() as u64,
            cached_tokens: self.config.cached_tokens,
            finish,
        }
    }

    /// The usage of `choices` answers to `plan`.
    fn usage(&self, plan: &Plan, choices: u64) -> Value {
        let reasoning = if plan.reasoning { 2 } else { 0 };
        let completion = (plan.tokens() as u64 + reasoning) * choices;
        let mut usage = json!({
            "prompt_tokens": plan.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": plan.prompt_tokens + completion,
        });
        if plan.reasoning {
            usage["completion_tokens_details"] = json!({"reasoning_tokens": reasoning * choices});
        }
        if let Some(cached) = plan.cached_tokens {
            usage["prompt_tokens_details"] = json!({"cached_tokens": cached});
        }
        usage
    }
}

fn word(i: u32, last: bool) -> String {
    let w = WORDS[i as usize % WORDS.len()];
    if last { w.to_string() } else { format!("{w} ") }
}

/// `stop` as given: a string or an array of strings (others are ignored).
fn stop_sequences(stop: Option<&Value>) -> Vec<String> {
    match stop {
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .filter_map(Value::as_str)
            .map(String::from)
            .collect(),
        _ => Vec::new(),
    }
}

/// The tokens cut before the first of `stops` in their text, how many were generated (up
/// to the one that completed the stop sequence), and whether one was found.
fn cut_at_stop(pieces: Vec<String>, stops: &[String]) -> (Vec<String>, u32, bool) {
    let text = pieces.concat();
    let Some((cut, end)) = stops
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| text.find(s.as_str()).map(|at| (at, at + s.len())))
        .min()
    else {
        let n = pieces.len() as u32;
        return (pieces, n, false);
    };
    let mut generated = 0;
    let mut len = 0;
    for piece in &pieces {
        generated += 1;
        len += piece.len();
        if len >= end {
            break;
        }
    }
    let mut kept = Vec::new();
    let mut at = 0;
    for piece in pieces {
        if at + piece.len() <= cut {
            at += piece.len();
            kept.push(piece);
            continue;
        }
        if cut > at {
            kept.push(piece[..cut - at].to_string());
        }
        break;
    }
    (kept, generated, true)
}

/// The largest request body the mock reads.
pub const MAX_BODY_BYTES: usize = 64 * 1024 * 1024;

pub fn router(config: MockConfig) -> (Router, Arc<MockStats>) {
    let stats = Arc::new(MockStats::default());
    let mock = Mock {
        ollama: Arc::new(ollama_models::OllamaModels::new(config.pull_step)),
        prefix_cache: config
            .prefix_cache
            .map(|c| Arc::new(prefix_cache::PrefixCache::new(c))),
        config: Arc::new(config),
        stats: stats.clone(),
        faults: Arc::default(),
    };
    let router = Router::new()
        .route("/health", get(health::health))
        .route("/api/version", get(health::version))
        .route(
            "/mock/faults",
            get(health::show_faults).post(health::set_faults),
        )
        .route("/v1/models", get(health::models))
        .route("/v1/chat/completions", post(openai::chat))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/embeddings", post(openai::embeddings))
        .route("/v1/responses", post(apis::responses))
        .route("/v1/messages", post(apis::messages))
        .route("/api/chat", post(ollama::ollama_chat))
        .route("/api/generate", post(ollama::ollama_generate))
        .route("/api/embed", post(ollama::ollama_embed))
        .route("/api/embeddings", post(ollama::ollama_embeddings))
        .route("/api/tags", get(ollama_models::tags))
        .route("/api/ps", get(ollama_models::ps))
        .route("/api/show", post(ollama_models::show))
        .route("/api/pull", post(ollama_models::pull))
        .route("/api/delete", axum::routing::delete(ollama_models::delete))
        .route("/api/copy", post(ollama_models::copy))
        .route("/api/create", post(ollama_models::create))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/mock/stats", get(stats_handler))
        .layer(axum::middleware::from_fn_with_state(
            mock.clone(),
            observe_headers,
        ))
        // Like an inference server, it takes prompts of many megabytes.
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
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

/// A 400 in OpenAI's error shape naming the parameter it is about.
fn bad_param(param: &str, message: String) -> Response {
    (
        StatusCode::BAD_REQUEST,
        axum::Json(json!({"error": {"message": message, "type": "invalid_request_error", "param": param, "code": "unsupported_parameter"}})),
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
