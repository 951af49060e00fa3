//! This edge's side of node permits: a node linked to several edges grants each of them
//! how many requests it may have in flight per provider (`PermitGrant`). The edge applies
//! a grant before it reads the next frame, answers it with a `PermitReport` acknowledging
//! it, and reports again whenever what waits for want of permits changes, so the node
//! can move permits here (oldest waiter first across its edges). A report that could not
//! be queued is sent again by [`report_demand`] a moment later.

use std::sync::Arc;
use std::time::Duration;

use iop_proto::connection::Outbound;
use iop_proto::pb;

use super::Edge;
use crate::registry::Generation;

/// At most this many providers are read from one grant.
const MAX_GRANT_ENTRIES: usize = 1024;

/// How often reports that could not be queued are tried again, and the ages of waiters
/// refreshed while some wait.
const RESEND: Duration = Duration::from_millis(250);

impl Edge {
    /// A node's `PermitGrant` over its connection `generation`: applied at once (waiters
    /// it lets through go), then acknowledged with what this edge holds and wants.
    pub fn permits_granted(
        &self,
        node_id: &str,
        generation: Generation,
        grant: &pb::PermitGrant,
        outbound: &Outbound,
    ) {
        if grant.providers.len() > MAX_GRANT_ENTRIES {
            tracing::warn!(
                node_id,
                entries = grant.providers.len(),
                "permit grant with too many entries: only the first {MAX_GRANT_ENTRIES} are read"
            );
        }
        let permits: Vec<(&str, u32)> = grant
            .providers
            .iter()
            .take(MAX_GRANT_ENTRIES)
            .map(|p| (p.provider_id.as_str(), p.permits))
            .collect();
        let admission = &self.dispatcher.admission;
        self.permit_reports.granted(
            node_id,
            generation,
            grant.seq,
            || {
                admission.set_permits(node_id, generation, &permits);
                tracing::debug!(node_id, seq = grant.seq, ?permits, "permits granted");
                admission.permit_demand(node_id)
            },
            |report| outbound.try_send(report),
        );
    }

    /// Tells every ready node granting permits what changed in what waits for them (and
    /// any acknowledgement still due).
    fn report_changed_demand(&self) {
        for session in self.nodes.ready_sessions() {
            let demand = self.dispatcher.admission.permit_demand(&session.node_id);
            if demand.is_empty() {
                continue;
            }
            self.permit_reports
                .changed(&session.node_id, session.generation, &demand, |report| {
                    session.outbound.try_send(report)
                });
        }
    }

    /// Forgets what was reported to a node whose connection `generation` ended.
    pub(crate) fn forget_permit_reports(&self, node_id: &str, generation: Generation) {
        self.permit_reports.forget(node_id, generation);
    }
}

/// Reports changes in demand to the nodes granting this edge permits, as they happen
/// (and every [`RESEND`], for reports a full connection queue refused).
pub async fn report_demand(edge: Arc<Edge>) {
    let shutdown = edge.shutdown_token().clone();
    let admission = edge.dispatcher.admission.clone();
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = admission.demand_changed.notified() => {}
            _ = tokio::time::sleep(RESEND) => {}
        }
        edge.report_changed_demand();
    }
}
