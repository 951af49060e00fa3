//! The API keys' part of the edge: the configured keys, the throttle of wrong keys by
//! source address, each key's limits (request windows, concurrency, today's tokens with
//! what is reserved), and which key started each live run. Each has its own lock, held
//! only for the call. In a fleet the limits count across edges ([`FleetLimits`]), with
//! this edge's own counts kept here too.

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, MutexGuard, RwLock};

use crate::auth::{Caller, KeyTable};
use crate::config::AuthConfig;
use crate::day_tokens::DayTokens;
use crate::fleet_limits::{FleetLimits, Shared};
use crate::key_limits::{Admitted, KeyLimiter, KeyUsage, LimitExceeded};
use crate::ledger::unix_ms_now;
use crate::throttle::{FailureThrottle, ThrottlePolicy};

/// How wrong API keys from one address are slowed down: the first waits a quarter second
/// before the next attempt, each further one twice as long up to 30 s; five quiet minutes
/// forget the address.
pub const KEY_FAILURE_POLICY: ThrottlePolicy = ThrottlePolicy {
    base_delay: Duration::from_millis(250),
    max_delay: Duration::from_secs(30),
    forgive_after: Duration::from_secs(300),
    max_tracked: 65_536,
};

#[derive(Debug)]
pub struct Keys {
    /// The configured API keys (empty: the API is open).
    table: RwLock<Arc<KeyTable>>,
    /// Wrong API keys per source address: growing waits and a periodic summary.
    failures: Mutex<FailureThrottle>,
    /// Per-key limits: request windows, concurrency and today's tokens.
    limiter: Arc<Mutex<KeyLimiter>>,
    /// The API key that started each live run (runs of keyed callers only).
    run_owners: Mutex<foldhash::HashMap<String, String>>,
    /// The fleet's count of the limits, when edges share a store.
    fleet: std::sync::OnceLock<Arc<FleetLimits>>,
}

/// A key's concurrency place, given back when dropped (with the request's recorder).
#[derive(Debug)]
pub struct KeyPermit {
    limiter: Arc<Mutex<KeyLimiter>>,
    admitted: Admitted,
    /// The fleet's store, when it admitted the request (and so counts its place and
    /// reservation until they are given back there).
    fleet: Option<Arc<FleetLimits>>,
}

impl KeyPermit {
    /// The tokens the request's key budget reserved for it.
    pub fn reserved_tokens(&self) -> u64 {
        self.admitted.reserved_tokens
    }
}

impl Drop for KeyPermit {
    fn drop(&mut self) {
        self.limiter.lock().release(&self.admitted);
        if let Some(fleet) = &self.fleet {
            fleet.release(
                &self.admitted.key,
                self.admitted.concurrent,
                self.admitted.reserved_tokens,
            );
        }
    }
}

impl Keys {
    /// The keys of `auth`; `today`: the tokens each key already used today.
    pub fn new(auth: &AuthConfig, today: DayTokens) -> Self {
        Self {
            table: RwLock::new(Arc::new(KeyTable::from_config(auth))),
            failures: Mutex::new(FailureThrottle::new(KEY_FAILURE_POLICY)),
            limiter: Arc::new(Mutex::new(KeyLimiter::new(today))),
            run_owners: Mutex::new(foldhash::HashMap::default()),
            fleet: std::sync::OnceLock::new(),
        }
    }

    /// From now on the limits count across the fleet.
    pub fn share_with(&self, fleet: Arc<FleetLimits>) {
        let _ = self.fleet.set(fleet);
    }

    /// The configured API keys.
    pub fn table(&self) -> Arc<KeyTable> {
        self.table.read().clone()
    }

    /// Takes the keys of a reloaded config; request windows of keys that no longer have a
    /// rate limit are forgotten (today's tokens are kept: a key that comes back has used
    /// them).
    pub fn replace(&self, auth: &AuthConfig) {
        let table = Arc::new(KeyTable::from_config(auth));
        *self.table.write() = table.clone();
        let limited = |name: &str| {
            table
                .find_by_name(name)
                .is_some_and(|k| k.limits.requests_per_minute.is_some())
        };
        self.limiter.lock().retain_keys(limited, Instant::now());
    }

    /// The throttle of wrong API keys by source address.
    pub fn failures(&self) -> MutexGuard<'_, FailureThrottle> {
        self.failures.lock()
    }

    /// Whether `caller` may start a request that reserves `reserve` tokens now. The
    /// permit (if any) holds a concurrency place until it is dropped; the reservation
    /// stays until [`Self::settle`]. In a fleet the store decides; while it does not
    /// answer, this edge's share of each limit.
    pub async fn admit(
        &self,
        caller: &Caller,
        reserve: u64,
        input: u64,
    ) -> Result<Option<KeyPermit>, LimitExceeded> {
        let (Some(key), Some(limits)) = (caller.key_name(), caller.limits()) else {
            return Ok(None);
        };
        let mut fleet = self.fleet.get().filter(|_| limits.any()).cloned();
        let admitted = match &fleet {
            Some(shared) => match shared
                .admit(key, limits, reserve, input, Instant::now())
                .await
            {
                Shared::Admitted => self
                    .limiter
                    .lock()
                    .count(key, limits, reserve, Instant::now()),
                Shared::Refused(exceeded) => return Err(exceeded),
                Shared::Unreachable(_) => {
                    let now = Instant::now();
                    let share = shared.share(limits, now);
                    let mut limiter = self.limiter.lock();
                    limiter.input_fits(key, &share, input, unix_ms_now())?;
                    let admitted = limiter.admit(key, &share, reserve, now, unix_ms_now())?;
                    // Counted here alone: nothing to give back in the store.
                    fleet = None;
                    admitted
                }
            },
            None => {
                let mut limiter = self.limiter.lock();
                limiter.input_fits(key, limits, input, unix_ms_now())?;
                limiter.admit(key, limits, reserve, Instant::now(), unix_ms_now())?
            }
        };
        Ok((!admitted.is_free()).then(|| KeyPermit {
            limiter: self.limiter.clone(),
            admitted,
            fleet,
        }))
    }

    /// A finished request of `key` that used `tokens` (at `time_ms`): its reservation
    /// gives way to what it used (in a fleet, the store's count of the day takes the
    /// tokens; its reservation there goes back with the request's [`KeyPermit`]).
    pub fn settle(&self, key: &str, reserved: u64, tokens: u64, time_ms: i64) {
        if tokens == 0 && reserved == 0 {
            return;
        }
        self.limiter
            .lock()
            .settle(key, reserved, tokens, time_ms, unix_ms_now());
        if let Some(fleet) = self.fleet.get() {
            fleet.add_tokens(key, time_ms.div_euclid(86_400_000), tokens);
        }
    }

    /// Where every configured key stands against its limits, by name.
    pub fn usage(&self) -> Vec<(String, KeyUsage)> {
        let table = self.table();
        let mut limiter = self.limiter.lock();
        let now = Instant::now();
        let now_ms = unix_ms_now();
        table
            .names()
            .map(|name| (name.to_string(), limiter.view(name, now, now_ms)))
            .collect()
    }

    /// Notes that `key` started run `run_id`.
    pub fn own_run(&self, run_id: &str, key: String) {
        self.run_owners.lock().insert(run_id.to_string(), key);
    }

    /// The API key that started a live run, if a keyed caller did.
    pub fn run_owner(&self, run_id: &str) -> Option<String> {
        self.run_owners.lock().get(run_id).cloned()
    }

    /// Forgets a run's owner (the run is over for its client).
    pub fn forget_run(&self, run_id: &str) {
        self.run_owners.lock().remove(run_id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::EdgeConfig;

    fn config(limits: &str) -> EdgeConfig {
        EdgeConfig::from_yaml(
            &format!(
                "auth:\n  keys:\n    - {{name: a, role: client, key: a-key-0123456789abcdef{limits}}}\n"
            ),
            "test",
        )
        .unwrap()
    }

    fn caller(keys: &Keys) -> Caller {
        Caller::with_key(keys.table().find("a-key-0123456789abcdef").unwrap())
    }

    #[tokio::test]
    async fn a_permit_holds_a_concurrency_place_until_dropped() {
        let keys = Keys::new(
            &config(", limits: {max_concurrent: 1}").auth,
            DayTokens::default(),
        );
        let a = caller(&keys);
        let permit = keys
            .admit(&a, 0, 0)
            .await
            .unwrap()
            .expect("a limited key gets a permit");
        assert!(
            keys.admit(&a, 0, 0).await.is_err(),
            "the one place is taken"
        );
        drop(permit);
        assert!(
            keys.admit(&a, 0, 0).await.unwrap().is_some(),
            "the place came back"
        );
    }

    #[tokio::test]
    async fn a_reservation_counts_until_settled_with_what_was_used() {
        let keys = Keys::new(
            &config(", limits: {tokens_per_day: 100}").auth,
            DayTokens::default(),
        );
        let a = caller(&keys);
        let permit = keys.admit(&a, 60, 0).await.unwrap().unwrap();
        assert_eq!(permit.reserved_tokens(), 60);
        assert_eq!(keys.usage()[0].1.tokens_reserved, 60);
        keys.settle("a", 60, 7, unix_ms_now());
        drop(permit);
        let usage = &keys.usage()[0].1;
        assert_eq!((usage.tokens_reserved, usage.tokens_today), (0, 7));
    }

    #[tokio::test]
    async fn an_unlimited_key_needs_no_permit() {
        let keys = Keys::new(&config("").auth, DayTokens::default());
        assert!(
            keys.admit(&caller(&keys), 1_000, 0)
                .await
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn a_reload_replaces_the_keys() {
        let keys = Keys::new(&config("").auth, DayTokens::default());
        assert!(keys.table().find_by_name("a").is_some());
        keys.replace(&EdgeConfig::from_yaml("{}", "test").unwrap().auth);
        assert!(keys.table().find_by_name("a").is_none());
        assert!(keys.usage().is_empty());
    }

    #[test]
    fn run_owners_are_kept_until_forgotten() {
        let keys = Keys::new(&config("").auth, DayTokens::default());
        keys.own_run("r1", "a".into());
        assert_eq!(keys.run_owner("r1").as_deref(), Some("a"));
        keys.forget_run("r1");
        assert_eq!(keys.run_owner("r1"), None);
    }
}
