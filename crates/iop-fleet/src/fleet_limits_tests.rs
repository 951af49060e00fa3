//! The fleet's key limits against a store in memory that decides as `iop_key_admit` and
//! `iop_key_release` do, and can fail or lose answers on demand.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};

use super::*;

/// One key's rows per edge: places in flight, reserved tokens, and the release totals
/// already taken off.
#[derive(Debug, Default, Clone, Copy)]
struct Row {
    n: i64,
    reserved: i64,
    released: Released,
}

#[derive(Debug, Default)]
struct MemoryStore {
    rows: Mutex<HashMap<(String, String), Row>>,
    tokens: Mutex<HashMap<(String, i64), u64>>,
    /// Every call fails.
    down: AtomicBool,
    /// Releases are applied, but their answer is lost (the caller sees an error).
    lose_release_answers: AtomicBool,
}

impl MemoryStore {
    fn in_flight(&self, key: &str) -> i64 {
        let rows = self.rows.lock();
        rows.iter()
            .filter(|((k, _), _)| k == key)
            .map(|(_, r)| r.n)
            .sum()
    }

    fn check(&self) -> Result<(), StoreError> {
        if self.down.load(Ordering::Relaxed) {
            return Err(StoreError::Unavailable("the store is down".into()));
        }
        Ok(())
    }
}

#[async_trait::async_trait]
impl KeyStore for MemoryStore {
    async fn admit(
        &self,
        key: &str,
        edge: &str,
        limits: &KeyLimitsConfig,
        reserve: u64,
        _input: u64,
    ) -> Result<Option<StoreRefusal>, StoreError> {
        self.check()?;
        if let Some(max) = limits.max_concurrent
            && self.in_flight(key) >= i64::from(max)
        {
            return Ok(Some(StoreRefusal::MaxConcurrent {
                retry_after_ms: 1000,
            }));
        }
        let mut rows = self.rows.lock();
        let row = rows.entry((key.into(), edge.into())).or_default();
        row.n += i64::from(limits.max_concurrent.is_some());
        if limits.tokens_per_day.is_some() {
            row.reserved += reserve as i64;
        }
        Ok(None)
    }

    async fn release(&self, key: &str, edge: &str, released: Released) -> Result<(), StoreError> {
        self.check()?;
        if let Some(row) = self.rows.lock().get_mut(&(key.into(), edge.into())) {
            row.n = (row.n - (released.places - row.released.places).max(0)).max(0);
            row.reserved =
                (row.reserved - (released.reserved - row.released.reserved).max(0)).max(0);
            row.released.places = row.released.places.max(released.places);
            row.released.reserved = row.released.reserved.max(released.reserved);
        }
        if self.lose_release_answers.load(Ordering::Relaxed) {
            return Err(StoreError::Unavailable("the answer was lost".into()));
        }
        Ok(())
    }

    async fn add_tokens(&self, key: &str, day: i64, tokens: u64) -> Result<(), StoreError> {
        self.check()?;
        *self.tokens.lock().entry((key.into(), day)).or_default() += tokens;
        Ok(())
    }

    async fn clear_edge(&self, edge: &str) -> Result<(), StoreError> {
        self.check()?;
        self.rows.lock().retain(|(_, e), _| e != edge);
        Ok(())
    }
}

fn limits(max: u32) -> KeyLimitsConfig {
    KeyLimitsConfig {
        max_concurrent: Some(max),
        ..Default::default()
    }
}

async fn edge(store: &Arc<MemoryStore>, id: &str) -> Arc<FleetLimits> {
    let limits = FleetLimits::new(store.clone(), id.into(), Arc::new(Fleet::default()));
    limits.forget_earlier_run().await.unwrap();
    limits
}

#[tokio::test]
async fn places_released_while_others_are_admitted_are_never_overwritten() {
    // The race of a whole count written after a snapshot: edge a releases one place while
    // it admits another; the store must count exactly what is in flight.
    let store = Arc::new(MemoryStore::default());
    let (a, b) = (edge(&store, "a").await, edge(&store, "b").await);
    let max = limits(4);
    let now = Instant::now();
    for _ in 0..2 {
        assert_eq!(a.admit("k", &max, 0, 0, now).await, Shared::Admitted);
        assert_eq!(b.admit("k", &max, 0, 0, now).await, Shared::Admitted);
    }
    assert!(matches!(
        a.admit("k", &max, 0, 0, now).await,
        Shared::Refused(LimitExceeded {
            limit: Limit::MaxConcurrent(4),
            ..
        })
    ));
    a.release("k", true, 0);
    // Admitted on a before the release reached the store: still refused (4 in flight).
    assert!(matches!(
        a.admit("k", &max, 0, 0, now).await,
        Shared::Refused(_)
    ));
    a.flush_released().await;
    assert_eq!(store.in_flight("k"), 3);
    assert_eq!(a.admit("k", &max, 0, 0, now).await, Shared::Admitted);
    assert_eq!(store.in_flight("k"), 4);
    assert!(matches!(
        b.admit("k", &max, 0, 0, now).await,
        Shared::Refused(_)
    ));
}

#[tokio::test]
async fn a_release_the_store_missed_or_answered_late_is_taken_off_exactly_once() {
    let store = Arc::new(MemoryStore::default());
    let a = edge(&store, "a").await;
    let now = Instant::now();
    for _ in 0..3 {
        assert_eq!(a.admit("k", &limits(3), 0, 0, now).await, Shared::Admitted);
    }
    // The store is down: the release waits here.
    store.down.store(true, Ordering::Relaxed);
    a.release("k", true, 0);
    a.flush_released().await;
    store.down.store(false, Ordering::Relaxed);
    assert_eq!(store.in_flight("k"), 3);
    // It is applied but its answer is lost: sent again, and not taken off twice.
    store.lose_release_answers.store(true, Ordering::Relaxed);
    a.flush_released().await;
    assert_eq!(store.in_flight("k"), 2);
    store.lose_release_answers.store(false, Ordering::Relaxed);
    a.flush_released().await;
    a.flush_released().await;
    assert_eq!(store.in_flight("k"), 2);
    a.release("k", true, 0);
    a.flush_released().await;
    assert_eq!(store.in_flight("k"), 1);
}

#[tokio::test]
async fn a_store_that_fails_is_left_alone_for_the_back_off_and_asked_after() {
    let store = Arc::new(MemoryStore::default());
    let a = edge(&store, "a").await;
    let start = Instant::now();
    store.down.store(true, Ordering::Relaxed);
    assert!(matches!(
        a.admit("k", &limits(1), 0, 0, start).await,
        Shared::Unreachable(_)
    ));
    store.down.store(false, Ordering::Relaxed);
    assert!(matches!(
        a.admit("k", &limits(1), 0, 0, start + BACKOFF / 2).await,
        Shared::Unreachable(_)
    ));
    assert_eq!(
        a.admit("k", &limits(1), 0, 0, start + BACKOFF).await,
        Shared::Admitted
    );
}

#[tokio::test]
async fn an_edge_that_starts_again_clears_its_earlier_places() {
    let store = Arc::new(MemoryStore::default());
    let a = edge(&store, "a").await;
    assert_eq!(
        a.admit("k", &limits(1), 0, 0, Instant::now()).await,
        Shared::Admitted
    );
    // The edge died holding the place; its next run clears it and starts its totals anew.
    drop(a);
    let a = edge(&store, "a").await;
    assert_eq!(store.in_flight("k"), 0);
    assert_eq!(
        a.admit("k", &limits(1), 0, 0, Instant::now()).await,
        Shared::Admitted
    );
    a.release("k", true, 0);
    a.flush_released().await;
    assert_eq!(store.in_flight("k"), 0);
}

#[tokio::test]
async fn tokens_the_store_did_not_take_are_added_when_it_answers() {
    let store = Arc::new(MemoryStore::default());
    let a = edge(&store, "a").await;
    store.down.store(true, Ordering::Relaxed);
    a.add_tokens("k", 20_000, 7);
    a.flush().await;
    store.down.store(false, Ordering::Relaxed);
    a.add_tokens("k", 20_000, 3);
    a.flush().await;
    assert_eq!(store.tokens.lock()[&("k".to_string(), 20_000)], 10);
}

#[test]
fn an_unknown_refusal_is_an_error_not_another_limit() {
    assert!(StoreRefusal::parse("tokens_per_week", 0).is_err());
    assert_eq!(
        StoreRefusal::parse("max_concurrent", 5).unwrap(),
        StoreRefusal::MaxConcurrent { retry_after_ms: 5 }
    );
}
