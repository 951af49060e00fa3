//! The scheduler's side of node permits: a node linked to several edges grants this edge
//! a number of requests in flight per provider ([`crate::lease::Leases::permits`]); a grant
//! may let waiters through, and what waits for want of permits is reported back to the
//! node ([`PermitDemand`]) so it can move permits here, oldest waiter first across edges.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::spec::Dispatch;
use super::state::{Scheduler, excluded};
use crate::lease::{LeaseId, ProviderKey};
use crate::registry::Generation;

/// What this edge holds and wants of one provider.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PermitDemand {
    pub provider: Arc<str>,
    /// Requests admitted onto the provider that have not ended.
    pub in_use: u32,
    /// Of those, requests not yet handed to the node's connection.
    pub unsent: u32,
    /// Requests waiting that only a permit of this provider could let through.
    pub waiting: u32,
    /// How long the oldest of them has waited.
    pub oldest_wait: Duration,
}

impl<W> Scheduler<W> {
    /// Applies the node's permits, granted over its connection `generation`, and serves
    /// the waiters they let through. Providers this edge does not know are ignored.
    pub fn set_permits(
        &mut self,
        node: &str,
        generation: Generation,
        permits: &[(&str, u32)],
        woken: &mut Vec<Dispatch<W>>,
        now: Instant,
    ) {
        for (provider, n) in permits {
            if let Some(id) = self.leases.account(&ProviderKey::new(node, provider)) {
                self.leases.set_permits(id, generation, *n);
            }
        }
        self.pump(woken, now);
    }

    /// The lease's request is on its way to the node.
    pub fn mark_sent(&mut self, lease: LeaseId) {
        self.leases.mark_sent(lease);
    }

    /// What this edge holds and wants of each of `node`'s providers that are granted
    /// permits.
    pub fn permit_demand(&self, node: &str, now: Instant) -> Vec<PermitDemand> {
        let mut demands = Vec::new();
        for id in self.leases.accounts() {
            let key = self.leases.key(id);
            if &*key.node != node || self.leases.permits(id).is_none() {
                continue;
            }
            let mut waiting = 0u32;
            let mut oldest: Option<Instant> = None;
            if self.leases.short_of_permits(id) {
                for group in &self.groups {
                    if !group.members.iter().any(|m| m.account == id) {
                        continue;
                    }
                    for w in &group.waiters {
                        if self.leases.serves(id, w.lane) && !excluded(&self.leases, &w.exclude, id)
                        {
                            waiting += 1;
                            oldest = Some(oldest.map_or(w.queued_at, |o| o.min(w.queued_at)));
                        }
                    }
                }
            }
            demands.push(PermitDemand {
                provider: key.provider.clone(),
                in_use: self.leases.in_flight_total(id),
                unsent: self.leases.unsent(id),
                waiting,
                oldest_wait: oldest.map_or(Duration::ZERO, |o| now.saturating_duration_since(o)),
            });
        }
        demands
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use crate::lease::{AccountSpec, Lane, LaneCounts, ProviderKey};
    use crate::queue::{Admission, GroupSpec, MemberSpec, MemberTraits, ProviderSpec, Scheduler};
    use crate::registry::Generation;

    const G1: Generation = Generation(1);

    fn scheduler() -> Scheduler<&'static str> {
        let key = ProviderKey::new("n", "p");
        Scheduler::new(
            [ProviderSpec {
                account: AccountSpec {
                    key: key.clone(),
                    capacity: LaneCounts { normal: 4, long: 0 },
                    max_in_flight: 4,
                    enabled: true,
                },
                traits: MemberTraits::default(),
            }],
            [GroupSpec {
                name: "g".into(),
                members: vec![MemberSpec {
                    key,
                    upstream_model: "m".into(),
                    capacity: LaneCounts { normal: 4, long: 0 },
                    enabled: true,
                    traits: MemberTraits::default(),
                }],
                max_waiting: 8,
                wait_for_reconnect: Duration::ZERO,
                routing: Default::default(),
            }],
        )
    }

    #[test]
    fn a_request_short_of_permits_waits_is_reported_and_goes_when_more_are_granted() {
        let t0 = Instant::now();
        let mut s = scheduler();
        let mut woken = Vec::new();
        s.set_permits("n", G1, &[("p", 1)], &mut woken, t0);
        s.node_ready("n", G1, t0);
        let Admission::Granted(first) = s.admit("g", Lane::Normal, "a", t0) else {
            panic!("the one permit is free");
        };
        assert!(matches!(
            s.admit("g", Lane::Normal, "b", t0),
            Admission::Queued(_)
        ));
        let later = t0 + Duration::from_millis(40);
        let demand = s.permit_demand("n", later);
        assert_eq!(demand.len(), 1);
        let d = &demand[0];
        assert_eq!((d.in_use, d.unsent, d.waiting), (1, 1, 1));
        assert_eq!(d.oldest_wait, Duration::from_millis(40));
        s.mark_sent(first.lease);
        assert_eq!(s.permit_demand("n", later)[0].unsent, 0);

        s.set_permits("n", G1, &[("p", 2), ("unknown", 3)], &mut woken, later);
        assert_eq!(woken.len(), 1, "the waiter goes with the new permit");
        assert_eq!(woken[0].waiter, "b");
        let d = &s.permit_demand("n", later)[0];
        assert_eq!((d.in_use, d.waiting), (2, 0));
        // Another node's providers are not in this node's report.
        assert!(s.permit_demand("other", later).is_empty());
    }
}
