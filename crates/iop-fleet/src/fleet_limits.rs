//! API key limits held across a fleet (edges sharing a store): `requests_per_minute`,
//! `max_concurrent` and `tokens_per_day` count every edge's requests together. Each
//! admission is one call of the store's `iop_key_admit` function, which decides under a
//! per-key lock: the requests of the last 60 s (exact: never one more), the requests in
//! flight and tokens reserved by the key on every live edge (an edge that died stops
//! counting once it is no longer live, within 10 s), and the tokens used today. An
//! admission adds its place and reservation to this edge's row in the same call.
//!
//! The row changes only by such increments and by releases, never by a whole count
//! written over it: a request that ends adds its place and reservation to this edge's
//! running totals of what it released per key, and at most every [`HOLD_FLUSH`] the totals
//! of the keys that changed are sent (`iop_key_release`, under the same per-key lock),
//! which takes off only what the row has not taken off yet. So a release the store
//! missed, or one whose answer was lost after it was applied, is simply sent again with
//! the next totals: it is never lost and never taken off twice. An edge that starts
//! clears the rows of its earlier run (its totals start again with them) and uses its
//! share until it could. Tokens used are added to the day's count; those the store could
//! not take wait here and are added when it answers again. While the store does not
//! answer (or answered with an error in the last [`BACKOFF`]), admissions fall back to
//! this edge's share of each limit — the limit divided by the number of live edges,
//! rounded up — counted locally (and, since the store never counted them, never released
//! there).
//!
//! The store's side is the [`KeyStore`] trait (`crate::store::key_limits`, with
//! PostgreSQL's implementation), so the rules here are unit-tested against a store in
//! memory.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::config::KeyLimitsConfig;
use crate::key_limits::{Limit, LimitExceeded};
use crate::store::edges::Fleet;
pub use crate::store::key_limits::{KeyStore, Released, StoreError, StoreRefusal};

/// How long an admission waits for the store before it falls back to this edge's share.
pub const ADMIT_TIMEOUT: Duration = Duration::from_millis(500);
/// After a failure, how long admissions use this edge's share without asking the store.
pub const BACKOFF: Duration = Duration::from_secs(2);
/// How often releases and tokens are written to the store (when there are any).
pub const HOLD_FLUSH: Duration = Duration::from_millis(50);

/// The store's refusal as the key's limits describe it.
fn exceeded(refusal: StoreRefusal, limits: &KeyLimitsConfig) -> LimitExceeded {
    let (limit, ms) = match refusal {
        StoreRefusal::RequestsPerMinute { retry_after_ms } => (
            Limit::RequestsPerMinute(limits.requests_per_minute.unwrap_or(0)),
            retry_after_ms,
        ),
        StoreRefusal::MaxConcurrent { retry_after_ms } => (
            Limit::MaxConcurrent(limits.max_concurrent.unwrap_or(0)),
            retry_after_ms,
        ),
        StoreRefusal::TokensPerDay { retry_after_ms } => (
            Limit::TokensPerDay(limits.tokens_per_day.unwrap_or(0)),
            retry_after_ms,
        ),
    };
    LimitExceeded {
        limit,
        retry_after: Duration::from_millis(ms.max(0) as u64),
    }
}

/// `call` to the store, or the store unavailable when it takes over `limit`.
async fn within<T>(
    limit: Duration,
    call: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    tokio::time::timeout(limit, call).await.unwrap_or_else(|_| {
        Err(StoreError::Unavailable(format!(
            "the store took over {limit:?}"
        )))
    })
}

/// What the store decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Shared {
    Admitted,
    Refused(LimitExceeded),
    /// The store did not answer (or not in time): fall back to this edge's share.
    Unreachable(StoreError),
}

#[derive(Debug)]
pub struct FleetLimits {
    store: Arc<dyn KeyStore>,
    edge_id: String,
    fleet: Arc<Fleet>,
    /// Tokens the store has not taken yet, per (key, UTC day as days since the epoch).
    pending_tokens: Mutex<HashMap<(String, i64), u64>>,
    /// When the store last failed an admission.
    failed_at: Mutex<Option<Instant>>,
    /// What this edge released per key since it started, and which keys the store was
    /// not sent since they changed.
    released: Mutex<Releases>,
    wake: tokio::sync::Notify,
    /// Whether what an earlier run of this edge held was cleared from the store; until
    /// then admissions use this edge's share.
    ready: std::sync::atomic::AtomicBool,
}

#[derive(Debug, Default)]
struct Releases {
    totals: HashMap<String, Released>,
    unsent: std::collections::HashSet<String>,
}

impl FleetLimits {
    pub fn new(store: Arc<dyn KeyStore>, edge_id: String, fleet: Arc<Fleet>) -> Arc<Self> {
        Arc::new(FleetLimits {
            store,
            edge_id,
            fleet,
            pending_tokens: Mutex::default(),
            failed_at: Mutex::default(),
            released: Mutex::default(),
            wake: tokio::sync::Notify::new(),
            ready: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Asks the store whether a request of `key` under `limits`, reserving `reserve`
    /// tokens, may start (`now`: for the back-off after a failure); on admission it is
    /// counted there, and must be given back with [`Self::release`].
    pub async fn admit(
        &self,
        key: &str,
        limits: &KeyLimitsConfig,
        reserve: u64,
        input: u64,
        now: Instant,
    ) -> Shared {
        if !self.ready.load(std::sync::atomic::Ordering::Acquire) {
            return Shared::Unreachable(StoreError::Unavailable(
                "the store has not answered since this edge started".into(),
            ));
        }
        if self
            .failed_at
            .lock()
            .is_some_and(|at| now.saturating_duration_since(at) < BACKOFF)
        {
            return Shared::Unreachable(StoreError::Unavailable(
                "the store failed moments ago".into(),
            ));
        }
        let decided = within(
            ADMIT_TIMEOUT,
            self.store.admit(key, &self.edge_id, limits, reserve, input),
        )
        .await;
        match decided {
            Ok(decision) => {
                if self.failed_at.lock().take().is_some() {
                    tracing::info!(
                        "the store answers again: API key limits count across the fleet"
                    );
                }
                match decision {
                    None => Shared::Admitted,
                    Some(refusal) => Shared::Refused(exceeded(refusal, limits)),
                }
            }
            Err(error) => {
                if self.failed_at.lock().replace(now).is_none() {
                    tracing::warn!(%error, "API key limits: the store does not answer; each edge enforces its share until it does");
                }
                Shared::Unreachable(error)
            }
        }
    }

    /// This edge's share of `limits` while the store does not answer.
    pub fn share(&self, limits: &KeyLimitsConfig, now: Instant) -> KeyLimitsConfig {
        let edges = self.fleet.sharing(now) as u64;
        let part = |n: u64| n.div_ceil(edges).max(1);
        KeyLimitsConfig {
            requests_per_minute: limits.requests_per_minute.map(|n| part(n as u64) as u32),
            tokens_per_day: limits.tokens_per_day.map(part),
            max_concurrent: limits.max_concurrent.map(|n| part(n as u64) as u32),
            reserve_tokens: limits.reserve_tokens,
        }
    }

    /// A request of `key` the store admitted ended: its place (`place`: whether it held
    /// one) and `reserved` tokens go back, in the store within [`HOLD_FLUSH`].
    pub fn release(&self, key: &str, place: bool, reserved: u64) {
        if !place && reserved == 0 {
            return;
        }
        let mut released = self.released.lock();
        let total = released.totals.entry(key.to_string()).or_default();
        total.places += i64::from(place);
        total.reserved = total
            .reserved
            .saturating_add(reserved.min(i64::MAX as u64) as i64);
        released.unsent.insert(key.to_string());
        drop(released);
        self.wake.notify_one();
    }

    /// Sends the release totals of the keys that changed; a key the store did not take
    /// is sent again next time.
    async fn flush_released(&self) {
        let unsent: Vec<(String, Released)> = {
            let mut released = self.released.lock();
            let keys: Vec<String> = released.unsent.drain().collect();
            keys.into_iter()
                .map(|k| {
                    let total = released.totals[&k];
                    (k, total)
                })
                .collect()
        };
        for (key, total) in unsent {
            let sent = within(
                ADMIT_TIMEOUT,
                self.store.release(&key, &self.edge_id, total),
            )
            .await;
            if let Err(error) = sent {
                tracing::debug!(%error, key, "could not give the key's places back in the store; sent again with the next flush");
                self.released.lock().unsent.insert(key);
            }
        }
    }

    /// Clears what an earlier run of this edge left held in the store; admissions ask
    /// the store from then on.
    pub async fn forget_earlier_run(&self) -> Result<(), StoreError> {
        if self.ready.load(std::sync::atomic::Ordering::Acquire) {
            return Ok(());
        }
        within(ADMIT_TIMEOUT * 4, self.store.clear_edge(&self.edge_id)).await?;
        self.ready.store(true, std::sync::atomic::Ordering::Release);
        Ok(())
    }

    /// Adds `tokens` used by `key` on UTC day `day` (days since the epoch), within
    /// [`HOLD_FLUSH`] or once the store answers again.
    pub fn add_tokens(&self, key: &str, day: i64, tokens: u64) {
        if tokens == 0 {
            return;
        }
        *self
            .pending_tokens
            .lock()
            .entry((key.to_string(), day))
            .or_default() += tokens;
        self.wake.notify_one();
    }

    /// Adds the tokens waiting here to the store's day counts.
    pub async fn flush(&self) {
        let pending: Vec<((String, i64), u64)> = self.pending_tokens.lock().drain().collect();
        for ((key, day), tokens) in pending {
            let added = within(ADMIT_TIMEOUT, self.store.add_tokens(&key, day, tokens)).await;
            if added.is_err() {
                *self.pending_tokens.lock().entry((key, day)).or_default() += tokens;
            }
        }
    }

    /// Writes what changed (tokens used, places given back) at most every
    /// [`HOLD_FLUSH`], and tries again what the store did not take every
    /// [`crate::store::edges::HEARTBEAT`], until `shutdown`.
    pub async fn run(self: Arc<Self>, shutdown: tokio_util::sync::CancellationToken) {
        // What this edge held before it restarted is not held any more.
        let mut retry = tokio::time::interval(crate::store::edges::HEARTBEAT);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = retry.tick() => {}
            }
            if self.forget_earlier_run().await.is_ok() {
                break;
            }
        }
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = self.wake.notified() => {}
                _ = retry.tick() => {}
            }
            self.flush_released().await;
            self.flush().await;
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(HOLD_FLUSH) => {}
            }
        }
        self.flush_released().await;
        self.flush().await;
    }
}

#[cfg(test)]
#[path = "fleet_limits_tests.rs"]
mod tests;
