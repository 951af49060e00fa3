//! The one accounting point: [`Edge::record_request`] receives every finished request of
//! every surface — its [`crate::ledger::UsageRecord`] and what the metrics need — and
//! counts it once in each place: the key's tokens today (settling what its budget
//! reserved), then the request metrics, usage, live window and ledger
//! ([`super::telemetry::Telemetry::record`]). [`Edge::start_request`] starts the
//! per-request [`RequestRecorder`] that calls it when the request ends.

use std::sync::Arc;

use super::Edge;
use crate::auth::Caller;
use crate::ledger::recorder::{FinishedRequest, RecordSink};
use crate::ledger::{ClientApi, RequestRecorder};

impl RecordSink for Edge {
    fn record_request(&self, finished: FinishedRequest) {
        Edge::record_request(self, finished);
    }
}

impl Edge {
    /// Starts the record of a request `caller` made on `api`.
    pub fn start_request(self: &Arc<Self>, api: ClientApi, caller: &Caller) -> RequestRecorder {
        RequestRecorder::start(self.clone(), api, caller.key_name())
    }

    /// THE accounting point: one finished request. Never blocks.
    pub fn record_request(&self, finished: FinishedRequest) {
        let FinishedRequest {
            record,
            queue_wait,
            reserved_tokens,
            served_model,
        } = finished;
        self.keys.settle(
            &record.key,
            reserved_tokens,
            record.billed_tokens(),
            record.time_ms,
        );
        self.telemetry.record(record, queue_wait, served_model);
    }
}
