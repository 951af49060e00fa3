//! API key limits held across a fleet (edges sharing a store): `requests_per_minute`,
//! `max_concurrent` and `tokens_per_day` count every edge's requests together. Each
//! admission is one call of the store's `iop_key_admit` function, which decides under a
//! per-key lock: the requests of the last 60 s (exact: never one more), the requests in
//! flight and tokens reserved by the key on every live edge (an edge that died stops
//! counting once it is no longer live, within 10 s), and the tokens used today.
//!
//! Each edge keeps its own row per key (in flight, reserved) and writes it whole, at most
//! every [`HOLD_FLUSH`] for the keys whose requests ended or settled meanwhile (so a
//! place comes back to the fleet within that time, and a write the store missed is
//! mended by the next one; an edge that starts clears what its earlier run held, and uses
//! its share until it could). Tokens
//! used are added to the day's count; those the store could not take wait here and are
//! added when it answers again. While the store does not answer (or answered with an
//! error in the last [`BACKOFF`]), admissions fall back to this edge's share of each
//! limit — the limit divided by the number of live edges, rounded up — counted locally.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::config::KeyLimitsConfig;
use crate::key_limits::{Limit, LimitExceeded};
use crate::store::Store;
use crate::store::edges::{Fleet, LIVE_WITHIN};

/// How long an admission waits for the store before it falls back to this edge's share.
pub const ADMIT_TIMEOUT: Duration = Duration::from_millis(500);
/// After a failure, how long admissions use this edge's share without asking the store.
pub const BACKOFF: Duration = Duration::from_secs(2);
/// How often what keys hold on this edge is written to the store (when it changed).
pub const HOLD_FLUSH: Duration = Duration::from_millis(50);

/// What the store decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Shared {
    Admitted,
    Refused(LimitExceeded),
    /// The store did not answer (or not in time): fall back to this edge's share.
    Unreachable(String),
}

#[derive(Debug)]
pub struct FleetLimits {
    store: Arc<Store>,
    edge_id: String,
    fleet: Arc<Fleet>,
    /// Tokens the store has not taken yet, per (key, UTC day as days since the epoch).
    pending_tokens: Mutex<HashMap<(String, i64), u64>>,
    /// When the store last failed an admission.
    failed_at: Mutex<Option<Instant>>,
    /// What keys hold on this edge (in flight, reserved) and the store was not told yet.
    dirty: Mutex<HashMap<String, (u32, u64)>>,
    wake: tokio::sync::Notify,
    /// Whether what an earlier run of this edge held was cleared from the store; until
    /// then admissions use this edge's share.
    ready: std::sync::atomic::AtomicBool,
}

impl FleetLimits {
    pub fn new(store: Arc<Store>, edge_id: String, fleet: Arc<Fleet>) -> Arc<Self> {
        Arc::new(FleetLimits {
            store,
            edge_id,
            fleet,
            pending_tokens: Mutex::default(),
            failed_at: Mutex::default(),
            dirty: Mutex::default(),
            wake: tokio::sync::Notify::new(),
            ready: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Asks the store whether a request of `key` under `limits`, reserving `reserve`
    /// tokens, may start; on admission it is counted there.
    pub async fn admit(&self, key: &str, limits: &KeyLimitsConfig, reserve: u64) -> Shared {
        if !self.ready.load(std::sync::atomic::Ordering::Acquire) {
            return Shared::Unreachable(
                "the store has not answered since this edge started".into(),
            );
        }
        if self
            .failed_at
            .lock()
            .is_some_and(|at| at.elapsed() < BACKOFF)
        {
            return Shared::Unreachable("the store failed moments ago".into());
        }
        let decided = tokio::time::timeout(ADMIT_TIMEOUT, self.ask(key, limits, reserve)).await;
        let result = match decided {
            Ok(result) => result,
            Err(_) => Err(format!("the store took over {ADMIT_TIMEOUT:?}")),
        };
        match result {
            Ok(decision) => {
                if self.failed_at.lock().take().is_some() {
                    tracing::info!(
                        "the store answers again: API key limits count across the fleet"
                    );
                }
                decision
            }
            Err(error) => {
                if self.failed_at.lock().replace(Instant::now()).is_none() {
                    tracing::warn!(%error, "API key limits: the store does not answer; each edge enforces its share until it does");
                }
                Shared::Unreachable(error)
            }
        }
    }

    async fn ask(
        &self,
        key: &str,
        limits: &KeyLimitsConfig,
        reserve: u64,
    ) -> Result<Shared, String> {
        let client = self.store.client().await?;
        let rpm = limits.requests_per_minute.map(|n| n as i32);
        let max = limits.max_concurrent.map(|n| n as i32);
        let budget = limits.tokens_per_day.map(|n| n.min(i64::MAX as u64) as i64);
        let reserve = reserve.min(i64::MAX as u64) as i64;
        let live = LIVE_WITHIN.as_secs_f64();
        let row = client
            .query_one(
                "SELECT refused, retry_after_ms FROM iop_key_admit($1, $2, $3, $4, $5, $6, $7)",
                &[&key, &self.edge_id, &rpm, &max, &budget, &reserve, &live],
            )
            .await
            .map_err(|e| format!("store (key limits): {}", crate::store::reason(&e)))?;
        let refused: Option<String> = row.get(0);
        let retry_after = Duration::from_millis(row.get::<_, i64>(1).max(0) as u64);
        let limit = match refused.as_deref() {
            None => return Ok(Shared::Admitted),
            Some("requests_per_minute") => {
                Limit::RequestsPerMinute(limits.requests_per_minute.unwrap_or(0))
            }
            Some("max_concurrent") => Limit::MaxConcurrent(limits.max_concurrent.unwrap_or(0)),
            Some(_) => Limit::TokensPerDay(limits.tokens_per_day.unwrap_or(0)),
        };
        Ok(Shared::Refused(LimitExceeded { limit, retry_after }))
    }

    /// This edge's share of `limits` while the store does not answer.
    pub fn share(&self, limits: &KeyLimitsConfig) -> KeyLimitsConfig {
        let edges = self.fleet.sharing(std::time::Instant::now()) as u64;
        let part = |n: u64| n.div_ceil(edges).max(1);
        KeyLimitsConfig {
            requests_per_minute: limits.requests_per_minute.map(|n| part(n as u64) as u32),
            tokens_per_day: limits.tokens_per_day.map(part),
            max_concurrent: limits.max_concurrent.map(|n| part(n as u64) as u32),
            reserve_tokens: limits.reserve_tokens,
        }
    }

    /// `key` holds this on this edge now (in flight, reserved): written to the store
    /// within [`HOLD_FLUSH`].
    pub fn held(&self, key: &str, in_flight: u32, reserved: u64) {
        self.dirty
            .lock()
            .insert(key.to_string(), (in_flight, reserved));
        self.wake.notify_one();
    }

    /// Writes what the keys told of since the last flush hold, whole.
    async fn flush_held(&self) {
        let dirty: Vec<(String, (u32, u64))> = self.dirty.lock().drain().collect();
        for (key, (in_flight, reserved)) in dirty {
            self.hold(&key, in_flight, reserved).await;
        }
    }

    /// Writes what `key` holds on this edge now (in flight, reserved), whole.
    async fn hold(&self, key: &str, in_flight: u32, reserved: u64) {
        let write = async {
            let client = self.store.client().await?;
            client
                .execute(
                    "INSERT INTO iop_key_inflight (key, edge_id, n, reserved) VALUES ($1, $2, $3, $4)
                     ON CONFLICT (key, edge_id) DO UPDATE SET n = $3, reserved = $4",
                    &[
                        &key,
                        &self.edge_id,
                        &(in_flight as i32),
                        &(reserved.min(i64::MAX as u64) as i64),
                    ],
                )
                .await
                .map_err(|e| crate::store::reason(&e))
        };
        if let Err(error) = tokio::time::timeout(ADMIT_TIMEOUT, write)
            .await
            .unwrap_or_else(|_| Err("timed out".into()))
        {
            tracing::debug!(%error, key, "could not write the key's place in the store; the next write mends it");
        }
    }

    /// Clears what an earlier run of this edge left held in the store; admissions ask
    /// the store from then on.
    pub async fn forget_earlier_run(&self) -> Result<(), String> {
        if self.ready.load(std::sync::atomic::Ordering::Acquire) {
            return Ok(());
        }
        let cleared = async {
            let client = self.store.client().await?;
            client
                .execute(
                    "DELETE FROM iop_key_inflight WHERE edge_id = $1",
                    &[&self.edge_id],
                )
                .await
                .map_err(|e| crate::store::reason(&e))
        };
        tokio::time::timeout(ADMIT_TIMEOUT * 4, cleared)
            .await
            .unwrap_or_else(|_| Err("timed out".into()))?;
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
            let added = async {
                let client = self.store.client().await?;
                client
                    .execute(
                        "INSERT INTO iop_key_tokens (key, day, used)
                         VALUES ($1, DATE '1970-01-01' + $2::INTEGER, $3)
                         ON CONFLICT (key, day) DO UPDATE SET used = iop_key_tokens.used + $3",
                        &[&key, &(day as i32), &(tokens.min(i64::MAX as u64) as i64)],
                    )
                    .await
                    .map_err(|e| crate::store::reason(&e))
            };
            let added = tokio::time::timeout(ADMIT_TIMEOUT, added)
                .await
                .unwrap_or_else(|_| Err("timed out".into()));
            if added.is_err() {
                *self.pending_tokens.lock().entry((key, day)).or_default() += tokens;
            }
        }
    }

    /// Writes what changed (tokens used, places held) at most every [`HOLD_FLUSH`], and
    /// tries again what the store did not take every [`crate::store::edges::HEARTBEAT`],
    /// until `shutdown`.
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
            self.flush_held().await;
            self.flush().await;
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(HOLD_FLUSH) => {}
            }
        }
        self.flush_held().await;
        self.flush().await;
    }
}
