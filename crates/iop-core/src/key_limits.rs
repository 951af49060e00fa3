//! Per-key limits (`auth.keys[].limits`): requests per minute (a sliding window over the
//! last 60 s), tokens per day (input + output in the current UTC day, from the ledger's
//! counts) and concurrent requests. A pure state machine: [`KeyLimiter::admit`] decides at
//! admission with `now`, a concurrency place is given back with [`KeyLimiter::release`]
//! when its request ends, and a request's tokens are settled with [`KeyLimiter::settle`].
//!
//! Token budgets reserve: a request admitted under `tokens_per_day` reserves its estimated
//! input plus its `max_tokens` (or `reserve_tokens`) until it ends, and a request is
//! admitted only while the tokens used today plus those reserved by the key's requests in
//! flight are below the budget. So a burst cannot run far past a budget: the day's use
//! ends below the budget plus one request's reservation, plus whatever requests in flight
//! used beyond what they reserved (docs/usage.md).
//!
//! Only keys with limits are tracked for requests per minute and concurrency; tokens are
//! counted for every key, so a budget added by a reload counts today's use already.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use crate::config::KeyLimitsConfig;
use crate::day_tokens::{DayTokens, until_next_day};

/// The sliding window of `requests_per_minute`.
pub const MINUTE: Duration = Duration::from_secs(60);

/// Which limit refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    RequestsPerMinute(u32),
    TokensPerDay(u64),
    MaxConcurrent(u32),
}

impl Limit {
    /// What the limit is, in words and by its config field.
    pub fn describe(self) -> String {
        match self {
            Limit::RequestsPerMinute(n) => {
                format!("{n} requests per minute (limits.requests_per_minute)")
            }
            Limit::TokensPerDay(n) => {
                format!("{n} tokens per day, input + output, UTC (limits.tokens_per_day)")
            }
            Limit::MaxConcurrent(n) => {
                format!("{n} concurrent requests (limits.max_concurrent)")
            }
        }
    }
}

/// A refusal: the limit, and how long until a request would pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitExceeded {
    pub limit: Limit,
    pub retry_after: Duration,
}

impl LimitExceeded {
    /// `Retry-After` in whole seconds (at least 1).
    pub fn retry_after_secs(&self) -> u64 {
        self.retry_after.as_secs_f64().ceil().max(1.0) as u64
    }
}

/// What an admitted request holds: a concurrency place of the key (given back with
/// [`KeyLimiter::release`]) and the tokens reserved for it (settled with
/// [`KeyLimiter::settle`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub struct Admitted {
    pub key: String,
    pub concurrent: bool,
    pub reserved_tokens: u64,
}

impl Admitted {
    /// Whether it holds nothing.
    pub fn is_free(&self) -> bool {
        !self.concurrent && self.reserved_tokens == 0
    }
}

/// Where a key stands against its limits (the admin status shows it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct KeyUsage {
    /// Requests admitted in the last 60 s (counted for keys with `requests_per_minute`).
    pub requests_last_minute: usize,
    /// Requests in flight (counted for keys with `max_concurrent`).
    pub in_flight: u32,
    /// Tokens today (UTC), as `tokens_per_day` counts them.
    pub tokens_today: u64,
    /// Tokens reserved by its requests in flight (keys with `tokens_per_day`).
    pub tokens_reserved: u64,
}

#[derive(Debug, Default)]
pub struct KeyLimiter {
    /// Admission times in the last minute, per key with `requests_per_minute`.
    recent: HashMap<String, VecDeque<Instant>>,
    /// Requests in flight, per key with `max_concurrent`.
    in_flight: HashMap<String, u32>,
    /// Tokens reserved by requests in flight, per key with `tokens_per_day`.
    reserved: HashMap<String, u64>,
    tokens: DayTokens,
}

impl KeyLimiter {
    pub fn new(tokens: DayTokens) -> Self {
        Self {
            tokens,
            ..Self::default()
        }
    }

    /// Whether a request of `key` with `limits` that would reserve `reserve` tokens may
    /// start now (`now_ms`: Unix ms). On success the request is counted against the
    /// minute and, with `max_concurrent`, holds a place until released, and with
    /// `tokens_per_day` reserves `reserve` tokens until settled.
    pub fn admit(
        &mut self,
        key: &str,
        limits: &KeyLimitsConfig,
        reserve: u64,
        now: Instant,
        now_ms: i64,
    ) -> Result<Admitted, LimitExceeded> {
        if let Some(max) = limits.max_concurrent
            && self.in_flight.get(key).copied().unwrap_or(0) >= max
        {
            return Err(LimitExceeded {
                limit: Limit::MaxConcurrent(max),
                retry_after: Duration::from_secs(1),
            });
        }
        let reserved = self.reserved.get(key).copied().unwrap_or(0);
        if let Some(budget) = limits.tokens_per_day
            && self.tokens.used(key, now_ms).saturating_add(reserved) >= budget
        {
            return Err(LimitExceeded {
                limit: Limit::TokensPerDay(budget),
                retry_after: Duration::from_millis(until_next_day(now_ms).max(0) as u64),
            });
        }
        if let Some(rpm) = limits.requests_per_minute {
            let window = self.recent.entry(key.to_string()).or_default();
            while window
                .front()
                .is_some_and(|t| now.saturating_duration_since(*t) >= MINUTE)
            {
                window.pop_front();
            }
            if window.len() >= rpm as usize {
                // The oldest of the last `rpm` leaves the window first.
                let oldest = window[window.len() - rpm as usize];
                return Err(LimitExceeded {
                    limit: Limit::RequestsPerMinute(rpm),
                    retry_after: MINUTE.saturating_sub(now.saturating_duration_since(oldest)),
                });
            }
        }
        Ok(self.count(key, limits, reserve, now))
    }

    /// Whether a request of `key` whose prompt is estimated at `input` tokens fits what is
    /// left of its `tokens_per_day` budget today (less what its requests in flight
    /// reserved): a prompt larger than that is refused before it is sent anywhere.
    pub fn input_fits(
        &mut self,
        key: &str,
        limits: &KeyLimitsConfig,
        input: u64,
        now_ms: i64,
    ) -> Result<(), LimitExceeded> {
        let Some(budget) = limits.tokens_per_day else {
            return Ok(());
        };
        let spent = self
            .tokens
            .used(key, now_ms)
            .saturating_add(self.reserved(key));
        if input > budget.saturating_sub(spent) {
            return Err(LimitExceeded {
                limit: Limit::TokensPerDay(budget),
                retry_after: Duration::from_millis(until_next_day(now_ms).max(0) as u64),
            });
        }
        Ok(())
    }

    /// Counts a request of `key` admitted elsewhere (by the fleet's store): against the
    /// minute, with `max_concurrent` a place until released, with `tokens_per_day`
    /// `reserve` tokens until settled — the same as [`KeyLimiter::admit`] without the
    /// checks.
    pub fn count(
        &mut self,
        key: &str,
        limits: &KeyLimitsConfig,
        reserve: u64,
        now: Instant,
    ) -> Admitted {
        match limits.requests_per_minute {
            Some(_) => self
                .recent
                .entry(key.to_string())
                .or_default()
                .push_back(now),
            None => {
                self.recent.remove(key);
            }
        }
        let concurrent = limits.max_concurrent.is_some();
        if concurrent {
            *self.in_flight.entry(key.to_string()).or_default() += 1;
        }
        let reserved_tokens = if limits.tokens_per_day.is_some() {
            *self.reserved.entry(key.to_string()).or_default() += reserve;
            reserve
        } else {
            0
        };
        Admitted {
            key: key.to_string(),
            concurrent,
            reserved_tokens,
        }
    }

    /// Gives back an admitted request's concurrency place (its request ended).
    pub fn release(&mut self, admitted: &Admitted) {
        if admitted.concurrent
            && let Some(n) = self.in_flight.get_mut(&admitted.key)
        {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.in_flight.remove(&admitted.key);
            }
        }
    }

    /// A finished request of `key` (arrived at `time_ms`) that reserved `reserved` tokens
    /// used `tokens` (input + output): the reservation gives way to the count.
    pub fn settle(&mut self, key: &str, reserved: u64, tokens: u64, time_ms: i64, now_ms: i64) {
        if reserved > 0
            && let Some(n) = self.reserved.get_mut(key)
        {
            *n = n.saturating_sub(reserved);
            if *n == 0 {
                self.reserved.remove(key);
            }
        }
        self.tokens.add(key, tokens, time_ms, now_ms);
    }

    /// Tokens `key`'s requests in flight reserved.
    pub fn reserved(&self, key: &str) -> u64 {
        self.reserved.get(key).copied().unwrap_or(0)
    }

    /// Where `key` stands against its limits at `now`.
    pub fn view(&mut self, key: &str, now: Instant, now_ms: i64) -> KeyUsage {
        let requests_last_minute = self.recent.get(key).map_or(0, |window| {
            window
                .iter()
                .filter(|t| now.saturating_duration_since(**t) < MINUTE)
                .count()
        });
        KeyUsage {
            requests_last_minute,
            in_flight: self.in_flight.get(key).copied().unwrap_or(0),
            tokens_today: self.tokens.used(key, now_ms),
            tokens_reserved: self.reserved(key),
        }
    }

    /// `key`'s tokens today.
    #[cfg(test)]
    pub fn tokens_today(&mut self, key: &str, now_ms: i64) -> u64 {
        self.tokens.used(key, now_ms)
    }

    /// Forgets the windows of keys that lost their limits (a reload) and that are empty.
    pub fn retain_keys(&mut self, limited: impl Fn(&str) -> bool, now: Instant) {
        self.recent.retain(|key, window| {
            limited(key)
                && window
                    .back()
                    .is_some_and(|t| now.saturating_duration_since(*t) < MINUTE)
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::day_tokens::DAY_MS;
    use proptest::prelude::*;

    fn limits(rpm: Option<u32>, tpd: Option<u64>, conc: Option<u32>) -> KeyLimitsConfig {
        KeyLimitsConfig {
            requests_per_minute: rpm,
            tokens_per_day: tpd,
            max_concurrent: conc,
            reserve_tokens: None,
        }
    }

    const NOON: i64 = 20_000 * DAY_MS + DAY_MS / 2;

    #[test]
    fn a_prompt_larger_than_what_is_left_of_the_budget_is_refused() {
        let mut l = KeyLimiter::default();
        let budget = KeyLimitsConfig {
            tokens_per_day: Some(100),
            ..Default::default()
        };
        l.settle("a", 0, 17, NOON, NOON);
        assert!(l.input_fits("a", &budget, 83, NOON).is_ok());
        let refused = l.input_fits("a", &budget, 50_012, NOON).unwrap_err();
        assert_eq!(refused.limit, Limit::TokensPerDay(100));
        assert!(
            l.input_fits("a", &KeyLimitsConfig::default(), 50_012, NOON)
                .is_ok()
        );
    }

    #[test]
    fn the_eleventh_request_in_a_minute_waits_for_the_first_to_leave_the_window() {
        let mut l = KeyLimiter::default();
        let ten = limits(Some(10), None, None);
        let t0 = Instant::now();
        for i in 0..10 {
            let at = t0 + Duration::from_secs(i);
            assert!(l.admit("a", &ten, 0, at, NOON).unwrap().is_free());
        }
        let at = t0 + Duration::from_secs(15);
        let refused = l.admit("a", &ten, 0, at, NOON).unwrap_err();
        assert_eq!(refused.limit, Limit::RequestsPerMinute(10));
        assert_eq!(refused.retry_after, Duration::from_secs(45));
        assert_eq!(refused.retry_after_secs(), 45);
        // Another key is not affected; a refused request does not count.
        assert!(l.admit("b", &ten, 0, at, NOON).is_ok());
        assert!(
            l.admit("a", &ten, 0, t0 + Duration::from_secs(59), NOON)
                .is_err()
        );
        // Once the first left the window, one more passes — and then the second must go.
        assert!(
            l.admit("a", &ten, 0, t0 + Duration::from_secs(60), NOON)
                .is_ok()
        );
        let refused = l
            .admit("a", &ten, 0, t0 + Duration::from_secs(60), NOON)
            .unwrap_err();
        assert_eq!(refused.retry_after, Duration::from_secs(1));
    }

    #[test]
    fn a_token_budget_trips_once_passed_and_resets_at_utc_midnight() {
        let mut l = KeyLimiter::new(DayTokens::loaded(NOON, [("a".to_string(), 90)]));
        let budget = limits(None, Some(100), None);
        let t = Instant::now();
        let admitted = l.admit("a", &budget, 5, t, NOON).unwrap();
        assert_eq!(admitted.reserved_tokens, 5);
        l.settle("a", admitted.reserved_tokens, 10, NOON, NOON);
        assert_eq!(l.reserved("a"), 0);
        let refused = l.admit("a", &budget, 5, t, NOON).unwrap_err();
        assert_eq!(refused.limit, Limit::TokensPerDay(100));
        assert_eq!(
            refused.retry_after,
            Duration::from_millis(DAY_MS as u64 / 2)
        );
        assert!(l.admit("a", &budget, 5, t, NOON + DAY_MS / 2).is_ok());
    }

    #[test]
    fn reservations_of_requests_in_flight_hold_a_burst_back() {
        let mut l = KeyLimiter::default();
        let budget = limits(None, Some(100), None);
        let t = Instant::now();
        // Each reserves 40: the third finds 80 reserved and passes (80 < 100), the fourth
        // finds 120 and is refused, although nothing was used yet.
        let held: Vec<Admitted> = (0..3)
            .map(|_| l.admit("a", &budget, 40, t, NOON).unwrap())
            .collect();
        assert!(l.admit("a", &budget, 40, t, NOON).is_err());
        for a in &held {
            l.settle("a", a.reserved_tokens, 30, NOON, NOON);
        }
        assert_eq!((l.reserved("a"), l.tokens_today("a", NOON)), (0, 90));
        // 90 used: one more passes, then the budget is spent.
        let last = l.admit("a", &budget, 40, t, NOON).unwrap();
        l.settle("a", last.reserved_tokens, 30, NOON, NOON);
        assert!(l.admit("a", &budget, 40, t, NOON).is_err());
    }

    #[test]
    fn concurrency_places_come_back_when_released() {
        let mut l = KeyLimiter::default();
        let two = limits(None, None, Some(2));
        let t = Instant::now();
        let a = l.admit("a", &two, 0, t, NOON).unwrap();
        let b = l.admit("a", &two, 0, t, NOON).unwrap();
        let refused = l.admit("a", &two, 0, t, NOON).unwrap_err();
        assert_eq!(refused.limit, Limit::MaxConcurrent(2));
        assert_eq!(refused.retry_after_secs(), 1);
        l.release(&a);
        let c = l.admit("a", &two, 0, t, NOON).unwrap();
        l.release(&b);
        l.release(&c);
        assert!(l.in_flight.is_empty());
    }

    proptest! {
        /// However requests of one key interleave, the day's tokens end below the budget
        /// plus one request's reservation, as long as each uses no more than it reserved.
        #[test]
        fn a_budget_is_overrun_by_at_most_one_reservation(
            steps in prop::collection::vec((any::<bool>(), 1u64..200, 0u64..=100), 1..200),
            budget in 1u64..2_000,
        ) {
            let mut l = KeyLimiter::default();
            let config = limits(None, Some(budget), None);
            let t = Instant::now();
            let mut in_flight: Vec<Admitted> = Vec::new();
            let mut max_reserve = 0;
            for (start, reserve, percent) in steps {
                if start || in_flight.is_empty() {
                    if let Ok(a) = l.admit("k", &config, reserve, t, NOON) {
                        max_reserve = max_reserve.max(reserve);
                        in_flight.push(a);
                    }
                } else {
                    let a = in_flight.remove(0);
                    let used = a.reserved_tokens * percent / 100;
                    l.settle("k", a.reserved_tokens, used, NOON, NOON);
                }
            }
            for a in in_flight.drain(..) {
                l.settle("k", a.reserved_tokens, a.reserved_tokens, NOON, NOON);
            }
            prop_assert!(l.tokens_today("k", NOON) < budget + max_reserve.max(1));
            prop_assert_eq!(l.reserved("k"), 0);
        }
    }
}
