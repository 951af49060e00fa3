//! Fleet model jobs: a model pull on several Ollama providers at once, as one job the
//! edge keeps — each target's latest progress and its outcome — whoever started it
//! (`POST /api/pull` streams it, `POST /admin/models/pull` only starts it) and whoever
//! watches it (`GET /admin/jobs/{id}` and its SSE `events`, the status page). The state is
//! a watch value, so a watcher sees the latest progress of each target, coalesced, never
//! an older one after a newer. When every target has ended the edge looks at the
//! providers' models again before it marks the job ended, so a model whose pull
//! succeeded is served by the time a watcher hears so. The last [`FINISHED_KEPT`] ended
//! jobs are kept.

use std::collections::VecDeque;
use std::sync::Arc;

use futures::{Stream, StreamExt};
use serde::Serialize;
use serde_json::{Value, json};
use tokio::sync::watch;

use super::Edge;
use super::models::{JobUpdate, Target};
use crate::ledger::unix_ms_now;

fn now_ms() -> u64 {
    unix_ms_now().max(0) as u64
}

/// Ended jobs kept for `GET /admin/jobs`.
pub const FINISHED_KEPT: usize = 32;

/// Where one target of a job is (as the admin API names it: `running`, `succeeded`,
/// `failed`).
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum TargetState {
    Running,
    Succeeded,
    /// With the reason in [`TargetJob::error`].
    Failed,
}

/// What a fleet model job does.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum JobOp {
    /// An Ollama pull on each target.
    Pull,
}

/// One target of a job.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct TargetJob {
    pub node: String,
    pub provider: String,
    pub state: TargetState,
    /// Ollama's latest progress line (`status`, `digest`, `total`, `completed`).
    pub progress: Value,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// A fleet model job.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct FleetJob {
    pub id: String,
    pub op: JobOp,
    pub model: String,
    pub started_unix_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ended_unix_ms: Option<u64>,
    pub targets: Vec<TargetJob>,
}

impl FleetJob {
    pub fn ended(&self) -> bool {
        self.ended_unix_ms.is_some()
    }

    /// The job's last line: success, or an error naming the targets that failed.
    pub fn outcome(&self) -> Value {
        let failed: Vec<String> = self
            .targets
            .iter()
            .filter(|t| t.state == TargetState::Failed)
            .map(|t| {
                format!(
                    "{}/{}: {}",
                    t.node,
                    t.provider,
                    t.error.as_deref().unwrap_or("failed")
                )
            })
            .collect();
        if failed.is_empty() {
            json!({"status": "success"})
        } else {
            json!({"error": format!("failed on {} of {} targets: {}", failed.len(), self.targets.len(), failed.join("; "))})
        }
    }
}

/// The edge's fleet model jobs: running ones and the last ended ones.
#[derive(Debug, Default)]
pub struct FleetJobs {
    jobs: parking_lot::Mutex<VecDeque<watch::Receiver<FleetJob>>>,
}

impl FleetJobs {
    fn add(&self, job: watch::Receiver<FleetJob>) {
        let mut jobs = self.jobs.lock();
        jobs.push_back(job);
        // Drop the oldest ended jobs beyond what is kept.
        let mut ended = jobs.iter().filter(|j| j.borrow().ended()).count();
        jobs.retain(|j| {
            if ended > FINISHED_KEPT && j.borrow().ended() {
                ended -= 1;
                return false;
            }
            true
        });
    }

    /// Every job kept, oldest first.
    pub fn list(&self) -> Vec<FleetJob> {
        self.jobs
            .lock()
            .iter()
            .map(|j| j.borrow().clone())
            .collect()
    }

    /// Follows job `id`.
    pub fn watch(&self, id: &str) -> Option<watch::Receiver<FleetJob>> {
        self.jobs
            .lock()
            .iter()
            .find(|j| j.borrow().id == id)
            .cloned()
    }
}

impl Edge {
    /// Starts pulling `model` on `targets` as one job; returns a watch of it.
    pub fn start_pull_job(
        self: &Arc<Self>,
        model: &str,
        targets: Vec<Target>,
    ) -> watch::Receiver<FleetJob> {
        let job = FleetJob {
            id: format!("job-{}", self.new_id()),
            op: JobOp::Pull,
            model: model.to_string(),
            started_unix_ms: now_ms(),
            ended_unix_ms: None,
            targets: targets
                .iter()
                .map(|t| TargetJob {
                    node: t.node.clone(),
                    provider: t.provider.clone(),
                    state: TargetState::Running,
                    progress: Value::Null,
                    error: None,
                })
                .collect(),
        };
        tracing::info!(job = %job.id, model, targets = targets.len(), "pulling a model onto the fleet");
        let (tx, rx) = watch::channel(job);
        self.provider_models.jobs.add(rx.clone());
        let tx = Arc::new(tx);
        let follows = targets.into_iter().enumerate().map(|(i, target)| {
            let tx = tx.clone();
            let updates = self.follow_pull(target, model.to_string());
            async move {
                let mut updates = std::pin::pin!(updates);
                while let Some(update) = updates.next().await {
                    tx.send_modify(|job| apply(&mut job.targets[i], update));
                }
            }
        });
        let follows = futures::future::join_all(follows);
        let edge = self.clone();
        self.tasks().spawn(async move {
            follows.await;
            if edge.shutdown_token().is_cancelled() {
                return;
            }
            edge.refresh_local_models(None).await;
            tx.send_modify(|job| job.ended_unix_ms = Some(now_ms()));
            let job = tx.borrow().clone();
            match job.outcome().get("error").and_then(Value::as_str) {
                None => {
                    tracing::info!(job = %job.id, model = %job.model, "model pulled onto the fleet")
                }
                Some(error) => {
                    tracing::warn!(job = %job.id, model = %job.model, error, "model pull failed")
                }
            }
        });
        rx
    }
}

fn apply(target: &mut TargetJob, update: JobUpdate) {
    match update {
        JobUpdate::Progress(progress) => target.progress = progress,
        JobUpdate::Succeeded => target.state = TargetState::Succeeded,
        JobUpdate::Failed(error) => {
            target.state = TargetState::Failed;
            target.error = Some(error);
        }
    }
}

/// What a watcher has been told of one target.
#[derive(Debug, Clone, Default)]
struct Told {
    progress: Value,
    ended: bool,
}

/// A job as Ollama's NDJSON progress: each target's new progress lines and its end
/// (`success` or `error`), each naming the target, then the job's outcome.
pub fn job_lines(job: watch::Receiver<FleetJob>) -> impl Stream<Item = Value> + Send + 'static {
    let told = vec![Told::default(); job.borrow().targets.len()];
    futures::stream::unfold(
        (job, told, VecDeque::new(), false),
        |(mut job, mut told, mut pending, mut done)| async move {
            loop {
                if let Some(line) = pending.pop_front() {
                    return Some((line, (job, told, pending, done)));
                }
                if done {
                    return None;
                }
                let now = job.borrow_and_update().clone();
                for (target, told) in now.targets.iter().zip(told.iter_mut()) {
                    if told.ended {
                        continue;
                    }
                    if !target.progress.is_null() && target.progress != told.progress {
                        told.progress = target.progress.clone();
                        pending.push_back(named(target, target.progress.clone()));
                    }
                    let end = match target.state {
                        TargetState::Succeeded => Some(json!({"status": "success"})),
                        TargetState::Failed => Some(json!({"error": target.error})),
                        TargetState::Running => None,
                    };
                    if let Some(end) = end {
                        told.ended = true;
                        pending.push_back(named(target, end));
                    }
                }
                if now.ended() {
                    pending.push_back(now.outcome());
                    done = true;
                    continue;
                }
                if pending.is_empty() && job.changed().await.is_err() {
                    // The job's task is gone (the edge is stopping).
                    pending.push_back(json!({"error": "the edge stopped following the job"}));
                    done = true;
                }
            }
        },
    )
}

fn named(target: &TargetJob, mut line: Value) -> Value {
    line["node"] = json!(target.node);
    line["provider"] = json!(target.provider);
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(states: &[(TargetState, Value)]) -> FleetJob {
        FleetJob {
            id: "job-1".into(),
            op: JobOp::Pull,
            model: "m".into(),
            started_unix_ms: 0,
            ended_unix_ms: None,
            targets: states
                .iter()
                .enumerate()
                .map(|(i, (state, progress))| TargetJob {
                    node: format!("n{i}"),
                    provider: "ol".into(),
                    state: *state,
                    progress: progress.clone(),
                    error: (*state == TargetState::Failed).then(|| "boom".to_string()),
                })
                .collect(),
        }
    }

    #[test]
    fn states_and_ops_keep_their_names_in_the_admin_api() {
        let j = job(&[
            (TargetState::Running, Value::Null),
            (TargetState::Failed, Value::Null),
        ]);
        let v = serde_json::to_value(&j).unwrap();
        assert_eq!(v["op"], "pull");
        assert_eq!(v["targets"][0]["state"], "running");
        assert_eq!(v["targets"][1]["state"], "failed");
        assert_eq!(
            serde_json::to_value(TargetState::Succeeded).unwrap(),
            "succeeded"
        );
    }

    #[tokio::test]
    async fn lines_follow_the_latest_progress_then_the_outcome() {
        let (tx, rx) = watch::channel(job(&[
            (TargetState::Running, Value::Null),
            (TargetState::Running, Value::Null),
        ]));
        let lines = job_lines(rx);
        let feeder = async {
            for completed in [10, 20, 30] {
                tx.send_modify(|j| {
                    j.targets[0].progress =
                        json!({"status": "pulling", "completed": completed, "total": 30})
                });
                tokio::task::yield_now().await;
            }
            tx.send_modify(|j| {
                j.targets[0].state = TargetState::Succeeded;
                j.targets[1].state = TargetState::Failed;
                j.targets[1].error = Some("pull model manifest: file does not exist".into());
                j.ended_unix_ms = Some(1);
            });
        };
        let (lines, ()) = tokio::join!(lines.collect::<Vec<Value>>(), feeder);
        let completed: Vec<u64> = lines
            .iter()
            .filter_map(|l| l["completed"].as_u64())
            .collect();
        assert!(completed.windows(2).all(|w| w[0] < w[1]), "{lines:?}");
        assert_eq!(completed.last(), Some(&30), "{lines:?}");
        let ends = lines
            .iter()
            .filter(|l| l.get("error").is_some() || l["status"] == "success")
            .count();
        assert_eq!(ends, 3, "{lines:?}");
        let last = lines.last().unwrap();
        assert!(
            last["error"]
                .as_str()
                .unwrap()
                .contains("n1/ol: pull model manifest"),
            "{last}"
        );
        assert!(last.get("node").is_none());
    }

    #[test]
    fn ended_jobs_beyond_the_kept_are_dropped_oldest_first() {
        let jobs = FleetJobs::default();
        let (_running, rx) = watch::channel(job(&[(TargetState::Running, Value::Null)]));
        jobs.add(rx);
        let mut senders = Vec::new();
        for i in 0..FINISHED_KEPT + 5 {
            let mut ended = job(&[(TargetState::Succeeded, Value::Null)]);
            ended.id = format!("ended-{i}");
            ended.ended_unix_ms = Some(1);
            let (tx, rx) = watch::channel(ended);
            senders.push(tx);
            jobs.add(rx);
        }
        let list = jobs.list();
        assert_eq!(list.len(), FINISHED_KEPT + 1);
        assert_eq!(list[0].id, "job-1");
        assert_eq!(list[1].id, "ended-5");
        assert!(jobs.watch("ended-4").is_none());
        assert!(jobs.watch("job-1").is_some());
    }
}
