//! What admission needs of a config — every provider's account (capacity per lane, the
//! node's gate, enabled) and dispatch traits (kind, idle timeout, stream usage), the model groups and
//! their queue settings, and the passive ejection policy — built the same way at start-up
//! and on reload.

use std::time::Duration;

use crate::config::{CapacityConfig, EdgeConfig, ProviderConfig};
use crate::ejection::EjectionPolicy;
use crate::lease::{AccountSpec, LaneCounts, ProviderKey};
use crate::queue::{ApiSet, GroupSpec, MemberSpec, MemberTraits, ProviderSpec};

/// The settings of every model group, by name.
pub type GroupPolicies = foldhash::HashMap<String, GroupPolicy>;

/// Per-group settings the async shell needs.
#[derive(Debug, Clone, Copy)]
pub struct GroupPolicy {
    pub timeout: Duration,
    pub long_context_tokens: Option<u64>,
    /// How long a request waits for a member to reconnect when none is online.
    pub wait_for_reconnect: Duration,
    /// How a request picks its member.
    pub routing: crate::routing::RoutingPolicy,
}

#[derive(Debug)]
pub struct AdmissionPlan {
    pub providers: Vec<ProviderSpec>,
    pub groups: Vec<GroupSpec>,
    pub policies: GroupPolicies,
    pub ejection: crate::ejection::EjectionPolicy,
}

fn capacity(c: &CapacityConfig) -> LaneCounts {
    LaneCounts {
        normal: c.normal,
        long: c.long,
    }
}

fn traits(p: &ProviderConfig) -> MemberTraits {
    MemberTraits {
        kind: p.kind,
        apis: ApiSet::of(p.served_apis()),
        idle_timeout: p.idle_timeout(),
        inject_stream_usage: p.injects_stream_usage(),
    }
}

impl AdmissionPlan {
    pub fn of(config: &EdgeConfig) -> Self {
        let providers = config
            .nodes
            .iter()
            .flat_map(|n| {
                n.providers.iter().map(move |p| ProviderSpec {
                    account: AccountSpec {
                        key: ProviderKey::new(&n.id, &p.id),
                        capacity: capacity(&p.capacity),
                        max_in_flight: p.max_concurrency(),
                        enabled: p.enabled,
                    },
                    traits: traits(p),
                })
            })
            .collect();
        let groups = config
            .model_groups
            .iter()
            .map(|g| GroupSpec {
                name: g.name.clone(),
                max_waiting: g.queue.max_waiting,
                wait_for_reconnect: Duration::from_secs(g.queue.wait_for_reconnect_sec),
                routing: g.routing,
                members: g
                    .members
                    .iter()
                    .map(|m| {
                        let p = super::provider_of(config, &m.node, &m.provider)
                            .expect("validated config");
                        MemberSpec {
                            key: ProviderKey::new(&m.node, &m.provider),
                            upstream_model: m.model.clone().unwrap_or_else(|| g.name.clone()),
                            capacity: capacity(&p.capacity),
                            enabled: p.enabled,
                            traits: traits(p),
                        }
                    })
                    .collect(),
            })
            .collect();
        let policies = config
            .model_groups
            .iter()
            .map(|g| {
                let policy = GroupPolicy {
                    timeout: Duration::from_secs(g.queue.timeout_sec),
                    long_context_tokens: g.long_context_tokens,
                    wait_for_reconnect: Duration::from_secs(g.queue.wait_for_reconnect_sec),
                    routing: g.routing,
                };
                (g.name.clone(), policy)
            })
            .collect();
        Self {
            providers,
            groups,
            policies,
            ejection: EjectionPolicy::from_config(&config.health.ejection, config.auth.keys.len()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_nodes_gate_and_the_kind_come_from_the_provider() {
        let config = EdgeConfig::from_yaml(
            r#"
nodes:
  - id: n
    token: token-n-0123456789ab
    providers:
      - {id: a, kind: mock, capacity: {normal: 4, long: 1}, max_concurrency: 2}
      - {id: b, kind: openai_compat, base_url: "http://127.0.0.1:1/v1", idle_timeout_sec: 7}
model_groups:
  - {name: g, members: [{node: n, provider: b, model: up}]}
"#,
            "test",
        )
        .unwrap();
        let plan = AdmissionPlan::of(&config);
        assert_eq!(plan.providers[0].account.max_in_flight, 2);
        assert_eq!(plan.providers[1].account.max_in_flight, 4, "normal + long");
        let member = &plan.groups[0].members[0];
        assert_eq!(member.upstream_model, "up");
        assert_eq!(
            member.traits.kind,
            crate::config::ProviderKind::OpenaiCompat
        );
        assert_eq!(member.traits.idle_timeout, Duration::from_secs(7));
    }
}
