//! Admission: picks a member of a model group with a free slot, or queues the request.
//!
//! Pure state over [`Leases`], generic over the waiter payload `W` (a channel in the
//! service, a plain id in tests). Rules:
//! - A request takes a slot of its lane on the live member with the fewest requests in
//!   flight; ties go round-robin. A retry (a request that names members it failed on)
//!   does not move the rotation, so retries never steer first attempts.
//! - With no free slot it waits in its group's FIFO (bounded by `max_waiting`). Waiters are
//!   served oldest first, across groups that share a provider, per lane: a long waiter never
//!   holds up normal requests behind it.
//! - Whenever capacity may have appeared (release, node ready) the queues are pumped and
//!   the caller gets the waiters to wake with their grants.
//! - Members whose provider is excluded (probed unhealthy, ejected after failed requests,
//!   or cooling down after a 429: [`crate::health`]) get no new requests while the group has another member
//!   that is online and not excluded; a group whose every online member is excluded uses
//!   them all rather than none.
//! - A retried request names the members (under their generation) that already failed
//!   it; it is never granted one of those again, and when every member is excluded it is
//!   refused at once ([`Admission::Exhausted`]). Those members do not count as live for
//!   it.
//! - A request to a group none of whose members is online (or live for it) ends at once
//!   ([`Admission::Offline`]), unless the group waits for a reconnect
//!   (`wait_for_reconnect`): then it queues, *stranded*, and the caller ends it once it has
//!   been stranded that long ([`Scheduler::expire_stranded`]).
//! - When a node's current generation is lost, every waiter of a group referencing it that
//!   has no live candidate left ends unavailable at once, or is stranded in a group that
//!   waits for reconnects.
//! - Every provider also has a queue of its own for requests pinned to it (native runs),
//!   sharing its lease account, so those count against the same capacity. Probe health
//!   and ejection never keep a pinned request from its one provider, and a pinned request
//!   to a provider that is offline ends at once.
//!
//! Every call that may grant takes `now` (ejections end with time).

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use crate::ejection::EjectionPolicy;
use crate::lease::{AccountId, Lane, LaneCounts, LeaseId, Leases, ProviderKey};
use crate::registry::Generation;
use crate::routing::{self, Affinity, RoutingPolicy};

mod candidates;
mod offline;
mod spec;
mod state;
mod steer;

pub use candidates::HealthView;
pub use spec::{
    Admission, ApiSet, Dispatch, Exclusion, Grant, GroupSpec, Lost, MemberSpec, MemberTraits,
    ProviderSpec, WaiterId,
};
pub use state::Scheduler;
use state::{Group, Member, Waiter, excluded};

/// Requests pinned to one provider (native runs) that may wait for it at most.
pub const DIRECT_MAX_WAITING: usize = 64;

impl<W> Scheduler<W> {
    /// A scheduler over `providers` (every configured provider, so the snapshot lists them
    /// all) and the model groups that reference them.
    pub fn new(
        providers: impl IntoIterator<Item = ProviderSpec>,
        groups: impl IntoIterator<Item = GroupSpec>,
    ) -> Self {
        let mut scheduler = Scheduler {
            leases: Leases::default(),
            groups: Vec::new(),
            by_name: foldhash::HashMap::default(),
            by_provider: foldhash::HashMap::default(),
            last_waiter: 0,
            health: foldhash::HashMap::default(),
            ejection: EjectionPolicy::default(),
            blocks: foldhash::HashMap::default(),
        };
        let online = HashMap::new();
        // Nothing is online yet: no waiter exists and no grant can be made, so the moment
        // passed does not matter.
        let (orphaned, woken) = scheduler.reconfigure(providers, groups, &online, Instant::now());
        debug_assert!(orphaned.is_empty() && woken.is_empty());
        scheduler
    }

    pub fn leases(&self) -> &Leases {
        &self.leases
    }

    /// Applies a new configuration (config reload). Providers are updated in place (their
    /// leases in flight stay counted; providers no longer configured are disabled), groups
    /// are rebuilt, and waiters move to the group of the same name in queue order. Returns
    /// the waiters of groups that no longer exist (they end with an error) and the waiters
    /// the new capacity lets through at once. `online` gives the current generation of
    /// each dispatch-ready node, for providers added to it. Waiters left without a live
    /// candidate are stranded (they wait for a reconnect as their group allows).
    // Over 100 lines: one transaction over providers, groups and waiters, whose steps read
    // the old and new state together and must run in this order (the tests pin each step).
    pub fn reconfigure(
        &mut self,
        providers: impl IntoIterator<Item = ProviderSpec>,
        groups: impl IntoIterator<Item = GroupSpec>,
        online: &HashMap<String, Generation>,
        now: Instant,
    ) -> (Vec<W>, Vec<Dispatch<W>>) {
        let configured: Vec<ProviderSpec> = providers.into_iter().collect();
        let keep: Vec<&ProviderKey> = configured.iter().map(|p| &p.account.key).collect();
        for id in self.leases.accounts().collect::<Vec<_>>() {
            let key = self.leases.key(id).clone();
            if !keep.contains(&&key) {
                self.leases.configure(key, LaneCounts::default(), false);
            }
        }
        let mut direct = Vec::with_capacity(configured.len());
        for provider in &configured {
            let key = &provider.account.key;
            let is_new = self.leases.account(key).is_none();
            let id = self.leases.apply(&provider.account);
            if is_new && let Some(generation) = online.get(&*key.node) {
                self.leases.activate_account(id, *generation);
            }
            direct.push((key.clone(), id, provider.traits));
        }
        let mut old: HashMap<(bool, String), Group<W>> = self
            .groups
            .drain(..)
            .map(|g| ((g.direct, g.name.clone()), g))
            .collect();
        self.by_name.clear();
        self.by_provider.clear();
        let mut place = |this: &mut Self,
                         name: String,
                         is_direct: bool,
                         members,
                         max_waiting,
                         wait_for_reconnect,
                         routing| {
            let (waiters, cursor) = match old.remove(&(is_direct, name.clone())) {
                Some(previous) => (previous.waiters, previous.cursor),
                None => (VecDeque::new(), 0),
            };
            let index = this.groups.len();
            this.groups.push(Group {
                name,
                direct: is_direct,
                members,
                max_waiting,
                wait_for_reconnect,
                waiters,
                cursor,
                routing,
            });
            index
        };
        for spec in groups {
            let members = spec
                .members
                .iter()
                .map(|m| Member {
                    account: match self.leases.account(&m.key) {
                        Some(id) if keep.contains(&&m.key) => id,
                        _ => self.leases.configure(m.key.clone(), m.capacity, m.enabled),
                    },
                    identity: routing::member_identity(&m.key.node, &m.key.provider),
                    upstream_model: m.upstream_model.as_str().into(),
                    traits: m.traits,
                })
                .collect();
            let name = spec.name.clone();
            let index = place(
                self,
                spec.name,
                false,
                members,
                spec.max_waiting,
                spec.wait_for_reconnect,
                spec.routing,
            );
            self.by_name.insert(name, index);
        }
        for (key, account, traits) in direct {
            let members = vec![Member {
                account,
                identity: routing::member_identity(&key.node, &key.provider),
                upstream_model: "".into(),
                traits,
            }];
            let name = format!("{}/{}", key.node, key.provider);
            let index = place(
                self,
                name,
                true,
                members,
                DIRECT_MAX_WAITING,
                Duration::ZERO,
                RoutingPolicy::LeastInFlight,
            );
            self.by_provider.insert(key, index);
        }
        self.blocks
            .retain(|&id, _| keep.contains(&self.leases.key(id)));
        let orphaned = old
            .into_values()
            .flat_map(|g| g.waiters.into_iter().map(|w| w.payload))
            .collect();
        let mut woken = Vec::new();
        self.pump(&mut woken, now);
        self.restrand(now);
        (orphaned, woken)
    }

    /// The policy of passive ejection (from the config).
    pub fn set_ejection_policy(&mut self, policy: EjectionPolicy) {
        self.ejection = policy;
    }

    pub fn ejection_policy(&self) -> EjectionPolicy {
        self.ejection
    }

    pub fn group_index(&self, name: &str) -> Option<usize> {
        self.by_name.get(name).copied()
    }

    /// The configured model groups with their waiting requests per lane.
    pub fn groups_waiting(&self) -> impl Iterator<Item = (&str, LaneCounts)> {
        self.groups
            .iter()
            .enumerate()
            .filter(|(_, g)| !g.direct)
            .map(|(i, g)| (g.name.as_str(), self.waiting(i)))
    }

    /// The queue of requests pinned to one provider.
    pub fn provider_queue(&self, key: &ProviderKey) -> Option<usize> {
        self.by_provider.get(key).copied()
    }

    /// Waiting requests of a group, per lane.
    pub fn waiting(&self, group: usize) -> LaneCounts {
        let mut counts = LaneCounts::default();
        for w in &self.groups[group].waiters {
            match w.lane {
                Lane::Normal => counts.normal += 1,
                Lane::Long => counts.long += 1,
            }
        }
        counts
    }

    /// Admits a request of `lane` to `group`: a grant now, or a place in the queue holding
    /// `payload` until [`Dispatch`], [`Lost::unavailable`] or
    /// [`Scheduler::expire_stranded`] hands it back.
    #[cfg(test)]
    pub fn admit(&mut self, group: &str, lane: Lane, payload: W, now: Instant) -> Admission {
        self.admit_excluding(group, lane, payload, &[], now)
    }

    /// Admits a retried request: never to a member in `exclude` (under that generation).
    #[cfg(test)]
    pub fn admit_excluding(
        &mut self,
        group: &str,
        lane: Lane,
        payload: W,
        exclude: &[Exclusion],
        now: Instant,
    ) -> Admission {
        self.admit_steered(group, lane, payload, exclude, &Affinity::none(), now)
    }

    /// Admits a request that `affinity` may steer to a member (see [`crate::routing`]),
    /// never to a member in `exclude` (under that generation: it failed there).
    pub fn admit_steered(
        &mut self,
        group: &str,
        lane: Lane,
        payload: W,
        exclude: &[Exclusion],
        affinity: &Affinity,
        now: Instant,
    ) -> Admission {
        let Some(g) = self.group_index(group) else {
            return Admission::UnknownGroup;
        };
        self.admit_to(g, lane, payload, exclude, affinity, now)
    }

    /// Admits a request pinned to one provider (a native run) through that provider's own
    /// queue; `UnknownGroup` when no such provider is configured.
    pub fn admit_direct(
        &mut self,
        key: &ProviderKey,
        lane: Lane,
        payload: W,
        now: Instant,
    ) -> Admission {
        let Some(g) = self.provider_queue(key) else {
            return Admission::UnknownGroup;
        };
        self.admit_to(g, lane, payload, &[], &Affinity::none(), now)
    }

    fn admit_to(
        &mut self,
        g: usize,
        lane: Lane,
        payload: W,
        exclude: &[Exclusion],
        affinity: &Affinity,
        now: Instant,
    ) -> Admission {
        let exclude: Vec<(AccountId, Generation)> = exclude
            .iter()
            .filter_map(|e| Some((self.leases.account(&e.key)?, e.generation)))
            .collect();
        let configured: Vec<AccountId> = self.groups[g]
            .members
            .iter()
            .map(|m| m.account)
            .filter(|&a| self.leases.configured_for(a, lane))
            .collect();
        if configured.is_empty() {
            return Admission::NoCapacityInLane;
        }
        if configured
            .iter()
            .all(|&a| excluded(&self.leases, &exclude, a))
        {
            return Admission::Exhausted;
        }
        if let Some(grant) = self.try_grant(g, lane, &exclude, affinity, now) {
            return Admission::Granted(grant);
        }
        let live = self.live_for(g, lane, &exclude);
        if !live && self.groups[g].wait_for_reconnect.is_zero() {
            return Admission::Offline {
                members: self.offline_members(g, lane),
            };
        }
        let group = &mut self.groups[g];
        if group.waiters.len() >= group.max_waiting {
            return Admission::QueueFull {
                max_waiting: group.max_waiting,
            };
        }
        self.last_waiter += 1;
        let id = WaiterId(self.last_waiter);
        group.waiters.push_back(Waiter {
            id,
            seq: id.0,
            lane,
            exclude,
            affinity: affinity.clone(),
            payload,
            stranded_since: (!live).then_some(now),
            queued_at: now,
        });
        Admission::Queued(id)
    }

    /// Removes a waiter that gave up (timeout, client gone). `None` if it is no longer
    /// queued: it was dispatched or ended unavailable in the meantime.
    pub fn cancel_waiter(&mut self, id: WaiterId) -> Option<W> {
        for group in &mut self.groups {
            if let Some(pos) = group.waiters.iter().position(|w| w.id == id) {
                return group.waiters.remove(pos).map(|w| w.payload);
            }
        }
        None
    }

    /// Returns a lease (at most once) and serves the waiters the freed slot allows.
    /// Returns whether the lease was live.
    pub fn release(&mut self, lease: LeaseId, woken: &mut Vec<Dispatch<W>>, now: Instant) -> bool {
        if self.leases.release(lease).is_none() {
            return false;
        }
        self.pump(woken, now);
        true
    }

    /// The node's generation became dispatch-ready: its providers come online and the
    /// queued waiters they can serve are dispatched at once; the others are no longer
    /// stranded if a member now serves them.
    pub fn node_ready(
        &mut self,
        node: &str,
        generation: Generation,
        now: Instant,
    ) -> Vec<Dispatch<W>> {
        self.leases.activate(node, generation);
        let mut woken = Vec::new();
        self.pump(&mut woken, now);
        self.restrand(now);
        woken
    }

    /// The node's generation is gone: fence its providers, return its leases once, and end
    /// the waiters it leaves without a live candidate (or strand them, in groups that wait
    /// for reconnects). Its providers' probe health becomes unknown. A stale generation
    /// changes nothing.
    pub fn node_lost(&mut self, node: &str, generation: Generation, now: Instant) -> Lost<W> {
        let going: Vec<AccountId> = self
            .leases
            .accounts()
            .filter(|&id| {
                &*self.leases.key(id).node == node
                    && self.leases.online_generation(id) == Some(generation)
            })
            .collect();
        let Some(released) = self.leases.fence(node, generation) else {
            return Lost {
                released: Vec::new(),
                unavailable: Vec::new(),
                stranded: 0,
            };
        };
        for id in going {
            self.health.entry(id).or_default().node_gone();
        }
        let mut unavailable = Vec::new();
        let mut stranded = 0;
        let leases = &self.leases;
        for group in &mut self.groups {
            let affected = group
                .members
                .iter()
                .any(|m| &*leases.key(m.account).node == node);
            if !affected {
                continue;
            }
            let waits = !group.wait_for_reconnect.is_zero();
            let mut kept = VecDeque::with_capacity(group.waiters.len());
            for mut w in group.waiters.drain(..) {
                let live = group.members.iter().any(|m| {
                    leases.serves(m.account, w.lane) && !excluded(leases, &w.exclude, m.account)
                });
                if live {
                    kept.push_back(w);
                } else if waits {
                    if w.stranded_since.is_none() {
                        w.stranded_since = Some(now);
                        stranded += 1;
                    }
                    kept.push_back(w);
                } else {
                    unavailable.push(w.payload);
                }
            }
            group.waiters = kept;
        }
        Lost {
            released,
            unavailable,
            stranded,
        }
    }

    /// Whether some member of the group `name` has `traits` that satisfy `pred`.
    pub fn any_member_traits(&self, name: &str, pred: impl Fn(&MemberTraits) -> bool) -> bool {
        self.group_index(name)
            .is_some_and(|g| self.groups[g].members.iter().any(|m| pred(&m.traits)))
    }

    /// Whether any member of the group is live for `lane` and not one a request that
    /// `exclude`s members already failed on.
    fn live_for(&self, g: usize, lane: Lane, exclude: &[(AccountId, Generation)]) -> bool {
        self.groups[g].members.iter().any(|m| {
            self.leases.serves(m.account, lane) && !excluded(&self.leases, exclude, m.account)
        })
    }

    fn try_grant(
        &mut self,
        g: usize,
        lane: Lane,
        exclude: &[(AccountId, Generation)],
        affinity: &Affinity,
        now: Instant,
    ) -> Option<Grant> {
        let ask = steer::Ask {
            lane,
            tried: exclude,
            affinity,
        };
        let (member, decision) = self.choose(g, &ask, now)?;
        let account = self.groups[g].members[member].account;
        let (lease, generation) = self.leases.acquire(account, lane)?;
        self.note_blocks(g, account, &ask);
        let group = &mut self.groups[g];
        // A retry takes another member without moving the rotation.
        if exclude.is_empty() {
            group.cursor = (member + 1) % group.members.len();
        }
        let key = self.leases.key(account);
        Some(Grant {
            lease,
            group: g,
            member,
            node: key.node.clone(),
            provider: key.provider.clone(),
            upstream_model: group.members[member].upstream_model.clone(),
            lane,
            generation,
            traits: group.members[member].traits,
            decision,
        })
    }

    /// Dispatches waiters, oldest first across all groups, while any can get a slot. Per
    /// lane the first waiter a free slot can serve goes; one that may not take the free
    /// slots (it failed on those members) lets the next one in that lane take them.
    fn pump(&mut self, woken: &mut Vec<Dispatch<W>>, now: Instant) {
        loop {
            let mut oldest: Option<(u64, usize, usize)> = None;
            for (g, group) in self.groups.iter().enumerate() {
                let mut done = [false; 2];
                for (i, w) in group.waiters.iter().enumerate() {
                    let lane_slot = w.lane as usize;
                    if done[lane_slot] {
                        continue;
                    }
                    let honour = self.exclusions_apply(g, w.lane, &w.exclude, now);
                    let mut free = false;
                    let mut can = false;
                    for m in &group.members {
                        if self.candidate(m.account, w.lane, &[], honour, now) {
                            free = true;
                            if !excluded(&self.leases, &w.exclude, m.account) {
                                can = true;
                                break;
                            }
                        }
                    }
                    if !free || can {
                        done[lane_slot] = true;
                    }
                    if can && oldest.is_none_or(|(seq, _, _)| w.seq < seq) {
                        oldest = Some((w.seq, g, i));
                    }
                    if done[0] && done[1] {
                        break;
                    }
                }
            }
            let Some((_, g, i)) = oldest else { return };
            let waiter = self.groups[g].waiters.remove(i).expect("index from scan");
            let grant = self
                .try_grant(g, waiter.lane, &waiter.exclude, &waiter.affinity, now)
                .expect("scan found a free slot");
            woken.push(Dispatch {
                waiter: waiter.payload,
                grant,
            });
        }
    }
}

mod permits;
pub use permits::PermitDemand;

#[cfg(test)]
mod health_tests;
#[cfg(test)]
mod steer_tests;
#[cfg(test)]
mod tests;
