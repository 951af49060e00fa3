//! The scheduler's state: every provider's lease account and health, the model groups
//! with their members and waiters, and the prompt blocks routed to each provider. Its
//! operations are `impl` blocks of the modules that own them (admission in
//! [`super`], candidates, permits, steering, offline handling).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::spec::{MemberTraits, WaiterId};
use crate::ejection::EjectionPolicy;
use crate::health::ProviderHealth;
use crate::lease::{AccountId, Lane, Leases, ProviderKey};
use crate::registry::Generation;
use crate::routing::{self, Affinity, RoutingPolicy};

#[derive(Debug)]
pub(super) struct Member {
    pub(super) account: AccountId,
    /// Its identity for rendezvous hashing ([`routing::member_identity`]).
    pub(super) identity: u64,
    pub(super) upstream_model: Arc<str>,
    pub(super) traits: MemberTraits,
}

#[derive(Debug)]
pub(super) struct Waiter<W> {
    pub(super) id: WaiterId,
    pub(super) seq: u64,
    pub(super) lane: Lane,
    /// Members (under a generation) this request already failed on.
    pub(super) exclude: Vec<(AccountId, Generation)>,
    /// What steers it to a member.
    pub(super) affinity: Affinity,
    pub(super) payload: W,
    /// Since when no member that serves its lane has been live for it.
    pub(super) stranded_since: Option<Instant>,
    /// When it was queued.
    pub(super) queued_at: Instant,
}

#[derive(Debug)]
pub(super) struct Group<W> {
    pub(super) name: String,
    /// A provider's own queue (native runs), not a configured model group.
    pub(super) direct: bool,
    pub(super) members: Vec<Member>,
    pub(super) max_waiting: usize,
    pub(super) wait_for_reconnect: Duration,
    pub(super) waiters: VecDeque<Waiter<W>>,
    pub(super) cursor: usize,
    pub(super) routing: RoutingPolicy,
}

#[derive(Debug)]
pub struct Scheduler<W> {
    pub(super) leases: Leases,
    pub(super) groups: Vec<Group<W>>,
    pub(super) by_name: foldhash::HashMap<String, usize>,
    /// Each provider's own queue.
    pub(super) by_provider: foldhash::HashMap<ProviderKey, usize>,
    pub(super) last_waiter: u64,
    /// Probe health and ejection per provider.
    pub(super) health: foldhash::HashMap<AccountId, ProviderHealth>,
    pub(super) ejection: EjectionPolicy,
    /// The prompt blocks recently routed to each provider (prefix affinity).
    pub(super) blocks: foldhash::HashMap<AccountId, routing::prefix::BlockIndex>,
}

/// Whether `account`, as it is online now, is one a waiter excluded.
pub(super) fn excluded(
    leases: &Leases,
    exclude: &[(AccountId, Generation)],
    account: AccountId,
) -> bool {
    !exclude.is_empty()
        && exclude.iter().any(|&(a, generation)| {
            a == account && leases.online_generation(account) == Some(generation)
        })
}
