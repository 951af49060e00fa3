//! Unit tests of cache-affine routing in the scheduler: sessions stick to their member
//! (the same on every edge), move when it is ejected, disabled or loaded past the bound
//! (the miss said in the grant), prompts sharing a long prefix go together, and requests
//! that name nothing still spread.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::*;
use crate::ejection::ProviderOutcome;
use crate::lease::AccountSpec;
use crate::routing::{Decision, Kind, Outcome, session};

const MEMBERS: [&str; 4] = ["a", "b", "c", "d"];

fn spec(
    nodes: &[&str],
    routing: RoutingPolicy,
    enabled: &[bool],
) -> (Vec<ProviderSpec>, GroupSpec) {
    let providers = nodes
        .iter()
        .zip(enabled)
        .map(|(n, &enabled)| ProviderSpec {
            account: AccountSpec {
                key: ProviderKey::new(n, "p"),
                capacity: LaneCounts { normal: 8, long: 0 },
                max_in_flight: 8,
                enabled,
            },
            traits: MemberTraits::default(),
        })
        .collect();
    let group = GroupSpec {
        name: "g".into(),
        members: nodes
            .iter()
            .map(|n| MemberSpec {
                key: ProviderKey::new(n, "p"),
                upstream_model: "m".into(),
                capacity: LaneCounts { normal: 8, long: 0 },
                enabled: true,
                traits: MemberTraits::default(),
            })
            .collect(),
        max_waiting: 64,
        wait_for_reconnect: Duration::ZERO,
        routing,
    };
    (providers, group)
}

/// An edge's scheduler over members `a..d/p` (8 slots each), all online.
fn edge(routing: RoutingPolicy, t0: Instant) -> Scheduler<u32> {
    let (providers, group) = spec(&MEMBERS, routing, &[true; 4]);
    let mut s = Scheduler::new(providers, [group]);
    s.set_ejection_policy(crate::ejection::EjectionPolicy {
        consecutive_failures: 1,
        ..Default::default()
    });
    for (i, n) in MEMBERS.iter().enumerate() {
        s.node_ready(n, Generation(i as u64 + 1), t0);
    }
    s
}

fn by_session(key: &str) -> Affinity {
    Affinity {
        session: Some(session::hash(key)),
        blocks: Arc::from([]),
    }
}

fn by_blocks(blocks: &[u64]) -> Affinity {
    Affinity {
        session: None,
        blocks: Arc::from(blocks),
    }
}

fn grant(s: &mut Scheduler<u32>, affinity: &Affinity, now: Instant) -> Grant {
    match s.admit_steered("g", Lane::Normal, 0, &[], affinity, now) {
        Admission::Granted(g) => g,
        other => panic!("expected a grant, got {other:?}"),
    }
}

/// One turn: granted, then finished.
fn turn(s: &mut Scheduler<u32>, affinity: &Affinity, now: Instant) -> Grant {
    let g = grant(s, affinity, now);
    s.release(g.lease, &mut Vec::new(), now);
    g
}

#[test]
fn a_session_stays_on_one_member_for_50_turns_and_every_edge_agrees() {
    let t0 = Instant::now();
    let mut one = edge(RoutingPolicy::SessionPrefix, t0);
    let mut two = edge(RoutingPolicy::Session, t0);
    let mut homes = std::collections::HashSet::new();
    for session in 0..20 {
        let affinity = by_session(&format!("session-{session}"));
        let first = turn(&mut one, &affinity, t0);
        homes.insert(first.node.clone());
        for _ in 0..50 {
            let on_one = turn(&mut one, &affinity, t0);
            let on_two = turn(&mut two, &affinity, t0);
            assert_eq!(on_one.node, first.node, "the session moved on this edge");
            assert_eq!(on_two.node, first.node, "another edge put it elsewhere");
            assert_eq!(on_one.decision.kind, Kind::Session);
            assert_eq!(on_one.decision.outcome, Outcome::Hit);
        }
    }
    assert!(homes.len() >= 3, "20 sessions spread over {homes:?}");
}

#[test]
fn a_session_moves_when_its_member_is_ejected_and_the_miss_is_said() {
    let t0 = Instant::now();
    let mut s = edge(RoutingPolicy::SessionPrefix, t0);
    let affinity = by_session("conversation-7");
    let home = turn(&mut s, &affinity, t0);
    s.report_outcome(
        &ProviderKey::new(&home.node, "p"),
        &ProviderOutcome::failure("HTTP 502"),
        t0,
    );
    let moved = turn(&mut s, &affinity, t0);
    assert_ne!(moved.node, home.node);
    assert_eq!(moved.decision.outcome, Outcome::Unavailable);
    // Every turn while it is out goes to the same second choice.
    for _ in 0..10 {
        assert_eq!(turn(&mut s, &affinity, t0).node, moved.node);
    }
    // Back home once the ejection is over.
    let later = t0 + Duration::from_secs(3600);
    let back = turn(&mut s, &affinity, later);
    assert_eq!(back.node, home.node);
    assert_eq!(back.decision.outcome, Outcome::Hit);
}

#[test]
fn a_session_moves_when_its_member_is_disabled() {
    let t0 = Instant::now();
    let mut s = edge(RoutingPolicy::SessionPrefix, t0);
    let affinity = by_session("conversation-9");
    let home = turn(&mut s, &affinity, t0);
    let enabled: Vec<bool> = MEMBERS.iter().map(|n| **n != *home.node).collect();
    let (providers, group) = spec(&MEMBERS, RoutingPolicy::SessionPrefix, &enabled);
    let online = MEMBERS
        .iter()
        .enumerate()
        .map(|(i, n)| (n.to_string(), Generation(i as u64 + 1)))
        .collect();
    s.reconfigure(providers, [group], &online, t0);
    let moved = turn(&mut s, &affinity, t0);
    assert_ne!(moved.node, home.node);
    assert_eq!(moved.decision.outcome, Outcome::Unavailable);
}

#[test]
fn a_session_spills_over_when_its_member_is_past_the_load_bound() {
    let t0 = Instant::now();
    let mut s = edge(RoutingPolicy::SessionPrefix, t0);
    let affinity = by_session("hot-session");
    // Its requests pile up on one member until that member is past the bound.
    let mut held = Vec::new();
    let home = grant(&mut s, &affinity, t0);
    let home_node = home.node.clone();
    held.push(home);
    loop {
        let g = grant(&mut s, &affinity, t0);
        let spilled = g.node != home_node;
        let outcome = g.decision.outcome;
        held.push(g);
        if spilled {
            assert_eq!(outcome, Outcome::OverBound);
            break;
        }
        assert_eq!(outcome, Outcome::Hit);
        assert!(held.len() <= 3, "the bound of an idle group is 3");
    }
    let on_home = held.iter().filter(|g| g.node == home_node).count();
    assert_eq!(
        on_home, 3,
        "max(ceil(1.25 x mean), ceil(mean) + 2) with 4 in flight"
    );
    // No member ever goes above the bound while others are free.
    for _ in 0..20 {
        held.push(grant(&mut s, &affinity, t0));
        let total = held.len() as u32;
        let bound = crate::routing::load_bound(total - 1, MEMBERS.len());
        for n in MEMBERS {
            let load = held.iter().filter(|g| &*g.node == n).count() as u32;
            assert!(load <= bound, "{n} holds {load} over the bound {bound}");
        }
    }
}

#[test]
fn prompts_sharing_a_long_prefix_go_together_and_another_need_not() {
    let t0 = Instant::now();
    let mut s = edge(RoutingPolicy::SessionPrefix, t0);
    // Four prompts sharing their first 6 blocks, one with another prefix.
    let shared: Vec<u64> = (1..=6).collect();
    let prompt = |tail: u64| {
        let mut b = shared.clone();
        b.extend([100 + tail, 200 + tail]);
        b
    };
    let first = turn(&mut s, &by_blocks(&prompt(0)), t0);
    assert_eq!(first.decision.outcome, Outcome::Cold);
    for tail in 1..10 {
        let g = turn(&mut s, &by_blocks(&prompt(tail)), t0);
        assert_eq!(
            g.node, first.node,
            "a prompt sharing the prefix went elsewhere"
        );
        assert_eq!(
            g.decision,
            Decision {
                kind: Kind::Prefix,
                outcome: Outcome::Hit
            }
        );
    }
    // Another system prompt is cold, and (least-in-flight from the rotation) is placed
    // like any request.
    let other = turn(&mut s, &by_blocks(&[900, 901, 902]), t0);
    assert_eq!(other.decision.outcome, Outcome::Cold);
    // A one-block match is below the threshold: it steers nothing.
    let short = turn(&mut s, &by_blocks(&[1, 555, 556]), t0);
    assert_eq!(short.decision.outcome, Outcome::Cold);
}

#[test]
fn requests_naming_nothing_still_spread_over_every_member() {
    let t0 = Instant::now();
    for routing in [
        RoutingPolicy::LeastInFlight,
        RoutingPolicy::Session,
        RoutingPolicy::Prefix,
        RoutingPolicy::SessionPrefix,
    ] {
        let mut s = edge(routing, t0);
        let held: Vec<Grant> = (0..8)
            .map(|_| grant(&mut s, &Affinity::none(), t0))
            .collect();
        for n in MEMBERS {
            let load = held.iter().filter(|g| &*g.node == n).count();
            assert_eq!(load, 2, "{routing:?}: {n} holds {load} of 8");
        }
        assert!(held.iter().all(|g| g.decision == Decision::UNSTEERED));
    }
}

#[test]
fn least_in_flight_ignores_session_keys() {
    let t0 = Instant::now();
    let mut s = edge(RoutingPolicy::LeastInFlight, t0);
    let affinity = by_session("sticky?");
    let nodes: std::collections::HashSet<_> =
        (0..4).map(|_| turn(&mut s, &affinity, t0).node).collect();
    assert_eq!(nodes.len(), 4, "round-robin over idle members");
}

/// What one routing decision costs with 64 members: a grant and its release, steered by a
/// session key, by a 512 KiB prompt's prefix, and not at all. A measurement, not a test:
/// `cargo test --release -p iop-edge --lib routing_decision_cost -- --ignored --nocapture`.
#[test]
#[ignore = "a measurement; run it in release"]
fn routing_decision_cost() {
    let nodes: Vec<String> = (0..64).map(|i| format!("n{i}")).collect();
    let names: Vec<&str> = nodes.iter().map(String::as_str).collect();
    let t0 = Instant::now();
    for (label, routing) in [
        ("least_in_flight", RoutingPolicy::LeastInFlight),
        ("session", RoutingPolicy::SessionPrefix),
        ("prefix", RoutingPolicy::Prefix),
    ] {
        let (providers, group) = spec(&names, routing, &[true; 64]);
        let mut s: Scheduler<u32> = Scheduler::new(providers, [group]);
        for (i, n) in names.iter().enumerate() {
            s.node_ready(n, Generation(i as u64 + 1), t0);
        }
        // Background load, and every member's index filled with other prompts.
        let mut held: Vec<Grant> = (0..96)
            .map(|_| grant(&mut s, &Affinity::none(), t0))
            .collect();
        for p in 0..64u64 {
            let blocks: Vec<u64> = (0..256).map(|b| p << 32 | b).collect();
            let g = grant(&mut s, &by_blocks(&blocks), t0);
            s.release(g.lease, &mut Vec::new(), t0);
        }
        let mut took = Vec::new();
        for i in 0..20_000u64 {
            let affinity = match routing {
                RoutingPolicy::LeastInFlight => Affinity::none(),
                RoutingPolicy::Prefix => {
                    by_blocks(&(0..1024).map(|b| (i % 64) << 32 | b).collect::<Vec<_>>())
                }
                _ => by_session(&format!("session-{}", i % 500)),
            };
            let start = Instant::now();
            let g = grant(&mut s, &affinity, t0);
            took.push(start.elapsed());
            s.release(g.lease, &mut Vec::new(), t0);
        }
        took.sort();
        let at = |p: f64| took[((took.len() - 1) as f64 * p) as usize];
        println!(
            "{label:>16}: p50 {:?}, p99 {:?}, max {:?} (64 members, 96 in flight)",
            at(0.5),
            at(0.99),
            took[took.len() - 1]
        );
        held.clear();
    }
}
