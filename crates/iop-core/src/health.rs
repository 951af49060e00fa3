//! A provider's health as the edge knows it: what its node's probes last reported
//! (healthy / unhealthy / unknown, the last probe error and when), its passive ejection
//! state ([`crate::ejection`]) and a cool-down after it answered 429. Pure state, no I/O;
//! calls that depend on time take `now`.
//!
//! A provider is *excluded* from new requests while its probes say unhealthy, while it
//! is ejected, or while it cools down (for the `Retry-After` of its last 429); the scheduler still uses excluded members when a group has no other (see
//! `queue`). When its node's connection ends the probe health goes back to unknown (the
//! node reports afresh after it reconnects); ejections and the last error stay.

use std::time::Instant;

use iop_proto::pb;

use crate::ejection::{Ejection, EjectionPolicy, ProviderOutcome, Verdict};

/// Longest probe error the edge keeps from a node's report.
pub const MAX_ERROR_CHARS: usize = 300;

/// What the node's probes say.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ProbeHealth {
    #[default]
    Unknown,
    Healthy,
    Unhealthy,
}

impl ProbeHealth {
    pub fn as_str(self) -> &'static str {
        match self {
            ProbeHealth::Unknown => "unknown",
            ProbeHealth::Healthy => "healthy",
            ProbeHealth::Unhealthy => "unhealthy",
        }
    }

    fn of_wire(state: pb::ProviderHealthState) -> Self {
        match state {
            pb::ProviderHealthState::Unknown => ProbeHealth::Unknown,
            pb::ProviderHealthState::Healthy => ProbeHealth::Healthy,
            pb::ProviderHealthState::Unhealthy => ProbeHealth::Unhealthy,
        }
    }
}

/// What a probe report changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeChange {
    pub from: ProbeHealth,
    pub to: ProbeHealth,
    /// A healthy report ended an ejection early.
    pub rejoined: bool,
}

/// One provider's health.
#[derive(Debug, Clone, Default)]
pub struct ProviderHealth {
    probe: ProbeHealth,
    /// When the probe health began, by the node's clock (unix ms).
    since_unix_ms: Option<u64>,
    /// The last failed probe and when (unix ms, the node's clock).
    last_error: Option<(String, u64)>,
    ejection: Ejection,
    /// The end of a cool-down after a 429.
    cooled_until: Option<Instant>,
}

impl ProviderHealth {
    pub fn probe(&self) -> ProbeHealth {
        self.probe
    }

    pub fn since_unix_ms(&self) -> Option<u64> {
        self.since_unix_ms
    }

    pub fn last_error(&self) -> Option<(&str, u64)> {
        self.last_error.as_ref().map(|(e, at)| (e.as_str(), *at))
    }

    pub fn ejection(&self) -> &Ejection {
        &self.ejection
    }

    /// Whether new requests should avoid this provider at `now`.
    pub fn excluded(&self, now: Instant) -> bool {
        self.probe == ProbeHealth::Unhealthy
            || self.ejection.is_ejected(now)
            || self.cooling_until(now).is_some()
    }

    /// The provider answered 429: it cools down until `until` (a later cool-down in
    /// progress stays).
    pub fn cool_down(&mut self, until: Instant) {
        if self.cooled_until.is_none_or(|t| t < until) {
            self.cooled_until = Some(until);
        }
    }

    /// The end of the cool-down in progress at `now`, if any.
    pub fn cooling_until(&self, now: Instant) -> Option<Instant> {
        self.cooled_until.filter(|until| now < *until)
    }

    /// Takes a node's probe report; a report that the provider is healthy again ends an
    /// ejection in progress. Returns what changed, if the probe health did.
    pub fn apply_report(
        &mut self,
        report: &pb::ProviderHealth,
        now: Instant,
    ) -> Option<ProbeChange> {
        let to = ProbeHealth::of_wire(report.state());
        if !report.last_error.is_empty() {
            let error: String = report.last_error.chars().take(MAX_ERROR_CHARS).collect();
            self.last_error = Some((error, report.last_error_unix_ms));
        }
        let from = self.probe;
        if from == to {
            return None;
        }
        self.probe = to;
        self.since_unix_ms = (report.since_unix_ms > 0).then_some(report.since_unix_ms);
        let rejoined = to == ProbeHealth::Healthy && self.ejection.rejoin(now);
        Some(ProbeChange { from, to, rejoined })
    }

    /// The node's connection ended: nothing is known of the probes until it reports again.
    pub fn node_gone(&mut self) {
        self.probe = ProbeHealth::Unknown;
        self.since_unix_ms = None;
    }

    /// Records one request's outcome (see [`Ejection::record`]).
    pub fn record(
        &mut self,
        outcome: &ProviderOutcome,
        now: Instant,
        policy: &EjectionPolicy,
        may_eject: impl FnOnce() -> bool,
    ) -> Verdict {
        self.ejection.record(outcome, now, policy, may_eject)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn report(state: pb::ProviderHealthState, error: &str) -> pb::ProviderHealth {
        pb::ProviderHealth {
            provider_id: "p".into(),
            state: state as i32,
            since_unix_ms: 1_000,
            last_error: error.into(),
            last_error_unix_ms: 900,
        }
    }

    #[test]
    fn unhealthy_excludes_and_healthy_again_ends_an_ejection() {
        let t0 = Instant::now();
        let mut h = ProviderHealth::default();
        assert!(!h.excluded(t0), "unknown is usable");
        let change = h
            .apply_report(
                &report(pb::ProviderHealthState::Unhealthy, "GET /models: HTTP 503"),
                t0,
            )
            .unwrap();
        assert_eq!(
            (change.from, change.to),
            (ProbeHealth::Unknown, ProbeHealth::Unhealthy)
        );
        assert!(h.excluded(t0));
        assert_eq!(h.last_error(), Some(("GET /models: HTTP 503", 900)));
        let policy = EjectionPolicy {
            consecutive_failures: 1,
            base: Duration::from_secs(60),
            max: Duration::from_secs(60),
            ..Default::default()
        };
        assert!(matches!(
            h.record(&ProviderOutcome::failure("HTTP 502"), t0, &policy, || true),
            Verdict::Ejected { .. }
        ));
        let change = h
            .apply_report(
                &report(pb::ProviderHealthState::Healthy, ""),
                t0 + Duration::from_secs(1),
            )
            .unwrap();
        assert!(change.rejoined);
        assert!(!h.excluded(t0 + Duration::from_secs(1)));
        // The last error stays visible.
        assert_eq!(
            h.last_error().map(|(e, _)| e),
            Some("GET /models: HTTP 503")
        );
        // The same state again is no change.
        assert!(
            h.apply_report(&report(pb::ProviderHealthState::Healthy, ""), t0)
                .is_none()
        );
        h.node_gone();
        assert_eq!(h.probe(), ProbeHealth::Unknown);
    }

    #[test]
    fn a_cool_down_excludes_until_it_ends_and_the_later_one_wins() {
        let t0 = Instant::now();
        let mut h = ProviderHealth::default();
        h.cool_down(t0 + Duration::from_secs(5));
        h.cool_down(t0 + Duration::from_secs(2));
        assert!(h.excluded(t0 + Duration::from_secs(4)));
        assert!(!h.excluded(t0 + Duration::from_secs(5)));
    }

    #[test]
    fn a_nodes_error_text_is_bounded() {
        let mut h = ProviderHealth::default();
        h.apply_report(
            &report(pb::ProviderHealthState::Unhealthy, &"x".repeat(1 << 20)),
            Instant::now(),
        );
        assert_eq!(h.last_error().unwrap().0.len(), MAX_ERROR_CHARS);
    }
}
