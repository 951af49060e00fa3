//! Node commands, handled apart from runs: `capabilities`, `transport`, `usage`,
//! `sessions`, `runs` (recent rows of the run store, at most [`MAX_RUNS_LISTED`], and the
//! store's counters), for OpenAI-compatible adapters `tokens.count` (args `body` and `api`:
//! a prompt counted with the provider's tokenizer, see `adapters::token_count`) and
//! `models.show` (arg `model`: what its `/v1/models` says of it, see
//! `adapters::model_info`), and for ollama adapters the `ollama.*` family ([`ollama`]:
//! queries, and pull, delete, copy, create, load, unload).

mod ollama;

use iop_proto::ErrorCode;
use iop_proto::pb;
use serde_json::{Value, json};

use crate::adapters::AdapterError;
use crate::runtime::NodeRuntime;

/// Rows the `runs` command returns at most (its `limit` is clamped to this).
pub const MAX_RUNS_LISTED: usize = 1000;

/// The answer to `request`: its result, or its error.
fn response(
    request: &pb::NodeCommandRequest,
    result: Result<Value, AdapterError>,
) -> pb::NodeCommandResponse {
    match result {
        Ok(value) => pb::NodeCommandResponse {
            command_id: request.command_id.clone(),
            ok: true,
            result_json: value.to_string(),
            error: None,
        },
        Err(e) => pb::NodeCommandResponse {
            command_id: request.command_id.clone(),
            ok: false,
            result_json: String::new(),
            error: Some(e.to_wire()),
        },
    }
}

impl NodeRuntime {
    pub async fn command(&self, request: &pb::NodeCommandRequest) -> pb::NodeCommandResponse {
        response(request, self.run_command(request).await)
    }

    /// The answer to a command refused because the connection runs
    /// [`crate::runtime::MAX_COMMANDS_PER_LINK`] already.
    pub fn busy(request: &pb::NodeCommandRequest) -> pb::NodeCommandResponse {
        let error = AdapterError::new(
            ErrorCode::NodeCapacity,
            format!(
                "the node runs {} commands for this edge already; try again when one ends",
                crate::runtime::MAX_COMMANDS_PER_LINK
            ),
        );
        response(request, Err(error))
    }

    async fn run_command(&self, request: &pb::NodeCommandRequest) -> Result<Value, AdapterError> {
        match request.name.as_str() {
            "capabilities" => Ok(self.capabilities()),
            "transport" => Ok(self.transport_status()),
            "usage" => Ok(self.usage_status()),
            "sessions" => Ok(self.session_list()),
            "runs" => {
                let limit = request
                    .args
                    .get("limit")
                    .and_then(|l| l.parse::<usize>().ok())
                    .unwrap_or(50)
                    .clamp(1, MAX_RUNS_LISTED);
                let (rows, stats) = match &self.store {
                    Some(store) => (store.recent(limit).await, Some(store.stats())),
                    None => (Vec::new(), None),
                };
                Ok(json!({"runs": rows, "store": stats}))
            }
            name if name.starts_with("ollama.") => self.ollama_command(request).await,
            "models.show" => {
                let provider = self.tunnel_provider(request)?;
                let model = request.args.get("model").ok_or_else(|| {
                    AdapterError::new(ErrorCode::BadRequest, "models.show needs `model`")
                })?;
                crate::adapters::model_info::show(&provider, model).await
            }
            "tokens.count" => {
                let provider = self.tunnel_provider(request)?;
                let body = request.args.get("body").cloned().ok_or_else(|| {
                    AdapterError::new(ErrorCode::BadRequest, "tokens.count needs `body` (JSON)")
                })?;
                let api = request.args.get("api").map_or("chat", String::as_str);
                crate::adapters::token_count::count(&provider, api, body).await
            }
            other => Err(AdapterError::new(
                ErrorCode::BadRequest,
                format!(
                    "unknown command {other:?}; commands are capabilities, transport, usage, sessions, runs, tokens.count, models.show, and ollama.tags, ollama.ps, ollama.show, ollama.pull, ollama.delete, ollama.copy, ollama.create, ollama.load, ollama.unload, ollama.jobs"
                ),
            )),
        }
    }

    /// The HTTP endpoint of the adapter `request` names, which must be OpenAI-compatible.
    fn tunnel_provider(
        &self,
        request: &pb::NodeCommandRequest,
    ) -> Result<crate::adapters::HttpProvider, AdapterError> {
        let instance = self.adapter(&request.adapter).ok_or_else(|| {
            AdapterError::new(
                ErrorCode::NotFound,
                format!(
                    "node {} has no adapter {:?}",
                    self.node_id(),
                    request.adapter
                ),
            )
        })?;
        match instance.adapter.tunnel() {
            Some(tunnel) => Ok(tunnel.provider.clone()),
            None => Err(AdapterError::not_supported(&format!(
                "{} on adapter {} (kind {}, not OpenAI-compatible)",
                request.name,
                instance.spec.id,
                instance.kind()
            ))),
        }
    }

    fn capabilities(&self) -> Value {
        let adapters: Vec<Value> = self
            .adapters()
            .iter()
            .map(|a| {
                json!({
                    "id": a.spec.id,
                    "kind": a.kind(),
                    "max_concurrency": a.max_concurrency(),
                    "in_flight": a.in_flight(),
                    "tunnel": a.adapter.tunnel().is_some(),
                    "sessions": a.adapter.supports_sessions(),
                })
            })
            .collect();
        json!({
            "node_id": self.node_id(),
            "version": env!("CARGO_PKG_VERSION"),
            "adapters": adapters,
        })
    }

    fn transport_status(&self) -> Value {
        let t = self.transport.lock().clone();
        json!({
            "edge": t.edge,
            "state": t.state,
            "sessions_started": t.sessions_started,
            "connected_since_ms": t.connected_since_ms,
            "last_error": t.last_error,
            "heartbeat": {
                "interval_sec": iop_proto::HEARTBEAT_INTERVAL.as_secs(),
                "timeout_sec": iop_proto::HEARTBEAT_TIMEOUT.as_secs(),
            },
            "active_runs": self.active_runs(),
            "active_tunnels": self.tunnels.lock().len(),
            "journal": {
                "streams": self.journal.len(),
                "kept_bytes": self.journal.kept_bytes(),
                "reattach_wait_ms": self.journal.wait().as_millis() as u64,
                "resume_keep_ms": self.journal.keep().as_millis() as u64,
            },
        })
    }

    fn usage_status(&self) -> Value {
        let adapters: serde_json::Map<String, Value> = self
            .adapters()
            .iter()
            .map(|a| (a.spec.id.clone(), json!(a.usage.lock().clone())))
            .collect();
        json!({"since_sec": self.started.elapsed().as_secs(), "adapters": adapters})
    }

    fn session_list(&self) -> Value {
        let sessions: Vec<Value> = self
            .adapters()
            .iter()
            .flat_map(|a| {
                let id = a.spec.id.clone();
                a.adapter.sessions().into_iter().map(move |s| {
                    json!({"adapter": id, "target": s.target, "session_id": s.session_id, "pid": s.pid, "age_sec": s.age_sec, "idle_sec": s.idle_sec})
                })
            })
            .collect();
        json!({"sessions": sessions})
    }
}
