//! SubmitRun: sends a `RunRequest` to a node and streams its `RunEvent`s back.
//!
//! A [`RunStream`] yields the run's events and ends with exactly one terminal: the node's,
//! or an error synthesized here when the node's connection is lost first. Dropping the
//! stream before its terminal cancels the run on the node, unless the run is background,
//! in which case it is drained to the event bus until it ends.
//!
//! A model-group run (one with an [`Observe`]) reports its provider's outcome for passive
//! ejection at its terminal.

use std::sync::Arc;

use iop_proto::pb;

use super::admission::{AdmitError, LeaseGuard};
use super::{CreditReturn, Edge, Observe};
use crate::events::{EdgeEvent, RunEventNotice};
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

/// Why a run, tunnel or command could not be started.
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
    #[error("could not send the request to node `{node}`: {reason}")]
    SendFailed { node: String, reason: String },
    #[error(transparent)]
    Admission(#[from] AdmitError),
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

    /// `SubmitRun`: sends the run to the named node (or the only ready one).
    pub async fn submit_run(
        self: &Arc<Self>,
        node: Option<&str>,
        spec: RunSpec,
    ) -> Result<RunStream, SubmitError> {
        let session = self.pick_node(node)?;
        self.start_run(session, spec, None, None).await
    }

    /// Sends a run on `session`. A `lease`, if given, is held until the run's terminal.
    pub(crate) async fn start_run(
        self: &Arc<Self>,
        session: Arc<NodeSession>,
        spec: RunSpec,
        lease: Option<LeaseGuard>,
        observe: Option<Observe>,
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
            inner: Some(RunInner {
                edge: self.clone(),
                credit: CreditReturn::new(&run_id),
                run_id,
                session,
                rx,
                finished: false,
                background: spec.background,
                lease,
                observe,
                served_model: None,
                first_token: false,
                owned,
                client_request_id: spec.client_request_id,
            }),
        })
    }
}

/// The event stream of one run.
#[derive(Debug)]
pub struct RunStream {
    inner: Option<RunInner>,
}

#[derive(Debug)]
struct RunInner {
    edge: Arc<Edge>,
    session: Arc<NodeSession>,
    run_id: String,
    rx: StreamReceiver<pb::RunEvent>,
    credit: CreditReturn,
    finished: bool,
    background: bool,
    lease: Option<LeaseGuard>,
    observe: Option<Observe>,
    /// The model the start event named, carried into the usage observation.
    served_model: Option<String>,
    /// A delta came (the first is the request's first token).
    first_token: bool,
    /// Whether `run_owners` holds this run (forgotten when the run is dropped).
    owned: bool,
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
    pub fn run_id(&self) -> &str {
        &self.inner.as_ref().expect("live stream").run_id
    }

    pub fn node_id(&self) -> &str {
        &self.inner.as_ref().expect("live stream").session.node_id
    }

    /// The next event; `None` after the terminal.
    pub async fn next(&mut self) -> Option<pb::RunEvent> {
        self.inner.as_mut()?.next().await
    }
}

impl RunInner {
    async fn next(&mut self) -> Option<pb::RunEvent> {
        if self.finished {
            return None;
        }
        let event = match self.rx.recv().await {
            Some(event) => event,
            None => {
                let reason = self
                    .session
                    .close_reason()
                    .unwrap_or_else(|| "the node stopped the stream".into());
                pb::RunEvent {
                    run_id: self.run_id.clone(),
                    kind: pb::RunEventKind::Error as i32,
                    error: Some(pb::RunError {
                        code: "node_disconnected".into(),
                        message: format!("node {} connection lost: {reason}", self.session.node_id),
                    }),
                    ..Default::default()
                }
            }
        };
        match event.kind() {
            pb::RunEventKind::Delta
            | pb::RunEventKind::ReasoningDelta
            | pb::RunEventKind::ToolCall => {
                self.credit.consumed_one(&self.edge, &self.session);
                if !self.first_token {
                    self.first_token = true;
                    if let Some(recorder) = self.observe.as_ref().and_then(|o| o.recorder.as_ref())
                    {
                        recorder.first_token();
                    }
                }
            }
            _ if event.is_terminal() => {
                self.finished = true;
                self.lease = None;
                if let Some(observe) = &self.observe {
                    self.edge.report_provider_outcome(
                        &observe.node_id,
                        &observe.provider_id,
                        crate::ejection::ProviderOutcome::of_run_terminal(&event),
                        super::admission::clock(),
                    );
                }
                if let (Some(observe), Some(usage)) = (&self.observe, &event.usage) {
                    let served = self.served_model.take();
                    self.edge.observe_usage(observe, "run", usage, served);
                }
                if let Some(recorder) = self.observe.as_ref().and_then(|o| o.recorder.as_ref()) {
                    recorder.stream_ended(terminal_error(&event));
                }
            }
            pb::RunEventKind::Start if !event.model.is_empty() => {
                self.served_model = Some(event.model.clone());
            }
            _ => {}
        }
        if self.edge.events.has_subscribers() {
            self.edge.events.publish(EdgeEvent::Run(RunEventNotice {
                node_id: self.session.node_id.clone(),
                run_id: self.run_id.clone(),
                kind: kind_name(event.kind()),
                text: event.text.clone(),
            }));
        }
        Some(event)
    }
}

impl Drop for RunStream {
    fn drop(&mut self) {
        let Some(mut inner) = self.inner.take() else {
            return;
        };
        if inner.finished {
            return;
        }
        if inner.background {
            let tasks = inner.edge.tasks().clone();
            tasks.spawn(async move { while inner.next().await.is_some() {} });
            return;
        }
        tracing::info!(node_id = %inner.session.node_id, run_id = %inner.run_id, request_id = %inner.client_request_id, "client went away: cancelling run");
        inner.session.close_stream(&inner.run_id);
        inner.edge.send_control(
            &inner.session.outbound,
            pb::CancelRequest::run(&inner.run_id, "client disconnected").into(),
        );
    }
}

/// The error code a run's terminal ended it with (`None`: it completed).
fn terminal_error(event: &pb::RunEvent) -> Option<&str> {
    match event.kind() {
        pb::RunEventKind::Complete => None,
        pb::RunEventKind::Cancelled => Some("cancelled"),
        _ => Some(
            event
                .error
                .as_ref()
                .map(|e| e.code.as_str())
                .filter(|c| !c.is_empty())
                .unwrap_or("provider_error"),
        ),
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
    }
}
