//! CLI adapter: runs a configured program (argv, env, working dir) per run, the input on
//! its stdin and each stdout line as a delta; exit status 0 completes the run, anything
//! else fails it with the tail of stderr.
//!
//! With a session id, one process per (target, session) is kept alive across runs: each
//! input is written followed by the end-marker line, and the answer is the stdout lines up
//! to the program's own end-marker line. An input holding the end-marker line is refused
//! (it would end the turn early and desync the session). At most `max_sessions` session
//! processes live per adapter, and `max_sessions_per_owner` per API key (a new session
//! over a cap is refused, see [`sessions`]);
//! one idle for `session_idle_sec` is ended by the adapter's reaper. Terminating a session
//! kills its process.
//!
//! Every process runs in its own process group; cancelling a run, terminating or reaping a
//! session kills the whole group, and the process is waited for. A stdout line
//! `@@iop-usage <nonce> {"input_tokens":N,"output_tokens":M}` reports usage and is not
//! part of the output, when `<nonce>` is the one iop gave that process in
//! `IOP_USAGE_NONCE` (see [`usage_line`]). The program also sees `IOP_RUN_ID`,
//! `IOP_TARGET`, `IOP_SESSION_ID`.

mod end_marker;
mod process;
pub mod sessions;
pub mod usage_line;

use iop_proto::ErrorCode;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use iop_proto::pb;
use parking_lot::Mutex;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::process::Command;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::adapter::{Adapter, RunInput, SessionInfo};
use super::error::AdapterError;
use crate::sink::{RunSink, SinkClosed};
use end_marker::refuse_end_marker;
use process::{GroupKill, SessionProcess, kill_group, tail};
use sessions::{CheckedOut, CheckoutError, SessionKey, SessionLimits, SessionTable};
use usage_line::{Line, NONCE_ENV, UsageNonce, classify};

pub const DEFAULT_END_MARKER: &str = "<<<IOP-END>>>";
/// Live session processes per adapter when the config does not say.
pub const DEFAULT_MAX_SESSIONS: u32 = 32;
/// Seconds a session process may sit idle when the config does not say.
pub const DEFAULT_SESSION_IDLE_SEC: u32 = 900;

#[derive(Debug)]
pub struct CliAdapter {
    spec: pb::CliSpec,
    end_marker: String,
    shared: Arc<Shared>,
    reaper: Mutex<Option<Reaper>>,
    /// An untrusted usage line was seen (warned about once per adapter).
    warned_untrusted: AtomicBool,
}

/// What the adapter and its reaper share.
#[derive(Debug)]
struct Shared {
    table: Mutex<SessionTable<SessionProcess>>,
    /// A session became idle: the reaper recomputes its next deadline.
    changed: Notify,
}

/// The idle-session reaper, started with the first session; it ends every remaining
/// session when the adapter goes away.
#[derive(Debug)]
struct Reaper {
    cancel: CancellationToken,
    _task: tokio::task::JoinHandle<()>,
}

impl Drop for CliAdapter {
    fn drop(&mut self) {
        if let Some(reaper) = self.reaper.lock().take() {
            reaper.cancel.cancel();
        }
    }
}

/// Ends a session's process taken out of the table, then frees its place under the cap.
async fn end_session(process: SessionProcess, shared: &Shared) {
    process.end().await;
    shared.table.lock().ended();
}

/// [`end_session`] from synchronous code: on a task when a runtime is there, else the
/// process is killed (and reaped by the runtime's orphan queue).
fn end_soon(process: SessionProcess, shared: Arc<Shared>) {
    match tokio::runtime::Handle::try_current() {
        Ok(handle) => {
            handle.spawn(async move { end_session(process, &shared).await });
        }
        Err(_) => {
            drop(process);
            shared.table.lock().ended();
        }
    }
}

/// The session limits a spec asks for, 0 meaning the defaults.
pub fn session_limits(spec: &pb::CliSpec) -> SessionLimits {
    let or = |v: u32, default: u32| if v == 0 { default } else { v };
    let max_sessions = or(spec.max_sessions, DEFAULT_MAX_SESSIONS);
    SessionLimits {
        max_sessions: max_sessions as usize,
        max_per_owner: or(spec.max_sessions_per_owner, max_sessions.div_ceil(4)) as usize,
        idle: Duration::from_secs(or(spec.session_idle_sec, DEFAULT_SESSION_IDLE_SEC).into()),
    }
}

impl CliAdapter {
    pub fn new(spec: pb::CliSpec) -> Result<Self, String> {
        Self::with_limits(spec.clone(), session_limits(&spec))
    }

    /// An adapter with explicit session limits (tests use sub-second idle times).
    pub fn with_limits(spec: pb::CliSpec, limits: SessionLimits) -> Result<Self, String> {
        if spec.argv.is_empty() || spec.argv[0].is_empty() {
            return Err("cli.argv needs at least the program to run".into());
        }
        if limits.max_sessions == 0 {
            return Err("cli.max_sessions must be at least 1".into());
        }
        let end_marker = if spec.end_marker.is_empty() {
            DEFAULT_END_MARKER.to_string()
        } else {
            spec.end_marker.clone()
        };
        if end_marker.trim().is_empty() || end_marker.contains(['\n', '\r']) {
            return Err("cli.end_marker must be one non-blank line".into());
        }
        Ok(Self {
            spec,
            end_marker,
            shared: Arc::new(Shared {
                table: Mutex::new(SessionTable::new(limits)),
                changed: Notify::new(),
            }),
            reaper: Mutex::default(),
            warned_untrusted: AtomicBool::new(false),
        })
    }

    fn command(&self, input: &RunInput, nonce: &UsageNonce) -> Command {
        let mut cmd = Command::new(&self.spec.argv[0]);
        cmd.args(&self.spec.argv[1..])
            .envs(&self.spec.env)
            .env("IOP_RUN_ID", &input.run_id)
            .env("IOP_TARGET", &input.target)
            .env("IOP_SESSION_ID", &input.session_id)
            .env(NONCE_ENV, nonce.as_str())
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
            ErrorCode::CliSpawn,
            format!("cannot start {:?}: {err}", self.spec.argv[0]),
        )
    }

    /// Relays one stdout line, or keeps it as the run's usage.
    async fn relay_line(
        &self,
        line: &str,
        nonce: &UsageNonce,
        usage: &mut Option<pb::Usage>,
        sink: &mut RunSink,
    ) -> Result<(), SinkClosed> {
        match classify(line, nonce) {
            Line::Usage(Some(u)) => *usage = Some(u),
            Line::Usage(None) => {
                tracing::debug!("a usage line with this process's nonce held no usage object")
            }
            Line::Untrusted(text) => {
                if !self.warned_untrusted.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        program = %self.spec.argv[0],
                        "a stdout line starting with @@iop-usage lacked the process's nonce: relayed as output and not counted (programs report usage as `@@iop-usage $IOP_USAGE_NONCE {{...}}`); said once per adapter"
                    );
                }
                sink.delta(&format!("{text}\n")).await?;
            }
            Line::Output(text) => sink.delta(&format!("{text}\n")).await?,
        }
        Ok(())
    }

    /// One process for one run.
    async fn run_once(&self, input: RunInput, sink: &mut RunSink) -> Result<(), AdapterError> {
        let nonce = UsageNonce::random();
        let mut child = self
            .command(&input, &nonce)
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
                    Ok(Some(line)) => self.relay_line(&line, &nonce, &mut usage, sink).await?,
                    Ok(None) => return Ok(usage),
                    Err(e) => {
                        return Err(AdapterError::new(
                            ErrorCode::CliOutput,
                            format!("reading the program's output failed: {e}"),
                        ));
                    }
                }
            }
        };
        let ((), stderr_bytes, usage) = tokio::join!(write, read_err, read_out);
        let usage = usage?;
        let status = child.wait().await.map_err(|e| {
            AdapterError::new(
                ErrorCode::CliExit,
                format!("waiting for the program failed: {e}"),
            )
        })?;
        guard.0 = None;
        if status.success() {
            sink.complete(usage, "stop").await?;
            Ok(())
        } else {
            Err(AdapterError::new(
                ErrorCode::CliExit,
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
        let mut prompt = input.prompt_text();
        refuse_end_marker(&prompt, &self.end_marker)?;
        let key = (input.target.clone(), input.session_id.clone());
        let checked = self.checkout(&key, &input)?;
        // If this turn does not finish (cancel, error), the process is mid-answer: end it.
        let mut turn = SessionTurn {
            shared: self.shared.clone(),
            key,
            id: checked.id,
            process: Some(checked.process),
        };
        sink.start(&input.target).await?;
        if !prompt.ends_with('\n') {
            prompt.push('\n');
        }
        prompt.push_str(&self.end_marker);
        prompt.push('\n');
        let process = turn.process.as_mut().expect("held until the turn ends");
        let gone = |e: std::io::Error| {
            AdapterError::new(
                ErrorCode::CliExit,
                format!("session {} process is gone: {e}", input.session_id),
            )
        };
        process
            .stdin
            .write_all(prompt.as_bytes())
            .await
            .map_err(gone)?;
        process.stdin.flush().await.map_err(gone)?;
        let mut usage = None;
        loop {
            match process.stdout.next_line().await {
                Ok(Some(line)) if line == self.end_marker => break,
                Ok(Some(line)) => {
                    self.relay_line(&line, &process.nonce, &mut usage, sink)
                        .await?
                }
                Ok(None) | Err(_) => {
                    process.kill_and_collect().await;
                    return Err(AdapterError::new(
                        ErrorCode::CliExit,
                        format!(
                            "session {} process exited before its end marker{}",
                            input.session_id,
                            tail(&process.stderr.lock())
                        ),
                    ));
                }
            }
        }
        turn.finish();
        sink.complete(usage, "stop").await?;
        Ok(())
    }

    /// The session's process for one turn, started if the session is new and the cap
    /// allows.
    fn checkout(
        &self,
        key: &SessionKey,
        input: &RunInput,
    ) -> Result<CheckedOut<SessionProcess>, AdapterError> {
        let mut table = self.shared.table.lock();
        let limits = table.limits();
        let result = table.checkout(key, &input.owner, Instant::now(), || {
            self.spawn_session(input)
        });
        let live = table.live();
        drop(table);
        match result {
            Ok(checked) => {
                if checked.fresh {
                    tracing::info!(target = %key.0, session_id = %key.1, pid = checked.process.pid, live, "cli session process started");
                    self.ensure_reaper();
                }
                Ok(checked)
            }
            Err(CheckoutError::Busy) => Err(AdapterError::new(
                ErrorCode::SessionBusy,
                format!("session {} is busy with another run", input.session_id),
            )),
            Err(CheckoutError::Full { max_sessions }) => {
                tracing::warn!(target = %key.0, session_id = %key.1, max_sessions, "new cli session refused: at the session cap");
                Err(AdapterError::new(
                    ErrorCode::SessionLimit,
                    format!(
                        "this adapter already runs its maximum of {max_sessions} session processes (cli.max_sessions); end a session (DELETE /v1/sessions/...) or retry once idle ones are ended after {}s (cli.session_idle_sec)",
                        limits.idle.as_secs()
                    ),
                ))
            }
            Err(CheckoutError::OwnerFull { max_per_owner }) => {
                tracing::warn!(target = %key.0, session_id = %key.1, owner = %input.owner, max_per_owner, "new cli session refused: the key holds its share of sessions");
                Err(AdapterError::new(
                    ErrorCode::SessionLimit,
                    format!(
                        "this API key already runs its maximum of {max_per_owner} session processes on this adapter (cli.max_sessions_per_key); end one of its sessions (DELETE /v1/sessions/...) or retry once idle ones are ended after {}s (cli.session_idle_sec)",
                        limits.idle.as_secs()
                    ),
                ))
            }
            Err(CheckoutError::Spawn(e)) => Err(e),
        }
    }

    fn spawn_session(&self, input: &RunInput) -> Result<(u32, SessionProcess), AdapterError> {
        let nonce = UsageNonce::random();
        let child = self
            .command(input, &nonce)
            .spawn()
            .map_err(|e| self.spawn_error(e))?;
        let pid = child.id().ok_or_else(|| {
            AdapterError::new(
                ErrorCode::CliSpawn,
                format!("{:?} exited as soon as it started", self.spec.argv[0]),
            )
        })?;
        let process = SessionProcess::new(child, pid, nonce);
        Ok((pid, process))
    }

    fn ensure_reaper(&self) {
        let mut reaper = self.reaper.lock();
        if reaper.is_none() {
            let cancel = CancellationToken::new();
            let task = tokio::spawn(reap_idle(self.shared.clone(), cancel.clone()));
            *reaper = Some(Reaper {
                cancel,
                _task: task,
            });
        }
    }
}

/// Ends idle sessions when their time comes; when the adapter goes away, ends them all.
async fn reap_idle(shared: Arc<Shared>, cancel: CancellationToken) {
    loop {
        let changed = shared.changed.notified();
        let next = shared.table.lock().next_expiry();
        let wake = next.unwrap_or_else(|| Instant::now() + Duration::from_secs(3600));
        tokio::select! {
            _ = cancel.cancelled() => break,
            _ = changed => continue,
            _ = tokio::time::sleep_until(wake) => {}
        }
        let expired = shared.table.lock().reap(Instant::now());
        for session in expired {
            tracing::info!(
                target = %session.key.0,
                session_id = %session.key.1,
                pid = session.pid,
                idle_sec = session.idle_for.as_secs(),
                "cli session process ended: idle for cli.session_idle_sec"
            );
            if let Some(process) = session.process {
                end_session(process, &shared).await;
            }
        }
    }
    let all = shared.table.lock().drain(Instant::now());
    for session in all {
        match session.process {
            Some(process) => end_session(process, &shared).await,
            // Mid-turn: the turn sees its process die and ends it.
            None => kill_group(session.pid),
        }
    }
}

/// One turn's hold on its session's process: `finish` checks it back in; dropped before
/// that (cancel, error), the session is forgotten and its process ended.
struct SessionTurn {
    shared: Arc<Shared>,
    key: SessionKey,
    id: u64,
    process: Option<SessionProcess>,
}

impl SessionTurn {
    fn finish(&mut self) {
        let Some(process) = self.process.take() else {
            return;
        };
        let back = self
            .shared
            .table
            .lock()
            .check_in(&self.key, self.id, process, Instant::now());
        match back {
            Ok(()) => self.shared.changed.notify_one(),
            // Terminated during the turn.
            Err(process) => end_soon(process, self.shared.clone()),
        }
    }
}

impl Drop for SessionTurn {
    fn drop(&mut self) {
        if let Some(process) = self.process.take() {
            self.shared.table.lock().discard(&self.key, self.id);
            tracing::info!(target = %self.key.0, session_id = %self.key.1, pid = process.pid, "cli session process ended: its turn did not finish");
            end_soon(process, self.shared.clone());
        }
    }
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
        let key = (target.to_string(), session_id.to_string());
        let removed = self.shared.table.lock().remove(&key, Instant::now());
        let Some(session) = removed else {
            return Err(AdapterError::new(
                ErrorCode::NotFound,
                format!("no session {session_id:?} for target {target:?}"),
            ));
        };
        let pid = session.pid;
        match session.process {
            Some(process) => end_session(process, &self.shared).await,
            // Mid-turn: the turn sees its process die and ends it.
            None => kill_group(pid),
        }
        tracing::info!(target, session_id, pid, "cli session terminated");
        Ok(())
    }

    fn sessions(&self) -> Vec<SessionInfo> {
        self.shared
            .table
            .lock()
            .list(Instant::now())
            .into_iter()
            .map(|s| SessionInfo {
                target: s.key.0,
                session_id: s.key.1,
                pid: Some(s.pid),
                age_sec: s.age.as_secs(),
                idle_sec: s.idle.map(|d| d.as_secs()),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests;
