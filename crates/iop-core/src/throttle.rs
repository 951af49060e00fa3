//! Throttle of failed authentication attempts (bad node credentials, bad API keys) per
//! source address, with growing delays.
//!
//! Pure state, no I/O, no clock: every call takes `now`. After `n` consecutive failures
//! from an address, its next attempt may proceed only `base_delay * 2^(n-1)` (at most
//! `max_delay`) after the last failure; earlier attempts are told how long to wait. A
//! success clears the address; an address quiet for `forgive_after` starts afresh. IPv6
//! addresses are grouped by /64 (one host usually holds a whole /64), IPv4-mapped IPv6
//! addresses count as their IPv4 address. At most `max_tracked` addresses are remembered;
//! a new one beyond that evicts the one whose last failure is oldest.
//!
//! [`FailureThrottle::take_summary`] hands out the failures counted since its last call,
//! for one periodic log line instead of a line per guess.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr};
use std::time::{Duration, Instant};

/// How the throttle reacts to failures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThrottlePolicy {
    /// The wait after the first failure; it doubles with every further one.
    pub base_delay: Duration,
    /// The longest wait.
    pub max_delay: Duration,
    /// An address without a failure for this long is forgiven (starts afresh).
    pub forgive_after: Duration,
    /// Addresses remembered at most; the oldest is evicted for a new one.
    pub max_tracked: usize,
}

/// Failures counted since the previous summary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FailureSummary {
    pub failures: u64,
    /// Distinct addresses (IPv6: /64 networks) they came from, counted up to `max_tracked`.
    pub addresses: usize,
    /// The address with the most failures, and how many.
    pub top: Option<(IpAddr, u64)>,
}

#[derive(Debug, Clone, Copy)]
struct Record {
    /// Consecutive failures since the last success or forgiveness.
    failures: u32,
    last_failure: Instant,
}

/// Per-address failure throttle; see the module documentation.
#[derive(Debug)]
pub struct FailureThrottle {
    policy: ThrottlePolicy,
    records: HashMap<IpAddr, Record>,
    /// Failures per address since the last summary (bounded like `records`).
    window: HashMap<IpAddr, u64>,
    window_failures: u64,
}

impl FailureThrottle {
    pub fn new(policy: ThrottlePolicy) -> Self {
        Self {
            policy,
            records: HashMap::new(),
            window: HashMap::new(),
            window_failures: 0,
        }
    }

    /// Ok if an attempt from `addr` may proceed now; Err(wait) if it must wait that long.
    pub fn check(&mut self, addr: IpAddr, now: Instant) -> Result<(), Duration> {
        let key = address_group(addr);
        let Some(record) = self.records.get(&key) else {
            return Ok(());
        };
        let quiet = now.saturating_duration_since(record.last_failure);
        if quiet >= self.policy.forgive_after {
            self.records.remove(&key);
            return Ok(());
        }
        let delay = self.delay(record.failures);
        if quiet >= delay {
            Ok(())
        } else {
            Err(delay - quiet)
        }
    }

    /// Counts one failed attempt from `addr`.
    pub fn failure(&mut self, addr: IpAddr, now: Instant) {
        let key = address_group(addr);
        let forgive_after = self.policy.forgive_after;
        match self.records.get_mut(&key) {
            Some(record) => {
                if now.saturating_duration_since(record.last_failure) >= forgive_after {
                    record.failures = 0;
                }
                record.failures = record.failures.saturating_add(1);
                record.last_failure = now;
            }
            None => {
                if self.records.len() >= self.policy.max_tracked.max(1) {
                    self.evict_oldest();
                }
                self.records.insert(
                    key,
                    Record {
                        failures: 1,
                        last_failure: now,
                    },
                );
            }
        }
        self.window_failures = self.window_failures.saturating_add(1);
        if let Some(count) = self.window.get_mut(&key) {
            *count = count.saturating_add(1);
        } else if self.window.len() < self.policy.max_tracked.max(1) {
            self.window.insert(key, 1);
        }
    }

    /// A successful attempt from `addr`: its failures are forgotten.
    pub fn success(&mut self, addr: IpAddr) {
        self.records.remove(&address_group(addr));
    }

    /// Failures since the last call, for a periodic log line.
    pub fn take_summary(&mut self) -> FailureSummary {
        let top = self
            .window
            .iter()
            .max_by(|a, b| a.1.cmp(b.1).then_with(|| b.0.cmp(a.0)))
            .map(|(addr, count)| (*addr, *count));
        let summary = FailureSummary {
            failures: self.window_failures,
            addresses: self.window.len(),
            top,
        };
        self.window.clear();
        self.window_failures = 0;
        summary
    }

    /// Addresses currently remembered (tests and status).
    #[cfg(test)]
    pub fn tracked(&self) -> usize {
        self.records.len()
    }

    fn delay(&self, failures: u32) -> Duration {
        let doublings = failures.saturating_sub(1).min(31);
        self.policy
            .base_delay
            .saturating_mul(1u32 << doublings)
            .min(self.policy.max_delay)
    }

    fn evict_oldest(&mut self) {
        if let Some(oldest) = self
            .records
            .iter()
            .min_by_key(|(_, r)| r.last_failure)
            .map(|(addr, _)| *addr)
        {
            self.records.remove(&oldest);
        }
    }
}

/// The key an address is throttled under: IPv4 as is, IPv6 by its /64, an IPv4-mapped
/// IPv6 address as its IPv4 address.
pub fn address_group(addr: IpAddr) -> IpAddr {
    match addr {
        IpAddr::V4(_) => addr,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(Ipv6Addr::from(u128::from(v6) & !((1u128 << 64) - 1))),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn policy() -> ThrottlePolicy {
        ThrottlePolicy {
            base_delay: 100 * MS,
            max_delay: 1000 * MS,
            forgive_after: 10_000 * MS,
            max_tracked: 3,
        }
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn an_unknown_address_may_proceed() {
        let mut t = FailureThrottle::new(policy());
        assert_eq!(t.check(ip("10.0.0.1"), Instant::now()), Ok(()));
    }

    #[test]
    fn delays_double_with_each_failure_up_to_the_maximum() {
        let mut t = FailureThrottle::new(policy());
        let a = ip("10.0.0.1");
        let mut now = Instant::now();
        let mut waits = Vec::new();
        for _ in 0..6 {
            t.failure(a, now);
            let wait = t.check(a, now).unwrap_err();
            waits.push(wait.as_millis());
            // Half-way through the wait: still throttled, told the rest.
            assert_eq!(t.check(a, now + wait / 2), Err(wait - wait / 2));
            now += wait;
            assert_eq!(t.check(a, now), Ok(()), "after the full wait");
        }
        assert_eq!(waits, [100, 200, 400, 800, 1000, 1000]);
    }

    #[test]
    fn success_clears_the_address() {
        let mut t = FailureThrottle::new(policy());
        let a = ip("10.0.0.1");
        let now = Instant::now();
        t.failure(a, now);
        t.failure(a, now);
        t.success(a);
        assert_eq!(t.check(a, now), Ok(()));
        t.failure(a, now);
        assert_eq!(t.check(a, now), Err(100 * MS), "starts afresh");
    }

    #[test]
    fn a_quiet_address_is_forgiven() {
        let mut t = FailureThrottle::new(policy());
        let a = ip("10.0.0.1");
        let start = Instant::now();
        for _ in 0..5 {
            t.failure(a, start);
        }
        let later = start + 10_000 * MS;
        assert_eq!(t.check(a, later), Ok(()));
        t.failure(a, later);
        assert_eq!(t.check(a, later), Err(100 * MS), "counting starts afresh");
    }

    #[test]
    fn a_failure_after_the_forgiveness_period_starts_afresh_even_unchecked() {
        let mut t = FailureThrottle::new(policy());
        let a = ip("10.0.0.1");
        let start = Instant::now();
        for _ in 0..5 {
            t.failure(a, start);
        }
        let later = start + 20_000 * MS;
        t.failure(a, later);
        assert_eq!(t.check(a, later), Err(100 * MS));
    }

    #[test]
    fn addresses_are_independent() {
        let mut t = FailureThrottle::new(policy());
        let now = Instant::now();
        t.failure(ip("10.0.0.1"), now);
        assert!(t.check(ip("10.0.0.1"), now).is_err());
        assert_eq!(t.check(ip("10.0.0.2"), now), Ok(()));
    }

    #[test]
    fn ipv6_is_grouped_by_64_and_mapped_ipv4_counts_as_ipv4() {
        let mut t = FailureThrottle::new(policy());
        let now = Instant::now();
        t.failure(ip("2001:db8:1:2::1"), now);
        assert!(t.check(ip("2001:db8:1:2:ffff::9"), now).is_err());
        assert_eq!(t.check(ip("2001:db8:1:3::1"), now), Ok(()));
        t.failure(ip("::ffff:10.0.0.7"), now);
        assert!(t.check(ip("10.0.0.7"), now).is_err());
    }

    #[test]
    fn memory_is_bounded_and_the_oldest_is_evicted() {
        let mut t = FailureThrottle::new(policy());
        let start = Instant::now();
        for i in 0..3u64 {
            t.failure(ip(&format!("10.0.0.{i}")), start + i as u32 * MS);
        }
        assert_eq!(t.tracked(), 3);
        t.failure(ip("10.0.0.9"), start + 5 * MS);
        assert_eq!(t.tracked(), 3);
        let now = start + 6 * MS;
        assert_eq!(t.check(ip("10.0.0.0"), now), Ok(()), "the oldest went");
        assert!(t.check(ip("10.0.0.1"), now).is_err());
        assert!(t.check(ip("10.0.0.9"), now).is_err());
        for i in 0..10_000u32 {
            t.failure(IpAddr::V4(i.into()), now);
        }
        assert_eq!(t.tracked(), 3);
    }

    #[test]
    fn the_summary_counts_failures_since_the_last_one() {
        let mut t = FailureThrottle::new(policy());
        let now = Instant::now();
        assert_eq!(t.take_summary(), FailureSummary::default());
        for _ in 0..7 {
            t.failure(ip("10.0.0.1"), now);
        }
        t.failure(ip("10.0.0.2"), now);
        t.failure(ip("2001:db8::1"), now);
        t.failure(ip("2001:db8::2"), now);
        let s = t.take_summary();
        assert_eq!(s.failures, 10);
        assert_eq!(s.addresses, 3);
        assert_eq!(s.top, Some((ip("10.0.0.1"), 7)));
        assert_eq!(t.take_summary(), FailureSummary::default(), "taken");
        // A success does not hide failures already counted.
        t.failure(ip("10.0.0.3"), now);
        t.success(ip("10.0.0.3"));
        assert_eq!(t.take_summary().failures, 1);
    }

    #[test]
    fn the_summary_window_is_bounded_too() {
        let mut t = FailureThrottle::new(policy());
        let now = Instant::now();
        for i in 0..100u32 {
            t.failure(IpAddr::V4(i.into()), now);
        }
        let s = t.take_summary();
        assert_eq!((s.failures, s.addresses), (100, 3));
    }
}
