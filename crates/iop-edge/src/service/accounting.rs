//! The two hooks between requests and the usage ledger and key limits:
//! [`Edge::record_request`], where every finished request's [`UsageRecord`] is handed
//! over (to the ledger's writer queue, the live window and the keys' token counts), and
//! [`Edge::admit_key`], where admission asks the key's limits before a slot is taken.
//! [`Edge::start_request`] starts the per-request [`RequestRecorder`] that calls the first.

use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

use super::Edge;
use crate::auth::Caller;
use crate::key_limits::{Admitted, KeyLimiter, LimitExceeded};
use crate::ledger::live::GroupLive;
use crate::ledger::recorder::RecordSink;
use crate::ledger::{ClientApi, Ledger, RequestRecorder, UsageRecord, unix_ms_now};

/// A key's concurrency place, given back when dropped (with the request's recorder).
#[derive(Debug)]
pub struct KeyPermit {
    limiter: Arc<Mutex<KeyLimiter>>,
    admitted: Option<Admitted>,
}

impl Drop for KeyPermit {
    fn drop(&mut self) {
        if let Some(admitted) = self.admitted.take() {
            self.limiter.lock().release(admitted);
        }
    }
}

impl RecordSink for Edge {
    fn record_request(&self, record: UsageRecord) {
        Edge::record_request(self, record);
    }
}

impl Edge {
    /// The usage ledger.
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// Starts the record of a request `caller` made on `api`.
    pub fn start_request(self: &Arc<Self>, api: ClientApi, caller: &Caller) -> RequestRecorder {
        RequestRecorder::start(self.clone(), api, caller.key_name())
    }

    /// THE record hook: one finished request. Never blocks (the ledger's queue is
    /// bounded; a full queue counts a drop).
    pub fn record_request(&self, record: UsageRecord) {
        let tokens = record.billed_tokens();
        if tokens > 0 {
            self.limiter
                .lock()
                .add_tokens(&record.key, tokens, record.time_ms, unix_ms_now());
        }
        if !record.group.is_empty() {
            self.live.lock().record(
                &record.group,
                !record.is_ok(),
                record.ttft_ms,
                record.latency_ms,
                Instant::now(),
            );
        }
        self.ledger.push(record);
    }

    /// THE admission hook for key limits: whether `caller` may start a request now. The
    /// permit (if any) holds a concurrency place until it is dropped.
    pub fn admit_key(&self, caller: &Caller) -> Result<Option<KeyPermit>, LimitExceeded> {
        let (Some(key), Some(limits)) = (caller.key_name(), caller.limits()) else {
            return Ok(None);
        };
        let admitted = self
            .limiter
            .lock()
            .admit(key, limits, Instant::now(), unix_ms_now())?;
        Ok(match admitted {
            Admitted::Free => None,
            concurrent => Some(KeyPermit {
                limiter: self.limiter.clone(),
                admitted: Some(concurrent),
            }),
        })
    }

    /// `key`'s input + output tokens today (UTC), as `tokens_per_day` counts them.
    pub fn tokens_today(&self, key: &str) -> u64 {
        self.limiter.lock().tokens_today(key, unix_ms_now())
    }

    /// The last minute per model group.
    pub fn live_usage(&self) -> Vec<GroupLive> {
        self.live.lock().summary(Instant::now())
    }

    /// Forgets request windows of keys that no longer have a rate limit (after a reload).
    pub(crate) fn prune_key_limits(&self) {
        let keys = self.keys();
        let limited = |name: &str| {
            keys.find_by_name(name)
                .is_some_and(|k| k.limits.requests_per_minute.is_some())
        };
        self.limiter.lock().retain_keys(limited, Instant::now());
    }
}
