//! One connection (TCP, or TLS over TCP) split into a frame reader and a batching frame
//! writer.
//!
//! The writer half is owned by a single task fed through a bounded channel ([`Outbound`]);
//! it writes every frame already queued before flushing once, so a burst of small frames
//! (token deltas of many streams) costs one syscall. When the channel is full, senders wait:
//! that is the backpressure from a slow socket to whoever produces frames.

use std::any::Any;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures::SinkExt;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::mpsc;
use tokio_util::codec::{FramedRead, FramedWrite};

use crate::codec::{EnvelopeCodec, FrameError};
use crate::pb::Envelope;

/// Frames queued towards one socket before senders wait.
pub const OUTBOUND_QUEUE: usize = 1024;

/// Decodes envelopes from the read half of a connection.
pub type FrameReader = FramedRead<ReadHalf, EnvelopeCodec>;

/// Any byte stream a connection can run over: a `TcpStream`, or a TLS stream around one.
/// (`Sync` so the connection's owner can be borrowed across an await on a thread pool.)
pub trait ByteStream: AsyncRead + AsyncWrite + Unpin + Send + Sync + 'static {}

impl<S: AsyncRead + AsyncWrite + Unpin + Send + Sync + 'static> ByteStream for S {}

/// The read half of a connection. A plain TCP socket splits into two owned halves that
/// need no lock; any other stream (TLS) is shared by its halves behind tokio's split.
pub enum ReadHalf {
    Tcp(OwnedReadHalf),
    Shared(tokio::io::ReadHalf<Box<dyn ByteStream>>),
}

/// The write half matching [`ReadHalf`].
pub enum WriteHalf {
    Tcp(OwnedWriteHalf),
    Shared(tokio::io::WriteHalf<Box<dyn ByteStream>>),
}

impl AsyncRead for ReadHalf {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ReadHalf::Tcp(r) => Pin::new(r).poll_read(cx, buf),
            // A TLS peer that vanished without close_notify (killed, or a dropped link)
            // reads as an end of stream, as a TCP peer does: frames are length-prefixed,
            // so a frame cut short is still reported by the codec.
            ReadHalf::Shared(r) => match Pin::new(r).poll_read(cx, buf) {
                Poll::Ready(Err(e)) if e.kind() == io::ErrorKind::UnexpectedEof => {
                    Poll::Ready(Ok(()))
                }
                other => other,
            },
        }
    }
}

impl AsyncWrite for WriteHalf {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            WriteHalf::Tcp(w) => Pin::new(w).poll_write(cx, buf),
            WriteHalf::Shared(w) => Pin::new(w).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            WriteHalf::Tcp(w) => Pin::new(w).poll_write_vectored(cx, bufs),
            WriteHalf::Shared(w) => Pin::new(w).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            WriteHalf::Tcp(w) => w.is_write_vectored(),
            WriteHalf::Shared(w) => w.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            WriteHalf::Tcp(w) => Pin::new(w).poll_flush(cx),
            WriteHalf::Shared(w) => Pin::new(w).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            WriteHalf::Tcp(w) => Pin::new(w).poll_shutdown(cx),
            WriteHalf::Shared(w) => Pin::new(w).poll_shutdown(cx),
        }
    }
}

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
    sink: FramedWrite<WriteHalf, EnvelopeCodec>,
    rx: mpsc::Receiver<Envelope>,
}

impl FrameWriterTask {
    /// Writes queued frames until every [`Outbound`] is dropped or a write fails, then
    /// closes the stream's sending side (a TLS stream says close_notify).
    pub async fn run(mut self) -> Result<(), FrameError> {
        self.write_all().await?;
        self.sink.get_mut().shutdown().await?;
        Ok(())
    }

    async fn write_all(&mut self) -> Result<(), FrameError> {
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

/// Splits a connected stream into its frame reader, an [`Outbound`] handle and the writer
/// task the caller must run.
///
/// A `TcpStream` gets `TCP_NODELAY` (frames carry streamed tokens) and is split into owned
/// halves, exactly as before TLS existed; any other stream (TLS) is split behind a lock
/// its two halves share. Set `TCP_NODELAY` on the socket under a TLS stream before
/// wrapping it.
pub fn split_stream<S: ByteStream>(
    stream: S,
    max_frame_bytes: usize,
) -> (FrameReader, Outbound, FrameWriterTask) {
    let (read, write) = match (Box::new(stream) as Box<dyn Any>).downcast::<TcpStream>() {
        Ok(tcp) => {
            if let Err(err) = tcp.set_nodelay(true) {
                tracing::warn!(%err, "could not set TCP_NODELAY");
            }
            let (read, write) = tcp.into_split();
            (ReadHalf::Tcp(read), WriteHalf::Tcp(write))
        }
        Err(other) => {
            let Ok(stream) = other.downcast::<S>() else {
                unreachable!("the box holds an S")
            };
            let (read, write) = tokio::io::split(stream as Box<dyn ByteStream>);
            (ReadHalf::Shared(read), WriteHalf::Shared(write))
        }
    };
    let codec = EnvelopeCodec::new(max_frame_bytes);
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

#[cfg(test)]
mod tests {
    use futures::StreamExt;

    use super::*;
    use crate::pb;

    async fn round_trip<S: ByteStream>(a: S, b: S) {
        let (_ra, out_a, writer_a) = split_stream(a, 1024);
        let (mut rb, _out_b, _writer_b) = split_stream(b, 1024);
        let writer = tokio::spawn(writer_a.run());
        out_a.send(pb::Ping { nonce: 7 }).await.unwrap();
        let got = rb.next().await.unwrap().unwrap();
        assert_eq!(got, pb::Ping { nonce: 7 }.into());
        drop(out_a);
        writer.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn frames_cross_a_tcp_socket() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (a, b) = tokio::join!(TcpStream::connect(addr), listener.accept());
        round_trip(a.unwrap(), b.unwrap().0).await;
    }

    #[tokio::test]
    async fn frames_cross_any_other_stream() {
        let (a, b) = tokio::io::duplex(4096);
        round_trip(a, b).await;
    }
}
