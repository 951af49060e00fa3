//! Prometheus metrics (`GET /metrics`): request, queue-wait and usage counters recorded as
//! things happen, plus capacity, in-flight, waiting and readiness gauges taken from the
//! status snapshot at scrape time.
//!
//! Every label value comes from the config or from a fixed set: a model name no group has
//! counts as `model_group="(unknown)"`, a key no longer configured as `api_key="(unknown)"`,
//! and outcomes beyond the first [`MAX_OUTCOMES`] distinct ones as `outcome="other"`; so
//! nothing a client sends adds series, and the number of series is bounded by the config.

use std::collections::HashSet;
use std::time::Duration;

use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::events::UsageEvent;
use crate::status::StatusSnapshot;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub model_group: String,
    /// `tunnel`, `run` or `none` (rejected before dispatch).
    pub path: String,
    /// `ok`, `error`, `client_closed`, `queue_full`, `queue_timeout`, `unavailable` ...
    pub outcome: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GroupLabels {
    model_group: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GroupLaneLabels {
    model_group: String,
    lane: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct UsageLabels {
    model_group: String,
    node: String,
    provider: String,
    api_key: String,
    kind: &'static str,
}

/// The label value of a model name no configured group has.
pub const UNKNOWN_LABEL: &str = "(unknown)";
/// The `api_key` label of requests on an edge without keys.
pub const NO_KEY_LABEL: &str = "(none)";
/// Distinct `outcome` values kept; later ones count as `other`.
pub const MAX_OUTCOMES: usize = 64;

/// The label values allowed now (from the config) and the outcomes seen so far.
#[derive(Debug, Default)]
struct LabelBounds {
    groups: HashSet<String>,
    keys: HashSet<String>,
    outcomes: HashSet<String>,
}

impl LabelBounds {
    fn group(&self, name: &str) -> String {
        if self.groups.contains(name) {
            name.to_string()
        } else {
            UNKNOWN_LABEL.to_string()
        }
    }

    fn outcome(&mut self, outcome: &str) -> String {
        if self.outcomes.contains(outcome) {
            return outcome.to_string();
        }
        if self.outcomes.len() < MAX_OUTCOMES {
            self.outcomes.insert(outcome.to_string());
            return outcome.to_string();
        }
        "other".to_string()
    }

    fn key(&self, name: Option<&str>) -> String {
        match name {
            None => NO_KEY_LABEL.to_string(),
            Some(name) if self.keys.contains(name) => name.to_string(),
            Some(_) => UNKNOWN_LABEL.to_string(),
        }
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProviderLaneLabels {
    node: String,
    provider: String,
    lane: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NodeLabels {
    node: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RefusalLabels {
    reason: &'static str,
}

pub struct Metrics {
    registry: Mutex<Registry>,
    bounds: Mutex<LabelBounds>,
    requests: Family<RequestLabels, Counter>,
    queue_wait: Family<GroupLabels, Histogram>,
    usage_tokens: Family<UsageLabels, Counter>,
    provider_capacity: Family<ProviderLaneLabels, Gauge>,
    provider_in_flight: Family<ProviderLaneLabels, Gauge>,
    group_waiting: Family<GroupLaneLabels, Gauge>,
    node_ready: Family<NodeLabels, Gauge>,
    leases_acquired: Counter,
    leases_released: Counter,
    leases_live: Gauge,
    node_connections_refused: Family<RefusalLabels, Counter>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("iop");
        let requests = Family::<RequestLabels, Counter>::default();
        let queue_wait = Family::<GroupLabels, Histogram>::new_with_constructor(|| {
            Histogram::new([0.001, 0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0])
        });
        let usage_tokens = Family::<UsageLabels, Counter>::default();
        let provider_capacity = Family::<ProviderLaneLabels, Gauge>::default();
        let provider_in_flight = Family::<ProviderLaneLabels, Gauge>::default();
        let group_waiting = Family::<GroupLaneLabels, Gauge>::default();
        let node_ready = Family::<NodeLabels, Gauge>::default();
        registry.register(
            "requests",
            "Model-group requests (OpenAI and Ollama APIs) by outcome",
            requests.clone(),
        );
        registry.register(
            "queue_wait_seconds",
            "Time requests waited for a provider slot",
            queue_wait.clone(),
        );
        registry.register(
            "usage_tokens",
            "Provider-reported tokens (input, output, reasoning, cached_input)",
            usage_tokens.clone(),
        );
        registry.register(
            "provider_capacity",
            "Effective provider capacity per lane (0 while offline)",
            provider_capacity.clone(),
        );
        registry.register(
            "provider_in_flight",
            "Requests holding a provider slot per lane",
            provider_in_flight.clone(),
        );
        registry.register(
            "model_group_waiting",
            "Requests waiting for a slot per model group and lane",
            group_waiting.clone(),
        );
        registry.register(
            "node_ready",
            "1 while the node is dispatch-ready",
            node_ready.clone(),
        );
        let leases_acquired = Counter::default();
        let leases_released = Counter::default();
        let leases_live = Gauge::default();
        registry.register(
            "leases_acquired",
            "Provider leases acquired",
            leases_acquired.clone(),
        );
        registry.register(
            "leases_released",
            "Provider leases released (each exactly once)",
            leases_released.clone(),
        );
        registry.register(
            "leases_live",
            "Provider leases held now",
            leases_live.clone(),
        );
        let node_connections_refused = Family::<RefusalLabels, Counter>::default();
        registry.register(
            "node_connections_refused",
            "Node-listener connections refused or closed before registering, by reason",
            node_connections_refused.clone(),
        );
        Self {
            registry: Mutex::new(registry),
            bounds: Mutex::new(LabelBounds::default()),
            requests,
            queue_wait,
            usage_tokens,
            provider_capacity,
            provider_in_flight,
            group_waiting,
            node_ready,
            leases_acquired,
            leases_released,
            leases_live,
            node_connections_refused,
        }
    }

    /// Registers the usage ledger's counters of records written and dropped.
    pub fn register_ledger(&self, written: Counter, dropped: Counter) {
        let mut registry = self.registry.lock();
        registry.register(
            "ledger_records_written",
            "Usage records committed to the ledger",
            written,
        );
        registry.register(
            "ledger_records_dropped",
            "Usage records lost because the ledger's writer fell behind (or could not write)",
            dropped,
        );
    }

    /// Counts one node-listener connection refused before it registered (`reason` is one
    /// of a fixed set of labels).
    pub fn count_node_refusal(&self, reason: &'static str) {
        self.node_connections_refused
            .get_or_create(&RefusalLabels { reason })
            .inc();
    }

    /// The configured model groups: the only `model_group` label values.
    pub fn set_model_groups<'a>(&self, names: impl IntoIterator<Item = &'a str>) {
        self.bounds.lock().groups = names.into_iter().map(String::from).collect();
    }

    /// The configured API key names: the only `api_key` label values.
    pub fn set_api_keys<'a>(&self, names: impl IntoIterator<Item = &'a str>) {
        self.bounds.lock().keys = names.into_iter().map(String::from).collect();
    }

    pub fn count_request(&self, model_group: &str, path: &str, outcome: &str) {
        let labels = {
            let mut bounds = self.bounds.lock();
            RequestLabels {
                model_group: bounds.group(model_group),
                path: path.to_string(),
                outcome: bounds.outcome(outcome),
            }
        };
        self.requests.get_or_create(&labels).inc();
    }

    pub fn observe_queue_wait(&self, model_group: &str, waited: Duration) {
        let model_group = self.bounds.lock().group(model_group);
        self.queue_wait
            .get_or_create(&GroupLabels { model_group })
            .observe(waited.as_secs_f64());
    }

    pub fn record_usage(&self, usage: &UsageEvent) {
        let counts = [
            ("input", Some(usage.input_tokens)),
            ("output", Some(usage.output_tokens)),
            ("reasoning", usage.reasoning_tokens),
            ("cached_input", usage.cached_input_tokens),
        ];
        // One label set for all kinds: the family copies it only for a new series.
        let (model_group, api_key) = {
            let bounds = self.bounds.lock();
            (
                bounds.group(&usage.model_group),
                bounds.key(usage.api_key.as_deref()),
            )
        };
        let mut labels = UsageLabels {
            model_group,
            node: usage.node_id.clone(),
            provider: usage.provider_id.clone(),
            api_key,
            kind: "",
        };
        for (kind, value) in counts {
            if let Some(value) = value {
                labels.kind = kind;
                self.usage_tokens.get_or_create(&labels).inc_by(value);
            }
        }
    }

    /// Prometheus text exposition, with gauges taken from `snapshot`.
    pub fn render(&self, snapshot: &StatusSnapshot) -> String {
        for node in &snapshot.nodes {
            self.node_ready
                .get_or_create(&NodeLabels {
                    node: node.id.clone(),
                })
                .set(node.ready as i64);
            for p in &node.providers {
                for (lane, cap, inf) in [
                    ("normal", p.capacity.normal, p.in_flight.normal),
                    ("long", p.capacity.long, p.in_flight.long),
                ] {
                    let labels = ProviderLaneLabels {
                        node: node.id.clone(),
                        provider: p.id.clone(),
                        lane: lane.to_string(),
                    };
                    self.provider_capacity
                        .get_or_create(&labels)
                        .set(cap as i64);
                    self.provider_in_flight
                        .get_or_create(&labels)
                        .set(inf as i64);
                }
            }
        }
        for g in &snapshot.model_groups {
            for (lane, n) in [("normal", g.waiting.normal), ("long", g.waiting.long)] {
                self.group_waiting
                    .get_or_create(&GroupLaneLabels {
                        model_group: g.name.clone(),
                        lane: lane.to_string(),
                    })
                    .set(n as i64);
            }
        }
        let totals = snapshot.leases;
        self.leases_acquired
            .inc_by(totals.acquired.saturating_sub(self.leases_acquired.get()));
        self.leases_released
            .inc_by(totals.released.saturating_sub(self.leases_released.get()));
        self.leases_live.set(totals.live as i64);
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry.lock())
            .expect("writing to a String cannot fail");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn series(metrics: &Metrics) -> usize {
        let snapshot = StatusSnapshot {
            nodes: vec![],
            model_groups: vec![],
            leases: Default::default(),
        };
        metrics
            .render(&snapshot)
            .lines()
            .filter(|l| !l.starts_with('#'))
            .count()
    }

    #[test]
    fn model_names_outside_the_config_share_one_label() {
        let m = Metrics::new();
        m.set_model_groups(["llama"]);
        m.count_request("llama", "run", "ok");
        let before = series(&m);
        for i in 0..1000 {
            m.count_request(&format!("random-{i}"), "none", "model_not_found");
            m.observe_queue_wait(&format!("random-{i}"), Duration::from_millis(1));
        }
        let text = m.render(&StatusSnapshot {
            nodes: vec![],
            model_groups: vec![],
            leases: Default::default(),
        });
        assert!(text.contains("model_group=\"(unknown)\""), "{text}");
        assert!(!text.contains("random-"), "{text}");
        // One new request series and one histogram for "(unknown)", whatever the count.
        assert!(series(&m) < before + 20, "{text}");
    }

    #[test]
    fn outcomes_are_bounded() {
        let m = Metrics::new();
        m.set_model_groups(["g"]);
        for i in 0..1000 {
            m.count_request("g", "run", &format!("code-{i}"));
        }
        let text = m.render(&StatusSnapshot {
            nodes: vec![],
            model_groups: vec![],
            leases: Default::default(),
        });
        assert!(text.contains("outcome=\"other\""));
        let requests = text
            .lines()
            .filter(|l| l.starts_with("iop_requests_total"))
            .count();
        assert_eq!(requests, MAX_OUTCOMES + 1, "{text}");
    }

    #[test]
    fn usage_is_labelled_with_configured_key_names_only() {
        let m = Metrics::new();
        m.set_model_groups(["g"]);
        m.set_api_keys(["alice"]);
        for key in [Some("alice"), Some("mallory"), None] {
            m.record_usage(&UsageEvent {
                model_group: "g".into(),
                api_key: key.map(String::from),
                input_tokens: 1,
                output_tokens: 1,
                ..Default::default()
            });
        }
        let text = m.render(&StatusSnapshot {
            nodes: vec![],
            model_groups: vec![],
            leases: Default::default(),
        });
        assert!(text.contains("api_key=\"alice\""), "{text}");
        assert!(text.contains("api_key=\"(unknown)\""), "{text}");
        assert!(text.contains("api_key=\"(none)\""), "{text}");
        assert!(!text.contains("mallory"), "{text}");
    }
}
