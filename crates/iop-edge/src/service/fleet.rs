//! What this edge tells its nodes about the fleet it is in (edges sharing a store): the
//! live edges to link to, sent to every dispatch-ready node whenever they change, and —
//! when this edge drains — the list without itself, so nodes stop dialling it.

use iop_proto::pb;

use super::Edge;

impl Edge {
    /// Sends `edges` (the fleet's live edges, as nodes dial them) to every ready node.
    /// A node whose queue is full misses this one; the next change, or its next
    /// registration, tells it.
    pub fn announce_fleet(&self, edges: Vec<pb::FleetEdge>) {
        let sessions = self.nodes.ready_sessions();
        tracing::info!(
            edges = edges.len(),
            nodes = sessions.len(),
            "the fleet's live edges changed: telling the nodes"
        );
        for session in sessions {
            session.outbound.try_send(pb::FleetUpdate {
                edges: edges.clone(),
            });
        }
    }
}
