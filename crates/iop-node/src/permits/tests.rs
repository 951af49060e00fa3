use std::collections::VecDeque;

use proptest::prelude::*;

use super::*;

fn demand(in_use: u32, waiting: u32, oldest_wait_ms: u64) -> Vec<Demand> {
    sent_demand(in_use, 0, waiting, oldest_wait_ms)
}

fn sent_demand(in_use: u32, unsent: u32, waiting: u32, oldest_wait_ms: u64) -> Vec<Demand> {
    vec![Demand {
        provider: "p".into(),
        in_use,
        unsent,
        waiting,
        oldest_wait_ms,
    }]
}

fn permits_of(grants: &[Grant], link: LinkId) -> Option<(u64, u32)> {
    grants
        .iter()
        .rev()
        .find(|g| g.link == link)
        .map(|g| (g.seq, g.permits[0].1))
}

fn book(capacity: u32) -> PermitBook {
    let mut book = PermitBook::default();
    book.configure(&[("p".into(), capacity)], 0);
    book
}

#[test]
fn one_link_gets_every_permit() {
    let mut b = book(3);
    let grants = b.link(1, 0);
    assert_eq!(permits_of(&grants, 1), Some((1, 3)));
}

#[test]
fn a_second_link_gets_idle_permits_once_the_first_acknowledges_losing_them() {
    let mut b = book(2);
    b.link(1, 0);
    // Edge 2 links: nothing is free, it hears it has none.
    assert_eq!(permits_of(&b.link(2, 0), 2), Some((1, 0)));
    // It has a request waiting: edge 1's idle permits are asked back...
    let grants = b.report(2, 1, &demand(0, 1, 5), 10);
    let (seq, left) = permits_of(&grants, 1).expect("edge 1 told");
    assert_eq!(left, 1);
    assert_eq!(
        permits_of(&grants, 2),
        None,
        "not before edge 1 acknowledges"
    );
    assert_eq!(b.held("p"), 2);
    // ... and go to edge 2 once edge 1 says it applied that (holding nothing).
    let grants = b.report(1, seq, &demand(0, 0, 0), 11);
    assert_eq!(permits_of(&grants, 2).map(|g| g.1), Some(1));
    assert_eq!(b.held("p"), 2);
}

#[test]
fn a_run_the_edge_admitted_but_had_not_sent_keeps_its_slot() {
    let mut b = book(1);
    b.link(1, 0);
    b.link(2, 0);
    let grants = b.report(2, 1, &demand(0, 1, 5), 10);
    let (seq, _) = permits_of(&grants, 1).unwrap();
    // Edge 1 had admitted a request before it applied the lower grant; its run is on its
    // way. The slot stays edge 1's until the run arrives and ends.
    let grants = b.report(1, seq, &sent_demand(1, 1, 0, 0), 11);
    assert_eq!(permits_of(&grants, 2), None);
    b.started("p", 1);
    assert_eq!(permits_of(&b.rebalance(12), 2), None);
    let grants = b.ended("p", 1, 13);
    assert_eq!(permits_of(&grants, 2).map(|g| g.1), Some(1));
}

#[test]
fn the_oldest_waiter_across_edges_gets_the_next_slot() {
    let mut b = book(2);
    b.link(1, 0);
    b.link(2, 0);
    b.link(3, 0);
    // Edges 1 and 2 hold one permit each, both busy; edge 3 has none.
    let grants = b.report(2, 1, &demand(0, 1, 0), 10);
    let (seq, _) = permits_of(&grants, 1).unwrap();
    let grants = b.report(1, seq, &demand(0, 0, 0), 11);
    assert_eq!(permits_of(&grants, 2).map(|g| g.1), Some(1));
    for link in [1, 2] {
        b.started("p", link);
    }
    b.report(2, 2, &demand(1, 0, 0), 100);
    // Edge 1's waiter came at 90, edge 3's at 50: edge 3's is older.
    b.report(1, seq, &demand(1, 1, 10), 100);
    let grants = b.report(3, 1, &demand(0, 1, 50), 100);
    // Edge 1 (younger waiter) gives one up; nothing is free until its run ends.
    let (seq, left) = permits_of(&grants, 1).expect("edge 1 asked to give one up");
    assert_eq!(left, 0);
    b.report(1, seq, &demand(1, 1, 12), 102);
    let grants = b.ended("p", 1, 103);
    assert_eq!(permits_of(&grants, 3).map(|g| g.1), Some(1));
    assert_eq!(permits_of(&grants, 1), None);
}

#[test]
fn a_dropped_link_gives_its_permits_back_and_its_runs_keep_their_slots() {
    let mut b = book(2);
    b.link(1, 0);
    b.link(2, 0);
    b.report(2, 1, &demand(0, 2, 5), 1);
    b.started("p", 1);
    // Edge 1 dies with one run still here.
    let grants = b.unlink(1, 10);
    assert_eq!(permits_of(&grants, 2).map(|g| g.1), Some(1));
    let grants = b.ended("p", 1, 11);
    assert_eq!(permits_of(&grants, 2).map(|g| g.1), Some(2));
    assert_eq!(b.held("p"), 2);
}

#[test]
fn runs_an_edge_never_sends_count_until_it_reports_again() {
    let mut b = book(1);
    b.link(1, 0);
    b.link(2, 0);
    let grants = b.report(2, 1, &demand(0, 1, 0), 0);
    let (seq, _) = permits_of(&grants, 1).unwrap();
    // Edge 1 says it holds one it has not sent.
    b.report(1, seq, &sent_demand(1, 1, 0, 0), 1);
    assert_eq!(permits_of(&b.rebalance(RECHECK_MS / 2), 2), None);
    // Later, with edge 2 still waiting, the node asks edge 1 again (same permits)...
    let grants = b.rebalance(1 + RECHECK_MS);
    assert_eq!(permits_of(&grants, 1).map(|g| g.1), Some(0));
    assert_eq!(permits_of(&grants, 2), None);
    // ... and its answer (its client gave up: nothing held) frees the slot.
    let (seq, _) = permits_of(&grants, 1).unwrap();
    let grants = b.report(1, seq, &demand(0, 0, 0), 2 + RECHECK_MS);
    assert_eq!(permits_of(&grants, 2).map(|g| g.1), Some(1));
}

#[test]
fn a_lowered_capacity_is_taken_back_from_idle_links() {
    let mut b = book(4);
    b.link(1, 0);
    let grants = b.configure(&[("p".into(), 2)], 1);
    assert_eq!(permits_of(&grants, 1).map(|g| g.1), Some(2));
}

// ------------------------------------------------------------------ the simulation

/// What an edge sends the node over its link.
#[derive(Debug, Clone)]
enum Up {
    Run,
    Report {
        acked: u64,
        in_use: u32,
        unsent: u32,
        waiting: u32,
        oldest: u64,
    },
}

/// What the node sends an edge.
#[derive(Debug, Clone)]
enum Down {
    Grant { seq: u64, permits: u32 },
    End,
}

#[derive(Debug, Default)]
struct SimEdge {
    link: Option<LinkId>,
    applied: u32,
    acked: u64,
    in_use: u32,
    unsent: u32,
    queue: VecDeque<u64>,
    up: VecDeque<Up>,
    down: VecDeque<Down>,
}

#[derive(Debug, Clone)]
enum Op {
    Arrive(usize),
    EdgeSend(usize),
    NodeRecv(usize),
    EdgeRecv(usize),
    EndRun(usize),
    Drop(usize),
    Relink(usize),
    Tick(u64),
}

fn op(edges: usize) -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..edges).prop_map(Op::Arrive),
        4 => (0..edges).prop_map(Op::EdgeSend),
        8 => (0..edges).prop_map(Op::NodeRecv),
        8 => (0..edges).prop_map(Op::EdgeRecv),
        4 => (0..8usize).prop_map(Op::EndRun),
        1 => (0..edges).prop_map(Op::Drop),
        1 => (0..edges).prop_map(Op::Relink),
        2 => (0..1_000u64).prop_map(Op::Tick),
    ]
}

struct Sim {
    capacity: u32,
    book: PermitBook,
    edges: Vec<SimEdge>,
    /// Runs the provider is serving, by the link that sent them.
    running: Vec<LinkId>,
    next_link: LinkId,
    now: u64,
    peak: u32,
}

impl Sim {
    fn new(capacity: u32, edges: usize) -> Self {
        let mut sim = Sim {
            capacity,
            book: book(capacity),
            edges: (0..edges).map(|_| SimEdge::default()).collect(),
            running: Vec::new(),
            next_link: 0,
            now: 0,
            peak: 0,
        };
        for e in 0..edges {
            sim.relink(e);
        }
        sim
    }

    fn deliver(&mut self, grants: Vec<Grant>) {
        for g in grants {
            if let Some(edge) = self.edges.iter_mut().find(|e| e.link == Some(g.link)) {
                edge.down.push_back(Down::Grant {
                    seq: g.seq,
                    permits: g.permits[0].1,
                });
            }
        }
    }

    fn relink(&mut self, e: usize) {
        if self.edges[e].link.is_some() {
            return;
        }
        self.next_link += 1;
        let link = self.next_link;
        let edge = &mut self.edges[e];
        edge.link = Some(link);
        edge.applied = 0;
        edge.acked = 0;
        let grants = self.book.link(link, self.now);
        self.deliver(grants);
    }

    fn report(&mut self, e: usize) {
        let now = self.now;
        let edge = &mut self.edges[e];
        if edge.link.is_none() {
            return;
        }
        let report = Up::Report {
            acked: edge.acked,
            in_use: edge.in_use,
            unsent: edge.unsent,
            waiting: edge.queue.len() as u32,
            oldest: edge.queue.front().map_or(0, |t| now - t),
        };
        edge.up.push_back(report);
    }

    fn admit(&mut self, e: usize) {
        let edge = &mut self.edges[e];
        if edge.link.is_none() {
            return;
        }
        let mut changed = false;
        while edge.in_use < edge.applied && edge.queue.pop_front().is_some() {
            edge.in_use += 1;
            edge.unsent += 1;
            changed = true;
        }
        if changed {
            self.report(e);
        }
    }

    fn step(&mut self, op: Op) {
        match op {
            Op::Arrive(e) => {
                self.edges[e].queue.push_back(self.now);
                self.admit(e);
                self.report(e);
            }
            Op::EdgeSend(e) => {
                let edge = &mut self.edges[e];
                if edge.unsent > 0 {
                    edge.unsent -= 1;
                    edge.up.push_back(Up::Run);
                }
            }
            Op::NodeRecv(e) => {
                let Some(link) = self.edges[e].link else {
                    return;
                };
                match self.edges[e].up.pop_front() {
                    Some(Up::Run) => {
                        self.book.started("p", link);
                        self.running.push(link);
                        let total = self.running.len() as u32;
                        self.peak = self.peak.max(total);
                        assert!(
                            total <= self.capacity,
                            "{total} in flight on a provider of capacity {}",
                            self.capacity
                        );
                    }
                    Some(Up::Report {
                        acked,
                        in_use,
                        unsent,
                        waiting,
                        oldest,
                    }) => {
                        let demand = sent_demand(in_use, unsent, waiting, oldest);
                        let grants = self.book.report(link, acked, &demand, self.now);
                        self.deliver(grants);
                    }
                    None => {}
                }
            }
            Op::EdgeRecv(e) => match self.edges[e].down.pop_front() {
                Some(Down::Grant { seq, permits }) => {
                    let edge = &mut self.edges[e];
                    if seq > edge.acked {
                        edge.acked = seq;
                        edge.applied = permits;
                    }
                    self.report(e);
                    self.admit(e);
                }
                Some(Down::End) => {
                    self.edges[e].in_use -= 1;
                    self.admit(e);
                    self.report(e);
                }
                None => {}
            },
            Op::EndRun(i) => {
                if self.running.is_empty() {
                    return;
                }
                let link = self.running.remove(i % self.running.len());
                let grants = self.book.ended("p", link, self.now);
                if let Some(edge) = self.edges.iter_mut().find(|e| e.link == Some(link)) {
                    edge.down.push_back(Down::End);
                }
                self.deliver(grants);
            }
            Op::Drop(e) => {
                let Some(link) = self.edges[e].link.take() else {
                    return;
                };
                let edge = &mut self.edges[e];
                edge.applied = 0;
                edge.in_use = 0;
                edge.unsent = 0;
                edge.up.clear();
                edge.down.clear();
                let grants = self.book.unlink(link, self.now);
                self.deliver(grants);
            }
            Op::Relink(e) => self.relink(e),
            Op::Tick(ms) => {
                self.now += ms;
                let grants = self.book.rebalance(self.now);
                self.deliver(grants);
            }
        }
        assert!(
            self.book.held("p") <= self.capacity,
            "the node promised {} of {}",
            self.book.held("p"),
            self.capacity
        );
    }

    /// Delivers everything and lets every run end, until no live edge has a request
    /// waiting. Returns whether that happened.
    fn settle(&mut self) -> bool {
        for _ in 0..10_000 {
            for e in 0..self.edges.len() {
                self.relink(e);
            }
            let idle = self.edges.iter().all(|e| {
                e.queue.is_empty() && e.up.is_empty() && e.down.is_empty() && e.unsent == 0
            }) && self.running.is_empty();
            if idle {
                return true;
            }
            for e in 0..self.edges.len() {
                self.step(Op::EdgeSend(e));
                self.step(Op::NodeRecv(e));
                self.step(Op::EdgeRecv(e));
            }
            self.step(Op::EndRun(0));
            self.step(Op::Tick(RECHECK_MS));
        }
        false
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Random edges, requests, message orderings, run ends, link drops and time: the
    /// provider never has more in flight than its capacity, no slot is ever lost (every
    /// waiting request is served once things settle, and then every permit is granted
    /// to some live link), and the node never promises more than it has.
    #[test]
    fn never_over_capacity_and_no_slot_lost(
        capacity in 1u32..5,
        ops in (1usize..5).prop_flat_map(|edges| {
            (Just(edges), proptest::collection::vec(op(edges), 0..300))
        }),
    ) {
        let (edges, ops) = ops;
        let mut sim = Sim::new(capacity, edges);
        for op in ops {
            sim.step(op);
        }
        prop_assert!(sim.settle(), "waiting requests were never served: {:?}", sim.edges);
        let granted: u32 = sim
            .edges
            .iter()
            .filter_map(|e| e.link)
            .map(|l| sim.book.granted("p", l))
            .sum();
        prop_assert_eq!(granted, capacity, "every permit is granted once all is idle");
        prop_assert!(sim.peak <= capacity);
    }
}
