//! Each API key's input + output tokens in the current UTC day, for `tokens_per_day`
//! limits: loaded from the ledger when the edge starts (so a budget holds across a
//! restart), then kept up to date by every finished request. A pure state machine: the
//! day turns over when a call's `now_ms` (Unix milliseconds) is in a later day.

use std::collections::HashMap;

/// Milliseconds in a day.
pub const DAY_MS: i64 = 86_400_000;

/// The UTC day `unix_ms` falls in (days since the Unix epoch).
pub fn day_of(unix_ms: i64) -> i64 {
    unix_ms.div_euclid(DAY_MS)
}

/// Milliseconds from `unix_ms` to the next UTC midnight.
pub fn until_next_day(unix_ms: i64) -> i64 {
    (day_of(unix_ms) + 1) * DAY_MS - unix_ms
}

#[derive(Debug, Default)]
pub struct DayTokens {
    day: i64,
    by_key: HashMap<String, u64>,
}

impl DayTokens {
    /// Today's counts as the ledger had them at `now_ms`.
    pub fn loaded(now_ms: i64, counts: impl IntoIterator<Item = (String, u64)>) -> Self {
        Self {
            day: day_of(now_ms),
            by_key: counts.into_iter().collect(),
        }
    }

    fn turn_over(&mut self, now_ms: i64) {
        let today = day_of(now_ms);
        if today > self.day {
            self.day = today;
            self.by_key.clear();
        }
    }

    /// A request of `key` that arrived at `time_ms` used `tokens`; counted when it falls in
    /// the current day.
    pub fn add(&mut self, key: &str, tokens: u64, time_ms: i64, now_ms: i64) {
        self.turn_over(now_ms);
        if tokens == 0 || day_of(time_ms) != self.day {
            return;
        }
        match self.by_key.get_mut(key) {
            Some(n) => *n = n.saturating_add(tokens),
            None => {
                self.by_key.insert(key.to_string(), tokens);
            }
        }
    }

    /// `key`'s tokens today.
    pub fn used(&mut self, key: &str, now_ms: i64) -> u64 {
        self.turn_over(now_ms);
        self.by_key.get(key).copied().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_today_and_starts_over_at_utc_midnight() {
        let noon = 20_000 * DAY_MS + DAY_MS / 2;
        let mut t = DayTokens::loaded(noon, [("a".to_string(), 100)]);
        t.add("a", 50, noon, noon);
        t.add("b", 7, noon, noon);
        // A request that began yesterday is not today's.
        t.add("a", 1_000, noon - DAY_MS, noon);
        assert_eq!(t.used("a", noon), 150);
        assert_eq!(t.used("b", noon), 7);
        assert_eq!(t.used("c", noon), 0);
        assert_eq!(until_next_day(noon), DAY_MS / 2);
        let tomorrow = noon + DAY_MS / 2;
        assert_eq!(t.used("a", tomorrow), 0);
        t.add("a", 3, tomorrow, tomorrow);
        assert_eq!(t.used("a", tomorrow + 1), 3);
    }
}
