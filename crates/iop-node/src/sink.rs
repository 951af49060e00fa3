//! Where an adapter writes its run's events: numbers them, spends stream credit on data
//! events, and sends them on the connection. Enforces exactly one terminal per run:
//! anything an adapter emits after its terminal is dropped.
//!
//! The sink holds the run's capacity slot (its adapter's gate permit) and gives it up just
//! before the terminal goes out: once the edge has seen a terminal, the node's slot is
//! free, so the edge may hand it to the next request without the node refusing it.

use iop_proto::pb::{self, RunEventKind};
use iop_proto::{ErrorCode, Outbound};
use tokio::sync::OwnedSemaphorePermit;

use crate::permit_desk::PermitHook;
use tokio_util::sync::CancellationToken;

use crate::stream::Credit;

/// The run's connection is gone or the run was cancelled: stop producing.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("the run's stream is closed")]
pub struct SinkClosed;

#[derive(Debug)]
pub struct RunSink {
    run_id: String,
    seq: u64,
    outbound: Outbound,
    credit: Credit,
    cancel: CancellationToken,
    terminal: Option<RunEventKind>,
    usage: Option<pb::Usage>,
    started: bool,
    /// The adapter's capacity slot, released just before the terminal is sent.
    permit: Option<OwnedSemaphorePermit>,
    /// Counts the run in its edge's permits until then too.
    hook: Option<PermitHook>,
}

impl RunSink {
    pub fn new(
        run_id: &str,
        outbound: Outbound,
        credit: Credit,
        cancel: CancellationToken,
    ) -> Self {
        Self {
            run_id: run_id.to_string(),
            seq: 0,
            outbound,
            credit,
            cancel,
            terminal: None,
            usage: None,
            started: false,
            permit: None,
            hook: None,
        }
    }

    /// Counts the run in its edge's permits until its terminal.
    pub fn keep(&mut self, hook: PermitHook) {
        self.hook = Some(hook);
    }

    /// Holds the run's capacity slot until its terminal.
    pub fn hold(&mut self, permit: OwnedSemaphorePermit) {
        self.permit = Some(permit);
    }

    /// Acknowledges the dispatch: the run passed its gate and starts. Not numbered and not
    /// a data event (no credit); the edge never shows it to clients.
    pub async fn accepted(&mut self) -> Result<(), SinkClosed> {
        let mut e = Self::event(RunEventKind::Accepted);
        e.run_id = self.run_id.clone();
        self.outbound.send(e).await.map_err(|_| SinkClosed)
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
        ) && !self.credit.take(&self.cancel).await
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
            self.permit = None;
            self.hook = None;
        }
        self.outbound.send(event).await.map_err(|_| SinkClosed)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stream::StreamCredits;
    use iop_proto::pb::envelope::Message;
    use std::sync::Arc;

    #[tokio::test]
    async fn only_the_first_terminal_goes_out() {
        let (outbound, mut rx) = Outbound::channel(16);
        let credits = Arc::new(StreamCredits::default());
        let mut sink = RunSink::new(
            "r",
            outbound,
            credits.open("r", 8),
            CancellationToken::new(),
        );
        sink.start("m").await.unwrap();
        sink.delta("a").await.unwrap();
        sink.complete(None, "stop").await.unwrap();
        sink.error(ErrorCode::ProviderError, "ignored")
            .await
            .unwrap();
        sink.delta("late").await.unwrap();
        drop(sink);
        let mut kinds = Vec::new();
        while let Some(env) = rx.recv().await {
            if let Some(Message::RunEvent(e)) = env.message {
                assert_eq!(e.seq as usize, kinds.len() + 1);
                kinds.push(e.kind());
            }
        }
        assert_eq!(
            kinds,
            [
                RunEventKind::Start,
                RunEventKind::Delta,
                RunEventKind::Complete
            ]
        );
    }

    #[tokio::test]
    async fn the_slot_is_free_before_the_terminal_is_sent() {
        let (outbound, mut rx) = Outbound::channel(16);
        let credits = Arc::new(StreamCredits::default());
        let gate = Arc::new(tokio::sync::Semaphore::new(1));
        let mut sink = RunSink::new(
            "r",
            outbound,
            credits.open("r", 8),
            CancellationToken::new(),
        );
        sink.hold(gate.clone().try_acquire_owned().unwrap());
        sink.accepted().await.unwrap();
        sink.start("m").await.unwrap();
        let first = rx.recv().await.unwrap();
        match first.message {
            Some(Message::RunEvent(e)) => {
                assert_eq!((e.kind(), e.seq), (RunEventKind::Accepted, 0));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(gate.available_permits(), 0, "held while the run goes on");
        sink.error(ErrorCode::ProviderError, "boom").await.unwrap();
        let mut terminal = None;
        while let Ok(env) = rx.try_recv() {
            if let Some(Message::RunEvent(e)) = env.message
                && e.is_terminal()
            {
                // By the time anyone can read the terminal, the slot is back.
                assert_eq!(gate.available_permits(), 1);
                terminal = Some(e);
            }
        }
        let terminal = terminal.expect("a terminal");
        assert_eq!(
            terminal.error.unwrap().error_code(),
            ErrorCode::ProviderError
        );
    }
}
