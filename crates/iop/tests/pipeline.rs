//! One pipeline for every surface, with real processes: every client API (OpenAI chat
//! streamed and not, completions, embeddings, Responses, Messages, Ollama chat and
//! generate, native runs) against both kinds of member (an OpenAI-compatible provider
//! reached through the tunnel, a run adapter — a CLI program that counts its calls) and
//! every outcome (served, the client leaving mid-stream, a provider error, the node lost
//! before and after it accepted the request, a key over its limit). For each, what the
//! client saw, the ledger record, the metric outcome, the key's limit counters and the
//! number of requests the provider received must agree.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;
use serde_json::{Value, json};

/// The CLI program behind the run members: it counts its calls in `$CALLS`, then answers
/// by its target — `fail` exits 3 before any output, `slow` writes 400 lines 25 ms apart
/// (it dies of SIGPIPE once nobody reads), anything else one line — and reports usage.
const COUNTING: &str = r#"echo "$IOP_TARGET" >> "$CALLS"
case "$IOP_TARGET" in
  *fail*) echo "the program failed" >&2; exit 3 ;;
  *slow*) i=0; while [ $i -lt 400 ]; do echo "tok$i" || exit 1; i=$((i+1)); sleep 0.025; done ;;
  *) cat > /dev/null; echo "Hello from the counting program" ;;
esac
echo "@@iop-usage $IOP_USAGE_NONCE {\"input_tokens\":3,\"output_tokens\":2}"
"#;

const KEY: &str = "sk-matrix-0123456789";
/// Keys with `requests_per_minute: 1`, one per cell that trips it.
fn limited_key(i: usize) -> String {
    format!("sk-limited-{i:04}-0123456789")
}
const LIMITED_KEYS: usize = 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// An OpenAI-compatible provider through the raw tunnel.
    Tunnel,
    /// A run adapter (the counting CLI program).
    Run,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Surface {
    ChatStream,
    Chat,
    Completions,
    Embeddings,
    Responses,
    Messages,
    OllamaChat,
    OllamaGenerate,
    Runs,
}

const SURFACES: [Surface; 9] = [
    Surface::ChatStream,
    Surface::Chat,
    Surface::Completions,
    Surface::Embeddings,
    Surface::Responses,
    Surface::Messages,
    Surface::OllamaChat,
    Surface::OllamaGenerate,
    Surface::Runs,
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Ok,
    Leaves,
    ProviderError,
    LostBeforeAccept,
    LostAfterAccept,
    OverLimit,
}

/// How errors look in an API.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shape {
    OpenAi,
    Anthropic,
    Ollama,
}

impl Surface {
    fn path(self) -> &'static str {
        match self {
            Surface::ChatStream | Surface::Chat => "/v1/chat/completions",
            Surface::Completions => "/v1/completions",
            Surface::Embeddings => "/v1/embeddings",
            Surface::Responses => "/v1/responses",
            Surface::Messages => "/v1/messages",
            Surface::OllamaChat => "/api/chat",
            Surface::OllamaGenerate => "/api/generate",
            Surface::Runs => "/v1/runs",
        }
    }

    fn streams(self) -> bool {
        matches!(
            self,
            Surface::ChatStream
                | Surface::Responses
                | Surface::Messages
                | Surface::OllamaChat
                | Surface::Runs
        )
    }

    fn api(self) -> &'static str {
        match self {
            Surface::ChatStream | Surface::Chat | Surface::Completions | Surface::Embeddings => {
                "openai"
            }
            Surface::Responses => "responses",
            Surface::Messages => "messages",
            Surface::OllamaChat | Surface::OllamaGenerate => "ollama",
            Surface::Runs => "runs",
        }
    }

    fn shape(self) -> Shape {
        match self {
            Surface::Messages => Shape::Anthropic,
            Surface::OllamaChat | Surface::OllamaGenerate => Shape::Ollama,
            _ => Shape::OpenAi,
        }
    }

    /// The request for model group `group` (a run names the member's node, adapter and
    /// target instead).
    fn body(self, group: &str, member: &Member) -> Value {
        let hi = json!([{"role": "user", "content": "hello there"}]);
        match self {
            Surface::ChatStream => json!({"model": group, "messages": hi, "stream": true}),
            Surface::Chat => json!({"model": group, "messages": hi}),
            Surface::Completions => json!({"model": group, "prompt": "hello there"}),
            Surface::Embeddings => json!({"model": group, "input": "hello there"}),
            Surface::Responses => json!({"model": group, "input": "hello there", "stream": true}),
            Surface::Messages => {
                json!({"model": group, "max_tokens": 1000, "messages": hi, "stream": true})
            }
            Surface::OllamaChat => json!({"model": group, "messages": hi}),
            Surface::OllamaGenerate => {
                json!({"model": group, "prompt": "hello there", "stream": false})
            }
            Surface::Runs => json!({"node": member.node, "adapter": member.provider,
                                    "target": member.target, "input": "hello there"}),
        }
    }

    /// Whether a body says the answer completed.
    fn completed(self, body: &str) -> bool {
        match self {
            Surface::ChatStream => body.contains("data: [DONE]"),
            Surface::Chat | Surface::Completions => body.contains("\"choices\""),
            Surface::Embeddings => body.contains("\"embedding\""),
            Surface::Responses => body.contains("response.completed"),
            Surface::Messages => body.contains("message_stop"),
            Surface::OllamaChat | Surface::OllamaGenerate => body
                .lines()
                .last()
                .is_some_and(|l| l.contains("\"done\":true")),
            Surface::Runs => body.contains("event: complete"),
        }
    }

    /// Whether a streamed body ended with an error event.
    fn ended_in_error(self, body: &str) -> bool {
        match self {
            Surface::ChatStream => body.contains("data: {\"error\""),
            Surface::Responses => body.contains("response.failed"),
            Surface::Messages => body.contains("event: error"),
            Surface::OllamaChat => body
                .lines()
                .last()
                .is_some_and(|l| l.starts_with("{\"error\"")),
            Surface::Runs => body.contains("event: error"),
            _ => false,
        }
    }

    /// Whether a body holds output yet (a streamed delta).
    fn has_output(self, body: &str) -> bool {
        match self {
            Surface::ChatStream => {
                body.contains("\"content\":\"tok") || body.contains("\"content\":\"Hello")
            }
            Surface::Responses => body.contains("output_text.delta"),
            Surface::Messages => body.contains("text_delta"),
            Surface::OllamaChat => body.lines().count() >= 2,
            Surface::Runs => body.contains("event: delta"),
            _ => false,
        }
    }
}

/// Checks that an HTTP error body is in `shape` and returns its message.
fn error_message(shape: Shape, body: &str) -> String {
    let v: Value = serde_json::from_str(body).unwrap_or_else(|_| panic!("not JSON: {body}"));
    let message = match shape {
        Shape::OpenAi => v["error"]["message"].as_str(),
        Shape::Anthropic => {
            assert_eq!(v["type"], "error", "{body}");
            v["error"]["message"].as_str()
        }
        Shape::Ollama => {
            assert_eq!(v.as_object().unwrap().len(), 1, "only `error`: {body}");
            v["error"].as_str()
        }
    };
    message
        .unwrap_or_else(|| panic!("no message in {shape:?} shape: {body}"))
        .to_string()
}

/// A member a cell's requests go to.
#[derive(Debug, Clone)]
struct Member {
    /// The model group (empty for a run, which names no group).
    group: String,
    node: &'static str,
    provider: &'static str,
    target: &'static str,
}

struct Setup {
    _dir: tempfile::TempDir,
    dir: PathBuf,
    mock: MockProc,
    edge: EdgeProc,
    _n1: Proc,
    n2: Option<Proc>,
    calls: PathBuf,
}

fn config(mock: &MockProc, dir: &Path) -> String {
    let calls = dir.join("calls");
    let script = dir.join("counting.sh");
    let mut keys = format!(
        "    - {{name: ops, role: admin, key: {TEST_API_KEY}}}\n    - {{name: matrix, role: client, key: {KEY}, limits: {{requests_per_minute: 100000, max_concurrent: 100, tokens_per_day: 100000000}}}}\n"
    );
    for i in 0..LIMITED_KEYS {
        keys.push_str(&format!(
            "    - {{name: limited-{i}, role: client, key: {}, limits: {{requests_per_minute: 1}}}}\n",
            limited_key(i)
        ));
    }
    let cli = |id: &str| {
        format!(
            "{{id: {id}, kind: cli, capacity: {{normal: 8}}, cli: {{argv: [sh, \"{}\"], env: {{CALLS: \"{}\"}}}}}}",
            script.display(),
            calls.display()
        )
    };
    let oa = |id: &str| {
        format!(
            "{{id: {id}, kind: openai_compat, base_url: \"{}\", capacity: {{normal: 8}}}}",
            mock.openai_base()
        )
    };
    // A node the matrix kills fails its requests once the re-attach wait (1 s) passed.
    format!(
        r#"
dispatch: {{reattach_wait_sec: 1}}
auth:
  keys:
{keys}nodes:
  - id: n1
    token: token-n1-0123456789
    providers: [{oa1}, {cli1}]
  - id: n2
    token: token-n2-0123456789
    providers: [{oa2}, {cli2}]
model_groups:
  - {{name: t-ok, members: [{{node: n1, provider: oa, model: mock-model}}]}}
  - {{name: t-fail, members: [{{node: n1, provider: oa, model: fail-500}}]}}
  - {{name: t-slow, members: [{{node: n1, provider: oa, model: slow}}]}}
  - {{name: c-ok, members: [{{node: n1, provider: cli, model: ok}}]}}
  - {{name: c-fail, members: [{{node: n1, provider: cli, model: fail}}]}}
  - {{name: c-slow, members: [{{node: n1, provider: cli, model: slow}}]}}
  - {{name: t-before, members: [{{node: n2, provider: oa2, model: mock-model}}], queue: {{wait_for_reconnect_sec: 60, timeout_sec: 60}}}}
  - {{name: t-after, members: [{{node: n2, provider: oa2, model: slow}}]}}
  - {{name: c-before, members: [{{node: n2, provider: cli2, model: ok}}], queue: {{wait_for_reconnect_sec: 60, timeout_sec: 60}}}}
  - {{name: c-after, members: [{{node: n2, provider: cli2, model: slow}}]}}
"#,
        oa1 = oa("oa"),
        cli1 = cli("cli"),
        oa2 = oa("oa2"),
        cli2 = cli("cli2"),
    )
}

async fn setup() -> Setup {
    let dir = tempdir();
    let path = dir.path().to_path_buf();
    std::fs::write(path.join("counting.sh"), COUNTING).unwrap();
    std::fs::write(path.join("calls"), "").unwrap();
    let mock = start_mock(&[]).await;
    let edge = start_edge(&path, &config(&mock, &path)).await;
    let n1 = start_node("n1", &path, &edge.nodes, "token-n1-0123456789", "");
    let n2 = start_node("n2", &path, &edge.nodes, "token-n2-0123456789", "");
    wait_ready(&edge, "n1").await;
    wait_ready(&edge, "n2").await;
    Setup {
        calls: path.join("calls"),
        dir: path,
        _dir: dir,
        mock,
        edge,
        _n1: n1,
        n2: Some(n2),
    }
}

impl Setup {
    /// What the provider of `kind` received so far.
    async fn provider_count(&self, kind: Kind) -> u64 {
        match kind {
            Kind::Tunnel => self.mock.stats().await["requests"].as_u64().unwrap(),
            Kind::Run => std::fs::read_to_string(&self.calls)
                .unwrap()
                .lines()
                .count() as u64,
        }
    }

    /// Waits until the provider of `kind` received `n` requests.
    async fn wait_provider(&self, kind: Kind, n: u64) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while self.provider_count(kind).await < n {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the provider never got request {n}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    async fn restart_n2(&mut self) {
        if let Some(mut n2) = self.n2.take() {
            n2.kill9();
        }
        self.n2 = Some(start_node(
            "n2",
            &self.dir,
            &self.edge.nodes,
            "token-n2-0123456789",
            "",
        ));
        wait_ready(&self.edge, "n2").await;
    }

    fn n2(&self) -> &Proc {
        self.n2.as_ref().expect("n2 runs")
    }
}

/// The request counter of `(group, path, outcome)` in `/metrics`.
async fn metric(edge: &EdgeProc, group: &str, path: &str, outcome: &str) -> f64 {
    let text = admin_get(edge, "/metrics").await.text().await.unwrap();
    let series = format!(
        "iop_requests_total{{model_group=\"{group}\",path=\"{path}\",outcome=\"{outcome}\"}}"
    );
    text.lines()
        .find_map(|l| l.strip_prefix(&series))
        .map_or(0.0, |v| v.trim().parse().unwrap())
}

/// The newest ledger records of `key` (the record of a request is written once its
/// response ended; this waits for `n`).
async fn records(edge: &EdgeProc, key_name: &str, n: usize) -> Vec<Value> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let path = format!("/admin/usage/records?key={key_name}&limit=1000");
        let body: Value = admin_get(edge, &path).await.json().await.unwrap();
        let records = body["records"].as_array().unwrap().clone();
        if records.len() >= n {
            return records;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} of {n} records of {key_name}: {body}",
            records.len()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Where key `name` stands against its limits (`/admin/status`).
async fn key_usage(edge: &EdgeProc, name: &str) -> Value {
    let s = status(edge).await;
    s["keys"]
        .as_array()
        .unwrap()
        .iter()
        .find(|k| k["name"] == name)
        .unwrap_or_else(|| panic!("no key {name} in {s}"))
        .clone()
}

/// What the client saw.
#[derive(Debug)]
struct Seen {
    status: u16,
    body: String,
    error_header: Option<String>,
}

async fn send(edge: &EdgeProc, surface: Surface, key: &str, body: &Value) -> reqwest::Response {
    client()
        .post(edge.url(surface.path()))
        .bearer_auth(key)
        .json(body)
        .send()
        .await
        .unwrap()
}

async fn seen(response: reqwest::Response) -> Seen {
    let status = response.status().as_u16();
    let error_header = response
        .headers()
        .get("x-iop-error")
        .map(|v| v.to_str().unwrap().to_string());
    let body = response.text().await.unwrap_or_default();
    Seen {
        status,
        body,
        error_header,
    }
}

fn member(kind: Kind, behaviour: &str) -> Member {
    let (prefix, provider, node) = match (kind, behaviour) {
        (Kind::Tunnel, "before" | "after") => ("t", "oa2", "n2"),
        (Kind::Run, "before" | "after") => ("c", "cli2", "n2"),
        (Kind::Tunnel, _) => ("t", "oa", "n1"),
        (Kind::Run, _) => ("c", "cli", "n1"),
    };
    let target = match (kind, behaviour) {
        (Kind::Tunnel, "ok" | "before") => "mock-model",
        (Kind::Tunnel, "fail") => "fail-500",
        (Kind::Tunnel, _) => "slow",
        (Kind::Run, "ok" | "before") => "ok",
        (Kind::Run, "fail") => "fail",
        (Kind::Run, _) => "slow",
    };
    Member {
        group: format!("{prefix}-{behaviour}"),
        node,
        provider,
        target,
    }
}

/// Whether a cell applies: embeddings are not streamed, not served by runs and not slow,
/// and a node run named by the client has no group to wait for its node.
fn applies(surface: Surface, kind: Kind, outcome: Outcome) -> bool {
    match (surface, outcome) {
        (_, Outcome::Leaves) => surface.streams(),
        (Surface::Embeddings, Outcome::LostBeforeAccept | Outcome::LostAfterAccept) => false,
        (Surface::Embeddings, _) => kind == Kind::Tunnel,
        (Surface::Runs, Outcome::LostBeforeAccept) => false,
        _ => true,
    }
}

/// The ledger's group of a cell: a run is recorded under its `node/adapter`.
fn ledger_group(surface: Surface, member: &Member) -> String {
    if surface == Surface::Runs {
        format!("{}/{}", member.node, member.provider)
    } else {
        member.group.clone()
    }
}

fn metric_group(surface: Surface, member: &Member) -> String {
    if surface == Surface::Runs {
        "(none)".into()
    } else {
        member.group.clone()
    }
}

/// One cell: sends what the outcome needs, and checks that the client's answer, the
/// ledger, the metrics, the key's counters and the provider agree.
async fn cell(s: &mut Setup, surface: Surface, kind: Kind, outcome: Outcome, limited: &mut usize) {
    let behaviour = match outcome {
        Outcome::Ok | Outcome::OverLimit => "ok",
        Outcome::Leaves => "slow",
        Outcome::ProviderError => "fail",
        Outcome::LostBeforeAccept => "before",
        Outcome::LostAfterAccept => "after",
    };
    let m = member(kind, behaviour);
    let body = surface.body(&m.group, &m);
    // A native run is a run whatever its adapter.
    let path = if kind == Kind::Tunnel && surface != Surface::Runs {
        "tunnel"
    } else {
        "run"
    };
    let (key, key_name) = match outcome {
        Outcome::OverLimit => {
            *limited += 1;
            assert!(*limited <= LIMITED_KEYS);
            (
                limited_key(*limited - 1),
                format!("limited-{}", *limited - 1),
            )
        }
        _ => (KEY.to_string(), "matrix".to_string()),
    };
    let records_before = records(&s.edge, &key_name, 0).await.len();
    let usage_before = key_usage(&s.edge, &key_name).await;
    let provider_before = s.provider_count(kind).await;
    let what = format!("{surface:?} × {kind:?} × {outcome:?}");
    let (expected_outcome, status, calls) = match outcome {
        Outcome::Ok => {
            let got = seen(send(&s.edge, surface, &key, &body).await).await;
            assert_eq!(got.status, 200, "{what}: {got:?}");
            assert!(surface.completed(&got.body), "{what}: {}", got.body);
            ("ok", 200, 1)
        }
        Outcome::Leaves => {
            let mut response = send(&s.edge, surface, &key, &body).await;
            assert_eq!(response.status(), 200, "{what}");
            let mut read = String::new();
            read_until(&mut response, &mut read, |b| surface.has_output(b)).await;
            drop(response);
            ("client_abort", 200, 1)
        }
        Outcome::ProviderError => {
            let got = seen(send(&s.edge, surface, &key, &body).await).await;
            let reason = match kind {
                Kind::Tunnel => "provider_error",
                Kind::Run => "cli_exit",
            };
            if got.status == 200 {
                // The program started its answer: the error ends the stream.
                assert!(surface.streams(), "{what}: {got:?}");
                assert!(surface.ended_in_error(&got.body), "{what}: {}", got.body);
            } else {
                assert!(got.status >= 500, "{what}: {got:?}");
                error_message(surface.shape(), &got.body);
                assert_eq!(got.error_header.as_deref(), Some(reason), "{what}: {got:?}");
            }
            (reason, got.status, 1)
        }
        Outcome::LostBeforeAccept => {
            // The node is stopped when the request reaches it, and killed: nothing was
            // accepted, so the request waits for the node to return and runs once.
            s.n2().signal(nix::sys::signal::Signal::SIGSTOP);
            let request = tokio::spawn({
                let url = s.edge.url(surface.path());
                let key = key.clone();
                let body = body.clone();
                async move { post(url, &key, &body).await }
            });
            wait_status(
                &s.edge,
                Duration::from_secs(20),
                "the request sent to n2",
                |st| provider_of(st, "n2", m.provider)["in_flight"]["normal"] == 1,
            )
            .await;
            s.n2.as_mut().unwrap().kill9();
            s.restart_n2().await;
            let got = tokio::time::timeout(Duration::from_secs(30), request)
                .await
                .unwrap()
                .unwrap();
            assert_eq!(got.status, 200, "{what}: {got:?}");
            assert!(surface.completed(&got.body), "{what}: {}", got.body);
            ("ok", 200, 1)
        }
        Outcome::LostAfterAccept => {
            // The provider has the request (and the client its first output) when the
            // node dies: the edge must not send it again.
            let status = if surface.streams() {
                let mut response = send(&s.edge, surface, &key, &body).await;
                assert_eq!(response.status(), 200, "{what}");
                let mut read = String::new();
                read_until(&mut response, &mut read, |b| surface.has_output(b)).await;
                s.wait_provider(kind, provider_before + 1).await;
                s.n2.as_mut().unwrap().kill9();
                read_to_end(&mut response, &mut read, Duration::from_secs(20)).await;
                assert!(surface.ended_in_error(&read), "{what}: {read}");
                assert!(
                    read.contains("node_disconnected") || read.contains("connection lost"),
                    "{what}: {read}"
                );
                200
            } else {
                let request = tokio::spawn({
                    let url = s.edge.url(surface.path());
                    let key = key.clone();
                    let body = body.clone();
                    async move {
                        let response = client().post(url).bearer_auth(key).json(&body).send();
                        seen(response.await.unwrap()).await
                    }
                });
                s.wait_provider(kind, provider_before + 1).await;
                // The node acknowledges within 10 ms of sending it to the provider.
                tokio::time::sleep(Duration::from_millis(500)).await;
                s.n2.as_mut().unwrap().kill9();
                let got = tokio::time::timeout(Duration::from_secs(20), request)
                    .await
                    .unwrap()
                    .unwrap();
                assert_eq!(got.status, 503, "{what}: {got:?}");
                assert_eq!(
                    got.error_header.as_deref(),
                    Some("node_disconnected"),
                    "{what}"
                );
                let message = error_message(surface.shape(), &got.body);
                assert!(message.contains("connection lost"), "{what}: {message}");
                503
            };
            s.restart_n2().await;
            ("node_disconnected", status, 1)
        }
        Outcome::OverLimit => {
            let first = seen(send(&s.edge, surface, &key, &body).await).await;
            assert_eq!(first.status, 200, "{what}: {first:?}");
            let got = seen(send(&s.edge, surface, &key, &body).await).await;
            assert_eq!(got.status, 429, "{what}: {got:?}");
            error_message(surface.shape(), &got.body);
            assert_eq!(
                got.error_header.as_deref(),
                Some("requests_per_minute_exceeded"),
                "{what}"
            );
            ("requests_per_minute_exceeded", 429, 1)
        }
    };
    // The ledger: one record per request, the newest first.
    let sent = if outcome == Outcome::OverLimit { 2 } else { 1 };
    let all = records(&s.edge, &key_name, records_before + sent).await;
    assert_eq!(all.len(), records_before + sent, "{what}: {all:?}");
    let r = &all[0];
    assert_eq!(r["outcome"], expected_outcome, "{what}: {r}");
    assert_eq!(r["status"], status, "{what}: {r}");
    assert_eq!(r["api"], surface.api(), "{what}: {r}");
    assert_eq!(r["group"], ledger_group(surface, &m), "{what}: {r}");
    if outcome != Outcome::OverLimit {
        assert_eq!(r["path"], path, "{what}: {r}");
        // Tokens: reported, or — where the provider reported none — estimated, and more
        // than none whenever output was relayed.
        let reported = r["input_tokens"].as_u64().unwrap() + r["output_tokens"].as_u64().unwrap();
        let estimated = r["est_input_tokens"].as_u64().unwrap_or(0)
            + r["est_output_tokens"].as_u64().unwrap_or(0);
        assert!(reported > 0 || estimated > 0, "{what}: {r}");
        if outcome == Outcome::Leaves && reported == 0 {
            assert!(r["est_output_tokens"].as_u64().unwrap() > 0, "{what}: {r}");
        }
    }
    // The metrics: the same outcome.
    let group = metric_group(surface, &m);
    let metric_path = if outcome == Outcome::OverLimit {
        "none"
    } else {
        path
    };
    let counted = metric(&s.edge, &group, metric_path, expected_outcome).await;
    assert!(
        counted >= 1.0,
        "{what}: {group} {metric_path} {expected_outcome} = {counted}"
    );
    // The key: nothing in flight or reserved any more, its tokens counted.
    let usage = key_usage(&s.edge, &key_name).await;
    assert_eq!(usage["in_flight"], 0, "{what}: {usage}");
    assert_eq!(usage["tokens_reserved"], 0, "{what}: {usage}");
    if key_name == "matrix" {
        let billed = r["input_tokens"].as_u64().unwrap() + r["output_tokens"].as_u64().unwrap();
        let billed = if billed > 0 {
            billed
        } else {
            r["est_input_tokens"].as_u64().unwrap_or(0)
                + r["est_output_tokens"].as_u64().unwrap_or(0)
        };
        assert_eq!(
            usage["tokens_today"].as_u64().unwrap(),
            usage_before["tokens_today"].as_u64().unwrap() + billed,
            "{what}: {usage} {r}"
        );
    }
    // The provider: exactly the requests that were to reach it, also a while later.
    if outcome == Outcome::LostAfterAccept {
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert_eq!(
        s.provider_count(kind).await,
        provider_before + calls,
        "{what}: the provider's count"
    );
    wait_idle(&s.edge).await;
}

async fn matrix(kind: Kind) {
    let mut s = setup().await;
    let mut limited = 0;
    for surface in SURFACES {
        for outcome in [
            Outcome::Ok,
            Outcome::Leaves,
            Outcome::ProviderError,
            Outcome::LostBeforeAccept,
            Outcome::LostAfterAccept,
            Outcome::OverLimit,
        ] {
            if applies(surface, kind, outcome) {
                cell(&mut s, surface, kind, outcome, &mut limited).await;
            }
        }
    }
    // Embeddings are not served by run adapters: refused in the API's shape, nothing sent.
    if kind == Kind::Run {
        let m = member(Kind::Run, "ok");
        let before = s.provider_count(kind).await;
        let got = seen(
            send(
                &s.edge,
                Surface::Embeddings,
                KEY,
                &Surface::Embeddings.body(&m.group, &m),
            )
            .await,
        )
        .await;
        assert_eq!(got.status, 400, "{got:?}");
        assert!(error_message(Shape::OpenAi, &got.body).contains("embeddings"));
        assert_eq!(s.provider_count(kind).await, before);
    }
}

#[tokio::test]
async fn every_surface_agrees_on_every_outcome_with_a_tunnelled_member() {
    matrix(Kind::Tunnel).await;
}

#[tokio::test]
async fn every_surface_agrees_on_every_outcome_with_a_run_member() {
    matrix(Kind::Run).await;
}

/// An edge with `keys` (YAML list entries) and one node `n1` with `providers`, serving
/// `groups`; returns the edge, the node and the mock provider behind it.
async fn small_edge(
    dir: &Path,
    keys: &str,
    providers: &str,
    groups: &str,
) -> (EdgeProc, Proc, MockProc) {
    let mock = start_mock(&[]).await;
    let providers = providers
        .replace("{oa}", &mock.openai_base())
        .replace("{dir}", &dir.display().to_string());
    let config = format!(
        "auth:\n  keys:\n    - {{name: ops, role: admin, key: {TEST_API_KEY}}}\n{keys}nodes:\n  - id: n1\n    token: token-n1-0123456789\n    providers:\n{providers}model_groups:\n{groups}"
    );
    let edge = start_edge(dir, &config).await;
    let node = start_node("n1", dir, &edge.nodes, "token-n1-0123456789", "");
    wait_ready(&edge, "n1").await;
    (edge, node, mock)
}

/// What a client saw of `POST url` with `body` and `key`.
async fn post(url: String, key: &str, body: &Value) -> Seen {
    let response = client().post(url).bearer_auth(key).json(body).send();
    seen(response.await.unwrap()).await
}

async fn post_run(edge: &EdgeProc, key: &str, body: Value) -> Seen {
    post(edge.url("/v1/runs"), key, &body).await
}

#[tokio::test]
async fn runs_obey_the_keys_limits_and_model_allowlist() {
    let dir = tempdir();
    let keys = "    - {name: rpm, role: client, key: sk-rpm-0123456789abc, limits: {requests_per_minute: 3}}\n    - {name: two, role: client, key: sk-two-0123456789abc, limits: {max_concurrent: 2}}\n    - {name: echo-only, role: client, key: sk-echo-0123456789abc, models: [echo]}\n";
    let providers = "      - {id: m, kind: mock, mock: {tokens: 3}}\n      - {id: slow, kind: mock, capacity: {normal: 8}, mock: {tokens: 200, token_delay_ms: 25}}\n      - {id: oa, kind: openai_compat, base_url: \"{oa}\"}\n";
    let groups = "  - {name: echo, members: [{node: n1, provider: m, model: echo-model}]}\n";
    let (edge, _node, mock) = small_edge(dir.path(), keys, providers, groups).await;
    let run =
        |adapter: &str, target: &str| json!({"adapter": adapter, "target": target, "input": "hi"});
    // requests_per_minute: 3 runs, then 429 in OpenAI's shape naming the limit.
    for i in 0..4 {
        let got = post_run(&edge, "sk-rpm-0123456789abc", run("m", "x")).await;
        if i < 3 {
            assert_eq!(got.status, 200, "{got:?}");
            assert!(got.body.contains("event: complete"), "{got:?}");
        } else {
            assert_eq!(got.status, 429, "{got:?}");
            assert_eq!(
                got.error_header.as_deref(),
                Some("requests_per_minute_exceeded")
            );
            assert!(error_message(Shape::OpenAi, &got.body).contains("3 requests per minute"));
        }
    }
    // max_concurrent: 2 runs at once, the third is refused while they run.
    let mut open = Vec::new();
    for _ in 0..2 {
        let response = client()
            .post(edge.url("/v1/runs"))
            .bearer_auth("sk-two-0123456789abc")
            .json(&run("slow", "x"))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        open.push(response);
    }
    let got = post_run(&edge, "sk-two-0123456789abc", run("slow", "x")).await;
    assert_eq!(got.status, 429, "{got:?}");
    assert_eq!(got.error_header.as_deref(), Some("max_concurrent_exceeded"));
    drop(open);
    wait_status(&edge, Duration::from_secs(10), "the runs given up", |s| {
        s["keys"]
            .as_array()
            .unwrap()
            .iter()
            .any(|k| k["name"] == "two" && k["in_flight"] == 0)
    })
    .await;
    assert_eq!(
        post_run(&edge, "sk-two-0123456789abc", run("m", "x"))
            .await
            .status,
        200
    );
    // A key limited to the group `echo` runs what that group reaches and nothing else: not
    // another adapter, not another target on its adapter.
    let echo = "sk-echo-0123456789abc";
    assert_eq!(
        post_run(&edge, echo, run("m", "echo-model")).await.status,
        200
    );
    let requests = mock.stats().await["requests"].as_u64().unwrap();
    for (adapter, target) in [
        ("m", "something-else"),
        ("oa", "echo-model"),
        ("oa", "mock-model"),
    ] {
        let got = post_run(&edge, echo, run(adapter, target)).await;
        assert_eq!(got.status, 403, "{adapter}/{target}: {got:?}");
        assert!(error_message(Shape::OpenAi, &got.body).contains("may not run"));
    }
    assert_eq!(
        mock.stats().await["requests"].as_u64().unwrap(),
        requests,
        "nothing ran"
    );
    // Every run is in the ledger, refusals included.
    let records = records(&edge, "rpm", 4).await;
    let outcomes: Vec<&str> = records
        .iter()
        .map(|r| r["outcome"].as_str().unwrap())
        .collect();
    assert_eq!(outcomes, ["requests_per_minute_exceeded", "ok", "ok", "ok"]);
    assert!(records.iter().all(|r| r["api"] == "runs"));
    wait_idle(&edge).await;
}

#[tokio::test]
async fn a_budget_burst_overruns_by_at_most_one_reservation() {
    let dir = tempdir();
    const BUDGET: u64 = 300;
    let keys = format!(
        "    - {{name: budget, role: client, key: sk-budget-0123456789a, limits: {{tokens_per_day: {BUDGET}}}}}\n"
    );
    let providers =
        "      - {id: oa, kind: openai_compat, base_url: \"{oa}\", capacity: {normal: 64}}\n";
    let groups = "  - {name: g, members: [{node: n1, provider: oa, model: mock-model}]}\n";
    let (edge, _node, _mock) = small_edge(dir.path(), &keys, providers, groups).await;
    let body = json!({"model": "g", "max_tokens": 10, "messages": [{"role": "user", "content": "count to ten"}]});
    let burst = futures::future::join_all((0..60).map(|_| {
        let url = edge.url("/v1/chat/completions");
        let body = body.clone();
        async move {
            let r = client()
                .post(url)
                .bearer_auth("sk-budget-0123456789a")
                .json(&body)
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            let v: Value = r.json().await.unwrap();
            (status, v)
        }
    }))
    .await;
    let served: Vec<&Value> = burst
        .iter()
        .filter(|(s, _)| *s == 200)
        .map(|(_, v)| v)
        .collect();
    let refused = burst.iter().filter(|(s, _)| *s == 429).count();
    assert_eq!(served.len() + refused, 60, "{burst:?}");
    assert!(
        refused > 0,
        "a burst of 60 must hit a {BUDGET}-token budget"
    );
    let used: u64 = served
        .iter()
        .map(|v| v["usage"]["total_tokens"].as_u64().unwrap())
        .sum();
    // The documented bound: below the budget plus one request's reservation (its
    // estimated input and its max_tokens), each request using no more than it reserved.
    let messages = body["messages"].to_string().len() as u64;
    let reservation = messages.div_ceil(4) + 10;
    assert!(
        used < BUDGET + reservation,
        "{used} tokens used of a {BUDGET} budget (one reservation: {reservation})"
    );
    let usage = key_usage(&edge, "budget").await;
    assert_eq!(usage["tokens_today"].as_u64().unwrap(), used, "{usage}");
    assert_eq!(usage["tokens_reserved"], 0, "{usage}");
}

#[tokio::test]
async fn an_adapter_panic_ends_its_run_with_an_error_and_the_node_goes_on() {
    let dir = tempdir();
    let providers = "      - {id: m, kind: mock, mock: {tokens: 3}}\n";
    let groups = "  - {name: panics, members: [{node: n1, provider: m, model: mock-panic}]}\n  - {name: fine, members: [{node: n1, provider: m, model: fine}]}\n";
    let (edge, node, _mock) = small_edge(dir.path(), "", providers, groups).await;
    let got = post_run(
        &edge,
        TEST_API_KEY,
        json!({"adapter": "m", "target": "mock-panic", "input": "hi"}),
    )
    .await;
    assert_eq!(got.status, 200, "{got:?}");
    assert!(got.body.contains("event: error"), "{got:?}");
    assert!(got.body.contains("panicked"), "{got:?}");
    for stream in [false, true] {
        let response = client()
            .post(edge.url("/v1/chat/completions"))
            .bearer_auth(TEST_API_KEY)
            .json(&json!({"model": "panics", "stream": stream, "messages": [{"role": "user", "content": "hi"}]}))
            .send();
        let got = tokio::time::timeout(Duration::from_secs(10), async {
            seen(response.await.unwrap()).await
        })
        .await
        .expect("a panicking adapter must not leave the request hanging");
        if stream {
            assert!(got.body.contains("\"code\":\"internal\""), "{got:?}");
        } else {
            assert_eq!(got.status, 500, "{got:?}");
        }
    }
    // The node and its capacity are fine.
    let got = seen(
        client()
            .post(edge.url("/v1/chat/completions"))
            .bearer_auth(TEST_API_KEY)
            .json(&json!({"model": "fine", "messages": [{"role": "user", "content": "hi"}]}))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(got.status, 200, "{got:?}");
    assert!(node.has_line("panicked"), "{}", node.log());
    wait_idle(&edge).await;
}

#[tokio::test]
async fn a_nodes_own_shutdown_reaches_clients_and_the_ledger_as_node_disconnected() {
    let dir = tempdir();
    let providers = "      - {id: slow, kind: mock, mock: {tokens: 400, token_delay_ms: 25}}\n      - {id: oa, kind: openai_compat, base_url: \"{oa}\"}\n";
    let groups = "  - {name: run, members: [{node: n1, provider: slow}]}\n  - {name: tunnel, members: [{node: n1, provider: oa, model: slow}]}\n";
    let (mut edge, node, _mock) = small_edge(dir.path(), "", providers, groups).await;
    let mut node = Some(node);
    for (i, group) in ["run", "tunnel"].into_iter().enumerate() {
        let mut response = client()
            .post(edge.url("/v1/chat/completions"))
            .bearer_auth(TEST_API_KEY)
            .json(&json!({"model": group, "stream": true, "messages": [{"role": "user", "content": "hi"}]}))
            .send()
            .await
            .unwrap();
        let mut read = String::new();
        read_until(&mut response, &mut read, |b| {
            b.matches("data: ").count() >= 3
        })
        .await;
        let n = node.take().unwrap();
        n.signal(nix::sys::signal::Signal::SIGTERM);
        read_to_end(&mut response, &mut read, Duration::from_secs(20)).await;
        assert!(
            read.contains("\"code\":\"node_disconnected\""),
            "{group}: {read}"
        );
        assert!(!read.contains("cancelled by the edge"), "{group}: {read}");
        let records = records(&edge, "ops", i + 1).await;
        assert_eq!(
            records[0]["outcome"], "node_disconnected",
            "{group}: {}",
            records[0]
        );
        drop(n);
        node = Some(start_node(
            "n1",
            dir.path(),
            &edge.nodes,
            "token-n1-0123456789",
            "",
        ));
        wait_ready(&edge, "n1").await;
    }
    let _ = &mut edge;
}

#[tokio::test]
async fn a_429_cools_its_member_down_and_retries_do_not_steer_first_attempts() {
    let dir = tempdir();
    let providers = "      - {id: limited, kind: openai_compat, base_url: \"{oa}\"}\n      - {id: fine, kind: openai_compat, base_url: \"{oa}\"}\n";
    let groups = "  - {name: g, members: [{node: n1, provider: limited, model: rate-limit-429}, {node: n1, provider: fine, model: mock-model}]}\n";
    let (edge, _node, mock) = small_edge(dir.path(), "", providers, groups).await;
    let mut retried = 0;
    for _ in 0..8 {
        let response = client()
            .post(edge.url("/v1/chat/completions"))
            .bearer_auth(TEST_API_KEY)
            .json(&json!({"model": "g", "messages": [{"role": "user", "content": "hi"}]}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        if response.headers()["x-iop-attempts"] != "1" {
            retried += 1;
        }
    }
    // The first request may meet the 429 first; the member then cools down for its
    // Retry-After (30 s), so the next ones go to the other member at once.
    assert!(
        retried <= 1,
        "{retried} of 8 requests needed a second attempt"
    );
    assert!(mock.stats().await["requests"].as_u64().unwrap() <= 9);
    let s = status(&edge).await;
    let limited = provider_of(&s, "n1", "limited");
    assert!(limited.get("ejected").is_none(), "a 429 never ejects: {s}");
    assert!(
        limited["cooling_down"]["remaining_sec"].as_f64().unwrap() > 0.0,
        "{s}"
    );
}

const SESSION: &str = r#"last=""
while IFS= read -r line; do
  if [ "$line" = "<<<IOP-END>>>" ]; then
    echo "said: $last"
    echo "<<<IOP-END>>>"
  else
    last="$line"
  fi
done
"#;

#[tokio::test]
async fn one_key_cannot_take_every_cli_session_from_the_others() {
    let dir = tempdir();
    std::fs::write(dir.path().join("session.sh"), SESSION).unwrap();
    let keys = "    - {name: alice, role: client, key: sk-alice-0123456789ab}\n    - {name: bob, role: client, key: sk-bob-0123456789abcd}\n";
    let providers = "      - {id: chat, kind: cli, cli: {argv: [sh, \"{dir}/session.sh\"], max_sessions: 4, max_sessions_per_key: 2}}\n";
    let (edge, _node, _mock) = small_edge(dir.path(), keys, providers, "").await;
    let turn = |session: &str| json!({"adapter": "chat", "target": "t", "input": "hi", "session_id": session});
    for s in ["a1", "a2"] {
        let got = post_run(&edge, "sk-alice-0123456789ab", turn(s)).await;
        assert!(got.body.contains("event: complete"), "{got:?}");
    }
    let got = post_run(&edge, "sk-alice-0123456789ab", turn("a3")).await;
    assert!(got.body.contains("session_limit"), "{got:?}");
    assert!(got.body.contains("max_sessions_per_key"), "{got:?}");
    // Bob's sessions are his own, under the adapter's cap.
    for s in ["b1", "b2"] {
        let got = post_run(&edge, "sk-bob-0123456789abcd", turn(s)).await;
        assert!(got.body.contains("event: complete"), "{got:?}");
    }
}

#[tokio::test]
async fn a_link_dropped_after_accept_never_sends_the_request_again() {
    // A slow provider (5 s per answer) behind a node whose link to the edge can be cut;
    // the group waits for a reconnect, so an edge that retried would send it again.
    let dir = tempdir();
    let mock = start_mock(&["--tokens", "100", "--token-delay-ms", "50"]).await;
    let config = format!(
        "auth:\n  keys:\n    - {{name: ops, role: admin, key: {TEST_API_KEY}}}\nnodes:\n  - id: n1\n    token: token-n1-0123456789\n    providers:\n      - {{id: oa, kind: openai_compat, base_url: \"{}\"}}\nmodel_groups:\n  - {{name: g, members: [{{node: n1, provider: oa, model: mock-model}}], queue: {{wait_for_reconnect_sec: 30, timeout_sec: 30}}}}\n",
        mock.openai_base()
    );
    let edge = start_edge(dir.path(), &config).await;
    let proxy = CuttableProxy::start(&edge.nodes).await;
    let _node = start_node(
        "n1",
        dir.path(),
        &proxy.addr,
        "token-n1-0123456789",
        "reconnect: {max_attempts: 0, interval_sec: 1}",
    );
    wait_ready(&edge, "n1").await;
    for stream in [false, true] {
        let before = mock.stats().await["requests"].as_u64().unwrap();
        let body = json!({"model": "g", "stream": stream, "messages": [{"role": "user", "content": "hi"}]});
        let mut request = Some(tokio::spawn(
            client()
                .post(edge.url("/v1/chat/completions"))
                .bearer_auth(TEST_API_KEY)
                .json(&body)
                .send(),
        ));
        // The provider has the request (a stream: the client has its first tokens).
        let mut read = String::new();
        let response = if stream {
            let mut response = request.take().unwrap().await.unwrap().unwrap();
            read_until(&mut response, &mut read, |b| b.contains("\"content\"")).await;
            Some(response)
        } else {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
            while mock.stats().await["requests"].as_u64().unwrap() == before {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "the provider never got it"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            // The node acknowledges within 10 ms of sending it to the provider (a node
            // lost inside those 10 ms is lost before accept, and failed over).
            tokio::time::sleep(Duration::from_millis(500)).await;
            None
        };
        proxy.cut();
        let (status, attempts, ended) = match response {
            Some(mut response) => {
                read_to_end(&mut response, &mut read, Duration::from_secs(20)).await;
                (200, "1".to_string(), read)
            }
            None => {
                let response =
                    tokio::time::timeout(Duration::from_secs(20), request.take().unwrap())
                        .await
                        .unwrap_or_else(|_| {
                            panic!(
                                "the client gets an answer once the link is gone; edge log:\n{}",
                                edge.proc.log()
                            )
                        })
                        .unwrap()
                        .unwrap();
                let attempts = response.headers()["x-iop-attempts"]
                    .to_str()
                    .unwrap()
                    .to_string();
                let status = response.status().as_u16();
                (status, attempts, response.text().await.unwrap())
            }
        };
        assert!(
            ended.contains("node_disconnected"),
            "stream {stream}: {ended}"
        );
        if !stream {
            assert_eq!((status, attempts.as_str()), (503, "1"), "{ended}");
        }
        proxy.restore();
        wait_ready(&edge, "n1").await;
        wait_idle(&edge).await;
        assert_eq!(
            mock.stats().await["requests"].as_u64().unwrap(),
            before + 1,
            "stream {stream}: the provider got the request once"
        );
    }
}
