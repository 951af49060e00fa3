//! Test harness: real `iop` processes on loopback. Each process's stdout and stderr are
//! collected line by line so tests can wait for a log line, read bound addresses, and
//! print the logs when something fails. Every wait is bounded.

#![allow(dead_code)]

pub mod agents;
pub mod browser;
pub mod haproxy;
pub mod health;
pub mod in_process;
pub mod node_wire;
pub mod ollama_api;
pub mod postgres;
pub mod real_backend;
pub mod recorder;
pub mod sdk;
pub mod suite;
pub mod tls;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

pub const IOP: &str = env!("CARGO_BIN_EXE_iop");

/// A running `iop` process.
pub struct Proc {
    pub name: String,
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
    /// The threads collecting stdout and stderr into `lines`.
    readers: Vec<std::thread::JoinHandle<()>>,
}

impl Proc {
    pub fn spawn(name: &str, args: &[&str]) -> Proc {
        Self::spawn_with_env(name, args, &[])
    }

    pub fn spawn_with_env(name: &str, args: &[&str], env: &[(&str, &str)]) -> Proc {
        let mut cmd = Command::new(IOP);
        // `env` may set its own RUST_LOG.
        cmd.args(args)
            .env("RUST_LOG", "info")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("spawn iop");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let mut readers = Vec::new();
        for stream in [
            Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>,
            Box::new(child.stderr.take().unwrap()),
        ] {
            let lines = lines.clone();
            readers.push(std::thread::spawn(move || {
                for line in BufReader::new(stream).lines() {
                    let Ok(line) = line else { break };
                    lines.lock().unwrap().push(line);
                }
            }));
        }
        Proc {
            name: name.to_string(),
            child,
            lines,
            readers,
        }
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn log(&self) -> String {
        self.lines.lock().unwrap().join("\n")
    }

    pub fn has_line(&self, needle: &str) -> bool {
        self.lines
            .lock()
            .unwrap()
            .iter()
            .any(|l| l.contains(needle))
    }

    /// Waits for a line containing `needle`; returns it.
    pub async fn wait_line(&self, needle: &str, within: Duration) -> String {
        let deadline = Instant::now() + within;
        loop {
            if let Some(line) = self
                .lines
                .lock()
                .unwrap()
                .iter()
                .find(|l| l.contains(needle))
            {
                return line.clone();
            }
            if Instant::now() > deadline {
                panic!(
                    "{}: no line containing {needle:?} within {within:?}; log:\n{}",
                    self.name,
                    self.log()
                );
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    pub fn signal(&self, sig: nix::sys::signal::Signal) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid()), sig);
    }

    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Waits for the process to exit, then (for at most 5 s more, in case a child of it
    /// still holds its output open) for the last lines it wrote to be collected, so the
    /// log is complete when this returns.
    pub async fn wait_exit(&mut self, within: Duration) -> ExitStatus {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                let drained = Instant::now() + Duration::from_secs(5);
                while self.readers.iter().any(|r| !r.is_finished()) && Instant::now() < drained {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                return status;
            }
            if Instant::now() > deadline {
                panic!(
                    "{} did not exit within {within:?}; log:\n{}",
                    self.name,
                    self.log()
                );
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.pid()),
            nix::sys::signal::Signal::SIGCONT,
        );
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("----- {} log -----\n{}\n-----", self.name, self.log());
        }
    }
}

/// An `iop edge` process and its bound addresses.
pub struct EdgeProc {
    pub proc: Proc,
    pub nodes: String,
    pub http: String,
    pub config: PathBuf,
    /// The pin of the node listener's CA (`None` for a plaintext listener).
    pub pin: Option<String>,
}

impl EdgeProc {
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.http, path)
    }
}

/// Starts an edge with `config` (YAML), on free ports unless given.
pub async fn start_edge(dir: &Path, config: &str) -> EdgeProc {
    start_edge_on(dir, config, "127.0.0.1:0", "127.0.0.1:0").await
}

pub async fn start_edge_on(dir: &Path, config: &str, nodes: &str, http: &str) -> EdgeProc {
    spawn_edge(dir, config, nodes, http, &[], &[]).await
}

/// An edge on ephemeral ports with `args` added to its command line.
pub async fn start_edge_with(dir: &Path, config: &str, args: &[&str]) -> EdgeProc {
    spawn_edge(dir, config, "127.0.0.1:0", "127.0.0.1:0", args, &[]).await
}

/// An edge on ephemeral ports whose process gets `env` (e.g. `RUST_LOG`).
pub async fn start_edge_env(dir: &Path, config: &str, env: &[(&str, &str)]) -> EdgeProc {
    spawn_edge(dir, config, "127.0.0.1:0", "127.0.0.1:0", &[], env).await
}

/// Runs `iop edge` with `config` (on ephemeral ports, with `env`), expects it to exit
/// with a failure, and returns its log.
pub async fn edge_failing_to_start(config: &str, env: &[(&str, &str)]) -> String {
    let dir = tempdir();
    let path = dir.path().join("edge.yaml");
    std::fs::write(&path, config).unwrap();
    let mut edge = Proc::spawn_with_env(
        "edge",
        &[
            "edge",
            "--config",
            path.to_str().unwrap(),
            "--listen-nodes",
            "127.0.0.1:0",
            "--listen-http",
            "127.0.0.1:0",
        ],
        env,
    );
    let status = edge.wait_exit(Duration::from_secs(60)).await;
    assert!(!status.success(), "the edge started:\n{}", edge.log());
    edge.log()
}

/// An edge listening on `nodes` and `http` whose process gets `env`.
pub async fn start_edge_full(
    dir: &Path,
    config: &str,
    nodes: &str,
    http: &str,
    env: &[(&str, &str)],
) -> EdgeProc {
    spawn_edge(dir, config, nodes, http, &[], env).await
}

async fn spawn_edge(
    dir: &Path,
    config: &str,
    nodes: &str,
    http: &str,
    args: &[&str],
    env: &[(&str, &str)],
) -> EdgeProc {
    let path = dir.join("edge.yaml");
    std::fs::write(&path, config).unwrap();
    let mut all = vec![
        "edge",
        "--config",
        path.to_str().unwrap(),
        "--listen-nodes",
        nodes,
        "--listen-http",
        http,
    ];
    all.extend_from_slice(args);
    let proc = Proc::spawn_with_env("edge", &all, env);
    let line = proc
        .wait_line("iop edge listening:", Duration::from_secs(20))
        .await;
    let field = |key: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(key))
            .unwrap_or_else(|| panic!("no {key} in {line:?}"))
            .to_string()
    };
    let pin = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("pin="))
        .map(String::from);
    let nodes = field("nodes=");
    tls::remember_pin(&nodes, pin.as_deref());
    EdgeProc {
        nodes,
        http: field("http="),
        proc,
        config: path,
        pin,
    }
}

/// Starts `iop node` against `edge` with `token`, writing a node config with `extra` YAML.
pub fn start_node(name: &str, dir: &Path, edge_nodes: &str, token: &str, extra: &str) -> Proc {
    start_node_with(name, dir, edge_nodes, token, extra, &[])
}

/// A node whose config file holds `extra` and whose command line adds `args`.
pub fn start_node_with(
    name: &str,
    dir: &Path,
    edge_nodes: &str,
    token: &str,
    extra: &str,
    args: &[&str],
) -> Proc {
    start_node_with_env(name, dir, edge_nodes, token, extra, args, &[])
}

/// [`start_node_with`] whose process also gets `env` (e.g. `RUST_LOG`).
pub fn start_node_with_env(
    name: &str,
    dir: &Path,
    edge_nodes: &str,
    token: &str,
    extra: &str,
    args: &[&str],
    env: &[(&str, &str)],
) -> Proc {
    let config = dir.join(format!("{name}.yaml"));
    let db = dir.join(format!("{name}.db"));
    std::fs::write(
        &config,
        format!(
            "edge: \"{edge_nodes}\"\ntoken: \"{token}\"\ndb: \"{}\"\n{}{extra}\n",
            db.display(),
            tls::node_trust_yaml(name, dir, edge_nodes),
        ),
    )
    .unwrap();
    let mut all = vec!["node", "--config", config.to_str().unwrap()];
    all.extend_from_slice(args);
    Proc::spawn_with_env(name, &all, env)
}

/// An `iop mock-provider` process.
pub struct MockProc {
    pub proc: Proc,
    pub addr: String,
}

impl MockProc {
    pub fn openai_base(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    pub fn ollama_base(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub async fn stats(&self) -> Value {
        get_json(&format!("http://{}/mock/stats", self.addr)).await
    }

    /// Waits until the mock has seen `n` abandoned responses.
    pub async fn wait_aborted(&self, n: u64, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let stats = self.stats().await;
            if stats["aborted"].as_u64().unwrap_or(0) >= n {
                return;
            }
            if Instant::now() > deadline {
                panic!("provider saw no closed connection within {within:?}: {stats}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

pub async fn start_mock(args: &[&str]) -> MockProc {
    let mut all = vec!["mock-provider", "--listen", "127.0.0.1:0"];
    all.extend_from_slice(args);
    let proc = Proc::spawn("mock-provider", &all);
    let line = proc
        .wait_line("iop mock-provider listening:", Duration::from_secs(20))
        .await;
    let addr = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("http://"))
        .unwrap()
        .to_string();
    MockProc { proc, addr }
}

pub fn client() -> reqwest::Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap()
}

pub async fn get_text(url: &str) -> String {
    client()
        .get(url)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// POSTs `body` to `url` and reads the answer as JSON (whatever its status).
pub async fn post_json(url: &str, body: &Value) -> Value {
    client()
        .post(url)
        .json(body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

pub async fn get_json(url: &str) -> Value {
    client()
        .get(url)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// The admin API key tests configure when they turn auth on; status reads send it (an
/// edge without keys ignores it).
pub const TEST_API_KEY: &str = "sk-right-0123456789";

/// `GET path` on the edge with the admin key.
pub async fn admin_get(edge: &EdgeProc, path: &str) -> reqwest::Response {
    client()
        .get(edge.url(path))
        .bearer_auth(TEST_API_KEY)
        .send()
        .await
        .unwrap()
}

pub async fn status(edge: &EdgeProc) -> Value {
    admin_get(edge, "/admin/status").await.json().await.unwrap()
}

pub fn node_status<'a>(status: &'a Value, id: &str) -> &'a Value {
    status["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["id"] == id)
        .unwrap_or_else(|| panic!("node {id} not in {status}"))
}

/// Polls the status snapshot until `pred` holds; returns how long it took.
pub async fn wait_status(
    edge: &EdgeProc,
    within: Duration,
    what: &str,
    pred: impl Fn(&Value) -> bool,
) -> Duration {
    let started = Instant::now();
    loop {
        let s = status(edge).await;
        if pred(&s) {
            return started.elapsed();
        }
        if started.elapsed() > within {
            panic!(
                "status never showed {what} within {within:?}: {s}\nedge log:\n{}",
                edge.proc.log()
            );
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

pub async fn wait_ready(edge: &EdgeProc, node: &str) -> Duration {
    wait_status(
        edge,
        Duration::from_secs(20),
        &format!("{node} ready"),
        |s| node_status(s, node)["ready"] == true,
    )
    .await
}

/// An event stream without the `id:` fields the edge adds to relayed events (for resuming):
/// the provider's bytes as it sent them.
pub fn without_event_ids(body: &str) -> String {
    body.split_inclusive('\n')
        .filter(|line| !line.starts_with("id: "))
        .collect()
}

/// Parses an SSE body into `(event name, data)` pairs.
pub fn sse_events(body: &str) -> Vec<(String, String)> {
    let mut events = Vec::new();
    for block in body.split("\n\n") {
        let mut name = String::new();
        let mut data = Vec::new();
        for line in block.lines() {
            if let Some(n) = line.strip_prefix("event: ") {
                name = n.to_string();
            } else if let Some(d) = line.strip_prefix("data: ") {
                data.push(d);
            }
        }
        if !data.is_empty() {
            events.push((name, data.join("\n")));
        }
    }
    events
}

/// A temporary directory for one test's configs and databases.
/// A loopback address no one listens on now (`127.0.0.1:<port>`).
pub fn free_addr() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().to_string()
}

pub fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

/// A TCP proxy between a node and the edge that a test can cut (every connection
/// dropped, new ones refused) and restore: a network drop with both processes alive.
pub struct CuttableProxy {
    pub addr: String,
    open: Arc<std::sync::atomic::AtomicBool>,
    connections: Arc<Mutex<Vec<tokio::task::AbortHandle>>>,
    task: tokio::task::JoinHandle<()>,
}

impl CuttableProxy {
    pub async fn start(upstream: &str) -> CuttableProxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        tls::alias_pin(&addr, upstream);
        let open = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let connections: Arc<Mutex<Vec<tokio::task::AbortHandle>>> = Arc::default();
        let upstream = upstream.to_string();
        let (open2, conns2) = (open.clone(), connections.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut inbound, _)) = listener.accept().await else {
                    return;
                };
                if !open2.load(std::sync::atomic::Ordering::SeqCst) {
                    drop(inbound);
                    continue;
                }
                let upstream = upstream.clone();
                let handle = tokio::spawn(async move {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(&upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
                conns2.lock().unwrap().push(handle.abort_handle());
            }
        });
        CuttableProxy {
            addr,
            open,
            connections,
            task,
        }
    }

    /// Drops every proxied connection and refuses new ones.
    pub fn cut(&self) {
        self.open.store(false, std::sync::atomic::Ordering::SeqCst);
        for c in self.connections.lock().unwrap().drain(..) {
            c.abort();
        }
    }

    pub fn restore(&self) {
        self.open.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Drop for CuttableProxy {
    fn drop(&mut self) {
        self.cut();
        self.task.abort();
    }
}

/// Sends one chat completion and returns `(status, body)`.
pub async fn chat_completion(
    edge: &EdgeProc,
    model: &str,
    content: &str,
    extra: Value,
) -> (u16, String) {
    let mut body =
        serde_json::json!({"model": model, "messages": [{"role": "user", "content": content}]});
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            b.insert(k.clone(), v.clone());
        }
    }
    let response = client()
        .post(edge.url("/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.text().await.unwrap_or_default())
}

/// Provider in-flight counts of one node's provider.
pub fn provider_of<'a>(status: &'a Value, node: &str, provider: &str) -> &'a Value {
    node_status(status, node)["providers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["id"] == provider)
        .unwrap_or_else(|| panic!("no provider {node}/{provider} in {status}"))
}

pub fn group_of<'a>(status: &'a Value, name: &str) -> &'a Value {
    status["model_groups"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["name"] == name)
        .unwrap_or_else(|| panic!("no model group {name} in {status}"))
}

/// Every provider idle, nothing waiting, and every lease released exactly once.
pub fn all_idle(status: &Value) -> bool {
    let zero = serde_json::json!({"normal": 0, "long": 0});
    let providers_idle = status["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|n| n["providers"].as_array().unwrap().iter())
        .all(|p| p["in_flight"] == zero);
    let none_waiting = status["model_groups"]
        .as_array()
        .unwrap()
        .iter()
        .all(|g| g["waiting"] == zero);
    let leases = &status["leases"];
    providers_idle
        && none_waiting
        && leases["live"] == 0
        && leases["acquired"] == leases["released"]
}

pub async fn wait_idle(edge: &EdgeProc) {
    wait_status(
        edge,
        Duration::from_secs(10),
        "all counters back to 0",
        all_idle,
    )
    .await;
}

/// Reads a streaming response until `done` holds for everything read so far.
pub async fn read_until(
    response: &mut reqwest::Response,
    seen: &mut String,
    done: impl Fn(&str) -> bool,
) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !done(seen) {
        let chunk = tokio::time::timeout_at(deadline, response.chunk())
            .await
            .unwrap_or_else(|_| panic!("the stream stalled; read so far: {seen}"))
            .unwrap()
            .unwrap_or_else(|| panic!("the stream ended early; read: {seen}"));
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
}

/// Reads a streaming response to its end (a broken body counts as the end); every chunk
/// must come within `gap`.
pub async fn read_to_end(response: &mut reqwest::Response, seen: &mut String, gap: Duration) {
    loop {
        let chunk = tokio::time::timeout(gap, response.chunk())
            .await
            .unwrap_or_else(|_| panic!("the stream did not end within {gap:?}; read: {seen}"));
        match chunk {
            Ok(Some(chunk)) => seen.push_str(&String::from_utf8_lossy(&chunk)),
            _ => return,
        }
    }
}
