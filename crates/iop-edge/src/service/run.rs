//! SubmitRun: sends a `RunRequest` to a node and streams its `RunEvent`s back.
//!
//! A [`RunStream`] yields the run's events and ends with exactly one terminal: the node's,
//! or an error synthesized here when the node's connection is lost first, when the node
//! does not acknowledge the run within the ack timeout, or when the run's provider stays
//! silent past its idle timeout once the run started. The node's `accepted` event is
//! consumed here and never shown.
//!
//! Dropping the stream before its terminal cancels the run on the node, unless the run is
//! background, in which case it is drained to the event bus until it ends. A cancelled
//! run keeps its provider slot until the node's terminal confirms the cancel (the node
//! frees its own slot first) or the ack timeout passes.
//!
//! Native runs (`POST /v1/runs`) take a slot on their provider too, through the
//! provider's own queue, so they count against the same capacity as model-group requests.
//!
//! A model-group run (one with an [`Observe`]) reports its provider's outcome for passive
//! ejection when it ends ([`Edge::attempt_finished`]).

use std::sync::Arc;

use iop_proto::ErrorCode;
use iop_proto::pb;

use super::admission::{AdmitError, LeaseGuard, Target};
use super::stream::{Deadlines, Expired, RequestMeter, StreamLimits};
use super::{CreditReturn, Edge, Observe};
use crate::events::{EdgeEvent, RunEventNotice};
use crate::lease::{Lane, ProviderKey};
use crate::session::{NodeSession, STREAM_WINDOW, StreamReceiver};

/// A surface-neutral run submission.
#[derive(Debug, Clone, Default)]
pub struct RunSpec {
    pub adapter: String,
    pub target: String,
    pub input: String,
    pub messages: Vec<pb::ChatMessage>,
    pub options: Option<pb::GenerationOptions>,
    pub session_id: String,
    pub background: bool,
    /// The name of the API key that started the run; only it (and admins) may cancel it.
    pub owner: Option<String>,
    /// The client's request id (`x-request-id`), for the node's logs.
    pub client_request_id: String,
    /// Headers the adapter adds to its provider requests (see [`crate::http::forward`]).
    pub provider_headers: Vec<pb::Header>,
}

/// Why a run, tunnel or command could not be started or failed before it began.
#[derive(Debug, Clone, thiserror::Error)]
pub enum SubmitError {
    #[error("no node is connected and ready")]
    NoReadyNode,
    #[error("several nodes are ready ({}); say which one with `node`", .0.join(", "))]
    AmbiguousNode(Vec<String>),
    #[error("node `{0}` is not configured")]
    UnknownNode(String),
    #[error("node `{0}` is not connected and ready")]
    NodeNotReady(String),
    #[error("node `{node}` has no adapter `{adapter}` (its providers: {known})")]
    UnknownAdapter {
        node: String,
        adapter: String,
        known: String,
    },
    #[error("could not send the request to node `{node}`: {reason}")]
    SendFailed { node: String, reason: String },
    /// The node, or the provider behind it, failed the request before it began.
    #[error("{message}")]
    Failed { code: ErrorCode, message: String },
    #[error(transparent)]
    Admission(#[from] AdmitError),
}

impl SubmitError {
    /// The typed reason.
    pub fn code(&self) -> ErrorCode {
        match self {
            SubmitError::NoReadyNode | SubmitError::NodeNotReady(_) => ErrorCode::NodeUnavailable,
            SubmitError::AmbiguousNode(_) => ErrorCode::BadRequest,
            SubmitError::UnknownNode(_) | SubmitError::UnknownAdapter { .. } => ErrorCode::NotFound,
            SubmitError::SendFailed { .. } => ErrorCode::NodeDisconnected,
            SubmitError::Failed { code, .. } => *code,
            SubmitError::Admission(e) => e.code(),
        }
    }

    /// A run's error terminal (or its absence) as a failure.
    pub fn of_run_error(error: Option<&pb::RunError>) -> Self {
        match error {
            Some(e) => SubmitError::Failed {
                code: e.error_code(),
                message: e.message.clone(),
            },
            None => SubmitError::Failed {
                code: ErrorCode::ProviderError,
                message: "the run failed without a reason".into(),
            },
        }
    }
}

impl Edge {
    /// Picks the node for a run: the one named, or the only ready node.
    pub fn pick_node(&self, node: Option<&str>) -> Result<Arc<NodeSession>, SubmitError> {
        match node {
            Some(id) => self.session(id).ok_or_else(|| {
                if self.config().nodes.iter().any(|n| n.id == id) {
                    SubmitError::NodeNotReady(id.to_string())
                } else {
                    SubmitError::UnknownNode(id.to_string())
                }
            }),
            None => {
                let mut ready = self.ready_sessions();
                match ready.len() {
                    0 => Err(SubmitError::NoReadyNode),
                    1 => Ok(ready.remove(0)),
                    _ => Err(SubmitError::AmbiguousNode(
                        ready.iter().map(|s| s.node_id.clone()).collect(),
                    )),
                }
            }
        }
    }

    /// `SubmitRun`: takes a slot on the run's provider (waiting in that provider's queue
    /// like any request) and sends the run to the named node (or the only ready one).
    pub async fn submit_run(
        self: &Arc<Self>,
        node: Option<&str>,
        spec: RunSpec,
    ) -> Result<RunStream, SubmitError> {
        let node_id = self.pick_node(node)?.node_id.clone();
        let config = self.config();
        let Some(provider) = super::provider_of(&config, &node_id, &spec.adapter) else {
            let known = config
                .nodes
                .iter()
                .find(|n| n.id == node_id)
                .map(|n| {
                    n.providers
                        .iter()
                        .map(|p| p.id.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                })
                .unwrap_or_default();
            return Err(SubmitError::UnknownAdapter {
                node: node_id,
                adapter: spec.adapter,
                known,
            });
        };
        if !provider.enabled {
            return Err(SubmitError::Failed {
                code: ErrorCode::NotFound,
                message: format!(
                    "adapter `{}` of node `{node_id}` is disabled in the edge config",
                    spec.adapter
                ),
            });
        }
        let lane = if provider.capacity.normal > 0 {
            Lane::Normal
        } else {
            Lane::Long
        };
        let key = ProviderKey::new(&node_id, &spec.adapter);
        let limits = StreamLimits {
            ack_timeout: config.dispatch.ack_timeout(),
            idle_timeout: provider.idle_timeout(),
        };
        drop(config);
        let admitted = self
            .admission
            .acquire(Target::Provider(&key), lane, &[], None)
            .await?;
        let session = match self.session(&node_id) {
            Some(s) if s.generation == admitted.grant.generation => s,
            _ => return Err(SubmitError::NodeNotReady(node_id)),
        };
        self.start_run(session, spec, Some(admitted.guard), None, limits)
            .await
    }

    /// Sends a run on `session`. A `lease`, if given, is held until the run's terminal.
    pub(crate) async fn start_run(
        self: &Arc<Self>,
        session: Arc<NodeSession>,
        spec: RunSpec,
        lease: Option<LeaseGuard>,
        observe: Option<Observe>,
        limits: StreamLimits,
    ) -> Result<RunStream, SubmitError> {
        let run_id = self.new_id();
        let send_failed = |reason: String| SubmitError::SendFailed {
            node: session.node_id.clone(),
            reason,
        };
        let rx = session
            .open_run(&run_id)
            .map_err(|e| send_failed(e.to_string()))?;
        let request = pb::RunRequest {
            run_id: run_id.clone(),
            adapter: spec.adapter.clone(),
            target: spec.target.clone(),
            input: spec.input,
            messages: spec.messages,
            options: spec.options,
            session_id: spec.session_id.clone(),
            background: spec.background,
            initial_credit: STREAM_WINDOW,
            client_request_id: spec.client_request_id.clone(),
            provider_headers: spec.provider_headers,
        };
        if session.outbound.send(request).await.is_err() {
            session.close_stream(&run_id);
            // `lease` drops here: a send failure returns the slot.
            return Err(send_failed("the connection closed".into()));
        }
        tracing::debug!(node_id = %session.node_id, %run_id, adapter = %spec.adapter, request_id = %spec.client_request_id, "run sent");
        let owned = match spec.owner {
            Some(owner) => {
                self.run_owners.lock().insert(run_id.clone(), owner);
                true
            }
            None => false,
        };
        Ok(RunStream {
            replay: None,
            inner: Some(RunInner {
                edge: self.clone(),
                credit: CreditReturn::new(&run_id),
                run_id,
                session,
                rx,
                deadlines: Deadlines::new(limits),
                ended: false,
                done: false,
                cancel_sent: false,
                background: spec.background,
                lease,
                observe,
                served_model: None,
                owned,
                failure: None,
                meter: None,
                concluded: false,
                client_request_id: spec.client_request_id,
            }),
        })
    }
}

/// The event stream of one run.
#[derive(Debug)]
pub struct RunStream {
    inner: Option<RunInner>,
    /// An event the dispatcher already read (the first), returned again first.
    replay: Option<Box<pb::RunEvent>>,
}

#[derive(Debug)]
struct RunInner {
    edge: Arc<Edge>,
    session: Arc<NodeSession>,
    run_id: String,
    rx: StreamReceiver<pb::RunEvent>,
    credit: CreditReturn,
    deadlines: Deadlines,
    /// The node's terminal arrived, or the route is gone.
    ended: bool,
    /// The consumer has seen a terminal.
    done: bool,
    cancel_sent: bool,
    background: bool,
    lease: Option<LeaseGuard>,
    observe: Option<Observe>,
    /// The model the start event named, carried into the usage observation.
    served_model: Option<String>,
    /// Whether `run_owners` holds this run (forgotten when the run is dropped).
    owned: bool,
    /// Why the consumer gave the run up, when it did (see [`RunStream::fail`]).
    failure: Option<ErrorCode>,
    meter: Option<RequestMeter>,
    concluded: bool,
    /// The client's request id (`x-request-id`), for log lines.
    client_request_id: String,
}

impl Drop for RunInner {
    fn drop(&mut self) {
        if self.owned {
            self.edge.run_owners.lock().remove(&self.run_id);
        }
    }
}

impl RunStream {
    fn inner_mut(&mut self) -> &mut RunInner {
        self.inner.as_mut().expect("live stream")
    }

    pub fn run_id(&self) -> &str {
        &self.inner.as_ref().expect("live stream").run_id
    }

    pub fn node_id(&self) -> &str {
        &self.inner.as_ref().expect("live stream").session.node_id
    }

    /// The next event; `None` after the terminal.
    pub async fn next(&mut self) -> Option<pb::RunEvent> {
        if let Some(event) = self.replay.take() {
            return Some(*event);
        }
        self.inner.as_mut()?.next().await
    }

    /// Puts back `first`, the event the dispatcher waited for: [`Self::next`] returns it
    /// again, for a surface that reads the run from its start.
    pub fn replay_first(&mut self, first: pb::RunEvent) {
        self.replay = Some(Box::new(first));
    }

    /// Makes this run's metrics the client request's.
    pub fn set_meter(&mut self, mut meter: RequestMeter) {
        meter.set_path("run");
        self.inner_mut().meter = Some(meter);
    }

    /// Says why the consumer gives the run up (before dropping it): what the metrics and
    /// the attempt report record instead of `client_abort`.
    pub fn fail(&mut self, code: ErrorCode) {
        let inner = self.inner_mut();
        if inner.failure.is_none() && !inner.ended {
            inner.failure = Some(code);
        }
    }
}

impl RunInner {
    fn error_event(&self, code: ErrorCode, message: String) -> pb::RunEvent {
        pb::RunEvent {
            run_id: self.run_id.clone(),
            kind: pb::RunEventKind::Error as i32,
            error: Some(pb::RunError::new(code, message)),
            ..Default::default()
        }
    }

    async fn next(&mut self) -> Option<pb::RunEvent> {
        let event = loop {
            if self.done {
                return None;
            }
            match self.deadlines.recv(&mut self.rx).await {
                Ok(Some(event)) if event.kind() == pb::RunEventKind::Accepted => {
                    self.deadlines.acknowledged();
                }
                Ok(Some(event)) => break event,
                Ok(None) => {
                    let reason = self
                        .session
                        .close_reason()
                        .unwrap_or_else(|| "the node stopped the stream".into());
                    break self.error_event(
                        ErrorCode::NodeDisconnected,
                        format!("node {} connection lost: {reason}", self.session.node_id),
                    );
                }
                Err(expired) => {
                    let limits = self.deadlines.limits();
                    let message = match expired {
                        Expired::Ack => format!(
                            "node {} did not acknowledge the run within {:.1}s",
                            self.session.node_id,
                            limits.ack_timeout.as_secs_f64()
                        ),
                        Expired::Idle => format!(
                            "the provider sent nothing for {}s (its idle_timeout_sec)",
                            limits.idle_timeout.as_secs()
                        ),
                    };
                    let code = expired.code();
                    tracing::warn!(node_id = %self.session.node_id, run_id = %self.run_id, code = code.as_str(), "{message}");
                    self.failure = Some(code);
                    self.done = true;
                    self.conclude(Some(code));
                    self.send_cancel("deadline passed");
                    let event = self.error_event(code, message);
                    self.publish(&event);
                    return Some(event);
                }
            }
        };
        self.deadlines.acknowledged();
        match event.kind() {
            pb::RunEventKind::Delta
            | pb::RunEventKind::ReasoningDelta
            | pb::RunEventKind::ToolCall => {
                self.deadlines.began();
                self.credit.consumed_one(&self.edge, &self.session);
                if let Some(meter) = &mut self.meter {
                    meter.first_token();
                }
            }
            _ if event.is_terminal() => {
                self.ended = true;
                self.done = true;
                self.lease = None;
                if let (Some(observe), Some(usage)) = (&self.observe, &event.usage) {
                    let served = self.served_model.take();
                    self.edge.observe_usage(observe, "run", usage, served);
                }
                let failure = match event.kind() {
                    pb::RunEventKind::Complete => None,
                    pb::RunEventKind::Cancelled => Some(ErrorCode::Cancelled),
                    _ => Some(
                        event
                            .error
                            .as_ref()
                            .map(pb::RunError::error_code)
                            .unwrap_or(ErrorCode::ProviderError),
                    ),
                };
                self.conclude(self.failure.or(failure));
            }
            pb::RunEventKind::Start => {
                self.deadlines.began();
                if !event.model.is_empty() {
                    self.served_model = Some(event.model.clone());
                }
            }
            _ => {}
        }
        self.publish(&event);
        Some(event)
    }

    fn publish(&self, event: &pb::RunEvent) {
        if self.edge.events.has_subscribers() {
            self.edge.events.publish(EdgeEvent::Run(RunEventNotice {
                node_id: self.session.node_id.clone(),
                run_id: self.run_id.clone(),
                kind: kind_name(event.kind()),
                text: event.text.clone(),
            }));
        }
    }

    /// Records the outcome once: the request's metrics and the attempt's report.
    fn conclude(&mut self, failure: Option<ErrorCode>) {
        if self.concluded {
            return;
        }
        self.concluded = true;
        if let Some(meter) = &mut self.meter {
            meter.finish(failure);
        }
        if let Some(observe) = &self.observe {
            self.edge
                .attempt_finished(&observe.node_id, &observe.provider_id, failure, None);
        }
    }

    fn send_cancel(&mut self, reason: &str) {
        if self.cancel_sent || self.ended {
            return;
        }
        self.cancel_sent = true;
        self.edge.send_control(
            &self.session.outbound,
            pb::CancelRequest::run(&self.run_id, reason).into(),
        );
    }

    /// After a cancel: takes the node's events until its terminal (which comes once the
    /// node freed its slot), up to the ack timeout, then returns the slot.
    async fn drain(mut self) {
        let bound = self.deadlines.limits().ack_timeout;
        let confirmed = tokio::time::timeout(bound, async {
            while let Some(event) = self.rx.recv().await {
                if event.is_terminal() {
                    return true;
                }
            }
            true
        })
        .await
        .unwrap_or(false);
        if !confirmed {
            tracing::warn!(node_id = %self.session.node_id, run_id = %self.run_id, "the node did not confirm the run's cancel within {:.1}s: its slot is returned anyway", bound.as_secs_f64());
            self.session.close_stream(&self.run_id);
        }
        self.ended = true;
        self.lease = None;
    }
}

impl Drop for RunStream {
    fn drop(&mut self) {
        let Some(mut inner) = self.inner.take() else {
            return;
        };
        if inner.ended {
            return;
        }
        let tasks = inner.edge.tasks().clone();
        if inner.background && !inner.done {
            tasks.spawn(async move { while inner.next().await.is_some() {} });
            return;
        }
        let failure = inner.failure.unwrap_or(ErrorCode::ClientAbort);
        inner.conclude(Some(failure));
        if !inner.cancel_sent {
            match failure {
                ErrorCode::ClientAbort => {
                    tracing::info!(node_id = %inner.session.node_id, run_id = %inner.run_id, request_id = %inner.client_request_id, "client went away: cancelling run")
                }
                other => {
                    tracing::info!(node_id = %inner.session.node_id, run_id = %inner.run_id, request_id = %inner.client_request_id, reason = other.as_str(), "run given up: cancelling it on the node")
                }
            }
        }
        inner.send_cancel(match failure {
            ErrorCode::ClientAbort => "client disconnected",
            other => other.as_str(),
        });
        if inner.lease.is_none() {
            inner.session.close_stream(&inner.run_id);
            return;
        }
        tasks.spawn(inner.drain());
    }
}

pub fn kind_name(kind: pb::RunEventKind) -> &'static str {
    match kind {
        pb::RunEventKind::Unspecified => "unspecified",
        pb::RunEventKind::Start => "start",
        pb::RunEventKind::Delta => "delta",
        pb::RunEventKind::ReasoningDelta => "reasoning_delta",
        pb::RunEventKind::Complete => "complete",
        pb::RunEventKind::Error => "error",
        pb::RunEventKind::Cancelled => "cancelled",
        pb::RunEventKind::ToolCall => "tool_call",
        pb::RunEventKind::Accepted => "accepted",
    }
}
