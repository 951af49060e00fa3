//! Reads the edge's state for `/admin/status` at one moment — the counters under the
//! admission lock once, each configured node's connection — and hands it to the pure
//! [`StatusSnapshot::of`].

use crate::registry::OwnerState;
use crate::status::{NodeReading, SessionReading, StatusInput, StatusSnapshot};

use super::Edge;

impl Edge {
    /// The status snapshot now.
    pub fn snapshot(&self) -> StatusSnapshot {
        let now = super::admission::clock();
        let config = self.config();
        // Counters from one moment, under one lock.
        let (accounts, waiting, leases) = self.dispatcher.admission.inspect(|s| {
            let l = s.leases();
            let accounts = l
                .accounts()
                .map(|id| (l.key(id).clone(), (l.view(id), s.health_view(id, now))))
                .collect();
            let waiting = s
                .groups_waiting()
                .map(|(name, counts)| (name.to_string(), counts))
                .collect();
            (accounts, waiting, l.totals())
        });
        let nodes = config
            .nodes
            .iter()
            .map(|node| {
                let owner = self.nodes.owner_state(&node.id);
                let session = matches!(owner, OwnerState::Ready(_))
                    .then(|| self.session(&node.id))
                    .flatten()
                    .map(|s| SessionReading {
                        peer: s.peer.clone(),
                        connected_at: s.connected_at,
                        last_heartbeat: s.last_heartbeat(),
                    });
                let link = match owner {
                    OwnerState::Pending(g) | OwnerState::Ready(g) => {
                        self.nodes.link_status(&node.id, g)
                    }
                    OwnerState::Offline => None,
                };
                (
                    node.id.clone(),
                    NodeReading {
                        owner,
                        session,
                        link,
                    },
                )
            })
            .collect();
        let routing = config
            .model_groups
            .iter()
            .map(|g| {
                let metrics = self.telemetry.metrics.group(&g.name);
                (g.name.clone(), (metrics.routing(), metrics.prompt_tokens()))
            })
            .collect();
        StatusSnapshot::of(&StatusInput {
            config,
            accounts,
            waiting,
            routing,
            leases,
            nodes,
            now,
            now_unix_ms: crate::events::unix_ms(),
        })
    }
}
