//! The Ollama mock's model store: the models an Ollama server holds on disk and the ones it
//! has loaded, changed by `POST /api/pull`, `DELETE /api/delete`, `POST /api/copy`,
//! `POST /api/create` and by loading (`/api/chat` with no messages, `/api/generate` with no
//! prompt, `keep_alive: 0` to unload), and read by `GET /api/tags` and `GET /api/ps`.
//!
//! It follows Ollama's API documentation (`docs/api.md` in the ollama repository, "Pull a
//! Model", "Delete a Model", "Copy a Model", "Create a Model", "List Local Models", "List
//! Running Models", "Load a model" / "Unload a model" under the chat and generate
//! endpoints):
//! - a pull streams NDJSON: `{"status":"pulling manifest"}`, then per layer
//!   `{"status":"pulling <digest prefix>","digest":…,"total":…,"completed":…}` with
//!   `completed` rising, then `verifying sha256 digest`, `writing manifest`, `success`; with
//!   `"stream": false` one `{"status":"success"}`. A failure after the head is an
//!   `{"error": …}` line inside the 200 stream, as Ollama sends it; a pull cut off part way
//!   resumes where it stopped, as Ollama's partial downloads do;
//! - `/api/delete` answers 200 with no body, or 404 `{"error": …}` for a model it does not
//!   hold; `/api/copy` likewise for a missing source;
//! - `/api/create` (`from` an existing model, with `system`, `template`, `parameters`)
//!   streams `using existing layer …`, `writing manifest`, `success`;
//! - `/api/ps` lists loaded models with `expires_at` (RFC 3339) and `size_vram`; a load
//!   keeps a model for `keep_alive` (5 minutes by default, a duration such as `"10m"` or
//!   seconds), and `keep_alive: 0` unloads it (`done_reason: "unload"`).
//!
//! Test models by name: one whose name holds `missing` does not exist upstream (its pull
//! fails with `pull model manifest: file does not exist` after the head); one holding
//! `error-mid-pull` fails half way through its download; the first pull of one holding
//! `drop-mid-pull` breaks its connection half way through (no error line, no end), and
//! the next resumes it.
//!
//! A fresh store holds `mock-model:latest`. Chat and generate answer any model name,
//! held or not (the rest of the mock's tests rely on that); a held model they answer is
//! loaded as Ollama would load it.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::Mock;

/// How long a loaded model stays loaded when a request does not say (Ollama's default).
const DEFAULT_KEEP_ALIVE: Duration = Duration::from_secs(5 * 60);
/// Progress lines per layer of a pull.
const PULL_STEPS: u64 = 8;

/// One model on the mock's disk.
#[derive(Debug, Clone)]
struct Held {
    size: u64,
    digest: String,
    modified: SystemTime,
    system: Option<String>,
    template: Option<String>,
    parameters: Option<Value>,
    parent: Option<String>,
}

impl Held {
    fn new(name: &str, parent: Option<String>) -> Self {
        Self {
            size: model_size(name),
            digest: digest_of(name),
            modified: SystemTime::now(),
            system: None,
            template: None,
            parameters: None,
            parent,
        }
    }
}

/// The models the mock holds and has loaded.
#[derive(Debug)]
pub struct OllamaModels {
    held: Mutex<BTreeMap<String, Held>>,
    /// Loaded model → when it unloads.
    loaded: Mutex<BTreeMap<String, SystemTime>>,
    /// Bytes already downloaded of an interrupted pull, by model and layer digest.
    partial: Mutex<BTreeMap<(String, String), u64>>,
    /// `drop-mid-pull` models whose pull broke once already.
    dropped: Mutex<std::collections::BTreeSet<String>>,
    /// The pause before each progress line of a pull.
    pull_step: Duration,
}

impl OllamaModels {
    pub fn new(pull_step: Duration) -> Self {
        let mut held = BTreeMap::new();
        held.insert(
            "mock-model:latest".to_string(),
            Held::new("mock-model:latest", None),
        );
        Self {
            held: Mutex::new(held),
            loaded: Mutex::default(),
            partial: Mutex::default(),
            dropped: Mutex::default(),
            pull_step,
        }
    }

    fn holds(&self, name: &str) -> bool {
        self.held.lock().expect("not poisoned").contains_key(name)
    }

    /// Marks a held model loaded until `keep_alive` from now (`None`: the default), or
    /// unloads it for a zero keep-alive. Returns `false` when the model is not held.
    fn load(&self, name: &str, keep_alive: Option<Duration>) -> bool {
        if !self.holds(name) {
            return false;
        }
        let mut loaded = self.loaded.lock().expect("not poisoned");
        match keep_alive.unwrap_or(DEFAULT_KEEP_ALIVE) {
            d if d.is_zero() => {
                loaded.remove(name);
            }
            d => {
                loaded.insert(name.to_string(), SystemTime::now() + d);
            }
        }
        true
    }

    /// A chat or generate request for `body`'s model: loads it if held, or unloads it for a
    /// zero keep-alive. Returns the `done_reason` of a load-only request (no messages / no
    /// prompt): `load` or `unload`.
    pub(crate) fn touch(&self, body: &Value, chat: bool) -> Option<&'static str> {
        let name = full_name(body.get("model").and_then(Value::as_str).unwrap_or(""));
        let keep_alive = keep_alive(body.get("keep_alive"));
        self.load(&name, keep_alive);
        let empty = if chat {
            body.get("messages")
                .and_then(Value::as_array)
                .is_none_or(Vec::is_empty)
        } else {
            body.get("prompt")
                .and_then(Value::as_str)
                .is_none_or(str::is_empty)
        };
        empty.then_some(if keep_alive.is_some_and(|d| d.is_zero()) {
            "unload"
        } else {
            "load"
        })
    }
}

/// `name` with Ollama's default tag (`llama3.2` → `llama3.2:latest`).
pub(crate) fn full_name(name: &str) -> String {
    let last = name.rsplit('/').next().unwrap_or(name);
    if last.contains(':') {
        name.to_string()
    } else {
        format!("{name}:latest")
    }
}

/// A `keep_alive` as Ollama reads it: seconds as a number, or a duration string
/// (`"10m"`, `"1h"`, `"30s"`, `"0"`); a negative one keeps the model loaded for a long
/// time.
fn keep_alive(value: Option<&Value>) -> Option<Duration> {
    let long = Duration::from_secs(100 * 365 * 24 * 3600);
    match value? {
        Value::Number(n) => {
            let secs = n.as_f64()?;
            Some(if secs < 0.0 {
                long
            } else {
                Duration::from_secs_f64(secs)
            })
        }
        Value::String(s) => {
            let s = s.trim();
            if s.starts_with('-') {
                return Some(long);
            }
            let split = s.find(|c: char| !c.is_ascii_digit() && c != '.');
            let (number, unit) = s.split_at(split.unwrap_or(s.len()));
            let number: f64 = number.parse().ok()?;
            let scale = match unit {
                "" | "s" => 1.0,
                "ms" => 0.001,
                "m" => 60.0,
                "h" => 3600.0,
                _ => return None,
            };
            Some(Duration::from_secs_f64(number * scale))
        }
        _ => None,
    }
}

/// A deterministic hex digest standing in for a model's sha256 (64 hex digits).
fn digest_of(name: &str) -> String {
    let mut out = String::with_capacity(64);
    let mut state: u64 = 0xcbf2_9ce4_8422_2325;
    for round in 0..4u64 {
        for b in name.bytes().chain(round.to_le_bytes()) {
            state ^= u64::from(b);
            state = state.wrapping_mul(0x0100_0000_01b3);
        }
        out.push_str(&format!("{state:016x}"));
    }
    out
}

/// A model's size in bytes: a few megabytes, by name.
fn model_size(name: &str) -> u64 {
    4_000_000 + u64::from_str_radix(&digest_of(name)[..4], 16).unwrap_or(0)
}

fn rfc3339(at: SystemTime) -> String {
    let at = time::OffsetDateTime::from(at);
    at.format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}

fn details(parent: Option<&str>) -> Value {
    json!({
        "parent_model": parent.unwrap_or(""),
        "format": "gguf",
        "family": "mock",
        "families": ["mock"],
        "parameter_size": "0B",
        "quantization_level": "Q4_0",
    })
}

fn ollama_error(status: StatusCode, message: String) -> Response {
    (status, axum::Json(json!({"error": message}))).into_response()
}

fn not_found(name: &str) -> Response {
    ollama_error(StatusCode::NOT_FOUND, format!("model '{name}' not found"))
}

/// A management request refused with Ollama's 400.
struct Refused(String);

impl IntoResponse for Refused {
    fn into_response(self) -> Response {
        ollama_error(StatusCode::BAD_REQUEST, self.0)
    }
}

/// The JSON body of a management request.
fn body_json(body: &Bytes) -> Result<Value, Refused> {
    serde_json::from_slice(body).map_err(|e| Refused(format!("invalid JSON: {e}")))
}

/// The model a request names (`model`, or the older `name`).
fn model_of(body: &Value) -> Result<String, Refused> {
    body.get("model")
        .or_else(|| body.get("name"))
        .and_then(Value::as_str)
        .filter(|m| !m.is_empty())
        .map(full_name)
        .ok_or_else(|| Refused("model is required".into()))
}

fn streams(body: &Value) -> bool {
    body.get("stream").and_then(Value::as_bool).unwrap_or(true)
}

/// `GET /api/tags`.
pub(crate) async fn tags(State(mock): State<Mock>) -> Response {
    let held = mock.ollama.held.lock().expect("not poisoned");
    let models: Vec<Value> = held
        .iter()
        .map(|(name, m)| {
            json!({
                "name": name,
                "model": name,
                "modified_at": rfc3339(m.modified),
                "size": m.size,
                "digest": m.digest,
                "details": details(m.parent.as_deref()),
            })
        })
        .collect();
    axum::Json(json!({"models": models})).into_response()
}

/// `GET /api/ps`: the loaded models whose keep-alive has not run out.
pub(crate) async fn ps(State(mock): State<Mock>) -> Response {
    let now = SystemTime::now();
    let mut loaded = mock.ollama.loaded.lock().expect("not poisoned");
    loaded.retain(|_, until| *until > now);
    let held = mock.ollama.held.lock().expect("not poisoned");
    let models: Vec<Value> = loaded
        .iter()
        .filter_map(|(name, until)| {
            let m = held.get(name)?;
            Some(json!({
                "name": name,
                "model": name,
                "size": m.size,
                "digest": m.digest,
                "details": details(m.parent.as_deref()),
                "expires_at": rfc3339(*until),
                "size_vram": m.size,
            }))
        })
        .collect();
    axum::Json(json!({"models": models})).into_response()
}

/// `POST /api/show`: a held model's modelfile, parameters and system prompt; any other
/// name gets a plain `FROM` (the mock answers every model name).
pub(crate) async fn show(State(mock): State<Mock>, body: Bytes) -> Response {
    let model = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|v| {
            v.get("model")
                .or_else(|| v.get("name"))
                .and_then(Value::as_str)
                .map(String::from)
        })
        .unwrap_or_default();
    let held = mock
        .ollama
        .held
        .lock()
        .expect("not poisoned")
        .get(&full_name(&model))
        .cloned();
    let mut answer = json!({
        "modelfile": format!("FROM {model}"),
        "details": {"family": "mock", "parameter_size": "0B"},
        "model_info": {},
    });
    if let Some(held) = held {
        if let Some(parent) = &held.parent {
            answer["modelfile"] = json!(format!("FROM {parent}"));
        }
        if let Some(system) = held.system {
            answer["system"] = json!(system);
        }
        if let Some(template) = held.template {
            answer["template"] = json!(template);
        }
        if let Some(parameters) = held.parameters {
            answer["parameters"] = parameters;
        }
        answer["modified_at"] = json!(rfc3339(held.modified));
    }
    axum::Json(answer).into_response()
}

/// `DELETE /api/delete {model}`.
pub(crate) async fn delete(State(mock): State<Mock>, body: Bytes) -> Response {
    let name = match body_json(&body).and_then(|b| model_of(&b)) {
        Ok(name) => name,
        Err(refused) => return refused.into_response(),
    };
    if mock
        .ollama
        .held
        .lock()
        .expect("not poisoned")
        .remove(&name)
        .is_none()
    {
        return not_found(&name);
    }
    mock.ollama
        .loaded
        .lock()
        .expect("not poisoned")
        .remove(&name);
    StatusCode::OK.into_response()
}

/// `POST /api/copy {source, destination}`.
pub(crate) async fn copy(State(mock): State<Mock>, body: Bytes) -> Response {
    let body = match body_json(&body) {
        Ok(body) => body,
        Err(refused) => return refused.into_response(),
    };
    let (Some(source), Some(destination)) = (
        body.get("source").and_then(Value::as_str),
        body.get("destination").and_then(Value::as_str),
    ) else {
        return ollama_error(
            StatusCode::BAD_REQUEST,
            "source and destination are required".into(),
        );
    };
    let (source, destination) = (full_name(source), full_name(destination));
    let mut held = mock.ollama.held.lock().expect("not poisoned");
    let Some(model) = held.get(&source).cloned() else {
        return not_found(&source);
    };
    held.insert(
        destination,
        Held {
            modified: SystemTime::now(),
            ..model
        },
    );
    StatusCode::OK.into_response()
}

/// `POST /api/create {model, from, system?, template?, parameters?, stream?}`.
pub(crate) async fn create(State(mock): State<Mock>, body: Bytes) -> Response {
    let (body, name) = match body_json(&body).and_then(|b| model_of(&b).map(|m| (b, m))) {
        Ok(named) => named,
        Err(refused) => return refused.into_response(),
    };
    let Some(from) = body.get("from").and_then(Value::as_str).map(full_name) else {
        return ollama_error(
            StatusCode::BAD_REQUEST,
            "neither 'from' or 'files' was specified".into(),
        );
    };
    let mut held = mock.ollama.held.lock().expect("not poisoned");
    let Some(base) = held.get(&from).cloned() else {
        return not_found(&from);
    };
    let text = |key: &str| body.get(key).and_then(Value::as_str).map(String::from);
    held.insert(
        name.clone(),
        Held {
            digest: digest_of(&name),
            modified: SystemTime::now(),
            system: text("system").or(base.system.clone()),
            template: text("template").or(base.template.clone()),
            parameters: body.get("parameters").cloned().or(base.parameters.clone()),
            parent: Some(from),
            ..base.clone()
        },
    );
    if !streams(&body) {
        return axum::Json(json!({"status": "success"})).into_response();
    }
    let lines = [
        json!({"status": format!("using existing layer sha256:{}", base.digest)}),
        json!({"status": "writing manifest"}),
        json!({"status": "success"}),
    ];
    ndjson(lines.iter().map(|l| format!("{l}\n")).collect::<String>())
}

fn ndjson(body: impl Into<Body>) -> Response {
    (
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        body.into(),
    )
        .into_response()
}

/// One layer of a pulled model.
struct Layer {
    digest: String,
    total: u64,
}

/// Where a pull is.
enum Stage {
    Manifest,
    /// Downloading `layers[i]`.
    Layer(usize),
    /// Verifying, writing the manifest, success.
    Tail(usize),
    /// The next line is this error, and then the end.
    Failing(&'static str),
    Done,
}

/// A pull under way: the lines it has yet to send.
struct Pull {
    models: Arc<OllamaModels>,
    name: String,
    layers: Vec<Layer>,
    stage: Stage,
}

impl Pull {
    fn new(models: Arc<OllamaModels>, name: String) -> Self {
        let layers = vec![
            Layer {
                digest: format!("sha256:{}", digest_of(&name)),
                total: model_size(&name),
            },
            Layer {
                digest: format!("sha256:{}", digest_of(&format!("{name}#params"))),
                total: 96,
            },
        ];
        Self {
            models,
            name,
            layers,
            stage: Stage::Manifest,
        }
    }

    /// The next line and whether to pause before it, or `None` at the end.
    fn next_line(&mut self) -> Option<(bool, Value)> {
        match self.stage {
            Stage::Manifest => {
                self.stage = if self.name.contains("missing") {
                    Stage::Failing("pull model manifest: file does not exist")
                } else {
                    Stage::Layer(0)
                };
                Some((true, json!({"status": "pulling manifest"})))
            }
            Stage::Failing(error) => {
                self.stage = Stage::Done;
                Some((false, json!({"error": error})))
            }
            Stage::Layer(i) => Some((true, self.download(i))),
            Stage::Tail(step) => {
                let line = match step {
                    0 => json!({"status": "verifying sha256 digest"}),
                    1 => {
                        let held = Held::new(&self.name, None);
                        let mut models = self.models.held.lock().expect("not poisoned");
                        models.insert(self.name.clone(), held);
                        json!({"status": "writing manifest"})
                    }
                    _ => {
                        self.stage = Stage::Done;
                        return Some((false, json!({"status": "success"})));
                    }
                };
                self.stage = Stage::Tail(step + 1);
                Some((false, line))
            }
            Stage::Done => None,
        }
    }

    /// The next progress line of layer `i`, resuming from what an earlier pull of it
    /// downloaded.
    fn download(&mut self, i: usize) -> Value {
        let layer = &self.layers[i];
        let key = (self.name.clone(), layer.digest.clone());
        let mut partial = self.models.partial.lock().expect("not poisoned");
        let done = partial.get(&key).copied().unwrap_or(0);
        if self.name.contains("error-mid-pull") && i == 0 && done >= layer.total / 2 {
            self.stage = Stage::Done;
            return json!({"error": "max retries exceeded: unexpected EOF"});
        }
        if self.name.contains("drop-mid-pull")
            && i == 0
            && done >= layer.total / 2
            && self
                .models
                .dropped
                .lock()
                .expect("not poisoned")
                .insert(self.name.clone())
        {
            self.stage = Stage::Done;
            return CUT;
        }
        let completed = (done + layer.total.div_ceil(PULL_STEPS)).min(layer.total);
        if completed >= layer.total {
            partial.remove(&key);
            self.stage = if i + 1 < self.layers.len() {
                Stage::Layer(i + 1)
            } else {
                Stage::Tail(0)
            };
        } else {
            partial.insert(key, completed);
        }
        json!({
            "status": format!("pulling {}", &layer.digest["sha256:".len()..][..12]),
            "digest": layer.digest,
            "total": layer.total,
            "completed": completed,
        })
    }
}

/// The "line" that breaks a pull's connection instead (`drop-mid-pull`).
const CUT: Value = Value::Null;

/// `POST /api/pull {model, stream?}`.
pub(crate) async fn pull(State(mock): State<Mock>, body: Bytes) -> Response {
    let (body, name) = match body_json(&body).and_then(|b| model_of(&b).map(|m| (b, m))) {
        Ok(named) => named,
        Err(refused) => return refused.into_response(),
    };
    let step = mock.ollama.pull_step;
    let mut pull = Pull::new(mock.ollama.clone(), name);
    if !streams(&body) {
        let mut last = json!({"status": "success"});
        while let Some((pause, line)) = pull.next_line() {
            if pause && !step.is_zero() {
                tokio::time::sleep(step).await;
            }
            last = line;
        }
        if let Some(error) = last.get("error").and_then(Value::as_str) {
            return ollama_error(StatusCode::INTERNAL_SERVER_ERROR, error.to_string());
        }
        if last == CUT {
            return ollama_error(StatusCode::INTERNAL_SERVER_ERROR, "unexpected EOF".into());
        }
        return axum::Json(last).into_response();
    }
    let lines = futures::stream::unfold(pull, move |mut pull| async move {
        let (pause, line) = pull.next_line()?;
        if pause && !step.is_zero() {
            tokio::time::sleep(step).await;
        }
        if line == CUT {
            let cut = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "cut mid-pull");
            return Some((Err(cut), pull));
        }
        Some((Ok(Bytes::from(format!("{line}\n"))), pull))
    });
    ndjson(Body::from_stream(lines))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_get_the_default_tag() {
        assert_eq!(full_name("llama3.2"), "llama3.2:latest");
        assert_eq!(full_name("llama3.2:3b"), "llama3.2:3b");
        assert_eq!(full_name("host:5000/ns/model"), "host:5000/ns/model:latest");
    }

    #[test]
    fn keep_alive_reads_numbers_and_durations() {
        assert_eq!(keep_alive(Some(&json!(0))), Some(Duration::ZERO));
        assert_eq!(keep_alive(Some(&json!("0"))), Some(Duration::ZERO));
        assert_eq!(
            keep_alive(Some(&json!("10m"))),
            Some(Duration::from_secs(600))
        );
        assert_eq!(keep_alive(Some(&json!(30))), Some(Duration::from_secs(30)));
        assert!(keep_alive(Some(&json!(-1))).unwrap() > Duration::from_secs(3600));
        assert_eq!(keep_alive(None), None);
    }

    fn drain(pull: &mut Pull) -> Vec<Value> {
        std::iter::from_fn(|| pull.next_line().map(|(_, l)| l)).collect()
    }

    #[test]
    fn a_pull_rises_to_success_and_then_the_model_is_held() {
        let models = Arc::new(OllamaModels::new(Duration::ZERO));
        let lines = drain(&mut Pull::new(models.clone(), "tiny:1b".into()));
        assert_eq!(lines[0]["status"], "pulling manifest");
        assert_eq!(lines.last().unwrap()["status"], "success");
        let progress: Vec<u64> = lines
            .iter()
            .filter(|l| l["total"].as_u64().is_some_and(|t| t > 1000))
            .map(|l| l["completed"].as_u64().unwrap())
            .collect();
        assert_eq!(progress.len() as u64, PULL_STEPS);
        assert!(progress.windows(2).all(|w| w[0] < w[1]), "{progress:?}");
        assert!(models.holds("tiny:1b"));
    }

    #[test]
    fn an_interrupted_pull_resumes_where_it_stopped() {
        let models = Arc::new(OllamaModels::new(Duration::ZERO));
        let mut first = Pull::new(models.clone(), "tiny:1b".into());
        for _ in 0..4 {
            first.next_line();
        }
        drop(first);
        let lines = drain(&mut Pull::new(models.clone(), "tiny:1b".into()));
        let first_progress = lines.iter().find(|l| l.get("completed").is_some()).unwrap();
        assert!(
            first_progress["completed"].as_u64().unwrap()
                > first_progress["total"].as_u64().unwrap() / 3,
            "{first_progress}"
        );
        assert_eq!(lines.last().unwrap()["status"], "success");
    }

    #[test]
    fn a_missing_model_fails_inside_the_stream() {
        let models = Arc::new(OllamaModels::new(Duration::ZERO));
        let lines = drain(&mut Pull::new(models.clone(), "missing:1b".into()));
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert_eq!(lines[0]["status"], "pulling manifest");
        assert!(
            lines[1]["error"]
                .as_str()
                .unwrap()
                .contains("file does not exist")
        );
        assert!(!models.holds("missing:1b"));
        let lines = drain(&mut Pull::new(models.clone(), "error-mid-pull:1b".into()));
        assert!(lines.last().unwrap()["error"].is_string(), "{lines:?}");
        assert!(lines.len() > 3);
        assert!(!models.holds("error-mid-pull:1b"));
    }

    #[test]
    fn a_dropping_pull_breaks_once_and_then_resumes() {
        let models = Arc::new(OllamaModels::new(Duration::ZERO));
        let first = drain(&mut Pull::new(models.clone(), "drop-mid-pull:1b".into()));
        assert_eq!(first.last(), Some(&CUT), "{first:?}");
        let second = drain(&mut Pull::new(models.clone(), "drop-mid-pull:1b".into()));
        let resumed = second
            .iter()
            .find(|l| l.get("completed").is_some())
            .unwrap();
        assert!(resumed["completed"].as_u64() > Some(resumed["total"].as_u64().unwrap() / 2));
        assert_eq!(second.last().unwrap()["status"], "success");
    }

    #[test]
    fn loading_and_unloading() {
        let models = OllamaModels::new(Duration::ZERO);
        let load = json!({"model": "mock-model", "messages": []});
        assert_eq!(models.touch(&load, true), Some("load"));
        assert!(
            models
                .loaded
                .lock()
                .unwrap()
                .contains_key("mock-model:latest")
        );
        let unload = json!({"model": "mock-model", "keep_alive": 0});
        assert_eq!(models.touch(&unload, false), Some("unload"));
        assert!(models.loaded.lock().unwrap().is_empty());
        let answer = json!({"model": "mock-model", "prompt": "hi"});
        assert_eq!(models.touch(&answer, false), None);
    }
}
