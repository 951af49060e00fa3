//! A real inference server for the conformance suite: llama.cpp's `llama-server` with the
//! tiny model `scripts/real-backend.sh` builds, found through `IOP_LLAMA_SERVER` and
//! `IOP_LLAMA_MODEL`, started on a loopback port, its log collected like an `iop` process's.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::Proc;
use super::suite::notice;

/// The llama-server binary and model to test against, from `IOP_LLAMA_SERVER` and
/// `IOP_LLAMA_MODEL`. Without them: `None` after a notice, or a panic under
/// `IOP_REQUIRE_REAL_BACKEND=1`.
pub fn from_env(suite: &str) -> Option<(PathBuf, PathBuf)> {
    let server = std::env::var_os("IOP_LLAMA_SERVER").map(PathBuf::from);
    let model = std::env::var_os("IOP_LLAMA_MODEL").map(PathBuf::from);
    match (server, model) {
        (Some(server), Some(model)) => {
            assert!(
                server.is_file(),
                "IOP_LLAMA_SERVER={server:?} is not a file"
            );
            assert!(model.is_file(), "IOP_LLAMA_MODEL={model:?} is not a file");
            Some((server, model))
        }
        _ => {
            assert!(
                std::env::var("IOP_REQUIRE_REAL_BACKEND").as_deref() != Ok("1"),
                "IOP_REQUIRE_REAL_BACKEND=1 but IOP_LLAMA_SERVER / IOP_LLAMA_MODEL are not set: \
                 run `eval \"$(scripts/real-backend.sh)\"` first"
            );
            notice(&format!(
                "{suite}: SKIPPED (IOP_LLAMA_SERVER and IOP_LLAMA_MODEL are not set; \
                 `eval \"$(scripts/real-backend.sh)\"` provides them)"
            ));
            None
        }
    }
}

impl Proc {
    /// Any program (not `iop`), its output collected line by line.
    pub fn spawn_program(name: &str, program: &std::path::Path, args: &[&str]) -> Proc {
        let mut command = Command::new(program);
        command.args(args);
        Self::spawn_command(name, command)
    }

    /// A prepared command (its working directory and environment set by the caller).
    pub fn spawn_command(name: &str, mut command: Command) -> Proc {
        let mut child = command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {command:?}: {e}"));
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

    /// How many lines contain `needle`.
    pub fn count_lines(&self, needle: &str) -> usize {
        self.lines
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.contains(needle))
            .count()
    }

    /// The lines from index `from` on (see `line_count`).
    pub fn lines_since(&self, from: usize) -> Vec<String> {
        self.lines.lock().unwrap()[from..].to_vec()
    }

    pub fn line_count(&self) -> usize {
        self.lines.lock().unwrap().len()
    }

    /// The last `n` lines.
    pub fn tail(&self, n: usize) -> String {
        let lines = self.lines.lock().unwrap();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// Whether the process has exited.
    pub fn exited(&mut self) -> bool {
        self.child.try_wait().is_ok_and(|s| s.is_some())
    }

    /// Waits until `count` lines contain `needle`.
    pub async fn wait_line_count(&self, needle: &str, count: usize, within: Duration) {
        let deadline = Instant::now() + within;
        while self.count_lines(needle) < count {
            if Instant::now() > deadline {
                panic!(
                    "{}: fewer than {count} lines containing {needle:?} within {within:?}; last lines:\n{}",
                    self.name,
                    self.tail(100)
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// A running `llama-server`.
pub struct LlamaServer {
    pub proc: Proc,
    /// `127.0.0.1:<port>`.
    pub addr: String,
}

impl LlamaServer {
    /// The OpenAI-compatible API root, as a provider's `base_url` names it.
    pub fn base(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

/// Starts `llama-server` on a free loopback port with `args` added, and waits (at most
/// 3 minutes: a busy machine loads slowly) until its `/health` answers 200.
pub async fn start_llama_server(name: &str, bin: &std::path::Path, args: &[&str]) -> LlamaServer {
    let mut all = vec!["--host", "127.0.0.1", "--port", "0", "--threads", "1"];
    all.extend_from_slice(args);
    let proc = Proc::spawn_program(name, bin, &all);
    let line = proc
        .wait_line("listening on http://", Duration::from_secs(180))
        .await;
    let addr = line
        .split("http://")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .to_string();
    let server = LlamaServer { proc, addr };
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let health = super::client().get(server.url("/health")).send().await;
        if health.is_ok_and(|r| r.status() == 200) {
            return server;
        }
        if Instant::now() > deadline {
            panic!(
                "{name}: /health never answered 200; log:\n{}",
                server.proc.log()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
