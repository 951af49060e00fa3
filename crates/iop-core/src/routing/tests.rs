//! Unit tests of the pure routing rules: the load bound, rendezvous hashing and the
//! counts of decisions.

use super::*;

#[test]
fn the_load_bound_is_a_quarter_over_the_mean_and_at_least_two_over() {
    // Idle group of 4: mean 1/4 → ⌈mean⌉ + 2 = 3.
    assert_eq!(load_bound(0, 4), 3);
    // 40 in flight over 4 (41 with this one): mean 10.25 → ⌈12.8⌉ = 13 vs 11 + 2 = 13.
    assert_eq!(load_bound(40, 4), 13);
    // 400 over 4: mean 100.25 → 126 vs 103.
    assert_eq!(load_bound(400, 4), 126);
    // A lone member is bounded by nothing it could spill to.
    assert_eq!(load_bound(0, 1), 3);
    assert_eq!(load_bound(5, 0), load_bound(5, 1));
}

#[test]
fn rendezvous_is_stable_and_spreads_sessions_evenly() {
    let members: Vec<u64> = (0..8)
        .map(|i| member_identity(&format!("n{i}"), "p"))
        .collect();
    let mut firsts = [0usize; 8];
    for s in 0..8000u64 {
        let key = session::hash(&format!("session-{s}"));
        let order = rendezvous_order(key, &members);
        assert_eq!(order, rendezvous_order(key, &members));
        firsts[order[0]] += 1;
    }
    for n in firsts {
        assert!((800..1200).contains(&n), "uneven spread: {firsts:?}");
    }
    // Removing a member moves only its own sessions.
    let fewer = &members[..7];
    for s in 0..2000u64 {
        let key = session::hash(&format!("session-{s}"));
        let before = rendezvous_order(key, &members)[0];
        let after = rendezvous_order(key, fewer)[0];
        if before != 7 {
            assert_eq!(before, after);
        }
    }
}

#[test]
fn the_hit_ratio_counts_steered_decisions_only() {
    let mut stats = Stats::default();
    assert_eq!(stats.hit_ratio(), None);
    stats.add(Decision::UNSTEERED, 1);
    assert_eq!(stats.hit_ratio(), None);
    for outcome in [Outcome::Hit, Outcome::Hit, Outcome::Hit, Outcome::OverBound] {
        stats.add(
            Decision {
                kind: Kind::Session,
                outcome,
            },
            1,
        );
    }
    assert_eq!(stats.hit_ratio(), Some(0.75));
    assert_eq!(stats.get(Kind::Session, Outcome::OverBound), 1);
    assert_eq!(stats.iter().count(), 3);
}

#[test]
fn policies_parse_from_the_config_names() {
    for policy in [
        RoutingPolicy::LeastInFlight,
        RoutingPolicy::Session,
        RoutingPolicy::Prefix,
        RoutingPolicy::SessionPrefix,
    ] {
        let parsed: RoutingPolicy = serde_yaml_ng::from_str(policy.as_str()).unwrap();
        assert_eq!(parsed, policy);
    }
    assert_eq!(RoutingPolicy::default(), RoutingPolicy::SessionPrefix);
}

#[test]
fn a_decision_is_named_kind_slash_outcome_and_read_back() {
    for kind in Kind::ALL {
        for outcome in Outcome::ALL {
            let decision = Decision { kind, outcome };
            let name = decision.as_str();
            assert_eq!(name, format!("{}/{}", kind.as_str(), outcome.as_str()));
            assert_eq!(Decision::parse(name), Some(decision));
        }
    }
    assert_eq!(Decision::parse("session"), None);
    assert_eq!(Decision::parse("session/maybe"), None);
    assert_eq!(Decision::parse(""), None);
}
