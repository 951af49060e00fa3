//! A run's events onto the connection its request came on: data events spend the
//! stream's credit from the edge; a closed connection or a cancelled run ends the stream.

use async_trait::async_trait;
use iop_proto::{Outbound, pb};
use tokio_util::sync::CancellationToken;

use crate::sink::RunOutlet;
use crate::stream::Credit;

#[derive(Debug)]
pub struct LinkOutlet {
    pub outbound: Outbound,
    pub credit: Credit,
    /// Cancelled with the run (or its connection): a wait for credit ends.
    pub cancel: CancellationToken,
}

#[async_trait]
impl RunOutlet for LinkOutlet {
    async fn credit(&mut self) -> bool {
        self.credit.take(&self.cancel).await
    }

    async fn send(&mut self, event: pb::RunEvent) -> bool {
        self.outbound.send(event).await.is_ok()
    }
}
