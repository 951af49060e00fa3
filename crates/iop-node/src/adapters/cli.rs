//! CLI adapter: runs a configured program (argv, env, working dir) per run, the input on
//! its stdin and each stdout line as a delta; exit status 0 completes the run, anything
//! else fails it with the tail of stderr.
//!
//! With a session id, one process per (target, session) is kept alive across runs: each
//! input is written followed by the end-marker line, and the answer is the stdout lines up
//! to the program's own end-marker line. Terminating the session kills the process.
//!
//! Every process runs in its own process group; cancelling a run kills the whole group.
//! A stdout line `@@iop-usage {"input_tokens":N,"output_tokens":M}` reports usage and is
//! not part of the output. The program sees `IOP_RUN_ID`, `IOP_TARGET`, `IOP_SESSION_ID`.

use std::collections::HashMap;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use iop_proto::pb;
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use parking_lot::Mutex;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

use super::{Adapter, AdapterError, RunInput, SessionInfo};
use crate::sink::RunSink;

pub const DEFAULT_END_MARKER: &str = "<<<IOP-END>>>";
const USAGE_PREFIX: &str = "@@iop-usage ";
const STDERR_TAIL: usize = 2048;

type SessionKey = (String, String);

#[derive(Debug)]
pub struct CliAdapter {
    spec: pb::CliSpec,
    end_marker: String,
    sessions: Mutex<HashMap<SessionKey, SessionEntry>>,
}

/// A live session process; the pid is outside the lock so it can be killed mid-turn.
#[derive(Debug, Clone)]
struct SessionEntry {
    pid: u32,
    started: Instant,
    process: Arc<tokio::sync::Mutex<SessionProcess>>,
}

#[derive(Debug)]
struct SessionProcess {
    _child: Child,
    pid: u32,
    stdin: ChildStdin,
    stdout: Lines<BufReader<ChildStdout>>,
}

impl Drop for SessionProcess {
    fn drop(&mut self) {
        kill_group(self.pid);
    }
}

/// Kills a process group when dropped, unless disarmed (the process exited by itself).
struct GroupKill(Option<u32>);

impl Drop for GroupKill {
    fn drop(&mut self) {
        if let Some(pid) = self.0 {
            kill_group(pid);
        }
    }
}

fn kill_group(pid: u32) {
    let _ = killpg(Pid::from_raw(pid as i32), Signal::SIGKILL);
}

impl CliAdapter {
    pub fn new(spec: pb::CliSpec) -> Result<Self, String> {
        if spec.argv.is_empty() || spec.argv[0].is_empty() {
            return Err("cli.argv needs at least the program to run".into());
        }
        let end_marker = if spec.end_marker.is_empty() {
            DEFAULT_END_MARKER.to_string()
        } else {
            spec.end_marker.clone()
        };
        Ok(Self {
            spec,
            end_marker,
            sessions: Mutex::default(),
        })
    }

    fn command(&self, input: &RunInput) -> Command {
        let mut cmd = Command::new(&self.spec.argv[0]);
        cmd.args(&self.spec.argv[1..])
            .envs(&self.spec.env)
            .env("IOP_RUN_ID", &input.run_id)
            .env("IOP_TARGET", &input.target)
            .env("IOP_SESSION_ID", &input.session_id)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        if !self.spec.working_dir.is_empty() {
            cmd.current_dir(&self.spec.working_dir);
        }
        cmd
    }

    fn spawn_error(&self, err: std::io::Error) -> AdapterError {
        AdapterError::new(
            "cli_spawn",
            format!("cannot start {:?}: {err}", self.spec.argv[0]),
        )
    }

    /// One process for one run.
    async fn run_once(&self, input: RunInput, sink: &mut RunSink) -> Result<(), AdapterError> {
        let mut child = self
            .command(&input)
            .spawn()
            .map_err(|e| self.spawn_error(e))?;
        let mut guard = GroupKill(child.id());
        let mut stdin = child.stdin.take().expect("piped stdin");
        let stdout = child.stdout.take().expect("piped stdout");
        let mut stderr = child.stderr.take().expect("piped stderr");
        sink.start(&input.target).await?;
        let prompt = input.prompt_text();
        let write = async move {
            let _ = stdin.write_all(prompt.as_bytes()).await;
            let _ = stdin.shutdown().await;
        };
        let read_err = async move {
            let mut buf = Vec::new();
            let _ = (&mut stderr).take(1 << 20).read_to_end(&mut buf).await;
            buf
        };
        let read_out = async {
            let mut lines = BufReader::new(stdout).lines();
            let mut usage = None;
            loop {
                match lines.next_line().await {
                    Ok(Some(line)) => {
                        if let Some(u) = parse_usage(&line) {
                            usage = Some(u);
                        } else {
                            sink.delta(&format!("{line}\n")).await?;
                        }
                    }
                    Ok(None) => return Ok(usage),
                    Err(e) => {
                        return Err(AdapterError::new(
                            "cli_output",
                            format!("reading the program's output failed: {e}"),
                        ));
                    }
                }
            }
        };
        let ((), stderr_bytes, usage) = tokio::join!(write, read_err, read_out);
        let usage = usage?;
        let status = child.wait().await.map_err(|e| {
            AdapterError::new("cli_exit", format!("waiting for the program failed: {e}"))
        })?;
        guard.0 = None;
        if status.success() {
            sink.complete(Some(usage.unwrap_or_default()), "stop")
                .await?;
            Ok(())
        } else {
            Err(AdapterError::new(
                "cli_exit",
                format!(
                    "{:?} exited with {status}{}",
                    self.spec.argv[0],
                    tail(&stderr_bytes)
                ),
            ))
        }
    }

    /// One turn of a long-lived session process.
    async fn run_in_session(
        &self,
        input: RunInput,
        sink: &mut RunSink,
    ) -> Result<(), AdapterError> {
        let key = (input.target.clone(), input.session_id.clone());
        let session = self.session(&key, &input)?;
        let Ok(mut process) = session.process.try_lock() else {
            return Err(AdapterError::new(
                "session_busy",
                format!("session {} is busy with another run", input.session_id),
            ));
        };
        // If this turn does not finish (cancel, error), the process is mid-answer: end it.
        let mut turn = SessionTurn {
            sessions: &self.sessions,
            key: key.clone(),
            done: false,
        };
        sink.start(&input.target).await?;
        let mut prompt = input.prompt_text();
        if !prompt.ends_with('\n') {
            prompt.push('\n');
        }
        prompt.push_str(&self.end_marker);
        prompt.push('\n');
        process
            .stdin
            .write_all(prompt.as_bytes())
            .await
            .map_err(|e| {
                AdapterError::new(
                    "cli_exit",
                    format!("session {} process is gone: {e}", input.session_id),
                )
            })?;
        process.stdin.flush().await.ok();
        let mut usage = None;
        loop {
            match process.stdout.next_line().await {
                Ok(Some(line)) if line == self.end_marker => break,
                Ok(Some(line)) => {
                    if let Some(u) = parse_usage(&line) {
                        usage = Some(u);
                    } else {
                        sink.delta(&format!("{line}\n")).await?;
                    }
                }
                Ok(None) | Err(_) => {
                    return Err(AdapterError::new(
                        "cli_exit",
                        format!(
                            "session {} process exited before its end marker",
                            input.session_id
                        ),
                    ));
                }
            }
        }
        turn.done = true;
        sink.complete(Some(usage.unwrap_or_default()), "stop")
            .await?;
        Ok(())
    }

    fn session(&self, key: &SessionKey, input: &RunInput) -> Result<SessionEntry, AdapterError> {
        let mut sessions = self.sessions.lock();
        if let Some(existing) = sessions.get(key) {
            return Ok(existing.clone());
        }
        let mut child = self
            .command(input)
            .spawn()
            .map_err(|e| self.spawn_error(e))?;
        let pid = child.id().unwrap_or(0);
        let process = SessionProcess {
            stdin: child.stdin.take().expect("piped stdin"),
            stdout: BufReader::new(child.stdout.take().expect("piped stdout")).lines(),
            pid,
            _child: child,
        };
        tracing::info!(target = %key.0, session_id = %key.1, pid, "cli session process started");
        let entry = SessionEntry {
            pid,
            started: Instant::now(),
            process: Arc::new(tokio::sync::Mutex::new(process)),
        };
        sessions.insert(key.clone(), entry.clone());
        Ok(entry)
    }
}

/// Ends the session's process unless the turn completed.
struct SessionTurn<'a> {
    sessions: &'a Mutex<HashMap<SessionKey, SessionEntry>>,
    key: SessionKey,
    done: bool,
}

impl Drop for SessionTurn<'_> {
    fn drop(&mut self) {
        if !self.done
            && let Some(entry) = self.sessions.lock().remove(&self.key)
        {
            kill_group(entry.pid);
        }
    }
}

fn parse_usage(line: &str) -> Option<pb::Usage> {
    let json = line.strip_prefix(USAGE_PREFIX)?;
    let v: serde_json::Value = serde_json::from_str(json).ok()?;
    let count = |k: &str| v.get(k).and_then(serde_json::Value::as_u64);
    Some(pb::Usage {
        input_tokens: count("input_tokens").unwrap_or(0),
        output_tokens: count("output_tokens").unwrap_or(0),
        reasoning_tokens: count("reasoning_tokens"),
        cached_input_tokens: count("cached_input_tokens"),
    })
}

fn tail(stderr: &[u8]) -> String {
    let text = String::from_utf8_lossy(stderr);
    let text = text.trim();
    if text.is_empty() {
        return String::new();
    }
    let start = text
        .char_indices()
        .rev()
        .nth(STDERR_TAIL)
        .map(|(i, _)| i)
        .unwrap_or(0);
    format!(": {}", &text[start..])
}

#[async_trait]
impl Adapter for CliAdapter {
    async fn execute(&self, input: RunInput, sink: &mut RunSink) -> Result<(), AdapterError> {
        if input.session_id.is_empty() {
            self.run_once(input, sink).await
        } else {
            self.run_in_session(input, sink).await
        }
    }

    fn supports_sessions(&self) -> bool {
        true
    }

    async fn terminate_session(&self, target: &str, session_id: &str) -> Result<(), AdapterError> {
        let removed = self
            .sessions
            .lock()
            .remove(&(target.to_string(), session_id.to_string()));
        match removed {
            Some(entry) => {
                kill_group(entry.pid);
                tracing::info!(
                    target,
                    session_id,
                    pid = entry.pid,
                    "cli session terminated"
                );
                Ok(())
            }
            None => Err(AdapterError::new(
                "not_found",
                format!("no session {session_id:?} for target {target:?}"),
            )),
        }
    }

    fn sessions(&self) -> Vec<SessionInfo> {
        self.sessions
            .lock()
            .iter()
            .map(|((target, session_id), entry)| SessionInfo {
                target: target.clone(),
                session_id: session_id.clone(),
                pid: Some(entry.pid),
                age_sec: entry.started.elapsed().as_secs(),
            })
            .collect()
    }
}
