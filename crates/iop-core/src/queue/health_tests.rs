//! Unit tests of member exclusion (probe health, passive ejection) and of groups with no
//! member online, with explicit `now`.

use std::time::{Duration, Instant};

use iop_proto::pb;

use super::*;
use crate::ejection::{ProviderOutcome, Verdict};

const SEC: Duration = Duration::from_secs(1);

fn member(node: &str, capacity: u32) -> MemberSpec {
    MemberSpec {
        key: ProviderKey::new(node, "p"),
        upstream_model: "m".into(),
        capacity: LaneCounts {
            normal: capacity,
            long: 0,
        },
        enabled: true,
        traits: MemberTraits::default(),
    }
}

fn group(name: &str, nodes: &[&str], wait_for_reconnect: Duration) -> GroupSpec {
    GroupSpec {
        name: name.into(),
        members: nodes.iter().map(|n| member(n, 8)).collect(),
        max_waiting: 8,
        wait_for_reconnect,
        routing: Default::default(),
    }
}

/// Group `g` of members `a/p` and `b/p`, both online; ejection after 2 failures for 10 s.
fn two_members(t0: Instant) -> Scheduler<u32> {
    let mut s = Scheduler::new([], [group("g", &["a", "b"], Duration::ZERO)]);
    s.set_ejection_policy(EjectionPolicy {
        consecutive_failures: 2,
        base: 10 * SEC,
        max: 60 * SEC,
        ..Default::default()
    });
    s.node_ready("a", Generation(1), t0);
    s.node_ready("b", Generation(2), t0);
    s
}

fn nodes_granted(s: &mut Scheduler<u32>, n: usize, now: Instant) -> Vec<String> {
    (0..n)
        .map(|i| match s.admit("g", Lane::Normal, i as u32, now) {
            Admission::Granted(g) => {
                let node = g.node.to_string();
                let mut woken = Vec::new();
                s.release(g.lease, &mut woken, now);
                node
            }
            other => panic!("expected a grant, got {other:?}"),
        })
        .collect()
}

fn fail(s: &mut Scheduler<u32>, node: &str, now: Instant) -> Verdict {
    s.report_outcome(
        &ProviderKey::new(node, "p"),
        &ProviderOutcome::failure("HTTP 502"),
        now,
    )
    .unwrap()
}

fn probe(state: pb::ProviderHealthState) -> pb::ProviderHealth {
    pb::ProviderHealth {
        provider_id: "p".into(),
        state: state as i32,
        since_unix_ms: 1,
        last_error: if state == pb::ProviderHealthState::Unhealthy {
            "GET /models: cannot connect".into()
        } else {
            String::new()
        },
        last_error_unix_ms: 1,
    }
}

#[test]
fn an_ejected_member_gets_no_requests_until_its_time_has_passed() {
    let t0 = Instant::now();
    let mut s = two_members(t0);
    assert_eq!(fail(&mut s, "b", t0), Verdict::Unchanged);
    assert!(matches!(fail(&mut s, "b", t0), Verdict::Ejected { .. }));
    let during = nodes_granted(&mut s, 10, t0 + SEC);
    assert!(during.iter().all(|n| n == "a"), "{during:?}");
    let b = s.leases().account(&ProviderKey::new("b", "p")).unwrap();
    assert_eq!(
        s.health_view(b, t0 + SEC).ejected_until,
        Some(t0 + 10 * SEC)
    );
    // Back in rotation when the ejection time has passed.
    let after = nodes_granted(&mut s, 10, t0 + 10 * SEC);
    assert!(after.iter().any(|n| n == "b"), "{after:?}");
    assert_eq!(s.health_view(b, t0 + 10 * SEC).ejected_until, None);
}

#[test]
fn the_last_usable_member_of_a_group_is_never_ejected() {
    let t0 = Instant::now();
    let mut s = two_members(t0);
    fail(&mut s, "b", t0);
    assert!(matches!(fail(&mut s, "b", t0), Verdict::Ejected { .. }));
    // a is now the group's only usable member: its failures do not eject it.
    fail(&mut s, "a", t0);
    assert_eq!(fail(&mut s, "a", t0), Verdict::Kept { failures: 2 });
    let granted = nodes_granted(&mut s, 4, t0);
    assert!(granted.iter().all(|n| n == "a"), "{granted:?}");
    // A member shared with a second group is kept while that group has nothing else.
    let mut s: Scheduler<u32> = Scheduler::new(
        [],
        [
            group("g", &["a", "b"], Duration::ZERO),
            group("solo", &["b"], Duration::ZERO),
        ],
    );
    s.set_ejection_policy(EjectionPolicy {
        consecutive_failures: 1,
        ..EjectionPolicy::default()
    });
    s.node_ready("a", Generation(1), t0);
    s.node_ready("b", Generation(2), t0);
    assert!(matches!(fail(&mut s, "b", t0), Verdict::Kept { .. }));
    assert!(matches!(fail(&mut s, "a", t0), Verdict::Ejected { .. }));
}

#[test]
fn an_unhealthy_member_gets_no_requests_and_rejoins_when_healthy_again() {
    let t0 = Instant::now();
    let mut s = two_members(t0);
    let mut woken = Vec::new();
    let change = s
        .set_probe_health(
            "b",
            Generation(2),
            &probe(pb::ProviderHealthState::Unhealthy),
            t0,
            &mut woken,
        )
        .unwrap();
    assert_eq!(change.to, crate::health::ProbeHealth::Unhealthy);
    let granted = nodes_granted(&mut s, 6, t0);
    assert!(granted.iter().all(|n| n == "a"), "{granted:?}");
    // A report from another connection of the node changes nothing.
    assert!(
        s.set_probe_health(
            "b",
            Generation(9),
            &probe(pb::ProviderHealthState::Healthy),
            t0,
            &mut woken
        )
        .is_none()
    );
    s.set_probe_health(
        "b",
        Generation(2),
        &probe(pb::ProviderHealthState::Healthy),
        t0,
        &mut woken,
    );
    let granted = nodes_granted(&mut s, 6, t0);
    assert!(granted.iter().any(|n| n == "b"), "{granted:?}");
}

#[test]
fn a_healthy_probe_ends_an_ejection_early() {
    let t0 = Instant::now();
    let mut s = two_members(t0);
    let mut woken = Vec::new();
    s.set_probe_health(
        "b",
        Generation(2),
        &probe(pb::ProviderHealthState::Unhealthy),
        t0,
        &mut woken,
    );
    fail(&mut s, "b", t0);
    // Unhealthy b is excluded already, so a is not its group's last usable member... but b
    // is the one failing: it is ejected.
    assert!(matches!(fail(&mut s, "b", t0), Verdict::Ejected { .. }));
    s.set_probe_health(
        "b",
        Generation(2),
        &probe(pb::ProviderHealthState::Healthy),
        t0 + SEC,
        &mut woken,
    );
    let granted = nodes_granted(&mut s, 6, t0 + SEC);
    assert!(granted.iter().any(|n| n == "b"), "{granted:?}");
}

#[test]
fn a_group_whose_every_member_is_excluded_uses_them_rather_than_none() {
    let t0 = Instant::now();
    let mut s = two_members(t0);
    let mut woken = Vec::new();
    for node in ["a", "b"] {
        let generation = if node == "a" {
            Generation(1)
        } else {
            Generation(2)
        };
        s.set_probe_health(
            node,
            generation,
            &probe(pb::ProviderHealthState::Unhealthy),
            t0,
            &mut woken,
        );
    }
    let granted = nodes_granted(&mut s, 6, t0);
    assert!(granted.iter().any(|n| n == "a") && granted.iter().any(|n| n == "b"));
    // Healthy again, a member is preferred over the unhealthy one.
    s.set_probe_health(
        "a",
        Generation(1),
        &probe(pb::ProviderHealthState::Healthy),
        t0,
        &mut woken,
    );
    let granted = nodes_granted(&mut s, 6, t0);
    assert!(granted.iter().all(|n| n == "a"), "{granted:?}");
}

#[test]
fn a_waiter_is_served_by_a_member_that_turns_healthy() {
    let t0 = Instant::now();
    let mut s: Scheduler<u32> = Scheduler::new(
        [],
        [GroupSpec {
            members: vec![member("a", 1), member("b", 1)],
            ..group("g", &[], Duration::ZERO)
        }],
    );
    s.node_ready("a", Generation(1), t0);
    s.node_ready("b", Generation(2), t0);
    let mut woken = Vec::new();
    s.set_probe_health(
        "b",
        Generation(2),
        &probe(pb::ProviderHealthState::Unhealthy),
        t0,
        &mut woken,
    );
    assert!(matches!(
        s.admit("g", Lane::Normal, 1, t0),
        Admission::Granted(_)
    ));
    assert!(matches!(
        s.admit("g", Lane::Normal, 2, t0),
        Admission::Queued(_)
    ));
    s.set_probe_health(
        "b",
        Generation(2),
        &probe(pb::ProviderHealthState::Healthy),
        t0,
        &mut woken,
    );
    assert_eq!(woken.len(), 1);
    assert_eq!(&*woken[0].grant.node, "b");
}

#[test]
fn losing_a_node_forgets_its_probe_health_but_keeps_its_ejection() {
    let t0 = Instant::now();
    let mut s = two_members(t0);
    let mut woken = Vec::new();
    s.set_probe_health(
        "b",
        Generation(2),
        &probe(pb::ProviderHealthState::Unhealthy),
        t0,
        &mut woken,
    );
    s.node_lost("b", Generation(2), t0);
    let b = s.leases().account(&ProviderKey::new("b", "p")).unwrap();
    let view = s.health_view(b, t0);
    assert_eq!(view.probe, crate::health::ProbeHealth::Unknown);
    assert_eq!(view.last_error.unwrap().0, "GET /models: cannot connect");
}

#[test]
fn a_group_with_no_member_online_fails_at_once_naming_them() {
    let t0 = Instant::now();
    let mut s: Scheduler<u32> = Scheduler::new([], [group("g", &["a", "b"], Duration::ZERO)]);
    match s.admit("g", Lane::Normal, 1, t0) {
        Admission::Offline { members } => assert_eq!(members, ["a/p", "b/p"]),
        other => panic!("{other:?}"),
    }
    // Once one member is back, requests go through.
    s.node_ready("b", Generation(1), t0);
    assert!(matches!(
        s.admit("g", Lane::Normal, 2, t0),
        Admission::Granted(_)
    ));
}

#[test]
fn a_group_that_waits_for_reconnects_strands_its_waiters_until_their_time() {
    let t0 = Instant::now();
    let mut s: Scheduler<u32> = Scheduler::new([], [group("g", &["a"], 5 * SEC)]);
    let Admission::Queued(early) = s.admit("g", Lane::Normal, 1, t0) else {
        panic!("must wait for a reconnect");
    };
    assert_eq!(s.stranded_deadline(early), Some(t0 + 5 * SEC));
    assert!(s.expire_stranded(early, t0 + 4 * SEC).is_none(), "not yet");
    let (payload, offline) = s.expire_stranded(early, t0 + 5 * SEC).unwrap();
    assert_eq!((payload, offline), (1, vec!["a/p".to_string()]));
    // A reconnect in time dispatches the waiter; one queued while the member is online but
    // full is not stranded until the member goes away.
    let Admission::Queued(w) = s.admit("g", Lane::Normal, 2, t0) else {
        panic!()
    };
    let woken = s.node_ready("a", Generation(1), t0 + 2 * SEC);
    assert_eq!(woken.len(), 1);
    assert_eq!(s.stranded_deadline(w), None);
    let mut s: Scheduler<u32> = Scheduler::new(
        [],
        [GroupSpec {
            members: vec![member("a", 1)],
            ..group("g", &[], 5 * SEC)
        }],
    );
    s.node_ready("a", Generation(1), t0);
    let Admission::Granted(_) = s.admit("g", Lane::Normal, 1, t0) else {
        panic!()
    };
    let Admission::Queued(w) = s.admit("g", Lane::Normal, 2, t0) else {
        panic!()
    };
    assert_eq!(s.stranded_deadline(w), None);
    let lost = s.node_lost("a", Generation(1), t0 + 3 * SEC);
    assert!(lost.unavailable.is_empty());
    assert_eq!(lost.stranded, 1);
    assert_eq!(s.stranded_deadline(w), Some(t0 + 8 * SEC));
    s.node_ready("a", Generation(2), t0 + 4 * SEC);
    assert_eq!(s.stranded_deadline(w), None, "served: it was dispatched");
}

fn failed_on(s: &Scheduler<u32>, node: &str) -> Exclusion {
    let account = s.leases().account(&ProviderKey::new(node, "p")).unwrap();
    Exclusion {
        key: ProviderKey::new(node, "p"),
        generation: s.leases().online_generation(account).unwrap(),
    }
}

fn granted_node(a: Admission) -> String {
    match a {
        Admission::Granted(g) => g.node.to_string(),
        other => panic!("expected a grant, got {other:?}"),
    }
}

#[test]
fn a_retry_skips_ejected_members_and_those_it_failed_on_but_never_ends_with_none() {
    let t0 = Instant::now();
    let mut s = Scheduler::new([], [group("g", &["a", "b", "c"], Duration::ZERO)]);
    s.set_ejection_policy(EjectionPolicy {
        consecutive_failures: 1,
        base: 10 * SEC,
        max: 60 * SEC,
        ..Default::default()
    });
    for (node, generation) in [("a", 1), ("b", 2), ("c", 3)] {
        s.node_ready(node, Generation(generation), t0);
    }
    assert!(matches!(fail(&mut s, "a", t0), Verdict::Ejected { .. }));
    // Failed on b, a ejected: only c.
    let exclude = [failed_on(&s, "b")];
    for i in 0..6 {
        let node = granted_node(s.admit_excluding("g", Lane::Normal, i, &exclude, t0));
        assert_eq!(node, "c");
    }
    // Failed on b and c: the ejected a is all that is left, and it is used.
    let exclude = [failed_on(&s, "b"), failed_on(&s, "c")];
    let node = granted_node(s.admit_excluding("g", Lane::Normal, 9, &exclude, t0));
    assert_eq!(node, "a");
}

#[test]
fn a_retry_with_every_live_member_tried_ends_offline_or_waits_for_a_reconnect() {
    let t0 = Instant::now();
    let mut s = Scheduler::new(
        [],
        [
            group("g", &["a", "b"], Duration::ZERO),
            group("w", &["a", "b"], 5 * SEC),
        ],
    );
    s.node_ready("a", Generation(1), t0);
    // b is offline; the request failed on a.
    let exclude = [failed_on(&s, "a")];
    match s.admit_excluding("g", Lane::Normal, 1, &exclude, t0) {
        Admission::Offline { members } => assert_eq!(members, ["b/p"]),
        other => panic!("expected offline, got {other:?}"),
    }
    let id = match s.admit_excluding("w", Lane::Normal, 2, &exclude, t0) {
        Admission::Queued(id) => id,
        other => panic!("expected to wait, got {other:?}"),
    };
    assert_eq!(s.stranded_deadline(id), Some(t0 + 5 * SEC));
    // b reconnects: the retry is served there, not on a.
    let woken = s.node_ready("b", Generation(2), t0 + SEC);
    assert_eq!(woken.len(), 1);
    assert_eq!(&*woken[0].grant.node, "b");
}

#[test]
fn native_runs_reach_an_ejected_provider_and_do_not_keep_it_in_rotation() {
    let t0 = Instant::now();
    let provider = |node: &str| ProviderSpec {
        account: crate::lease::AccountSpec {
            key: ProviderKey::new(node, "p"),
            capacity: LaneCounts { normal: 8, long: 0 },
            max_in_flight: 8,
            enabled: true,
        },
        traits: MemberTraits::default(),
    };
    let mut s: Scheduler<u32> = Scheduler::new(
        [provider("a"), provider("b")],
        [group("g", &["a", "b"], Duration::ZERO)],
    );
    s.set_ejection_policy(EjectionPolicy {
        consecutive_failures: 1,
        ..EjectionPolicy::default()
    });
    s.node_ready("a", Generation(1), t0);
    s.node_ready("b", Generation(2), t0);
    // b's own queue (one member) does not make it a last usable member.
    assert!(matches!(fail(&mut s, "b", t0), Verdict::Ejected { .. }));
    let granted = nodes_granted(&mut s, 4, t0);
    assert!(granted.iter().all(|n| n == "a"), "{granted:?}");
    // A native run names its provider: it is served there, ejected or not.
    let node = granted_node(s.admit_direct(&ProviderKey::new("b", "p"), Lane::Normal, 7, t0));
    assert_eq!(node, "b");
    // And one to a provider whose node is offline ends at once.
    s.node_lost("a", Generation(1), t0);
    assert!(matches!(
        s.admit_direct(&ProviderKey::new("a", "p"), Lane::Normal, 8, t0),
        Admission::Offline { .. }
    ));
}

#[test]
fn no_more_than_the_policys_share_of_a_group_is_ejected_at_once() {
    let t0 = Instant::now();
    let mut s = Scheduler::new([], [group("g", &["a", "b", "c", "d"], Duration::ZERO)]);
    s.set_ejection_policy(EjectionPolicy {
        consecutive_failures: 1,
        base: 10 * SEC,
        max: 60 * SEC,
        max_ejected_percent: 50,
        ..Default::default()
    });
    for (node, generation) in [("a", 1), ("b", 2), ("c", 3), ("d", 4)] {
        s.node_ready(node, Generation(generation), t0);
    }
    // Half of four: two go out, the third failing member stays in (its failures count).
    assert!(matches!(fail(&mut s, "a", t0), Verdict::Ejected { .. }));
    assert!(matches!(fail(&mut s, "b", t0), Verdict::Ejected { .. }));
    assert!(matches!(fail(&mut s, "c", t0), Verdict::Kept { .. }));
    // Once one is back, another may go.
    assert!(matches!(
        fail(&mut s, "c", t0 + 11 * SEC),
        Verdict::Ejected { .. }
    ));
}
