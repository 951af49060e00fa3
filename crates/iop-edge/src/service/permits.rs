//! This edge's side of node permits: a node linked to several edges grants each of them
//! how many requests it may have in flight per provider (`PermitGrant`). The edge applies
//! a grant before it reads the next frame, answers it with a `PermitReport` acknowledging
//! it, and reports again whenever what waits for want of permits changes, so the node
//! can move permits here (oldest waiter first across its edges). A report that could not
//! be queued is sent again by [`report_demand`] a moment later.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use iop_proto::connection::Outbound;
use iop_proto::pb;
use parking_lot::Mutex;

use super::Edge;
use crate::queue::PermitDemand;
use crate::registry::Generation;

/// At most this many providers are read from one grant.
const MAX_GRANT_ENTRIES: usize = 1024;

/// How often reports that could not be queued are tried again, and the ages of waiters
/// refreshed while some wait.
const RESEND: Duration = Duration::from_millis(250);

/// What was last reported to each node.
#[derive(Debug, Default)]
pub struct PermitReports(Mutex<HashMap<String, NodeReports>>);

#[derive(Debug)]
struct NodeReports {
    generation: Generation,
    /// The last grant applied.
    acked: u64,
    /// The acknowledgement of `acked` has not been queued yet.
    ack_due: bool,
    /// Per provider: waiting, and in use while something waits.
    last: Vec<(Arc<str>, u32, u32)>,
}

fn summary(demand: &[PermitDemand]) -> Vec<(Arc<str>, u32, u32)> {
    demand
        .iter()
        .map(|d| {
            let in_use = if d.waiting > 0 { d.in_use } else { 0 };
            (d.provider.clone(), d.waiting, in_use)
        })
        .collect()
}

fn report(acked: u64, demand: &[PermitDemand]) -> pb::PermitReport {
    pb::PermitReport {
        acked_seq: acked,
        providers: demand
            .iter()
            .map(|d| pb::ProviderDemand {
                provider_id: d.provider.to_string(),
                in_use: d.in_use,
                unsent: d.unsent,
                waiting: d.waiting,
                oldest_wait_ms: d.oldest_wait.as_millis() as u64,
            })
            .collect(),
    }
}

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
        let mut reports = self.permit_reports.0.lock();
        let entry = reports
            .entry(node_id.to_string())
            .or_insert_with(|| NodeReports {
                generation,
                acked: 0,
                ack_due: false,
                last: Vec::new(),
            });
        if entry.generation != generation {
            *entry = NodeReports {
                generation,
                acked: 0,
                ack_due: false,
                last: Vec::new(),
            };
        }
        // A grant the node had to queue may arrive after a later one: the later one holds.
        if grant.seq <= entry.acked {
            return;
        }
        let admission = &self.dispatcher.admission;
        admission.set_permits(node_id, generation, &permits);
        tracing::debug!(node_id, seq = grant.seq, ?permits, "permits granted");
        let demand = admission.permit_demand(node_id);
        let sent = outbound.try_send(report(grant.seq, &demand));
        entry.acked = grant.seq;
        entry.ack_due = !sent;
        if sent {
            entry.last = summary(&demand);
        }
    }

    /// Tells every ready node granting permits what changed in what waits for them (and
    /// any acknowledgement still due).
    fn report_changed_demand(&self) {
        for session in self.nodes.ready_sessions() {
            let demand = self.dispatcher.admission.permit_demand(&session.node_id);
            if demand.is_empty() {
                continue;
            }
            let mut reports = self.permit_reports.0.lock();
            let Some(entry) = reports
                .get_mut(&session.node_id)
                .filter(|e| e.generation == session.generation)
            else {
                continue;
            };
            // Only the waiters' ages moving is no news: the node keeps them from the last
            // report.
            let now = summary(&demand);
            if now == entry.last && !entry.ack_due {
                continue;
            }
            if session.outbound.try_send(report(entry.acked, &demand)) {
                entry.ack_due = false;
                entry.last = now;
            }
        }
    }

    /// Forgets what was reported to a node whose connection `generation` ended.
    pub(crate) fn forget_permit_reports(&self, node_id: &str, generation: Generation) {
        let mut reports = self.permit_reports.0.lock();
        if reports
            .get(node_id)
            .is_some_and(|e| e.generation == generation)
        {
            reports.remove(node_id);
        }
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
