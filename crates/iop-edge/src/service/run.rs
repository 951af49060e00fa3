//! SubmitRun: sends a `RunRequest` to a node and streams its `RunEvent`s back.
//!
//! A [`RunStream`] yields the run's events and ends with exactly one terminal: the node's,
//! or an error synthesized here (numbered after the last event the node sent) when the
//! node's connection is lost first, when the node does not acknowledge the run within the
//! ack timeout, or when the run's provider stays silent past its idle timeout once the run
//! started. The node's `accepted` event is consumed here and never shown.
//!
//! Dropping the stream before its terminal cancels the run on the node, unless the run is
//! background, in which case it is drained until it ends. A cancelled run keeps its
//! provider slot until the node's terminal confirms the cancel (the node frees its own
//! slot first) or the ack timeout passes ([`StreamCore`]).

use std::sync::Arc;

use iop_proto::ErrorCode;
use iop_proto::pb;

use super::Edge;
use super::errors::SubmitError;
use super::stream::{Live, StreamCore, StreamItem, StreamKind, StreamTerms};
use crate::codec::RunSpec;
use crate::session::{NodeSession, STREAM_WINDOW, SessionClosed, StreamReceiver};

impl StreamItem for pb::RunEvent {
    const KIND: StreamKind = StreamKind::Run;

    fn open(session: &NodeSession, id: &str) -> Result<StreamReceiver<Self>, SessionClosed> {
        session.open_run(id)
    }

    fn is_last(&self) -> bool {
        self.is_terminal()
    }

    fn observation(&mut self) -> (Option<pb::Usage>, Option<String>) {
        let model = (self.kind() == pb::RunEventKind::Start && !self.model.is_empty())
            .then(|| self.model.clone());
        (self.usage, model)
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
                let mut ready = self.nodes.ready_sessions();
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

    /// Sends a run on `session`. The terms' lease, if any, is held until the run's
    /// terminal.
    pub(crate) async fn start_run(
        self: &Arc<Self>,
        session: Arc<NodeSession>,
        spec: RunSpec,
        terms: StreamTerms,
    ) -> Result<RunStream, SubmitError> {
        let client_request_id = spec.client_request_id.clone();
        let owner = spec.owner.clone();
        let background = spec.background;
        let adapter = spec.adapter.clone();
        let core = self
            .open_stream(session, client_request_id, terms, |run_id| pb::RunRequest {
                run_id,
                adapter: spec.adapter,
                target: spec.target,
                input: spec.input,
                messages: spec.messages,
                options: spec.options,
                session_id: spec.session_id,
                background: spec.background,
                initial_credit: STREAM_WINDOW,
                client_request_id: spec.client_request_id,
                provider_headers: spec.provider_headers,
                owner: spec.owner.unwrap_or_default(),
                billing: spec.billing,
            })
            .await?;
        tracing::debug!(node_id = core.node_id(), run_id = %core.id, %adapter, request_id = %core.client_request_id, "run sent");
        let owned = match owner {
            Some(owner) => {
                self.keys.own_run(&core.id, owner);
                true
            }
            None => false,
        };
        Ok(RunStream {
            replay: None,
            background,
            owned,
            last_seq: 0,
            core,
        })
    }
}

/// The event stream of one run.
#[derive(Debug)]
pub struct RunStream {
    pub core: Live<pb::RunEvent>,
    /// An event the dispatcher already read (the first), returned again first.
    replay: Option<Box<pb::RunEvent>>,
    background: bool,
    /// Whether `run_owners` holds this run (forgotten when the run is dropped).
    owned: bool,
    /// The `seq` of the last event the node sent.
    last_seq: u64,
}

impl RunStream {
    /// Puts back `first`, the event the dispatcher waited for: [`Self::next`] returns it
    /// again, for a consumer that reads the run from its start.
    pub fn replay_first(&mut self, first: pb::RunEvent) {
        self.replay = Some(Box::new(first));
    }

    /// Makes this run's outcome and usage the client request's.
    pub fn serve(&mut self, recorder: crate::ledger::RequestRecorder) {
        self.core.serve(recorder);
    }

    /// Says why the consumer gives the run up (before dropping it): what the request's
    /// record and the attempt report record instead of `client_abort`.
    pub fn fail(&mut self, code: ErrorCode) {
        let core = &mut self.core;
        if core.failure.is_none() && !core.ended {
            core.failure = Some(code);
        }
    }

    fn synthesized(&self, code: ErrorCode, message: String) -> pb::RunEvent {
        pb::RunEvent {
            run_id: self.core.id.clone(),
            seq: self.last_seq + 1,
            kind: pb::RunEventKind::Error as i32,
            error: Some(pb::RunError::new(code, message)),
            ..Default::default()
        }
    }

    /// The next event; `None` after the terminal.
    pub async fn next(&mut self) -> Option<pb::RunEvent> {
        if let Some(event) = self.replay.take() {
            return Some(*event);
        }
        let core = self.core.get_mut()?;
        let event = loop {
            if core.done {
                return None;
            }
            match core.recv().await {
                Ok(Some(event)) if event.kind() == pb::RunEventKind::Accepted => {
                    core.deadlines.acknowledged();
                }
                Ok(Some(event)) => break Ok(event),
                Ok(None) => break Err((ErrorCode::NodeDisconnected, core.lost(), false)),
                Err(expired) => {
                    let (code, message) = core.expire(expired);
                    break Err((code, message, true));
                }
            }
        };
        let mut event = match event {
            Ok(event) => {
                // An error before the node's `accepted` is a refusal before any work (its
                // gate was full, it has no such adapter, it never received the run): it
                // acknowledges nothing, so the dispatcher may try another member.
                if event.kind() != pb::RunEventKind::Error {
                    core.deadlines.acknowledged();
                }
                event
            }
            // Node loss ends the run below, as a terminal from the node would (it
            // acknowledges nothing: the node may never have seen the run).
            Err((code, message, false)) => self.synthesized(code, message),
            Err((code, message, true)) => {
                let event = self.synthesized(code, message);
                self.core.publish(&event);
                return Some(event);
            }
        };
        let core = &mut self.core;
        self.last_seq = self.last_seq.max(event.seq);
        match event.kind() {
            pb::RunEventKind::Delta
            | pb::RunEventKind::ReasoningDelta
            | pb::RunEventKind::ToolCall => {
                core.deadlines.began();
                core.data(1);
            }
            _ if event.is_terminal() => {
                let (usage, _) = event.observation();
                core.observe(usage, None);
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
                core.node_ended(failure);
            }
            pb::RunEventKind::Start => {
                core.deadlines.began();
                let (_, model) = event.observation();
                core.observe(None, model);
            }
            _ => {}
        }
        core.publish(&event);
        Some(event)
    }
}

impl StreamCore<pb::RunEvent> {
    fn publish(&self, event: &pb::RunEvent) {
        if self.edge.telemetry.events.has_subscribers() {
            self.edge
                .telemetry
                .events
                .publish(crate::events::EdgeEvent::Run(
                    crate::events::RunEventNotice {
                        node_id: self.session.node_id.clone(),
                        run_id: self.id.clone(),
                        kind: event.kind().name(),
                        text: event.text.clone(),
                    },
                ));
        }
    }
}

impl Drop for RunStream {
    fn drop(&mut self) {
        let Some(core) = self.core.take() else {
            return;
        };
        if self.owned {
            core.edge.keys.forget_run(&core.id);
        }
        if core.ended {
            return;
        }
        if self.background && !core.done {
            // A background run goes on without its client: drained to the event bus.
            let tasks = core.edge.tasks().clone();
            let mut rest = RunStream {
                core: Live::new(core),
                replay: None,
                background: false,
                owned: false,
                last_seq: self.last_seq,
            };
            tasks.spawn(async move { while rest.next().await.is_some() {} });
            return;
        }
        core.abandon();
    }
}
