//! The `/admin/status` snapshot: every configured node and provider, connected or not, with
//! capacity and in-flight per lane (and the most in flight at once, where
//! `max_concurrency` caps the lanes), probe health, last probe error and ejection, how each
//! connected node's link is secured and authenticated, and the waiting count of every model
//! group.
//!
//! The edge reads the state it needs under each lock once ([`StatusInput`]);
//! [`StatusSnapshot::of`] is a pure function of that reading and `now`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

use crate::config::EdgeConfig;
use crate::health::ProbeHealth;
use crate::lease::{AccountView, LaneCounts, LeaseTotals, ProviderKey};
use crate::queue::HealthView;
use crate::registry::OwnerState;
use crate::routing::Stats;

/// How a node's current connection is secured and authenticated, for the status.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LinkStatus {
    /// `tls` or `plaintext`.
    pub transport: &'static str,
    /// `client_certificate`, `join_token` (this connection joined; later ones present the
    /// certificate it received) or `static_token`.
    pub credential: &'static str,
    /// When the credential stops working (certificates), Unix milliseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub credential_expires_unix_ms: Option<u64>,
    /// The iop version the node registered with (empty if it sent none).
    #[serde(skip_serializing_if = "str::is_empty")]
    pub version: String,
    /// The host name the node registered with (empty if it sent none).
    #[serde(skip_serializing_if = "str::is_empty")]
    pub hostname: String,
}

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
    /// The current connection's generation (registering or ready): it grows with every
    /// connection the edge accepts, so a new one means the node reconnected.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub generation: Option<u64>,
    /// Milliseconds since the ready node's last heartbeat (a ping or pong); pings come
    /// every 2 s, and 5 s of silence ends the connection.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub heartbeat_age_ms: Option<u64>,
    /// For a connected (or registering) node: `transport` (`tls` / `plaintext`),
    /// `credential` (`client_certificate` / `join_token` / `static_token`),
    /// `credential_expires_unix_ms`, and the `version` and `hostname` it registered with.
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
    /// What the node's probes say: `healthy`, `unhealthy` or `unknown` (not probed enough
    /// yet); `offline` while the node is not connected.
    pub health: &'static str,
    /// When the health began (unix ms, the node's clock).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub health_since_unix_ms: Option<u64>,
    /// The last failed probe (kept after recovery) and when (unix ms, the node's clock).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_error_unix_ms: Option<u64>,
    /// Set while the provider is ejected after failed requests.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ejected: Option<EjectedStatus>,
    /// Set while the provider cools down after it answered 429 (for its `Retry-After`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cooling_down: Option<CoolingStatus>,
    pub capacity: LaneCounts,
    /// The most requests the provider has in flight at once, both lanes together: its
    /// `max_concurrency` when that is below the lanes' sum (0 while it takes none).
    pub max_in_flight: u32,
    pub in_flight: LaneCounts,
    /// How many of those the node lets this edge have in flight now: its share of the
    /// provider's `max_concurrency` among the edges of a fleet (absent for a node that
    /// grants none).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub permits: Option<u32>,
}

/// A cool-down in progress.
#[derive(Debug, Clone, Serialize)]
pub struct CoolingStatus {
    /// When it ends (unix ms, the edge's clock).
    pub until_unix_ms: u64,
    pub remaining_sec: f64,
}

/// An ejection in progress.
#[derive(Debug, Clone, Serialize)]
pub struct EjectedStatus {
    /// When it ends at the latest (unix ms, the edge's clock).
    pub until_unix_ms: u64,
    pub remaining_sec: f64,
    /// How many times in a row it was ejected (each lasts longer).
    pub times: u32,
    pub reason: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct GroupStatus {
    pub name: String,
    pub waiting: LaneCounts,
    pub members: Vec<MemberStatus>,
    pub routing: RoutingStatus,
}

/// How a group's requests found their members since the edge started, and what the
/// providers had cached of their prompts.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RoutingStatus {
    /// `least_in_flight`, `session`, `prefix` or `session_prefix`.
    pub policy: &'static str,
    /// Steered decisions (session or prefix) that got the preferred member.
    pub hit_ratio: Option<f64>,
    /// Decisions by what steered them and how they went (`session.hit`,
    /// `prefix.cold`, `none.unsteered` ...); only those that happened.
    pub decisions: std::collections::BTreeMap<String, u64>,
    /// Provider-reported input tokens of finished requests, and how many of them the
    /// provider had cached.
    pub input_tokens: u64,
    pub cached_tokens: u64,
}

impl RoutingStatus {
    pub fn of(policy: crate::routing::RoutingPolicy, stats: &Stats, tokens: (u64, u64)) -> Self {
        Self {
            policy: policy.as_str(),
            hit_ratio: stats.hit_ratio(),
            decisions: stats
                .iter()
                .map(|(kind, outcome, n)| (format!("{}.{}", kind.as_str(), outcome.as_str()), n))
                .collect(),
            input_tokens: tokens.0,
            cached_tokens: tokens.1,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct MemberStatus {
    pub node: String,
    pub provider: String,
    pub model: String,
}

/// What a snapshot is made of, read from the edge at one moment.
#[derive(Debug, Clone)]
pub struct StatusInput {
    pub config: Arc<EdgeConfig>,
    pub accounts: HashMap<ProviderKey, (AccountView, HealthView)>,
    pub waiting: HashMap<String, LaneCounts>,
    /// Per group: its routing decisions and prompt tokens (input, cached).
    pub routing: HashMap<String, (Stats, (u64, u64))>,
    pub leases: LeaseTotals,
    pub nodes: HashMap<String, NodeReading>,
    pub now: Instant,
    pub now_unix_ms: u64,
}

/// A dispatch-ready session as the snapshot reads it.
#[derive(Debug, Clone)]
pub struct SessionReading {
    pub peer: String,
    pub connected_at: Instant,
    pub last_heartbeat: Instant,
}

/// One node's connection as the snapshot reads it.
#[derive(Debug, Clone)]
pub struct NodeReading {
    pub owner: OwnerState,
    /// The dispatch-ready session's peer, start and last heartbeat.
    pub session: Option<SessionReading>,
    /// How the registered (or registering) connection is secured and authenticated.
    pub link: Option<LinkStatus>,
}

impl StatusSnapshot {
    /// The snapshot of `input`: a pure function of it.
    pub fn of(input: &StatusInput) -> StatusSnapshot {
        let config = &input.config;
        let nodes = config
            .nodes
            .iter()
            .map(|node| {
                let reading = input.nodes.get(&node.id);
                let state = reading.map_or(OwnerState::Offline, |r| r.owner);
                let ready = matches!(state, OwnerState::Ready(_));
                let session = reading.and_then(|r| r.session.clone());
                let providers = node
                    .providers
                    .iter()
                    .map(|p| {
                        let (view, health) = input
                            .accounts
                            .get(&ProviderKey::new(&node.id, &p.id))
                            .cloned()
                            .map_or((None, HealthView::default()), |(v, h)| (Some(v), h));
                        provider_status(p, ready, view, health, input)
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
                    connected_for_sec: session.as_ref().map(|s| {
                        input
                            .now
                            .saturating_duration_since(s.connected_at)
                            .as_secs()
                    }),
                    generation: match state {
                        OwnerState::Offline => None,
                        OwnerState::Pending(g) | OwnerState::Ready(g) => Some(g.0),
                    },
                    heartbeat_age_ms: session.as_ref().map(|s| {
                        input
                            .now
                            .saturating_duration_since(s.last_heartbeat)
                            .as_millis() as u64
                    }),
                    link: reading.and_then(|r| r.link.clone()),
                    providers,
                }
            })
            .collect();
        let model_groups = config
            .model_groups
            .iter()
            .map(|g| GroupStatus {
                name: g.name.clone(),
                waiting: input.waiting.get(&g.name).copied().unwrap_or_default(),
                members: g
                    .members
                    .iter()
                    .map(|m| MemberStatus {
                        node: m.node.clone(),
                        provider: m.provider.clone(),
                        model: m.model.clone().unwrap_or_else(|| g.name.clone()),
                    })
                    .collect(),
                routing: input
                    .routing
                    .get(&g.name)
                    .map(|(stats, tokens)| RoutingStatus::of(g.routing, stats, *tokens))
                    .unwrap_or_else(|| RoutingStatus::of(g.routing, &Stats::default(), (0, 0))),
            })
            .collect();
        StatusSnapshot {
            nodes,
            model_groups,
            leases: input.leases,
        }
    }
}

fn provider_status(
    p: &crate::config::ProviderConfig,
    ready: bool,
    view: Option<AccountView>,
    health: HealthView,
    input: &StatusInput,
) -> ProviderStatus {
    let (capacity, in_flight) = view.map(|v| (v.capacity, v.in_flight)).unwrap_or_default();
    let permits = view.and_then(|v| v.permits);
    let online = ready && view.is_some_and(|v| v.online);
    let (status, capacity, in_flight) = if !p.enabled {
        ("disabled", LaneCounts::default(), in_flight)
    } else if online {
        ("available", capacity, in_flight)
    } else {
        ("unavailable", LaneCounts::default(), LaneCounts::default())
    };
    let probed = online && p.enabled;
    // (unix ms, seconds to a tenth) of a moment ahead.
    let ahead = |until: Instant| {
        let remaining = until.saturating_duration_since(input.now);
        (
            input.now_unix_ms + remaining.as_millis() as u64,
            (remaining.as_secs_f64() * 10.0).ceil() / 10.0,
        )
    };
    let ejected = health.ejected_until.map(|until| {
        let (until_unix_ms, remaining_sec) = ahead(until);
        EjectedStatus {
            until_unix_ms,
            remaining_sec,
            times: health.times_ejected,
            reason: health.ejection_reason.clone().unwrap_or_default(),
        }
    });
    let cooling_down = health.cooling_until.map(|until| {
        let (until_unix_ms, remaining_sec) = ahead(until);
        CoolingStatus {
            until_unix_ms,
            remaining_sec,
        }
    });
    ProviderStatus {
        id: p.id.clone(),
        kind: p.kind.as_str(),
        status,
        health: if probed {
            health.probe.as_str()
        } else {
            "offline"
        },
        health_since_unix_ms: health
            .since_unix_ms
            .filter(|_| probed && health.probe != ProbeHealth::Unknown),
        last_error: health.last_error.as_ref().map(|(e, _)| e.clone()),
        last_error_unix_ms: health.last_error.as_ref().map(|(_, at)| *at),
        ejected,
        cooling_down,
        capacity,
        max_in_flight: p
            .max_concurrency()
            .min(capacity.normal.saturating_add(capacity.long)),
        in_flight,
        permits: permits.filter(|_| online),
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
        let now = Instant::now();
        let mut input = StatusInput {
            config: Arc::new(config),
            accounts: HashMap::new(),
            waiting: HashMap::new(),
            routing: HashMap::new(),
            leases: LeaseTotals::default(),
            nodes: HashMap::new(),
            now,
            now_unix_ms: 1_000,
        };
        input.accounts.insert(
            ProviderKey::new("a", "p"),
            (
                AccountView {
                    online: true,
                    enabled: true,
                    capacity: LaneCounts { normal: 2, long: 1 },
                    in_flight: LaneCounts { normal: 1, long: 0 },
                    permits: None,
                },
                HealthView::default(),
            ),
        );
        input.nodes.insert(
            "a".into(),
            NodeReading {
                owner: OwnerState::Ready(Generation(4)),
                session: Some(SessionReading {
                    peer: "127.0.0.1:5".into(),
                    connected_at: now - std::time::Duration::from_secs(9),
                    last_heartbeat: now - std::time::Duration::from_secs(1),
                }),
                link: None,
            },
        );
        input
            .waiting
            .insert("g".into(), LaneCounts { normal: 3, long: 0 });
        let s = StatusSnapshot::of(&input);
        let a = &s.nodes[0];
        assert_eq!(
            (a.state, a.ready, a.connected_for_sec),
            ("ready", true, Some(9))
        );
        assert_eq!(a.providers[0].status, "available");
        assert_eq!(a.providers[0].health, "unknown");
        assert_eq!(a.providers[0].in_flight.normal, 1);
        let b = &s.nodes[1];
        assert_eq!((b.state, b.providers[0].status), ("offline", "disabled"));
        assert_eq!(s.model_groups[0].waiting.normal, 3);
    }
}
