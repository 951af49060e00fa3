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
//! - Members whose provider is excluded (probed unhealthy, or ejected after failed
//!   requests: [`crate::health`]) get no new requests while the group has another member
//!   that is online and not excluded; a group whose every online member is excluded uses
//!   them all rather than none.
//! - A request to a group none of whose members is online ends at once
//!   ([`Admission::Offline`]), unless the group waits for a reconnect
//!   (`wait_for_reconnect`): then it queues, *stranded*, and the caller ends it once it has
//!   been stranded that long ([`Scheduler::expire_stranded`]).
//! - When a node's current generation is lost, every waiter of a group referencing it that
//!   has no live candidate left ends unavailable at once, or is stranded in a group that
//!   waits for reconnects.
//!
//! Every call that may grant takes `now` (ejections end with time).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::ejection::EjectionPolicy;
use crate::health::ProviderHealth;
use crate::lease::{AccountId, Lane, LaneCounts, LeaseId, Leases, ProviderKey};
use crate::registry::Generation;

mod candidates;
mod offline;

pub use candidates::HealthView;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WaiterId(pub u64);

/// A model group as admission sees it.
#[derive(Debug, Clone)]
pub struct GroupSpec {
    pub name: String,
    pub members: Vec<MemberSpec>,
    pub max_waiting: usize,
    /// How long a request waits for a member to reconnect when none is online; zero ends
    /// it at once.
    pub wait_for_reconnect: Duration,
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
    /// No member that serves the lane is online, and the group does not wait for
    /// reconnects: the members (`node/provider`) that are offline.
    Offline {
        members: Vec<String>,
    },
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
    /// Waiters left without a live candidate in groups that wait for reconnects: they stay
    /// queued, stranded (see [`Scheduler::stranded_deadline`]).
    pub stranded: usize,
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
    /// Since when no member that serves its lane has been online.
    stranded_since: Option<Instant>,
}

#[derive(Debug)]
struct Group<W> {
    name: String,
    members: Vec<Member>,
    max_waiting: usize,
    wait_for_reconnect: Duration,
    waiters: VecDeque<Waiter<W>>,
    cursor: usize,
}

#[derive(Debug)]
pub struct Scheduler<W> {
    leases: Leases,
    groups: Vec<Group<W>>,
    by_name: foldhash::HashMap<String, usize>,
    last_waiter: u64,
    /// Probe health and ejection per provider.
    health: foldhash::HashMap<AccountId, ProviderHealth>,
    ejection: EjectionPolicy,
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
            health: foldhash::HashMap::default(),
            ejection: EjectionPolicy::default(),
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
                wait_for_reconnect: spec.wait_for_reconnect,
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
    /// each dispatch-ready node, for providers added to it. Waiters left without a live
    /// candidate are stranded (they wait for a reconnect as their group allows).
    pub fn reconfigure(
        &mut self,
        providers: impl IntoIterator<Item = (ProviderKey, LaneCounts, bool)>,
        groups: impl IntoIterator<Item = GroupSpec>,
        online: &HashMap<String, Generation>,
        now: Instant,
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
                wait_for_reconnect: spec.wait_for_reconnect,
                waiters,
                cursor,
            });
        }
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
    /// `payload` until [`Dispatch`], [`Lost::unavailable`] or
    /// [`Scheduler::expire_stranded`] hands it back.
    pub fn admit(&mut self, group: &str, lane: Lane, payload: W, now: Instant) -> Admission {
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
        if let Some(grant) = self.try_grant(g, lane, now) {
            return Admission::Granted(grant);
        }
        let live = self.has_live_candidate(g, lane);
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
            payload,
            stranded_since: (!live).then_some(now),
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
                let live = group
                    .members
                    .iter()
                    .any(|m| leases.serves(m.account, w.lane));
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

    /// Whether any member of the group is live for `lane` (online with capacity).
    pub fn has_live_candidate(&self, group: usize, lane: Lane) -> bool {
        self.groups[group]
            .members
            .iter()
            .any(|m| self.leases.serves(m.account, lane))
    }

    fn try_grant(&mut self, g: usize, lane: Lane, now: Instant) -> Option<Grant> {
        let group = &self.groups[g];
        let n = group.members.len();
        let honour = self.exclusions_apply(g, lane, now);
        let mut best: Option<(u32, usize)> = None;
        for step in 0..n {
            let i = (group.cursor + step) % n;
            let account = group.members[i].account;
            if !self.candidate(account, lane, honour, now) {
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
    fn pump(&mut self, woken: &mut Vec<Dispatch<W>>, now: Instant) {
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
                    let honour = self.exclusions_apply(g, w.lane, now);
                    let can = group
                        .members
                        .iter()
                        .any(|m| self.candidate(m.account, w.lane, honour, now));
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
                .try_grant(g, waiter.lane, now)
                .expect("scan found a free slot");
            woken.push(Dispatch {
                waiter: waiter.payload,
                grant,
            });
        }
    }
}

#[cfg(test)]
mod health_tests;
#[cfg(test)]
mod tests;
