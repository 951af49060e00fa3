//! [`RequestRecorder`]: one request's record while it is under way. The HTTP surface that
//! receives a request starts it; the surface, the dispatcher and the run or tunnel
//! stream fill in what each learns (the group, the member, the provider's status, the
//! first token, the usage, how it ended); when the last holder lets go — the handler
//! returned and the response stream ended or was dropped — the finished [`UsageRecord`] is
//! handed to a [`RecordSink`] (the edge's `record_request`) exactly once.
//!
//! So every request is recorded whatever ends it: a success, an error answered by the
//! edge, a provider error, a refusal by admission or a key limit, or a client that left
//! (`client_abort`: the response was not finished when it was dropped).

use std::any::Any;
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

use super::record::{ClientApi, OUTCOME_OK, UsageRecord, provider_status_outcome};

/// Where finished records go.
pub trait RecordSink: Send + Sync {
    fn record_request(&self, record: UsageRecord);
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
    input_tokens: u64,
    output_tokens: u64,
    reasoning_tokens: u64,
    cached_tokens: u64,
    ttft_ms: Option<u64>,
    /// The first error code learned (the root cause wins over what followed from it).
    error: Option<String>,
    /// The status the client got, once the edge answered.
    status: Option<u16>,
    provider_status: Option<u16>,
    stream: StreamState,
    attempts: u32,
    /// Held until the request ends (a key's concurrency place).
    held: Vec<Box<dyn Any + Send>>,
}

impl RequestRecorder {
    /// A request of `key` (`None`: anonymous) on `api`, arriving now.
    pub fn start(sink: Arc<dyn RecordSink>, api: ClientApi, key: Option<&str>) -> Self {
        Self(Arc::new(Draft {
            sink,
            started: Instant::now(),
            time_ms: super::unix_ms_now(),
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

    /// The model group the request named.
    pub fn set_group(&self, group: &str) {
        let mut state = self.0.state.lock();
        if state.group != group {
            state.group = group.to_string();
        }
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

    /// The first token (body bytes or a delta) arrived; later calls change nothing.
    pub fn first_token(&self) {
        let elapsed = self.0.started.elapsed().as_millis() as u64;
        self.0.state.lock().ttft_ms.get_or_insert(elapsed);
    }

    /// The provider reported its usage.
    pub fn usage(&self, input: u64, output: u64, reasoning: u64, cached: u64) {
        let mut state = self.0.state.lock();
        state.input_tokens = input;
        state.output_tokens = output;
        state.reasoning_tokens = reasoning;
        state.cached_tokens = cached;
    }

    /// The provider answered with `status` (a tunnel).
    pub fn provider_status(&self, status: u16) {
        self.0.state.lock().provider_status = Some(status);
    }

    /// The stream reached its end: cleanly (`None`) or with an error code.
    pub fn stream_ended(&self, error: Option<&str>) {
        let mut state = self.0.state.lock();
        state.stream = StreamState::Ended;
        if let Some(code) = error
            && state.error.is_none()
        {
            state.error = Some(code.to_string());
        }
    }

    /// The edge answered with an error.
    pub fn failed(&self, code: &str, status: u16) {
        let mut state = self.0.state.lock();
        if state.error.is_none() {
            state.error = Some(code.to_string());
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
    fn outcome(&self) -> (String, u16) {
        let status = self.status.unwrap_or(CLIENT_CLOSED_STATUS);
        if let Some(code) = &self.error {
            return (code.clone(), status);
        }
        if let Some(s) = self.provider_status.filter(|s| *s >= 400) {
            return (provider_status_outcome(s).to_string(), status);
        }
        if self.status.is_none() || self.stream == StreamState::Open {
            return (CLIENT_ABORT.to_string(), status);
        }
        (OUTCOME_OK.to_string(), status)
    }
}

impl Drop for Draft {
    fn drop(&mut self) {
        let state = self.state.get_mut();
        let (outcome, status) = state.outcome();
        let record = UsageRecord {
            time_ms: self.time_ms,
            key: std::mem::take(&mut self.key),
            group: std::mem::take(&mut state.group),
            node: std::mem::take(&mut state.node),
            provider: std::mem::take(&mut state.provider),
            path: state.path,
            api: self.api.as_str(),
            input_tokens: state.input_tokens,
            output_tokens: state.output_tokens,
            reasoning_tokens: state.reasoning_tokens,
            cached_tokens: state.cached_tokens,
            latency_ms: self.started.elapsed().as_millis() as u64,
            ttft_ms: state.ttft_ms,
            outcome,
            status,
            attempts: state.attempts.max(1),
        };
        self.sink.record_request(record);
        // `held` drops after the record is handed over.
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Collect(Mutex<Vec<UsageRecord>>);

    impl RecordSink for Collect {
        fn record_request(&self, record: UsageRecord) {
            self.0.lock().push(record);
        }
    }

    fn start(sink: &Arc<Collect>) -> RequestRecorder {
        RequestRecorder::start(sink.clone(), ClientApi::OpenAi, Some("alice"))
    }

    #[test]
    fn recorded_once_when_the_last_holder_lets_go() {
        let sink = Arc::new(Collect::default());
        let handler = start(&sink);
        handler.set_group("g");
        let stream = handler.clone();
        stream.dispatched("n1", "p1", "tunnel");
        handler.responded(200);
        drop(handler);
        assert!(sink.0.lock().is_empty(), "the stream still runs");
        stream.first_token();
        stream.usage(3, 16, 0, 1);
        stream.stream_ended(None);
        drop(stream);
        let records = sink.0.lock();
        assert_eq!(records.len(), 1);
        let r = &records[0];
        assert_eq!(
            (r.key.as_str(), r.group.as_str(), r.node.as_str(), r.path),
            ("alice", "g", "n1", "tunnel")
        );
        assert_eq!(
            (r.input_tokens, r.output_tokens, r.cached_tokens),
            (3, 16, 1)
        );
        assert_eq!((r.outcome.as_str(), r.status, r.attempts), ("ok", 200, 1));
        assert!(r.ttft_ms.is_some());
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
        // A run failed: the stream's code wins over the error the surface made of it.
        let r = start(&sink);
        r.dispatched("n", "p", "run");
        r.stream_ended(Some("provider_timeout"));
        r.failed("upstream_error", 504);
        drop(r);
        // Refused before dispatch.
        let r = start(&sink);
        r.failed("queue_full", 429);
        drop(r);
        let got: Vec<(String, u16)> = sink
            .0
            .lock()
            .iter()
            .map(|r| (r.outcome.clone(), r.status))
            .collect();
        assert_eq!(
            got,
            [
                ("client_abort".to_string(), 200),
                ("client_abort".to_string(), 499),
                ("provider_error".to_string(), 500),
                ("provider_timeout".to_string(), 504),
                ("queue_full".to_string(), 429),
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
