//! The one accounting point: [`Edge::record_request`] receives every finished request of
//! every surface — its [`crate::ledger::UsageRecord`] and what the metrics need — and
//! counts it once in each place: the key's tokens today (settling what its budget
//! reserved), then the request metrics, usage, live window and ledger
//! ([`super::telemetry::Telemetry::record`]). [`Edge::start_request`] starts the
//! per-request [`RequestRecorder`] that calls it when the request ends.
//! [`Edge::record_orphan`] records a request whose end no edge received (its edge died),
//! from the usage its node reported.

use std::sync::Arc;

use iop_proto::pb;

use super::Edge;
use crate::auth::Caller;
use crate::ledger::record::{ANONYMOUS_KEY, EDGE_LOST};
use crate::ledger::recorder::{FinishedRequest, RecordSink};
use crate::ledger::{ClientApi, RequestRecorder, UsageRecord, unix_ms_now};

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

    /// A request whose end no edge received — its edge died, or no edge took its stream
    /// back within the wait — as its node reported it: recorded here, once (the node
    /// reports each once), with the usage the provider reported and outcome
    /// [`EDGE_LOST`], counted in its key's tokens today.
    pub fn record_orphan(&self, node_id: &str, report: &pb::OrphanUsage) {
        let billing = report.billing.clone().unwrap_or_default();
        let usage = report.usage.unwrap_or_default();
        let now = unix_ms_now();
        let time_ms = if billing.received_unix_ms > 0 {
            billing.received_unix_ms
        } else {
            now
        };
        let record = UsageRecord {
            time_ms,
            key: if report.owner.is_empty() {
                ANONYMOUS_KEY.to_string()
            } else {
                report.owner.clone()
            },
            group: billing.group,
            node: node_id.to_string(),
            provider: report.provider.clone(),
            path: if report.tunnel { "tunnel" } else { "run" },
            api: api_name(&billing.api),
            input_tokens: usage.input_tokens,
            output_tokens: usage.output_tokens,
            reasoning_tokens: usage.reasoning_tokens.unwrap_or(0),
            cached_tokens: usage.cached_input_tokens.unwrap_or(0),
            est_input_tokens: None,
            est_output_tokens: None,
            latency_ms: u64::try_from(now.saturating_sub(time_ms)).unwrap_or(0),
            ttft_ms: None,
            outcome: EDGE_LOST.to_string(),
            status: u16::try_from(report.status).unwrap_or(0),
            attempts: 1,
            routing: "",
        };
        tracing::info!(node_id, stream_id = %report.stream_id, key = %record.key, group = %record.group, input_tokens = record.input_tokens, output_tokens = record.output_tokens, "recorded a request whose edge did not receive its end, as its node reported it");
        self.record_request(FinishedRequest {
            record,
            queue_wait: None,
            reserved_tokens: 0,
            served_model: (!report.model.is_empty()).then(|| report.model.clone()),
        });
    }
}

/// The ledger's name of a client API a node reported (`openai` for one it does not know).
fn api_name(api: &str) -> &'static str {
    [
        ClientApi::OpenAi,
        ClientApi::Responses,
        ClientApi::Messages,
        ClientApi::Ollama,
        ClientApi::Runs,
    ]
    .into_iter()
    .map(ClientApi::as_str)
    .find(|name| *name == api)
    .unwrap_or("openai")
}
