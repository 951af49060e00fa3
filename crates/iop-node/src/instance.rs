//! One provider's running adapter ([`AdapterInstance`]): the adapter, the capacity gate
//! its runs and tunnels share, its usage totals and what its probes found. The runtime
//! keeps instances across config refreshes; probes watch them.

use std::sync::Arc;
use std::time::Duration;

use iop_proto::pb;
use parking_lot::Mutex;
use serde::Serialize;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

use crate::adapters::Adapter;
use crate::health::ProbeTracker;

/// How long a run or tunnel waits for a slot of its adapter's capacity gate before it is
/// refused. The edge admits against the same capacity and counts a slot free as soon as it
/// has sent the cancel of the stream that held it; that stream lets go of the slot a moment
/// later, once the node has handled the cancel, possibly after it read the next request.
/// Work beyond what the edge admitted is still refused, after this grace.
pub const SLOT_GRACE: Duration = Duration::from_millis(250);

/// One provider's adapter with its node-local capacity gate, shared by runs and tunnels.
#[derive(Debug)]
pub struct AdapterInstance {
    pub spec: pb::ProviderSpec,
    pub adapter: Arc<dyn Adapter>,
    pub gate: Arc<Semaphore>,
    pub usage: Mutex<UsageTotals>,
    /// What the provider's probes found.
    pub health: Mutex<ProbeTracker>,
    /// Stops the probe task when the instance is dropped.
    pub probe_stop: CancellationToken,
}

impl Drop for AdapterInstance {
    fn drop(&mut self) {
        self.probe_stop.cancel();
    }
}

impl AdapterInstance {
    pub fn max_concurrency(&self) -> u32 {
        self.spec.max_concurrency.max(1)
    }

    pub fn in_flight(&self) -> u32 {
        self.max_concurrency()
            .saturating_sub(self.gate.available_permits() as u32)
    }

    pub fn kind(&self) -> &'static str {
        self.spec.kind().config_name()
    }

    /// Takes one slot of the capacity gate, waiting at most [`SLOT_GRACE`] for one to be
    /// let go; `None` when the adapter is still at its max concurrency.
    pub async fn acquire_slot(&self) -> Option<OwnedSemaphorePermit> {
        acquire_within(&self.gate, SLOT_GRACE).await
    }

    /// The error of a run or tunnel refused for capacity.
    pub fn at_capacity(&self) -> crate::adapters::AdapterError {
        crate::adapters::AdapterError::new(
            iop_proto::ErrorCode::NodeCapacity,
            format!(
                "adapter {} is at its max concurrency ({})",
                self.spec.id,
                self.max_concurrency()
            ),
        )
    }

    pub fn record_usage(&self, usage: Option<&pb::Usage>, tunnel: bool) {
        self.usage.lock().record(usage, tunnel);
    }
}

/// One permit of `gate`, at once or once one is let go within `grace`.
async fn acquire_within(gate: &Arc<Semaphore>, grace: Duration) -> Option<OwnedSemaphorePermit> {
    if let Ok(permit) = gate.clone().try_acquire_owned() {
        return Some(permit);
    }
    tokio::time::timeout(grace, gate.clone().acquire_owned())
        .await
        .ok()?
        .ok()
}

/// Token totals of one adapter since the node started.
#[derive(Debug, Clone, Default, Serialize)]
pub struct UsageTotals {
    pub runs: u64,
    pub tunnels: u64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub reasoning_tokens: u64,
    pub cached_input_tokens: u64,
}

impl UsageTotals {
    /// Counts one run or tunnel and its usage. Every sum saturates: a backend reporting
    /// `u64::MAX` pins a total at the maximum instead of wrapping it to a small number.
    pub fn record(&mut self, usage: Option<&pb::Usage>, tunnel: bool) {
        let count = if tunnel {
            &mut self.tunnels
        } else {
            &mut self.runs
        };
        *count = count.saturating_add(1);
        if let Some(u) = usage {
            let add = |total: &mut u64, n: u64| *total = total.saturating_add(n);
            add(&mut self.input_tokens, u.input_tokens);
            add(&mut self.output_tokens, u.output_tokens);
            add(&mut self.reasoning_tokens, u.reasoning_tokens.unwrap_or(0));
            add(
                &mut self.cached_input_tokens,
                u.cached_input_tokens.unwrap_or(0),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_slot_let_go_within_the_grace_is_taken_and_a_held_one_is_refused() {
        let gate = Arc::new(Semaphore::new(1));
        let held = gate.clone().try_acquire_owned().unwrap();
        tokio::spawn(async move {
            tokio::time::sleep(SLOT_GRACE / 2).await;
            drop(held);
        });
        let permit = acquire_within(&gate, SLOT_GRACE).await;
        assert!(permit.is_some(), "a slot freed during the grace is taken");
        let started = tokio::time::Instant::now();
        assert!(acquire_within(&gate, SLOT_GRACE).await.is_none());
        assert_eq!(
            started.elapsed(),
            SLOT_GRACE,
            "refused once the grace is over"
        );
    }

    #[test]
    fn usage_totals_saturate_instead_of_wrapping() {
        let mut totals = UsageTotals::default();
        let huge = pb::Usage {
            input_tokens: u64::MAX,
            output_tokens: u64::MAX - 1,
            reasoning_tokens: Some(u64::MAX),
            cached_input_tokens: Some(3),
        };
        totals.record(Some(&huge), false);
        totals.record(
            Some(&pb::Usage {
                input_tokens: 5,
                output_tokens: 5,
                reasoning_tokens: Some(5),
                cached_input_tokens: Some(u64::MAX),
            }),
            false,
        );
        assert_eq!(totals.input_tokens, u64::MAX, "MAX + 5 stays MAX");
        assert_eq!(totals.output_tokens, u64::MAX);
        assert_eq!(totals.reasoning_tokens, u64::MAX);
        assert_eq!(totals.cached_input_tokens, u64::MAX);
        assert_eq!(totals.runs, 2);
        totals.tunnels = u64::MAX;
        totals.record(None, true);
        assert_eq!(totals.tunnels, u64::MAX);
        // Ordinary sums are exact.
        let mut small = UsageTotals::default();
        small.record(
            Some(&pb::Usage {
                input_tokens: 2,
                output_tokens: 3,
                ..Default::default()
            }),
            false,
        );
        small.record(
            Some(&pb::Usage {
                input_tokens: 4,
                output_tokens: 1,
                ..Default::default()
            }),
            true,
        );
        assert_eq!(
            (
                small.input_tokens,
                small.output_tokens,
                small.runs,
                small.tunnels
            ),
            (6, 4, 1, 1)
        );
    }
}
