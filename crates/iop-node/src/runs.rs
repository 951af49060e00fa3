//! The run manager: one task per `RunRequest`, each with its own cancellation token (a
//! child of its connection's), admitted through its adapter's capacity gate, ending with
//! exactly one terminal — the adapter's, or one synthesized here when the adapter returns
//! without one, fails, or is cancelled. Also handles `CancelRequest`s.
//!
//! A run that passes its gate is acknowledged at once (an `accepted` event) so the edge
//! knows the node took it; a full gate answers `node_capacity` instead, which the edge
//! takes as "try again elsewhere". The gate's slot is freed before the terminal leaves.

use crate::permit_desk::PermitHook;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use futures::FutureExt;
use iop_proto::ErrorCode;

use iop_proto::pb::{self, RunEventKind};
use parking_lot::Mutex;
use tracing::Instrument;

use tokio_util::sync::CancellationToken;

use crate::adapters::{AdapterError, RunInput};
use crate::instance::AdapterInstance;
use crate::journal::{JournalStream, StreamMeta};
use crate::run_outlet::JournalOutlet;
use crate::runtime::{ActiveRun, Connection, NodeRuntime};
use crate::sink::RunSink;
use crate::store::RunStatus;

enum Outcome {
    Returned(Result<(), AdapterError>),
    Cancelled,
}

/// Why the edge cancelled the run, if it did.
fn cancel_reason(reason: &Mutex<Option<String>>) -> Option<String> {
    reason.lock().clone()
}

/// Runs `input` on the adapter once its gate has a slot (the run is acknowledged then);
/// until the end, or the cancel.
async fn execute(
    instance: &AdapterInstance,
    input: RunInput,
    sink: &mut RunSink,
    cancel: &CancellationToken,
) -> Outcome {
    let slot = tokio::select! {
        biased;
        _ = cancel.cancelled() => return Outcome::Cancelled,
        slot = instance.acquire_slot() => slot,
    };
    let Some(permit) = slot else {
        return Outcome::Returned(Err(instance.at_capacity()));
    };
    sink.hold(permit);
    let _ = sink.accepted().await;
    // A panic in the adapter ends the run with an error terminal like any other failure,
    // instead of leaving it without one.
    let execute = AssertUnwindSafe(instance.adapter.execute(input, sink));
    tokio::select! {
        biased;
        _ = cancel.cancelled() => Outcome::Cancelled,
        result = execute.catch_unwind() => Outcome::Returned(result.unwrap_or_else(|panic| {
            Err(AdapterError::new(
                ErrorCode::Internal,
                format!(
                    "the node's {} adapter failed unexpectedly (it panicked: {}); this is a bug in iop",
                    instance.kind(),
                    crate::runtime::panic_message(&panic)
                ),
            ))
        })),
    }
}

/// Sends the run's terminal unless the adapter sent one; the status and error its record
/// ends with.
async fn terminal(
    outcome: Outcome,
    sink: &mut RunSink,
    reason: &Mutex<Option<String>>,
    stream: &JournalStream,
) -> (RunStatus, Option<String>) {
    match outcome {
        Outcome::Cancelled => match (cancel_reason(reason), stream.stopped()) {
            // The edge cancelled it.
            (Some(why), _) => {
                tracing::info!(reason = %why, "run cancelled");
                let _ = sink.cancelled(&why).await;
                (RunStatus::Cancelled, Some(why))
            }
            // The node stopped it (it shuts down, no edge re-attached it in time).
            (None, stopped) => {
                let why = stopped.unwrap_or_else(|| "the node stopped it".into());
                tracing::info!(reason = %why, "run stopped by the node");
                let _ = sink.error(ErrorCode::NodeDisconnected, &why).await;
                (RunStatus::Interrupted, Some(why))
            }
        },
        Outcome::Returned(Err(err)) => {
            tracing::warn!(code = err.code.as_str(), error = %err.message, "run failed");
            let _ = sink.error(err.code, &err.message).await;
            (RunStatus::Failed, Some(err.message))
        }
        Outcome::Returned(Ok(())) => match sink.terminal() {
            Some(RunEventKind::Complete) => (RunStatus::Completed, None),
            Some(RunEventKind::Cancelled) => (RunStatus::Cancelled, None),
            Some(_) => (
                RunStatus::Failed,
                Some("the adapter reported an error".into()),
            ),
            None => {
                tracing::warn!("adapter returned without a terminal event: completing the run");
                let _ = sink.complete(None, "stop").await;
                (RunStatus::Completed, None)
            }
        },
    }
}

impl NodeRuntime {
    /// Starts a run on its own task; events go out on `conn` (or the link it is
    /// re-attached to). It is in the journal before this returns, so a resume read after
    /// the request finds it.
    pub fn start_run(self: &Arc<Self>, request: pb::RunRequest, conn: &Connection) {
        let runtime = self.clone();
        let stream = self.journal.begin(
            &request.run_id,
            StreamMeta {
                owner: request.owner.clone(),
                billing: request.billing.clone(),
                provider: request.adapter.clone(),
                tunnel: false,
                resumable: false,
            },
            conn.link_out(),
            request.initial_credit,
        );
        let hook = self.permits.arrived(&request.adapter, conn.link);
        let span = tracing::info_span!(
            "run",
            run_id = %request.run_id,
            adapter = %request.adapter,
            request_id = %request.client_request_id
        );
        conn.tasks
            .spawn(async move { runtime.run(request, stream, hook).await }.instrument(span));
    }

    async fn run(
        self: Arc<Self>,
        request: pb::RunRequest,
        stream: Arc<JournalStream>,
        hook: PermitHook,
    ) {
        let cancel = stream.cancel.clone();
        let mut sink = RunSink::new(
            &request.run_id,
            JournalOutlet {
                stream: stream.clone(),
            },
        );
        sink.hold(hook);
        let stored = self.store.as_ref().map(|store| {
            store.started(
                &request.run_id,
                &request.adapter,
                &request.target,
                &request.session_id,
                request.background,
            )
        });
        let Some(instance) = self.adapter(&request.adapter) else {
            let known = self.adapter_ids().join(", ");
            tracing::warn!("run for an unknown adapter refused");
            let message = format!(
                "node {} has no adapter {:?} (it has: {known})",
                self.node_id(),
                request.adapter
            );
            let _ = sink.error(ErrorCode::UnknownAdapter, &message).await;
            if let (Some(store), Some(row)) = (&self.store, stored) {
                store.finished(row, RunStatus::Failed, Some(message));
            }
            return;
        };
        let reason = Arc::new(Mutex::new(None));
        self.runs.lock().insert(
            request.run_id.clone(),
            ActiveRun {
                cancel: cancel.clone(),
                reason: reason.clone(),
            },
        );
        tracing::debug!(target_name = %request.target, "run started");
        let input = RunInput {
            provider_headers: request.provider_headers,
            run_id: request.run_id.clone(),
            target: request.target.clone(),
            input: request.input,
            messages: request.messages,
            options: request.options.unwrap_or_default(),
            session_id: request.session_id,
            owner: request.owner,
        };
        let outcome = execute(&instance, input, &mut sink, &cancel).await;
        let (status, error) = terminal(outcome, &mut sink, &reason, &stream).await;
        instance.record_usage(sink.usage(), false);
        if let (Some(store), Some(row)) = (&self.store, stored) {
            store.finished(row, status, error);
        }
        self.runs.lock().remove(&request.run_id);
    }

    /// Handles a `CancelRequest`; the response goes back if the edge asked for one.
    pub async fn cancel(&self, request: &pb::CancelRequest) -> pb::CancelResponse {
        let fail = |code: ErrorCode, message: String| pb::CancelResponse {
            command_id: request.command_id.clone(),
            ok: false,
            error: Some(pb::RunError::new(code, message)),
        };
        let ok = pb::CancelResponse {
            command_id: request.command_id.clone(),
            ok: true,
            error: None,
        };
        match request.kind() {
            pb::CancelKind::CancelRun => {
                let runs = self.runs.lock();
                match runs.get(&request.run_id) {
                    Some(run) => {
                        *run.reason.lock() = Some(if request.reason.is_empty() {
                            "cancelled by the edge".into()
                        } else {
                            format!("cancelled: {}", request.reason)
                        });
                        run.cancel.cancel();
                        ok
                    }
                    None => fail(
                        ErrorCode::NotFound,
                        format!("no active run {:?}", request.run_id),
                    ),
                }
            }
            pb::CancelKind::CancelTunnel => match self.tunnels.lock().get(&request.request_id) {
                Some(cancel) => {
                    cancel.cancel();
                    ok
                }
                None => fail(
                    ErrorCode::NotFound,
                    format!("no active tunnel {:?}", request.request_id),
                ),
            },
            pb::CancelKind::TerminateSession => {
                let Some(instance) = self.adapter(&request.adapter) else {
                    return fail(
                        ErrorCode::NotFound,
                        format!(
                            "node {} has no adapter {:?}",
                            self.node_id(),
                            request.adapter
                        ),
                    );
                };
                if !instance.adapter.supports_sessions() {
                    return fail(
                        ErrorCode::NotSupported,
                        format!(
                            "adapter {} (kind {}) does not support session termination",
                            instance.spec.id,
                            instance.kind()
                        ),
                    );
                }
                match instance
                    .adapter
                    .terminate_session(&request.target, &request.session_id)
                    .await
                {
                    Ok(()) => ok,
                    Err(e) => fail(e.code, e.message),
                }
            }
            pb::CancelKind::Unspecified => {
                fail(ErrorCode::BadRequest, "cancel kind is missing".into())
            }
        }
    }
}
