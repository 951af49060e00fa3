//! The edges of a fleet, as this node knows them: the live edges the edges listed (in the
//! register reply, then in `FleetUpdate` frames) and which of them a connection of this
//! node is linked to. Sessions write it; the supervisor reads it to keep one link to each
//! listed edge. Pure bookkeeping behind a watch channel: no I/O.

use std::collections::BTreeMap;

use iop_proto::pb;
use serde::Serialize;
use tokio::sync::watch;

/// An edge of the fleet, as nodes dial it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FleetEdge {
    pub id: String,
    pub address: String,
}

/// What the node knows of the fleet.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct FleetState {
    /// The live edges as last listed by any edge (empty: not in a fleet).
    pub edges: Vec<FleetEdge>,
    /// The edges a connection is registered with, by id: the address it dialled.
    pub linked: BTreeMap<String, String>,
}

/// The shared fleet view: one writer per session, any number of readers.
#[derive(Debug)]
pub struct Fleet {
    state: watch::Sender<FleetState>,
}

impl Default for Fleet {
    fn default() -> Self {
        Fleet {
            state: watch::Sender::new(FleetState::default()),
        }
    }
}

/// The list an edge sent, as the node keeps it: entries without an id or an address
/// dropped, at most [`MAX_FLEET_EDGES`], sorted by id.
fn edges_from(list: &[pb::FleetEdge]) -> Vec<FleetEdge> {
    let mut edges: Vec<FleetEdge> = list
        .iter()
        .filter(|e| !e.id.is_empty() && !e.address.is_empty())
        .take(MAX_FLEET_EDGES)
        .map(|e| FleetEdge {
            id: e.id.clone(),
            address: e.address.clone(),
        })
        .collect();
    edges.sort_by(|a, b| a.id.cmp(&b.id));
    edges.dedup_by(|a, b| a.id == b.id);
    edges
}

/// The most edges a node links to (an edge is not trusted to keep its list short).
pub const MAX_FLEET_EDGES: usize = 64;

impl Fleet {
    pub fn subscribe(&self) -> watch::Receiver<FleetState> {
        self.state.subscribe()
    }

    pub fn state(&self) -> FleetState {
        self.state.borrow().clone()
    }

    /// An edge listed the fleet's live edges. An empty list from an edge on its own
    /// changes nothing.
    pub fn listed(&self, list: &[pb::FleetEdge]) {
        let edges = edges_from(list);
        if edges.is_empty() {
            return;
        }
        self.state.send_if_modified(|s| {
            let changed = s.edges != edges;
            s.edges = edges;
            changed
        });
    }

    /// A connection to edge `id` (dialled at `address`) registered.
    pub fn linked(&self, id: &str, address: &str) {
        if id.is_empty() {
            return;
        }
        self.state.send_modify(|s| {
            s.linked.insert(id.to_string(), address.to_string());
        });
    }

    /// The connection to edge `id` ended.
    pub fn unlinked(&self, id: &str) {
        self.state
            .send_if_modified(|s| s.linked.remove(id).is_some());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn edge(id: &str, address: &str) -> pb::FleetEdge {
        pb::FleetEdge {
            id: id.into(),
            address: address.into(),
        }
    }

    #[test]
    fn the_list_is_cleaned_bounded_and_only_news_wake_readers() {
        let fleet = Fleet::default();
        let mut seen = fleet.subscribe();
        fleet.listed(&[]);
        assert!(
            !seen.has_changed().unwrap(),
            "an edge on its own says nothing"
        );
        fleet.listed(&[
            edge("b", "h:2"),
            edge("a", "h:1"),
            edge("", "h:3"),
            edge("a", "h:9"),
        ]);
        assert!(seen.has_changed().unwrap());
        let ids: Vec<_> = seen
            .borrow_and_update()
            .edges
            .iter()
            .map(|e| e.id.clone())
            .collect();
        assert_eq!(ids, ["a", "b"]);
        fleet.listed(&[edge("a", "h:1"), edge("b", "h:2")]);
        assert!(!seen.has_changed().unwrap(), "the same list again");
        let many: Vec<_> = (0..100).map(|i| edge(&format!("e{i:03}"), "h:1")).collect();
        fleet.listed(&many);
        assert_eq!(fleet.state().edges.len(), MAX_FLEET_EDGES);
        fleet.linked("a", "h:1");
        fleet.unlinked("a");
        fleet.unlinked("a");
        assert!(fleet.state().linked.is_empty());
    }
}
