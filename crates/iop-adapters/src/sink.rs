//! Where an adapter writes its run's events: numbers them, spends credit on data events,
//! and hands them to the run's [`RunOutlet`] (the node's link to the edge the run came
//! from). Enforces exactly one terminal per run: anything an adapter emits after its
//! terminal is dropped.
//!
//! The sink holds what the run occupies (its adapter's capacity slot, its place in the
//! edge's permits) and gives it up just before the terminal goes out: once the edge has
//! seen a terminal, the node's slot is free, so the edge may hand it to the next request
//! without the node refusing it.

use std::any::Any;

use async_trait::async_trait;
use iop_proto::ErrorCode;
use iop_proto::pb::{self, RunEventKind};

/// The run's stream is gone or the run was cancelled: stop producing.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("the run's stream is closed")]
pub struct SinkClosed;

/// Where a run's events go once numbered, and the credit its data events (deltas, tool
/// calls) spend there.
#[async_trait]
pub trait RunOutlet: Send + std::fmt::Debug {
    /// Waits for credit for one data event; false when the run's stream is gone.
    async fn credit(&mut self) -> bool;
    /// Sends one event; false when the run's stream is gone.
    async fn send(&mut self, event: pb::RunEvent) -> bool;
}

#[derive(Debug)]
pub struct RunSink {
    run_id: String,
    seq: u64,
    outlet: Box<dyn RunOutlet>,
    terminal: Option<RunEventKind>,
    usage: Option<pb::Usage>,
    started: bool,
    /// What the run occupies until its terminal is sent (a capacity slot, its place in
    /// the edge's permits).
    held: Vec<Box<dyn Any + Send>>,
}

impl RunSink {
    pub fn new(run_id: &str, outlet: impl RunOutlet + 'static) -> Self {
        Self {
            run_id: run_id.to_string(),
            seq: 0,
            outlet: Box::new(outlet),
            terminal: None,
            usage: None,
            started: false,
            held: Vec::new(),
        }
    }

    /// Holds `occupied` (a capacity slot, a place in the edge's permits) until the run's
    /// terminal is sent.
    pub fn hold(&mut self, occupied: impl Any + Send) {
        self.held.push(Box::new(occupied));
    }

    pub async fn accepted(&mut self) -> Result<(), SinkClosed> {
        let mut e = Self::event(RunEventKind::Accepted);
        e.run_id = self.run_id.clone();
        self.delivered(e).await
    }

    async fn delivered(&mut self, event: pb::RunEvent) -> Result<(), SinkClosed> {
        if self.outlet.send(event).await {
            Ok(())
        } else {
            Err(SinkClosed)
        }
    }

    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// The terminal sent, if any.
    pub fn terminal(&self) -> Option<RunEventKind> {
        self.terminal
    }

    /// The usage the terminal carried.
    pub fn usage(&self) -> Option<&pb::Usage> {
        self.usage.as_ref()
    }

    async fn send(&mut self, mut event: pb::RunEvent) -> Result<(), SinkClosed> {
        if self.terminal.is_some() {
            return Ok(());
        }
        let kind = event.kind();
        if matches!(
            kind,
            RunEventKind::Delta | RunEventKind::ReasoningDelta | RunEventKind::ToolCall
        ) && !self.outlet.credit().await
        {
            return Err(SinkClosed);
        }
        self.seq += 1;
        event.seq = self.seq;
        event.run_id = self.run_id.clone();
        if event.is_terminal() {
            self.terminal = Some(kind);
            self.usage = event.usage;
            // The slot is free before the edge can see the terminal.
            self.held.clear();
        }
        self.delivered(event).await
    }

    fn event(kind: RunEventKind) -> pb::RunEvent {
        pb::RunEvent {
            kind: kind as i32,
            ..Default::default()
        }
    }

    /// The provider accepted the run (sent once; later calls do nothing).
    pub async fn start(&mut self, model: &str) -> Result<(), SinkClosed> {
        if self.started {
            return Ok(());
        }
        self.started = true;
        let mut e = Self::event(RunEventKind::Start);
        e.model = model.to_string();
        self.send(e).await
    }

    pub async fn delta(&mut self, text: &str) -> Result<(), SinkClosed> {
        self.text(RunEventKind::Delta, text).await
    }

    pub async fn reasoning(&mut self, text: &str) -> Result<(), SinkClosed> {
        self.text(RunEventKind::ReasoningDelta, text).await
    }

    async fn text(&mut self, kind: RunEventKind, text: &str) -> Result<(), SinkClosed> {
        if text.is_empty() {
            return Ok(());
        }
        let mut e = Self::event(kind);
        e.text = text.to_string();
        self.send(e).await
    }

    /// The model called tools (complete calls; nothing is sent for none).
    pub async fn tool_calls(&mut self, calls: Vec<pb::ToolCall>) -> Result<(), SinkClosed> {
        if calls.is_empty() {
            return Ok(());
        }
        let mut e = Self::event(RunEventKind::ToolCall);
        e.tool_calls = calls;
        self.send(e).await
    }

    pub async fn complete(
        &mut self,
        usage: Option<pb::Usage>,
        finish_reason: &str,
    ) -> Result<(), SinkClosed> {
        let mut e = Self::event(RunEventKind::Complete);
        e.usage = usage;
        e.finish_reason = finish_reason.to_string();
        self.send(e).await
    }

    pub async fn error(&mut self, code: ErrorCode, message: &str) -> Result<(), SinkClosed> {
        let mut e = Self::event(RunEventKind::Error);
        e.error = Some(pb::RunError::new(code, message));
        self.send(e).await
    }

    pub async fn cancelled(&mut self, reason: &str) -> Result<(), SinkClosed> {
        let mut e = Self::event(RunEventKind::Cancelled);
        e.error = Some(pb::RunError::new(ErrorCode::Cancelled, reason));
        self.send(e).await
    }
}

/// An outlet that keeps what it is sent, for tests.
#[cfg(test)]
pub(crate) mod recorded {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use async_trait::async_trait;
    use iop_proto::pb::{self, RunEventKind};
    use parking_lot::Mutex;

    use super::RunOutlet;

    type OnSend = Arc<dyn Fn(&pb::RunEvent) + Send + Sync>;

    /// Unlimited credit; [`Recorded::close`] makes every later send fail as a gone stream
    /// would.
    #[derive(Clone, Default)]
    pub struct Recorded {
        pub events: Arc<Mutex<Vec<pb::RunEvent>>>,
        closed: Arc<AtomicBool>,
        /// Called with each event as it is sent.
        on_send: Option<OnSend>,
    }

    impl Recorded {
        pub fn close(&self) {
            self.closed.store(true, Ordering::SeqCst);
        }

        /// Calls `f` with each event as it is sent.
        pub fn on_send(mut self, f: impl Fn(&pb::RunEvent) + Send + Sync + 'static) -> Self {
            self.on_send = Some(Arc::new(f));
            self
        }

        pub fn kinds(&self) -> Vec<RunEventKind> {
            self.events.lock().iter().map(|e| e.kind()).collect()
        }
    }

    impl std::fmt::Debug for Recorded {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("Recorded")
                .field("events", &self.events)
                .finish()
        }
    }

    #[async_trait]
    impl RunOutlet for Recorded {
        async fn credit(&mut self) -> bool {
            !self.closed.load(Ordering::SeqCst)
        }

        async fn send(&mut self, event: pb::RunEvent) -> bool {
            if self.closed.load(Ordering::SeqCst) {
                return false;
            }
            if let Some(f) = &self.on_send {
                f(&event);
            }
            self.events.lock().push(event);
            true
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::recorded::Recorded;
    use super::*;

    #[tokio::test]
    async fn only_the_first_terminal_goes_out() {
        let out = Recorded::default();
        let mut sink = RunSink::new("r", out.clone());
        sink.start("m").await.unwrap();
        sink.delta("a").await.unwrap();
        sink.complete(None, "stop").await.unwrap();
        sink.error(ErrorCode::ProviderError, "ignored")
            .await
            .unwrap();
        sink.delta("late").await.unwrap();
        let seqs: Vec<u64> = out.events.lock().iter().map(|e| e.seq).collect();
        assert_eq!(seqs, [1, 2, 3]);
        assert_eq!(
            out.kinds(),
            [
                RunEventKind::Start,
                RunEventKind::Delta,
                RunEventKind::Complete
            ]
        );
    }

    #[tokio::test]
    async fn the_slot_is_free_before_the_terminal_is_sent() {
        let gate = Arc::new(tokio::sync::Semaphore::new(1));
        let seen = gate.clone();
        // By the time anyone can read the terminal, the slot is back.
        let out = Recorded::default().on_send(move |e| {
            let free = if e.is_terminal() { 1 } else { 0 };
            assert_eq!(seen.available_permits(), free, "{:?}", e.kind());
        });
        let mut sink = RunSink::new("r", out.clone());
        sink.hold(gate.clone().try_acquire_owned().unwrap());
        sink.accepted().await.unwrap();
        sink.start("m").await.unwrap();
        sink.error(ErrorCode::ProviderError, "boom").await.unwrap();
        let events = out.events.lock().clone();
        assert_eq!(
            (events[0].kind(), events[0].seq),
            (RunEventKind::Accepted, 0)
        );
        let terminal = events.last().unwrap();
        assert_eq!(
            terminal.error.clone().unwrap().error_code(),
            ErrorCode::ProviderError
        );
    }

    #[tokio::test]
    async fn a_gone_stream_stops_the_adapter() {
        let out = Recorded::default();
        let mut sink = RunSink::new("r", out.clone());
        sink.start("m").await.unwrap();
        out.close();
        assert!(sink.delta("a").await.is_err());
    }
}
