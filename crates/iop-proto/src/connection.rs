//! One TCP connection split into a frame reader and a batching frame writer.
//!
//! The writer half is owned by a single task fed through a bounded channel ([`Outbound`]);
//! it writes every frame already queued before flushing once, so a burst of small frames
//! (token deltas of many streams) costs one syscall. When the channel is full, senders wait:
//! that is the backpressure from a slow socket to whoever produces frames.

use futures::SinkExt;
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::mpsc;
use tokio_util::codec::{FramedRead, FramedWrite};

use crate::codec::{EnvelopeCodec, FrameError};
use crate::pb::Envelope;

/// Frames queued towards one socket before senders wait.
pub const OUTBOUND_QUEUE: usize = 1024;

/// Decodes envelopes from the read half of a connection.
pub type FrameReader = FramedRead<OwnedReadHalf, EnvelopeCodec>;

/// The connection's writer went away (socket closed or owner stopped).
#[derive(Debug, thiserror::Error)]
#[error("connection closed")]
pub struct ConnectionClosed;

/// A cloneable handle that queues envelopes for the connection's writer task.
#[derive(Debug, Clone)]
pub struct Outbound {
    tx: mpsc::Sender<Envelope>,
}

impl Outbound {
    /// Queues one envelope, waiting while the queue is full.
    pub async fn send(&self, envelope: impl Into<Envelope>) -> Result<(), ConnectionClosed> {
        self.tx
            .send(envelope.into())
            .await
            .map_err(|_| ConnectionClosed)
    }

    /// Queues one envelope unless the queue is full or closed (used for heartbeats, which
    /// are pointless behind a full queue).
    pub fn try_send(&self, envelope: impl Into<Envelope>) -> bool {
        self.tx.try_send(envelope.into()).is_ok()
    }

    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }

    /// A handle whose frames go nowhere but into the returned receiver (tests).
    pub fn channel(capacity: usize) -> (Self, mpsc::Receiver<Envelope>) {
        let (tx, rx) = mpsc::channel(capacity);
        (Self { tx }, rx)
    }
}

/// The writer half and its queue; [`FrameWriterTask::run`] drains the queue into the socket.
pub struct FrameWriterTask {
    sink: FramedWrite<OwnedWriteHalf, EnvelopeCodec>,
    rx: mpsc::Receiver<Envelope>,
}

impl FrameWriterTask {
    /// Writes queued frames until every [`Outbound`] is dropped or a write fails.
    pub async fn run(mut self) -> Result<(), FrameError> {
        while let Some(first) = self.rx.recv().await {
            self.sink.feed(first).await?;
            while let Ok(next) = self.rx.try_recv() {
                self.sink.feed(next).await?;
            }
            // Let the tasks that are ready right now add their frames to this write; when
            // nothing else is runnable this returns at once.
            crate::yield_once().await;
            while let Ok(next) = self.rx.try_recv() {
                self.sink.feed(next).await?;
            }
            self.sink.flush().await?;
        }
        Ok(())
    }
}

/// Splits a connected socket into its frame reader, an [`Outbound`] handle and the writer
/// task the caller must run. Sets `TCP_NODELAY`: frames carry streamed tokens.
pub fn split_stream(
    stream: TcpStream,
    max_frame_bytes: usize,
) -> (FrameReader, Outbound, FrameWriterTask) {
    if let Err(err) = stream.set_nodelay(true) {
        tracing::warn!(%err, "could not set TCP_NODELAY");
    }
    let codec = EnvelopeCodec::new(max_frame_bytes);
    let (read, write) = stream.into_split();
    let (tx, rx) = mpsc::channel(OUTBOUND_QUEUE);
    (
        FramedRead::new(read, codec),
        Outbound { tx },
        FrameWriterTask {
            sink: FramedWrite::new(write, codec),
            rx,
        },
    )
}
