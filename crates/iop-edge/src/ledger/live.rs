//! The last minute of requests per model group, in memory, for `/admin/usage/live`:
//! requests per second, failures, and time-to-first-token and latency percentiles. A pure
//! state machine: it is fed finished requests and asked for a summary, both with `now`.
//!
//! Memory is bounded: per group, one counter per second of the window and at most
//! [`MAX_SAMPLES`] recent latency samples (percentiles come from the newest ones when a
//! group is busier than that); at most [`MAX_GROUPS`] groups (a group quiet for a whole
//! window makes room).

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use serde::Serialize;

/// The window summarized.
pub const WINDOW: Duration = Duration::from_secs(60);
/// Latency samples kept per group.
pub const MAX_SAMPLES: usize = 4_096;
/// Groups tracked at most.
pub const MAX_GROUPS: usize = 1_024;

/// One finished request as the window sees it.
#[derive(Debug, Clone, Copy)]
struct Sample {
    at: Instant,
    ttft_ms: Option<u64>,
    latency_ms: u64,
}

#[derive(Debug, Default)]
struct GroupWindow {
    /// `(second since the window's origin, requests, failed)`, oldest first.
    seconds: VecDeque<(u64, u64, u64)>,
    samples: VecDeque<Sample>,
}

/// A group's last minute.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GroupLive {
    pub group: String,
    pub requests_per_sec: f64,
    pub ttft_p50_ms: Option<u64>,
    pub ttft_p95_ms: Option<u64>,
    pub latency_p50_ms: Option<u64>,
    pub latency_p95_ms: Option<u64>,
    pub failed: u64,
}

/// The last [`WINDOW`] of every group.
#[derive(Debug)]
pub struct LiveWindow {
    origin: Instant,
    groups: HashMap<String, GroupWindow>,
}

impl LiveWindow {
    pub fn new(origin: Instant) -> Self {
        Self {
            origin,
            groups: HashMap::new(),
        }
    }

    fn second(&self, at: Instant) -> u64 {
        at.saturating_duration_since(self.origin).as_secs()
    }

    /// A request of `group` finished at `now`.
    pub fn record(
        &mut self,
        group: &str,
        failed: bool,
        ttft_ms: Option<u64>,
        latency_ms: u64,
        now: Instant,
    ) {
        let second = self.second(now);
        if !self.groups.contains_key(group) {
            if self.groups.len() >= MAX_GROUPS {
                self.evict_quiet(now);
            }
            if self.groups.len() >= MAX_GROUPS {
                return;
            }
            self.groups
                .insert(group.to_string(), GroupWindow::default());
        }
        let window = self.groups.get_mut(group).expect("inserted above");
        match window.seconds.back_mut() {
            Some((s, requests, fails)) if *s == second => {
                *requests += 1;
                *fails += u64::from(failed);
            }
            _ => window.seconds.push_back((second, 1, u64::from(failed))),
        }
        while window.seconds.len() > WINDOW.as_secs() as usize + 1 {
            window.seconds.pop_front();
        }
        if window.samples.len() >= MAX_SAMPLES {
            window.samples.pop_front();
        }
        window.samples.push_back(Sample {
            at: now,
            ttft_ms,
            latency_ms,
        });
    }

    /// Drops the groups with nothing in the window.
    fn evict_quiet(&mut self, now: Instant) {
        let oldest = self.second(now).saturating_sub(WINDOW.as_secs());
        self.groups
            .retain(|_, w| w.seconds.back().is_some_and(|(s, _, _)| *s >= oldest));
    }

    /// Every group with requests in the window ending at `now`, by name.
    pub fn summary(&mut self, now: Instant) -> Vec<GroupLive> {
        self.evict_quiet(now);
        let current = self.second(now);
        // The window is the last WINDOW seconds: the current (partial) second and the
        // 59 before it.
        let first = (current + 1).saturating_sub(WINDOW.as_secs());
        let cutoff = now.checked_sub(WINDOW);
        let mut out: Vec<GroupLive> = self
            .groups
            .iter()
            .filter_map(|(name, w)| {
                let (requests, failed) = w
                    .seconds
                    .iter()
                    .filter(|(s, _, _)| *s >= first && *s <= current)
                    .fold((0, 0), |(r, f), (_, rs, fs)| (r + rs, f + fs));
                if requests == 0 {
                    return None;
                }
                let recent = w.samples.iter().filter(|s| cutoff.is_none_or(|c| s.at > c));
                let mut ttft: Vec<u64> = recent.clone().filter_map(|s| s.ttft_ms).collect();
                let mut latency: Vec<u64> = recent.map(|s| s.latency_ms).collect();
                ttft.sort_unstable();
                latency.sort_unstable();
                Some(GroupLive {
                    group: name.clone(),
                    requests_per_sec: requests as f64 / WINDOW.as_secs_f64(),
                    ttft_p50_ms: percentile(&ttft, 50),
                    ttft_p95_ms: percentile(&ttft, 95),
                    latency_p50_ms: percentile(&latency, 50),
                    latency_p95_ms: percentile(&latency, 95),
                    failed,
                })
            })
            .collect();
        out.sort_by(|a, b| a.group.cmp(&b.group));
        out
    }
}

/// The `p`th percentile (nearest rank) of sorted values.
fn percentile(sorted: &[u64], p: usize) -> Option<u64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = (p * sorted.len()).div_ceil(100).max(1);
    Some(sorted[rank - 1])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_by_nearest_rank() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(percentile(&v, 50), Some(50));
        assert_eq!(percentile(&v, 95), Some(95));
        assert_eq!(percentile(&[7], 95), Some(7));
        assert_eq!(percentile(&[], 50), None);
    }

    #[test]
    fn a_minute_of_requests_is_summarized_and_then_forgotten() {
        let t0 = Instant::now();
        let mut live = LiveWindow::new(t0);
        for i in 0..120u64 {
            let at = t0 + Duration::from_millis(i * 500);
            live.record("g", i % 10 == 0, Some(i), 100 + i, at);
        }
        live.record("other", true, None, 5, t0 + Duration::from_secs(59));
        let now = t0 + Duration::from_millis(59_900);
        let summary = live.summary(now);
        assert_eq!(summary.len(), 2);
        let g = &summary[0];
        assert_eq!(g.group, "g");
        assert!((g.requests_per_sec - 2.0).abs() < 1e-9, "{g:?}");
        assert_eq!(g.failed, 12);
        assert_eq!(g.ttft_p50_ms, Some(59));
        assert_eq!(g.latency_p95_ms, Some(213));
        assert_eq!(summary[1].ttft_p50_ms, None);
        assert_eq!(summary[1].latency_p50_ms, Some(5));
        // A minute later nothing is left, and the groups are forgotten.
        assert!(live.summary(now + Duration::from_secs(61)).is_empty());
        assert!(live.groups.is_empty());
    }

    #[test]
    fn memory_stays_bounded() {
        let t0 = Instant::now();
        let mut live = LiveWindow::new(t0);
        for i in 0..(MAX_SAMPLES as u64 * 3) {
            live.record("g", false, None, i, t0 + Duration::from_micros(i));
        }
        assert_eq!(live.groups["g"].samples.len(), MAX_SAMPLES);
        for i in 0..(MAX_GROUPS + 10) {
            live.record(&format!("g{i}"), false, None, 1, t0);
        }
        assert_eq!(live.groups.len(), MAX_GROUPS);
        // Once the window passed, quiet groups make room.
        live.record("late", false, None, 1, t0 + Duration::from_secs(120));
        assert!(live.groups.contains_key("late"));
        assert_eq!(live.groups.len(), 1);
    }
}
