//! Provider health as the service takes it in: the outcome of every request dispatched to
//! a member (passive ejection) and the probe reports nodes send about their providers.
//! The state itself lives in the scheduler (`queue`, `health`, `ejection`); this is the
//! entry point for the dispatch path and the transport.

use std::time::Instant;

use iop_proto::pb;

use super::Edge;
use crate::ejection::{ProviderOutcome, Verdict};
use crate::health::ProbeHealth;
use crate::registry::Generation;

/// Entries of one health report that are looked at; a node has far fewer providers.
const MAX_REPORT_ENTRIES: usize = 1024;

impl Edge {
    /// Records how one request to `node`/`provider` went: consecutive provider-side
    /// failures eject the member for a while (never the last usable member of a group).
    /// Every attempt of a model-group request reports here once, through
    /// `Edge::attempt_finished` (the dispatcher, or the run or tunnel stream when it ends);
    /// call this for outcomes they do not see. `Neutral` outcomes change nothing.
    pub fn report_provider_outcome(
        &self,
        node: &str,
        provider: &str,
        outcome: ProviderOutcome,
        now: Instant,
    ) -> Option<Verdict> {
        if outcome == ProviderOutcome::Neutral {
            return None;
        }
        self.dispatcher
            .admission
            .report_outcome(node, provider, &outcome, now)
    }

    /// A node's `ProviderHealthReport`, from its connection `generation`.
    pub fn provider_health(
        &self,
        node_id: &str,
        generation: Generation,
        report: &pb::ProviderHealthReport,
    ) {
        if report.providers.len() > MAX_REPORT_ENTRIES {
            tracing::warn!(
                node_id,
                entries = report.providers.len(),
                "health report with too many entries: only the first {MAX_REPORT_ENTRIES} are read"
            );
        }
        let now = super::admission::clock();
        for entry in report.providers.iter().take(MAX_REPORT_ENTRIES) {
            let Some(change) = self
                .dispatcher
                .admission
                .probe_health(node_id, generation, entry, now)
            else {
                continue;
            };
            let provider = entry.provider_id.as_str();
            if change.to == ProbeHealth::Unhealthy {
                tracing::warn!(
                    node_id,
                    provider,
                    from = change.from.as_str(),
                    last_error = %entry.last_error,
                    "provider unhealthy: no new requests while its group has another member"
                );
            } else {
                tracing::info!(
                    node_id,
                    provider,
                    from = change.from.as_str(),
                    to = change.to.as_str(),
                    ejection_ended = change.rejoined,
                    "provider health changed"
                );
            }
        }
    }
}
