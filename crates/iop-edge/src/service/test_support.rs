//! What the service's unit tests share: an edge without nodes, a node session whose
//! outbound frames the test reads, and a record sink that keeps what it is given.

use std::sync::Arc;

use iop_proto::{Outbound, pb};
use parking_lot::Mutex;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::Edge;
use crate::config::EdgeConfig;
use crate::ledger::recorder::{FinishedRequest, RecordSink};
use crate::ledger::{ClientApi, RequestRecorder};
use crate::registry::Generation;
use crate::session::NodeSession;

/// An edge without nodes, and a session of node `n1` whose outbound frames are returned.
pub fn edge_and_session() -> (Arc<Edge>, Arc<NodeSession>, mpsc::Receiver<pb::Envelope>) {
    let config = EdgeConfig::from_yaml("nodes: []\nmodel_groups: []\n", "test").unwrap();
    let (outbound, sent) = Outbound::channel(64);
    let session = NodeSession::new(
        "n1".into(),
        Generation(1),
        "peer".into(),
        outbound,
        CancellationToken::new(),
    );
    (Edge::new(config), Arc::new(session), sent)
}

/// Keeps every finished request.
#[derive(Default)]
pub struct Collect(pub Mutex<Vec<FinishedRequest>>);

impl RecordSink for Collect {
    fn record_request(&self, finished: FinishedRequest) {
        self.0.lock().push(finished);
    }
}

/// A recorder whose record goes to the returned sink.
pub fn recorder() -> (RequestRecorder, Arc<Collect>) {
    let sink = Arc::new(Collect::default());
    (
        RequestRecorder::start(sink.clone(), ClientApi::OpenAi, None),
        sink,
    )
}

/// Waits (up to 5 s) for a cancel among the frames sent to the node.
pub async fn cancel_sent(sent: &mut mpsc::Receiver<pb::Envelope>) -> bool {
    tokio::time::timeout(std::time::Duration::from_secs(5), async {
        while let Some(envelope) = sent.recv().await {
            if matches!(
                envelope.message,
                Some(pb::envelope::Message::CancelRequest(_))
            ) {
                return true;
            }
        }
        false
    })
    .await
    .unwrap_or(false)
}
