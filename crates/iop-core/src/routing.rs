//! Cache-affine routing: which member of a model group a request should go to so that
//! the inference server that still holds its prompt in its KV cache answers it.
//!
//! A request carries an [`Affinity`]: a session key (what the client already sends to
//! name its conversation, [`session`]) and the chained hashes of its prompt's blocks
//! ([`prefix`]). Per group, `routing:` says which of them steers:
//! - `least_in_flight`: neither; the member with the fewest requests in flight.
//! - `session`: the session key picks the member by rendezvous hashing over the members'
//!   identities (`node/provider`), so every edge picks the same one without sharing state.
//! - `prefix`: the member whose index of recently routed prompt blocks holds the longest
//!   prefix of this prompt, if at least [`prefix::MIN_MATCH_BLOCKS`] long.
//! - `session_prefix` (the default): the session key when there is one, else the prefix.
//!
//! Never strict: a preferred member that is down, ejected, drained or at or over the
//! [`load_bound`] is skipped (the next in rendezvous order, or least-in-flight) and the
//! miss is counted with its reason ([`Outcome`]).
//!
//! Pure: no I/O, no clock.

pub mod prefix;
pub mod session;

use std::sync::Arc;

pub use crate::config::RoutingPolicy;

/// What of a request can steer it to a member.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Affinity {
    /// The hash of its session key.
    pub session: Option<u64>,
    /// The chained hashes of its prompt's full blocks, in order (empty: none).
    pub blocks: Arc<[u64]>,
}

impl Affinity {
    pub fn none() -> Self {
        Self::default()
    }

    /// What steers this request under `policy`.
    pub fn kind(&self, policy: RoutingPolicy) -> Kind {
        if policy.uses_session() && self.session.is_some() {
            Kind::Session
        } else if policy.uses_prefix() && !self.blocks.is_empty() {
            Kind::Prefix
        } else {
            Kind::None
        }
    }
}

/// What of `request` steers it under `policy`: its session key's hash, and its prompt's
/// blocks whenever the policy routes by prefix (a request with a session key still notes
/// its blocks, for the requests that come without one). Embeddings steer nothing: an
/// embedding server keeps no cache of prompts.
pub fn affinity(policy: RoutingPolicy, request: &crate::canonical::ModelRequest) -> Affinity {
    if policy == RoutingPolicy::LeastInFlight || !request.op.generates() {
        return Affinity::none();
    }
    let session = request
        .session
        .filter(|_| policy.uses_session())
        .map(session::hash);
    let blocks = if policy.uses_prefix() {
        prefix::blocks(request.canonical.unwrap_or(&request.native.request))
    } else {
        Arc::from([])
    };
    Affinity { session, blocks }
}

/// What steered a routing decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    Session,
    Prefix,
    /// Nothing: least-in-flight.
    None,
}

impl Kind {
    pub const ALL: [Kind; 3] = [Kind::Session, Kind::Prefix, Kind::None];

    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Session => "session",
            Kind::Prefix => "prefix",
            Kind::None => "none",
        }
    }
}

/// How a steered decision went.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// The preferred member took it.
    Hit,
    /// The preferred member is offline, ejected, unhealthy, drained or failed this
    /// request already.
    Unavailable,
    /// The preferred member has no free slot, or its load is at the bound.
    OverBound,
    /// No member holds a long enough prefix of the prompt (a first turn).
    Cold,
    /// Nothing steered it.
    Unsteered,
}

impl Outcome {
    pub const ALL: [Outcome; 5] = [
        Outcome::Hit,
        Outcome::Unavailable,
        Outcome::OverBound,
        Outcome::Cold,
        Outcome::Unsteered,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Hit => "hit",
            Outcome::Unavailable => "unavailable",
            Outcome::OverBound => "over_bound",
            Outcome::Cold => "cold",
            Outcome::Unsteered => "unsteered",
        }
    }
}

/// How one routing decision went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    pub kind: Kind,
    pub outcome: Outcome,
}

impl Decision {
    pub const UNSTEERED: Decision = Decision {
        kind: Kind::None,
        outcome: Outcome::Unsteered,
    };

    /// `<kind>/<outcome>` (`session/hit`, `prefix/cold`, `none/unsteered`, …): how the
    /// usage ledger records it.
    pub fn as_str(self) -> &'static str {
        const NAMES: [[&str; Outcome::ALL.len()]; Kind::ALL.len()] = [
            [
                "session/hit",
                "session/unavailable",
                "session/over_bound",
                "session/cold",
                "session/unsteered",
            ],
            [
                "prefix/hit",
                "prefix/unavailable",
                "prefix/over_bound",
                "prefix/cold",
                "prefix/unsteered",
            ],
            [
                "none/hit",
                "none/unavailable",
                "none/over_bound",
                "none/cold",
                "none/unsteered",
            ],
        ];
        NAMES[self.kind as usize][self.outcome as usize]
    }

    /// The decision [`Decision::as_str`] names.
    pub fn parse(name: &str) -> Option<Decision> {
        let (kind, outcome) = name.split_once('/')?;
        Some(Decision {
            kind: *Kind::ALL.iter().find(|k| k.as_str() == kind)?,
            outcome: *Outcome::ALL.iter().find(|o| o.as_str() == outcome)?,
        })
    }
}

/// Routing decisions of one group, by kind and outcome.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    counts: [[u64; Outcome::ALL.len()]; Kind::ALL.len()],
}

impl Stats {
    /// Counts `n` more decisions like `decision`.
    pub fn add(&mut self, decision: Decision, n: u64) {
        self.counts[decision.kind as usize][decision.outcome as usize] += n;
    }

    pub fn get(&self, kind: Kind, outcome: Outcome) -> u64 {
        self.counts[kind as usize][outcome as usize]
    }

    /// Every (kind, outcome) counted at least once.
    pub fn iter(&self) -> impl Iterator<Item = (Kind, Outcome, u64)> + '_ {
        Kind::ALL.into_iter().flat_map(move |k| {
            Outcome::ALL
                .into_iter()
                .map(move |o| (k, o, self.get(k, o)))
                .filter(|(.., n)| *n > 0)
        })
    }

    /// Steered decisions (session or prefix) that went to the preferred member, over all
    /// steered decisions; `None` before the first.
    pub fn hit_ratio(&self) -> Option<f64> {
        let steered: u64 = [Kind::Session, Kind::Prefix]
            .into_iter()
            .flat_map(|k| Outcome::ALL.map(|o| self.get(k, o)))
            .sum();
        let hits = self.get(Kind::Session, Outcome::Hit) + self.get(Kind::Prefix, Outcome::Hit);
        (steered > 0).then(|| hits as f64 / steered as f64)
    }
}

/// The most requests in flight a preferred member may hold and still take one more, given
/// `total` requests in flight over `live` members (this one included):
/// `max(⌈1.25 × mean⌉, ⌈mean⌉ + 2)`, `mean` counting the request being placed. A member
/// whose load is below the bound takes it. With an idle group that is 3: a session keeps
/// its member until that member is two requests ahead of an even share.
pub fn load_bound(total: u32, live: usize) -> u32 {
    let live = live.max(1) as u64;
    let total = u64::from(total) + 1;
    let mean_ceil = total.div_ceil(live);
    let scaled = (total * 5).div_ceil(live * 4);
    scaled.max(mean_ceil + 2).min(u64::from(u32::MAX)) as u32
}

/// A member's stable identity for rendezvous hashing: the same on every edge.
pub fn member_identity(node: &str, provider: &str) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3::with_seed(0x696f_702d_6d65_6d62);
    h.update(node.as_bytes());
    h.update(b"/");
    h.update(provider.as_bytes());
    h.digest()
}

/// The rendezvous weight of a member for a session: the member with the highest weight
/// is the session's.
pub fn rendezvous(session: u64, member: u64) -> u64 {
    // A 64-bit finaliser (splitmix64's) of the pair: uniform, and the same everywhere.
    let mut z = session ^ member.rotate_left(29) ^ 0x9e37_79b9_7f4a_7c15;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The indices of `members` (their identities) in the session's rendezvous order: the
/// preferred member first.
pub fn rendezvous_order(session: u64, members: &[u64]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..members.len()).collect();
    order.sort_unstable_by_key(|&i| std::cmp::Reverse(rendezvous(session, members[i])));
    order
}

#[cfg(test)]
mod tests;
