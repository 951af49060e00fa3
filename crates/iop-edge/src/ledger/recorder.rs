//! [`RequestRecorder`]: one request's record while it is under way, on every surface. The
//! service starts it when a request arrives; the pipeline, the dispatcher and the run or
//! tunnel stream fill in what each learns (the group, the member, the provider's status,
//! the first token, the usage or what was relayed, how it ended); when the last holder
//! lets go — the handler returned and the response stream ended or was dropped — the
//! finished request is handed to a [`RecordSink`] (the edge's one accounting point:
//! ledger, metrics, live view, the key's tokens) exactly once.
//!
//! So every request is recorded whatever ends it: a success, an error answered by the
//! edge, a provider error, a refusal by admission or a key limit, or a client that left
//! (`client_abort`: the response was not finished when it was dropped).

use std::any::Any;
use std::sync::Arc;
use std::time::{Duration, Instant};

use iop_proto::ErrorCode;
use parking_lot::Mutex;

use super::record::{ClientApi, OUTCOME_OK, UsageRecord};
use crate::routing::Decision;

/// A finished request, as the accounting point receives it.
#[derive(Debug)]
pub struct FinishedRequest {
    pub record: UsageRecord,
    /// How long it waited for a provider slot, when it got one.
    pub queue_wait: Option<Duration>,
    /// The tokens its key's budget reserved for it at admission.
    pub reserved_tokens: u64,
    /// The model the provider said served it.
    pub served_model: Option<String>,
}

/// Where finished requests go.
pub trait RecordSink: Send + Sync {
    fn record_request(&self, finished: FinishedRequest);
}

/// The outcome of a request the client left before its end.
pub const CLIENT_ABORT: &str = "client_abort";
/// The status recorded for a request the client left before any response.
pub const CLIENT_CLOSED_STATUS: u16 = 499;

/// A shared handle on one request's record; cheap to clone.
#[derive(Clone)]
pub struct RequestRecorder(Arc<Draft>);

impl std::fmt::Debug for RequestRecorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestRecorder")
            .field("api", &self.0.api)
            .field("key", &self.0.key)
            .finish_non_exhaustive()
    }
}

struct Draft {
    sink: Arc<dyn RecordSink>,
    started: Instant,
    time_ms: i64,
    api: ClientApi,
    key: String,
    state: Mutex<State>,
}

/// Whether a dispatched stream reached its end.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum StreamState {
    #[default]
    None,
    Open,
    Ended,
}

#[derive(Default)]
struct State {
    group: String,
    node: String,
    provider: String,
    path: &'static str,
    usage: Option<iop_proto::pb::Usage>,
    served_model: Option<String>,
    /// The input estimated from the prompt (tokens).
    input_estimate: u64,
    /// Output deltas (or streamed events) relayed to the client.
    relayed: u64,
    reserved_tokens: u64,
    ttft_ms: Option<u64>,
    queue_wait: Option<Duration>,
    /// The first error learned (the root cause wins over what followed from it).
    error: Option<ErrorCode>,
    /// The status the client got, once the edge answered.
    status: Option<u16>,
    provider_status: Option<u16>,
    stream: StreamState,
    attempts: u32,
    /// How the last member was picked.
    routing: Option<Decision>,
    /// Held until the request ends (a key's concurrency place).
    held: Vec<Box<dyn Any + Send>>,
}

impl RequestRecorder {
    /// A request of `key` (`None`: anonymous) on `api`, arriving now.
    pub fn start(sink: Arc<dyn RecordSink>, api: ClientApi, key: Option<&str>) -> Self {
        Self(Arc::new(Draft {
            sink,
            started: Instant::now(),
            time_ms: super::record::unix_ms_now(),
            api,
            key: key.unwrap_or(super::record::ANONYMOUS_KEY).to_string(),
            state: Mutex::new(State {
                path: "none",
                ..State::default()
            }),
        }))
    }

    pub fn key(&self) -> &str {
        &self.0.key
    }

    /// What the node is told to bill the request by, should no edge receive its end.
    pub fn billing(&self) -> iop_proto::pb::Billing {
        iop_proto::pb::Billing {
            group: self.0.state.lock().group.clone(),
            api: self.0.api.as_str().to_string(),
            received_unix_ms: self.0.time_ms,
        }
    }

    /// The model group (a configured group's name, or its stand-in: see
    /// [`super::record::unknown_model_label`]).
    pub fn set_group(&self, group: &str) {
        let mut state = self.0.state.lock();
        if state.group != group {
            state.group = group.to_string();
        }
    }

    /// The request was admitted: its estimated input tokens and the tokens its key's
    /// budget reserved for it.
    pub fn admitted(&self, input_estimate: u64, reserved_tokens: u64) {
        let mut state = self.0.state.lock();
        state.input_estimate = input_estimate;
        state.reserved_tokens = reserved_tokens;
    }

    /// The request waited `waited` for a provider slot.
    pub fn queue_wait(&self, waited: Duration) {
        self.0.state.lock().queue_wait = Some(waited);
    }

    /// A member was picked for it this way (the last attempt's pick is recorded).
    pub fn routed(&self, decision: Decision) {
        self.0.state.lock().routing = Some(decision);
    }

    /// The request was sent to `provider` on `node` by `path` (`tunnel` or `run`).
    pub fn dispatched(&self, node: &str, provider: &str, path: &'static str) {
        let mut state = self.0.state.lock();
        state.node = node.to_string();
        state.provider = provider.to_string();
        state.path = path;
        state.stream = StreamState::Open;
        state.attempts += 1;
    }

    /// `provider` on `node` answered the request itself without running it (a token
    /// count): it goes on the record, which bills nothing for it.
    pub fn counted_by(&self, node: &str, provider: &str) {
        let mut state = self.0.state.lock();
        state.node = node.to_string();
        state.provider = provider.to_string();
    }

    /// The first token (body bytes or a delta) arrived; later calls change nothing.
    pub fn first_token(&self) {
        let elapsed = self.0.started.elapsed().as_millis() as u64;
        self.0.state.lock().ttft_ms.get_or_insert(elapsed);
    }

    /// `n` more output deltas (or streamed events) were relayed.
    pub fn relayed(&self, n: u64) {
        let mut state = self.0.state.lock();
        state.relayed = state.relayed.saturating_add(n);
    }

    /// The provider reported its usage (and, if it said, the model that served it).
    pub fn usage(&self, usage: iop_proto::pb::Usage, served_model: Option<String>) {
        let mut state = self.0.state.lock();
        state.usage = Some(usage);
        if served_model.is_some() {
            state.served_model = served_model;
        }
    }

    /// The provider answered with `status` (a tunnel).
    pub fn provider_status(&self, status: u16) {
        self.0.state.lock().provider_status = Some(status);
    }

    /// The stream reached its end: cleanly (`None`) or with an error.
    pub fn stream_ended(&self, error: Option<ErrorCode>) {
        let mut state = self.0.state.lock();
        state.stream = StreamState::Ended;
        if let Some(code) = error
            && state.error.is_none()
        {
            state.error = Some(code);
        }
    }

    /// The edge answered with an error.
    pub fn failed(&self, reason: ErrorCode, status: u16) {
        let mut state = self.0.state.lock();
        if state.error.is_none() {
            state.error = Some(reason);
        }
        state.status = Some(status);
    }

    /// The edge answered with `status` (the body may still be streaming).
    pub fn responded(&self, status: u16) {
        self.0.state.lock().status = Some(status);
    }

    /// Keeps `value` until the request ends (e.g. a key's concurrency place).
    pub fn hold(&self, value: Box<dyn Any + Send>) {
        self.0.state.lock().held.push(value);
    }
}

impl State {
    fn outcome(&self) -> (&'static str, u16) {
        let status = self.status.unwrap_or(CLIENT_CLOSED_STATUS);
        if let Some(code) = self.error {
            return (code.as_str(), status);
        }
        if let Some(code) = self
            .provider_status
            .and_then(ErrorCode::from_provider_status)
        {
            return (code.as_str(), status);
        }
        if self.status.is_none() || self.stream == StreamState::Open {
            return (CLIENT_ABORT, status);
        }
        (OUTCOME_OK, status)
    }
}

impl Drop for Draft {
    fn drop(&mut self) {
        let state = self.state.get_mut();
        let (outcome, status) = state.outcome();
        let usage = state.usage.unwrap_or_default();
        let reported = usage.input_tokens > 0 || usage.output_tokens > 0;
        // Estimates only where the provider reported nothing for a request it got.
        let estimated = !reported && state.path != "none";
        let record = UsageRecord {
            time_ms: self.time_ms,
            key: std::mem::take(&mut self.key),
            group: std::mem::take(&mut state.group),
            node: std::mem::take(&mut state.node),
            provider: std::mem::take(&mut state.provider),
            path: state.path,
            api: self.api.as_str(),
            input_tokens: usage.input_tokens,
            output_tokens: usage.output_tokens,
            reasoning_tokens: usage.reasoning_tokens.unwrap_or(0),
            cached_tokens: usage.cached_input_tokens.unwrap_or(0),
            est_input_tokens: estimated.then_some(state.input_estimate),
            est_output_tokens: estimated.then_some(state.relayed),
            latency_ms: self.started.elapsed().as_millis() as u64,
            ttft_ms: state.ttft_ms,
            outcome: outcome.to_string(),
            status,
            attempts: state.attempts.max(1),
            routing: state.routing.map_or("", Decision::as_str),
        };
        self.sink.record_request(FinishedRequest {
            record,
            queue_wait: state.queue_wait,
            reserved_tokens: state.reserved_tokens,
            served_model: state.served_model.take(),
        });
        // `held` drops after the record is handed over.
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Collect(Mutex<Vec<FinishedRequest>>);

    impl RecordSink for Collect {
        fn record_request(&self, finished: FinishedRequest) {
            self.0.lock().push(finished);
        }
    }

    fn start(sink: &Arc<Collect>) -> RequestRecorder {
        RequestRecorder::start(sink.clone(), ClientApi::OpenAi, Some("alice"))
    }

    fn usage(input: u64, output: u64) -> iop_proto::pb::Usage {
        iop_proto::pb::Usage {
            input_tokens: input,
            output_tokens: output,
            cached_input_tokens: Some(1),
            ..Default::default()
        }
    }

    #[test]
    fn recorded_once_when_the_last_holder_lets_go() {
        let sink = Arc::new(Collect::default());
        let handler = start(&sink);
        handler.set_group("g");
        handler.admitted(10, 1034);
        let stream = handler.clone();
        stream.dispatched("n1", "p1", "tunnel");
        handler.responded(200);
        drop(handler);
        assert!(sink.0.lock().is_empty(), "the stream still runs");
        stream.first_token();
        stream.relayed(3);
        stream.usage(usage(3, 16), Some("m".into()));
        stream.stream_ended(None);
        drop(stream);
        let finished = sink.0.lock();
        assert_eq!(finished.len(), 1);
        let f = &finished[0];
        let r = &f.record;
        assert_eq!(
            (r.key.as_str(), r.group.as_str(), r.node.as_str(), r.path),
            ("alice", "g", "n1", "tunnel")
        );
        assert_eq!(
            (r.input_tokens, r.output_tokens, r.cached_tokens),
            (3, 16, 1)
        );
        assert_eq!((r.est_input_tokens, r.est_output_tokens), (None, None));
        assert_eq!((r.outcome.as_str(), r.status, r.attempts), ("ok", 200, 1));
        assert!(r.ttft_ms.is_some());
        assert_eq!(
            (f.reserved_tokens, f.served_model.as_deref()),
            (1034, Some("m"))
        );
    }

    #[test]
    fn a_client_that_leaves_without_usage_is_recorded_with_estimates() {
        let sink = Arc::new(Collect::default());
        let r = start(&sink);
        r.admitted(12, 0);
        r.dispatched("n", "p", "run");
        r.responded(200);
        r.relayed(5);
        drop(r);
        // Refused before dispatch: nothing was sent, nothing is estimated.
        let r = start(&sink);
        r.admitted(12, 0);
        r.failed(ErrorCode::QueueFull, 429);
        drop(r);
        let finished = sink.0.lock();
        let left = &finished[0].record;
        assert_eq!(left.outcome, "client_abort");
        assert_eq!(
            (left.est_input_tokens, left.est_output_tokens),
            (Some(12), Some(5))
        );
        assert_eq!(left.billed_tokens(), 17);
        let refused = &finished[1].record;
        assert_eq!(
            (refused.est_input_tokens, refused.billed_tokens()),
            (None, 0)
        );
    }

    #[test]
    fn how_a_request_ended_decides_its_outcome() {
        let sink = Arc::new(Collect::default());
        // The client left mid-stream.
        let r = start(&sink);
        r.dispatched("n", "p", "run");
        r.responded(200);
        drop(r);
        // The client left while the request waited (no answer at all).
        drop(start(&sink));
        // The provider answered 500 and the edge relayed it.
        let r = start(&sink);
        r.dispatched("n", "p", "tunnel");
        r.provider_status(500);
        r.responded(500);
        r.stream_ended(None);
        drop(r);
        // A run failed: the stream's reason wins over the error the surface made of it.
        let r = start(&sink);
        r.dispatched("n", "p", "run");
        r.stream_ended(Some(ErrorCode::ProviderTimeout));
        r.failed(ErrorCode::ProviderError, 504);
        drop(r);
        // Refused before dispatch.
        let r = start(&sink);
        r.failed(ErrorCode::RequestsPerMinuteExceeded, 429);
        drop(r);
        let got: Vec<(String, u16)> = sink
            .0
            .lock()
            .iter()
            .map(|f| (f.record.outcome.clone(), f.record.status))
            .collect();
        assert_eq!(
            got,
            [
                ("client_abort".to_string(), 200),
                ("client_abort".to_string(), 499),
                ("provider_error".to_string(), 500),
                ("provider_timeout".to_string(), 504),
                ("requests_per_minute_exceeded".to_string(), 429),
            ]
        );
    }

    #[test]
    fn what_is_held_is_released_after_the_record() {
        struct Flag(Arc<Mutex<bool>>);
        impl Drop for Flag {
            fn drop(&mut self) {
                *self.0.lock() = true;
            }
        }
        let sink = Arc::new(Collect::default());
        let released = Arc::new(Mutex::new(false));
        let r = start(&sink);
        r.hold(Box::new(Flag(released.clone())));
        assert!(!*released.lock());
        drop(r);
        assert!(*released.lock());
        assert_eq!(sink.0.lock().len(), 1);
    }
}
