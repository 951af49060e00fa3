//! Model management across the fleet: which Ollama providers an operation targets (every
//! enabled Ollama provider on a connected node, or those a selector names), and following
//! a model pull on each. A pull is a job on the node (`ollama.pull`, answered at once);
//! the edge follows it by asking the node for its jobs every [`PULL_POLL`], so progress
//! reaches the client a few times a second whatever Ollama sends, and the job goes on
//! when the client leaves. A node that cannot be asked for [`PULL_LOST_AFTER`] ends the
//! follow with an error (the pull may still finish there).
//!
//! It also keeps the groups of the Ollama providers' own models ([`crate::local_models`])
//! current: each provider's server is asked what it holds (`ollama.tags`, and what it has
//! loaded, `ollama.ps`, for the status) when a node becomes ready, after every model
//! operation, and every [`MODELS_REFRESH`].

use std::collections::HashMap;
use std::time::Duration;

use futures::Stream;
use serde_json::Value;

use super::Edge;
use super::command::CommandError;
use crate::config::{ProviderKind, Reconcile};

/// How often a followed pull is asked for its progress.
pub const PULL_POLL: Duration = Duration::from_millis(250);
/// How often a pull whose client left is asked for its progress.
pub const PULL_POLL_UNWATCHED: Duration = Duration::from_secs(2);
/// How long a followed pull's node may go unanswered before the follow gives up.
pub const PULL_LOST_AFTER: Duration = Duration::from_secs(60);

/// How often the Ollama providers are asked which models they hold.
pub const MODELS_REFRESH: Duration = Duration::from_secs(60);
/// How long one provider may take to say which models it holds.
pub const TAGS_TIMEOUT: Duration = Duration::from_secs(10);

/// One Ollama provider an operation runs on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub node: String,
    pub provider: String,
}

/// What a followed job says next.
#[derive(Debug, Clone, PartialEq)]
pub enum JobUpdate {
    /// Ollama's latest progress line (`status`, `digest`, `total`, `completed`).
    Progress(Value),
    Succeeded,
    Failed(String),
}

impl Edge {
    /// Asks the Ollama providers on connected nodes (of `node` only, when given) which
    /// models they hold, and serves groups for them from now on. A provider that does not
    /// answer keeps what it held.
    pub async fn refresh_local_models(&self, node: Option<&str>) {
        let config = self.file_config();
        let targets: Vec<Target> = self
            .ollama_targets(node, None)
            .into_iter()
            .filter(|t| {
                super::provider_of(&config, &t.node, &t.provider)
                    .is_some_and(|p| p.local_models().is_some())
            })
            .collect();
        let config = &config;
        let asks = targets.iter().map(|t| async move {
            let tags =
                tokio::time::timeout(TAGS_TIMEOUT, self.target_command(t, "ollama.tags", &[]));
            let ps = tokio::time::timeout(TAGS_TIMEOUT, self.target_command(t, "ollama.ps", &[]));
            let (tags, ps) = futures::future::join(tags, ps).await;
            if let Ok(Ok(ps)) = ps {
                let key = (t.node.clone(), t.provider.clone());
                let cap = config.limits.models_per_provider;
                self.provider_models
                    .set_loaded(key, model_names(&ps, cap).0);
            }
            (t, tags)
        });
        let answers = futures::future::join_all(asks).await;
        // From here until the result is served, no reload applies a config of its own.
        let _applying = self.configs.applying();
        let mut updates = Vec::new();
        for (target, answer) in answers {
            let key = (target.node.clone(), target.provider.clone());
            match answer {
                Ok(Ok(tags)) => {
                    let cap = config.limits.models_per_provider;
                    let (names, left_out) = model_names(&tags, cap);
                    if left_out > 0 {
                        tracing::warn!(node_id = %target.node, provider = %target.provider, kept = names.len(), left_out, "the provider lists models that are not valid names or more than limits.models_per_provider; those are left out");
                    }
                    updates.push((key, names));
                }
                Ok(Err(e)) => {
                    tracing::debug!(node_id = %target.node, provider = %target.provider, %e, "cannot list the provider's models; keeping what it held")
                }
                Err(_) => {
                    tracing::debug!(node_id = %target.node, provider = %target.provider, "listing the provider's models timed out; keeping what it held")
                }
            }
        }
        let Some(held) = self.provider_models.update_held(updates) else {
            return;
        };
        let file = self.file_config();
        let served = crate::local_models::with_local_groups(&file, &held);
        let local: Vec<&str> = served
            .model_groups
            .iter()
            .filter(|g| g.local)
            .map(|g| g.name.as_str())
            .collect();
        tracing::info!(groups = ?local, "the Ollama providers' own models changed: serving them as model groups");
        self.apply_config(served);
    }

    /// Starts a pull of each model a `reconcile: pull` provider lists and its server does
    /// not hold (a provider that has not said what it holds is left alone), unless one is
    /// running already.
    pub fn reconcile_models(self: &std::sync::Arc<Self>) {
        let config = self.file_config();
        let held = self.provider_models.held();
        let running: Vec<_> = self
            .provider_models
            .jobs
            .list()
            .into_iter()
            .filter(|j| !j.ended())
            .collect();
        for target in self.ollama_targets(None, None) {
            let Some(provider) = super::provider_of(&config, &target.node, &target.provider) else {
                continue;
            };
            let (Reconcile::Pull, Some(listed)) = (provider.reconcile, &provider.models) else {
                continue;
            };
            let Some(has) = held.get(&(target.node.clone(), target.provider.clone())) else {
                continue;
            };
            for name in listed.wanted() {
                let full = crate::local_models::full_name(name);
                if has.contains(&full) {
                    continue;
                }
                let pulling = running.iter().any(|j| {
                    crate::local_models::full_name(&j.model) == full
                        && j.targets
                            .iter()
                            .any(|t| t.node == target.node && t.provider == target.provider)
                });
                if !pulling {
                    tracing::info!(node_id = %target.node, provider = %target.provider, model = name,
                        "the provider lacks a model its `models:` lists (reconcile: pull): pulling it");
                    self.start_pull_job(name, vec![target.clone()]);
                }
            }
        }
    }

    /// What each Ollama provider holds and has loaded, as last asked.
    pub fn ollama_models(&self) -> Vec<Value> {
        self.provider_models.view()
    }

    /// The enabled Ollama providers on connected nodes, narrowed to `node` and `provider`
    /// when given.
    pub fn ollama_targets(&self, node: Option<&str>, provider: Option<&str>) -> Vec<Target> {
        let config = self.config();
        config
            .nodes
            .iter()
            .filter(|n| node.is_none_or(|want| n.id == want))
            .filter(|n| self.session(&n.id).is_some())
            .flat_map(|n| {
                n.providers
                    .iter()
                    .filter(|p| p.kind == ProviderKind::Ollama && p.enabled)
                    .filter(|p| provider.is_none_or(|want| p.id == want))
                    .map(|p| Target {
                        node: n.id.clone(),
                        provider: p.id.clone(),
                    })
            })
            .collect()
    }

    /// Runs the node command `name` on `target` with `args`.
    pub async fn target_command(
        &self,
        target: &Target,
        name: &str,
        args: &[(&str, &str)],
    ) -> Result<Value, CommandError> {
        let args: HashMap<String, String> = args
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        self.node_command(&target.node, name, &target.provider, args)
            .await
    }

    /// Starts pulling `model` on `target` (or joins its pull running there) and follows
    /// it to its end: progress when it changes, then success or failure. A client that
    /// drops the stream stops neither the pull nor the following, which slows to
    /// [`PULL_POLL_UNWATCHED`]: when the pull ends the edge looks at the provider's models
    /// again either way.
    pub fn follow_pull(
        self: &std::sync::Arc<Self>,
        target: Target,
        model: String,
    ) -> impl Stream<Item = JobUpdate> + Send + 'static {
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        let edge = self.clone();
        self.tasks().spawn(async move {
            let shutdown = edge.shutdown_token().clone();
            tokio::select! {
                _ = edge.follow(&target, &model, &tx) => {}
                _ = shutdown.cancelled() => return,
            }
            edge.provider_models.mark_stale();
        });
        futures::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|update| (update, rx))
        })
    }

    async fn start_pull(&self, target: &Target, model: &str) -> Result<String, CommandError> {
        let job = self
            .target_command(target, "ollama.pull", &[("model", model), ("wait_ms", "0")])
            .await?;
        Ok(job["id"].as_str().unwrap_or_default().to_string())
    }

    async fn follow(
        &self,
        target: &Target,
        model: &str,
        tx: &tokio::sync::mpsc::Sender<JobUpdate>,
    ) {
        let mut id = match self.start_pull(target, model).await {
            Ok(id) => id,
            Err(e) => {
                let _ = tx.send(JobUpdate::Failed(e.to_string())).await;
                return;
            }
        };
        let mut last = Value::Null;
        let mut answered = tokio::time::Instant::now();
        loop {
            let job = match self.target_command(target, "ollama.jobs", &[]).await {
                Ok(jobs) => {
                    answered = tokio::time::Instant::now();
                    let job = jobs["jobs"]
                        .as_array()
                        .and_then(|jobs| jobs.iter().find(|j| j["id"] == id.as_str()))
                        .cloned();
                    if job.is_none() {
                        // The node no longer knows the job (it restarted): start the pull
                        // again; Ollama resumes the download.
                        match self.start_pull(target, model).await {
                            Ok(again) => id = again,
                            Err(e) => {
                                tracing::debug!(node_id = %target.node, %e, "restarting a pull the node forgot failed")
                            }
                        }
                    }
                    job
                }
                Err(e) if answered.elapsed() >= PULL_LOST_AFTER => {
                    let lost = format!(
                        "lost track of the pull on node {}: {e} (it may still finish there)",
                        target.node
                    );
                    let _ = tx.send(JobUpdate::Failed(lost)).await;
                    return;
                }
                Err(_) => None,
            };
            if let Some(job) = job {
                let progress = &job["progress"];
                if *progress != last && progress.get("status").is_some_and(|s| s != "") {
                    last = progress.clone();
                    let _ = tx.send(JobUpdate::Progress(last.clone())).await;
                }
                let end = match job["state"].as_str() {
                    Some("succeeded") => Some(JobUpdate::Succeeded),
                    Some("failed") => Some(JobUpdate::Failed(
                        job["error"]
                            .as_str()
                            .unwrap_or("the pull failed")
                            .to_string(),
                    )),
                    _ => None,
                };
                if let Some(end) = end {
                    let _ = tx.send(end).await;
                    return;
                }
            }
            let watched = !tx.is_closed();
            tokio::time::sleep(if watched {
                PULL_POLL
            } else {
                PULL_POLL_UNWATCHED
            })
            .await;
        }
    }
}

/// The model names of an Ollama `/api/tags` or `/api/ps` answer.
fn model_names(answer: &Value, cap: usize) -> (Vec<String>, usize) {
    let models = answer["models"].as_array().map_or(&[][..], Vec::as_slice);
    crate::local_models::listed_names(
        models.iter().map(|m| {
            m["name"]
                .as_str()
                .or_else(|| m["model"].as_str())
                .unwrap_or("")
        }),
        cap,
    )
}

/// Keeps the groups of the Ollama providers' own models current until shutdown: on
/// demand ([`super::provider_models::ProviderModels::mark_stale`]) and every [`MODELS_REFRESH`].
pub async fn refresh_local_models(edge: std::sync::Arc<Edge>) {
    let shutdown = edge.shutdown_token().clone();
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = edge.provider_models.stale() => {}
            _ = tokio::time::sleep(MODELS_REFRESH) => {}
        }
        edge.refresh_local_models(None).await;
        edge.reconcile_models();
    }
}
