//! Which members may take new requests, and what changes it: a member is a candidate when
//! it is online with a free slot in the lane, is not one the request already failed on
//! (a retry), and, while its group has another such member that is not excluded, is not
//! excluded itself (probed unhealthy or ejected). Request outcomes feed passive ejection
//! here, probe reports the probe health; neither ever ejects or excludes a group's last
//! usable member. A provider's own queue (native runs pinned to it) is not a group here:
//! it never keeps a provider from being ejected.

use std::time::Instant;

use iop_proto::pb;

use super::spec::Dispatch;
use super::state::{Scheduler, excluded};
use crate::ejection::{ProviderOutcome, Verdict};
use crate::health::{ProbeChange, ProbeHealth};
use crate::lease::{AccountId, Lane, ProviderKey};
use crate::registry::Generation;

type Tried = [(AccountId, Generation)];

/// What the status snapshot shows of one provider's health.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HealthView {
    pub probe: ProbeHealth,
    /// When the probe health began (unix ms, the node's clock).
    pub since_unix_ms: Option<u64>,
    /// The last failed probe and when (unix ms, the node's clock).
    pub last_error: Option<(String, u64)>,
    /// The end of the ejection in progress.
    pub ejected_until: Option<Instant>,
    /// Why it was last ejected.
    pub ejection_reason: Option<String>,
    /// The multiplier of the last ejection.
    pub times_ejected: u32,
    /// The end of a cool-down after a 429, in progress.
    pub cooling_until: Option<Instant>,
}

impl<W> Scheduler<W> {
    pub(super) fn health_excluded(&self, account: AccountId, now: Instant) -> bool {
        self.health.get(&account).is_some_and(|h| h.excluded(now))
    }

    /// Whether health exclusions apply to `lane` requests of group `g` that already failed
    /// on the members in `tried`: some other member that serves the lane is not excluded.
    /// If none is, every online member is a candidate again.
    pub(super) fn exclusions_apply(
        &self,
        g: usize,
        lane: Lane,
        tried: &Tried,
        now: Instant,
    ) -> bool {
        self.groups[g].members.iter().any(|m| {
            self.leases.serves(m.account, lane)
                && !excluded(&self.leases, tried, m.account)
                && !self.health_excluded(m.account, now)
        })
    }

    /// Whether `account` can take a `lane` request that already failed on `tried` now
    /// (`honour`: health exclusions apply).
    pub(super) fn candidate(
        &self,
        account: AccountId,
        lane: Lane,
        tried: &Tried,
        honour: bool,
        now: Instant,
    ) -> bool {
        self.leases.has_free(account, lane)
            && !excluded(&self.leases, tried, account)
            && !(honour && self.health_excluded(account, now))
    }

    /// Whether `account` may be ejected: every group it belongs to keeps another member
    /// that is online and not excluded, and has fewer members ejected than the policy's
    /// share allows.
    fn may_eject(&self, account: AccountId, now: Instant) -> bool {
        self.groups
            .iter()
            .filter(|g| !g.direct && g.members.iter().any(|m| m.account == account))
            .all(|g| {
                let ejected = g
                    .members
                    .iter()
                    .filter(|m| {
                        m.account != account
                            && self
                                .health
                                .get(&m.account)
                                .is_some_and(|h| h.ejection().is_ejected(now))
                    })
                    .count();
                ejected < self.ejection.max_ejected(g.members.len())
                    && g.members.iter().any(|m| {
                        m.account != account
                            && self.leases.serves_any(m.account)
                            && !self.health_excluded(m.account, now)
                    })
            })
    }

    /// Records how one request to `key` went (passive ejection). `None` for a provider
    /// that is not configured.
    pub fn report_outcome(
        &mut self,
        key: &ProviderKey,
        outcome: &ProviderOutcome,
        now: Instant,
    ) -> Option<Verdict> {
        let account = self.leases.account(key)?;
        let mut health = self.health.remove(&account).unwrap_or_default();
        let verdict = health.record(outcome, now, &self.ejection, || {
            self.may_eject(account, now)
        });
        self.health.insert(account, health);
        Some(verdict)
    }

    /// `key` answered 429: it gets no new requests until `until` while its groups have
    /// another member (the rule every exclusion follows).
    pub fn cool_down(&mut self, key: &ProviderKey, until: Instant) {
        if let Some(account) = self.leases.account(key) {
            self.health.entry(account).or_default().cool_down(until);
        }
    }

    /// Takes a probe report from `node`'s connection `generation` (reports of any other
    /// connection, or about providers the edge does not know, are ignored). A provider
    /// that is healthy again rejoins at once and the waiters it can serve are dispatched
    /// into `woken`.
    pub fn set_probe_health(
        &mut self,
        node: &str,
        generation: Generation,
        report: &pb::ProviderHealth,
        now: Instant,
        woken: &mut Vec<Dispatch<W>>,
    ) -> Option<ProbeChange> {
        let account = self
            .leases
            .account(&ProviderKey::new(node, &report.provider_id))?;
        if self.leases.online_generation(account) != Some(generation) {
            return None;
        }
        let change = self
            .health
            .entry(account)
            .or_default()
            .apply_report(report, now)?;
        if change.to != ProbeHealth::Unhealthy {
            self.pump(woken, now);
        }
        Some(change)
    }

    /// One provider's health for the snapshot.
    pub fn health_view(&self, account: AccountId, now: Instant) -> HealthView {
        let Some(h) = self.health.get(&account) else {
            return HealthView::default();
        };
        HealthView {
            probe: h.probe(),
            since_unix_ms: h.since_unix_ms(),
            last_error: h.last_error().map(|(e, at)| (e.to_string(), at)),
            ejected_until: h.ejection().ejected_until(now),
            ejection_reason: h.ejection().reason().map(String::from),
            times_ejected: h.ejection().times(),
            cooling_until: h.cooling_until(now),
        }
    }
}
