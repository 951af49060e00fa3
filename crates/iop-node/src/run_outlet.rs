//! A run's events into the journal's stream of the run, which sends them on the link the
//! run goes out on now (and keeps them until the edge credits them): data events spend
//! the stream's credit; a stopped run's stream takes no more.

use std::sync::Arc;

use async_trait::async_trait;
use iop_proto::pb::{self, RunEventKind};

use crate::journal::{JournalStream, StreamFrame};
use crate::sink::RunOutlet;

#[derive(Debug)]
pub struct JournalOutlet {
    pub stream: Arc<JournalStream>,
}

#[async_trait]
impl RunOutlet for JournalOutlet {
    async fn credit(&mut self) -> bool {
        self.stream.credit().await
    }

    async fn send(&mut self, event: pb::RunEvent) -> bool {
        let data = matches!(
            event.kind(),
            RunEventKind::Delta | RunEventKind::ReasoningDelta | RunEventKind::ToolCall
        );
        let last = event.is_terminal();
        self.stream.send(StreamFrame::Run(event), data, last).await
    }
}
