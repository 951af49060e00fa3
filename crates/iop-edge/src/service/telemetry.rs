//! What the edge tells about the requests it served: the Prometheus metrics, the event
//! bus, the durable usage ledger and the last minute per model group. [`Telemetry::record`]
//! counts one finished request in each of them; the accounting point calls it once per
//! request.

use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::config::EdgeConfig;
use crate::events::{EdgeEvent, EventBus, UsageEvent};
use crate::ledger::live::{GroupLive, LiveWindow};
use crate::ledger::record::ANONYMOUS_KEY;
use crate::ledger::{Ledger, UsageRecord};
use crate::metrics::UNKNOWN_LABEL;
use crate::metrics::{Metrics, UsageSource};

#[derive(Debug)]
pub struct Telemetry {
    pub metrics: Metrics,
    pub events: EventBus,
    /// The durable usage ledger (off in unit tests and with `ledger.enabled: false`).
    ledger: Ledger,
    /// The last minute of requests per model group.
    live: Mutex<LiveWindow>,
}

impl Telemetry {
    pub fn new(config: &EdgeConfig, ledger: Ledger) -> Self {
        let telemetry = Self {
            metrics: Metrics::new(),
            events: EventBus::default(),
            ledger,
            live: Mutex::new(LiveWindow::new(Instant::now())),
        };
        telemetry.configure(config);
        telemetry
    }

    /// Names the model groups and API keys of `config` in the metrics (after a reload,
    /// those gone are dropped).
    pub fn configure(&self, config: &EdgeConfig) {
        self.metrics
            .set_model_groups(config.model_groups.iter().map(|g| g.name.as_str()));
        self.metrics
            .set_api_keys(config.auth.keys.iter().map(|k| k.name.as_str()));
    }

    /// The usage ledger.
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// Counts one finished request: the request metrics, its reported usage (metrics and
    /// a usage event), the live window and the ledger. Never blocks (the ledger's queue
    /// is bounded; a full queue counts a drop).
    pub fn record(
        &self,
        record: UsageRecord,
        queue_wait: Option<Duration>,
        served_model: Option<String>,
    ) {
        self.metrics.record_request(&record, queue_wait);
        if record.reported() {
            self.reported_usage(&record, served_model);
        }
        if !record.group.is_empty() {
            // Names no group has share one entry, as they share one metrics label: a client
            // sending random names cannot fill the view.
            let group = match record.group.starts_with(UNKNOWN_LABEL) {
                true => UNKNOWN_LABEL,
                false => record.group.as_str(),
            };
            self.live.lock().record(
                group,
                !record.is_ok(),
                record.ttft_ms,
                record.latency_ms,
                Instant::now(),
            );
        }
        self.ledger.push(record);
    }

    /// The usage the provider reported, in the metrics and as a usage event.
    fn reported_usage(&self, record: &UsageRecord, served_model: Option<String>) {
        let usage = iop_proto::pb::Usage {
            input_tokens: record.input_tokens,
            output_tokens: record.output_tokens,
            reasoning_tokens: Some(record.reasoning_tokens).filter(|n| *n > 0),
            cached_input_tokens: Some(record.cached_tokens).filter(|n| *n > 0),
        };
        let api_key = (record.key != ANONYMOUS_KEY).then_some(record.key.as_str());
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

    /// The last minute per model group.
    pub fn live_usage(&self) -> Vec<GroupLive> {
        self.live.lock().summary(Instant::now())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(group: &str, outcome: &str, output_tokens: u64) -> UsageRecord {
        UsageRecord::sample("alice", group, 1, outcome, output_tokens)
    }

    fn telemetry() -> Telemetry {
        Telemetry::new(
            &EdgeConfig::from_yaml("{}", "test").unwrap(),
            Ledger::disabled(),
        )
    }

    #[test]
    fn names_no_group_has_share_one_live_entry() {
        let t = telemetry();
        for i in 0..50 {
            let group = crate::ledger::record::unknown_model_label(&format!("nope-{i}"));
            t.record(record(&group, "model_not_found", 0), None, None);
        }
        let live = t.live_usage();
        assert_eq!(live.len(), 1, "{live:?}");
        assert_eq!(live[0].group, UNKNOWN_LABEL);
    }

    #[test]
    fn a_request_counts_in_the_live_window_of_its_group() {
        let t = telemetry();
        t.record(record("small", "ok", 5), None, None);
        t.record(record("small", "provider_error", 0), None, None);
        t.record(record("", "bad_request", 0), None, None);
        let live = t.live_usage();
        assert_eq!(
            live.len(),
            1,
            "a request with no group is not in the live view"
        );
        assert_eq!((live[0].group.as_str(), live[0].failed), ("small", 1));
    }

    #[test]
    fn reported_usage_is_published_once_with_the_served_model() {
        let t = telemetry();
        let mut rx = t.events.subscribe();
        t.record(record("small", "ok", 5), None, Some("tiny-1b".into()));
        let EdgeEvent::Usage(usage) = &*rx.try_recv().unwrap() else {
            panic!("a usage event")
        };
        assert_eq!(usage.output_tokens, 5);
        assert_eq!(usage.served_model.as_deref(), Some("tiny-1b"));
        assert_eq!(usage.api_key.as_deref(), Some("alice"));
        assert!(rx.try_recv().is_err(), "one event per request");
    }
}
