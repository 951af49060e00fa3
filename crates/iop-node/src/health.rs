//! A provider's health as its probes found it: a pure state machine with hysteresis.
//!
//! A provider starts `unknown`. `unhealthy_after` consecutive failed probes make it
//! unhealthy, `healthy_after` consecutive good ones make it healthy; a single probe that
//! disagrees with the settled state only starts a streak. While a streak is under way the
//! next probe comes sooner (the edge interval), so a dead provider is noticed, and a
//! revived one readmitted, in a few seconds rather than a few intervals. No I/O, no clock:
//! every call takes `now`.

use std::time::Duration;

use iop_proto::pb;

/// Defaults used when the edge leaves a field of the health-check spec at 0.
pub use iop_proto::health_check::{
    DEFAULT_HEALTHY_AFTER, DEFAULT_INTERVAL, DEFAULT_TIMEOUT, DEFAULT_UNHEALTHY_AFTER,
};
/// The longest wait between probes while a streak may change the state.
pub const EDGE_INTERVAL: Duration = Duration::from_secs(1);
/// Longest probe error kept (and reported).
const MAX_ERROR_CHARS: usize = 300;

/// How one provider is probed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HealthSettings {
    pub interval: Duration,
    pub timeout: Duration,
    pub unhealthy_after: u32,
    pub healthy_after: u32,
}

impl HealthSettings {
    /// The settings of a provider spec, with the defaults for fields left at 0.
    pub fn of(spec: Option<&pb::HealthCheckSpec>) -> Self {
        let spec = spec.cloned().unwrap_or_default();
        let ms = |v: u32, default: Duration| {
            if v == 0 {
                default
            } else {
                Duration::from_millis(v as u64)
            }
        };
        let count = |v: u32, default: u32| if v == 0 { default } else { v };
        Self {
            interval: ms(spec.interval_ms, DEFAULT_INTERVAL),
            timeout: ms(spec.timeout_ms, DEFAULT_TIMEOUT),
            unhealthy_after: count(spec.unhealthy_after, DEFAULT_UNHEALTHY_AFTER),
            healthy_after: count(spec.healthy_after, DEFAULT_HEALTHY_AFTER),
        }
    }
}

impl Default for HealthSettings {
    fn default() -> Self {
        Self::of(None)
    }
}

/// The settled health of a provider.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    Unknown,
    Healthy,
    Unhealthy,
}

impl Health {
    pub fn as_str(self) -> &'static str {
        match self {
            Health::Unknown => "unknown",
            Health::Healthy => "healthy",
            Health::Unhealthy => "unhealthy",
        }
    }

    pub fn wire(self) -> pb::ProviderHealthState {
        match self {
            Health::Unknown => pb::ProviderHealthState::Unknown,
            Health::Healthy => pb::ProviderHealthState::Healthy,
            Health::Unhealthy => pb::ProviderHealthState::Unhealthy,
        }
    }
}

/// One provider's probe history.
#[derive(Debug, Clone)]
pub struct ProbeTracker {
    settings: HealthSettings,
    health: Health,
    /// When `health` began (unix ms).
    since_ms: u64,
    successes: u32,
    failures: u32,
    last_error: Option<(String, u64)>,
}

impl ProbeTracker {
    pub fn new(settings: HealthSettings, now_ms: u64) -> Self {
        Self {
            settings,
            health: Health::Unknown,
            since_ms: now_ms,
            successes: 0,
            failures: 0,
            last_error: None,
        }
    }

    /// A provider that needs no probe (the mock): healthy from the start.
    pub fn always_healthy(now_ms: u64) -> Self {
        Self {
            health: Health::Healthy,
            ..Self::new(HealthSettings::default(), now_ms)
        }
    }

    pub fn health(&self) -> Health {
        self.health
    }

    pub fn settings(&self) -> HealthSettings {
        self.settings
    }

    /// New probe settings (a config change); the streaks so far count under them.
    pub fn set_settings(&mut self, settings: HealthSettings) {
        self.settings = settings;
    }

    /// Takes one probe's result; returns whether the settled health changed.
    pub fn record(&mut self, result: Result<(), String>, now_ms: u64) -> bool {
        let next = match result {
            Ok(()) => {
                self.failures = 0;
                self.successes = self.successes.saturating_add(1);
                (self.health != Health::Healthy && self.successes >= self.settings.healthy_after)
                    .then_some(Health::Healthy)
            }
            Err(error) => {
                self.successes = 0;
                self.failures = self.failures.saturating_add(1);
                let error: String = error.chars().take(MAX_ERROR_CHARS).collect();
                self.last_error = Some((error, now_ms));
                (self.health != Health::Unhealthy && self.failures >= self.settings.unhealthy_after)
                    .then_some(Health::Unhealthy)
            }
        };
        match next {
            Some(health) => {
                self.health = health;
                self.since_ms = now_ms;
                true
            }
            None => false,
        }
    }

    /// How long to wait before the next probe: the interval while the state is settled,
    /// at most [`EDGE_INTERVAL`] while a streak could change it.
    pub fn next_probe_in(&self) -> Duration {
        let streak_pending = match self.health {
            Health::Unknown => true,
            Health::Healthy => self.failures > 0,
            Health::Unhealthy => self.successes > 0,
        };
        if streak_pending {
            self.settings.interval.min(EDGE_INTERVAL)
        } else {
            self.settings.interval
        }
    }

    /// The state as the node reports it.
    pub fn report(&self, provider_id: &str) -> pb::ProviderHealth {
        let (last_error, last_error_unix_ms) = self.last_error.clone().unwrap_or_default();
        pb::ProviderHealth {
            provider_id: provider_id.to_string(),
            state: self.health.wire() as i32,
            since_unix_ms: self.since_ms,
            last_error,
            last_error_unix_ms,
        }
    }

    pub fn last_error(&self) -> Option<&str> {
        self.last_error.as_ref().map(|(e, _)| e.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tracker() -> ProbeTracker {
        ProbeTracker::new(HealthSettings::default(), 0)
    }

    fn fail(t: &mut ProbeTracker, at: u64) -> bool {
        t.record(Err("connection refused".into()), at)
    }

    #[test]
    fn starts_unknown_and_two_successes_make_it_healthy() {
        let mut t = tracker();
        assert_eq!(t.health(), Health::Unknown);
        assert!(!t.record(Ok(()), 1));
        assert_eq!(t.health(), Health::Unknown);
        assert!(t.record(Ok(()), 2));
        assert_eq!(t.health(), Health::Healthy);
        assert_eq!(t.report("p").since_unix_ms, 2);
        // More successes change nothing.
        assert!(!t.record(Ok(()), 3));
    }

    #[test]
    fn three_consecutive_failures_make_it_unhealthy_and_a_success_resets_the_streak() {
        let mut t = tracker();
        t.record(Ok(()), 1);
        t.record(Ok(()), 2);
        assert!(!fail(&mut t, 3));
        assert!(!fail(&mut t, 4));
        // One good probe breaks the streak: a flap is not an outage.
        assert!(!t.record(Ok(()), 5));
        assert!(!fail(&mut t, 6));
        assert!(!fail(&mut t, 7));
        assert_eq!(t.health(), Health::Healthy);
        assert!(fail(&mut t, 8));
        assert_eq!(t.health(), Health::Unhealthy);
        let report = t.report("p");
        assert_eq!(report.state(), pb::ProviderHealthState::Unhealthy);
        assert_eq!(
            (report.last_error.as_str(), report.last_error_unix_ms),
            ("connection refused", 8)
        );
        // Recovery needs two good probes in a row.
        assert!(!t.record(Ok(()), 9));
        assert!(!fail(&mut t, 10));
        assert!(!t.record(Ok(()), 11));
        assert!(t.record(Ok(()), 12));
        assert_eq!(t.health(), Health::Healthy);
        // The last error stays visible after recovery.
        assert_eq!(t.last_error(), Some("connection refused"));
    }

    #[test]
    fn an_unknown_provider_becomes_unhealthy_without_ever_being_healthy() {
        let mut t = tracker();
        assert!(!fail(&mut t, 1));
        assert!(!fail(&mut t, 2));
        assert!(fail(&mut t, 3));
        assert_eq!(t.health(), Health::Unhealthy);
    }

    #[test]
    fn probes_come_sooner_while_a_streak_may_change_the_state() {
        let settings = HealthSettings {
            interval: Duration::from_secs(5),
            ..HealthSettings::default()
        };
        let mut t = ProbeTracker::new(settings, 0);
        assert_eq!(t.next_probe_in(), EDGE_INTERVAL, "unknown: settle quickly");
        t.record(Ok(()), 1);
        t.record(Ok(()), 2);
        assert_eq!(t.next_probe_in(), Duration::from_secs(5));
        fail(&mut t, 3);
        assert_eq!(t.next_probe_in(), EDGE_INTERVAL);
        fail(&mut t, 4);
        fail(&mut t, 5);
        assert_eq!(t.next_probe_in(), Duration::from_secs(5));
        t.record(Ok(()), 6);
        assert_eq!(t.next_probe_in(), EDGE_INTERVAL);
    }

    #[test]
    fn zero_fields_take_the_defaults_and_long_errors_are_cut() {
        let s = HealthSettings::of(Some(&pb::HealthCheckSpec {
            interval_ms: 250,
            ..Default::default()
        }));
        assert_eq!(s.interval, Duration::from_millis(250));
        assert_eq!(s.timeout, DEFAULT_TIMEOUT);
        assert_eq!((s.unhealthy_after, s.healthy_after), (3, 2));
        let mut t = tracker();
        t.record(Err("x".repeat(10_000)), 1);
        assert_eq!(t.last_error().unwrap().len(), MAX_ERROR_CHARS);
        assert_eq!(
            ProbeTracker::always_healthy(0).health(),
            Health::Healthy,
            "the mock needs no probe"
        );
    }
}
