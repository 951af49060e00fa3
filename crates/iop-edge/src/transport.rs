//! The edge's node listener: accepts TCP connections from nodes, runs the TLS handshake
//! (unless the listener is plaintext), and runs one handler per connection through
//! register → ready → serve, with heartbeats both ways.
//!
//! A connection that sends a bad frame (undecodable, oversized) or stays silent past the
//! heartbeat timeout is closed with a logged reason; every other connection keeps going.
//! All state changes go through [`Edge`]; this module only moves frames.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use iop_proto::envelope::kind;
use iop_proto::pb::{self, envelope::Message};
use iop_proto::{ByteStream, FrameReader, Heartbeat, Outbound, split_stream};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::{timeout, timeout_at};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::registry::{Generation, ReadyOutcome};
use crate::service::credentials::ConnectionControl;
use crate::service::{Edge, Rejection};
use crate::session::{CommandReply, Delivery, NodeSession};
use crate::trust::Link;
use crate::trust::node_tls::NodeListenerTls;

/// A new connection must register within this time.
pub const REGISTER_TIMEOUT: Duration = Duration::from_secs(10);
const WINDOW_OVERRUN: &str = "stream window overrun";
/// Time given to the writer to flush a last frame (a rejection) before the socket closes.
const FLUSH_GRACE: Duration = Duration::from_millis(500);

/// Accepts node connections until the edge shuts down, then waits for their handlers.
/// With `tls`, every connection completes a TLS handshake before its first frame is read.
pub async fn serve_nodes(
    edge: Arc<Edge>,
    listener: TcpListener,
    tls: Option<Arc<NodeListenerTls>>,
) {
    let connections = TaskTracker::new();
    let shutdown = edge.shutdown_token().clone();
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    connections.spawn(accept_connection(edge.clone(), stream, peer, tls.clone()));
                }
                Err(err) => {
                    tracing::warn!(%err, "accepting a node connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
        }
    }
    connections.close();
    connections.wait().await;
}

/// Secures an accepted socket (TLS handshake, bounded in time) and hands it on.
async fn accept_connection(
    edge: Arc<Edge>,
    stream: TcpStream,
    peer: SocketAddr,
    tls: Option<Arc<NodeListenerTls>>,
) {
    let Some(tls) = tls else {
        return handle_connection(edge, stream, peer, Link::Plaintext).await;
    };
    if let Err(err) = stream.set_nodelay(true) {
        tracing::warn!(%err, "could not set TCP_NODELAY");
    }
    let shutdown = edge.shutdown_token().clone();
    let accepted = tokio::select! {
        _ = shutdown.cancelled() => return,
        accepted = tls.accept(stream) => accepted,
    };
    match accepted {
        Ok((stream, link)) => handle_connection(edge, stream, peer, link).await,
        Err(reason) => tracing::warn!(%peer, "closing node connection: {reason}"),
    }
}

async fn handle_connection<S: ByteStream>(
    edge: Arc<Edge>,
    stream: S,
    peer: SocketAddr,
    link: Link,
) {
    let (reader, outbound, writer) = split_stream(stream, edge.config().max_frame_bytes);
    let mut writer = tokio::spawn(writer.run());
    let mut connection = Connection {
        edge,
        reader,
        outbound,
        peer: peer.to_string(),
        session: None,
        kick: CancellationToken::new(),
        link,
    };
    connection.run().await;
    drop(connection);
    if timeout(FLUSH_GRACE, &mut writer).await.is_err() {
        writer.abort();
    }
}

struct Connection {
    edge: Arc<Edge>,
    reader: FrameReader,
    outbound: Outbound,
    peer: String,
    session: Option<Arc<NodeSession>>,
    /// Cancelled by the edge to drop this connection.
    kick: CancellationToken,
    /// How the connection is secured and which client certificate it presented.
    link: Link,
}

impl Connection {
    async fn run(&mut self) {
        let first = match timeout(REGISTER_TIMEOUT, self.reader.next()).await {
            Err(_) => {
                tracing::warn!(peer = %self.peer, "closing connection: no RegisterRequest within {}s", REGISTER_TIMEOUT.as_secs());
                return;
            }
            Ok(None) => return,
            Ok(Some(Err(err))) => {
                tracing::warn!(peer = %self.peer, %err, "closing connection: bad first frame");
                return;
            }
            Ok(Some(Ok(envelope))) => envelope,
        };
        let request = match first.message {
            Some(Message::RegisterRequest(request)) => request,
            _ => {
                let rejection = Rejection::Protocol(format!(
                    "the first frame must be a register_request, got {}",
                    kind(&first)
                ));
                self.edge.rejected(&rejection, &self.peer);
                self.reject(&rejection).await;
                return;
            }
        };
        let generation = self.edge.next_generation();
        let control = ConnectionControl {
            outbound: self.outbound.clone(),
            kick: self.kick.clone(),
        };
        let registered = match self
            .edge
            .register(&request, &self.link, generation, &self.peer, control)
        {
            Ok(registered) => registered,
            Err(rejection) => {
                self.reject(&rejection).await;
                return;
            }
        };
        let node_id = registered.node_id.clone();
        let response = pb::RegisterResponse {
            accepted: true,
            node_id: node_id.clone(),
            config: Some(registered.payload),
            credential: registered.credential,
            ..Default::default()
        };
        let reason = if self.outbound.send(response).await.is_err() {
            "could not send the register response".to_string()
        } else {
            self.serve(&node_id, generation).await
        };
        self.edge.connection_lost(&node_id, generation, &reason);
    }

    async fn reject(&self, rejection: &Rejection) {
        let _ = self
            .outbound
            .send(pb::RegisterResponse {
                accepted: false,
                reject_reason: rejection.wire_reason() as i32,
                reason: rejection.to_string(),
                node_id: rejection.node_id().to_string(),
                ..Default::default()
            })
            .await;
    }

    /// Serves a registered connection until it ends; returns why it ended.
    async fn serve(&mut self, node_id: &str, generation: Generation) -> String {
        let shutdown = self.edge.shutdown_token().clone();
        let mut heartbeat = Heartbeat::new();
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return "edge shutting down".into(),
                _ = self.kick.cancelled() => return "node removed from the edge config".into(),
                frame = timeout_at(heartbeat.deadline(), self.reader.next()) => match frame {
                    Err(_) => return heartbeat.timeout_reason("node"),
                    Ok(None) => return "connection closed by the node".into(),
                    Ok(Some(Err(err))) => return format!("bad frame: {err}"),
                    Ok(Some(Ok(envelope))) => {
                        heartbeat.seen();
                        self.dispatch(node_id, generation, envelope).await;
                    }
                },
                ping = heartbeat.ping() => {
                    self.outbound.try_send(ping);
                }
            }
        }
    }

    /// Cuts one stream whose node ignored its credit window: the rest of the connection goes on.
    fn cut(&self, node_id: &str, cancel: pb::CancelRequest) {
        tracing::warn!(node_id, run_id = %cancel.run_id, request_id = %cancel.request_id, "node overran the stream window: stream cut");
        self.edge.send_control(&self.outbound, cancel.into());
    }

    async fn dispatch(&mut self, node_id: &str, generation: Generation, envelope: pb::Envelope) {
        let name = kind(&envelope);
        let Some(message) = envelope.message else {
            tracing::warn!(node_id, "empty envelope from node ignored");
            return;
        };
        match message {
            Message::NodeReadyRequest(request) => {
                let outcome = if request.node_id != node_id {
                    tracing::warn!(node_id, claimed = %request.node_id, "ready for another node id refused");
                    ReadyOutcome::Refused
                } else {
                    self.edge
                        .ready(node_id, generation, &self.outbound, &self.kick, &self.peer)
                };
                if outcome == ReadyOutcome::Activated {
                    self.session = self
                        .edge
                        .session(node_id)
                        .filter(|s| s.generation == generation);
                }
                let response = pb::NodeReadyResponse {
                    ready: outcome != ReadyOutcome::Refused,
                    reason: match outcome {
                        ReadyOutcome::Activated => String::new(),
                        ReadyOutcome::AlreadyReady => "already ready".into(),
                        ReadyOutcome::Refused => "not the current connection of this node".into(),
                    },
                };
                let _ = self.outbound.send(response).await;
            }
            Message::Ping(ping) => {
                self.outbound.try_send(pb::Pong { nonce: ping.nonce });
            }
            Message::Pong(_) => {}
            Message::RunEvent(event) => {
                let Some(session) = &self.session else {
                    tracing::warn!(node_id, "run event before ready ignored");
                    return;
                };
                let run_id = event.run_id.clone();
                if session.deliver_run_event(event) == Delivery::Overflow {
                    self.cut(node_id, pb::CancelRequest::run(&run_id, WINDOW_OVERRUN));
                }
            }
            Message::ProviderTunnelFrame(frame) => {
                let Some(session) = &self.session else {
                    tracing::warn!(node_id, "tunnel frame before ready ignored");
                    return;
                };
                let request_id = frame.request_id.clone();
                if session.deliver_tunnel_frame(frame) == Delivery::Overflow {
                    self.cut(
                        node_id,
                        pb::CancelRequest::tunnel(&request_id, WINDOW_OVERRUN),
                    );
                }
            }
            Message::NodeCommandResponse(response) => {
                if let Some(session) = &self.session {
                    let id = response.command_id.clone();
                    session.deliver_reply(&id, CommandReply::Command(response));
                }
            }
            Message::CancelResponse(response) => {
                if let Some(session) = &self.session {
                    let id = response.command_id.clone();
                    session.deliver_reply(&id, CommandReply::Cancel(response));
                }
            }
            _ => tracing::warn!(node_id, kind = name, "unexpected frame from node ignored"),
        }
    }
}
