//! The edge's node listener: accepts TCP connections from nodes, runs the TLS handshake
//! (unless the listener is plaintext), and runs one handler per connection through
//! register → ready → serve, with heartbeats both ways.
//!
//! Until a connection has registered it is untrusted (`limits.nodes`): from its accept on
//! it counts against the caps on unauthenticated connections ([`gate`]), its TLS handshake
//! must finish within `tls_handshake_timeout_sec`, its first frame may be at most
//! `first_frame_bytes` (refused from the announced length, before anything is buffered),
//! it must register within `register_timeout_sec`, and bad credentials from its address
//! (static tokens, join tokens, client certificates) are throttled. Those refusals are
//! counted and summarized in one log line per interval, not a line each. A registered
//! connection gets `max_frame_bytes` and must send ready within `ready_timeout_sec`, or it
//! is closed and its claim on the node id released.
//!
//! A connection that sends a bad frame (undecodable, oversized) or stays silent past the
//! heartbeat timeout is closed with a logged reason; every other connection keeps going.
//! All state changes go through [`Edge`]; this module only moves frames.

pub mod gate;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use iop_proto::envelope::kind;
use iop_proto::heartbeat;
use iop_proto::pb::{self, envelope::Message};
use iop_proto::{ByteStream, FrameError, FrameReader, Heartbeat, Outbound, split_stream};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::timeout;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::node_limits::NodeLimitsConfig;
use crate::registry::{Generation, ReadyOutcome};
use crate::service::nodes::ConnectionControl;
use crate::service::{Edge, Registered, Rejection};
use crate::session::{CommandReply, Delivery, NodeSession};
use crate::trust::Link;
use crate::trust::node_tls::{HandshakeError, NodeListenerTls};
use gate::{NodeGate, Notice, Room, UnauthenticatedSlot};

const WINDOW_OVERRUN: &str = "stream window overrun";
const BUDGET_OVERRUN: &str = "stream byte budget overrun (limits.nodes.stream_buffer_bytes)";
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
    let gate = NodeGate::new(Instant::now());
    let period = edge.config().limits.nodes.summary_interval();
    let mut summary = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    summary.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut take_one = false;
    loop {
        // A full pool takes no connection from the accept queue until it can make room:
        // the ones waiting there are taken in the order they came, a node among them.
        // Once a full pool with nobody silent was asked again, the next connection is
        // taken all the same: the heaviest-address rule may make room for it.
        let room_at = if take_one {
            None
        } else {
            gate.room_at(&edge.config().limits.nodes, Instant::now())
        };
        take_one = false;
        let wait_for_room = async {
            match room_at {
                None => false,
                Some(Room::When(at)) | Some(Room::Recheck(at)) => {
                    let at = tokio::time::Instant::from_std(at);
                    tokio::select! {
                        _ = tokio::time::sleep_until(at) => matches!(room_at, Some(Room::Recheck(_))),
                        _ = gate.freed() => false,
                    }
                }
            }
        };
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = summary.tick() => {
                if let Some(line) = gate.take_summary(Instant::now()) {
                    tracing::warn!("{line}");
                }
            }
            recheck = wait_for_room, if room_at.is_some() => take_one = recheck,
            accepted = listener.accept(), if room_at.is_none() => match accepted {
                Ok((stream, peer)) => {
                    let limits = &edge.config().limits.nodes;
                    match gate.admit(peer.ip(), limits, Instant::now()) {
                        Ok(slot) => {
                            connections.spawn(accept_connection(
                                edge.clone(),
                                gate.clone(),
                                slot,
                                stream,
                                peer,
                                tls.clone(),
                            ));
                        }
                        Err((notice, log)) => {
                            edge.telemetry.metrics.count_node_refusal(notice.label());
                            if log {
                                tracing::warn!(%peer, reason = notice.label(), unauthenticated = gate.unauthenticated(), "node connection closed at once: over the cap on unauthenticated connections (further ones are summarized)");
                            }
                            drop(stream);
                        }
                    }
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

/// Secures an accepted socket (TLS handshake, bounded in time) and hands it on. The
/// connection holds its unauthenticated `slot` all along, so the caps on unauthenticated
/// connections cover TLS handshakes too.
async fn accept_connection(
    edge: Arc<Edge>,
    gate: Arc<NodeGate>,
    mut slot: UnauthenticatedSlot,
    stream: TcpStream,
    peer: SocketAddr,
    tls: Option<Arc<NodeListenerTls>>,
) {
    let shutdown = edge.shutdown_token().clone();
    let limits = edge.config().limits.nodes.clone();
    // A node speaks at once (its ClientHello, or its registration); until a connection
    // does, its place is the first a full pool gives to a newcomer.
    let (patience, silent) = match tls {
        Some(_) => (limits.tls_handshake_timeout(), Notice::TlsHandshakeTimeout),
        None => (limits.register_timeout(), Notice::RegisterTimeout),
    };
    let mut first = [0u8; 1];
    let spoke = tokio::select! {
        _ = shutdown.cancelled() => return,
        _ = slot.evicted() => {
            edge.telemetry.metrics.count_node_refusal(Notice::Evicted.label());
            return;
        }
        // A peek waits for a byte that is there (readiness alone may be spurious).
        spoke = timeout(patience, stream.peek(&mut first)) => spoke,
    };
    if !matches!(spoke, Ok(Ok(n)) if n > 0) {
        edge.telemetry.metrics.count_node_refusal(silent.label());
        gate.note(silent);
        return;
    }
    slot.spoke();
    let Some(tls) = tls else {
        return handle_connection(edge, gate, slot, stream, peer, Link::Plaintext).await;
    };
    if let Err(err) = stream.set_nodelay(true) {
        tracing::warn!(%err, "could not set TCP_NODELAY");
    }
    let within = limits.tls_handshake_timeout();
    let accepted = tokio::select! {
        _ = shutdown.cancelled() => return,
        _ = slot.evicted() => {
            edge.telemetry.metrics.count_node_refusal(Notice::Evicted.label());
            return;
        }
        accepted = tls.accept(stream, within) => accepted,
    };
    let err = match accepted {
        Ok((stream, link)) => {
            // A client certificate the handshake verified is a credential: the connection
            // leaves the unauthenticated pool now (its registration still checks it).
            if link.client_cert().is_some() {
                slot.authenticated();
            }
            return handle_connection(edge, gate, slot, stream, peer, link).await;
        }
        Err(err) => err,
    };
    let notice = match &err {
        HandshakeError::Timeout(_) => Notice::TlsHandshakeTimeout,
        HandshakeError::Failed(_) => Notice::TlsHandshakeFailed,
        HandshakeError::ClientCertificate(_) => Notice::BadCredential,
    };
    edge.telemetry.metrics.count_node_refusal(notice.label());
    let log = match notice {
        Notice::BadCredential => gate.bad_credential(peer.ip(), Instant::now()),
        _ => gate.note(notice),
    };
    if log {
        tracing::warn!(%peer, "closing node connection: {err} (further ones are summarized)");
    }
}

async fn handle_connection<S: ByteStream>(
    edge: Arc<Edge>,
    gate: Arc<NodeGate>,
    slot: UnauthenticatedSlot,
    stream: S,
    peer: SocketAddr,
    link: Link,
) {
    let (mut reader, outbound, writer) = split_stream(stream, edge.config().max_frame_bytes);
    // Until the peer has registered, only a frame the size of a RegisterRequest is read.
    reader
        .decoder_mut()
        .set_max_frame_bytes(edge.config().limits.nodes.first_frame_bytes);
    let mut writer = tokio::spawn(writer.run());
    let mut connection = Connection {
        edge,
        gate,
        reader,
        outbound,
        ip: peer.ip(),
        peer: peer.to_string(),
        session: None,
        kick: CancellationToken::new(),
        link,
    };
    connection.run(slot).await;
    drop(connection);
    if timeout(FLUSH_GRACE, &mut writer).await.is_err() {
        writer.abort();
    }
}

struct Connection {
    edge: Arc<Edge>,
    gate: Arc<NodeGate>,
    reader: FrameReader,
    outbound: Outbound,
    ip: IpAddr,
    peer: String,
    session: Option<Arc<NodeSession>>,
    /// Cancelled by the edge to drop this connection.
    kick: CancellationToken,
    /// How the connection is secured and which client certificate it presented.
    link: Link,
}

impl Connection {
    /// Counts a refusal before registration; true when it should be logged on its own.
    fn notice(&self, notice: Notice) -> bool {
        self.edge
            .telemetry
            .metrics
            .count_node_refusal(notice.label());
        self.gate.note(notice)
    }

    /// A connection's life: its registration, then its session until it ends.
    async fn run(&mut self, mut slot: UnauthenticatedSlot) {
        let (limits, max_frame_bytes) = {
            let config = self.edge.config();
            (config.limits.nodes.clone(), config.max_frame_bytes)
        };
        let Some(request) = self.first_request(&mut slot, &limits).await else {
            return;
        };
        let Some((registered, generation)) = self.register(&request).await else {
            return;
        };
        slot.authenticated();
        self.reader
            .decoder_mut()
            .set_max_frame_bytes(max_frame_bytes);
        let ready_deadline = tokio::time::Instant::now() + limits.ready_timeout();
        let node_id = registered.node_id.clone();
        let (edge_id, fleet) = self
            .edge
            .fleet
            .get()
            .map(|f| (f.this_edge_id(), f.for_nodes()))
            .unwrap_or_default();
        let response = pb::RegisterResponse {
            accepted: true,
            node_id: node_id.clone(),
            config: Some(registered.payload),
            credential: registered.credential,
            edge_id,
            fleet,
            ..Default::default()
        };
        let reason = if self.outbound.send(response).await.is_err() {
            "could not send the register response".to_string()
        } else {
            self.serve(
                &node_id,
                generation,
                ready_deadline,
                limits.ready_timeout_sec,
            )
            .await
        };
        self.edge.connection_lost(&node_id, generation, &reason);
    }

    /// The connection's first frame, when it is a register request in time; otherwise the
    /// connection is noted (and refused when it said something else) and `None`.
    async fn first_request(
        &mut self,
        slot: &mut UnauthenticatedSlot,
        limits: &NodeLimitsConfig,
    ) -> Option<Box<pb::RegisterRequest>> {
        let first = tokio::select! {
            _ = slot.evicted() => {
                self.edge.telemetry.metrics.count_node_refusal(Notice::Evicted.label());
                return None;
            }
            first = timeout(limits.register_timeout(), self.reader.next()) => first,
        };
        let first = match first {
            Err(_) => {
                if self.notice(Notice::RegisterTimeout) {
                    tracing::warn!(peer = %self.peer, "closing connection: no RegisterRequest within {}s (limits.nodes.register_timeout_sec; further ones are summarized)", limits.register_timeout_sec);
                }
                return None;
            }
            Ok(None) => return None,
            Ok(Some(Err(err))) => {
                let notice = match err {
                    FrameError::TooLarge { .. } => Notice::OversizedFirstFrame,
                    _ => Notice::UndecodableFirstFrame,
                };
                if self.notice(notice) {
                    tracing::warn!(peer = %self.peer, %err, "closing connection: bad first frame (limits.nodes.first_frame_bytes; further ones are summarized)");
                }
                return None;
            }
            Ok(Some(Ok(envelope))) => envelope,
        };
        match first.message {
            Some(Message::RegisterRequest(request)) => Some(request),
            _ => {
                let rejection = Rejection::Protocol(format!(
                    "the first frame must be a register_request, got {}",
                    kind(&first)
                ));
                if self.notice(Notice::NotRegister) {
                    self.edge.rejected(&rejection, &self.peer);
                }
                self.reject(&rejection).await;
                None
            }
        }
    }

    /// Registers the node `request` names, unless its address is held back for bad
    /// credentials; a refusal is sent, noted and `None`.
    async fn register(
        &mut self,
        request: &pb::RegisterRequest,
    ) -> Option<(Registered, Generation)> {
        let now = Instant::now();
        // A verified client certificate cannot be guessed: it is never held back by what
        // others at its address sent.
        let throttled = match self.link.client_cert() {
            Some(_) => Ok(()),
            None => self.gate.check_credential_attempt(self.ip, now),
        };
        if let Err((retry_after, log)) = throttled {
            self.edge
                .telemetry
                .metrics
                .count_node_refusal(Notice::Throttled.label());
            let rejection = Rejection::Throttled { retry_after };
            if log {
                tracing::warn!(peer = %self.peer, reason = %rejection, "node registration refused (further ones are summarized)");
            }
            self.reject(&rejection).await;
            return None;
        }
        let generation = self.edge.nodes.next_generation();
        let control = ConnectionControl {
            outbound: self.outbound.clone(),
            kick: self.kick.clone(),
        };
        let registered = match self
            .edge
            .register(request, &self.link, generation, &self.peer, control)
            .await
        {
            Ok(registered) => registered,
            Err(rejection) => {
                if rejection.is_refused_credential() {
                    self.edge
                        .telemetry
                        .metrics
                        .count_node_refusal(Notice::BadCredential.label());
                    // Guesses are logged once per summary window (the edge logged the rest).
                    if self.gate.bad_credential(self.ip, now) && rejection.is_guess() {
                        self.edge.rejected(&rejection, &self.peer);
                    }
                } else if rejection.credential_was_good() {
                    // A duplicate, a config that cannot be built, state that cannot be saved.
                    self.gate.good_credential(self.ip);
                }
                self.reject(&rejection).await;
                return None;
            }
        };
        self.gate.good_credential(self.ip);
        Some((registered, generation))
    }

    async fn reject(&self, rejection: &Rejection) {
        let _ = self
            .outbound
            .send(pb::RegisterResponse {
                accepted: false,
                reject_reason: rejection.wire_reason() as i32,
                reason: rejection.to_string(),
                node_id: rejection.node_id().to_string(),
                retry_after_ms: match rejection {
                    Rejection::Throttled { retry_after } => u64::try_from(retry_after.as_millis())
                        .unwrap_or(u64::MAX)
                        .max(1),
                    _ => 0,
                },
                ..Default::default()
            })
            .await;
    }

    /// Serves a registered connection until it ends; returns why it ended. Until the
    /// connection is dispatch-ready it must become so by `ready_deadline`.
    async fn serve(
        &mut self,
        node_id: &str,
        generation: Generation,
        ready_deadline: tokio::time::Instant,
        ready_timeout_sec: f64,
    ) -> String {
        let shutdown = self.edge.shutdown_token().clone();
        let mut heartbeat = Heartbeat::new();
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return "edge shutting down".into(),
                _ = self.kick.cancelled() => return "node removed from the edge config".into(),
                _ = tokio::time::sleep_until(ready_deadline), if self.session.is_none() => {
                    return format!("no accepted NodeReadyRequest within {ready_timeout_sec}s of registering (limits.nodes.ready_timeout_sec): claim released");
                }
                frame = heartbeat::next_frame(heartbeat.deadline(), &mut self.reader) => match frame {
                    None => return heartbeat.timeout_reason("node"),
                    Some(None) => return "connection closed by the node".into(),
                    Some(Some(Err(err))) => return format!("bad frame: {err}"),
                    Some(Some(Ok(envelope))) => {
                        heartbeat.seen();
                        self.dispatch(node_id, generation, envelope).await;
                    }
                },
                ping = heartbeat.ping() => {
                    if let Some(session) = &self.session {
                        session.flush_received();
                    }
                    self.outbound.try_send(ping);
                }
            }
        }
    }

    /// Notes a heartbeat from the node for the status (its heartbeat age).
    fn heartbeat_seen(&self) {
        if let Some(session) = &self.session {
            session.heartbeat_seen(Instant::now());
        }
    }

    /// Cuts one stream whose node ignored its credit window or byte budget: the rest of
    /// the connection goes on.
    fn cut(&self, node_id: &str, cancel: pb::CancelRequest) {
        tracing::warn!(node_id, run_id = %cancel.run_id, request_id = %cancel.request_id, reason = %cancel.reason, "node overran a stream's limits: stream cut");
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
                if outcome == ReadyOutcome::Activated {
                    self.edge.resume_parked(node_id);
                }
            }
            Message::Ping(ping) => {
                self.outbound.try_send(pb::Pong { nonce: ping.nonce });
                self.heartbeat_seen();
            }
            Message::Pong(_) => self.heartbeat_seen(),
            Message::RunEvent(event) => {
                let Some(session) = &self.session else {
                    tracing::warn!(node_id, "run event before ready ignored");
                    return;
                };
                let run_id = event.run_id.clone();
                let delivery = session.deliver_run_event(*event);
                if delivery.is_overrun() {
                    self.cut(node_id, pb::CancelRequest::run(&run_id, overrun(&delivery)));
                }
            }
            Message::ProviderTunnelFrame(frame) => {
                let Some(session) = &self.session else {
                    tracing::warn!(node_id, "tunnel frame before ready ignored");
                    return;
                };
                let delivery = session.deliver_tunnel(&frame.request_id, frame.frame);
                if delivery.is_overrun() {
                    self.cut(
                        node_id,
                        pb::CancelRequest::tunnel(&frame.request_id, overrun(&delivery)),
                    );
                }
            }
            Message::ProviderHealthReport(report) => {
                if self.session.is_some() {
                    self.edge.provider_health(node_id, generation, &report);
                } else {
                    tracing::warn!(node_id, "health report before ready ignored");
                }
            }
            Message::PermitGrant(grant) => {
                self.edge
                    .permits_granted(node_id, generation, &grant, &self.outbound);
            }
            Message::OrphanUsage(report) => {
                if self.session.is_some() {
                    self.edge.record_orphan(node_id, &report);
                } else {
                    tracing::warn!(node_id, "usage report before ready ignored");
                }
            }
            Message::NodeCommandResponse(response) => {
                if let Some(session) = &self.session {
                    let id = response.command_id.clone();
                    session.deliver_reply(&id, CommandReply::Command(*response));
                }
            }
            Message::CancelResponse(response) => {
                if let Some(session) = &self.session {
                    let id = response.command_id.clone();
                    session.deliver_reply(&id, CommandReply::Cancel(*response));
                }
            }
            _ => tracing::warn!(node_id, kind = name, "unexpected frame from node ignored"),
        }
    }
}

/// Why an overrun stream was cut, as told to the node.
fn overrun(delivery: &Delivery) -> &'static str {
    match delivery {
        Delivery::OverBudget => BUDGET_OVERRUN,
        _ => WINDOW_OVERRUN,
    }
}
