//! The edge service: the authoritative owner of node lifecycle (register → ready → lost),
//! the dispatch-ready sessions, admission, request dispatch, and the event bus. The
//! transport feeds it connection events; the HTTP surfaces hand it parsed requests
//! ([`dispatch`], runs, commands) and render what comes back.
//!
//! Node loss is handled here, on one path, not through the event bus: the registry fences
//! the generation, the session's streams end with an error, the generation's leases are
//! returned once and the waiters it leaves without a candidate end unavailable.

pub mod accounting;
pub mod admission;
pub mod answer;
pub mod command;
pub mod credentials;
pub mod dispatch;
pub mod errors;
pub mod health;
pub mod pipeline;
pub mod plan;
pub mod reload;
pub mod route;
pub mod run;
mod snapshot;
pub mod stream;
#[cfg(test)]
pub(crate) mod test_support;
pub mod tunnel;

use std::collections::HashMap;
use std::sync::Arc;

use iop_proto::Outbound;
use iop_proto::pb;
use parking_lot::{Mutex, RwLock};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::auth::KeyTable;
use crate::config::{EdgeConfig, ProviderConfig};
use crate::events::{EventBus, NodeEventKind};
use crate::key_limits::KeyLimiter;
use crate::ledger::day_tokens::{DAY_MS, DayTokens, day_of};
use crate::ledger::live::LiveWindow;
use crate::ledger::{Ledger, unix_ms_now};
use crate::metrics::Metrics;
use crate::payload::build_payload;
use crate::queue::Scheduler;
use crate::registry::{
    ClaimError, DisconnectOutcome, Generation, OwnerState, ReadyOutcome, Registry,
};
use crate::retry_budget::{BudgetPolicy, RetryBudget};
use crate::session::{NodeSession, STREAM_WINDOW};
use crate::throttle::{FailureThrottle, ThrottlePolicy};
use crate::trust::join::JoinError;
use crate::trust::{Link, TrustStore};
use admission::AdmissionControl;
use credentials::{ConnectionControl, LinkEntry};

pub use run::RunStream;
pub use tunnel::{TunnelHead, TunnelItem, TunnelStream};

/// Why a registration was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rejection {
    UnknownToken,
    Duplicate {
        node_id: String,
    },
    ConfigBuild {
        node_id: String,
        message: String,
    },
    Protocol(String),
    /// Too many bad credentials from the connection's address lately.
    Throttled {
        retry_after: std::time::Duration,
    },
    /// A certificate named a node the config does not have.
    UnknownNode {
        node_id: String,
    },
    /// An admin revoked the node's credentials.
    Revoked {
        node_id: String,
    },
    /// The join token was refused.
    JoinToken(JoinError),
    /// The node's credential could not be checked or issued (a bad request from it).
    Credential(String),
    /// The edge could not do its part (e.g. save state); retrying may help.
    Unavailable(String),
}

impl Rejection {
    pub fn wire_reason(&self) -> pb::RegisterRejectReason {
        match self {
            Rejection::UnknownToken => pb::RegisterRejectReason::UnknownToken,
            Rejection::Duplicate { .. } => pb::RegisterRejectReason::DuplicateConnection,
            Rejection::ConfigBuild { .. } => pb::RegisterRejectReason::ConfigBuildFailed,
            Rejection::Protocol(_) => pb::RegisterRejectReason::Protocol,
            Rejection::Throttled { .. } => pb::RegisterRejectReason::Throttled,
            // A credential the edge cannot accept will not become acceptable by retrying.
            Rejection::UnknownNode { .. } | Rejection::Credential(_) => {
                pb::RegisterRejectReason::UnknownToken
            }
            Rejection::Revoked { .. } => pb::RegisterRejectReason::Revoked,
            Rejection::JoinToken(JoinError::Unknown) => pb::RegisterRejectReason::UnknownToken,
            Rejection::JoinToken(JoinError::Expired { .. }) => {
                pb::RegisterRejectReason::JoinTokenExpired
            }
            Rejection::JoinToken(JoinError::UsedUp { .. }) => {
                pb::RegisterRejectReason::JoinTokenUsedUp
            }
            Rejection::Unavailable(_) => pb::RegisterRejectReason::Unspecified,
        }
    }

    /// A credential (static token, join token, client certificate) was checked and
    /// refused: counts against the source address in the node listener's throttle.
    pub fn is_refused_credential(&self) -> bool {
        matches!(
            self,
            Rejection::UnknownToken
                | Rejection::UnknownNode { .. }
                | Rejection::Revoked { .. }
                | Rejection::JoinToken(_)
                | Rejection::Credential(_)
        )
    }

    /// A refusal anyone can provoke without holding a real credential (a guessed token or
    /// join token, a malformed credential): reported in the listener's periodic summary,
    /// not one line each. Refusals that need a real credential (revoked, an expired or
    /// used-up join token, a certificate naming an unknown node) are logged each time.
    pub fn is_guess(&self) -> bool {
        matches!(
            self,
            Rejection::UnknownToken
                | Rejection::JoinToken(JoinError::Unknown)
                | Rejection::Credential(_)
        )
    }

    /// The credential was good and the registration failed for another reason.
    pub fn credential_was_good(&self) -> bool {
        matches!(
            self,
            Rejection::Duplicate { .. } | Rejection::ConfigBuild { .. } | Rejection::Unavailable(_)
        )
    }

    pub fn node_id(&self) -> &str {
        match self {
            Rejection::Duplicate { node_id }
            | Rejection::ConfigBuild { node_id, .. }
            | Rejection::UnknownNode { node_id }
            | Rejection::Revoked { node_id }
            | Rejection::JoinToken(JoinError::Expired { node_id })
            | Rejection::JoinToken(JoinError::UsedUp { node_id, .. }) => node_id,
            _ => "",
        }
    }
}

impl std::fmt::Display for Rejection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Rejection::UnknownToken => write!(f, "unknown node token"),
            Rejection::Duplicate { node_id } => write!(
                f,
                "duplicate connection: node {node_id} already has a live connection"
            ),
            Rejection::ConfigBuild { message, .. } => {
                write!(f, "config payload build failed: {message}")
            }
            Rejection::Protocol(message) => write!(f, "protocol error: {message}"),
            Rejection::Throttled { retry_after } => write!(
                f,
                "too many bad node credentials from this address: retry in {:.1}s",
                retry_after.as_secs_f64()
            ),
            Rejection::UnknownNode { node_id } => write!(
                f,
                "unknown node: the certificate names node {node_id:?}, which is not in the edge config"
            ),
            Rejection::Revoked { node_id } => write!(
                f,
                "node {node_id}'s credentials were revoked by an admin; it needs a new join token (or a new certificate or token) to register again"
            ),
            Rejection::JoinToken(e) => write!(f, "join token refused: {e}"),
            Rejection::Credential(message) => write!(f, "credential refused: {message}"),
            Rejection::Unavailable(message) => {
                write!(f, "the edge cannot register nodes right now: {message}")
            }
        }
    }
}

/// An accepted registration.
#[derive(Debug)]
pub struct Registered {
    pub node_id: String,
    pub payload: pb::NodeConfigPayload,
    /// The credential issued to a node that registered with a join token.
    pub credential: Option<pb::NodeCredential>,
}

pub struct Edge {
    config: RwLock<Arc<EdgeConfig>>,
    /// The configured API keys (empty: the API is open).
    keys: RwLock<Arc<KeyTable>>,
    /// Wrong API keys per source address: growing waits and a periodic summary.
    key_failures: Mutex<FailureThrottle>,
    /// The API key that started each live run (runs of keyed callers only).
    run_owners: Mutex<foldhash::HashMap<String, String>>,
    /// The config payload version each node was last sent.
    sent_config: Mutex<HashMap<String, u64>>,
    registry: Mutex<Registry>,
    /// Dispatch-ready sessions by node id (current generation only).
    sessions: RwLock<foldhash::HashMap<String, Arc<NodeSession>>>,
    pub admission: Arc<AdmissionControl>,
    /// Retries allowed over the last window (`dispatch.retry_budget_*`).
    retry_budget: Mutex<RetryBudget>,
    pub events: EventBus,
    pub metrics: Metrics,
    tasks: TaskTracker,
    shutdown: CancellationToken,
    ids: IdGenerator,
    /// The CA, join tokens and revocations (`None`: no state directory, e.g. unit tests).
    trust: Option<Arc<TrustStore>>,
    /// How each node's current connection reached the edge and what it registered with.
    links: Mutex<HashMap<String, LinkEntry>>,
    /// The node listener's bound address and the pin nodes verify it by.
    node_listener: Mutex<Option<credentials::NodeListenerInfo>>,
    /// The durable usage ledger (off in unit tests and with `ledger.enabled: false`).
    ledger: Ledger,
    /// The last minute of requests per model group.
    live: Mutex<LiveWindow>,
    /// Per-key limits: request windows, concurrency and today's tokens.
    limiter: Arc<Mutex<KeyLimiter>>,
}

/// Ids for runs, tunnels and commands: 128 random bits each (32 hex digits) from a
/// thread-local CSPRNG seeded by the OS, so an id says nothing about any other id and
/// cannot be guessed; no syscall per id.
#[derive(Debug, Default)]
struct IdGenerator;

impl IdGenerator {
    fn next(&self) -> String {
        format!("{:032x}", rand::random::<u128>())
    }
}

/// How wrong API keys from one address are slowed down: the first waits a quarter second
/// before the next attempt, each further one twice as long up to 30 s; five quiet minutes
/// forget the address.
pub const KEY_FAILURE_POLICY: ThrottlePolicy = ThrottlePolicy {
    base_delay: std::time::Duration::from_millis(250),
    max_delay: std::time::Duration::from_secs(30),
    forgive_after: std::time::Duration::from_secs(300),
    max_tracked: 65_536,
};

impl std::fmt::Debug for Edge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Edge").finish_non_exhaustive()
    }
}

impl Edge {
    pub fn new(config: EdgeConfig) -> Arc<Self> {
        Self::with_trust(config, None)
    }

    /// An edge whose node credentials, join tokens and revocations live in `trust`.
    pub fn with_trust(config: EdgeConfig, trust: Option<Arc<TrustStore>>) -> Arc<Self> {
        Self::with_ledger(config, trust, Ledger::disabled())
    }

    /// An edge that records requests in `ledger` (today's tokens per key are read from it).
    pub fn with_ledger(
        config: EdgeConfig,
        trust: Option<Arc<TrustStore>>,
        ledger: Ledger,
    ) -> Arc<Self> {
        let now_ms = unix_ms_now();
        let today = ledger.tokens_since(day_of(now_ms) * DAY_MS);
        let registry = Registry::new(reload::token_records(&config));
        let plan = plan::AdmissionPlan::of(&config);
        let mut scheduler = Scheduler::new(plan.providers, plan.groups);
        scheduler.set_ejection_policy(plan.ejection);
        let metrics = Metrics::new();
        metrics.set_model_groups(config.model_groups.iter().map(|g| g.name.as_str()));
        metrics.set_api_keys(config.auth.keys.iter().map(|k| k.name.as_str()));
        let retry_budget = Mutex::new(RetryBudget::new(
            budget_policy(&config.dispatch),
            crate::retry_budget::WINDOW,
        ));
        Arc::new(Edge {
            metrics,
            keys: RwLock::new(Arc::new(KeyTable::from_config(&config.auth))),
            key_failures: Mutex::new(FailureThrottle::new(KEY_FAILURE_POLICY)),
            run_owners: Mutex::new(foldhash::HashMap::default()),
            config: RwLock::new(Arc::new(config)),
            sent_config: Mutex::new(HashMap::new()),
            registry: Mutex::new(registry),
            sessions: RwLock::new(foldhash::HashMap::default()),
            admission: AdmissionControl::new(scheduler, plan.policies),
            retry_budget,
            events: EventBus::default(),
            tasks: TaskTracker::new(),
            shutdown: CancellationToken::new(),
            ids: IdGenerator,
            trust,
            links: Mutex::new(HashMap::new()),
            node_listener: Mutex::new(None),
            ledger,
            live: Mutex::new(LiveWindow::new(std::time::Instant::now())),
            limiter: Arc::new(Mutex::new(KeyLimiter::new(DayTokens::loaded(
                now_ms, today,
            )))),
        })
    }

    /// A fresh id for a run, tunnel or command.
    pub fn new_id(&self) -> String {
        self.ids.next()
    }

    /// The current config (replaced as a whole by a reload).
    pub fn config(&self) -> Arc<EdgeConfig> {
        self.config.read().clone()
    }

    /// The configured API keys.
    pub fn keys(&self) -> Arc<KeyTable> {
        self.keys.read().clone()
    }

    /// The throttle of wrong API keys by source address.
    pub fn key_failures(&self) -> parking_lot::MutexGuard<'_, FailureThrottle> {
        self.key_failures.lock()
    }

    /// The API key that started a live run, if a keyed caller did.
    pub fn run_owner(&self, run_id: &str) -> Option<String> {
        self.run_owners.lock().get(run_id).cloned()
    }

    pub fn tasks(&self) -> &TaskTracker {
        &self.tasks
    }

    pub fn shutdown_token(&self) -> &CancellationToken {
        &self.shutdown
    }

    pub fn provider(&self, node: &str, provider: &str) -> Option<ProviderConfig> {
        provider_of(&self.config(), node, provider).cloned()
    }

    /// A fresh generation for an accepted connection.
    pub fn next_generation(&self) -> Generation {
        self.registry.lock().next_generation()
    }

    /// Handles a `RegisterRequest` arriving over `link`: authenticates the node (client
    /// certificate, join token or static token), claims pending ownership and builds its
    /// config payload; a join also issues the node its credential. Publishes registered /
    /// rejected, except for a refused credential: the transport reports those, summarized
    /// (guesses come in floods).
    pub fn register(
        &self,
        request: &pb::RegisterRequest,
        link: &Link,
        generation: Generation,
        peer: &str,
        control: ConnectionControl,
    ) -> Result<Registered, Rejection> {
        let result = self.authenticate_and_claim(request, link, generation, control);
        match &result {
            Ok(r) => {
                tracing::info!(node_id = %r.node_id, %generation, peer, link = link.name(), joined = r.credential.is_some(), "node registered (pending ready)");
                self.events
                    .node_event(&r.node_id, NodeEventKind::Registered, "", peer);
            }
            Err(rejection) if rejection.is_guess() => {}
            Err(rejection) => self.rejected(rejection, peer),
        }
        result
    }

    /// Claims pending ownership of an authenticated node and builds its config payload.
    fn claim(&self, node_id: &str, generation: Generation) -> Result<Registered, Rejection> {
        let mut registry = self.registry.lock();
        registry
            .claim_node(node_id, generation)
            .map_err(|e| match e {
                ClaimError::UnknownToken => Rejection::UnknownNode {
                    node_id: node_id.to_string(),
                },
                ClaimError::Duplicate { node_id } => Rejection::Duplicate { node_id },
            })?;
        let node_id = node_id.to_string();
        let config = self.config();
        // The config is swapped before the registry on a reload: a node the registry
        // still knows may have left the config, and is refused like an unknown one.
        let Some(node) = config.nodes.iter().find(|n| n.id == node_id) else {
            registry.disconnect(&node_id, generation);
            return Err(Rejection::UnknownNode { node_id });
        };
        match build_payload(node, &config.health, config.max_frame_bytes) {
            Ok(payload) => {
                self.sent_config
                    .lock()
                    .insert(node_id.clone(), payload.config_version);
                Ok(Registered {
                    node_id,
                    payload,
                    credential: None,
                })
            }
            Err(message) => {
                registry.disconnect(&node_id, generation);
                Err(Rejection::ConfigBuild { node_id, message })
            }
        }
    }

    /// Logs and publishes a refused registration.
    pub fn rejected(&self, rejection: &Rejection, peer: &str) {
        tracing::warn!(node_id = rejection.node_id(), peer, reason = %rejection, "node registration rejected");
        self.events.node_event(
            rejection.node_id(),
            NodeEventKind::Rejected,
            &rejection.to_string(),
            peer,
        );
    }

    /// Handles a `NodeReadyRequest`. The first ready of the current generation makes the
    /// node dispatch-ready, brings its providers online and serves queued waiters.
    pub fn ready(
        &self,
        node_id: &str,
        generation: Generation,
        outbound: &Outbound,
        kick: &CancellationToken,
        peer: &str,
    ) -> ReadyOutcome {
        let outcome = {
            let mut registry = self.registry.lock();
            let outcome = registry.ready(node_id, generation);
            if outcome == ReadyOutcome::Activated {
                let session = Arc::new(
                    NodeSession::new(
                        node_id.to_string(),
                        generation,
                        peer.to_string(),
                        outbound.clone(),
                        kick.clone(),
                    )
                    .with_stream_budget(self.config().limits.nodes.stream_buffer_bytes),
                );
                self.sessions.write().insert(node_id.to_string(), session);
            }
            outcome
        };
        match outcome {
            ReadyOutcome::Activated => {
                self.refresh_if_stale(node_id, outbound);
                self.admission.node_ready(node_id, generation);
                tracing::info!(node_id, %generation, peer, "node ready");
                self.events
                    .node_event(node_id, NodeEventKind::Ready, "", peer);
            }
            ReadyOutcome::AlreadyReady => {
                tracing::debug!(node_id, %generation, "duplicate ready acknowledged");
            }
            ReadyOutcome::Refused => {
                tracing::warn!(node_id, %generation, "stale ready refused");
            }
        }
        outcome
    }

    /// Sends a node the current config when a reload happened between its registration and
    /// its ready (it would otherwise serve the old providers until the next reload).
    fn refresh_if_stale(&self, node_id: &str, outbound: &Outbound) {
        let config = self.config();
        let Some(node) = config.nodes.iter().find(|n| n.id == node_id) else {
            return;
        };
        let Ok(payload) = build_payload(node, &config.health, config.max_frame_bytes) else {
            return;
        };
        let mut sent = self.sent_config.lock();
        if sent.get(node_id) != Some(&payload.config_version) {
            sent.insert(node_id.to_string(), payload.config_version);
            outbound.try_send(pb::ConfigRefresh {
                config: Some(payload),
            });
            tracing::info!(
                node_id,
                "config changed while the node registered: refresh sent"
            );
        }
    }

    /// A connection ended. For the node's current generation: fence it, end its streams,
    /// return its leases and end waiters it leaves without a candidate. Stale: nothing.
    pub fn connection_lost(&self, node_id: &str, generation: Generation, reason: &str) {
        let outcome = self.registry.lock().disconnect(node_id, generation);
        {
            let mut links = self.links.lock();
            if links
                .get(node_id)
                .is_some_and(|l| l.generation == generation)
            {
                links.remove(node_id);
            }
        }
        let DisconnectOutcome::Current { was_ready } = outcome else {
            tracing::debug!(node_id, %generation, reason, "stale disconnect ignored");
            return;
        };
        let mut returned = 0;
        if was_ready {
            let session = {
                let mut sessions = self.sessions.write();
                match sessions.get(node_id) {
                    Some(s) if s.generation == generation => sessions.remove(node_id),
                    _ => None,
                }
            };
            if let Some(session) = session {
                session.close(reason);
            }
            returned = self.admission.node_lost(node_id, generation, reason);
        }
        tracing::warn!(node_id, %generation, reason, leases_returned = returned, "node disconnected");
        self.events
            .node_event(node_id, NodeEventKind::Disconnected, reason, "");
    }

    /// The node's dispatch-ready session, if it has one.
    pub fn session(&self, node_id: &str) -> Option<Arc<NodeSession>> {
        self.sessions.read().get(node_id).cloned()
    }

    pub fn ready_sessions(&self) -> Vec<Arc<NodeSession>> {
        let mut sessions: Vec<_> = self.sessions.read().values().cloned().collect();
        sessions.sort_by(|a, b| a.node_id.cmp(&b.node_id));
        sessions
    }

    pub fn owner_state(&self, node_id: &str) -> OwnerState {
        self.registry.lock().state(node_id)
    }

    /// Queues a control frame (cancel, credit) without waiting; if the queue is full it is
    /// sent from a tracked task.
    pub fn send_control(&self, outbound: &Outbound, envelope: pb::Envelope) {
        if outbound.is_closed() {
            return;
        }
        if !outbound.try_send(envelope.clone()) {
            let outbound = outbound.clone();
            self.tasks.spawn(async move {
                let _ = outbound.send(envelope).await;
            });
        }
    }
}

/// The retry budget a dispatch config asks for.
pub(crate) fn budget_policy(config: &crate::config::DispatchConfig) -> BudgetPolicy {
    BudgetPolicy {
        percent: config.retry_budget_percent,
        min: config.retry_budget_min,
    }
}

pub(crate) fn provider_of<'a>(
    config: &'a EdgeConfig,
    node: &str,
    provider: &str,
) -> Option<&'a ProviderConfig> {
    config
        .nodes
        .iter()
        .find(|n| n.id == node)?
        .providers
        .iter()
        .find(|p| p.id == provider)
}

/// Counts consumed data frames of one stream and returns credit to the node in batches.
#[derive(Debug)]
pub(crate) struct CreditReturn {
    stream_id: String,
    consumed: u32,
}

impl CreditReturn {
    pub(crate) fn new(stream_id: &str) -> Self {
        Self {
            stream_id: stream_id.to_string(),
            consumed: 0,
        }
    }

    pub(crate) fn consumed_one(&mut self, edge: &Edge, session: &NodeSession) {
        self.consumed += 1;
        if self.consumed >= STREAM_WINDOW / 2 {
            edge.send_control(
                &session.outbound,
                pb::StreamCredit {
                    stream_id: self.stream_id.clone(),
                    frames: self.consumed,
                }
                .into(),
            );
            self.consumed = 0;
        }
    }
}
