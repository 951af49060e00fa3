//! Prometheus metrics (`GET /metrics`): request outcomes, request latency, time to first
//! token, queue waits and usage recorded as things happen, plus capacity, in-flight,
//! waiting and readiness gauges taken from the status snapshot at scrape time. Served in
//! the Prometheus text format, or OpenMetrics when the scraper's `Accept` asks for it;
//! every family has help text.
//!
//! A request's `outcome` is `ok` or the reason it failed (an `ErrorCode` name, e.g.
//! `client_abort`, `provider_error`, `broken_stream`, `queue_full`), and `path` is how it
//! was served (`tunnel`, `run`) or `none` when it never reached a member.
//!
//! Every label value comes from the config or from a fixed set: a model name no group has
//! counts as `model_group="(unknown)"`, a key no longer configured as `api_key="(unknown)"`,
//! and outcomes beyond the first [`MAX_OUTCOMES`] distinct ones as `outcome="other"`; so
//! nothing a client sends adds series, and the number of series is bounded by the config.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use iop_proto::pb;
use parking_lot::{Mutex, RwLock};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::ledger::UsageRecord;
use crate::routing::{Decision, Stats};
use crate::status::StatusSnapshot;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub model_group: String,
    /// `tunnel`, `run` or `none` (never reached a member).
    pub path: String,
    /// `ok`, or the `ErrorCode` name that ended it: `client_abort`, `provider_error`,
    /// `broken_stream`, `queue_full`, `provider_idle_timeout` ...
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

/// Where one request's tokens were spent, as [`Metrics::record_usage`] is told.
#[derive(Debug, Clone, Copy, Hash)]
pub struct UsageSource<'a> {
    pub model_group: &'a str,
    pub node: &'a str,
    pub provider: &'a str,
    /// The name of the API key (`None` on an edge without keys).
    pub api_key: Option<&'a str>,
}

/// A [`UsageSource`] as a key of the usage counters already made.
#[derive(Debug, Hash, PartialEq, Eq)]
struct UsageSourceKey {
    model_group: String,
    node: String,
    provider: String,
    api_key: Option<String>,
}

impl hashbrown::Equivalent<UsageSourceKey> for UsageSource<'_> {
    fn equivalent(&self, key: &UsageSourceKey) -> bool {
        self.model_group == key.model_group
            && self.node == key.node
            && self.provider == key.provider
            && self.api_key == key.api_key.as_deref()
    }
}

impl UsageSourceKey {
    fn of(source: &UsageSource<'_>) -> Self {
        Self {
            model_group: source.model_group.to_string(),
            node: source.node.to_string(),
            provider: source.provider.to_string(),
            api_key: source.api_key.map(String::from),
        }
    }
}

/// The `kind` label of the usage counters, in the order [`Metrics::record_usage`] keeps them.
const USAGE_KINDS: [&str; 4] = ["input", "output", "reasoning", "cached_input"];

/// Usage sources whose counters are kept at hand; past that the cache starts over (the
/// series stay in the registry).
const MAX_USAGE_SOURCES: usize = 4096;

/// The label value of a model name no configured group has.
pub const UNKNOWN_LABEL: &str = "(unknown)";
/// The `model_group` label of requests that name no group (native runs).
pub const NO_GROUP_LABEL: &str = "(none)";
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
struct RoutingLabels {
    model_group: String,
    /// What steered it: `session`, `prefix` or `none`.
    affinity: &'static str,
    /// `hit`, or why the preferred member was passed over (`unavailable`, `over_bound`,
    /// `cold`), or `unsteered`.
    outcome: &'static str,
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

/// One model group's series, resolved once per request by [`Metrics::group`]: recording
/// through it takes no label lookup (its `model_group` label is fixed, and the request
/// counters it used are kept by path and outcome).
#[derive(Debug)]
pub struct GroupMetrics {
    label: String,
    queue_wait: Histogram,
    request_duration: Histogram,
    first_token: Histogram,
    /// The request counters used so far, by path and outcome (a few of each).
    requests: Mutex<Vec<(&'static str, String, Counter)>>,
    /// The routing decision counters used so far (made at first use).
    routing: Mutex<Vec<(Decision, Counter)>>,
    routing_family: Family<RoutingLabels, Counter>,
    /// Provider-reported input tokens, and how many of them the provider had cached.
    input_tokens: AtomicU64,
    cached_tokens: AtomicU64,
}

impl GroupMetrics {
    /// The `model_group` label: the group's name, or `(unknown)`.
    pub fn label(&self) -> &str {
        &self.label
    }

    pub fn observe_queue_wait(&self, waited: Duration) {
        self.queue_wait.observe(waited.as_secs_f64());
    }

    pub fn observe_request_duration(&self, took: Duration) {
        self.request_duration.observe(took.as_secs_f64());
    }

    pub fn observe_first_token(&self, took: Duration) {
        self.first_token.observe(took.as_secs_f64());
    }

    /// Counts one routing decision (every grant of a slot in this group).
    pub fn count_route(&self, decision: Decision) {
        let mut routing = self.routing.lock();
        if let Some((_, counter)) = routing.iter().find(|(d, _)| *d == decision) {
            counter.inc();
            return;
        }
        let counter = self
            .routing_family
            .get_or_create(&RoutingLabels {
                model_group: self.label.clone(),
                affinity: decision.kind.as_str(),
                outcome: decision.outcome.as_str(),
            })
            .clone();
        counter.inc();
        routing.push((decision, counter));
    }

    /// The routing decisions counted so far, read from their counters.
    pub fn routing(&self) -> Stats {
        let mut stats = Stats::default();
        for (decision, counter) in self.routing.lock().iter() {
            stats.add(*decision, counter.get());
        }
        stats
    }

    /// Provider-reported input tokens so far, and how many of them were cached.
    pub fn prompt_tokens(&self) -> (u64, u64) {
        (
            self.input_tokens.load(Ordering::Relaxed),
            self.cached_tokens.load(Ordering::Relaxed),
        )
    }
}

pub struct Metrics {
    registry: Mutex<Registry>,
    bounds: Mutex<LabelBounds>,
    /// The series of every configured group, by name.
    groups: RwLock<foldhash::HashMap<String, Arc<GroupMetrics>>>,
    /// The series every name outside the config shares.
    unknown_group: OnceLock<Arc<GroupMetrics>>,
    /// The series of requests that name no group (native runs).
    none_group: OnceLock<Arc<GroupMetrics>>,
    /// The usage counters made so far, by source (cleared when the groups or keys change,
    /// as the labels they map to may).
    usage_series: Mutex<hashbrown::HashMap<UsageSourceKey, [Option<Counter>; 4]>>,
    /// The usage series made so far, by their `model_group` label (dropped with the group).
    usage_labels: Mutex<HashMap<String, HashSet<UsageLabels>>>,
    requests: Family<RequestLabels, Counter>,
    queue_wait: Family<GroupLabels, Histogram>,
    request_duration: Family<GroupLabels, Histogram>,
    first_token: Family<GroupLabels, Histogram>,
    usage_tokens: Family<UsageLabels, Counter>,
    provider_capacity: Family<ProviderLaneLabels, Gauge>,
    provider_in_flight: Family<ProviderLaneLabels, Gauge>,
    group_waiting: Family<GroupLaneLabels, Gauge>,
    node_ready: Family<NodeLabels, Gauge>,
    leases_acquired: Counter,
    leases_released: Counter,
    leases_live: Gauge,
    node_connections_refused: Family<RefusalLabels, Counter>,
    routing_decisions: Family<RoutingLabels, Counter>,
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
    // Over 100 lines: one registration per metric family, in the order /metrics lists them;
    // split, one table would be read in pieces.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("iop");
        let requests = Family::<RequestLabels, Counter>::default();
        let queue_wait = Family::<GroupLabels, Histogram>::new_with_constructor(|| {
            Histogram::new([0.001, 0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0])
        });
        let request_duration = Family::<GroupLabels, Histogram>::new_with_constructor(|| {
            Histogram::new([
                0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
            ])
        });
        let first_token = Family::<GroupLabels, Histogram>::new_with_constructor(|| {
            Histogram::new([
                0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
            ])
        });
        let usage_tokens = Family::<UsageLabels, Counter>::default();
        let provider_capacity = Family::<ProviderLaneLabels, Gauge>::default();
        let provider_in_flight = Family::<ProviderLaneLabels, Gauge>::default();
        let group_waiting = Family::<GroupLaneLabels, Gauge>::default();
        let node_ready = Family::<NodeLabels, Gauge>::default();
        registry.register(
            "requests",
            "Requests of every API (OpenAI, Responses, Anthropic, Ollama, native runs) by model group, path and outcome (ok or the error reason)",
            requests.clone(),
        );
        registry.register(
            "queue_wait_seconds",
            "Time requests waited for a provider slot",
            queue_wait.clone(),
        );
        registry.register(
            "request_duration_seconds",
            "Time from a request's arrival to the end of its response (or its failure), per model group",
            request_duration.clone(),
        );
        registry.register(
            "time_to_first_token_seconds",
            "Time from a request's arrival to its first output (token or body bytes) from the provider, per model group",
            first_token.clone(),
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
        let routing_decisions = Family::<RoutingLabels, Counter>::default();
        registry.register(
            "routing_decisions",
            "Member choices per model group: what steered each (session key, prompt prefix, none) and whether the preferred member took it (hit) or why not (unavailable, over_bound, cold)",
            routing_decisions.clone(),
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
            groups: RwLock::new(foldhash::HashMap::default()),
            unknown_group: OnceLock::new(),
            none_group: OnceLock::new(),
            usage_series: Mutex::new(hashbrown::HashMap::default()),
            usage_labels: Mutex::default(),
            requests,
            queue_wait,
            request_duration,
            first_token,
            usage_tokens,
            provider_capacity,
            provider_in_flight,
            group_waiting,
            node_ready,
            leases_acquired,
            leases_released,
            leases_live,
            node_connections_refused,
            routing_decisions,
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

    /// The configured model groups: the only `model_group` label values. The series of
    /// a group no longer configured are dropped, so `/metrics` shrinks back when groups go
    /// (a group configured again starts its counters anew).
    pub fn set_model_groups<'a>(&self, names: impl IntoIterator<Item = &'a str>) {
        let names: HashSet<String> = names.into_iter().map(String::from).collect();
        let mut groups = self.groups.write();
        let gone: Vec<Arc<GroupMetrics>> = groups
            .iter()
            .filter(|(name, _)| !names.contains(*name))
            .map(|(_, series)| series.clone())
            .collect();
        groups.retain(|name, _| names.contains(name));
        for group in gone {
            self.drop_group_series(&group);
        }
        for name in &names {
            if !groups.contains_key(name) {
                groups.insert(name.clone(), self.group_series(name));
            }
        }
        self.bounds.lock().groups = names;
        self.usage_series.lock().clear();
    }

    /// Removes every series labelled with `group`'s name.
    fn drop_group_series(&self, group: &GroupMetrics) {
        let labels = GroupLabels {
            model_group: group.label.clone(),
        };
        self.queue_wait.remove(&labels);
        self.request_duration.remove(&labels);
        self.first_token.remove(&labels);
        for (path, outcome, _) in group.requests.lock().iter() {
            self.requests.remove(&RequestLabels {
                model_group: group.label.clone(),
                path: path.to_string(),
                outcome: self.bounds.lock().outcome(outcome),
            });
        }
        for (decision, _) in group.routing.lock().iter() {
            self.routing_decisions.remove(&RoutingLabels {
                model_group: group.label.clone(),
                affinity: decision.kind.as_str(),
                outcome: decision.outcome.as_str(),
            });
        }
        for lane in ["normal", "long"] {
            self.group_waiting.remove(&GroupLaneLabels {
                model_group: group.label.clone(),
                lane: lane.to_string(),
            });
        }
        if let Some(usage) = self.usage_labels.lock().remove(&group.label) {
            for labels in usage {
                self.usage_tokens.remove(&labels);
            }
        }
    }

    /// The series of the model group `name` (those of `(unknown)` for a name no configured
    /// group has), to record one request's metrics through.
    pub fn group(&self, name: &str) -> Arc<GroupMetrics> {
        if let Some(group) = self.groups.read().get(name) {
            return group.clone();
        }
        self.unknown_group
            .get_or_init(|| self.group_series(UNKNOWN_LABEL))
            .clone()
    }

    fn group_series(&self, label: &str) -> Arc<GroupMetrics> {
        let labels = GroupLabels {
            model_group: label.to_string(),
        };
        Arc::new(GroupMetrics {
            label: label.to_string(),
            queue_wait: self.queue_wait.get_or_create(&labels).clone(),
            request_duration: self.request_duration.get_or_create(&labels).clone(),
            first_token: self.first_token.get_or_create(&labels).clone(),
            requests: Mutex::new(Vec::new()),
            routing: Mutex::new(Vec::new()),
            routing_family: self.routing_decisions.clone(),
            input_tokens: AtomicU64::new(0),
            cached_tokens: AtomicU64::new(0),
        })
    }

    /// Counts one finished request (every request of every surface comes here once, from
    /// the accounting point): its outcome, and — for a configured group, or a native run
    /// (`(none)`: it names no group; the ledger records it under its `node/adapter`) — its
    /// duration, its time to first token and how long it waited for a slot. A name no
    /// group has counts in `(unknown)`'s request counter only.
    pub fn record_request(&self, record: &UsageRecord, queue_wait: Option<Duration>) {
        let native_run = record.api == crate::surfaces::ClientApi::Runs.as_str();
        let group = if record.group.is_empty() || native_run {
            self.none_group
                .get_or_init(|| self.group_series(NO_GROUP_LABEL))
                .clone()
        } else {
            let known = self.groups.read().get(&record.group).cloned();
            let Some(group) = known else {
                let labels = RequestLabels {
                    model_group: UNKNOWN_LABEL.to_string(),
                    path: record.path.to_string(),
                    outcome: self.bounds.lock().outcome(&record.outcome),
                };
                self.requests.get_or_create(&labels).inc();
                return;
            };
            group
        };
        self.count_group_request(&group, record.path, &record.outcome);
        group
            .input_tokens
            .fetch_add(record.input_tokens, Ordering::Relaxed);
        group
            .cached_tokens
            .fetch_add(record.cached_tokens, Ordering::Relaxed);
        group.observe_request_duration(Duration::from_millis(record.latency_ms));
        if let Some(ttft) = record.ttft_ms {
            group.observe_first_token(Duration::from_millis(ttft));
        }
        if let Some(waited) = queue_wait {
            group.observe_queue_wait(waited);
        }
    }

    /// Counts one request of `group` served by `path` that ended with `outcome`.
    fn count_group_request(&self, group: &GroupMetrics, path: &'static str, outcome: &str) {
        let mut counters = group.requests.lock();
        if let Some((.., counter)) = counters.iter().find(|(p, o, _)| *p == path && o == outcome) {
            counter.inc();
            return;
        }
        let labels = RequestLabels {
            model_group: group.label.clone(),
            path: path.to_string(),
            outcome: self.bounds.lock().outcome(outcome),
        };
        let counter = self.requests.get_or_create(&labels).clone();
        counter.inc();
        counters.push((path, outcome.to_string(), counter));
    }

    /// The configured API key names: the only `api_key` label values.
    pub fn set_api_keys<'a>(&self, names: impl IntoIterator<Item = &'a str>) {
        self.bounds.lock().keys = names.into_iter().map(String::from).collect();
        self.usage_series.lock().clear();
    }

    /// Counts one request's provider-reported tokens.
    pub fn record_usage(&self, source: UsageSource<'_>, usage: &pb::Usage) {
        let counts = [
            Some(usage.input_tokens),
            Some(usage.output_tokens),
            usage.reasoning_tokens,
            usage.cached_input_tokens,
        ];
        let mut series = self.usage_series.lock();
        if series.len() >= MAX_USAGE_SOURCES && !series.contains_key(&source) {
            series.clear();
        }
        if !series.contains_key(&source) {
            series.insert(UsageSourceKey::of(&source), Default::default());
        }
        let counters = series.get_mut(&source).expect("just inserted");
        for ((counter, kind), value) in counters.iter_mut().zip(USAGE_KINDS).zip(counts) {
            let Some(value) = value else { continue };
            counter
                .get_or_insert_with(|| self.usage_counter(&source, kind))
                .inc_by(value);
        }
    }

    /// The usage counter of `kind` for `source`, its labels bounded by the config.
    fn usage_counter(&self, source: &UsageSource<'_>, kind: &'static str) -> Counter {
        let (model_group, api_key) = {
            let bounds = self.bounds.lock();
            (bounds.group(source.model_group), bounds.key(source.api_key))
        };
        let labels = UsageLabels {
            model_group,
            node: source.node.to_string(),
            provider: source.provider.to_string(),
            api_key,
            kind,
        };
        let counter = self.usage_tokens.get_or_create(&labels).clone();
        self.usage_labels
            .lock()
            .entry(labels.model_group.clone())
            .or_default()
            .insert(labels);
        counter
    }

    /// The exposition in `format`, with gauges taken from `snapshot`.
    pub fn render(&self, snapshot: &StatusSnapshot, format: Format) -> String {
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
        match format {
            Format::OpenMetrics => out,
            Format::Prometheus => openmetrics_to_prometheus(&out),
        }
    }
}

/// The exposition formats `/metrics` speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// The Prometheus text format 0.0.4 (the default).
    Prometheus,
    /// OpenMetrics 1.0, for scrapers whose `Accept` asks for it.
    OpenMetrics,
}

impl Format {
    /// The format an `Accept` header asks for.
    pub fn negotiate(accept: Option<&str>) -> Self {
        match accept {
            Some(accept)
                if accept
                    .split(',')
                    .any(|t| t.trim().starts_with("application/openmetrics-text")) =>
            {
                Format::OpenMetrics
            }
            _ => Format::Prometheus,
        }
    }

    pub fn content_type(self) -> &'static str {
        match self {
            Format::Prometheus => "text/plain; version=0.0.4; charset=utf-8",
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
        }
    }
}

/// Rewrites an OpenMetrics exposition as Prometheus text: counter families are described
/// under their sample name (`x_total`, which is what Prometheus's parser looks up), and
/// the `# EOF` and `# UNIT` lines go.
fn openmetrics_to_prometheus(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut help: Option<&str> = None;
    for line in text.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        if line.starts_with("# HELP ") {
            if let Some(pending) = help.replace(line) {
                out.push_str(pending);
                out.push('\n');
            }
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ")
            && let Some(name) = rest.strip_suffix(" counter")
        {
            if let Some(pending) = help.take() {
                let text = pending
                    .strip_prefix("# HELP ")
                    .and_then(|h| h.strip_prefix(name))
                    .unwrap_or("");
                out.push_str(&format!("# HELP {name}_total{text}\n"));
            }
            out.push_str(&format!("# TYPE {name}_total counter\n"));
            continue;
        }
        if let Some(pending) = help.take() {
            out.push_str(pending);
            out.push('\n');
        }
        out.push_str(line);
        out.push('\n');
    }
    if let Some(pending) = help {
        out.push_str(pending);
        out.push('\n');
    }
    out
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
            .render(&snapshot, Format::Prometheus)
            .lines()
            .filter(|l| !l.starts_with('#'))
            .count()
    }

    #[test]
    fn model_names_outside_the_config_share_one_label() {
        let m = Metrics::new();
        m.set_model_groups(["llama"]);
        m.count_group_request(&m.group("llama"), "run", "ok");
        let before = series(&m);
        for i in 0..1000 {
            m.count_group_request(&m.group(&format!("random-{i}")), "none", "model_not_found");
            m.group(&format!("random-{i}"))
                .observe_queue_wait(Duration::from_millis(1));
        }
        let text = m.render(
            &StatusSnapshot {
                nodes: vec![],
                model_groups: vec![],
                leases: Default::default(),
            },
            Format::Prometheus,
        );
        assert!(text.contains("model_group=\"(unknown)\""), "{text}");
        assert!(!text.contains("random-"), "{text}");
        // One request series and the histograms of "(unknown)", however many names.
        assert!(series(&m) < before + 60, "{text}");
        let after = series(&m);
        for i in 0..1000 {
            m.count_group_request(&m.group(&format!("other-{i}")), "none", "model_not_found");
            m.group(&format!("other-{i}"))
                .observe_queue_wait(Duration::from_millis(1));
        }
        assert_eq!(series(&m), after);
    }

    fn sample(text: &str, prefix: &str) -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(prefix))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {prefix} in {text}"))
    }

    #[test]
    fn a_group_handle_records_into_the_groups_series_across_reloads() {
        let m = Metrics::new();
        m.set_model_groups(["llama", "qwen"]);
        let llama = m.group("llama");
        assert_eq!(llama.label(), "llama");
        m.count_group_request(&llama, "tunnel", "ok");
        m.count_group_request(&llama, "tunnel", "ok");
        m.count_group_request(&m.group("llama"), "tunnel", "ok");
        m.count_group_request(&llama, "tunnel", "client_abort");
        llama.observe_request_duration(Duration::from_millis(20));
        // A reload that keeps the group keeps its series; one that drops it sends its
        // name to `(unknown)`.
        m.set_model_groups(["llama"]);
        let again = m.group("llama");
        again.observe_request_duration(Duration::from_millis(20));
        m.count_group_request(&again, "tunnel", "ok");
        assert_eq!(m.group("qwen").label(), UNKNOWN_LABEL);
        assert_eq!(m.group("no-such-model").label(), UNKNOWN_LABEL);
        let text = m.render(&empty(), Format::Prometheus);
        let ok = r#"iop_requests_total{model_group="llama",path="tunnel",outcome="ok"}"#;
        assert_eq!(sample(&text, ok), 4.0, "{text}");
        let abort =
            r#"iop_requests_total{model_group="llama",path="tunnel",outcome="client_abort"}"#;
        assert_eq!(sample(&text, abort), 1.0, "{text}");
        let count = r#"iop_request_duration_seconds_count{model_group="llama"}"#;
        assert_eq!(sample(&text, count), 2.0, "{text}");
    }

    #[test]
    fn outcomes_are_bounded() {
        let m = Metrics::new();
        m.set_model_groups(["g"]);
        for i in 0..1000 {
            m.count_group_request(&m.group("g"), "run", &format!("code-{i}"));
        }
        let text = m.render(
            &StatusSnapshot {
                nodes: vec![],
                model_groups: vec![],
                leases: Default::default(),
            },
            Format::Prometheus,
        );
        assert!(text.contains("outcome=\"other\""));
        let requests = text
            .lines()
            .filter(|l| l.starts_with("iop_requests_total"))
            .count();
        assert_eq!(requests, MAX_OUTCOMES + 1, "{text}");
    }

    fn usage(input: u64, output: u64, reasoning: Option<u64>) -> pb::Usage {
        pb::Usage {
            input_tokens: input,
            output_tokens: output,
            reasoning_tokens: reasoning,
            ..Default::default()
        }
    }

    fn source<'a>(group: &'a str, key: Option<&'a str>) -> UsageSource<'a> {
        UsageSource {
            model_group: group,
            node: "n1",
            provider: "p",
            api_key: key,
        }
    }

    #[test]
    fn usage_is_labelled_with_configured_key_names_only() {
        let m = Metrics::new();
        m.set_model_groups(["g"]);
        m.set_api_keys(["alice"]);
        for key in [Some("alice"), Some("mallory"), None] {
            m.record_usage(source("g", key), &usage(1, 1, None));
        }
        let text = m.render(&empty(), Format::Prometheus);
        assert!(text.contains("api_key=\"alice\""), "{text}");
        assert!(text.contains("api_key=\"(unknown)\""), "{text}");
        assert!(text.contains("api_key=\"(none)\""), "{text}");
        assert!(!text.contains("mallory"), "{text}");
    }

    #[test]
    fn usage_adds_up_per_source_and_follows_a_reload_of_the_keys() {
        let m = Metrics::new();
        m.set_model_groups(["g"]);
        m.set_api_keys(["alice", "bob"]);
        m.record_usage(source("g", Some("alice")), &usage(10, 3, None));
        m.record_usage(source("g", Some("alice")), &usage(5, 2, Some(1)));
        let series = |kind: &str, key: &str| {
            format!(
                r#"iop_usage_tokens_total{{model_group="g",node="n1",provider="p",api_key="{key}",kind="{kind}"}}"#
            )
        };
        let text = m.render(&empty(), Format::Prometheus);
        assert_eq!(sample(&text, &series("input", "alice")), 15.0, "{text}");
        assert_eq!(sample(&text, &series("output", "alice")), 5.0, "{text}");
        assert_eq!(sample(&text, &series("reasoning", "alice")), 1.0, "{text}");
        assert!(!text.contains(r#"kind="cached_input""#), "{text}");
        // alice's key is removed: her next request counts as an unknown key.
        m.set_api_keys(["bob"]);
        m.record_usage(source("g", Some("alice")), &usage(7, 1, None));
        let text = m.render(&empty(), Format::Prometheus);
        assert_eq!(sample(&text, &series("input", "alice")), 15.0, "{text}");
        assert_eq!(sample(&text, &series("input", "(unknown)")), 7.0, "{text}");
    }

    fn empty() -> StatusSnapshot {
        StatusSnapshot {
            nodes: vec![],
            model_groups: vec![],
            leases: Default::default(),
        }
    }

    #[test]
    fn both_formats_parse_and_every_family_has_help() {
        let m = Metrics::new();
        m.set_model_groups(["g"]);
        m.count_group_request(&m.group("g"), "tunnel", "ok");
        m.count_group_request(&m.group("g"), "run", "client_abort");
        let g = m.group("g");
        g.observe_request_duration(Duration::from_millis(120));
        g.observe_first_token(Duration::from_millis(30));
        g.observe_queue_wait(Duration::from_millis(3));
        m.count_node_refusal("bad_token");
        let prometheus = m.render(&empty(), Format::Prometheus);
        let families = openmetrics_parser::prometheus::parse_prometheus(&prometheus)
            .unwrap_or_else(|e| panic!("{e:?}\n{prometheus}"));
        for name in [
            "iop_requests_total",
            "iop_request_duration_seconds",
            "iop_time_to_first_token_seconds",
            "iop_queue_wait_seconds",
            "iop_leases_acquired_total",
            "iop_node_connections_refused_total",
        ] {
            assert!(
                families.families.contains_key(name),
                "{name} missing: {:?}",
                families.families.keys().collect::<Vec<_>>()
            );
        }
        for (name, family) in &families.families {
            assert!(!family.help.is_empty(), "{name} has no help: {prometheus}");
        }
        assert!(
            prometheus.contains("# HELP iop_requests_total "),
            "{prometheus}"
        );
        assert!(prometheus.contains("# TYPE iop_requests_total counter"));
        assert!(!prometheus.contains("# EOF"));
        let open = m.render(&empty(), Format::OpenMetrics);
        openmetrics_parser::openmetrics::parse_openmetrics(&open)
            .unwrap_or_else(|e| panic!("{e:?}\n{open}"));
        assert!(open.ends_with("# EOF\n"));
    }

    #[test]
    fn the_scraper_picks_the_format() {
        assert_eq!(Format::negotiate(None), Format::Prometheus);
        assert_eq!(Format::negotiate(Some("text/plain")), Format::Prometheus);
        assert_eq!(
            Format::negotiate(Some(
                "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
            )),
            Format::OpenMetrics
        );
    }
}
