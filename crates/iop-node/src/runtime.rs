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
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::adapters::{self, Adapter};
use crate::health::{HealthSettings, ProbeTracker};
use crate::store::RunStore;
use crate::stream::StreamCredits;

/// How long a run or tunnel waits for a slot of its adapter's capacity gate before it is
/// refused. The edge admits against the same capacity and counts a slot free as soon as it
/// has sent the cancel of the stream that held it; that stream lets go of the slot a moment
/// later, once the node has handled the cancel, possibly after it read the next request.
/// Work beyond what the edge admitted is still refused, after this grace.
pub const SLOT_GRACE: Duration = Duration::from_millis(250);

/// One provider's adapter with its node-local capacity gate, shared by runs and tunnels.
#[derive(Debug)]
pub struct AdapterInstance {
    pub spec: pb::ProviderSpec,
    pub adapter: Arc<dyn Adapter>,
    pub gate: Arc<Semaphore>,
    pub usage: Mutex<UsageTotals>,
    /// What the provider's probes found.
    pub health: Mutex<ProbeTracker>,
    /// Stops the probe task when the instance is dropped.
    pub probe_stop: CancellationToken,
}

impl Drop for AdapterInstance {
    fn drop(&mut self) {
        self.probe_stop.cancel();
    }
}

impl AdapterInstance {
    pub fn max_concurrency(&self) -> u32 {
        self.spec.max_concurrency.max(1)
    }

    pub fn in_flight(&self) -> u32 {
        self.max_concurrency()
            .saturating_sub(self.gate.available_permits() as u32)
    }

    pub fn kind(&self) -> &'static str {
        adapters::kind_name(self.spec.kind())
    }

    /// Takes one slot of the capacity gate, waiting at most [`SLOT_GRACE`] for one to be
    /// let go; `None` when the adapter is still at its max concurrency.
    pub async fn acquire_slot(&self) -> Option<OwnedSemaphorePermit> {
        acquire_within(&self.gate, SLOT_GRACE).await
    }

    /// The error of a run or tunnel refused for capacity.
    pub fn at_capacity(&self) -> crate::adapters::AdapterError {
        crate::adapters::AdapterError::new(
            iop_proto::ErrorCode::NodeCapacity,
            format!(
                "adapter {} is at its max concurrency ({})",
                self.spec.id,
                self.max_concurrency()
            ),
        )
    }

    pub fn record_usage(&self, usage: Option<&pb::Usage>, tunnel: bool) {
        self.usage.lock().record(usage, tunnel);
    }
}

/// One permit of `gate`, at once or once one is let go within `grace`.
async fn acquire_within(gate: &Arc<Semaphore>, grace: Duration) -> Option<OwnedSemaphorePermit> {
    if let Ok(permit) = gate.clone().try_acquire_owned() {
        return Some(permit);
    }
    tokio::time::timeout(grace, gate.clone().acquire_owned())
        .await
        .ok()?
        .ok()
}

/// Token totals of one adapter since the node started.
#[derive(Debug, Clone, Default, Serialize)]
pub struct UsageTotals {
    pub runs: u64,
    pub tunnels: u64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub reasoning_tokens: u64,
    pub cached_input_tokens: u64,
}

impl UsageTotals {
    /// Counts one run or tunnel and its usage. Every sum saturates: a backend reporting
    /// `u64::MAX` pins a total at the maximum instead of wrapping it to a small number.
    pub fn record(&mut self, usage: Option<&pb::Usage>, tunnel: bool) {
        let count = if tunnel {
            &mut self.tunnels
        } else {
            &mut self.runs
        };
        *count = count.saturating_add(1);
        if let Some(u) = usage {
            let add = |total: &mut u64, n: u64| *total = total.saturating_add(n);
            add(&mut self.input_tokens, u.input_tokens);
            add(&mut self.output_tokens, u.output_tokens);
            add(&mut self.reasoning_tokens, u.reasoning_tokens.unwrap_or(0));
            add(
                &mut self.cached_input_tokens,
                u.cached_input_tokens.unwrap_or(0),
            );
        }
    }
}

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

/// What runs and tunnels of one connection share.
#[derive(Debug, Clone)]
pub struct Connection {
    pub outbound: Outbound,
    pub credits: Arc<StreamCredits>,
    /// Cancelled when the connection ends: every run and tunnel on it stops.
    pub cancel: CancellationToken,
    pub tasks: TaskTracker,
    /// Why the node stopped the connection's work ([`Connection::stop`]).
    stopped: Arc<Mutex<Option<String>>>,
}

impl Connection {
    pub fn new(outbound: Outbound) -> Self {
        Self {
            outbound,
            credits: Arc::new(StreamCredits::default()),
            cancel: CancellationToken::new(),
            tasks: TaskTracker::new(),
            stopped: Arc::default(),
        }
    }

    /// The node stops every run and tunnel of the connection, for `reason` (it shuts
    /// down, or the connection ended).
    pub fn stop(&self, reason: String) {
        self.stopped.lock().get_or_insert(reason);
        self.cancel.cancel();
    }

    /// Why the node stopped the connection's work, if it did: a run or tunnel cancelled
    /// for this was not cancelled by the edge, and ends as `node_disconnected`.
    pub fn stopped(&self) -> Option<String> {
        self.stopped.lock().clone()
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
    pub(crate) transport: Mutex<TransportStatus>,
    pub(crate) started: Instant,
    /// Bumped whenever a provider's settled health changes (or the adapters change).
    health_changed: watch::Sender<u64>,
    /// How long a tunnel waits for the provider's answer before it is acknowledged with
    /// an `accepted` frame ([`crate::tunnel::ACCEPT_GRACE`]).
    pub(crate) accept_grace: Duration,
}

/// A provider spec without its probe settings.
fn without_health(spec: &pb::ProviderSpec) -> pb::ProviderSpec {
    pb::ProviderSpec {
        health: None,
        ..spec.clone()
    }
}

/// Builds the HTTP clients all adapters share: pooled, `TCP_NODELAY`, no proxy from the
/// environment (providers sit next to the node).
pub fn http_clients() -> adapters::HttpClients {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let reqwest = reqwest::Client::builder()
        .tcp_nodelay(true)
        .no_proxy()
        .connect_timeout(Duration::from_secs(10))
        .pool_idle_timeout(Duration::from_secs(90))
        .build()
        .expect("a TLS backend is available");
    adapters::HttpClients { reqwest }
}

impl NodeRuntime {
    pub fn new(store: Option<RunStore>) -> Arc<Self> {
        Arc::new(Self {
            http: http_clients(),
            store,
            adapters: RwLock::new(HashMap::default()),
            node_id: RwLock::new(String::new()),
            runs: Mutex::new(HashMap::default()),
            tunnels: Mutex::new(HashMap::default()),
            transport: Mutex::new(TransportStatus::default()),
            started: Instant::now(),
            health_changed: watch::Sender::new(0),
            accept_grace: crate::tunnel::ACCEPT_GRACE,
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
        *self.adapters.write() = next;
        *self.node_id.write() = payload.node_id.clone();
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

    /// Cancels every active run and tunnel (local shutdown).
    pub fn cancel_all(&self, reason: &str) {
        for run in self.runs.lock().values() {
            *run.reason.lock() = Some(reason.to_string());
            run.cancel.cancel();
        }
        for tunnel in self.tunnels.lock().values() {
            tunnel.cancel();
        }
    }

    pub fn active_runs(&self) -> usize {
        self.runs.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_slot_let_go_within_the_grace_is_taken_and_a_held_one_is_refused() {
        let gate = Arc::new(Semaphore::new(1));
        let held = gate.clone().try_acquire_owned().unwrap();
        tokio::spawn(async move {
            tokio::time::sleep(SLOT_GRACE / 2).await;
            drop(held);
        });
        let permit = acquire_within(&gate, SLOT_GRACE).await;
        assert!(permit.is_some(), "a slot freed during the grace is taken");
        let started = tokio::time::Instant::now();
        assert!(acquire_within(&gate, SLOT_GRACE).await.is_none());
        assert_eq!(
            started.elapsed(),
            SLOT_GRACE,
            "refused once the grace is over"
        );
    }

    #[test]
    fn usage_totals_saturate_instead_of_wrapping() {
        let mut totals = UsageTotals::default();
        let huge = pb::Usage {
            input_tokens: u64::MAX,
            output_tokens: u64::MAX - 1,
            reasoning_tokens: Some(u64::MAX),
            cached_input_tokens: Some(3),
        };
        totals.record(Some(&huge), false);
        totals.record(
            Some(&pb::Usage {
                input_tokens: 5,
                output_tokens: 5,
                reasoning_tokens: Some(5),
                cached_input_tokens: Some(u64::MAX),
            }),
            false,
        );
        assert_eq!(totals.input_tokens, u64::MAX, "MAX + 5 stays MAX");
        assert_eq!(totals.output_tokens, u64::MAX);
        assert_eq!(totals.reasoning_tokens, u64::MAX);
        assert_eq!(totals.cached_input_tokens, u64::MAX);
        assert_eq!(totals.runs, 2);
        totals.tunnels = u64::MAX;
        totals.record(None, true);
        assert_eq!(totals.tunnels, u64::MAX);
        // Ordinary sums are exact.
        let mut small = UsageTotals::default();
        small.record(
            Some(&pb::Usage {
                input_tokens: 2,
                output_tokens: 3,
                ..Default::default()
            }),
            false,
        );
        small.record(
            Some(&pb::Usage {
                input_tokens: 4,
                output_tokens: 1,
                ..Default::default()
            }),
            true,
        );
        assert_eq!(
            (
                small.input_tokens,
                small.output_tokens,
                small.runs,
                small.tunnels
            ),
            (6, 4, 1, 1)
        );
    }

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
