//! Node-owned capacity permits: how many requests each edge linked to this node may have in
//! flight on each provider, so that however many edges admit, together they never send a
//! provider more than its `max_concurrency`.
//!
//! Pure state, no I/O; every call that may move permits takes `now` (Unix ms) and returns
//! the [`Grant`]s to send. Rules:
//! - A provider's permits are granted to links; what is promised never exceeds capacity:
//!   the sum over links of what each *may* use — its grant, or a higher grant it has not
//!   yet acknowledged losing, or the runs it still has here (or has sent us) — is at most
//!   `max_concurrency`.
//! - Lowering a link's grant takes effect only once the edge acknowledges it (it echoes the
//!   grant's sequence number in its next report). Links are ordered streams, so every run
//!   the edge sent before acknowledging has reached the node by then; the edge's report
//!   says how many it holds, covering runs it admitted but has not sent yet.
//! - Waiting requests are served oldest first across edges: free permits go to the link
//!   whose oldest waiting request is oldest. When none are free, idle permits are taken
//!   back from links with nothing waiting, and a link whose oldest waiter is younger than
//!   another's gives up one permit at a time to it.
//! - With nothing waiting, free permits are spread over the links, fewest first, so every
//!   edge can start a request without asking.
//! - A link that ends gives its permits back at once; runs it still had here keep their
//!   slots until they end.

use std::collections::BTreeMap;

/// One link (connection) to an edge, unique for the life of the node process.
pub type LinkId = u64;

/// How long after an edge's report the node, short of permits, asks again about runs that
/// edge said it held but had not sent (a run its client gave up before it was sent never
/// comes; the edge's next report says so).
pub const RECHECK_MS: u64 = 250;

/// Permits to send one link: the new total per provider, numbered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    pub link: LinkId,
    pub seq: u64,
    pub permits: Vec<(String, u32)>,
}

/// What an edge reports of one provider.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Demand {
    pub provider: String,
    /// Requests it has admitted onto the provider and not seen end.
    pub in_use: u32,
    /// Of those, requests it has not sent yet.
    pub unsent: u32,
    /// Requests waiting for a permit of this provider.
    pub waiting: u32,
    /// How long the oldest of them has waited.
    pub oldest_wait_ms: u64,
}

#[derive(Debug, Default)]
struct Holder {
    granted: u32,
    /// A lower grant sent as `seq`, not yet acknowledged: the link may still use `high`.
    shrink: Option<(u64, u32)>,
    running: u32,
    /// Runs the edge said it holds that had not arrived (when it reported at `reported`).
    in_transit: u32,
    reported: u64,
    in_use: u32,
    waiting: u32,
    /// When (Unix ms) its oldest waiting request started waiting.
    since: u64,
}

impl Holder {
    /// Slots this link may be using.
    fn held(&self) -> u32 {
        let high = self.shrink.map_or(0, |(_, high)| high);
        self.granted.max(high).max(self.running + self.in_transit)
    }

    /// Permits granted and not in use, as far as the node can tell.
    fn spare(&self) -> u32 {
        self.granted.saturating_sub(self.running + self.in_transit)
    }

    /// Permits it asked for beyond its grant.
    fn shortage(&self) -> u32 {
        if self.waiting == 0 {
            return 0;
        }
        (self.in_use.max(self.running) + self.waiting).saturating_sub(self.granted)
    }
}

#[derive(Debug)]
struct Pool {
    capacity: u32,
    holders: BTreeMap<LinkId, Holder>,
}

#[derive(Debug, Default)]
struct LinkSeq {
    sent: u64,
    live: bool,
}

/// Every provider's permits on this node.
#[derive(Debug, Default)]
pub struct PermitBook {
    pools: BTreeMap<String, Pool>,
    links: BTreeMap<LinkId, LinkSeq>,
}

impl PermitBook {
    /// Sets the providers and their capacity (config applied). New providers start with
    /// every live link; a removed one is forgotten; a lowered capacity takes permits back
    /// as they come free.
    pub fn configure(&mut self, capacities: &[(String, u32)], now: u64) -> Vec<Grant> {
        self.pools
            .retain(|id, _| capacities.iter().any(|(p, _)| p == id));
        for (id, capacity) in capacities {
            let pool = self.pools.entry(id.clone()).or_insert_with(|| Pool {
                capacity: *capacity,
                holders: BTreeMap::new(),
            });
            pool.capacity = *capacity;
            for (link, seq) in &self.links {
                if seq.live {
                    pool.holders.entry(*link).or_default();
                }
            }
        }
        self.rebalance(now)
    }

    /// A new link: it gets its share of what is free.
    pub fn link(&mut self, link: LinkId, now: u64) -> Vec<Grant> {
        self.links.insert(
            link,
            LinkSeq {
                sent: 0,
                live: true,
            },
        );
        for pool in self.pools.values_mut() {
            pool.holders.entry(link).or_default();
        }
        let mut grants = self.rebalance(now);
        // The new link always hears its permits first, even when it gets none.
        if !grants.iter().any(|g| g.link == link) {
            grants.push(self.grant_of(link));
        }
        grants
    }

    /// A link ended: its permits come back; its runs keep their slots until they end.
    pub fn unlink(&mut self, link: LinkId, now: u64) -> Vec<Grant> {
        self.links.remove(&link);
        for pool in self.pools.values_mut() {
            if let Some(h) = pool.holders.get_mut(&link) {
                if h.running == 0 {
                    pool.holders.remove(&link);
                } else {
                    *h = Holder {
                        running: h.running,
                        ..Holder::default()
                    };
                }
            }
        }
        self.rebalance(now)
    }

    /// A report from a link: it acknowledges grants up to `acked`, and says what it holds
    /// and what waits.
    pub fn report(&mut self, link: LinkId, acked: u64, demands: &[Demand], now: u64) -> Vec<Grant> {
        if !self.links.get(&link).is_some_and(|l| l.live) {
            return Vec::new();
        }
        for pool in self.pools.values_mut() {
            if let Some(h) = pool.holders.get_mut(&link)
                && h.shrink.is_some_and(|(seq, _)| seq <= acked)
            {
                h.shrink = None;
            }
        }
        for d in demands {
            let Some(h) = self
                .pools
                .get_mut(&d.provider)
                .and_then(|p| p.holders.get_mut(&link))
            else {
                continue;
            };
            h.in_use = d.in_use;
            h.in_transit = d.unsent;
            h.reported = now;
            h.waiting = d.waiting;
            h.since = now.saturating_sub(d.oldest_wait_ms);
        }
        self.rebalance(now)
    }

    /// A run (or tunnel) from `link` took a slot of `provider`.
    pub fn started(&mut self, provider: &str, link: LinkId) {
        if let Some(h) = self
            .pools
            .get_mut(provider)
            .and_then(|p| p.holders.get_mut(&link))
        {
            h.running += 1;
            h.in_transit = h.in_transit.saturating_sub(1);
        }
    }

    /// A run from `link` let its slot of `provider` go.
    pub fn ended(&mut self, provider: &str, link: LinkId, now: u64) -> Vec<Grant> {
        let live = self.links.get(&link).is_some_and(|l| l.live);
        if let Some(pool) = self.pools.get_mut(provider)
            && let Some(h) = pool.holders.get_mut(&link)
        {
            h.running = h.running.saturating_sub(1);
            if !live && h.running == 0 {
                pool.holders.remove(&link);
            }
        }
        self.rebalance_only(Some(provider), now)
    }

    /// Moves permits where the rules say; returns the grants to send.
    pub fn rebalance(&mut self, now: u64) -> Vec<Grant> {
        self.rebalance_only(None, now)
    }

    /// [`PermitBook::rebalance`] of one provider's permits, or of all.
    fn rebalance_only(&mut self, only: Option<&str>, now: u64) -> Vec<Grant> {
        let mut changed: std::collections::BTreeSet<LinkId> = Default::default();
        let mut shrunk: Vec<(String, LinkId, u32)> = Vec::new();
        for (id, pool) in &mut self.pools {
            if only.is_some_and(|p| p != id) {
                continue;
            }
            let moves = pool.rebalance(&self.links, now);
            for (link, old_high) in moves {
                changed.insert(link);
                if let Some(high) = old_high {
                    shrunk.push((id.clone(), link, high));
                }
            }
        }
        let mut grants = Vec::new();
        for link in &changed {
            let grant = self.grant_of(*link);
            for (provider, l, high) in &shrunk {
                if l == link
                    && let Some(h) = self
                        .pools
                        .get_mut(provider)
                        .and_then(|p| p.holders.get_mut(l))
                {
                    let high = h.shrink.map_or(*high, |(_, was)| was.max(*high));
                    h.shrink = Some((grant.seq, high));
                }
            }
            grants.push(grant);
        }
        grants
    }

    /// The link's permits on every provider, under its next sequence number.
    fn grant_of(&mut self, link: LinkId) -> Grant {
        let seq = self.links.get_mut(&link).map_or(0, |l| {
            l.sent += 1;
            l.sent
        });
        let permits = self
            .pools
            .iter()
            .filter_map(|(id, p)| p.holders.get(&link).map(|h| (id.clone(), h.granted)))
            .collect();
        Grant { link, seq, permits }
    }

    #[cfg(test)]
    /// Slots of `provider` that links may be using now (never above its capacity, but
    /// for runs of a lowered capacity still ending).
    pub fn held(&self, provider: &str) -> u32 {
        self.pools
            .get(provider)
            .map_or(0, |p| p.holders.values().map(Holder::held).sum())
    }

    #[cfg(test)]
    /// What `link` was last granted on `provider`.
    pub fn granted(&self, provider: &str, link: LinkId) -> u32 {
        self.pools
            .get(provider)
            .and_then(|p| p.holders.get(&link))
            .map_or(0, |h| h.granted)
    }
}

impl Pool {
    fn held(&self) -> u32 {
        self.holders.values().map(Holder::held).sum()
    }

    /// Returns the links whose grant changed, each with the grant it may still use until
    /// it acknowledges when the change lowered it.
    /// Links that are only asked to report again come with `None` too.
    // Over 100 lines: one pass over the pool's holders in its fixed phases (take back, hand
    // out, report), sharing the same running totals; the property tests check it whole.
    fn rebalance(
        &mut self,
        links: &BTreeMap<LinkId, LinkSeq>,
        now: u64,
    ) -> Vec<(LinkId, Option<u32>)> {
        let live = |l: &LinkId| links.get(l).is_some_and(|s| s.live);
        let before: BTreeMap<LinkId, u32> =
            self.holders.iter().map(|(l, h)| (*l, h.granted)).collect();
        let mut free = self.capacity.saturating_sub(self.held());

        // Free permits to the waiting links, oldest waiter first.
        let mut needy: Vec<LinkId> = self
            .holders
            .iter()
            .filter(|(l, h)| live(l) && h.shortage() > 0)
            .map(|(l, _)| *l)
            .collect();
        needy.sort_by_key(|l| (self.holders[l].since, *l));
        for l in &needy {
            let h = self.holders.get_mut(l).expect("listed");
            let add = h.shortage().min(free);
            h.granted += add;
            free -= add;
        }

        // Still short: take permits back, counting those already on their way back.
        let short: u32 = needy.iter().map(|l| self.holders[l].shortage()).sum();
        let over = self.held().saturating_sub(self.capacity);
        let returning: u32 = self
            .holders
            .values()
            .map(|h| h.held() - h.granted.min(h.held()))
            .sum();
        let mut need = (short + over).saturating_sub(returning);
        if need > 0 {
            let oldest_short = needy
                .iter()
                .filter(|l| self.holders[*l].shortage() > 0)
                .map(|l| self.holders[l].since)
                .min();
            // Idle permits of links with nothing waiting first, then one permit from each
            // link whose oldest waiter is younger than the oldest one short, youngest first.
            let mut idle: Vec<LinkId> = self
                .holders
                .iter()
                .filter(|(_, h)| h.waiting == 0 && h.shrink.is_none() && h.spare() > 0)
                .map(|(l, _)| *l)
                .collect();
            idle.sort_by_key(|l| std::cmp::Reverse(self.holders[l].spare()));
            for l in idle {
                if need == 0 {
                    break;
                }
                let h = self.holders.get_mut(&l).expect("listed");
                let take = h.spare().min(need);
                h.granted -= take;
                need -= take;
            }
            if let Some(oldest) = oldest_short {
                let mut younger: Vec<LinkId> = self
                    .holders
                    .iter()
                    .filter(|(_, h)| {
                        h.waiting > 0 && h.since > oldest && h.shrink.is_none() && h.granted > 0
                    })
                    .map(|(l, _)| *l)
                    .collect();
                younger.sort_by_key(|l| std::cmp::Reverse((self.holders[l].since, *l)));
                for l in younger {
                    if need == 0 {
                        break;
                    }
                    self.holders.get_mut(&l).expect("listed").granted -= 1;
                    need -= 1;
                }
            }
        }

        // Still short: runs an edge said it had not sent yet may never come; ask it again.
        let mut recheck = Vec::new();
        if short > 0 {
            for (l, h) in &mut self.holders {
                if live(l) && h.in_transit > 0 && now >= h.reported + RECHECK_MS {
                    h.reported = now;
                    recheck.push(*l);
                }
            }
        }

        // Nothing waits: spread what is free, fewest permits first.
        if needy.iter().all(|l| self.holders[l].shortage() == 0) {
            let mut free = self.capacity.saturating_sub(self.held());
            while free > 0 {
                let Some(h) = self
                    .holders
                    .iter_mut()
                    .filter(|(l, h)| live(l) && h.shrink.is_none())
                    .min_by_key(|(l, h)| (h.granted, **l))
                    .map(|(_, h)| h)
                else {
                    break;
                };
                h.granted += 1;
                free -= 1;
            }
        }

        let mut moves: Vec<(LinkId, Option<u32>)> = self
            .holders
            .iter()
            .filter(|(l, h)| live(l) && before.get(l) != Some(&h.granted))
            .map(|(l, h)| {
                let was = before.get(l).copied().unwrap_or(0);
                (*l, (h.granted < was).then_some(was))
            })
            .collect();
        moves.extend(recheck.into_iter().map(|l| (l, None)));
        moves
    }
}

#[cfg(test)]
mod tests;
