//! The Ollama family of node commands, on the adapter `adapter` names: queries
//! (`ollama.tags`, `ollama.ps`, `ollama.show` with `model`) and controls — `ollama.pull`
//! (`model`; a job of [`crate::model_jobs`] that outlives the command: the answer waits up
//! to `wait_ms`, at most [`MAX_PULL_WAIT`], and reports the job as it is then),
//! `ollama.delete` (`model`), `ollama.copy` (`source`, `destination`), `ollama.create`
//! (`model`, `from`, and `system`, `template`, `parameters` as a JSON object),
//! `ollama.load` (`model`, `keep_alive`) and `ollama.unload` (`model`). `ollama.jobs` lists
//! the node's model jobs (of one adapter with `adapter`).

use std::collections::HashMap;
use std::time::Duration;

use iop_proto::ErrorCode;
use iop_proto::pb;
use serde_json::{Value, json};

use crate::adapters::AdapterError;
use crate::adapters::ollama::OllamaAdapter;
use crate::model_jobs::{self, JobPhase};
use crate::runtime::NodeRuntime;

/// The longest an `ollama.pull` command waits for its job before answering with the job
/// still running (under the edge's wait for a command's answer).
pub const MAX_PULL_WAIT: Duration = Duration::from_secs(20);

/// An argument the command needs.
fn required<'a>(
    args: &'a HashMap<String, String>,
    name: &str,
    key: &str,
) -> Result<&'a str, AdapterError> {
    args.get(key)
        .map(String::as_str)
        .filter(|v| !v.is_empty())
        .ok_or_else(|| AdapterError::new(ErrorCode::BadRequest, format!("{name} needs `{key}`")))
}

/// A `keep_alive` argument as Ollama takes it: a number of seconds or a duration string.
fn keep_alive(arg: Option<&String>) -> Option<Value> {
    let arg = arg?;
    Some(match arg.parse::<f64>() {
        Ok(seconds) => json!(seconds),
        Err(_) => json!(arg),
    })
}

impl NodeRuntime {
    pub(super) async fn ollama_command(
        &self,
        request: &pb::NodeCommandRequest,
    ) -> Result<Value, AdapterError> {
        let name = request.name.as_str();
        let what = &name["ollama.".len()..];
        if what == "jobs" {
            let jobs: Vec<_> = self
                .model_jobs
                .list()
                .into_iter()
                .filter(|j| request.adapter.is_empty() || j.adapter == request.adapter)
                .collect();
            return Ok(json!({"jobs": jobs}));
        }
        let ollama = self.ollama_adapter(request)?;
        let args = &request.args;
        match what {
            "tags" | "ps" | "show" => {
                ollama
                    .query(what, args.get("model").map(String::as_str))
                    .await
            }
            "pull" => {
                let model = required(args, name, "model")?;
                crate::adapters::ollama::manage::check_model_name(model)?;
                let wait = args
                    .get("wait_ms")
                    .and_then(|w| w.parse::<u64>().ok())
                    .map_or(MAX_PULL_WAIT, Duration::from_millis)
                    .min(MAX_PULL_WAIT);
                let job = self.model_jobs.pull(&request.adapter, ollama, model)?;
                let state = model_jobs::settle(job, wait).await;
                if state.state == JobPhase::Failed {
                    return Err(AdapterError::new(
                        state.error_code.unwrap_or(ErrorCode::ProviderError),
                        state.error.unwrap_or_default(),
                    ));
                }
                Ok(json!(state))
            }
            "delete" => ollama.delete(required(args, name, "model")?).await,
            "copy" => {
                ollama
                    .copy(
                        required(args, name, "source")?,
                        required(args, name, "destination")?,
                    )
                    .await
            }
            "create" => {
                let model = required(args, name, "model")?;
                let from = required(args, name, "from")?;
                let mut options = serde_json::Map::new();
                for key in ["system", "template"] {
                    if let Some(text) = args.get(key) {
                        options.insert(key.into(), json!(text));
                    }
                }
                if let Some(parameters) = args.get("parameters") {
                    let parameters: Value = serde_json::from_str(parameters)
                        .ok()
                        .filter(Value::is_object)
                        .ok_or_else(|| {
                            AdapterError::new(
                                ErrorCode::BadRequest,
                                "ollama.create: `parameters` must be a JSON object",
                            )
                        })?;
                    options.insert("parameters".into(), parameters);
                }
                ollama.create(model, from, &options, &mut |_| {}).await?;
                Ok(json!({"created": model, "from": from}))
            }
            "load" => {
                let model = required(args, name, "model")?;
                ollama.load(model, keep_alive(args.get("keep_alive"))).await
            }
            "unload" => {
                ollama
                    .load(required(args, name, "model")?, Some(json!(0)))
                    .await
            }
            other => Err(AdapterError::new(
                ErrorCode::BadRequest,
                format!(
                    "unknown command \"ollama.{other}\"; the Ollama commands are ollama.tags, ollama.ps, ollama.show, ollama.pull, ollama.delete, ollama.copy, ollama.create, ollama.load, ollama.unload and ollama.jobs"
                ),
            )),
        }
    }

    /// The Ollama adapter `request` names (a copy of its client: jobs outlive the command).
    fn ollama_adapter(
        &self,
        request: &pb::NodeCommandRequest,
    ) -> Result<OllamaAdapter, AdapterError> {
        let instance = self.adapter(&request.adapter).ok_or_else(|| {
            AdapterError::new(
                ErrorCode::NotFound,
                format!(
                    "{} needs `adapter` naming an ollama adapter of node {} (it has: {})",
                    request.name,
                    self.node_id(),
                    self.adapter_ids().join(", ")
                ),
            )
        })?;
        let ollama = instance.adapter.ollama().ok_or_else(|| {
            AdapterError::not_supported(&format!(
                "adapter {} is kind {}, not ollama",
                instance.spec.id,
                instance.kind()
            ))
        })?;
        Ok(ollama.clone())
    }
}
