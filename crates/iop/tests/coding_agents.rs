//! The real coding agents through translated groups, as their users run them: Claude Code
//! (`claude -p`, Anthropic Messages translated to chat) and Codex (`codex exec`, Responses
//! translated to chat), pinned in `tests/node/package-lock.json`.
//!
//! - Against `iop demo`, each completes a turn with a tool call: the demo's model calls a
//!   tool the agent offers, the agent runs it and sends the result back, the model answers.
//! - Against a real llama-server (the conformance suite's tiny model), each completes a
//!   prompt through an `openai_compat` member whose Messages and Responses are translated
//!   to the server's chat API with every tool the agent offers, and through one that
//!   serves both APIs itself (the agent's requests reach the server as they are).
//!
//! Every request an agent makes goes through a recording proxy, and every one must get a
//! 2xx; the agent must exit 0.

mod common;

use std::time::Duration;

use common::agents::{self, AgentRun};
use common::real_backend::start_llama_server;
use common::recorder::{Exchange, Recorder};
use common::sdk::Demo;
use common::*;

/// What one agent run may take on a busy machine.
const WITHIN: Duration = Duration::from_secs(300);

/// Every exchange got a 2xx, and there was at least one model request to `path`.
fn assert_all_2xx(exchanges: &[Exchange], path: &str, run: &AgentRun) {
    let listing: Vec<String> = exchanges.iter().map(ToString::to_string).collect();
    assert!(
        exchanges.iter().all(|e| (200..300).contains(&e.status)),
        "a request was refused: {listing:#?}\n{}\n{run}",
        exchanges
            .iter()
            .filter(|e| e.status >= 300)
            .map(|e| format!("{e}: {}", e.response_text()))
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert!(
        exchanges.iter().any(|e| e.path.starts_with(path)),
        "no request to {path}: {listing:#?}\n{run}"
    );
}

/// An answer to a `path` request called a tool (`call` appears in it), and a later
/// request sent the tool's result back (`result` appears in it).
fn assert_tool_round_trip(exchanges: &[Exchange], path: &str, call: &str, result: &str) {
    let model: Vec<&Exchange> = exchanges
        .iter()
        .filter(|e| e.path.starts_with(path))
        .collect();
    let called = model
        .iter()
        .position(|e| e.response_text().contains(call))
        .unwrap_or_else(|| panic!("no answer called a tool ({call}): {model:#?}"));
    assert!(
        model[called + 1..]
            .iter()
            .any(|e| e.request_text().contains(result)),
        "no request after the call sent its result ({result})"
    );
}

/// The two agents, each with what it speaks and how a user would prompt it to use a tool.
#[derive(Clone, Copy, Debug)]
enum Agent {
    ClaudeCode,
    Codex,
}

impl Agent {
    fn program(self) -> &'static str {
        match self {
            Agent::ClaudeCode => "claude",
            Agent::Codex => "codex",
        }
    }

    /// The endpoint its model requests go to.
    fn path(self) -> &'static str {
        match self {
            Agent::ClaudeCode => "/v1/messages",
            Agent::Codex => "/v1/responses",
        }
    }

    /// What an answer calling a tool holds, and a request sending its result back.
    fn round_trip(self) -> (&'static str, &'static str) {
        match self {
            Agent::ClaudeCode => ("\"tool_use\"", "\"tool_result\""),
            Agent::Codex => ("\"function_call\"", "\"function_call_output\""),
        }
    }

    /// Runs it against the edge at `root` (`http://host:port`) with model `model`.
    async fn run(self, program: &std::path::Path, root: &str, model: &str) -> AgentRun {
        let home = tempdir();
        match self {
            Agent::ClaudeCode => {
                let prompt = "List the files in this directory with the Bash tool.";
                agents::claude(program, home.path(), root, model, prompt, WITHIN).await
            }
            Agent::Codex => {
                let base = format!("{root}/v1");
                let prompt = "List the files here with exec_command.";
                agents::codex(program, home.path(), &base, model, prompt, WITHIN).await
            }
        }
    }
}

/// `agent` against the demo: exit 0, every request 2xx, a tool round trip.
async fn calls_a_tool_through_the_demo(agent: Agent) {
    let test = format!("{agent:?} against the demo");
    let Some(program) = agents::program(&test, agent.program()) else {
        return;
    };
    let demo = Demo::start().await;
    let recorder = Recorder::start(&demo.root).await;
    let run = agent.run(&program, &recorder.url, "mock").await;
    let exchanges = recorder.exchanges();
    assert!(run.success, "{run}\n{exchanges:#?}");
    assert_all_2xx(&exchanges, agent.path(), &run);
    let (call, result) = agent.round_trip();
    assert_tool_round_trip(&exchanges, agent.path(), call, result);
}

#[tokio::test]
async fn claude_code_calls_a_tool_through_the_demo() {
    calls_a_tool_through_the_demo(Agent::ClaudeCode).await;
}

#[tokio::test]
async fn codex_calls_a_tool_through_the_demo() {
    calls_a_tool_through_the_demo(Agent::Codex).await;
}

/// An edge and a node in front of a llama-server of its own with room for an agent's
/// prompt (over ten thousand of the tiny model's tokens) whose answers end at once; the
/// group `tiny` is an `openai_compat` member, so Messages and Responses are translated.
struct RealBackend {
    edge: EdgeProc,
    _node: Proc,
    _llama: common::real_backend::LlamaServer,
    _dir: tempfile::TempDir,
}

async fn real_backend(suite: &str) -> Option<RealBackend> {
    let (server, model) = common::real_backend::from_env(suite)?;
    let dir = tempdir();
    let llama = start_llama_server(
        "llama-server",
        &server,
        &[
            "--model",
            model.to_str().unwrap(),
            "--alias",
            "tiny",
            "--ctx-size",
            "131072",
            // The model was made with a 4096-token context, which the server would cap
            // a slot to; an agent's prompt is over 12,000 of its tokens.
            "--override-kv",
            "llama.context_length=int:131072",
            "--parallel",
            "1",
            // The tiny model never ends an answer by itself (the conformance suite relies on
            // that), and an agent takes an answer cut at its length limit as an error: here
            // the end-of-turn token (`<|im_end|>`, id 2) wins, so each answer is an empty
            // end of turn.
            "--logit-bias",
            "2+100",
            "--no-warmup",
        ],
    )
    .await;
    // `tiny` translates Messages and Responses to chat; `tiny-native` sends them to the
    // server as they are (it serves both APIs itself). One slot: they take turns.
    let config = format!(
        r#"
nodes:
  - id: n1
    token: token-n1-0123456789
    providers:
      - {{id: llama, kind: openai_compat, base_url: "{base}", capacity: {{normal: 1, long: 0}}, max_concurrency: 1, request_timeout_sec: 300}}
      - {{id: native, kind: openai_compat, base_url: "{base}", capacity: {{normal: 1, long: 0}}, max_concurrency: 1, request_timeout_sec: 300, apis: [chat, completions, embeddings, responses, messages]}}
model_groups:
  - {{name: tiny, members: [{{node: n1, provider: llama, model: tiny}}], queue: {{max_waiting: 16, timeout_sec: 300}}}}
  - {{name: tiny-native, members: [{{node: n1, provider: native, model: tiny}}], queue: {{max_waiting: 16, timeout_sec: 300}}}}
"#,
        base = llama.base()
    );
    let edge = start_edge(dir.path(), &config).await;
    let node = start_node("n1", dir.path(), &edge.nodes, "token-n1-0123456789", "");
    wait_ready(&edge, "n1").await;
    Some(RealBackend {
        edge,
        _node: node,
        _llama: llama,
        _dir: dir,
    })
}

/// `agent` against llama-server, through the translated group and the native one: exit 0,
/// every request 2xx, and its requests offered the agent's tools (`offered` appears in
/// one).
async fn completes_a_prompt_through_llama_server(agent: Agent, offered: &str) {
    let test = format!("{agent:?} against llama-server");
    let Some(program) = agents::program(&test, agent.program()) else {
        return;
    };
    let Some(backend) = real_backend(&test).await else {
        return;
    };
    for group in ["tiny", "tiny-native"] {
        let recorder = Recorder::start(&backend.edge.url("")).await;
        let run = agent.run(&program, &recorder.url, group).await;
        let exchanges = recorder.exchanges();
        assert!(run.success, "{group}: {run}\n{exchanges:#?}");
        assert_all_2xx(&exchanges, agent.path(), &run);
        assert!(
            exchanges
                .iter()
                .any(|e| e.path.starts_with(agent.path()) && e.request_text().contains(offered)),
            "{group}: the agent offered its tools ({offered})"
        );
    }
}

#[tokio::test]
async fn claude_code_completes_a_prompt_through_llama_server() {
    completes_a_prompt_through_llama_server(Agent::ClaudeCode, "\"Bash\"").await;
}

#[tokio::test]
async fn codex_completes_a_prompt_through_llama_server() {
    // Codex offers a namespace of sub-agent tools, which the translation expands.
    completes_a_prompt_through_llama_server(Agent::Codex, "\"namespace\"").await;
}
