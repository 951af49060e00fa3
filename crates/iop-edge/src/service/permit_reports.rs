//! What this edge last told each node granting it permits: the last grant it applied and
//! acknowledged (a grant that arrives after a later one is ignored), whether that
//! acknowledgement still has to be sent (the connection's queue was full), and the demand
//! last reported, so a report goes out only when what waits changed. Per node and
//! connection generation: a new connection starts afresh.

use std::collections::HashMap;
use std::sync::Arc;

use iop_proto::pb;
use parking_lot::Mutex;

use crate::queue::PermitDemand;
use crate::registry::Generation;

/// What was last reported to each node.
#[derive(Debug, Default)]
pub struct PermitReports(Mutex<HashMap<String, NodeReports>>);

#[derive(Debug)]
struct NodeReports {
    generation: Generation,
    /// The last grant applied.
    acked: u64,
    /// The acknowledgement of `acked` has not been queued yet.
    ack_due: bool,
    /// Per provider: waiting, and in use while something waits.
    last: Vec<(Arc<str>, u32, u32)>,
}

impl NodeReports {
    fn new(generation: Generation) -> Self {
        Self {
            generation,
            acked: 0,
            ack_due: false,
            last: Vec::new(),
        }
    }
}

impl PermitReports {
    /// Grant `seq` from `node_id`'s connection `generation`: unless a later grant was
    /// applied already, `apply` applies it (under this table's lock, so grants apply in
    /// the order they are acknowledged) and returns the demand after it, and `send` is
    /// handed the acknowledgement (false: not queued, it is sent with the next change).
    pub fn granted(
        &self,
        node_id: &str,
        generation: Generation,
        seq: u64,
        apply: impl FnOnce() -> Vec<PermitDemand>,
        send: impl FnOnce(pb::PermitReport) -> bool,
    ) {
        let mut reports = self.0.lock();
        let entry = reports
            .entry(node_id.to_string())
            .or_insert_with(|| NodeReports::new(generation));
        if entry.generation != generation {
            *entry = NodeReports::new(generation);
        }
        // A grant the node had to queue may arrive after a later one: the later one holds.
        if seq <= entry.acked {
            return;
        }
        let demand = apply();
        let sent = send(report(seq, &demand));
        entry.acked = seq;
        entry.ack_due = !sent;
        if sent {
            entry.last = summary(&demand);
        }
    }

    /// What waits for `node_id`'s permits is `demand` now: `send` gets a report when it
    /// changed since the last one (or an acknowledgement is still due). Nothing for a node
    /// that granted nothing on connection `generation`.
    pub fn changed(
        &self,
        node_id: &str,
        generation: Generation,
        demand: &[PermitDemand],
        send: impl FnOnce(pb::PermitReport) -> bool,
    ) {
        let mut reports = self.0.lock();
        let Some(entry) = reports
            .get_mut(node_id)
            .filter(|e| e.generation == generation)
        else {
            return;
        };
        // Only the waiters' ages moving is no news: the node keeps them from the last
        // report.
        let now = summary(demand);
        if now == entry.last && !entry.ack_due {
            return;
        }
        if send(report(entry.acked, demand)) {
            entry.ack_due = false;
            entry.last = now;
        }
    }

    /// Forgets what was reported to a node whose connection `generation` ended.
    pub fn forget(&self, node_id: &str, generation: Generation) {
        let mut reports = self.0.lock();
        if reports
            .get(node_id)
            .is_some_and(|e| e.generation == generation)
        {
            reports.remove(node_id);
        }
    }
}

fn summary(demand: &[PermitDemand]) -> Vec<(Arc<str>, u32, u32)> {
    demand
        .iter()
        .map(|d| {
            let in_use = if d.waiting > 0 { d.in_use } else { 0 };
            (d.provider.clone(), d.waiting, in_use)
        })
        .collect()
}

fn report(acked: u64, demand: &[PermitDemand]) -> pb::PermitReport {
    pb::PermitReport {
        acked_seq: acked,
        providers: demand
            .iter()
            .map(|d| pb::ProviderDemand {
                provider_id: d.provider.to_string(),
                in_use: d.in_use,
                unsent: d.unsent,
                waiting: d.waiting,
                oldest_wait_ms: d.oldest_wait.as_millis() as u64,
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::time::Duration;

    use super::*;

    fn demand(waiting: u32, in_use: u32, waited_ms: u64) -> Vec<PermitDemand> {
        vec![PermitDemand {
            provider: "p1".into(),
            in_use,
            unsent: 0,
            waiting,
            oldest_wait: Duration::from_millis(waited_ms),
        }]
    }

    /// The reports `send` was handed, answering `queued` for each.
    struct Sent {
        reports: RefCell<Vec<pb::PermitReport>>,
    }

    impl Sent {
        fn new() -> Self {
            Self {
                reports: RefCell::new(Vec::new()),
            }
        }

        fn send(&self, queued: bool) -> impl FnOnce(pb::PermitReport) -> bool + '_ {
            move |report| {
                self.reports.borrow_mut().push(report);
                queued
            }
        }

        fn acks(&self) -> Vec<u64> {
            self.reports.borrow().iter().map(|r| r.acked_seq).collect()
        }
    }

    #[test]
    fn a_grant_is_applied_and_acknowledged_once_and_a_late_older_one_not_at_all() {
        let reports = PermitReports::default();
        let sent = Sent::new();
        let applied = RefCell::new(Vec::new());
        let apply = |seq: u64| {
            let applied = &applied;
            move || {
                applied.borrow_mut().push(seq);
                demand(1, 2, 5)
            }
        };
        reports.granted("n1", Generation(1), 2, apply(2), sent.send(true));
        // Grant 1 was queued behind 2 at the node and arrives last: ignored.
        reports.granted("n1", Generation(1), 1, apply(1), sent.send(true));
        reports.granted("n1", Generation(1), 2, apply(2), sent.send(true));
        assert_eq!(*applied.borrow(), [2]);
        assert_eq!(sent.acks(), [2]);
        assert_eq!(sent.reports.borrow()[0].providers[0].waiting, 1);
        // A new connection numbers its grants afresh.
        reports.granted("n1", Generation(2), 1, apply(1), sent.send(true));
        assert_eq!(*applied.borrow(), [2, 1]);
    }

    #[test]
    fn demand_is_reported_when_it_changes_not_when_only_waits_grow_older() {
        let reports = PermitReports::default();
        let sent = Sent::new();
        // Nothing granted on this connection yet: nothing to report to.
        reports.changed("n1", Generation(1), &demand(1, 1, 0), sent.send(true));
        assert!(sent.acks().is_empty());
        reports.granted("n1", Generation(1), 3, || demand(1, 1, 0), sent.send(true));
        reports.changed("n1", Generation(1), &demand(1, 1, 900), sent.send(true));
        assert_eq!(sent.acks(), [3], "only the wait grew older: no news");
        reports.changed("n1", Generation(1), &demand(4, 1, 900), sent.send(true));
        assert_eq!(sent.acks(), [3, 3]);
        // In use counts only while something waits.
        reports.changed("n1", Generation(1), &demand(0, 1, 0), sent.send(true));
        reports.changed("n1", Generation(1), &demand(0, 2, 0), sent.send(true));
        assert_eq!(sent.acks(), [3, 3, 3]);
        // Another connection's generation is not this one's.
        reports.changed("n1", Generation(2), &demand(9, 9, 0), sent.send(true));
        assert_eq!(sent.acks().len(), 3);
    }

    #[test]
    fn an_acknowledgement_a_full_queue_refused_goes_with_the_next_report() {
        let reports = PermitReports::default();
        let sent = Sent::new();
        reports.granted("n1", Generation(1), 5, || demand(1, 1, 0), sent.send(false));
        // The same demand, but the acknowledgement is still due.
        reports.changed("n1", Generation(1), &demand(1, 1, 0), sent.send(false));
        reports.changed("n1", Generation(1), &demand(1, 1, 0), sent.send(true));
        assert_eq!(sent.acks(), [5, 5, 5]);
        reports.changed("n1", Generation(1), &demand(1, 1, 0), sent.send(true));
        assert_eq!(sent.acks().len(), 3, "sent: nothing more is due");
    }

    #[test]
    fn forgetting_a_connection_leaves_a_newer_one() {
        let reports = PermitReports::default();
        let sent = Sent::new();
        reports.granted("n1", Generation(2), 1, || demand(1, 1, 0), sent.send(true));
        reports.forget("n1", Generation(1));
        reports.changed("n1", Generation(2), &demand(3, 1, 0), sent.send(true));
        assert_eq!(sent.acks(), [1, 1]);
        reports.forget("n1", Generation(2));
        reports.changed("n1", Generation(2), &demand(5, 1, 0), sent.send(true));
        assert_eq!(sent.acks().len(), 2);
    }
}
