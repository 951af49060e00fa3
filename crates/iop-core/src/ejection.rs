//! Passive ejection: a member whose provider keeps failing requests is taken out of
//! rotation for a while, whatever its probes say.
//!
//! Pure state per provider, no I/O, no clock: every call takes `now`. The shape is
//! Envoy's outlier detection:
//! - `consecutive_failures` provider-side failures in a row (connect errors, 5xx, broken
//!   streams — never 4xx or 429, which are the client's or a rate limit) eject the member;
//!   a success in between resets the count, a neutral outcome leaves it;
//! - a failure a client could cause with what it sends (a 5xx answer, a timeout, a broken
//!   stream: a poison-pill request) counts toward an ejection only together with failures
//!   of other keys' requests: with `distinct_callers: 2` (the default on an edge with two
//!   keys or more) a streak from one key ejects only once it is [`ONE_CALLER_VOLUME_FACTOR`]
//!   times as long (no success in between: nothing is served there). Failures no request can cause
//!   (the provider unreachable, overloaded, a CLI program missing) count whoever sent;
//! - the n-th ejection lasts `base × n`, capped at `max`; every `base` spent back in
//!   rotation without an ejection lowers n by one again;
//! - the member rejoins when its ejection time has passed, or earlier when its node's
//!   probe reports it healthy again (a probe is evidence it recovered; the time limit is
//!   the fallback for providers whose probe stayed healthy while requests failed);
//! - the caller says whether ejecting is allowed: the last usable member of a group is
//!   never ejected, nor more than `max_ejected_percent` of a group's members at once
//!   (Envoy's max ejection percent; one member always may be) — the failures still count,
//!   so the next one tries again.

use std::time::{Duration, Instant};

use iop_proto::{ErrorCode, Fault};

use crate::config::health::EjectionConfig;

/// When to eject.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EjectionPolicy {
    /// Failures in a row that eject; 0 never ejects.
    pub consecutive_failures: u32,
    pub base: Duration,
    pub max: Duration,
    /// Distinct callers (API keys) whose requests must be among a streak of failures a
    /// request could cause before it ejects (1: any).
    pub distinct_callers: usize,
    /// The most of a group's members ejected at once, in percent (at least one member).
    pub max_ejected_percent: u32,
}

impl EjectionPolicy {
    /// The policy `config` sets on an edge with `keys` API keys.
    pub fn from_config(config: &EjectionConfig, keys: usize) -> Self {
        let default_keys = if keys >= 2 { 2 } else { 1 };
        EjectionPolicy {
            consecutive_failures: config.consecutive_failures,
            base: Duration::from_secs_f64(config.base_sec),
            max: Duration::from_secs_f64(config.max_sec),
            distinct_callers: config.distinct_keys.map_or(default_keys, |n| n as usize),
            max_ejected_percent: config.max_ejected_percent,
        }
    }
}

impl Default for EjectionPolicy {
    fn default() -> Self {
        Self {
            consecutive_failures: 3,
            base: Duration::from_secs(30),
            max: Duration::from_secs(300),
            distinct_callers: 2,
            max_ejected_percent: 50,
        }
    }
}

/// A streak of failures from fewer callers than the policy asks ejects anyway once it is
/// this many times `consecutive_failures` long: a provider nothing succeeds on for that
/// long is failing, whoever sends to it.
pub const ONE_CALLER_VOLUME_FACTOR: u32 = 4;

impl EjectionPolicy {
    /// The streak that ejects even when its failures come from one caller.
    pub fn one_caller_volume(&self) -> u32 {
        self.consecutive_failures
            .saturating_mul(ONE_CALLER_VOLUME_FACTOR)
    }

    /// How many of a group's `members` may be ejected at once.
    pub fn max_ejected(&self, members: usize) -> usize {
        (members * self.max_ejected_percent as usize / 100).max(1)
    }
}

/// How one request went, as far as its provider is concerned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProviderOutcome {
    /// The provider answered 2xx and the response ended cleanly.
    Success,
    /// The provider failed: unreachable, 5xx, timed out, broke its stream.
    Failure { reason: String, blame: Blame },
    /// Says nothing about the provider: a 4xx, a 429, the client left, the node's link
    /// dropped, the node's gate was full.
    Neutral,
}

/// Whether a provider failure could have been caused by the request itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Blame {
    /// No request can cause it: the provider is unreachable, overloaded, missing.
    Provider,
    /// A request could cause it (a 5xx answer, a timeout, a broken stream): this caller's
    /// (its API key's name; empty for the anonymous caller).
    Request { caller: String },
}

impl ProviderOutcome {
    /// A failure no request could cause.
    pub fn failure(reason: impl Into<String>) -> Self {
        ProviderOutcome::Failure {
            reason: reason.into(),
            blame: Blame::Provider,
        }
    }

    /// How an attempt of `caller`'s went for its provider, from why it ended: `None` for
    /// a response that ended cleanly with a success status, else its typed reason. Only
    /// the provider's own server-side failures count against it (unreachable, 5xx, timed
    /// out, stalled or broken streams, a CLI program that would not start or failed); a
    /// 4xx, a 429, refused credentials, the client leaving, the node's link or gate say
    /// nothing about the provider. `provider_status`, the status the provider answered if
    /// the failure came after one, is named in the reason when it is a 5xx.
    pub fn of(failure: Option<ErrorCode>, provider_status: Option<u32>, caller: &str) -> Self {
        match failure {
            None => ProviderOutcome::Success,
            Some(code) if counts_against_provider(code) => ProviderOutcome::Failure {
                reason: match provider_status.filter(|s| *s >= 500) {
                    Some(status) => format!("{} (HTTP {status})", code.as_str()),
                    None => code.as_str().to_string(),
                },
                blame: if request_cannot_cause(code) {
                    Blame::Provider
                } else {
                    Blame::Request {
                        caller: caller.to_string(),
                    }
                },
            },
            Some(_) => ProviderOutcome::Neutral,
        }
    }
}

/// Failures no request can bring about: the provider refused the connection, said it is
/// overloaded, or its program is missing.
fn request_cannot_cause(code: ErrorCode) -> bool {
    matches!(
        code,
        ErrorCode::ProviderUnreachable | ErrorCode::ProviderOverloaded | ErrorCode::CliSpawn
    )
}

/// Whether a failure with `code` blames the provider itself: its fault, and a 5xx-class
/// reason other than refused credentials.
pub fn counts_against_provider(code: ErrorCode) -> bool {
    code.fault() == Fault::Provider && code.status() >= 500 && code != ErrorCode::ProviderAuth
}

/// What recording an outcome did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Unchanged,
    /// Ejected until `until` (the `times`-th ejection in a row).
    Ejected {
        until: Instant,
        duration: Duration,
        times: u32,
        reason: String,
    },
    /// Enough failures to eject, but the caller did not allow it (last usable member, or
    /// too many of a group ejected).
    Kept {
        failures: u32,
    },
    /// Enough failures to eject, but all of a kind a request could cause, from fewer
    /// distinct callers than the policy asks: perhaps what one client sends.
    OneCaller {
        failures: u32,
    },
}

/// One provider's ejection state.
#[derive(Debug, Clone, Default)]
pub struct Ejection {
    consecutive: u32,
    /// The streak holds a failure no request can cause.
    provider_blamed: bool,
    /// Distinct callers of the streak's failures a request could cause (at most as many
    /// as a policy asks for are kept).
    callers: Vec<String>,
    /// The multiplier of the last ejection.
    times: u32,
    /// The end of the current (or last) ejection.
    until: Option<Instant>,
    /// Why it was last ejected.
    reason: Option<String>,
}

impl Ejection {
    /// The end of the ejection in progress at `now`, if any.
    pub fn ejected_until(&self, now: Instant) -> Option<Instant> {
        self.until.filter(|until| now < *until)
    }

    pub fn is_ejected(&self, now: Instant) -> bool {
        self.ejected_until(now).is_some()
    }

    /// How many times in a row it was ejected (the multiplier of the last ejection).
    pub fn times(&self) -> u32 {
        self.times
    }

    pub fn reason(&self) -> Option<&str> {
        self.reason.as_deref()
    }

    #[cfg(test)]
    pub fn consecutive_failures(&self) -> u32 {
        self.consecutive
    }

    /// Records one request's outcome. `may_eject` is asked only when the failures reach
    /// the threshold.
    pub fn record(
        &mut self,
        outcome: &ProviderOutcome,
        now: Instant,
        policy: &EjectionPolicy,
        may_eject: impl FnOnce() -> bool,
    ) -> Verdict {
        let (reason, blame) = match outcome {
            ProviderOutcome::Neutral => return Verdict::Unchanged,
            ProviderOutcome::Success => {
                self.reset_streak();
                return Verdict::Unchanged;
            }
            ProviderOutcome::Failure { reason, blame } => (reason, blame),
        };
        if self.is_ejected(now) {
            // Requests that were under way when it was ejected: already accounted for.
            return Verdict::Unchanged;
        }
        self.consecutive = self.consecutive.saturating_add(1);
        match blame {
            Blame::Provider => self.provider_blamed = true,
            Blame::Request { caller } => {
                if self.callers.len() < policy.distinct_callers.max(1)
                    && !self.callers.contains(caller)
                {
                    self.callers.push(caller.clone());
                }
            }
        }
        if policy.consecutive_failures == 0 || self.consecutive < policy.consecutive_failures {
            return Verdict::Unchanged;
        }
        if !self.provider_blamed
            && self.callers.len() < policy.distinct_callers
            && self.consecutive < policy.one_caller_volume()
        {
            return Verdict::OneCaller {
                failures: self.consecutive,
            };
        }
        if !may_eject() {
            return Verdict::Kept {
                failures: self.consecutive,
            };
        }
        let times = self.decayed_times(now, policy) + 1;
        let duration = policy.base.saturating_mul(times).min(policy.max);
        let until = now + duration;
        let reason = format!("{} failures in a row, the last: {reason}", self.consecutive);
        self.times = times;
        self.until = Some(until);
        self.reset_streak();
        self.reason = Some(reason.clone());
        Verdict::Ejected {
            until,
            duration,
            times,
            reason,
        }
    }

    /// A probe found the provider healthy: an ejection in progress ends now. Returns
    /// whether one did.
    pub fn rejoin(&mut self, now: Instant) -> bool {
        if self.is_ejected(now) {
            self.until = Some(now);
            self.reset_streak();
            return true;
        }
        false
    }

    fn reset_streak(&mut self) {
        self.consecutive = 0;
        self.provider_blamed = false;
        self.callers.clear();
    }

    /// The multiplier after the time spent back in rotation: one less per `base`.
    fn decayed_times(&self, now: Instant, policy: &EjectionPolicy) -> u32 {
        let Some(until) = self.until else {
            return 0;
        };
        let quiet = now.saturating_duration_since(until);
        let steps = if policy.base.is_zero() {
            u32::MAX
        } else {
            (quiet.as_secs_f64() / policy.base.as_secs_f64()) as u32
        };
        self.times.saturating_sub(steps)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: Duration = Duration::from_secs(1);

    fn policy() -> EjectionPolicy {
        EjectionPolicy {
            consecutive_failures: 3,
            base: 10 * SEC,
            max: 25 * SEC,
            ..Default::default()
        }
    }

    fn answered_500(caller: &str) -> ProviderOutcome {
        ProviderOutcome::of(Some(ErrorCode::ProviderError), Some(500), caller)
    }

    #[test]
    fn failures_of_one_keys_requests_alone_never_eject() {
        let t0 = Instant::now();
        let p = policy();
        let mut e = Ejection::default();
        // A poison pill: one key's requests make the provider answer 500.
        for i in 1..=11 {
            let verdict = e.record(&answered_500("mallory"), t0, &p, || true);
            if i >= 3 {
                assert_eq!(verdict, Verdict::OneCaller { failures: i });
            }
        }
        assert!(!e.is_ejected(t0));
        // Any success between (another key served fine) starts the count again...
        let mut served = e.clone();
        served.record(&ProviderOutcome::Success, t0, &p, || true);
        assert_eq!(
            served.record(&answered_500("mallory"), t0, &p, || true),
            Verdict::Unchanged
        );
        // ...but twelve failures in a row and nothing served: it is the provider.
        let mut idle = e.clone();
        assert!(matches!(
            idle.record(&answered_500("mallory"), t0, &p, || true),
            Verdict::Ejected { .. }
        ));
        // Another key's request failing too: the provider, not the request.
        assert!(matches!(
            e.record(&answered_500("alice"), t0, &p, || true),
            Verdict::Ejected { .. }
        ));
        // A failure no request can cause counts whoever sent it.
        let mut e = Ejection::default();
        let unreachable = ProviderOutcome::of(Some(ErrorCode::ProviderUnreachable), None, "m");
        e.record(&answered_500("mallory"), t0, &p, || true);
        e.record(&answered_500("mallory"), t0, &p, || true);
        assert!(matches!(
            e.record(&unreachable, t0, &p, || true),
            Verdict::Ejected { .. }
        ));
        // An edge with one key (or none) asks for one caller.
        let one = EjectionPolicy {
            distinct_callers: 1,
            ..p
        };
        let mut e = Ejection::default();
        for _ in 0..2 {
            e.record(&answered_500("mallory"), t0, &one, || true);
        }
        assert!(matches!(
            e.record(&answered_500("mallory"), t0, &one, || true),
            Verdict::Ejected { .. }
        ));
    }

    #[test]
    fn at_most_a_share_of_a_group_is_ejected_and_always_one() {
        let p = policy();
        assert_eq!(p.max_ejected(1), 1);
        assert_eq!(p.max_ejected(2), 1);
        assert_eq!(p.max_ejected(3), 1);
        assert_eq!(p.max_ejected(4), 2);
        assert_eq!(p.max_ejected(10), 5);
    }

    fn fail(e: &mut Ejection, now: Instant) -> Verdict {
        e.record(
            &ProviderOutcome::failure("HTTP 502"),
            now,
            &policy(),
            || true,
        )
    }

    #[test]
    fn consecutive_failures_eject_for_base_then_it_rejoins() {
        let t0 = Instant::now();
        let mut e = Ejection::default();
        assert_eq!(fail(&mut e, t0), Verdict::Unchanged);
        assert_eq!(fail(&mut e, t0), Verdict::Unchanged);
        let Verdict::Ejected {
            until,
            duration,
            times,
            reason,
        } = fail(&mut e, t0 + SEC)
        else {
            panic!("not ejected");
        };
        assert_eq!((duration, times), (10 * SEC, 1));
        assert_eq!(until, t0 + 11 * SEC);
        assert!(
            reason.contains("3 failures") && reason.contains("HTTP 502"),
            "{reason}"
        );
        assert!(e.is_ejected(t0 + 10 * SEC));
        assert!(
            !e.is_ejected(t0 + 11 * SEC),
            "rejoins when its time has passed"
        );
        assert_eq!(e.ejected_until(t0 + 11 * SEC), None);
    }

    #[test]
    fn successes_reset_the_count_and_neutral_outcomes_do_not() {
        let t0 = Instant::now();
        let mut e = Ejection::default();
        fail(&mut e, t0);
        fail(&mut e, t0);
        e.record(&ProviderOutcome::Success, t0, &policy(), || true);
        fail(&mut e, t0);
        fail(&mut e, t0);
        assert!(!e.is_ejected(t0));
        // A 4xx, a 429 or a client abort says nothing about the provider.
        e.record(&ProviderOutcome::Neutral, t0, &policy(), || true);
        assert!(matches!(fail(&mut e, t0), Verdict::Ejected { .. }));
    }

    #[test]
    fn each_ejection_in_a_row_lasts_longer_up_to_the_cap() {
        let t0 = Instant::now();
        let mut e = Ejection::default();
        let mut now = t0;
        let mut durations = Vec::new();
        for _ in 0..4 {
            for _ in 0..3 {
                if let Verdict::Ejected { duration, .. } = fail(&mut e, now) {
                    durations.push(duration);
                }
            }
            // Back in rotation, and failing again at once.
            now = e.until.unwrap();
        }
        assert_eq!(durations, [10 * SEC, 20 * SEC, 25 * SEC, 25 * SEC]);
        assert_eq!(e.times(), 4);
    }

    #[test]
    fn time_back_in_rotation_lowers_the_multiplier() {
        let t0 = Instant::now();
        let mut e = Ejection::default();
        for _ in 0..3 {
            fail(&mut e, t0);
        }
        for _ in 0..3 {
            fail(&mut e, t0 + 10 * SEC);
        }
        assert_eq!(e.times(), 2);
        let back = e.until.unwrap();
        // Two bases of quiet: the next ejection is a first one again.
        let later = back + 20 * SEC;
        let mut last = Verdict::Unchanged;
        for _ in 0..3 {
            last = fail(&mut e, later);
        }
        assert!(
            matches!(last, Verdict::Ejected { times: 1, duration, .. } if duration == 10 * SEC),
            "{last:?}"
        );
    }

    #[test]
    fn the_last_usable_member_is_kept_and_the_next_failure_asks_again() {
        let t0 = Instant::now();
        let mut e = Ejection::default();
        let p = policy();
        let failure = ProviderOutcome::failure("provider_unreachable");
        for _ in 0..2 {
            e.record(&failure, t0, &p, || {
                unreachable!("asked below the threshold")
            });
        }
        assert_eq!(
            e.record(&failure, t0, &p, || false),
            Verdict::Kept { failures: 3 }
        );
        assert!(!e.is_ejected(t0));
        assert!(matches!(
            e.record(&failure, t0, &p, || true),
            Verdict::Ejected { .. }
        ));
    }

    #[test]
    fn a_healthy_probe_ends_an_ejection_early_and_failures_while_ejected_do_not_extend_it() {
        let t0 = Instant::now();
        let mut e = Ejection::default();
        for _ in 0..3 {
            fail(&mut e, t0);
        }
        let until = e.ejected_until(t0).unwrap();
        for _ in 0..10 {
            assert_eq!(fail(&mut e, t0 + SEC), Verdict::Unchanged);
        }
        assert_eq!(e.ejected_until(t0 + SEC), Some(until));
        assert!(e.rejoin(t0 + 2 * SEC));
        assert!(!e.is_ejected(t0 + 2 * SEC));
        assert!(!e.rejoin(t0 + 3 * SEC), "nothing to end");
        assert_eq!(e.consecutive_failures(), 0);
    }

    #[test]
    fn zero_failures_never_eject() {
        let t0 = Instant::now();
        let mut e = Ejection::default();
        let off = EjectionPolicy {
            consecutive_failures: 0,
            ..policy()
        };
        for _ in 0..100 {
            e.record(&ProviderOutcome::failure("x"), t0, &off, || true);
        }
        assert!(!e.is_ejected(t0));
    }

    #[test]
    fn outcomes_are_classified_by_who_is_at_fault() {
        use ErrorCode::*;
        use ProviderOutcome as O;
        let by = |reason: &str| O::Failure {
            reason: reason.into(),
            blame: Blame::Request { caller: "k".into() },
        };
        assert_eq!(O::of(None, None, "k"), O::Success);
        for code in [ProviderUnreachable, ProviderOverloaded, CliSpawn] {
            assert_eq!(
                O::of(Some(code), None, "k"),
                O::failure(code.as_str()),
                "{code:?}"
            );
        }
        for code in [
            ProviderError,
            BrokenStream,
            ProviderIdleTimeout,
            ProviderTimeout,
            BadUpstreamResponse,
            CliExit,
        ] {
            assert_eq!(O::of(Some(code), None, "k"), by(code.as_str()), "{code:?}");
        }
        for code in [
            ProviderRateLimited,
            ProviderAuth,
            BadRequest,
            UnknownTarget,
            ClientAbort,
            Cancelled,
            NodeDisconnected,
            NodeCapacity,
            NodeTimeout,
            UnknownAdapter,
        ] {
            assert_eq!(O::of(Some(code), None, "k"), O::Neutral, "{code:?}");
        }
        // A provider's HTTP status, as a tunnel ending after it is classified.
        let of_status = |s: u16| O::of(ErrorCode::from_provider_status(s), Some(s.into()), "k");
        assert_eq!(of_status(200), O::Success);
        assert_eq!(of_status(503), O::failure("provider_overloaded (HTTP 503)"));
        assert_eq!(of_status(500), by("provider_error (HTTP 500)"));
        // A stream that broke after a 200 names no status.
        assert_eq!(
            O::of(Some(BrokenStream), Some(200), "k"),
            by("broken_stream")
        );
        for status in [400, 401, 404, 429] {
            assert_eq!(of_status(status), O::Neutral, "{status}");
        }
    }
}
