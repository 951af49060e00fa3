//! Unit and property tests of admission, leases and waiters together.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, OnceLock};

use proptest::prelude::*;

use super::*;
use crate::lease::AccountSpec;

/// A fixed moment: these tests do not depend on time (the health tests pass their own).
fn now() -> Instant {
    static T0: OnceLock<Instant> = OnceLock::new();
    *T0.get_or_init(Instant::now)
}

fn key(node: &str, provider: &str) -> ProviderKey {
    ProviderKey::new(node, provider)
}

fn member(node: &str, provider: &str, normal: u32, long: u32) -> MemberSpec {
    MemberSpec {
        key: key(node, provider),
        upstream_model: format!("{provider}-model"),
        capacity: LaneCounts { normal, long },
        enabled: true,
        traits: MemberTraits::default(),
    }
}

fn provider(node: &str, name: &str, normal: u32, long: u32) -> ProviderSpec {
    ProviderSpec {
        account: AccountSpec {
            key: key(node, name),
            capacity: LaneCounts { normal, long },
            max_in_flight: normal + long,
            enabled: true,
        },
        traits: MemberTraits::default(),
    }
}

fn group(name: &str, members: Vec<MemberSpec>) -> GroupSpec {
    GroupSpec {
        name: name.into(),
        members,
        max_waiting: 8,
        wait_for_reconnect: Duration::ZERO,
        routing: Default::default(),
    }
}

/// A group whose requests wait up to 30 s for a member to reconnect.
fn waiting_group(name: &str, members: Vec<MemberSpec>) -> GroupSpec {
    GroupSpec {
        wait_for_reconnect: Duration::from_secs(30),
        routing: Default::default(),
        ..group(name, members)
    }
}

fn granted(a: Admission) -> Grant {
    match a {
        Admission::Granted(g) => g,
        other => panic!("expected a grant, got {other:?}"),
    }
}

fn queued(a: Admission) -> WaiterId {
    match a {
        Admission::Queued(id) => id,
        other => panic!("expected to queue, got {other:?}"),
    }
}

/// Two aliases share one provider of capacity 1 (the reference's capacity smoke).
#[test]
fn aliases_share_one_lease_account_in_fifo_order() {
    let mut s: Scheduler<&str> = Scheduler::new(
        [],
        [
            group("alias-a", vec![member("n", "p", 1, 0)]),
            group("alias-b", vec![member("n", "p", 1, 0)]),
        ],
    );
    s.node_ready("n", Generation(1), now());
    let first = granted(s.admit("alias-a", Lane::Normal, "first", now()));
    queued(s.admit("alias-b", Lane::Normal, "second", now()));
    queued(s.admit("alias-a", Lane::Normal, "third", now()));

    let mut woken = Vec::new();
    assert!(s.release(first.lease, &mut woken, now()));
    assert_eq!(woken.len(), 1);
    assert_eq!(woken[0].waiter, "second");
    let second = woken.pop().unwrap().grant;
    assert!(s.release(second.lease, &mut woken, now()));
    assert_eq!(woken[0].waiter, "third");
    let third = woken.pop().unwrap().grant;
    assert!(s.release(third.lease, &mut woken, now()));
    assert!(woken.is_empty());
    let account = s.leases().account(&key("n", "p")).unwrap();
    assert_eq!(s.leases().view(account).in_flight, LaneCounts::default());
}

#[test]
fn long_requests_wait_for_the_long_slot_while_normal_ones_flow() {
    let mut s: Scheduler<&str> = Scheduler::new([], [group("g", vec![member("n", "p", 2, 1)])]);
    s.node_ready("n", Generation(1), now());
    let long1 = granted(s.admit("g", Lane::Long, "long-1", now()));
    queued(s.admit("g", Lane::Long, "long-2", now()));
    // Normal requests are not held up by the long waiter ahead of them.
    let n1 = granted(s.admit("g", Lane::Normal, "n1", now()));
    let n2 = granted(s.admit("g", Lane::Normal, "n2", now()));
    queued(s.admit("g", Lane::Normal, "n3", now()));
    let mut woken = Vec::new();
    s.release(n1.lease, &mut woken, now());
    assert_eq!(woken.iter().map(|d| d.waiter).collect::<Vec<_>>(), ["n3"]);
    woken.clear();
    s.release(long1.lease, &mut woken, now());
    assert_eq!(
        woken.iter().map(|d| d.waiter).collect::<Vec<_>>(),
        ["long-2"]
    );
    assert_eq!(woken[0].grant.lane, Lane::Long);
    let _ = n2;
}

#[test]
fn a_lane_no_member_has_is_refused_at_once() {
    let mut s: Scheduler<()> = Scheduler::new([], [group("g", vec![member("n", "p", 2, 0)])]);
    s.node_ready("n", Generation(1), now());
    assert!(matches!(
        s.admit("g", Lane::Long, (), now()),
        Admission::NoCapacityInLane
    ));
    assert!(matches!(
        s.admit("nope", Lane::Normal, (), now()),
        Admission::UnknownGroup
    ));
}

#[test]
fn the_queue_is_bounded() {
    let mut s: Scheduler<u32> = Scheduler::new(
        [],
        [GroupSpec {
            max_waiting: 2,
            ..group("g", vec![member("n", "p", 1, 0)])
        }],
    );
    s.node_ready("n", Generation(1), now());
    granted(s.admit("g", Lane::Normal, 0, now()));
    queued(s.admit("g", Lane::Normal, 1, now()));
    queued(s.admit("g", Lane::Normal, 2, now()));
    assert!(matches!(
        s.admit("g", Lane::Normal, 3, now()),
        Admission::QueueFull { max_waiting: 2 }
    ));
}

#[test]
fn losing_the_only_node_ends_its_waiters_unavailable_and_returns_leases() {
    let mut s: Scheduler<&str> = Scheduler::new([], [group("g", vec![member("n", "p", 1, 0)])]);
    s.node_ready("n", Generation(1), now());
    let running = granted(s.admit("g", Lane::Normal, "running", now()));
    queued(s.admit("g", Lane::Normal, "w1", now()));
    queued(s.admit("g", Lane::Normal, "w2", now()));
    let lost = s.node_lost("n", Generation(1), now());
    assert_eq!(lost.released, vec![running.lease]);
    assert_eq!(lost.unavailable, vec!["w1", "w2"]);
    assert_eq!(s.waiting(0), LaneCounts::default());
    // The running request's guard releases later: a no-op.
    let mut woken = Vec::new();
    assert!(!s.release(running.lease, &mut woken, now()));
}

#[test]
fn waiters_keep_waiting_while_another_member_is_live() {
    let mut s: Scheduler<&str> = Scheduler::new(
        [],
        [group(
            "g",
            vec![member("a", "p", 1, 0), member("b", "p", 1, 0)],
        )],
    );
    s.node_ready("a", Generation(1), now());
    s.node_ready("b", Generation(2), now());
    let on_a = granted(s.admit("g", Lane::Normal, "x", now()));
    let on_b = granted(s.admit("g", Lane::Normal, "y", now()));
    assert_ne!(on_a.node, on_b.node);
    queued(s.admit("g", Lane::Normal, "w", now()));
    let lost = s.node_lost(&on_a.node.clone(), on_a.generation, now());
    assert!(lost.unavailable.is_empty());
    let mut woken = Vec::new();
    s.release(on_b.lease, &mut woken, now());
    assert_eq!(woken[0].waiter, "w");
    assert_eq!(woken[0].grant.node, on_b.node);
}

#[test]
fn stale_loss_changes_nothing() {
    let mut s: Scheduler<&str> = Scheduler::new([], [group("g", vec![member("n", "p", 1, 0)])]);
    s.node_ready("n", Generation(2), now());
    let g = granted(s.admit("g", Lane::Normal, "x", now()));
    queued(s.admit("g", Lane::Normal, "w", now()));
    let lost = s.node_lost("n", Generation(1), now());
    assert!(lost.released.is_empty());
    assert!(lost.unavailable.is_empty());
    assert!(s.leases().is_live(g.lease));
}

#[test]
fn a_waiter_queued_while_offline_is_dispatched_once_on_ready() {
    let mut s: Scheduler<&str> =
        Scheduler::new([], [waiting_group("g", vec![member("n", "p", 1, 0)])]);
    let id = queued(s.admit("g", Lane::Normal, "early", now()));
    let woken = s.node_ready("n", Generation(7), now());
    assert_eq!(woken.len(), 1);
    assert_eq!(woken[0].waiter, "early");
    assert_eq!(woken[0].grant.generation, Generation(7));
    assert!(s.cancel_waiter(id).is_none());
    // A duplicate activation dispatches nothing more.
    assert!(s.node_ready("n", Generation(7), now()).is_empty());
}

#[test]
fn least_loaded_member_first_and_ties_round_robin() {
    let mut s: Scheduler<()> = Scheduler::new(
        [],
        [group(
            "g",
            vec![member("a", "p", 4, 0), member("b", "p", 4, 0)],
        )],
    );
    s.node_ready("a", Generation(1), now());
    s.node_ready("b", Generation(2), now());
    let nodes: Vec<Arc<str>> = (0..4)
        .map(|_| granted(s.admit("g", Lane::Normal, (), now())).node)
        .collect();
    assert_eq!(nodes.iter().filter(|n| &***n == "a").count(), 2);
    assert_ne!(nodes[0], nodes[1]);
}

#[test]
fn cancelled_waiter_is_gone() {
    let mut s: Scheduler<&str> = Scheduler::new([], [group("g", vec![member("n", "p", 1, 0)])]);
    s.node_ready("n", Generation(1), now());
    let g = granted(s.admit("g", Lane::Normal, "x", now()));
    let w = queued(s.admit("g", Lane::Normal, "w", now()));
    assert_eq!(s.cancel_waiter(w), Some("w"));
    let mut woken = Vec::new();
    s.release(g.lease, &mut woken, now());
    assert!(woken.is_empty());
}

#[test]
fn more_capacity_from_a_reload_dispatches_waiters_at_once() {
    let mut s: Scheduler<&str> = Scheduler::new([], [group("g", vec![member("n", "p", 1, 0)])]);
    s.node_ready("n", Generation(1), now());
    let running = granted(s.admit("g", Lane::Normal, "running", now()));
    queued(s.admit("g", Lane::Normal, "waiting", now()));
    let online = [("n".to_string(), Generation(1))].into();
    let (orphaned, woken) = s.reconfigure(
        [provider("n", "p", 2, 0)],
        [group("g", vec![member("n", "p", 2, 0)])],
        &online,
        now(),
    );
    assert!(orphaned.is_empty());
    assert_eq!(
        woken.iter().map(|d| d.waiter).collect::<Vec<_>>(),
        ["waiting"]
    );
    // The lease taken before the reload is still counted and released once.
    let account = s.leases().account(&key("n", "p")).unwrap();
    assert_eq!(s.leases().view(account).in_flight.normal, 2);
    let mut more = Vec::new();
    assert!(s.release(running.lease, &mut more, now()));
    assert!(!s.release(running.lease, &mut more, now()));
    assert_eq!(s.leases().view(account).in_flight.normal, 1);
}

#[test]
fn a_reload_ends_waiters_of_removed_groups_and_serves_new_ones() {
    let mut s: Scheduler<&str> = Scheduler::new([], [group("old", vec![member("n", "p", 1, 0)])]);
    s.node_ready("n", Generation(3), now());
    let _running = granted(s.admit("old", Lane::Normal, "running", now()));
    queued(s.admit("old", Lane::Normal, "orphan", now()));
    let online = [("n".to_string(), Generation(3))].into();
    let (orphaned, woken) = s.reconfigure(
        [provider("n", "p", 1, 0), provider("n", "q", 1, 0)],
        [group("new", vec![member("n", "q", 1, 0)])],
        &online,
        now(),
    );
    assert_eq!(orphaned, ["orphan"]);
    assert!(woken.is_empty());
    assert!(matches!(
        s.admit("old", Lane::Normal, "x", now()),
        Admission::UnknownGroup
    ));
    // The provider added to an online node is online at once, under its generation.
    let g = granted(s.admit("new", Lane::Normal, "y", now()));
    assert_eq!(g.generation, Generation(3));
}

#[test]
fn a_provider_dropped_by_a_reload_takes_no_new_requests() {
    let mut s: Scheduler<&str> = Scheduler::new([], [group("g", vec![member("n", "p", 1, 0)])]);
    s.node_ready("n", Generation(1), now());
    let online = [("n".to_string(), Generation(1))].into();
    s.reconfigure(
        [],
        [group("g", vec![member("n", "p", 1, 0)])],
        &online,
        now(),
    );
    // The group still names it, so the member spec re-enables it: groups win.
    assert!(matches!(
        s.admit("g", Lane::Normal, "a", now()),
        Admission::Granted(_)
    ));
    let (_, _) = s.reconfigure([], [], &online, now());
    let account = s.leases().account(&key("n", "p")).unwrap();
    assert!(!s.leases().view(account).enabled);
}

#[test]
fn a_retry_never_gets_a_member_that_failed_it_under_the_same_generation() {
    let mut s: Scheduler<&str> = Scheduler::new(
        [provider("a", "p", 1, 0), provider("b", "p", 1, 0)],
        [group(
            "g",
            vec![member("a", "p", 1, 0), member("b", "p", 1, 0)],
        )],
    );
    s.node_ready("a", Generation(1), now());
    s.node_ready("b", Generation(2), now());
    let first = granted(s.admit("g", Lane::Normal, "first", now()));
    let failed_on = first.exclusion();
    let mut woken = Vec::new();
    s.release(first.lease, &mut woken, now());
    // The retry goes to the other member, whichever the round-robin would pick.
    let retry = granted(s.admit_excluding(
        "g",
        Lane::Normal,
        "retry",
        std::slice::from_ref(&failed_on),
        now(),
    ));
    assert_ne!(retry.node, failed_on.key.node);
    // With the other member busy, the retry waits rather than taking the failed one...
    let blocked = s.admit_excluding(
        "g",
        Lane::Normal,
        "again",
        std::slice::from_ref(&failed_on),
        now(),
    );
    let waiting = queued(blocked);
    // ...while a fresh request behind it takes the free (not excluded) slot.
    let fresh = granted(s.admit("g", Lane::Normal, "fresh", now()));
    assert_eq!(fresh.node, failed_on.key.node);
    // When the other member frees, the excluded waiter gets it.
    s.release(retry.lease, &mut woken, now());
    assert_eq!(woken.len(), 1);
    assert_eq!(woken[0].waiter, "again");
    assert_ne!(woken[0].grant.node, failed_on.key.node);
    assert!(s.cancel_waiter(waiting).is_none());
    // Every member excluded: refused at once.
    let other = woken[0].grant.exclusion();
    assert!(matches!(
        s.admit_excluding("g", Lane::Normal, "none", &[failed_on, other], now()),
        Admission::Exhausted
    ));
}

#[test]
fn an_excluded_member_is_a_candidate_again_under_its_next_generation() {
    let mut s: Scheduler<&str> = Scheduler::new(
        [provider("a", "p", 1, 0)],
        [waiting_group("g", vec![member("a", "p", 1, 0)])],
    );
    s.node_ready("a", Generation(1), now());
    let first = granted(s.admit("g", Lane::Normal, "first", now()));
    let failed_on = first.exclusion();
    s.node_lost("a", Generation(1), now());
    // The node is gone: in a group that waits for reconnects the retry waits for it...
    queued(s.admit_excluding("g", Lane::Normal, "retry", &[failed_on], now()));
    // ...and its new generation serves it.
    let woken = s.node_ready("a", Generation(2), now());
    assert_eq!(woken.len(), 1);
    assert_eq!(woken[0].grant.generation, Generation(2));
}

#[test]
fn the_nodes_gate_caps_the_lanes_of_a_provider() {
    let mut p = provider("n", "p", 4, 1);
    p.account.max_in_flight = 1;
    let mut s: Scheduler<&str> = Scheduler::new([p], [group("g", vec![member("n", "p", 4, 1)])]);
    s.node_ready("n", Generation(1), now());
    let only = granted(s.admit("g", Lane::Normal, "only", now()));
    queued(s.admit("g", Lane::Normal, "second", now()));
    queued(s.admit("g", Lane::Long, "long", now()));
    let mut woken = Vec::new();
    s.release(only.lease, &mut woken, now());
    assert_eq!(woken.len(), 1, "one at a time");
}

#[test]
fn requests_pinned_to_a_provider_share_its_account_with_the_groups() {
    let mut s: Scheduler<&str> = Scheduler::new(
        [provider("n", "p", 1, 0)],
        [group("g", vec![member("n", "p", 1, 0)])],
    );
    s.node_ready("n", Generation(1), now());
    let pinned = granted(s.admit_direct(&key("n", "p"), Lane::Normal, "native run", now()));
    assert_eq!(&*pinned.provider, "p");
    // The group's request waits for the slot the native run holds.
    queued(s.admit("g", Lane::Normal, "group request", now()));
    queued(s.admit_direct(&key("n", "p"), Lane::Normal, "second run", now()));
    let mut woken = Vec::new();
    s.release(pinned.lease, &mut woken, now());
    assert_eq!(
        woken[0].waiter, "group request",
        "oldest first across queues"
    );
    assert!(matches!(
        s.admit_direct(&key("n", "nope"), Lane::Normal, "x", now()),
        Admission::UnknownGroup
    ));
    // Provider queues are not model groups.
    assert_eq!(s.groups_waiting().count(), 1);
    assert!(matches!(
        s.admit("n/p", Lane::Normal, "x", now()),
        Admission::UnknownGroup
    ));
}

// ------------------------------------------------------------------ property test

#[derive(Debug, Clone)]
enum Op {
    Admit {
        group: usize,
        long: bool,
    },
    /// Terminal, send failure or client abort: all of them release the lease.
    Release {
        pick: usize,
    },
    /// A second release of an already released lease.
    ReleaseAgain {
        pick: usize,
    },
    Disconnect {
        node: usize,
    },
    StaleDisconnect {
        node: usize,
    },
    Ready {
        node: usize,
    },
    Timeout {
        pick: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..3usize, any::<bool>()).prop_map(|(group, long)| Op::Admit { group, long }),
        4 => any::<usize>().prop_map(|pick| Op::Release { pick }),
        1 => any::<usize>().prop_map(|pick| Op::ReleaseAgain { pick }),
        1 => (0..2usize).prop_map(|node| Op::Disconnect { node }),
        1 => (0..2usize).prop_map(|node| Op::StaleDisconnect { node }),
        2 => (0..2usize).prop_map(|node| Op::Ready { node }),
        1 => any::<usize>().prop_map(|pick| Op::Timeout { pick }),
    ]
}

const NODES: [&str; 2] = ["n0", "n1"];

fn fixture() -> Scheduler<u64> {
    Scheduler::new(
        [],
        [
            waiting_group("g0", vec![member("n0", "p", 1, 1), member("n1", "r", 1, 1)]),
            // An alias of n0/p: shares its account.
            waiting_group("g1", vec![member("n0", "p", 1, 1)]),
            // Fails at once while its members are offline.
            group("g2", vec![member("n0", "q", 2, 0), member("n1", "r", 1, 1)]),
        ],
    )
}

struct Model {
    live: HashMap<LeaseId, (ProviderKey, Lane)>,
    released: HashSet<LeaseId>,
    waiting: HashMap<u64, WaiterId>,
    generation: [Option<Generation>; 2],
    last_gen: u64,
    next_request: u64,
}

impl Model {
    fn take(&mut self, grant: &Grant) {
        let fresh = self.live.insert(
            grant.lease,
            (ProviderKey::new(&grant.node, &grant.provider), grant.lane),
        );
        assert!(fresh.is_none(), "lease granted twice");
    }

    fn wake(&mut self, woken: Vec<Dispatch<u64>>) {
        for d in woken {
            assert!(
                self.waiting.remove(&d.waiter).is_some(),
                "woke a waiter twice"
            );
            self.take(&d.grant);
        }
    }

    fn release(&mut self, s: &mut Scheduler<u64>, lease: LeaseId) {
        let mut woken = Vec::new();
        let was_live = self.live.remove(&lease).is_some();
        let did = s.release(lease, &mut woken, now());
        assert_eq!(did, was_live, "release of {lease:?}");
        if did {
            assert!(self.released.insert(lease), "released twice");
        }
        self.wake(woken);
    }
}

fn check(s: &Scheduler<u64>, m: &Model) {
    let capacities: HashMap<ProviderKey, LaneCounts> = [
        (key("n0", "p"), LaneCounts { normal: 1, long: 1 }),
        (key("n0", "q"), LaneCounts { normal: 2, long: 0 }),
        (key("n1", "r"), LaneCounts { normal: 1, long: 1 }),
    ]
    .into();
    for (k, cap) in &capacities {
        let id = s.leases().account(k).unwrap();
        let view = s.leases().view(id);
        let mut want = LaneCounts::default();
        for (key, lane) in m.live.values() {
            if key == k {
                match lane {
                    Lane::Normal => want.normal += 1,
                    Lane::Long => want.long += 1,
                }
            }
        }
        assert_eq!(view.in_flight, want, "in-flight of {k:?}");
        assert!(view.in_flight.normal <= cap.normal && view.in_flight.long <= cap.long);
    }
    assert_eq!(s.leases().live_count(), m.live.len());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]
    #[test]
    fn leases_and_waiters_stay_consistent(ops in proptest::collection::vec(op(), 1..120)) {
        let mut s = fixture();
        let mut m = Model {
            live: HashMap::new(),
            released: HashSet::new(),
            waiting: HashMap::new(),
            generation: [None, None],
            last_gen: 0,
            next_request: 0,
        };
        for op in ops {
            match op {
                Op::Admit { group, long } => {
                    let lane = if long { Lane::Long } else { Lane::Normal };
                    m.next_request += 1;
                    let name = ["g0", "g1", "g2"][group];
                    match s.admit(name, lane, m.next_request, now()) {
                        Admission::Granted(g) => m.take(&g),
                        Admission::Queued(id) => { m.waiting.insert(m.next_request, id); }
                        Admission::QueueFull { .. } => assert!(m.waiting.len() >= 8),
                        Admission::Offline { members } => {
                            assert_eq!(name, "g2");
                            let serving = if long { vec![1] } else { vec![0, 1] };
                            assert!(serving.iter().all(|&n| m.generation[n].is_none()));
                            assert!(!members.is_empty());
                        }
                        Admission::NoCapacityInLane | Admission::UnknownGroup | Admission::Exhausted => {
                            unreachable!("every fixture group has both lanes; nothing is excluded")
                        }
                    }
                }
                Op::Release { pick } => {
                    let mut live: Vec<_> = m.live.keys().copied().collect();
                    live.sort();
                    if !live.is_empty() {
                        let lease = live[pick % live.len()];
                        m.release(&mut s, lease);
                    }
                }
                Op::ReleaseAgain { pick } => {
                    let mut done: Vec<_> = m.released.iter().copied().collect();
                    done.sort();
                    if !done.is_empty() {
                        let mut woken = Vec::new();
                        assert!(!s.release(done[pick % done.len()], &mut woken, now()));
                        assert!(woken.is_empty());
                    }
                }
                Op::Disconnect { node } => {
                    if let Some(generation) = m.generation[node].take() {
                        let lost = s.node_lost(NODES[node], generation, now());
                        for lease in lost.released {
                            assert!(m.live.remove(&lease).is_some(), "fence returned a dead lease");
                            assert!(m.released.insert(lease));
                        }
                        for waiter in lost.unavailable {
                            assert!(m.waiting.remove(&waiter).is_some());
                        }
                        // Nothing left on that node.
                        assert!(m.live.values().all(|(k, _)| &*k.node != NODES[node]));
                    }
                }
                Op::StaleDisconnect { node } => {
                    let before = m.live.len();
                    let lost = s.node_lost(NODES[node], Generation(0), now());
                    assert!(lost.released.is_empty() && lost.unavailable.is_empty());
                    assert_eq!(m.live.len(), before);
                }
                Op::Ready { node } => {
                    if m.generation[node].is_none() {
                        m.last_gen += 1;
                        let generation = Generation(m.last_gen);
                        m.generation[node] = Some(generation);
                        let woken = s.node_ready(NODES[node], generation, now());
                        m.wake(woken);
                    }
                }
                Op::Timeout { pick } => {
                    let mut waiting: Vec<_> = m.waiting.keys().copied().collect();
                    waiting.sort();
                    if !waiting.is_empty() {
                        let request = waiting[pick % waiting.len()];
                        let id = m.waiting[&request];
                        assert_eq!(s.cancel_waiter(id), Some(request));
                        m.waiting.remove(&request);
                    }
                }
            }
            check(&s, &m);
        }
        // Every request finishes: in-flight ones release, waiters run or time out.
        for _ in 0..1000 {
            let Some(&lease) = m.live.keys().next() else { break };
            m.release(&mut s, lease);
            check(&s, &m);
        }
        for (_, id) in m.waiting.drain() {
            s.cancel_waiter(id);
        }
        prop_assert!(m.live.is_empty());
        let totals = s.leases().totals();
        prop_assert_eq!(totals.acquired, totals.released);
        prop_assert_eq!(totals.released as usize, m.released.len());
        for id in s.leases().accounts() {
            prop_assert_eq!(s.leases().view(id).in_flight, LaneCounts::default());
        }
    }
}

/// A retry takes another member without moving the rotation: the next first attempt
/// still goes where the rotation pointed.
#[test]
fn a_retry_never_moves_the_rotation() {
    let members = vec![
        member("n", "a", 4, 0),
        member("n", "b", 4, 0),
        member("n", "c", 4, 0),
    ];
    let mut s: Scheduler<()> = Scheduler::new([], [group("g", members)]);
    s.node_ready("n", Generation(1), now());
    let first = granted(s.admit("g", Lane::Normal, (), now()));
    assert_eq!(&*first.provider, "a");
    s.release(first.lease, &mut Vec::new(), now());
    // A retry of a request that failed on `b` goes to `c`...
    let exclude = [Exclusion {
        key: key("n", "b"),
        generation: Generation(1),
    }];
    let retry = granted(s.admit_excluding("g", Lane::Normal, (), &exclude, now()));
    s.release(retry.lease, &mut Vec::new(), now());
    // ...and the next first attempt still goes to `b`, then `c`.
    let next: Vec<String> = (0..2)
        .map(|_| {
            let g = granted(s.admit("g", Lane::Normal, (), now()));
            s.release(g.lease, &mut Vec::new(), now());
            g.provider.to_string()
        })
        .collect();
    assert_eq!(next, ["b", "c"]);
}

/// A member cooling down after a 429 gets no first attempts while the group has another,
/// and all of them again once the cool-down ends.
#[test]
fn a_member_cooling_down_is_skipped_until_it_ends() {
    let members = vec![member("n", "a", 4, 0), member("n", "b", 4, 0)];
    let mut s: Scheduler<()> = Scheduler::new([], [group("g", members)]);
    s.node_ready("n", Generation(1), now());
    s.cool_down(&key("n", "a"), now() + Duration::from_secs(30));
    for _ in 0..4 {
        let g = granted(s.admit("g", Lane::Normal, (), now()));
        assert_eq!(&*g.provider, "b");
        s.release(g.lease, &mut Vec::new(), now());
    }
    let later = now() + Duration::from_secs(30);
    let providers: HashSet<String> = (0..2)
        .map(|_| {
            granted(s.admit("g", Lane::Normal, (), later))
                .provider
                .to_string()
        })
        .collect();
    assert!(providers.contains("a"), "{providers:?}");
}
