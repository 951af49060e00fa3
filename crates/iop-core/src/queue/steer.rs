//! Which member a request goes to: least-in-flight, or the member its session or prompt
//! prefix prefers under the load bound ([`crate::routing`]), with how the decision went
//! (the service counts it); a prompt's blocks are noted on the member it went to.

use std::time::Instant;

use super::state::{Scheduler, excluded};
use crate::lease::{AccountId, Lane};
use crate::registry::Generation;
use crate::routing::{self, Affinity, Decision, Kind, Outcome, prefix};

type Tried = [(AccountId, Generation)];

/// A request's routing inputs, as `try_grant` takes them.
pub(super) struct Ask<'a> {
    pub lane: Lane,
    pub tried: &'a Tried,
    pub affinity: &'a Affinity,
}

impl<W> Scheduler<W> {
    /// The member of group `g` the request should take, and how the decision went; `None`
    /// when no member is a candidate.
    pub(super) fn choose(&self, g: usize, ask: &Ask, now: Instant) -> Option<(usize, Decision)> {
        let honour = self.exclusions_apply(g, ask.lane, ask.tried, now);
        let kind = ask.affinity.kind(self.groups[g].routing);
        let (member, outcome) = match kind {
            Kind::None => (None, Outcome::Unsteered),
            Kind::Session => {
                let session = ask.affinity.session.expect("kind says so");
                self.by_session(g, ask, honour, session, now)
            }
            Kind::Prefix => self.by_prefix(g, ask, honour, now),
        };
        let member = member.or_else(|| self.least_in_flight(g, ask, honour, now))?;
        Some((member, Decision { kind, outcome }))
    }

    /// The candidate with the fewest requests in flight, from the group's rotation on.
    fn least_in_flight(&self, g: usize, ask: &Ask, honour: bool, now: Instant) -> Option<usize> {
        let group = &self.groups[g];
        let n = group.members.len();
        let mut best: Option<(u32, usize)> = None;
        for step in 0..n {
            let i = (group.cursor + step) % n;
            let account = group.members[i].account;
            if !self.candidate(account, ask.lane, ask.tried, honour, now) {
                continue;
            }
            let load = self.leases.in_flight_total(account);
            if best.is_none_or(|(b, _)| load < b) {
                best = Some((load, i));
            }
        }
        best.map(|(_, i)| i)
    }

    /// The load bound of group `g` for a `lane` request now.
    fn bound(&self, g: usize, lane: Lane) -> u32 {
        let (total, live) = self.groups[g]
            .members
            .iter()
            .filter(|m| self.leases.serves(m.account, lane))
            .fold((0u32, 0usize), |(t, n), m| {
                (t + self.leases.in_flight_total(m.account), n + 1)
            });
        routing::load_bound(total, live)
    }

    /// Why `account` may not take the request under `bound`, if it may not: it is a
    /// candidate below the bound, or [`Self::why_not`].
    fn passed_over(
        &self,
        account: AccountId,
        ask: &Ask,
        honour: bool,
        bound: u32,
        now: Instant,
    ) -> Option<Outcome> {
        let fits = self.candidate(account, ask.lane, ask.tried, honour, now)
            && self.leases.in_flight_total(account) < bound;
        (!fits).then(|| self.why_not(account, ask, honour, now))
    }

    /// Why a preferred member cannot take the request: it is live for it (so only full or
    /// loaded), or not.
    fn why_not(&self, account: AccountId, ask: &Ask, honour: bool, now: Instant) -> Outcome {
        let live = self.leases.serves(account, ask.lane)
            && !excluded(&self.leases, ask.tried, account)
            && !(honour && self.health_excluded(account, now));
        if live {
            Outcome::OverBound
        } else {
            Outcome::Unavailable
        }
    }

    /// The session's member: the first candidate in rendezvous order under the bound (none
    /// when every candidate is at the bound), and the outcome: a hit when that is the first
    /// of all members, else why the first was passed over.
    fn by_session(
        &self,
        g: usize,
        ask: &Ask,
        honour: bool,
        session: u64,
        now: Instant,
    ) -> (Option<usize>, Outcome) {
        let group = &self.groups[g];
        let bound = self.bound(g, ask.lane);
        let identities: Vec<u64> = group.members.iter().map(|m| m.identity).collect();
        let mut first_miss = None;
        for (rank, i) in routing::rendezvous_order(session, &identities)
            .into_iter()
            .enumerate()
        {
            let account = group.members[i].account;
            match self.passed_over(account, ask, honour, bound, now) {
                None => return (Some(i), first_miss.unwrap_or(Outcome::Hit)),
                Some(why) if rank == 0 => first_miss = Some(why),
                Some(_) => {}
            }
        }
        (None, first_miss.unwrap_or(Outcome::OverBound))
    }

    /// The candidate under the bound holding the longest prefix of the prompt (at least
    /// [`prefix::MIN_MATCH_BLOCKS`]; ties to the least loaded), and the outcome: a hit when
    /// no member holds a longer one, else why the one that does was passed over; `Cold`
    /// when none holds enough.
    fn by_prefix(
        &self,
        g: usize,
        ask: &Ask,
        honour: bool,
        now: Instant,
    ) -> (Option<usize>, Outcome) {
        let group = &self.groups[g];
        let blocks = &ask.affinity.blocks[..];
        let bound = self.bound(g, ask.lane);
        let mut longest: Option<(usize, AccountId)> = None;
        let mut best: Option<(usize, u32, usize)> = None;
        for (i, m) in group.members.iter().enumerate() {
            let held = self
                .blocks
                .get(&m.account)
                .map_or(0, |index| index.match_len(blocks));
            if held < prefix::MIN_MATCH_BLOCKS {
                continue;
            }
            if longest.is_none_or(|(l, _)| held > l) {
                longest = Some((held, m.account));
            }
            if self
                .passed_over(m.account, ask, honour, bound, now)
                .is_some()
            {
                continue;
            }
            let load = self.leases.in_flight_total(m.account);
            if best.is_none_or(|(h, l, _)| held > h || (held == h && load < l)) {
                best = Some((held, load, i));
            }
        }
        let Some((longest, account)) = longest else {
            return (None, Outcome::Cold);
        };
        match best {
            Some((held, _, i)) if held == longest => (Some(i), Outcome::Hit),
            best => (
                best.map(|(.., i)| i),
                self.why_not(account, ask, honour, now),
            ),
        }
    }

    /// Notes the prompt's blocks on the member that took it (when group `g` routes by
    /// prefix at all).
    pub(super) fn note_blocks(&mut self, g: usize, account: AccountId, ask: &Ask) {
        if self.groups[g].routing.uses_prefix() && !ask.affinity.blocks.is_empty() {
            self.blocks
                .entry(account)
                .or_default()
                .record(&ask.affinity.blocks);
        }
    }
}
