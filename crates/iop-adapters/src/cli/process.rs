//! The processes of the CLI adapter: a session process (its pipes, its nonce, the tail of
//! its stderr read all along so a chatty program never stalls), and ending a process:
//! SIGKILL to its whole process group, then waiting for it so no zombie is left. A process
//! is never signalled after it was waited for (its pid may belong to someone else then).

use std::sync::Arc;
use std::time::Duration;

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use parking_lot::Mutex;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout};

use super::usage_line::UsageNonce;

/// Bytes of stderr kept for error messages.
pub const STDERR_TAIL: usize = 2048;
/// How long an ended process gets to be waited for after SIGKILL.
const END_WAIT: Duration = Duration::from_secs(5);

/// A live session process.
#[derive(Debug)]
pub struct SessionProcess {
    pub child: Child,
    pub pid: u32,
    pub nonce: UsageNonce,
    pub stdin: ChildStdin,
    pub stdout: Lines<BufReader<ChildStdout>>,
    /// The last [`STDERR_TAIL`] bytes the process wrote to stderr.
    pub stderr: Arc<Mutex<Vec<u8>>>,
    /// Reads stderr until every process of the group has closed it.
    stderr_task: tokio::task::JoinHandle<()>,
    /// Waited for: its pid may belong to someone else now, never signal it again.
    waited: bool,
}

impl SessionProcess {
    /// Takes a spawned child's pipes (all three piped) and starts reading its stderr.
    pub fn new(mut child: Child, pid: u32, nonce: UsageNonce) -> Self {
        // Read stderr all along (a full pipe would stall the program), keeping its tail
        // for the error of a turn whose process dies. The task ends with the process.
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let mut pipe = child.stderr.take().expect("piped stderr");
        let tail_buf = stderr.clone();
        let stderr_task = tokio::spawn(async move {
            let mut chunk = [0u8; 4096];
            while let Ok(n @ 1..) = pipe.read(&mut chunk).await {
                let mut tail = tail_buf.lock();
                tail.extend_from_slice(&chunk[..n]);
                let excess = tail.len().saturating_sub(STDERR_TAIL);
                tail.drain(..excess);
            }
        });
        SessionProcess {
            stderr,
            stderr_task,
            stdin: child.stdin.take().expect("piped stdin"),
            stdout: BufReader::new(child.stdout.take().expect("piped stdout")).lines(),
            pid,
            nonce,
            child,
            waited: false,
        }
    }

    /// Kills the process group and waits for the process.
    pub async fn end(mut self) {
        if !self.waited {
            kill_group(self.pid);
        }
        match tokio::time::timeout(END_WAIT, self.child.wait()).await {
            Ok(Ok(_)) => self.waited = true,
            Ok(Err(e)) => {
                tracing::warn!(pid = self.pid, error = %e, "waiting for a cli session process failed")
            }
            Err(_) => tracing::warn!(
                pid = self.pid,
                "a killed cli session process did not exit in time"
            ),
        }
    }

    /// The process stopped answering: kill its group (its pid is still ours until it is
    /// waited for), wait for it, and let the stderr reader take the last words.
    pub async fn kill_and_collect(&mut self) {
        kill_group(self.pid);
        if let Ok(Ok(_)) = tokio::time::timeout(END_WAIT, self.child.wait()).await {
            self.waited = true;
        }
        let _ = tokio::time::timeout(Duration::from_millis(500), &mut self.stderr_task).await;
    }
}

impl Drop for SessionProcess {
    fn drop(&mut self) {
        if !self.waited {
            kill_group(self.pid);
        }
    }
}

/// Kills a process group when dropped, unless disarmed (the process exited by itself).
pub struct GroupKill(pub Option<u32>);

impl Drop for GroupKill {
    fn drop(&mut self) {
        if let Some(pid) = self.0 {
            kill_group(pid);
        }
    }
}

/// SIGKILL to a process group (its leader's pid).
pub fn kill_group(pid: u32) {
    // Pid 0 would mean our own process group.
    if pid != 0 {
        let _ = killpg(Pid::from_raw(pid as i32), Signal::SIGKILL);
    }
}

/// `": <the last STDERR_TAIL characters>"`, or nothing when stderr was empty.
pub fn tail(stderr: &[u8]) -> String {
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
