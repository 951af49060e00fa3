//! The dispatch part of the edge: admission (every provider's leases and every group's
//! queue, behind its own lock), the retry budget, and the ids of runs, tunnels and
//! commands.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

use super::admission::AdmissionControl;
use super::plan::AdmissionPlan;
use crate::config::{DispatchConfig, EdgeConfig};
use crate::queue::Scheduler;
use crate::registry::Generation;
use crate::retry_budget::{BudgetPolicy, RetryBudget, WINDOW};

#[derive(Debug)]
pub struct DispatchState {
    pub admission: Arc<AdmissionControl>,
    /// Retries allowed over the last window (`dispatch.retry_budget_*`).
    retry_budget: Mutex<RetryBudget>,
}

/// The retry budget a dispatch config asks for.
fn budget_policy(config: &DispatchConfig) -> BudgetPolicy {
    BudgetPolicy {
        percent: config.retry_budget_percent,
        min: config.retry_budget_min,
    }
}

impl DispatchState {
    pub fn new(config: &EdgeConfig) -> Self {
        let plan = AdmissionPlan::of(config);
        let mut scheduler = Scheduler::new(plan.providers, plan.groups);
        scheduler.set_ejection_policy(plan.ejection);
        Self {
            admission: AdmissionControl::new(scheduler, plan.policies),
            retry_budget: Mutex::new(RetryBudget::new(budget_policy(&config.dispatch), WINDOW)),
        }
    }

    /// Takes a reloaded config: its providers, groups and policies; `online`: the nodes
    /// connected now, with their generation.
    pub fn reconfigure(&self, config: &EdgeConfig, online: &HashMap<String, Generation>) {
        self.admission
            .reconfigure(AdmissionPlan::of(config), online);
        self.retry_budget
            .lock()
            .set_policy(budget_policy(&config.dispatch));
    }

    /// A request begins (it counts toward the retries the budget allows).
    pub fn request_started(&self, now: Instant) {
        self.retry_budget.lock().record_request(now);
    }

    /// Whether the budget has room for one more retry now (taking it if so).
    pub fn try_retry(&self, now: Instant) -> bool {
        self.retry_budget.lock().try_retry(now)
    }

    /// A fresh id for a run, tunnel or command: 128 random bits (32 hex digits) from a
    /// thread-local CSPRNG seeded by the OS, so an id says nothing about any other id and
    /// cannot be guessed; no syscall per id.
    pub fn new_id(&self) -> String {
        format!("{:032x}", rand::random::<u128>())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(retry: &str) -> EdgeConfig {
        EdgeConfig::from_yaml(&format!("dispatch: {{{retry}}}"), "test").unwrap()
    }

    #[test]
    fn retries_stay_within_the_budget_and_a_reload_changes_it() {
        let state = DispatchState::new(&config("retry_budget_percent: 0, retry_budget_min: 1"));
        let now = Instant::now();
        state.request_started(now);
        assert!(state.try_retry(now), "the minimum allows one");
        assert!(!state.try_retry(now), "and no more");
        state.reconfigure(
            &config("retry_budget_percent: 0, retry_budget_min: 2"),
            &HashMap::new(),
        );
        assert!(state.try_retry(now), "the new minimum allows a second");
    }

    #[test]
    fn ids_are_32_hex_digits_and_distinct() {
        let state = DispatchState::new(&config(""));
        let (a, b) = (state.new_id(), state.new_id());
        assert_eq!(a.len(), 32);
        assert!(a.chars().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
    }
}
