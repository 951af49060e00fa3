//! What admission is told and what it answers: the providers and groups it is configured
//! with (their traits carried into every grant), a granted slot, the outcome of asking for
//! one, the waiters woken with theirs and what losing a node's generation did.

use std::sync::Arc;
use std::time::Duration;

use crate::config::{ProviderApi, ProviderKind};
use crate::lease::{AccountSpec, Lane, LaneCounts, LeaseId, ProviderKey};
use crate::registry::Generation;
use crate::routing::{Decision, RoutingPolicy};

/// A set of provider APIs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ApiSet(u8);

impl ApiSet {
    pub fn of(apis: impl IntoIterator<Item = ProviderApi>) -> Self {
        Self(apis.into_iter().fold(0, |set, api| set | Self::bit(api)))
    }

    fn bit(api: ProviderApi) -> u8 {
        1 << (api as u8)
    }

    pub fn contains(self, api: ProviderApi) -> bool {
        self.0 & Self::bit(api) != 0
    }
}

/// What a grant needs to know of its provider to dispatch (and to route: the APIs it
/// serves itself): carried in the grant so the dispatcher never re-reads the config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemberTraits {
    pub kind: ProviderKind,
    /// The APIs a tunnelled provider serves itself (`apis`).
    pub apis: ApiSet,
    /// How long the provider's stream may stay silent once its response began.
    pub idle_timeout: Duration,
    /// A tunnelled stream asks the provider for usage the client did not ask for
    /// (`tunnel_usage: inject`).
    pub inject_stream_usage: bool,
}

impl Default for MemberTraits {
    fn default() -> Self {
        Self {
            kind: ProviderKind::Mock,
            apis: ApiSet::default(),
            idle_timeout: Duration::from_secs(
                crate::config::dispatch::DEFAULT_IDLE_TIMEOUT_SEC.into(),
            ),
            inject_stream_usage: false,
        }
    }
}

/// A configured provider: its account and what dispatch needs of it.
#[derive(Debug, Clone)]
pub struct ProviderSpec {
    pub account: AccountSpec,
    pub traits: MemberTraits,
}

/// A member (under one generation of its node) a retried request must not get again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exclusion {
    pub key: ProviderKey,
    pub generation: Generation,
}

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
    /// How a request picks its member.
    pub routing: RoutingPolicy,
}

#[derive(Debug, Clone)]
pub struct MemberSpec {
    pub key: ProviderKey,
    pub upstream_model: String,
    /// The provider's capacity and state, used only when it is not among the configured
    /// providers (tests).
    pub capacity: LaneCounts,
    pub enabled: bool,
    pub traits: MemberTraits,
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
    pub traits: MemberTraits,
    /// How the member was chosen.
    pub decision: Decision,
}

impl Grant {
    /// This grant's member under its generation, for a retry to exclude.
    pub fn exclusion(&self) -> Exclusion {
        Exclusion {
            key: ProviderKey {
                node: self.node.clone(),
                provider: self.provider.clone(),
            },
            generation: self.generation,
        }
    }
}

#[derive(Debug)]
pub enum Admission {
    Granted(Grant),
    Queued(WaiterId),
    /// Every member that could serve the lane already failed this request.
    Exhausted,
    /// The group's queue holds `max_waiting` requests already.
    QueueFull {
        max_waiting: usize,
    },
    /// No member of the group is configured with capacity in this lane.
    NoCapacityInLane,
    /// No member that serves the lane is online (or none this request has not failed on
    /// already), and the group does not wait for reconnects: the members (`node/provider`)
    /// that are offline.
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
    /// queued, stranded (see [`super::Scheduler::stranded_deadline`]).
    pub stranded: usize,
}
