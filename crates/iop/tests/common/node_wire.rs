//! Wire-level helpers for tests that attack the node listener: connections from a chosen
//! loopback address (plain TCP, or TLS as the listener speaks by default), a fake node
//! speaking `iop_proto` frames over TLS (it registers, answers pings and does whatever the
//! test says with what it receives), and a process's resident memory.

use std::time::Duration;

use iop_proto::pb::{self, envelope::Message};
use iop_proto::{FrameReader, Outbound, split_stream};
use tokio::net::{TcpSocket, TcpStream};
use tokio::sync::mpsc;

use super::tls::raw_tls_handshake;

/// A TLS connection to the node listener, not verifying the edge (the tests attack it).
pub type TlsLink = tokio_rustls::client::TlsStream<TcpStream>;

/// Resident memory of a process (`VmRSS` of `/proc/<pid>/status`), in bytes.
pub fn rss_bytes(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no VmRSS in /proc/{pid}/status"));
    kb * 1024
}

/// Samples a process's resident memory until dropped; [`RssPeak::peak`] is the highest seen.
pub struct RssPeak {
    peak: std::sync::Arc<std::sync::atomic::AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl RssPeak {
    pub fn start(pid: i32) -> RssPeak {
        let peak = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(rss_bytes(pid)));
        let seen = peak.clone();
        let task = tokio::spawn(async move {
            loop {
                seen.fetch_max(rss_bytes(pid), std::sync::atomic::Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        });
        RssPeak { peak, task }
    }

    pub fn peak(&self) -> u64 {
        self.peak.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl Drop for RssPeak {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A TCP connection to `addr` from the loopback address `source` (e.g. `127.0.0.2`).
pub async fn connect_from(source: &str, addr: &str) -> std::io::Result<TcpStream> {
    let socket = TcpSocket::new_v4()?;
    socket.bind(format!("{source}:0").parse().unwrap())?;
    socket.connect(addr.parse().unwrap()).await
}

/// A TLS connection to the node listener at `addr` from the loopback address `source`; an
/// error when the edge closes the connection before the handshake completes.
pub async fn tls_connect_from(source: &str, addr: &str) -> std::io::Result<TlsLink> {
    raw_tls_handshake(connect_from(source, addr).await?).await
}

/// A RegisterRequest with a static token.
fn register_request(token: &str, hostname: &str) -> pb::RegisterRequest {
    pb::RegisterRequest {
        token: token.to_string(),
        node_version: "test".into(),
        hostname: hostname.into(),
        ..Default::default()
    }
}

/// Sends one RegisterRequest on a fresh TLS connection from `source` and returns the
/// answer (`None` if the edge closed the connection without one).
pub async fn register_once(source: &str, addr: &str, token: &str) -> Option<pb::RegisterResponse> {
    let stream = tls_connect_from(source, addr).await.ok()?;
    let (mut reader, outbound, writer) = split_stream(stream, iop_proto::DEFAULT_MAX_FRAME_BYTES);
    let writer = tokio::spawn(writer.run());
    let sent = outbound.send(register_request(token, "attacker")).await;
    let answer = match sent {
        Ok(()) => {
            match tokio::time::timeout(Duration::from_secs(10), next_frame(&mut reader)).await {
                Ok(Some(Message::RegisterResponse(r))) => Some(*r),
                _ => None,
            }
        }
        Err(_) => None,
    };
    writer.abort();
    answer
}

async fn next_frame(reader: &mut FrameReader) -> Option<Message> {
    use futures::StreamExt;
    reader.next().await?.ok()?.message
}

/// A fake node: one TLS connection to the edge whose frames (all but pings, which it answers)
/// reach the test through [`FakeNode::next`].
pub struct FakeNode {
    pub outbound: Outbound,
    pub node_id: String,
    frames: mpsc::UnboundedReceiver<Message>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl FakeNode {
    /// Connects from `source` over TLS, registers with `token` and returns the fake node
    /// with the edge's answer (accepted or not).
    pub async fn register(
        source: &str,
        addr: &str,
        token: &str,
    ) -> (FakeNode, pb::RegisterResponse) {
        let stream = tls_connect_from(source, addr).await.unwrap();
        let (mut reader, outbound, writer) =
            split_stream(stream, iop_proto::DEFAULT_MAX_FRAME_BYTES);
        let writer = tokio::spawn(async move {
            let _ = writer.run().await;
        });
        let (tx, frames) = mpsc::unbounded_channel();
        let pong = outbound.clone();
        let reader = tokio::spawn(async move {
            while let Some(message) = next_frame(&mut reader).await {
                match message {
                    Message::Ping(ping) => {
                        pong.try_send(pb::Pong { nonce: ping.nonce });
                    }
                    Message::Pong(_) => {}
                    other => {
                        if tx.send(other).is_err() {
                            return;
                        }
                    }
                }
            }
        });
        let mut node = FakeNode {
            outbound,
            node_id: String::new(),
            frames,
            tasks: vec![writer, reader],
        };
        node.outbound
            .send(register_request(token, "fake"))
            .await
            .unwrap();
        let response = match node.next(Duration::from_secs(10)).await {
            Some(Message::RegisterResponse(r)) => *r,
            other => panic!("expected a register response, got {other:?}"),
        };
        node.node_id = response.node_id.clone();
        (node, response)
    }

    /// Sends ready and waits for the edge to accept it.
    pub async fn ready(&mut self) {
        self.outbound
            .send(pb::NodeReadyRequest {
                node_id: self.node_id.clone(),
            })
            .await
            .unwrap();
        loop {
            match self.next(Duration::from_secs(10)).await {
                Some(Message::NodeReadyResponse(r)) => {
                    assert!(r.ready, "ready refused: {}", r.reason);
                    return;
                }
                Some(_) => continue,
                None => panic!("no ready response"),
            }
        }
    }

    /// The next frame from the edge other than a ping; `None` when the connection closed
    /// or nothing came within `within`.
    pub async fn next(&mut self, within: Duration) -> Option<Message> {
        tokio::time::timeout(within, self.frames.recv())
            .await
            .ok()
            .flatten()
    }

    /// Waits until the edge closes the connection; false if it stays open for `within`.
    pub async fn wait_closed(&mut self, within: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            match tokio::time::timeout_at(deadline, self.frames.recv()).await {
                Ok(None) => return true,
                Ok(Some(_)) => continue,
                Err(_) => return false,
            }
        }
    }

    /// Sends one tunnel frame for `request_id`.
    pub async fn tunnel_frame(&self, request_id: &str, frame: pb::provider_tunnel_frame::Frame) {
        let _ = self
            .outbound
            .send(pb::ProviderTunnelFrame {
                request_id: request_id.to_string(),
                frame: Some(frame),
            })
            .await;
    }
}

impl Drop for FakeNode {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// A response header for tunnel frames.
pub fn header(name: &str, value: &str) -> pb::Header {
    pb::Header {
        name: name.to_string(),
        value: value.as_bytes().to_vec(),
    }
}
