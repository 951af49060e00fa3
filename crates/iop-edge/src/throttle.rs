//! A per-source-address throttle for failed credential attempts: each failure makes the
//! address wait longer before its next attempt (doubling from `base_delay` up to
//! `max_delay`), a quiet `forgive_after` clears its record, and failures are summed for one
//! periodic log line instead of one line per attempt. Pure: the caller passes `now`.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy)]
pub struct ThrottlePolicy {
    pub base_delay: Duration,
    pub max_delay: Duration,
    pub forgive_after: Duration,
    pub max_tracked: usize,
}

/// Failures since the last summary.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FailureSummary {
    pub failures: u64,
    pub addresses: usize,
    pub top: Option<(IpAddr, u64)>,
}

#[derive(Debug, Clone, Copy)]
struct Record {
    failures: u32,
    last: Instant,
    blocked_until: Instant,
}

#[derive(Debug)]
pub struct FailureThrottle {
    policy: ThrottlePolicy,
    records: HashMap<IpAddr, Record>,
    period: HashMap<IpAddr, u64>,
    period_failures: u64,
}

impl FailureThrottle {
    pub fn new(policy: ThrottlePolicy) -> Self {
        Self {
            policy,
            records: HashMap::new(),
            period: HashMap::new(),
            period_failures: 0,
        }
    }

    /// `Err(wait)` while `addr` must wait before its next attempt.
    pub fn check(&mut self, addr: IpAddr, now: Instant) -> Result<(), Duration> {
        match self.records.get(&addr) {
            Some(r) if r.blocked_until > now => Err(r.blocked_until - now),
            _ => Ok(()),
        }
    }

    pub fn failure(&mut self, addr: IpAddr, now: Instant) {
        let policy = self.policy;
        if !self.records.contains_key(&addr) && self.records.len() >= policy.max_tracked {
            self.records
                .retain(|_, r| now.saturating_duration_since(r.last) < policy.forgive_after);
            if self.records.len() >= policy.max_tracked
                && let Some(oldest) = self
                    .records
                    .iter()
                    .min_by_key(|(_, r)| r.last)
                    .map(|(a, _)| *a)
            {
                self.records.remove(&oldest);
            }
        }
        let record = self.records.entry(addr).or_insert(Record {
            failures: 0,
            last: now,
            blocked_until: now,
        });
        if now.saturating_duration_since(record.last) >= policy.forgive_after {
            record.failures = 0;
        }
        record.failures = record.failures.saturating_add(1);
        record.last = now;
        let factor = 1u32 << (record.failures - 1).min(20);
        let delay = policy
            .base_delay
            .saturating_mul(factor)
            .min(policy.max_delay);
        record.blocked_until = now + delay;
        self.period_failures += 1;
        if self.period.len() < policy.max_tracked || self.period.contains_key(&addr) {
            *self.period.entry(addr).or_default() += 1;
        }
    }

    pub fn success(&mut self, addr: IpAddr) {
        self.records.remove(&addr);
    }

    /// The failures since the previous call.
    pub fn take_summary(&mut self) -> FailureSummary {
        let top = self
            .period
            .iter()
            .max_by_key(|(_, n)| **n)
            .map(|(a, n)| (*a, *n));
        let summary = FailureSummary {
            failures: self.period_failures,
            addresses: self.period.len(),
            top,
        };
        self.period.clear();
        self.period_failures = 0;
        summary
    }
}
