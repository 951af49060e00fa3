//! The one accounting point: [`Edge::record_request`] receives every finished request of
//! every surface — its [`UsageRecord`] and what the metrics need — and counts it once in
//! each place: the request metrics (outcome, latency, time to first token, queue wait,
//! usage), the live window, the key's tokens today (settling what its budget reserved)
//! and the ledger. [`Edge::start_request`] starts the per-request [`RequestRecorder`] that
//! calls it when the request ends.
//!
//! The key limits' side of admission is here too ([`Edge::admit_key`]): a concurrency
//! place and a token reservation, held by the request's recorder until it ends.

use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

use super::Edge;
use crate::auth::Caller;
use crate::events::{EdgeEvent, UsageEvent};
use crate::key_limits::{Admitted, KeyLimiter, KeyUsage, LimitExceeded};
use crate::ledger::live::GroupLive;
use crate::ledger::recorder::{FinishedRequest, RecordSink};
use crate::ledger::{ClientApi, Ledger, RequestRecorder, unix_ms_now};
use crate::metrics::UsageSource;

/// A key's concurrency place, given back when dropped (with the request's recorder).
#[derive(Debug)]
pub struct KeyPermit {
    limiter: Arc<Mutex<KeyLimiter>>,
    admitted: Admitted,
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
    }
}

impl RecordSink for Edge {
    fn record_request(&self, finished: FinishedRequest) {
        Edge::record_request(self, finished);
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

    /// THE accounting point: one finished request. Never blocks (the ledger's queue is
    /// bounded; a full queue counts a drop).
    pub fn record_request(&self, finished: FinishedRequest) {
        let FinishedRequest {
            record,
            queue_wait,
            reserved_tokens,
            served_model,
        } = finished;
        let tokens = record.billed_tokens();
        if tokens > 0 || reserved_tokens > 0 {
            self.limiter.lock().settle(
                &record.key,
                reserved_tokens,
                tokens,
                record.time_ms,
                unix_ms_now(),
            );
        }
        self.metrics.record_request(&record, queue_wait);
        if record.reported() {
            let usage = iop_proto::pb::Usage {
                input_tokens: record.input_tokens,
                output_tokens: record.output_tokens,
                reasoning_tokens: Some(record.reasoning_tokens).filter(|n| *n > 0),
                cached_input_tokens: Some(record.cached_tokens).filter(|n| *n > 0),
            };
            let api_key =
                (record.key != crate::ledger::record::ANONYMOUS_KEY).then_some(record.key.as_str());
            let source = UsageSource {
                model_group: &record.group,
                node: &record.node,
                provider: &record.provider,
                api_key,
            };
            self.metrics.record_usage(source, &usage);
            if self.events.has_subscribers() {
                self.events.publish(EdgeEvent::Usage(UsageEvent {
                    model_group: record.group.clone(),
                    node_id: record.node.clone(),
                    provider_id: record.provider.clone(),
                    path: record.path,
                    input_tokens: usage.input_tokens,
                    output_tokens: usage.output_tokens,
                    reasoning_tokens: usage.reasoning_tokens,
                    cached_input_tokens: usage.cached_input_tokens,
                    served_model,
                    api_key: api_key.map(String::from),
                }));
            }
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

    /// The key limits' side of admission: whether `caller` may start a request that
    /// reserves `reserve` tokens now. The permit (if any) holds a concurrency place until
    /// it is dropped; the reservation is settled when the request is recorded.
    pub(crate) fn admit_key(
        &self,
        caller: &Caller,
        reserve: u64,
    ) -> Result<Option<KeyPermit>, LimitExceeded> {
        let (Some(key), Some(limits)) = (caller.key_name(), caller.limits()) else {
            return Ok(None);
        };
        let admitted =
            self.limiter
                .lock()
                .admit(key, limits, reserve, Instant::now(), unix_ms_now())?;
        Ok((!admitted.is_free()).then(|| KeyPermit {
            limiter: self.limiter.clone(),
            admitted,
        }))
    }

    /// Where every configured key stands against its limits, by name.
    pub fn key_usage(&self) -> Vec<(String, KeyUsage)> {
        let keys = self.keys();
        let mut limiter = self.limiter.lock();
        let now = Instant::now();
        let now_ms = unix_ms_now();
        keys.names()
            .map(|name| (name.to_string(), limiter.view(name, now, now_ms)))
            .collect()
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
