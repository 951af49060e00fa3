//! The docs cannot drift: every shell block of README.md and docs/*.md is run here against
//! real processes, as a user would run it. A block says how in its info string:
//!
//! - ```` ```sh demo ````: the Quick start, against the `iop demo` its first line starts;
//! - ```` ```sh edge ````: "Running it for real" from a fresh clone's `configs/` — the edge,
//!   a node that joins with a join token, one with a static token, then status, a request,
//!   usage and revoke;
//! - ```` ```sh agents ````: the coding agents and aider against a running `iop demo`;
//! - ```` ```sh ci ````: what CI itself runs (`.ci/run` and `scripts/test.sh` are checked
//!   to run each line).
//!
//! A shell block with none of these fails the test; a `console` block is an illustration
//! and is not run. Lines run in order with `bash`; `export` lines carry over; a line that
//! starts `iop demo`, `iop edge` or `iop node` starts a process that stays up (the test
//! waits until it is ready). Only what a reader would fill in is substituted: the
//! documented ports (127.0.0.1:8080 and :7700) by free ones, `edge.example.net:7700`, the
//! example pin and join line by the real ones, `...` by a key or the node's token, and
//! `cargo run --release --bin iop --` by the `iop` this test was built with.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
/// What one command may take on a busy machine.
const WITHIN: Duration = Duration::from_secs(300);
/// The key filled in for `...` (the documented edge has no keys: loopback is open).
const KEY: &str = "sk-docs-0123456789";
/// The token of node `local` in configs/edge.yaml.
const LOCAL_TOKEN: &str = "dev-token-change-me";
const EXAMPLE_JOIN: &str = "iop1:edge.example.net:7700/sha256:3q2-7w.../1f2e3d4c5b6a7980.Vb3-...";
const EXAMPLE_PIN: &str = "sha256:3q2-7w...";

/// One shell block.
#[derive(Debug, Clone)]
struct Block {
    at: String,
    scenario: String,
    /// Its commands, continuation lines joined, comments and blank lines left out.
    commands: Vec<String>,
}

/// Every fenced block of README.md and docs/*.md whose language is a shell, in order.
fn shell_blocks() -> Vec<Block> {
    let mut files = vec![PathBuf::from(ROOT).join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(PathBuf::from(ROOT).join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    let mut blocks = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        let name = file.file_name().unwrap().to_string_lossy().into_owned();
        let mut open: Option<(usize, String, Vec<String>)> = None;
        for (i, line) in text.lines().enumerate() {
            if let Some(info) = line.strip_prefix("```") {
                match open.take() {
                    Some((at, scenario, lines)) => blocks.push(Block {
                        at: format!("{name}:{}", at + 1),
                        scenario,
                        commands: commands(&lines),
                    }),
                    None => {
                        let mut words = info.split_whitespace();
                        let language = words.next().unwrap_or("");
                        if matches!(language, "sh" | "bash" | "shell") {
                            let scenario = words.next().unwrap_or("").to_string();
                            open = Some((i, scenario, Vec::new()));
                        } else {
                            open = Some((i, "-".into(), Vec::new()));
                        }
                    }
                }
            } else if let Some((_, _, lines)) = open.as_mut() {
                lines.push(line.to_string());
            }
        }
    }
    blocks.retain(|b| b.scenario != "-");
    blocks
}

/// A block's commands: continuation lines joined, comment-only and blank lines dropped.
fn commands(lines: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    let mut current = String::new();
    for line in lines {
        let trimmed = line.trim();
        if current.is_empty() && (trimmed.is_empty() || trimmed.starts_with('#')) {
            continue;
        }
        if let Some(head) = line.strip_suffix('\\') {
            current.push_str(head);
            continue;
        }
        current.push_str(line);
        out.push(std::mem::take(&mut current));
    }
    out
}

fn scenario(name: &str) -> Vec<Block> {
    let blocks: Vec<Block> = shell_blocks()
        .into_iter()
        .filter(|b| b.scenario == name)
        .collect();
    assert!(!blocks.is_empty(), "no `sh {name}` block in the docs");
    blocks
}

#[test]
fn every_shell_block_says_how_it_is_tested() {
    let untested: Vec<String> = shell_blocks()
        .iter()
        .filter(|b| !matches!(b.scenario.as_str(), "demo" | "edge" | "agents" | "ci"))
        .map(|b| format!("{} (```sh {})", b.at, b.scenario))
        .collect();
    assert!(
        untested.is_empty(),
        "shell blocks must be tagged demo, edge, agents or ci (or be `console` illustrations): {untested:?}"
    );
}

/// The lines CI runs, and where it runs them.
fn ci_runs(command: &str) -> Option<(&'static str, &'static str)> {
    let command = command.split(" #").next().unwrap().trim();
    match command {
        "./scripts/test.sh" => Some((".ci/run", "./scripts/test.sh")),
        "eval \"$(scripts/real-backend.sh)\"" => Some((".ci/run", "$(scripts/real-backend.sh)")),
        // `cargo test --workspace` runs every suite, the conformance suite included.
        c if c.starts_with("cargo test -p iop --test ") => {
            Some(("scripts/test.sh", "cargo test --workspace"))
        }
        _ => None,
    }
}

fn assert_ci_runs(command: &str, at: &str) {
    let (file, needle) =
        ci_runs(command).unwrap_or_else(|| panic!("{at}: CI does not run `{command}`"));
    let script = std::fs::read_to_string(PathBuf::from(ROOT).join(file)).unwrap();
    assert!(
        script.contains(needle),
        "{at}: `{command}` is documented, but {file} does not run {needle}"
    );
}

#[test]
fn what_the_docs_say_ci_runs_it_runs() {
    for block in scenario("ci") {
        for command in &block.commands {
            assert_ci_runs(command, &block.at);
        }
    }
}

/// A free loopback port.
fn free_port() -> u16 {
    free_addr()
        .rsplit_once(':')
        .and_then(|(_, port)| port.parse().ok())
        .expect("host:port")
}

/// Where a scenario runs, what it fills in, and the processes it started.
struct Runner {
    dir: tempfile::TempDir,
    http: u16,
    nodes: u16,
    pin: Option<String>,
    join: Option<String>,
    exports: Vec<String>,
    env: BTreeMap<String, String>,
    daemons: Vec<Proc>,
    /// Output of every command run, in order.
    outputs: Vec<(String, String)>,
}

impl Runner {
    fn new() -> Runner {
        let dir = tempdir();
        let http = free_port();
        let nodes = free_port();
        let iop_dir = Path::new(IOP).parent().unwrap().to_path_buf();
        let mut path = vec![iop_dir];
        // The pinned agents, and aider when scripts/test.sh installed it.
        if let Ok(sdk) = std::env::var("IOP_NODE_SDK_DIR") {
            path.push(PathBuf::from(sdk).join("node_modules/.bin"));
        }
        if let Ok(aider) = std::env::var("IOP_AIDER") {
            path.push(PathBuf::from(aider).parent().unwrap().to_path_buf());
        }
        path.extend(std::env::split_paths(
            &std::env::var_os("PATH").unwrap_or_default(),
        ));
        let mut env = BTreeMap::new();
        env.insert(
            "PATH".to_string(),
            std::env::join_paths(path)
                .unwrap()
                .to_string_lossy()
                .into_owned(),
        );
        env.insert("HOME".into(), dir.path().display().to_string());
        env.insert("TMPDIR".into(), dir.path().display().to_string());
        // The admin commands' documented way to reach an edge elsewhere than :8080.
        env.insert("IOP_URL".into(), format!("http://127.0.0.1:{http}"));
        // Only loopback: no telemetry, update checks or model-list downloads.
        for (key, value) in [
            ("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1"),
            ("DISABLE_AUTOUPDATER", "1"),
            ("DISABLE_TELEMETRY", "1"),
            ("AIDER_CHECK_UPDATE", "false"),
            ("AIDER_ANALYTICS_DISABLE", "true"),
            ("AIDER_SHOW_RELEASE_NOTES", "false"),
            ("AIDER_SHOW_MODEL_WARNINGS", "false"),
            ("LITELLM_LOCAL_MODEL_COST_MAP", "True"),
            ("NO_PROXY", "127.0.0.1,localhost"),
        ] {
            env.insert(key.into(), value.into());
        }
        Runner {
            dir,
            http,
            nodes,
            pin: None,
            join: None,
            exports: Vec::new(),
            env,
            daemons: Vec::new(),
            outputs: Vec::new(),
        }
    }

    /// `command` with what a reader fills in filled in.
    fn fill(&self, command: &str) -> String {
        let mut c = command.replace("cargo run --release --bin iop -- ", "iop ");
        if let Some(join) = &self.join {
            c = c.replace(EXAMPLE_JOIN, join);
        }
        if let Some(pin) = &self.pin {
            c = c.replace(EXAMPLE_PIN, pin);
        }
        c = c
            .replace("127.0.0.1:8080", &format!("127.0.0.1:{}", self.http))
            .replace(
                "edge.example.net:7700",
                &format!("127.0.0.1:{}", self.nodes),
            )
            .replace(
                "IOP_NODE_TOKEN=...",
                &format!("IOP_NODE_TOKEN={LOCAL_TOKEN}"),
            )
            .replace("=...", &format!("={KEY}"))
            .replace(" ... ", &format!(" {KEY} "));
        c
    }

    fn command(&self, script: &str, cwd: &Path) -> Command {
        let mut command = Command::new("bash");
        let mut full = self.exports.join("\n");
        full.push('\n');
        full.push_str(script);
        command
            .args(["-euo", "pipefail", "-c", &full])
            .current_dir(cwd)
            .env_clear()
            .envs(&self.env);
        command
    }

    /// Runs one documented command (filled in): a daemon is started and waited for, any
    /// other command must exit 0 within [`WITHIN`].
    async fn run(&mut self, documented: &str, at: &str) {
        if ci_runs(documented).is_some() {
            assert_ci_runs(documented, at);
            return;
        }
        let command = self.fill(documented);
        let words: Vec<&str> = command
            .split_whitespace()
            .skip_while(|w| w.contains('=') && !w.starts_with('-'))
            .collect();
        if command.trim_start().starts_with("export ") {
            self.exports.push(command);
            return;
        }
        match (words.first().copied(), words.get(1).copied()) {
            (Some("iop"), Some("demo")) => {
                let line = format!(
                    "{} --http 127.0.0.1:{} --nodes 127.0.0.1:0",
                    command.split(" #").next().unwrap().trim_end(),
                    self.http
                );
                self.daemon(&line, "Press Ctrl-C", at).await;
            }
            (Some("iop"), Some("edge")) => {
                let line = self.daemon(&command, "iop edge listening", at).await;
                let pin = line
                    .split_whitespace()
                    .find_map(|w| w.strip_prefix("pin="))
                    .unwrap_or_else(|| panic!("{at}: no pin in {line:?}"));
                self.pin = Some(pin.to_string());
            }
            (Some("iop"), Some("node")) => {
                self.daemon(&command, "dispatch-ready", at).await;
            }
            _ => {
                let mut child =
                    tokio::process::Command::from(self.command(&command, self.dir.path()));
                child.kill_on_drop(true);
                let out = tokio::time::timeout(WITHIN, child.output())
                    .await
                    .unwrap_or_else(|_| panic!("{at}: `{command}` took over {WITHIN:?}"))
                    .unwrap();
                let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
                let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
                assert!(
                    out.status.success(),
                    "{at}: `{command}` failed ({})\n--- stdout\n{stdout}\n--- stderr\n{stderr}\n{}",
                    out.status,
                    self.logs()
                );
                if let Some(join) = stdout
                    .lines()
                    .map(str::trim)
                    .find(|l| l.starts_with("iop1:"))
                {
                    self.join = Some(join.to_string());
                }
                self.outputs.push((command, stdout));
            }
        }
    }

    /// Starts `command` in a directory of its own (a daemon is a machine of its own) and
    /// waits for `ready` in its output; returns that line.
    async fn daemon(&mut self, command: &str, ready: &str, at: &str) -> String {
        let n = self.daemons.len();
        let cwd = if command.contains("--config configs/") {
            self.dir.path().to_path_buf()
        } else {
            let cwd = self.dir.path().join(format!("machine-{n}"));
            std::fs::create_dir_all(&cwd).unwrap();
            cwd
        };
        let proc = Proc::spawn_command(
            &format!("{at} #{n}"),
            self.command(&format!("exec env {command}"), &cwd),
        );
        let line = proc.wait_line(ready, Duration::from_secs(60)).await;
        self.daemons.push(proc);
        line
    }

    fn logs(&self) -> String {
        self.daemons
            .iter()
            .map(|d| format!("----- {} -----\n{}", d.name, d.log()))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// The output of the first command that starts with `prefix`.
    fn output_of(&self, prefix: &str) -> &str {
        self.outputs
            .iter()
            .find(|(c, _)| c.starts_with(prefix))
            .map(|(_, o)| o.as_str())
            .unwrap_or_else(|| panic!("no `{prefix}` was run"))
    }

    /// Copies the repository's `configs/` into the scenario's directory, with the
    /// documented ports replaced by free ones.
    fn copy_configs(&self) {
        let to = self.dir.path().join("configs");
        std::fs::create_dir_all(&to).unwrap();
        for entry in std::fs::read_dir(PathBuf::from(ROOT).join("configs")).unwrap() {
            let path = entry.unwrap().path();
            let text = std::fs::read_to_string(&path).unwrap();
            let text = text
                .replace("127.0.0.1:8080", &format!("127.0.0.1:{}", self.http))
                .replace("127.0.0.1:7700", &format!("127.0.0.1:{}", self.nodes));
            std::fs::write(to.join(path.file_name().unwrap()), text).unwrap();
        }
    }
}

#[tokio::test]
async fn the_quick_start_runs_as_written() {
    let mut runner = Runner::new();
    for block in scenario("demo") {
        for command in &block.commands {
            runner.run(command, &block.at).await;
        }
    }
    let streamed = runner.output_of("curl -N");
    assert!(
        streamed.contains("data: [DONE]"),
        "the demo's curl line streams: {streamed}"
    );
}

#[tokio::test]
async fn running_it_for_real_works_from_the_shipped_configs() {
    let mut runner = Runner::new();
    runner.copy_configs();
    for block in scenario("edge") {
        for command in &block.commands {
            runner.run(command, &block.at).await;
        }
    }
    let status = runner.output_of("iop status");
    assert!(
        status.contains("gpu-box") && status.contains("local"),
        "both nodes in the status: {status}"
    );
    let answer = runner.output_of("curl -s");
    assert!(answer.contains("chat.completion"), "{answer}");
    let usage = runner.output_of("iop usage");
    assert!(usage.contains("mock"), "the request in the usage: {usage}");
    let edge = runner.daemons[0].log();
    assert!(
        edge.contains("node ready node_id=\"gpu-box\"")
            && edge.contains("node ready node_id=\"local\""),
        "{}",
        runner.logs()
    );
    assert!(edge.contains("revoked"), "{}", runner.logs());
}

#[tokio::test]
async fn the_agents_section_works_against_the_demo() {
    let test = "the README's agent commands";
    if common::agents::program(test, "claude").is_none() {
        return;
    }
    if std::env::var("IOP_AIDER").is_err() {
        assert!(
            std::env::var("IOP_REQUIRE_NODE_SDK").is_err(),
            "IOP_REQUIRE_NODE_SDK is set but IOP_AIDER (aider, installed by scripts/test.sh) is not"
        );
        common::suite::notice(&format!("SKIPPED {test}: IOP_AIDER is not set"));
        return;
    }
    let mut runner = Runner::new();
    runner
        .run("cargo run --release --bin iop -- demo", "agents: the demo")
        .await;
    for block in scenario("agents") {
        for command in &block.commands {
            runner.run(command, &block.at).await;
        }
    }
}
