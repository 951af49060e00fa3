//! The retry budget: retries may be at most a percentage of the requests seen over a
//! sliding window, plus a minimum always allowed (Finagle's and Envoy's shape), so a fleet
//! whose members all fail does not double its own load with retries.
//!
//! Pure state, no clock: every call takes `now`. The window is kept as ten buckets, so
//! counts age out in steps of a tenth of the window.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// The window the edge uses.
pub const WINDOW: Duration = Duration::from_secs(10);
const BUCKETS: u32 = 10;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BudgetPolicy {
    /// Retries allowed per 100 requests in the window.
    pub percent: u32,
    /// Retries allowed in the window whatever the percentage says.
    pub min: u32,
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    start: Instant,
    requests: u64,
    retries: u64,
}

#[derive(Debug)]
pub struct RetryBudget {
    policy: BudgetPolicy,
    window: Duration,
    buckets: VecDeque<Bucket>,
}

impl RetryBudget {
    pub fn new(policy: BudgetPolicy, window: Duration) -> Self {
        Self {
            policy,
            window,
            buckets: VecDeque::with_capacity(BUCKETS as usize + 1),
        }
    }

    /// A reloaded policy; the counts stay.
    pub fn set_policy(&mut self, policy: BudgetPolicy) {
        self.policy = policy;
    }

    /// Counts a request (its first attempt).
    pub fn record_request(&mut self, now: Instant) {
        self.current(now).requests += 1;
    }

    /// Whether one more retry fits the budget now; if so it is counted.
    pub fn try_retry(&mut self, now: Instant) -> bool {
        self.expire(now);
        let (requests, retries) = self
            .buckets
            .iter()
            .fold((0u64, 0u64), |(q, r), b| (q + b.requests, r + b.retries));
        let allowed = u64::from(self.policy.min) + requests * u64::from(self.policy.percent) / 100;
        if retries >= allowed {
            return false;
        }
        self.current(now).retries += 1;
        true
    }

    fn expire(&mut self, now: Instant) {
        while let Some(first) = self.buckets.front() {
            if now.saturating_duration_since(first.start) >= self.window {
                self.buckets.pop_front();
            } else {
                break;
            }
        }
    }

    fn current(&mut self, now: Instant) -> &mut Bucket {
        self.expire(now);
        let width = self.window / BUCKETS;
        let fresh = match self.buckets.back() {
            Some(last) => now.saturating_duration_since(last.start) >= width,
            None => true,
        };
        if fresh {
            self.buckets.push_back(Bucket {
                start: now,
                requests: 0,
                retries: 0,
            });
        }
        self.buckets.back_mut().expect("a bucket")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(percent: u32, min: u32) -> RetryBudget {
        RetryBudget::new(BudgetPolicy { percent, min }, WINDOW)
    }

    #[test]
    fn the_minimum_is_always_allowed() {
        let mut b = budget(20, 3);
        let now = Instant::now();
        assert!(b.try_retry(now));
        assert!(b.try_retry(now));
        assert!(b.try_retry(now));
        assert!(!b.try_retry(now), "a fourth retry with no requests");
    }

    #[test]
    fn retries_are_a_share_of_the_requests() {
        let mut b = budget(20, 0);
        let now = Instant::now();
        for _ in 0..100 {
            b.record_request(now);
        }
        let granted = (0..100).filter(|_| b.try_retry(now)).count();
        assert_eq!(granted, 20);
    }

    #[test]
    fn a_failing_fleet_cannot_double_its_load() {
        // Every request fails and wants retries: over a long run the retries stay near 20 %
        // of the requests (+ the minimum per window).
        let mut b = budget(20, 10);
        let start = Instant::now();
        let (mut requests, mut retries) = (0u64, 0u64);
        for ms in 0..60_000u64 {
            let now = start + Duration::from_millis(ms);
            b.record_request(now);
            requests += 1;
            for _ in 0..2 {
                if b.try_retry(now) {
                    retries += 1;
                }
            }
        }
        let ratio = retries as f64 / requests as f64;
        assert!(ratio < 0.21, "retries {retries} of {requests}");
        assert!(ratio > 0.19, "the budget is used: {retries} of {requests}");
    }

    #[test]
    fn counts_age_out_of_the_window() {
        let mut b = budget(0, 2);
        let now = Instant::now();
        assert!(b.try_retry(now));
        assert!(b.try_retry(now));
        assert!(!b.try_retry(now + WINDOW / 2));
        assert!(
            b.try_retry(now + WINDOW),
            "the first bucket left the window"
        );
    }

    #[test]
    fn a_reloaded_policy_applies_at_once() {
        let mut b = budget(0, 0);
        let now = Instant::now();
        assert!(!b.try_retry(now));
        b.set_policy(BudgetPolicy { percent: 0, min: 1 });
        assert!(b.try_retry(now));
    }
}
