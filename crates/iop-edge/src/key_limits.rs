//! Per-key limits (`auth.keys[].limits`): requests per minute (a sliding window over the
//! last 60 s), tokens per day (input + output in the current UTC day, from the ledger's
//! counts) and concurrent requests. A pure state machine: [`KeyLimiter::admit`] decides at
//! admission with `now`, a request's tokens are added when it finishes, and a concurrency
//! place is given back with [`KeyLimiter::release`] when its stream ends.
//!
//! Only keys with limits are tracked for requests per minute and concurrency; tokens are
//! counted for every key, so a budget added by a reload counts today's use already.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use crate::config::KeyLimitsConfig;
use crate::ledger::day_tokens::{DayTokens, until_next_day};

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
    /// The error code a client gets.
    pub fn code(self) -> &'static str {
        match self {
            Limit::RequestsPerMinute(_) => "requests_per_minute_exceeded",
            Limit::TokensPerDay(_) => "tokens_per_day_exceeded",
            Limit::MaxConcurrent(_) => "max_concurrent_exceeded",
        }
    }

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

/// An admitted request's place, to give back with [`KeyLimiter::release`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub enum Admitted {
    /// Nothing to give back.
    Free,
    /// A concurrency place of the key.
    Concurrent(String),
}

#[derive(Debug, Default)]
pub struct KeyLimiter {
    /// Admission times in the last minute, per key with `requests_per_minute`.
    recent: HashMap<String, VecDeque<Instant>>,
    /// Requests in flight, per key with `max_concurrent`.
    in_flight: HashMap<String, u32>,
    tokens: DayTokens,
}

impl KeyLimiter {
    pub fn new(tokens: DayTokens) -> Self {
        Self {
            tokens,
            ..Self::default()
        }
    }

    /// Whether a request of `key` with `limits` may start now (`now_ms`: Unix ms). On
    /// success the request is counted against the minute and, with `max_concurrent`, holds
    /// a place until released.
    pub fn admit(
        &mut self,
        key: &str,
        limits: &KeyLimitsConfig,
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
        if let Some(budget) = limits.tokens_per_day
            && self.tokens.used(key, now_ms) >= budget
        {
            return Err(LimitExceeded {
                limit: Limit::TokensPerDay(budget),
                retry_after: Duration::from_millis(until_next_day(now_ms).max(0) as u64),
            });
        }
        match limits.requests_per_minute {
            Some(rpm) => {
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
                window.push_back(now);
            }
            None => {
                self.recent.remove(key);
            }
        }
        Ok(match limits.max_concurrent {
            Some(_) => {
                *self.in_flight.entry(key.to_string()).or_default() += 1;
                Admitted::Concurrent(key.to_string())
            }
            None => Admitted::Free,
        })
    }

    /// Gives back an admitted request's place (its stream ended, or it was refused later).
    pub fn release(&mut self, admitted: Admitted) {
        if let Admitted::Concurrent(key) = admitted
            && let Some(n) = self.in_flight.get_mut(&key)
        {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.in_flight.remove(&key);
            }
        }
    }

    /// A finished request of `key` (arrived at `time_ms`) used `tokens` (input + output).
    pub fn add_tokens(&mut self, key: &str, tokens: u64, time_ms: i64, now_ms: i64) {
        self.tokens.add(key, tokens, time_ms, now_ms);
    }

    /// `key`'s tokens today.
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
    use crate::ledger::day_tokens::DAY_MS;

    fn limits(rpm: Option<u32>, tpd: Option<u64>, conc: Option<u32>) -> KeyLimitsConfig {
        KeyLimitsConfig {
            requests_per_minute: rpm,
            tokens_per_day: tpd,
            max_concurrent: conc,
        }
    }

    const NOON: i64 = 20_000 * DAY_MS + DAY_MS / 2;

    #[test]
    fn the_eleventh_request_in_a_minute_waits_for_the_first_to_leave_the_window() {
        let mut l = KeyLimiter::default();
        let ten = limits(Some(10), None, None);
        let t0 = Instant::now();
        for i in 0..10 {
            let at = t0 + Duration::from_secs(i);
            assert_eq!(l.admit("a", &ten, at, NOON), Ok(Admitted::Free));
        }
        let at = t0 + Duration::from_secs(15);
        let refused = l.admit("a", &ten, at, NOON).unwrap_err();
        assert_eq!(refused.limit, Limit::RequestsPerMinute(10));
        assert_eq!(refused.retry_after, Duration::from_secs(45));
        assert_eq!(refused.retry_after_secs(), 45);
        // Another key is not affected; a refused request does not count.
        assert!(l.admit("b", &ten, at, NOON).is_ok());
        assert!(
            l.admit("a", &ten, t0 + Duration::from_secs(59), NOON)
                .is_err()
        );
        // Once the first left the window, one more passes — and then the second must go.
        assert!(
            l.admit("a", &ten, t0 + Duration::from_secs(60), NOON)
                .is_ok()
        );
        let refused = l
            .admit("a", &ten, t0 + Duration::from_secs(60), NOON)
            .unwrap_err();
        assert_eq!(refused.retry_after, Duration::from_secs(1));
    }

    #[test]
    fn a_token_budget_trips_once_passed_and_resets_at_utc_midnight() {
        let mut l = KeyLimiter::new(DayTokens::loaded(NOON, [("a".to_string(), 90)]));
        let budget = limits(None, Some(100), None);
        let t = Instant::now();
        assert!(l.admit("a", &budget, t, NOON).is_ok());
        l.add_tokens("a", 10, NOON, NOON);
        let refused = l.admit("a", &budget, t, NOON).unwrap_err();
        assert_eq!(refused.limit, Limit::TokensPerDay(100));
        assert_eq!(
            refused.retry_after,
            Duration::from_millis(DAY_MS as u64 / 2)
        );
        assert!(l.admit("a", &budget, t, NOON + DAY_MS / 2).is_ok());
    }

    #[test]
    fn concurrency_places_come_back_when_released() {
        let mut l = KeyLimiter::default();
        let two = limits(None, None, Some(2));
        let t = Instant::now();
        let a = l.admit("a", &two, t, NOON).unwrap();
        let b = l.admit("a", &two, t, NOON).unwrap();
        let refused = l.admit("a", &two, t, NOON).unwrap_err();
        assert_eq!(refused.limit, Limit::MaxConcurrent(2));
        assert_eq!(refused.retry_after_secs(), 1);
        l.release(a);
        let c = l.admit("a", &two, t, NOON).unwrap();
        l.release(b);
        l.release(c);
        assert!(l.in_flight.is_empty());
    }
}
