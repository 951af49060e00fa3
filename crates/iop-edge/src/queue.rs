//! Admission: picks a member of a model group with a free slot, or queues the request.
//!
//! Pure state over [`Leases`], generic over the waiter payload `W` (a channel in the
//! service, a plain id in tests). Rules:
//! - A request takes a slot of its lane on the live member with the fewest requests in
//!   flight; ties go round-robin.
//! - With no free slot it waits in its group's FIFO (bounded by `max_waiting`). Waiters are
//!   served oldest first, across groups that share a provider, per lane: a long waiter never
//!   holds up normal requests behind it.
//! - Whenever capacity may have appeared (release, node ready) the queues are pumped and
//!   the caller gets the waiters to wake with their grants.
//! - When a node's current generation is lost, every waiter of a group referencing it that
//!   has no live candidate left ends unavailable at once.
//! - A request arriving while no member is live waits like any other (a node may be
//!   reconnecting), up to the caller's timeout.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use crate::lease::{AccountId, Lane, LaneCounts, LeaseId, Leases, ProviderKey};
use crate::registry::Generation;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WaiterId(pub u64);

/// A model group as admission sees it.
#[derive(Debug, Clone)]
pub struct GroupSpec {
    pub name: String,
    pub members: Vec<MemberSpec>,
    pub max_waiting: usize,
}

#[derive(Debug, Clone)]
pub struct MemberSpec {
    pub key: ProviderKey,
    pub upstream_model: String,
    pub capacity: LaneCounts,
    pub enabled: bool,
}

/// A slot granted to one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    pub lease: LeaseId,
    pub group: usize,
    pub member: usize,
    pub node: Arc<str>,
    pub provider: Arc<str>,
    pub upstream_model: Arc<str>,
    pub lane: Lane,
    pub generation: Generation,
}

#[derive(Debug)]
pub enum Admission {
    Granted(Grant),
    Queued(WaiterId),
    /// The group's queue holds `max_waiting` requests already.
    QueueFull {
        max_waiting: usize,
    },
    /// No member of the group is configured with capacity in this lane.
    NoCapacityInLane,
    UnknownGroup,
}

/// A waiter woken with its grant.
#[derive(Debug)]
pub struct Dispatch<W> {
    pub waiter: W,
    pub grant: Grant,
}

/// What losing a node's generation did.
#[derive(Debug)]
pub struct Lost<W> {
    /// Leases returned by the fence (their guards' later releases are no-ops).
    pub released: Vec<LeaseId>,
    /// Waiters left without a live candidate: they end unavailable.
    pub unavailable: Vec<W>,
}

#[derive(Debug)]
struct Member {
    account: AccountId,
    upstream_model: Arc<str>,
}

#[derive(Debug)]
struct Waiter<W> {
    id: WaiterId,
    seq: u64,
    lane: Lane,
    payload: W,
}

#[derive(Debug)]
struct Group<W> {
    name: String,
    members: Vec<Member>,
    max_waiting: usize,
    waiters: VecDeque<Waiter<W>>,
    cursor: usize,
}

#[derive(Debug)]
pub struct Scheduler<W> {
    leases: Leases,
    groups: Vec<Group<W>>,
    by_name: foldhash::HashMap<String, usize>,
    last_waiter: u64,
}

impl<W> Scheduler<W> {
    /// A scheduler over `providers` (every configured provider, so the snapshot lists them
    /// all) and the model groups that reference them.
    pub fn new(
        providers: impl IntoIterator<Item = (ProviderKey, LaneCounts, bool)>,
        groups: impl IntoIterator<Item = GroupSpec>,
    ) -> Self {
        let mut leases = Leases::default();
        for (key, capacity, enabled) in providers {
            leases.add_account(key, capacity, enabled);
        }
        let mut scheduler = Scheduler {
            leases,
            groups: Vec::new(),
            by_name: foldhash::HashMap::default(),
            last_waiter: 0,
        };
        for spec in groups {
            let members = spec
                .members
                .iter()
                .map(|m| Member {
                    account: scheduler
                        .leases
                        .add_account(m.key.clone(), m.capacity, m.enabled),
                    upstream_model: m.upstream_model.as_str().into(),
                })
                .collect();
            scheduler
                .by_name
                .insert(spec.name.clone(), scheduler.groups.len());
            scheduler.groups.push(Group {
                name: spec.name,
                members,
                max_waiting: spec.max_waiting,
                waiters: VecDeque::new(),
                cursor: 0,
            });
        }
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
    /// each dispatch-ready node, for providers added to it.
    pub fn reconfigure(
        &mut self,
        providers: impl IntoIterator<Item = (ProviderKey, LaneCounts, bool)>,
        groups: impl IntoIterator<Item = GroupSpec>,
        online: &HashMap<String, Generation>,
    ) -> (Vec<W>, Vec<Dispatch<W>>) {
        let configured: Vec<(ProviderKey, LaneCounts, bool)> = providers.into_iter().collect();
        let keep: Vec<ProviderKey> = configured.iter().map(|(k, _, _)| k.clone()).collect();
        for id in self.leases.accounts().collect::<Vec<_>>() {
            let key = self.leases.key(id).clone();
            if !keep.contains(&key) {
                self.leases.configure(key, LaneCounts::default(), false);
            }
        }
        for (key, capacity, enabled) in configured {
            let is_new = self.leases.account(&key).is_none();
            let id = self.leases.configure(key.clone(), capacity, enabled);
            if is_new && let Some(generation) = online.get(&*key.node) {
                self.leases.activate_account(id, *generation);
            }
        }
        let mut old: HashMap<String, Group<W>> =
            self.groups.drain(..).map(|g| (g.name.clone(), g)).collect();
        self.by_name.clear();
        for spec in groups {
            let members = spec
                .members
                .iter()
                .map(|m| Member {
                    account: self.leases.configure(m.key.clone(), m.capacity, m.enabled),
                    upstream_model: m.upstream_model.as_str().into(),
                })
                .collect();
            let (waiters, cursor) = match old.remove(&spec.name) {
                Some(previous) => (previous.waiters, previous.cursor),
                None => (VecDeque::new(), 0),
            };
            self.by_name.insert(spec.name.clone(), self.groups.len());
            self.groups.push(Group {
                name: spec.name,
                members,
                max_waiting: spec.max_waiting,
                waiters,
                cursor,
            });
        }
        let orphaned = old
            .into_values()
            .flat_map(|g| g.waiters.into_iter().map(|w| w.payload))
            .collect();
        let mut woken = Vec::new();
        self.pump(&mut woken);
        (orphaned, woken)
    }

    pub fn group_index(&self, name: &str) -> Option<usize> {
        self.by_name.get(name).copied()
    }

    pub fn group_names(&self) -> impl Iterator<Item = &str> {
        self.groups.iter().map(|g| g.name.as_str())
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
    /// `payload` until [`Dispatch`] or [`Lost::unavailable`] hands it back.
    pub fn admit(&mut self, group: &str, lane: Lane, payload: W) -> Admission {
        let Some(g) = self.group_index(group) else {
            return Admission::UnknownGroup;
        };
        let configured = self.groups[g]
            .members
            .iter()
            .any(|m| self.leases.configured_for(m.account, lane));
        if !configured {
            return Admission::NoCapacityInLane;
        }
        if let Some(grant) = self.try_grant(g, lane) {
            return Admission::Granted(grant);
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
            payload,
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
    pub fn release(&mut self, lease: LeaseId, woken: &mut Vec<Dispatch<W>>) -> bool {
        if self.leases.release(lease).is_none() {
            return false;
        }
        self.pump(woken);
        true
    }

    /// The node's generation became dispatch-ready: its providers come online and the
    /// queued waiters they can serve are dispatched at once.
    pub fn node_ready(&mut self, node: &str, generation: Generation) -> Vec<Dispatch<W>> {
        self.leases.activate(node, generation);
        let mut woken = Vec::new();
        self.pump(&mut woken);
        woken
    }

    /// The node's generation is gone: fence its providers, return its leases once, and end
    /// the waiters it leaves without a live candidate. A stale generation changes nothing.
    pub fn node_lost(&mut self, node: &str, generation: Generation) -> Lost<W> {
        let Some(released) = self.leases.fence(node, generation) else {
            return Lost {
                released: Vec::new(),
                unavailable: Vec::new(),
            };
        };
        let mut unavailable = Vec::new();
        let leases = &self.leases;
        for group in &mut self.groups {
            let affected = group
                .members
                .iter()
                .any(|m| &*leases.key(m.account).node == node);
            if !affected {
                continue;
            }
            let mut kept = VecDeque::with_capacity(group.waiters.len());
            for w in group.waiters.drain(..) {
                let live = group
                    .members
                    .iter()
                    .any(|m| leases.serves(m.account, w.lane));
                if live {
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
        }
    }

    /// Whether any member of the group is live for `lane` (online with capacity).
    pub fn has_live_candidate(&self, group: usize, lane: Lane) -> bool {
        self.groups[group]
            .members
            .iter()
            .any(|m| self.leases.serves(m.account, lane))
    }

    fn try_grant(&mut self, g: usize, lane: Lane) -> Option<Grant> {
        let group = &self.groups[g];
        let n = group.members.len();
        let mut best: Option<(u32, usize)> = None;
        for step in 0..n {
            let i = (group.cursor + step) % n;
            let account = group.members[i].account;
            if !self.leases.has_free(account, lane) {
                continue;
            }
            let load = self.leases.in_flight_total(account);
            if best.is_none_or(|(b, _)| load < b) {
                best = Some((load, i));
            }
        }
        let (_, member) = best?;
        let account = self.groups[g].members[member].account;
        let (lease, generation) = self.leases.acquire(account, lane)?;
        let group = &mut self.groups[g];
        group.cursor = (member + 1) % n;
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
        })
    }

    /// Dispatches waiters, oldest first across all groups, while any can get a slot.
    fn pump(&mut self, woken: &mut Vec<Dispatch<W>>) {
        loop {
            let mut oldest: Option<(u64, usize, usize)> = None;
            for (g, group) in self.groups.iter().enumerate() {
                let mut seen = [false; 2];
                for (i, w) in group.waiters.iter().enumerate() {
                    let lane_slot = w.lane as usize;
                    if seen[lane_slot] {
                        continue;
                    }
                    seen[lane_slot] = true;
                    let can = group
                        .members
                        .iter()
                        .any(|m| self.leases.has_free(m.account, w.lane));
                    if can && oldest.is_none_or(|(seq, _, _)| w.seq < seq) {
                        oldest = Some((w.seq, g, i));
                    }
                    if seen[0] && seen[1] {
                        break;
                    }
                }
            }
            let Some((_, g, i)) = oldest else { return };
            let waiter = self.groups[g].waiters.remove(i).expect("index from scan");
            let grant = self
                .try_grant(g, waiter.lane)
                .expect("scan found a free slot");
            woken.push(Dispatch {
                waiter: waiter.payload,
                grant,
            });
        }
    }
}

#[cfg(test)]
mod tests;
