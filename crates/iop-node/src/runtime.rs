//! The node's long-lived state, kept across connections: the adapter instances built from
//! the edge's config, the active runs and tunnels, the run store and usage totals.
//!
//! Adapter instances are stable: applying a config keeps the instance (and so its capacity
//! gate, CLI sessions and probe history) of every provider whose spec did not change,
//! across config refreshes and reconnects alike (a change of its probe settings alone keeps
//! it too). Each instance is probed by a task of its
//! own (`probe`); a change of any provider's health bumps [`NodeRuntime::health_changed`].

use foldhash::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use iop_proto::Outbound;
use iop_proto::pb;
use parking_lot::{Mutex, RwLock};
use serde::Serialize;
use tokio::sync::{Semaphore, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::adapters;
use crate::health::HealthSettings;
use crate::instance::{AdapterInstance, UsageTotals};
use crate::journal::{Journal, LinkMarks, LinkOut};
use crate::store::RunStore;

/// What the `transport` command reports.
#[derive(Debug, Clone, Default, Serialize)]
pub struct TransportStatus {
    pub edge: String,
    pub state: &'static str,
    pub sessions_started: u64,
    pub connected_since_ms: Option<i64>,
    pub last_error: Option<String>,
}

/// An active run, for cancel.
#[derive(Debug)]
pub struct ActiveRun {
    pub cancel: CancellationToken,
    pub reason: Arc<Mutex<Option<String>>>,
}

/// The edge's commands (lookups, token counts, model jobs' controls) one connection
/// runs at once; one more is answered `node_capacity` at once, never queued.
pub const MAX_COMMANDS_PER_LINK: usize = 64;

/// What runs and tunnels of one connection share.
#[derive(Debug, Clone)]
pub struct Connection {
    /// Names the connection in the journal (unique in the process).
    pub id: u64,
    pub outbound: Outbound,
    /// Its heartbeat pings sent and answered (the journal forgets ended streams by them).
    pub marks: Arc<LinkMarks>,
    /// Cancelled when the connection ends: its commands stop (its runs and tunnels are
    /// the journal's: they go on detached, see [`crate::journal`]).
    pub cancel: CancellationToken,
    /// The link this connection is in the node's permits (0 before it is ready).
    pub link: crate::permits::LinkId,
    pub tasks: TaskTracker,
    /// Places for the edge's commands running at once on this connection
    /// ([`MAX_COMMANDS_PER_LINK`]).
    pub commands: Arc<tokio::sync::Semaphore>,
    /// Why the node stopped the connection's work ([`Connection::stop`]).
    stopped: Arc<Mutex<Option<String>>>,
}

impl Connection {
    pub fn new(outbound: Outbound) -> Self {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Self {
            id: NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            outbound,
            marks: Arc::default(),
            cancel: CancellationToken::new(),
            link: 0,
            tasks: TaskTracker::new(),
            commands: Arc::new(tokio::sync::Semaphore::new(MAX_COMMANDS_PER_LINK)),
            stopped: Arc::default(),
        }
    }

    /// The node stops the connection's commands, for `reason` (it shuts down, or the
    /// connection ended).
    pub fn stop(&self, reason: String) {
        self.stopped.lock().get_or_insert(reason);
        self.cancel.cancel();
    }

    /// This connection as the journal's streams go out on it.
    pub fn link_out(&self) -> LinkOut {
        LinkOut {
            id: self.id,
            outbound: self.outbound.clone(),
            marks: self.marks.clone(),
        }
    }
}

#[derive(Debug)]
pub struct NodeRuntime {
    pub(crate) http: adapters::HttpClients,
    pub(crate) store: Option<RunStore>,
    adapters: RwLock<HashMap<String, Arc<AdapterInstance>>>,
    node_id: RwLock<String>,
    pub(crate) runs: Mutex<HashMap<String, ActiveRun>>,
    pub(crate) tunnels: Mutex<HashMap<String, CancellationToken>>,
    /// Every run and tunnel, kept across links ([`crate::journal`]).
    pub(crate) journal: Journal,
    pub(crate) transport: Mutex<TransportStatus>,
    pub(crate) started: Instant,
    /// Bumped whenever a provider's settled health changes (or the adapters change).
    health_changed: watch::Sender<u64>,
    /// How long a tunnel waits for the provider's answer before it is acknowledged with
    /// an `accepted` frame ([`ACCEPT_GRACE`]).
    pub(crate) accept_grace: Duration,
    /// The fleet's edges and this node's links to them.
    pub(crate) fleet: crate::fleet::Fleet,
    /// How many requests each linked edge may have in flight per provider.
    pub(crate) permits: Arc<crate::permit_desk::PermitDesk>,
    /// Model pulls on the Ollama providers, which outlive the commands that start them.
    pub(crate) model_jobs: Arc<crate::model_jobs::ModelJobs>,
}

/// How long a tunnel that passed its gate waits for the provider's answer to acknowledge
/// it (the answer's first frame does); past this, a separate `accepted` frame goes out.
pub const ACCEPT_GRACE: Duration = Duration::from_millis(10);

/// What a panic said, if it said it as text (a run or tunnel that panicked ends with it).
pub fn panic_message(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("no message")
}

/// A provider spec without its probe settings.
fn without_health(spec: &pb::ProviderSpec) -> pb::ProviderSpec {
    pb::ProviderSpec {
        health: None,
        ..spec.clone()
    }
}

impl NodeRuntime {
    pub fn new(store: Option<RunStore>) -> Arc<Self> {
        Arc::new(Self {
            http: adapters::http_clients(),
            store,
            adapters: RwLock::new(HashMap::default()),
            node_id: RwLock::new(String::new()),
            runs: Mutex::new(HashMap::default()),
            tunnels: Mutex::new(HashMap::default()),
            journal: Journal::default(),
            transport: Mutex::new(TransportStatus::default()),
            started: Instant::now(),
            health_changed: watch::Sender::new(0),
            accept_grace: ACCEPT_GRACE,
            fleet: crate::fleet::Fleet::default(),
            permits: Arc::default(),
            model_jobs: Arc::default(),
        })
    }

    pub fn node_id(&self) -> String {
        self.node_id.read().clone()
    }

    pub fn adapter(&self, id: &str) -> Option<Arc<AdapterInstance>> {
        self.adapters.read().get(id).cloned()
    }

    pub fn adapters(&self) -> Vec<Arc<AdapterInstance>> {
        let mut all: Vec<_> = self.adapters.read().values().cloned().collect();
        all.sort_by(|a, b| a.spec.id.cmp(&b.spec.id));
        all
    }

    pub fn adapter_ids(&self) -> Vec<String> {
        self.adapters().iter().map(|a| a.spec.id.clone()).collect()
    }

    /// Applies a config payload: builds every provider's adapter (keeping unchanged
    /// instances) or, if any provider is invalid, changes nothing and says which.
    pub fn apply(&self, payload: &pb::NodeConfigPayload) -> Result<(), String> {
        let current = self.adapters.read().clone();
        let mut next = HashMap::default();
        for (i, spec) in payload.providers.iter().enumerate() {
            if let Some(existing) = current.get(&spec.id) {
                if existing.spec == *spec {
                    next.insert(spec.id.clone(), existing.clone());
                    continue;
                }
                // Only the probe settings changed: keep the instance (its gate, sessions
                // and probe history) and probe it the new way from the next probe on.
                if without_health(&existing.spec) == without_health(spec) {
                    existing
                        .health
                        .lock()
                        .set_settings(HealthSettings::of(spec.health.as_ref()));
                    next.insert(spec.id.clone(), existing.clone());
                    continue;
                }
            }
            let adapter = adapters::build(spec, &self.http)
                .map_err(|e| format!("providers[{i}] ({}): {e}", spec.id))?;
            let permits = spec.max_concurrency.max(1) as usize;
            next.insert(
                spec.id.clone(),
                Arc::new(AdapterInstance {
                    spec: spec.clone(),
                    adapter,
                    gate: Arc::new(Semaphore::new(permits)),
                    usage: Mutex::new(UsageTotals::default()),
                    health: Mutex::new(crate::probe::tracker_for(spec)),
                    probe_stop: CancellationToken::new(),
                }),
            );
        }
        let kept = next
            .iter()
            .filter(|(id, a)| current.get(*id).is_some_and(|c| Arc::ptr_eq(c, a)))
            .count();
        tracing::info!(
            node_id = %payload.node_id,
            providers = next.len(),
            kept,
            version = payload.config_version,
            "config applied"
        );
        for (id, instance) in &next {
            if !current.get(id).is_some_and(|c| Arc::ptr_eq(c, instance)) {
                crate::probe::start(instance, self.health_changed.clone());
            }
        }
        let capacities: Vec<(String, u32)> = next
            .values()
            .map(|a| (a.spec.id.clone(), a.max_concurrency()))
            .collect();
        *self.adapters.write() = next;
        self.permits.configure(&capacities);
        *self.node_id.write() = payload.node_id.clone();
        self.journal
            .set_wait(Duration::from_millis(payload.reattach_wait_ms.into()));
        self.journal
            .set_keep(Duration::from_millis(payload.resume_keep_ms.into()));
        // Replaced instances start over (unknown, or healthy for the mock): say so.
        self.health_changed.send_modify(|n| *n = n.wrapping_add(1));
        Ok(())
    }

    /// Subscribes to health changes: the receiver sees a change whenever some provider's
    /// reportable health may differ from what was last read.
    pub fn watch_health(&self) -> watch::Receiver<u64> {
        self.health_changed.subscribe()
    }

    /// Every provider's health as the node reports it.
    pub fn health_reports(&self) -> Vec<pb::ProviderHealth> {
        self.adapters()
            .iter()
            .map(|a| a.health.lock().report(&a.spec.id))
            .collect()
    }

    pub fn active_runs(&self) -> usize {
        self.runs.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn payload(interval_ms: u32, max_concurrency: u32) -> pb::NodeConfigPayload {
        pb::NodeConfigPayload {
            node_id: "n".into(),
            providers: vec![pb::ProviderSpec {
                id: "agent".into(),
                kind: pb::ProviderKind::Cli as i32,
                max_concurrency,
                cli: Some(pb::CliSpec {
                    argv: vec!["cat".into()],
                    ..Default::default()
                }),
                health: Some(pb::HealthCheckSpec {
                    interval_ms,
                    ..Default::default()
                }),
                ..Default::default()
            }],
            config_version: 1,
            reattach_wait_ms: 0,
            resume_keep_ms: 0,
        }
    }

    #[tokio::test]
    async fn a_change_of_probe_settings_alone_keeps_the_adapter_instance() {
        let runtime = NodeRuntime::new(None);
        runtime.apply(&payload(1000, 2)).unwrap();
        let first = runtime.adapter("agent").unwrap();
        runtime.apply(&payload(250, 2)).unwrap();
        let second = runtime.adapter("agent").unwrap();
        assert!(
            Arc::ptr_eq(&first, &second),
            "same gate, sessions and probe history"
        );
        assert_eq!(
            second.health.lock().settings().interval,
            Duration::from_millis(250)
        );
        runtime.apply(&payload(250, 3)).unwrap();
        let third = runtime.adapter("agent").unwrap();
        assert!(
            !Arc::ptr_eq(&second, &third),
            "another limit is another instance"
        );
        drop((first, second));
        assert_eq!(runtime.health_reports().len(), 1);
    }
}
