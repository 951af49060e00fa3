//! Model jobs: pulls (and creates) on the node's Ollama providers, which outlive the
//! command that started them. At most one job per (provider, model) runs at a time — a
//! second request for it joins the running one. A pull whose stream broke (the provider's
//! connection, not an `error` line) is issued again, up to [`PULL_ATTEMPTS`] times, and
//! Ollama resumes it where it stopped. The last [`FINISHED_KEPT`] finished jobs are kept
//! for `ollama.jobs`.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use iop_proto::ErrorCode;
use serde::Serialize;
use tokio::sync::watch;

use crate::adapters::AdapterError;
use crate::adapters::ollama::OllamaAdapter;
use crate::adapters::ollama::manage::Progress;

/// How many times a pull is issued before its failure stands.
pub const PULL_ATTEMPTS: u32 = 4;
/// Finished jobs kept for listing.
pub const FINISHED_KEPT: usize = 32;
/// Jobs running at once on a node; one more is refused until one ends.
pub const MAX_RUNNING: usize = 16;

/// What a job does.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum JobOp {
    Pull,
}

/// Where a job is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum JobPhase {
    Running,
    Succeeded,
    Failed,
}

/// A job as `ollama.jobs` and `ollama.pull` report it.
#[derive(Debug, Clone, Serialize)]
pub struct JobState {
    pub id: String,
    pub op: JobOp,
    pub adapter: String,
    pub model: String,
    pub state: JobPhase,
    /// Ollama's last progress line.
    pub progress: Progress,
    /// Attempts made so far (more than one after a broken stream).
    pub attempts: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(skip)]
    pub error_code: Option<ErrorCode>,
    pub started_unix_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ended_unix_ms: Option<u64>,
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[derive(Debug, Default)]
struct Jobs {
    running: HashMap<(String, String), watch::Receiver<JobState>>,
    finished: VecDeque<JobState>,
    next: u64,
}

/// The node's model jobs.
#[derive(Debug, Default)]
pub struct ModelJobs {
    jobs: Mutex<Jobs>,
}

impl ModelJobs {
    /// Starts pulling `model` on `adapter` (an Ollama provider), or joins the pull of it
    /// already running there. The receiver sees the job's state until it ends. Refused
    /// when [`MAX_RUNNING`] jobs run already.
    pub fn pull(
        self: &Arc<Self>,
        adapter_id: &str,
        ollama: OllamaAdapter,
        model: &str,
    ) -> Result<watch::Receiver<JobState>, AdapterError> {
        let key = (adapter_id.to_string(), model.to_string());
        let mut jobs = self.jobs.lock().expect("not poisoned");
        if let Some(running) = jobs.running.get(&key) {
            return Ok(running.clone());
        }
        if jobs.running.len() >= MAX_RUNNING {
            return Err(AdapterError::new(
                ErrorCode::NodeCapacity,
                format!(
                    "{MAX_RUNNING} model jobs are running on this node already; try again when one ends"
                ),
            ));
        }
        jobs.next += 1;
        let state = JobState {
            id: format!("pull-{}-{}", unix_ms(), jobs.next),
            op: JobOp::Pull,
            adapter: key.0.clone(),
            model: key.1.clone(),
            state: JobPhase::Running,
            progress: Progress::default(),
            attempts: 0,
            error: None,
            error_code: None,
            started_unix_ms: unix_ms(),
            ended_unix_ms: None,
        };
        tracing::info!(job = %state.id, provider = %state.adapter, model = %state.model, "pulling a model");
        let (tx, rx) = watch::channel(state);
        jobs.running.insert(key.clone(), rx.clone());
        let this = self.clone();
        tokio::spawn(async move {
            let result = pull_with_retries(&ollama, &key.1, &tx).await;
            tx.send_modify(|s| {
                s.ended_unix_ms = Some(unix_ms());
                match &result {
                    Ok(()) => s.state = JobPhase::Succeeded,
                    Err(e) => {
                        s.state = JobPhase::Failed;
                        s.error = Some(e.message.clone());
                        s.error_code = Some(e.code);
                    }
                }
            });
            let ended = tx.borrow().clone();
            match &result {
                Ok(()) => {
                    tracing::info!(job = %ended.id, provider = %ended.adapter, model = %ended.model, attempts = ended.attempts, "model pulled")
                }
                Err(e) => {
                    tracing::warn!(job = %ended.id, provider = %ended.adapter, model = %ended.model, attempts = ended.attempts, error = %e, "model pull failed")
                }
            }
            this.finish(&key, ended);
        });
        Ok(rx)
    }

    fn finish(&self, key: &(String, String), ended: JobState) {
        let mut jobs = self.jobs.lock().expect("not poisoned");
        jobs.running.remove(key);
        jobs.finished.push_back(ended);
        while jobs.finished.len() > FINISHED_KEPT {
            jobs.finished.pop_front();
        }
    }

    /// Running jobs, then the finished ones kept, newest last.
    pub fn list(&self) -> Vec<JobState> {
        let jobs = self.jobs.lock().expect("not poisoned");
        let mut list: Vec<JobState> = jobs
            .running
            .values()
            .map(|rx| rx.borrow().clone())
            .collect();
        list.sort_by_key(|j| j.started_unix_ms);
        list.extend(jobs.finished.iter().cloned());
        list
    }
}

/// Whether a failed attempt is worth issuing again: the stream broke or the provider was
/// briefly unreachable, not Ollama saying no.
fn retryable(err: &AdapterError) -> bool {
    matches!(
        err.code,
        ErrorCode::BrokenStream | ErrorCode::ProviderUnreachable | ErrorCode::ProviderTimeout
    )
}

async fn pull_with_retries(
    ollama: &OllamaAdapter,
    model: &str,
    state: &watch::Sender<JobState>,
) -> Result<(), AdapterError> {
    let mut attempt = 0;
    loop {
        attempt += 1;
        state.send_modify(|s| s.attempts = attempt);
        let mut progress = |p: Progress| state.send_modify(|s| s.progress = p);
        match ollama.pull(model, &mut progress).await {
            Ok(()) => return Ok(()),
            Err(e) if attempt < PULL_ATTEMPTS && retryable(&e) => {
                let pause = Duration::from_millis(500 << attempt.min(4));
                tracing::warn!(provider = %ollama.provider.id, model, attempt, error = %e,
                    "the pull's stream broke; issuing it again (Ollama resumes it)");
                tokio::time::sleep(pause).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// Waits up to `within` for a job to end; returns its state then, or as it is.
pub async fn settle(mut job: watch::Receiver<JobState>, within: Duration) -> JobState {
    let _ = tokio::time::timeout(within, job.wait_for(|s| s.state != JobPhase::Running)).await;
    job.borrow().clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An Ollama client of a server that never answers (a listener that accepts nothing).
    fn silent_ollama() -> (OllamaAdapter, std::net::TcpListener) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let spec = iop_proto::pb::ProviderSpec {
            id: "ol".into(),
            kind: iop_proto::pb::ProviderKind::Ollama as i32,
            base_url: format!("http://{}", listener.local_addr().unwrap()),
            ..Default::default()
        };
        let clients = crate::adapters::http_clients();
        let provider = crate::adapters::HttpProvider::new(&spec, &clients).unwrap();
        (OllamaAdapter::new(provider), listener)
    }

    #[tokio::test]
    async fn one_pull_per_model_and_at_most_max_running() {
        let (ollama, _listener) = silent_ollama();
        let jobs = Arc::new(ModelJobs::default());
        let first = jobs.pull("ol", ollama.clone(), "m0").unwrap();
        let again = jobs.pull("ol", ollama.clone(), "m0").unwrap();
        assert_eq!(
            first.borrow().id,
            again.borrow().id,
            "a second pull joins the first"
        );
        for i in 1..MAX_RUNNING {
            jobs.pull("ol", ollama.clone(), &format!("m{i}")).unwrap();
        }
        let refused = jobs.pull("ol", ollama.clone(), "one-more").unwrap_err();
        assert_eq!(refused.code, ErrorCode::NodeCapacity);
        // Joining a running one still works at the cap.
        jobs.pull("ol", ollama, "m3").unwrap();
        assert_eq!(jobs.list().len(), MAX_RUNNING);
    }
}
