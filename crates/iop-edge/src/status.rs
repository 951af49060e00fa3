//! The `/admin/status` snapshot: every configured node and provider, connected or not, with
//! capacity and in-flight per lane, and the waiting count of every model group.
//!
//! [`snapshot`] is a pure function of the config and the state the edge gathered
//! ([`StatusInputs`]); `Edge::snapshot` only collects those inputs.

use std::collections::HashMap;

use serde::Serialize;

use crate::config::EdgeConfig;
use crate::lease::{AccountView, LaneCounts, LeaseTotals, ProviderKey};
use crate::registry::OwnerState;
use crate::service::Edge;

#[derive(Debug, Clone, Serialize)]
pub struct StatusSnapshot {
    pub nodes: Vec<NodeStatus>,
    pub model_groups: Vec<GroupStatus>,
    /// Provider leases since start; `acquired == released` whenever nothing is in flight.
    pub leases: LeaseTotals,
}

#[derive(Debug, Clone, Serialize)]
pub struct NodeStatus {
    pub id: String,
    /// Dispatch-ready: registered, configured and acknowledged ready.
    pub connected: bool,
    pub ready: bool,
    /// `offline`, `registering` (registered, not yet ready) or `ready`.
    pub state: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peer: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub connected_for_sec: Option<u64>,
    pub providers: Vec<ProviderStatus>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ProviderStatus {
    pub id: String,
    pub kind: &'static str,
    /// `available`, `unavailable` (node offline) or `disabled`.
    pub status: &'static str,
    /// `online` or `offline`.
    pub health: &'static str,
    pub capacity: LaneCounts,
    pub in_flight: LaneCounts,
}

#[derive(Debug, Clone, Serialize)]
pub struct GroupStatus {
    pub name: String,
    pub waiting: LaneCounts,
    pub members: Vec<MemberStatus>,
}

#[derive(Debug, Clone, Serialize)]
pub struct MemberStatus {
    pub node: String,
    pub provider: String,
    pub model: String,
}

/// A dispatch-ready connection as the snapshot shows it.
#[derive(Debug, Clone)]
pub struct SessionInfo {
    pub peer: String,
    pub connected_for_sec: u64,
}

/// Everything the snapshot reads, taken at one moment.
#[derive(Debug, Default)]
pub struct StatusInputs {
    /// Each provider's account.
    pub accounts: HashMap<ProviderKey, AccountView>,
    /// Waiting requests per configured model group.
    pub waiting: HashMap<String, LaneCounts>,
    pub leases: LeaseTotals,
    /// Each node's ownership state (absent: offline).
    pub owners: HashMap<String, OwnerState>,
    /// Each dispatch-ready node's connection.
    pub sessions: HashMap<String, SessionInfo>,
}

/// The snapshot of `config` given what the edge's state says now: a pure function.
pub fn snapshot(config: &EdgeConfig, inputs: &StatusInputs) -> StatusSnapshot {
    let nodes = config
        .nodes
        .iter()
        .map(|node| {
            let state = inputs
                .owners
                .get(&node.id)
                .copied()
                .unwrap_or(OwnerState::Offline);
            let ready = matches!(state, OwnerState::Ready(_));
            let session = if ready {
                inputs.sessions.get(&node.id)
            } else {
                None
            };
            let providers = node
                .providers
                .iter()
                .map(|p| {
                    let view = inputs
                        .accounts
                        .get(&ProviderKey::new(&node.id, &p.id))
                        .copied();
                    let (capacity, in_flight) =
                        view.map(|v| (v.capacity, v.in_flight)).unwrap_or_default();
                    let online = ready && view.is_some_and(|v| v.online);
                    let (status, health, capacity, in_flight) = if !p.enabled {
                        (
                            "disabled",
                            if online { "online" } else { "offline" },
                            LaneCounts::default(),
                            in_flight,
                        )
                    } else if online {
                        ("available", "online", capacity, in_flight)
                    } else {
                        (
                            "unavailable",
                            "offline",
                            LaneCounts::default(),
                            LaneCounts::default(),
                        )
                    };
                    ProviderStatus {
                        id: p.id.clone(),
                        kind: p.kind.as_str(),
                        status,
                        health,
                        capacity,
                        in_flight,
                    }
                })
                .collect();
            NodeStatus {
                id: node.id.clone(),
                connected: ready,
                ready,
                state: match state {
                    OwnerState::Offline => "offline",
                    OwnerState::Pending(_) => "registering",
                    OwnerState::Ready(_) => "ready",
                },
                peer: session.map(|s| s.peer.clone()),
                connected_for_sec: session.map(|s| s.connected_for_sec),
                providers,
            }
        })
        .collect();
    let model_groups = config
        .model_groups
        .iter()
        .map(|g| GroupStatus {
            name: g.name.clone(),
            waiting: inputs.waiting.get(&g.name).copied().unwrap_or_default(),
            members: g
                .members
                .iter()
                .map(|m| MemberStatus {
                    node: m.node.clone(),
                    provider: m.provider.clone(),
                    model: m.model.clone().unwrap_or_else(|| g.name.clone()),
                })
                .collect(),
        })
        .collect();
    StatusSnapshot {
        nodes,
        model_groups,
        leases: inputs.leases,
    }
}

impl Edge {
    /// Gathers the snapshot's inputs (the counters under one lock) and builds it.
    pub fn snapshot(&self) -> StatusSnapshot {
        let config = self.config();
        let (accounts, waiting, leases) = self.admission.inspect(|s| {
            let l = s.leases();
            let accounts: HashMap<ProviderKey, AccountView> = l
                .accounts()
                .map(|id| (l.key(id).clone(), l.view(id)))
                .collect();
            let waiting: HashMap<String, LaneCounts> = s
                .groups_waiting()
                .map(|(name, counts)| (name.to_string(), counts))
                .collect();
            (accounts, waiting, l.totals())
        });
        let owners = config
            .nodes
            .iter()
            .map(|n| (n.id.clone(), self.owner_state(&n.id)))
            .collect();
        let sessions = self
            .ready_sessions()
            .into_iter()
            .map(|s| {
                (
                    s.node_id.clone(),
                    SessionInfo {
                        peer: s.peer.clone(),
                        connected_for_sec: s.connected_at.elapsed().as_secs(),
                    },
                )
            })
            .collect();
        let inputs = StatusInputs {
            accounts,
            waiting,
            leases,
            owners,
            sessions,
        };
        snapshot(&config, &inputs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::Generation;

    #[test]
    fn the_snapshot_is_what_the_state_says() {
        let config = EdgeConfig::from_yaml(
            r#"
nodes:
  - id: a
    token: token-a-0123456789ab
    providers: [{id: p, kind: mock, capacity: {normal: 2, long: 1}}]
  - id: b
    token: token-b-0123456789ab
    providers: [{id: q, kind: mock, enabled: false}]
model_groups:
  - {name: g, members: [{node: a, provider: p}]}
"#,
            "test",
        )
        .unwrap();
        let mut inputs = StatusInputs::default();
        inputs.accounts.insert(
            ProviderKey::new("a", "p"),
            AccountView {
                online: true,
                enabled: true,
                capacity: LaneCounts { normal: 2, long: 1 },
                in_flight: LaneCounts { normal: 1, long: 0 },
            },
        );
        inputs
            .owners
            .insert("a".into(), OwnerState::Ready(Generation(4)));
        inputs.sessions.insert(
            "a".into(),
            SessionInfo {
                peer: "127.0.0.1:5".into(),
                connected_for_sec: 9,
            },
        );
        inputs
            .waiting
            .insert("g".into(), LaneCounts { normal: 3, long: 0 });
        let s = snapshot(&config, &inputs);
        let a = &s.nodes[0];
        assert_eq!(
            (a.state, a.ready, a.connected_for_sec),
            ("ready", true, Some(9))
        );
        assert_eq!(a.providers[0].status, "available");
        assert_eq!(a.providers[0].in_flight.normal, 1);
        let b = &s.nodes[1];
        assert_eq!((b.state, b.providers[0].status), ("offline", "disabled"));
        assert_eq!(s.model_groups[0].waiting.normal, 3);
    }
}
