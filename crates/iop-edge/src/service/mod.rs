//! The edge service: the authoritative owner of node lifecycle (register → ready → lost),
//! the dispatch-ready sessions, admission, request dispatch, and the event bus. The
//! transport feeds it connection events; the HTTP surfaces hand it decoded requests
//! ([`pipeline`]: admission, then dispatch or a run; commands) and render what comes back.
//!
//! [`Edge`] is a composition of parts, each with its own locks and its own tests:
//! [`configs`] (the config served and the file's, and the lock that applies one at a
//! time), [`nodes`] (ownership, sessions, links, the config each node was sent), [`keys`]
//! (the key table, the wrong-key throttle, per-key limits, run owners), [`dispatch_state`]
//! (admission, the retry budget, ids), [`telemetry`] (metrics, events, the ledger, the live
//! window) and [`provider_models`] (the Ollama providers' own models and the fleet's model
//! pulls); beside them the edge's lifetime (tasks, shutdown, drain), the fleet, trust and
//! permit reports. New state goes into a part, not onto `Edge`. The modules beside them
//! are the edge's operations over those parts.
//!
//! Node loss is handled here, on one path, not through the event bus: the registry fences
//! the generation, the session's streams end with an error, the generation's leases are
//! returned once and the waiters it leaves without a candidate end unavailable.

pub mod accounting;
pub mod admission;
pub mod answer;
pub mod command;
pub mod configs;
pub mod credentials;
pub mod dispatch;
pub mod dispatch_state;
mod errors;
pub mod fleet;
pub mod health;
pub mod keys;
pub mod model_jobs;
pub mod models;
pub mod nodes;
pub mod permit_reports;
pub mod permits;
pub mod pipeline;
pub mod plan;
pub mod provider_models;
pub mod reload;
pub mod route;
pub mod run;
mod snapshot;
pub mod stream;
pub mod telemetry;
#[cfg(test)]
pub(crate) mod test_support;
pub mod token_count;
pub mod tunnel;

use std::sync::Arc;

use iop_proto::Outbound;
use iop_proto::pb;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::{EdgeConfig, ProviderConfig};
use crate::day_tokens::{DAY_MS, DayTokens, day_of};
use crate::events::NodeEventKind;
use crate::join::JoinError;
use crate::ledger::{Ledger, unix_ms_now};
use crate::payload::build_payload;
use crate::registry::{ClaimError, Generation, ReadyOutcome};
use crate::session::{NodeSession, STREAM_WINDOW};
use crate::trust::{Link, TrustStore};
use dispatch_state::DispatchState;
use keys::Keys;
use nodes::ConnectionControl;
use nodes::{Lost, Nodes};
use telemetry::Telemetry;

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
                | Rejection::Protocol(_)
        )
    }

    /// A refusal anyone can provoke without holding a real credential (a guessed token or
    /// join token, a malformed credential or registration, e.g. a join without a CSR):
    /// reported in the listener's periodic summary, not one line each. Refusals that need
    /// a real credential (revoked, an expired or used-up join token, a certificate naming
    /// an unknown node) are logged each time.
    pub fn is_guess(&self) -> bool {
        matches!(
            self,
            Rejection::UnknownToken
                | Rejection::JoinToken(JoinError::Unknown)
                | Rejection::Credential(_)
                | Rejection::Protocol(_)
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

/// The edge service: the config, and the parts it owns — each behind its own locks.
pub struct Edge {
    /// The config served and the file's, and the lock that applies one at a time.
    pub(crate) configs: configs::Configs,
    /// Node ownership, sessions, links and the config each node was sent.
    pub(crate) nodes: Nodes,
    /// API keys: the table, wrong-key throttle, limits, run owners.
    pub(crate) keys: Keys,
    /// Admission, the retry budget and ids.
    pub(crate) dispatcher: DispatchState,
    /// Metrics, events, the ledger and the live window.
    pub telemetry: Telemetry,
    tasks: TaskTracker,
    shutdown: CancellationToken,
    /// Whether the edge drains before a stop, and the client requests in progress.
    pub(crate) drain: Arc<crate::drain::Drain>,
    /// The fleet's live edges, read from the shared store (set when `store` is configured).
    pub(crate) fleet: std::sync::OnceLock<Arc<crate::store::edges::Fleet>>,
    /// The CA, join tokens and revocations (`None`: no state directory, e.g. unit tests).
    trust: Option<Arc<TrustStore>>,
    /// What this edge last told each node granting it permits.
    permit_reports: permit_reports::PermitReports,
    /// The Ollama providers' own models: held, loaded, pulls across the fleet.
    pub(crate) provider_models: provider_models::ProviderModels,
}

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
        let today = DayTokens::loaded(now_ms, ledger.tokens_since(day_of(now_ms) * DAY_MS));
        Arc::new(Edge {
            nodes: Nodes::new(nodes::token_records(&config)),
            keys: Keys::new(&config.auth, today),
            dispatcher: DispatchState::new(&config),
            telemetry: Telemetry::new(&config, ledger),
            provider_models: Default::default(),
            configs: configs::Configs::new(config),
            tasks: TaskTracker::new(),
            shutdown: CancellationToken::new(),
            drain: Arc::default(),
            fleet: std::sync::OnceLock::new(),
            trust,
            permit_reports: Default::default(),
        })
    }

    /// A fresh id for a run, tunnel or command.
    pub fn new_id(&self) -> String {
        self.dispatcher.new_id()
    }

    /// The current config (replaced as a whole by a reload).
    pub fn config(&self) -> Arc<EdgeConfig> {
        self.configs.served()
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

    /// Handles a `RegisterRequest` arriving over `link`: authenticates the node (client
    /// certificate, join token or static token), claims pending ownership and builds its
    /// config payload; a join also issues the node its credential. Publishes registered /
    /// rejected, except for a refused credential: the transport reports those, summarized
    /// (guesses come in floods).
    pub async fn register(
        &self,
        request: &pb::RegisterRequest,
        link: &Link,
        generation: Generation,
        peer: &str,
        control: ConnectionControl,
    ) -> Result<Registered, Rejection> {
        let result = self
            .authenticate_and_claim(request, link, generation, control)
            .await;
        match &result {
            Ok(r) => {
                tracing::info!(node_id = %r.node_id, %generation, peer, link = link.name(), joined = r.credential.is_some(), "node registered (pending ready)");
                self.telemetry
                    .events
                    .node_event(&r.node_id, NodeEventKind::Registered, "", peer);
            }
            Err(rejection) if rejection.is_guess() => {}
            Err(rejection) => self.rejected(rejection, peer),
        }
        result
    }

    /// Claims pending ownership of an authenticated node and builds its config payload.
    fn claim(&self, node_id: &str, generation: Generation) -> Result<Registered, Rejection> {
        self.nodes.claim(node_id, generation).map_err(|e| match e {
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
            self.nodes.unclaim(&node_id, generation);
            return Err(Rejection::UnknownNode { node_id });
        };
        match build_payload(
            node,
            &config.health,
            config.max_frame_bytes,
            &config.dispatch,
        ) {
            Ok(payload) => {
                self.nodes.config_sent(&node_id, payload.config_version);
                Ok(Registered {
                    node_id,
                    payload,
                    credential: None,
                })
            }
            Err(message) => {
                self.nodes.unclaim(&node_id, generation);
                Err(Rejection::ConfigBuild { node_id, message })
            }
        }
    }

    /// Logs and publishes a refused registration.
    pub fn rejected(&self, rejection: &Rejection, peer: &str) {
        tracing::warn!(node_id = rejection.node_id(), peer, reason = %rejection, "node registration rejected");
        self.telemetry.events.node_event(
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
        let stream_budget = self.config().limits.nodes.stream_buffer_bytes;
        let outcome = self.nodes.ready(node_id, generation, || {
            NodeSession::new(
                node_id.to_string(),
                generation,
                peer.to_string(),
                outbound.clone(),
                kick.clone(),
            )
            .with_stream_budget(stream_budget)
        });
        match outcome {
            ReadyOutcome::Activated => {
                self.refresh_if_stale(node_id, outbound);
                self.dispatcher.admission.node_ready(node_id, generation);
                self.provider_models.mark_stale();
                tracing::info!(node_id, %generation, peer, "node ready");
                self.telemetry
                    .events
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

    /// The node is back (its ready was answered): its new session adopts the streams
    /// parked when it was lost, and the node is asked to go on with each.
    pub fn resume_parked(&self, node_id: &str) {
        let parked = self.nodes.parked().take_parked(node_id);
        if parked.is_empty() {
            return;
        }
        let Some(session) = self.nodes.session(node_id) else {
            return;
        };
        let frames = session.adopt(parked);
        tracing::info!(
            node_id,
            streams = frames.len(),
            "node back: re-attaching its requests"
        );
        for frame in frames {
            self.send_control(&session.outbound, frame);
        }
    }

    /// Sends a node the current config when a reload happened between its registration and
    /// its ready (it would otherwise serve the old providers until the next reload).
    fn refresh_if_stale(&self, node_id: &str, outbound: &Outbound) {
        let config = self.config();
        let Some(node) = config.nodes.iter().find(|n| n.id == node_id) else {
            return;
        };
        let Ok(payload) = build_payload(
            node,
            &config.health,
            config.max_frame_bytes,
            &config.dispatch,
        ) else {
            return;
        };
        if self.nodes.config_sent(node_id, payload.config_version) {
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
        let Lost::Current { session } = self.nodes.lose(node_id, generation) else {
            tracing::debug!(node_id, %generation, reason, "stale disconnect ignored");
            return;
        };
        let mut returned = 0;
        let mut parked = 0;
        if let Some(session) = session {
            parked = self.park_streams(node_id, &session, reason);
            returned = self
                .dispatcher
                .admission
                .node_lost(node_id, generation, reason);
        }
        self.forget_permit_reports(node_id, generation);
        tracing::warn!(node_id, %generation, reason, leases_returned = returned, streams_waiting = parked, "node disconnected");
        self.telemetry
            .events
            .node_event(node_id, NodeEventKind::Disconnected, reason, "");
    }

    /// Closes a lost session. With a re-attach wait its streams are parked for the node's
    /// next session (their consumers wait); those still parked when the wait ends are
    /// given up. Returns how many were parked.
    fn park_streams(&self, node_id: &str, session: &NodeSession, reason: &str) -> usize {
        let wait = self.config().dispatch.reattach_wait();
        if wait.is_zero() {
            session.close(reason);
            return 0;
        }
        let streams = session.close_detaching(reason);
        let count = streams.len();
        if count == 0 {
            return 0;
        }
        let parked = self.nodes.parked().clone();
        let parking = parked.park(node_id, streams);
        let node_id = node_id.to_string();
        let shutdown = self.shutdown.clone();
        self.tasks.spawn(async move {
            // An edge that shuts down does not wait for the node: its clients are going.
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = shutdown.cancelled() => {}
            }
            let ended = parked.give_up(&node_id, parking);
            if ended > 0 {
                tracing::warn!(node_id, streams = ended, wait_sec = wait.as_secs(), "the node did not come back within the re-attach wait: its requests end (they may have run)");
            }
        });
        count
    }

    /// The node's dispatch-ready session, if it has one.
    pub fn session(&self, node_id: &str) -> Option<Arc<NodeSession>> {
        self.nodes.session(node_id)
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

    /// One data frame was consumed: every half window, the credit to send back (counted
    /// in `progress`, which a re-attach reports).
    pub(crate) fn consumed_one(
        &mut self,
        progress: &crate::session::StreamProgress,
    ) -> Option<pb::StreamCredit> {
        self.consumed += 1;
        if self.consumed < STREAM_WINDOW / 2 {
            return None;
        }
        progress.credited(self.consumed);
        let frames = std::mem::take(&mut self.consumed);
        Some(pb::StreamCredit {
            stream_id: self.stream_id.clone(),
            frames,
        })
    }
}
