//! Provider lease accounting: one account per `(node_id, provider_id)`, counting normal and
//! long in-flight requests against the provider's configured capacity, shared by every
//! model group that references the provider (and by native runs on it). The account's
//! total in flight is also bounded by the node's gate for that adapter (`max_concurrency`),
//! so the edge never dispatches more than the node would take.
//!
//! Pure state, no I/O. A lease is released at most once: [`Leases::release`] of a lease
//! that is no longer live (already released, or fenced by a disconnect) does nothing. An
//! account is online only while its node's current generation is dispatch-ready; fencing
//! that generation takes it offline and returns all of that generation's leases at once.
//!
//! A node linked to several edges grants each of them permits per provider (how many
//! requests that edge may have in flight there); while the account's generation has a
//! grant, it bounds the account's total in flight too. Leases count as *unsent* until the
//! request that uses them is on its way to the node ([`Leases::mark_sent`]), so the edge can
//! tell the node what it holds but has not sent.

use foldhash::HashMap;
use std::sync::Arc;

use serde::Serialize;

use crate::registry::Generation;

/// Which capacity a request needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Lane {
    Normal,
    Long,
}

impl Lane {
    pub fn as_str(self) -> &'static str {
        match self {
            Lane::Normal => "normal",
            Lane::Long => "long",
        }
    }
}

/// A count per lane.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct LaneCounts {
    pub normal: u32,
    pub long: u32,
}

impl LaneCounts {
    pub fn get(&self, lane: Lane) -> u32 {
        match lane {
            Lane::Normal => self.normal,
            Lane::Long => self.long,
        }
    }

    fn get_mut(&mut self, lane: Lane) -> &mut u32 {
        match lane {
            Lane::Normal => &mut self.normal,
            Lane::Long => &mut self.long,
        }
    }

    pub fn total(&self) -> u32 {
        self.normal + self.long
    }
}

/// Identifies one provider: the lease key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ProviderKey {
    pub node: Arc<str>,
    pub provider: Arc<str>,
}

impl ProviderKey {
    pub fn new(node: &str, provider: &str) -> Self {
        Self {
            node: node.into(),
            provider: provider.into(),
        }
    }
}

/// Index of an account in [`Leases`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AccountId(pub usize);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LeaseId(pub u64);

/// One provider as the accounts see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccountSpec {
    pub key: ProviderKey,
    pub capacity: LaneCounts,
    /// Requests in flight across both lanes at most (the node's gate, `max_concurrency`).
    pub max_in_flight: u32,
    pub enabled: bool,
}

#[derive(Debug)]
struct Account {
    key: ProviderKey,
    capacity: LaneCounts,
    in_flight: LaneCounts,
    /// Both lanes together never exceed this (the node's gate).
    max_in_flight: u32,
    enabled: bool,
    /// The dispatch-ready generation serving this account, if any.
    online: Option<Generation>,
    /// The node's permits for this edge, under the connection (generation) that sent them.
    permits: Option<(Generation, u32)>,
    /// Leases whose request has not been sent to the node yet.
    unsent: u32,
}

#[derive(Debug, Clone, Copy)]
struct LiveLease {
    account: AccountId,
    lane: Lane,
    generation: Generation,
    sent: bool,
}

/// What the status snapshot shows of one account.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AccountView {
    pub online: bool,
    pub enabled: bool,
    /// Configured capacity while online, 0 while offline.
    pub capacity: LaneCounts,
    pub in_flight: LaneCounts,
    /// The node's permits for this edge (a node linked to several edges), if it grants
    /// them over its current connection.
    pub permits: Option<u32>,
}

#[derive(Debug, Default)]
pub struct Leases {
    accounts: Vec<Account>,
    index: HashMap<ProviderKey, AccountId>,
    live: HashMap<LeaseId, LiveLease>,
    last_lease: u64,
    released_total: u64,
}

/// Lease counts since start: every acquired lease is released exactly once, so when
/// nothing is in flight `acquired == released`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct LeaseTotals {
    pub acquired: u64,
    pub released: u64,
    pub live: u64,
}

impl Leases {
    /// Registers a provider (idempotent: the same key gets the same account).
    pub fn add_account(
        &mut self,
        key: ProviderKey,
        capacity: LaneCounts,
        enabled: bool,
    ) -> AccountId {
        if let Some(&id) = self.index.get(&key) {
            return id;
        }
        let id = AccountId(self.accounts.len());
        self.index.insert(key.clone(), id);
        self.accounts.push(Account {
            key,
            capacity,
            in_flight: LaneCounts::default(),
            max_in_flight: u32::MAX,
            enabled,
            online: None,
            permits: None,
            unsent: 0,
        });
        id
    }

    /// Sets everything about a provider (config load and reload), adding its account if it
    /// is new. Leases in flight stay counted; lowered limits only stop new grants until
    /// the in-flight counts drop below them.
    pub fn apply(&mut self, spec: &AccountSpec) -> AccountId {
        let id = self.configure(spec.key.clone(), spec.capacity, spec.enabled);
        self.accounts[id.0].max_in_flight = spec.max_in_flight;
        id
    }

    /// Sets a provider's capacity and enabled flag (config reload), adding the account if
    /// it is new. Leases in flight stay counted; a lowered capacity only stops new grants
    /// until the in-flight count drops below it.
    pub fn configure(
        &mut self,
        key: ProviderKey,
        capacity: LaneCounts,
        enabled: bool,
    ) -> AccountId {
        let id = self.add_account(key, capacity, enabled);
        let account = &mut self.accounts[id.0];
        account.capacity = capacity;
        account.enabled = enabled;
        id
    }

    /// Brings one account online under its node's current generation (a provider added to
    /// a node that is already dispatch-ready).
    pub fn activate_account(&mut self, id: AccountId, generation: Generation) {
        self.accounts[id.0].online = Some(generation);
    }

    pub fn account(&self, key: &ProviderKey) -> Option<AccountId> {
        self.index.get(key).copied()
    }

    pub fn key(&self, id: AccountId) -> &ProviderKey {
        &self.accounts[id.0].key
    }

    /// Whether the account could ever take a request of `lane` right now: online, enabled,
    /// with capacity in that lane (free or not).
    pub fn serves(&self, id: AccountId, lane: Lane) -> bool {
        let a = &self.accounts[id.0];
        a.enabled && a.online.is_some() && a.capacity.get(lane) > 0
    }

    /// Whether the account could take a request of either lane right now.
    pub fn serves_any(&self, id: AccountId) -> bool {
        self.serves(id, Lane::Normal) || self.serves(id, Lane::Long)
    }

    /// Whether the account has a free slot of `lane` (and its node's gate room for one
    /// more request).
    pub fn has_free(&self, id: AccountId, lane: Lane) -> bool {
        let a = &self.accounts[id.0];
        self.serves(id, lane)
            && a.in_flight.get(lane) < a.capacity.get(lane)
            && a.in_flight.total() < a.max_in_flight
            && a.in_flight.total() < self.permits(id).unwrap_or(u32::MAX)
    }

    /// The node's permits for this edge on the account, while its current connection
    /// has granted some.
    pub fn permits(&self, id: AccountId) -> Option<u32> {
        let a = &self.accounts[id.0];
        match a.permits {
            Some((generation, n)) if a.online.is_none_or(|g| g == generation) => Some(n),
            _ => None,
        }
    }

    /// Whether the account has no slot free only for want of permits: a request waiting
    /// for it waits for the node to grant more.
    pub fn short_of_permits(&self, id: AccountId) -> bool {
        let a = &self.accounts[id.0];
        self.permits(id)
            .is_some_and(|n| a.in_flight.total() >= n && a.in_flight.total() < a.max_in_flight)
    }

    /// Sets the node's permits on the account, granted over the connection `generation`.
    pub fn set_permits(&mut self, id: AccountId, generation: Generation, permits: u32) {
        self.accounts[id.0].permits = Some((generation, permits));
    }

    /// Leases of the account whose request is not on its way to the node yet.
    pub fn unsent(&self, id: AccountId) -> u32 {
        self.accounts[id.0].unsent
    }

    /// The lease's request was handed to the node's connection.
    pub fn mark_sent(&mut self, lease: LeaseId) {
        if let Some(live) = self.live.get_mut(&lease)
            && !live.sent
        {
            live.sent = true;
            let unsent = &mut self.accounts[live.account.0].unsent;
            *unsent = unsent.saturating_sub(1);
        }
    }

    /// The dispatch-ready generation serving the account, if it is online.
    pub fn online_generation(&self, id: AccountId) -> Option<Generation> {
        self.accounts[id.0].online
    }

    /// Whether the account is configured with capacity in `lane`, online or not.
    pub fn configured_for(&self, id: AccountId, lane: Lane) -> bool {
        let a = &self.accounts[id.0];
        a.enabled && a.capacity.get(lane) > 0
    }

    pub fn in_flight_total(&self, id: AccountId) -> u32 {
        self.accounts[id.0].in_flight.total()
    }

    /// Takes a slot of `lane`, if one is free.
    pub fn acquire(&mut self, id: AccountId, lane: Lane) -> Option<(LeaseId, Generation)> {
        if !self.has_free(id, lane) {
            return None;
        }
        let account = &mut self.accounts[id.0];
        let generation = account.online.expect("has_free implies online");
        *account.in_flight.get_mut(lane) += 1;
        account.unsent += 1;
        self.last_lease += 1;
        let lease = LeaseId(self.last_lease);
        self.live.insert(
            lease,
            LiveLease {
                account: id,
                lane,
                generation,
                sent: false,
            },
        );
        Some((lease, generation))
    }

    /// Returns a lease's slot. `None` when the lease is not live: released before, or
    /// returned by a fence. Never releases twice.
    pub fn release(&mut self, lease: LeaseId) -> Option<AccountId> {
        let live = self.live.remove(&lease)?;
        self.released_total += 1;
        if !live.sent {
            let unsent = &mut self.accounts[live.account.0].unsent;
            *unsent = unsent.saturating_sub(1);
        }
        let counter = self.accounts[live.account.0].in_flight.get_mut(live.lane);
        debug_assert!(*counter > 0, "live lease with zero in-flight");
        *counter = counter.saturating_sub(1);
        Some(live.account)
    }

    #[cfg(test)]
    pub fn is_live(&self, lease: LeaseId) -> bool {
        self.live.contains_key(&lease)
    }

    /// The node's `generation` became dispatch-ready: its accounts come online with their
    /// configured capacity.
    pub fn activate(&mut self, node: &str, generation: Generation) {
        for account in self.accounts.iter_mut().filter(|a| &*a.key.node == node) {
            account.online = Some(generation);
        }
    }

    /// The node's `generation` is gone: its accounts go offline and every lease taken under
    /// that generation is returned. A fence of any other generation does nothing and
    /// returns `None`.
    pub fn fence(&mut self, node: &str, generation: Generation) -> Option<Vec<LeaseId>> {
        let mut fenced = Vec::new();
        for (i, account) in self.accounts.iter_mut().enumerate() {
            if &*account.key.node == node && account.online == Some(generation) {
                account.online = None;
                fenced.push(AccountId(i));
            }
        }
        if fenced.is_empty() {
            return None;
        }
        let returned: Vec<LeaseId> = self
            .live
            .iter()
            .filter(|(_, l)| l.generation == generation && fenced.contains(&l.account))
            .map(|(id, _)| *id)
            .collect();
        for lease in &returned {
            self.release(*lease);
        }
        Some(returned)
    }

    pub fn view(&self, id: AccountId) -> AccountView {
        let a = &self.accounts[id.0];
        let online = a.online.is_some();
        AccountView {
            online,
            enabled: a.enabled,
            capacity: if online && a.enabled {
                a.capacity
            } else {
                LaneCounts::default()
            },
            in_flight: a.in_flight,
            permits: self.permits(id).filter(|_| online),
        }
    }

    #[cfg(test)]
    pub fn live_count(&self) -> usize {
        self.live.len()
    }

    pub fn totals(&self) -> LeaseTotals {
        LeaseTotals {
            acquired: self.last_lease,
            released: self.released_total,
            live: self.live.len() as u64,
        }
    }

    pub fn accounts(&self) -> impl Iterator<Item = AccountId> + '_ {
        (0..self.accounts.len()).map(AccountId)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G1: Generation = Generation(1);
    const G2: Generation = Generation(2);

    fn one(capacity: LaneCounts) -> (Leases, AccountId) {
        let mut l = Leases::default();
        let id = l.add_account(ProviderKey::new("n", "p"), capacity, true);
        (l, id)
    }

    #[test]
    fn offline_accounts_grant_nothing() {
        let (mut l, id) = one(LaneCounts { normal: 1, long: 1 });
        assert_eq!(l.acquire(id, Lane::Normal), None);
        assert_eq!(l.view(id).capacity, LaneCounts::default());
    }

    #[test]
    fn capacity_bounds_each_lane() {
        let (mut l, id) = one(LaneCounts { normal: 2, long: 1 });
        l.activate("n", G1);
        assert!(l.acquire(id, Lane::Normal).is_some());
        assert!(l.acquire(id, Lane::Normal).is_some());
        assert!(l.acquire(id, Lane::Normal).is_none());
        assert!(l.acquire(id, Lane::Long).is_some());
        assert!(l.acquire(id, Lane::Long).is_none());
        assert_eq!(l.view(id).in_flight, LaneCounts { normal: 2, long: 1 });
    }

    #[test]
    fn release_happens_once() {
        let (mut l, id) = one(LaneCounts { normal: 1, long: 0 });
        l.activate("n", G1);
        let (lease, _) = l.acquire(id, Lane::Normal).unwrap();
        assert_eq!(l.release(lease), Some(id));
        assert_eq!(l.release(lease), None);
        assert_eq!(l.view(id).in_flight, LaneCounts::default());
        assert_eq!(
            l.totals(),
            LeaseTotals {
                acquired: 1,
                released: 1,
                live: 0
            }
        );
    }

    #[test]
    fn fence_returns_the_generations_leases_once() {
        let (mut l, id) = one(LaneCounts { normal: 2, long: 0 });
        l.activate("n", G1);
        let (a, _) = l.acquire(id, Lane::Normal).unwrap();
        let (b, _) = l.acquire(id, Lane::Normal).unwrap();
        let mut fenced = l.fence("n", G1).unwrap();
        fenced.sort();
        assert_eq!(fenced, vec![a, b]);
        assert_eq!(l.view(id).in_flight, LaneCounts::default());
        assert!(!l.view(id).online);
        // The guards' late releases are no-ops.
        assert_eq!(l.release(a), None);
        assert_eq!(l.release(b), None);
    }

    #[test]
    fn stale_fence_changes_nothing() {
        let (mut l, id) = one(LaneCounts { normal: 1, long: 0 });
        l.activate("n", G2);
        let (lease, _) = l.acquire(id, Lane::Normal).unwrap();
        assert!(l.fence("n", G1).is_none());
        assert!(l.view(id).online);
        assert!(l.is_live(lease));
    }

    #[test]
    fn reconnect_restores_configured_capacity() {
        let (mut l, id) = one(LaneCounts { normal: 3, long: 1 });
        l.activate("n", G1);
        l.fence("n", G1);
        assert_eq!(l.view(id).capacity, LaneCounts::default());
        l.activate("n", G2);
        assert_eq!(l.view(id).capacity, LaneCounts { normal: 3, long: 1 });
    }

    #[test]
    fn the_nodes_gate_bounds_both_lanes_together() {
        let mut l = Leases::default();
        let id = l.apply(&AccountSpec {
            key: ProviderKey::new("n", "p"),
            capacity: LaneCounts { normal: 4, long: 1 },
            max_in_flight: 2,
            enabled: true,
        });
        l.activate("n", G1);
        let (a, _) = l.acquire(id, Lane::Normal).unwrap();
        assert!(l.acquire(id, Lane::Long).is_some());
        // Two in flight: the gate is full although both lanes have room on paper.
        assert!(l.acquire(id, Lane::Normal).is_none());
        assert!(!l.has_free(id, Lane::Normal));
        l.release(a);
        assert!(l.acquire(id, Lane::Normal).is_some());
    }

    #[test]
    fn the_nodes_permits_bound_the_account_under_their_connection_only() {
        let (mut l, id) = one(LaneCounts { normal: 4, long: 0 });
        l.set_permits(id, G1, 1);
        l.activate("n", G1);
        let (a, _) = l.acquire(id, Lane::Normal).unwrap();
        assert!(l.acquire(id, Lane::Normal).is_none());
        assert!(l.short_of_permits(id));
        assert_eq!(l.unsent(id), 1);
        l.mark_sent(a);
        assert_eq!(l.unsent(id), 0);
        l.set_permits(id, G1, 2);
        let (b, _) = l.acquire(id, Lane::Normal).unwrap();
        // Released before it was sent: no longer unsent either.
        l.release(b);
        assert_eq!(l.unsent(id), 0);
        // A new connection without a grant yet is bounded by the node's gate alone.
        l.fence("n", G1);
        l.activate("n", G2);
        assert_eq!(l.permits(id), None);
        assert!(!l.short_of_permits(id));
    }

    #[test]
    fn shared_key_is_one_account() {
        let mut l = Leases::default();
        let a = l.add_account(
            ProviderKey::new("n", "p"),
            LaneCounts { normal: 1, long: 0 },
            true,
        );
        let b = l.add_account(
            ProviderKey::new("n", "p"),
            LaneCounts { normal: 1, long: 0 },
            true,
        );
        assert_eq!(a, b);
    }
}
