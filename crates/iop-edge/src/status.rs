//! The `/admin/status` snapshot: every configured node and provider, connected or not, with
//! capacity and in-flight per lane, and the waiting count of every model group.

use std::collections::HashMap;

use serde::Serialize;

use crate::lease::{AccountView, LaneCounts, LeaseTotals, ProviderKey};
use crate::registry::OwnerState;
use crate::service::Edge;
use crate::service::credentials::LinkStatus;

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
    /// For a connected (or registering) node: `transport` (`tls` / `plaintext`),
    /// `credential` (`client_certificate` / `join_token` / `static_token`) and
    /// `credential_expires_unix_ms`.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub link: Option<LinkStatus>,
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

impl Edge {
    pub fn snapshot(&self) -> StatusSnapshot {
        let config = self.config();
        // Counters from one moment, under one lock.
        let (views, waiting, leases) = self.admission.inspect(|s| {
            let l = s.leases();
            let views: HashMap<ProviderKey, AccountView> = l
                .accounts()
                .map(|id| (l.key(id).clone(), l.view(id)))
                .collect();
            let waiting: HashMap<String, LaneCounts> = s
                .group_names()
                .enumerate()
                .map(|(i, name)| (name.to_string(), s.waiting(i)))
                .collect();
            (views, waiting, l.totals())
        });
        let nodes = config
            .nodes
            .iter()
            .map(|node| {
                let state = self.owner_state(&node.id);
                let ready = matches!(state, OwnerState::Ready(_));
                let session = if ready { self.session(&node.id) } else { None };
                let providers = node
                    .providers
                    .iter()
                    .map(|p| {
                        let view = views.get(&ProviderKey::new(&node.id, &p.id)).copied();
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
                    peer: session.as_ref().map(|s| s.peer.clone()),
                    connected_for_sec: session.as_ref().map(|s| s.connected_at.elapsed().as_secs()),
                    link: match state {
                        OwnerState::Pending(g) | OwnerState::Ready(g) => {
                            self.link_status(&node.id, g)
                        }
                        OwnerState::Offline => None,
                    },
                    providers,
                }
            })
            .collect();
        let model_groups = config
            .model_groups
            .iter()
            .map(|g| GroupStatus {
                name: g.name.clone(),
                waiting: waiting.get(&g.name).copied().unwrap_or_default(),
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
            leases,
        }
    }
}
