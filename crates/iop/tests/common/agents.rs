//! The coding agents as a user runs them, non-interactively, against an edge: Claude Code
//! (`claude -p`) and Codex (`codex exec`), the versions pinned in
//! `tests/node/package-lock.json` (installed by `scripts/test.sh`; `IOP_REQUIRE_NODE_SDK`
//! turns a missing one into a failure). Each runs in its own home directory, with only
//! loopback to talk to, through a [`Recorder`](super::recorder::Recorder) so the test
//! sees every request it made.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::sdk::node_sdk;
use super::suite::notice;

/// What a run of an agent left behind.
pub struct AgentRun {
    pub success: bool,
    pub stdout: String,
    pub stderr: String,
}

impl std::fmt::Display for AgentRun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "exit ok: {}\n--- stdout\n{}\n--- stderr\n{}",
            self.success, self.stdout, self.stderr
        )
    }
}

/// The agent's program from the pinned install, or `None` after a notice.
pub fn program(test: &str, name: &str) -> Option<PathBuf> {
    let dir = node_sdk(test)?;
    let program = dir.join("node_modules/.bin").join(name);
    if program.exists() {
        return Some(program);
    }
    assert!(
        std::env::var("IOP_REQUIRE_NODE_SDK").is_err(),
        "IOP_REQUIRE_NODE_SDK is set but {} is missing (scripts/test.sh installs it)",
        program.display()
    );
    notice(&format!("SKIPPED {test}: no {}", program.display()));
    None
}

/// Runs `program args…` in `home` (its working and home directory) with `env`, no proxy
/// and no update checks, for at most `within`.
async fn run(
    program: &Path,
    home: &Path,
    args: &[&str],
    env: &[(&str, String)],
    within: Duration,
) -> AgentRun {
    let mut command = tokio::process::Command::new(program);
    command
        .args(args)
        .current_dir(home)
        .env("HOME", home)
        .env("NO_PROXY", "127.0.0.1,localhost")
        .env_remove("HTTP_PROXY")
        .env_remove("HTTPS_PROXY")
        .env_remove("ALL_PROXY")
        .env_remove("http_proxy")
        .env_remove("https_proxy")
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    for (key, value) in env {
        command.env(key, value);
    }
    let out = tokio::time::timeout(within, command.output())
        .await
        .unwrap_or_else(|_| panic!("{} did not finish within {within:?}", program.display()))
        .unwrap_or_else(|e| panic!("run {}: {e}", program.display()));
    AgentRun {
        success: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Claude Code, `claude -p prompt`, against the Anthropic API at `base` with every model
/// slot (main, fast, haiku/sonnet/opus aliases) set to `model`; Bash is the one tool it
/// may use without asking.
pub async fn claude(
    program: &Path,
    home: &Path,
    base: &str,
    model: &str,
    prompt: &str,
    within: Duration,
) -> AgentRun {
    let model = model.to_string();
    let env = [
        ("ANTHROPIC_BASE_URL", base.to_string()),
        ("ANTHROPIC_API_KEY", "sk-iop-test".to_string()),
        ("ANTHROPIC_MODEL", model.clone()),
        ("ANTHROPIC_SMALL_FAST_MODEL", model.clone()),
        ("ANTHROPIC_DEFAULT_HAIKU_MODEL", model.clone()),
        ("ANTHROPIC_DEFAULT_SONNET_MODEL", model.clone()),
        ("ANTHROPIC_DEFAULT_OPUS_MODEL", model),
        ("CLAUDE_CODE_MAX_OUTPUT_TOKENS", "256".to_string()),
        ("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1".to_string()),
        ("DISABLE_AUTOUPDATER", "1".to_string()),
        ("DISABLE_TELEMETRY", "1".to_string()),
    ];
    let args = [
        "-p",
        prompt,
        "--allowedTools",
        "Bash",
        "--max-turns",
        "4",
        "--output-format",
        "json",
    ];
    run(program, home, &args, &env, within).await
}

/// Codex, `codex exec prompt`, against the Responses API at `base` (`…/v1`) as a custom
/// model provider, model `model`.
pub async fn codex(
    program: &Path,
    home: &Path,
    base: &str,
    model: &str,
    prompt: &str,
    within: Duration,
) -> AgentRun {
    let codex_home = home.join(".codex");
    std::fs::create_dir_all(&codex_home).unwrap();
    let provider = format!(
        "model_providers.iop={{name=\"iop\",base_url=\"{base}\",env_key=\"IOP_API_KEY\",wire_api=\"responses\"}}"
    );
    let env = [
        ("CODEX_HOME", codex_home.display().to_string()),
        ("IOP_API_KEY", "sk-iop-test".to_string()),
    ];
    let args = [
        "exec",
        "--skip-git-repo-check",
        "-m",
        model,
        "-c",
        "model_provider=iop",
        "-c",
        &provider,
        prompt,
    ];
    run(program, home, &args, &env, within).await
}
