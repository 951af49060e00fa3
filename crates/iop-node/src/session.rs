//! One connection to the edge: dial, TLS handshake (the edge verified before anything is
//! sent), register, apply the config payload, start adapters, send ready, then serve frames
//! until the connection ends — with heartbeats both ways.
//!
//! Only the ready ack makes the node dispatch-ready. When the connection ends, every run
//! and tunnel started on it is cancelled; the supervisor decides whether to dial again.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use iop_proto::envelope::kind;
use iop_proto::heartbeat;
use iop_proto::pb::{self, envelope::Message};
use iop_proto::{ByteStream, FrameError, FrameReader, Heartbeat, Outbound, split_stream};
use tokio::net::TcpStream;
use tokio::time::{Instant, timeout, timeout_at};
use tokio_util::sync::CancellationToken;

use crate::link::{EdgeLink, Security};
use crate::runtime::{Connection, NodeRuntime};
use crate::store::now_ms;

pub const DIAL_TIMEOUT: Duration = Duration::from_secs(10);
/// Bounds the TLS handshake, and each step of registration.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Wait before trying again to queue a health report that found the queue full.
const HEALTH_RETRY: Duration = Duration::from_millis(500);
/// Time runs get to send their cancelled terminals when the connection or process ends.
const DRAIN_GRACE: Duration = Duration::from_secs(2);

/// How to reach and authenticate with the edge.
#[derive(Debug, Clone)]
pub struct EdgeTarget {
    pub link: Arc<EdgeLink>,
    pub max_frame_bytes: usize,
    /// Set for a link to one edge of a fleet (the supervisor's); such a session leaves
    /// the node's transport status to the link that came from the config.
    pub fleet_edge: Option<String>,
}

/// How a connection ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionEnd {
    /// Local shutdown was requested.
    Shutdown,
    /// Retrying cannot help (bad credentials, a config this node cannot apply).
    Fatal(String),
    /// Try again under the reconnect policy. `was_ready` resets the attempt budget;
    /// `next` says when the next attempt may come.
    Retry {
        error: String,
        was_ready: bool,
        next: NextAttempt,
    },
}

/// When the next attempt may come, within the reconnect interval.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NextAttempt {
    /// After the full interval.
    Interval,
    /// After this long (the edge said when it will listen to this address again).
    After(Duration),
    /// As soon as the edge accepts connections (at once if it does now): the edge could
    /// not be reached, or a ready connection was lost.
    WhenReachable,
}

fn retry(error: impl Into<String>) -> SessionEnd {
    retry_next(error, NextAttempt::Interval)
}

fn retry_next(error: impl Into<String>, next: NextAttempt) -> SessionEnd {
    SessionEnd::Retry {
        error: error.into(),
        was_ready: false,
        next,
    }
}

/// Runs one connection to its end.
pub async fn run_session(
    runtime: &Arc<NodeRuntime>,
    target: &EdgeTarget,
    shutdown: &CancellationToken,
) -> SessionEnd {
    let addr = target.link.edge_addr().to_string();
    let primary = target.fleet_edge.is_none();
    if primary {
        let mut t = runtime.transport.lock();
        t.edge = addr.clone();
        t.state = "connecting";
    }
    let dial = tokio::select! {
        _ = shutdown.cancelled() => return SessionEnd::Shutdown,
        d = timeout(DIAL_TIMEOUT, TcpStream::connect(&addr)) => d,
    };
    let stream = match dial {
        Ok(Ok(stream)) => stream,
        Ok(Err(e)) => {
            target.link.advance();
            return retry_next(
                format!("cannot connect to the edge at {addr}: {e}"),
                NextAttempt::WhenReachable,
            );
        }
        Err(_) => {
            target.link.advance();
            return retry_next(
                format!(
                    "connecting to the edge at {addr} timed out after {}s",
                    DIAL_TIMEOUT.as_secs()
                ),
                NextAttempt::WhenReachable,
            );
        }
    };
    let end = match target.link.security() {
        Security::InsecurePlaintext => {
            run_connection(runtime, target, &addr, stream, shutdown).await
        }
        Security::Tls(_) => {
            if let Err(err) = stream.set_nodelay(true) {
                tracing::warn!(%err, "could not set TCP_NODELAY");
            }
            match handshake(&target.link, &addr, stream, shutdown).await {
                Ok(tls) => run_connection(runtime, target, &addr, tls, shutdown).await,
                Err(end) => end,
            }
        }
    };
    if primary {
        let mut t = runtime.transport.lock();
        t.state = "disconnected";
        t.connected_since_ms = None;
        if let SessionEnd::Retry { error, .. } | SessionEnd::Fatal(error) = &end {
            t.last_error = Some(error.clone());
        }
    }
    end
}

/// The TLS handshake with the edge, which verifies the edge before anything is sent. A
/// certificate that does not match the pin ends the node; other failures are retried.
async fn handshake(
    link: &EdgeLink,
    addr: &str,
    stream: TcpStream,
    shutdown: &CancellationToken,
) -> Result<tokio_rustls::client::TlsStream<TcpStream>, SessionEnd> {
    let (config, name) = link.client_config().map_err(SessionEnd::Fatal)?;
    let connector = tokio_rustls::TlsConnector::from(config);
    let done = tokio::select! {
        _ = shutdown.cancelled() => return Err(SessionEnd::Shutdown),
        done = timeout(HANDSHAKE_TIMEOUT, connector.connect(name, stream)) => done,
    };
    match done {
        Ok(Ok(tls)) => Ok(tls),
        Ok(Err(e)) => {
            if let Some(mismatch) = crate::tls::is_pin_mismatch(&e) {
                return Err(SessionEnd::Fatal(format!(
                    "{mismatch} (edge {addr}). Nothing was sent. Check the pin (--edge-pin, the join string): the edge prints its pin at start. If the edge's CA was rotated, add the new pin"
                )));
            }
            let hint = if e.kind() == std::io::ErrorKind::UnexpectedEof {
                " (the edge closed the connection before the handshake finished: it may be turning away connections over its limits.nodes caps; if this never stops, check that its node listener is not plaintext)"
            } else if e.to_string().contains("corrupt message") {
                " (is the edge's node listener plaintext? then both sides must say insecure_plaintext)"
            } else {
                ""
            };
            Err(retry(format!(
                "TLS handshake with the edge at {addr} failed: {e}{hint}"
            )))
        }
        Err(_) => Err(retry(format!(
            "TLS handshake with the edge at {addr} timed out after {}s",
            HANDSHAKE_TIMEOUT.as_secs()
        ))),
    }
}

/// Registers and serves over an established (plain or TLS) stream.
async fn run_connection<S: ByteStream>(
    runtime: &Arc<NodeRuntime>,
    target: &EdgeTarget,
    addr: &str,
    stream: S,
    shutdown: &CancellationToken,
) -> SessionEnd {
    let (reader, outbound, writer) = split_stream(stream, target.max_frame_bytes);
    let mut writer = tokio::spawn(writer.run());
    let conn = Connection::new(outbound.clone());
    let mut session = Session {
        runtime: runtime.clone(),
        reader,
        outbound,
        conn,
        addr: addr.to_string(),
        edge_id: String::new(),
    };
    let end = session.run(target, shutdown).await;
    runtime.fleet.unlinked(&session.edge_id);
    runtime.permits.unlink(session.conn.link);
    // Stop everything started on this connection and give it a moment to say so.
    let why = match &end {
        SessionEnd::Shutdown => "the node is shutting down".to_string(),
        SessionEnd::Fatal(error) | SessionEnd::Retry { error, .. } => {
            format!("the node's connection to the edge ended: {error}")
        }
    };
    // Its runs and tunnels go on detached for an edge to re-attach them, unless the node
    // shuts down (or the edge set no re-attach wait): then they stop, and are given a
    // moment to say so.
    let shutdown = matches!(end, SessionEnd::Shutdown);
    runtime.journal.detach(session.conn.id, &why, shutdown);
    session.conn.stop(why);
    session.conn.tasks.close();
    if shutdown || runtime.journal.wait().is_zero() {
        let _ = timeout(DRAIN_GRACE, session.conn.tasks.wait()).await;
    }
    drop(session);
    if timeout(Duration::from_millis(500), &mut writer)
        .await
        .is_err()
    {
        writer.abort();
    }
    end
}

/// The provider health this connection last reported, by provider id.
#[derive(Debug, Default)]
struct HealthReported(std::collections::HashMap<String, pb::ProviderHealth>);

impl HealthReported {
    /// Whether `h` says something the edge has not heard on this connection (a provider
    /// never reported counts as unknown without an error).
    fn differs(&self, h: &pb::ProviderHealth) -> bool {
        match self.0.get(&h.provider_id) {
            Some(last) => {
                (last.state, &last.last_error, last.last_error_unix_ms)
                    != (h.state, &h.last_error, h.last_error_unix_ms)
            }
            None => h.state() != pb::ProviderHealthState::Unknown || !h.last_error.is_empty(),
        }
    }
}

struct Session {
    runtime: Arc<NodeRuntime>,
    reader: FrameReader,
    outbound: Outbound,
    conn: Connection,
    addr: String,
    /// The edge's id in its fleet (empty for an edge on its own).
    edge_id: String,
}

/// Why the edge refused this node, as a fatal end or a retry.
fn refused(addr: &str, response: &pb::RegisterResponse) -> SessionEnd {
    use pb::RegisterRejectReason as R;
    let reason = &response.reason;
    match response.reject_reason() {
        R::UnknownToken => SessionEnd::Fatal(format!(
            "the edge at {addr} rejected this node's token: {reason} (check --token / IOP_NODE_TOKEN and the edge's nodes[].token, or the join string)"
        )),
        R::Revoked => SessionEnd::Fatal(format!(
            "revoked: the edge at {addr} revoked this node's credentials: {reason}"
        )),
        R::JoinTokenExpired => SessionEnd::Fatal(format!("the join token expired: {reason}")),
        R::JoinTokenUsedUp => SessionEnd::Fatal(format!("the join token is used up: {reason}")),
        R::ConfigBuildFailed => SessionEnd::Fatal(format!(
            "the edge could not build this node's config: {reason}"
        )),
        // Someone at this node's address sent bad credentials: the wait passes.
        R::Throttled => retry_next(
            format!("the edge is holding back registrations from this address: {reason}"),
            match response.retry_after_ms {
                0 => NextAttempt::Interval,
                ms => NextAttempt::After(Duration::from_millis(ms)),
            },
        ),
        _ => retry(format!("the edge rejected the registration: {reason}")),
    }
}

/// A read error that means the edge refused this node's client certificate (TLS 1.3 tells
/// the client after its side of the handshake): fatal, retrying presents the same one.
fn certificate_refused(addr: &str, err: &FrameError) -> Option<SessionEnd> {
    use rustls::AlertDescription as A;
    let FrameError::Io(io) = err else { return None };
    let alert = crate::tls::received_alert(io)?;
    matches!(
        alert,
        A::BadCertificate
            | A::UnknownCA
            | A::CertificateRevoked
            | A::CertificateExpired
            | A::CertificateUnknown
            | A::UnsupportedCertificate
            | A::AccessDenied
            | A::DecryptError
    )
    .then(|| {
        SessionEnd::Fatal(format!(
            "the edge at {addr} refused this node's client certificate ({alert:?}): it is not from a CA the edge trusts, or it has expired"
        ))
    })
}

impl Session {
    async fn run(&mut self, target: &EdgeTarget, shutdown: &CancellationToken) -> SessionEnd {
        let register = target.link.register_request();
        if self.outbound.send(register).await.is_err() {
            return retry("the edge closed the connection before registration");
        }
        let response = match self.handshake_frame(shutdown).await {
            Ok(Message::RegisterResponse(r)) => r,
            Ok(other) => {
                return retry(format!(
                    "the edge answered registration with {}",
                    kind(&pb::Envelope {
                        message: Some(other)
                    })
                ));
            }
            Err(end) => return end,
        };
        if !response.accepted {
            return refused(&self.addr, &response);
        }
        let node_id = response.node_id.clone();
        if let Some(credential) = &response.credential
            && let Err(e) = target.link.joined(&node_id, credential)
        {
            return SessionEnd::Fatal(e);
        }
        // Only now: the links to the fleet's other edges present the credential a join
        // just gave, never the join token again.
        self.edge_id = response.edge_id.clone();
        self.runtime.fleet.linked(&self.edge_id, &self.addr);
        self.runtime.fleet.listed(&response.fleet);
        let Some(payload) = response.config else {
            return SessionEnd::Fatal(
                "the edge accepted the registration but sent no config".into(),
            );
        };
        if let Err(e) = self.runtime.apply(&payload) {
            return SessionEnd::Fatal(format!("cannot apply the config from the edge: {e}"));
        }
        tracing::info!(%node_id, edge = %self.addr, credential = target.link.credential_kind(), "registered; adapters ready");
        // This edge's permits go out before the ready request, so it never admits
        // without them.
        self.conn.link = self.runtime.permits.link(&self.outbound);
        if self
            .outbound
            .send(pb::NodeReadyRequest {
                node_id: node_id.clone(),
            })
            .await
            .is_err()
        {
            return retry("the edge closed the connection before ready");
        }
        match self.handshake_frame(shutdown).await {
            Ok(Message::NodeReadyResponse(r)) if r.ready => {}
            Ok(Message::NodeReadyResponse(r)) => {
                return retry(format!("the edge refused ready: {}", r.reason));
            }
            Ok(other) => {
                return retry(format!(
                    "the edge answered ready with {}",
                    kind(&pb::Envelope {
                        message: Some(other)
                    })
                ));
            }
            // The edge took the registration and then the connection ended (it stopped or
            // died before its ready answer reached us): back as soon as it is reachable,
            // not a whole interval later.
            Err(SessionEnd::Retry {
                error, was_ready, ..
            }) => {
                return SessionEnd::Retry {
                    error,
                    was_ready,
                    next: NextAttempt::WhenReachable,
                };
            }
            Err(end) => return end,
        }
        tracing::info!(%node_id, edge = %self.addr, edge_id = %self.edge_id, "dispatch-ready");
        if target.fleet_edge.is_none() {
            let mut t = self.runtime.transport.lock();
            t.state = "ready";
            t.sessions_started += 1;
            t.connected_since_ms = Some(now_ms());
        }
        match self.serve(shutdown).await {
            SessionEnd::Retry { error, .. } => SessionEnd::Retry {
                error,
                was_ready: true,
                next: NextAttempt::WhenReachable,
            },
            other => other,
        }
    }

    /// The next handshake frame, skipping heartbeats (and taking permit reports).
    async fn handshake_frame(
        &mut self,
        shutdown: &CancellationToken,
    ) -> Result<Message, SessionEnd> {
        let deadline = Instant::now() + HANDSHAKE_TIMEOUT;
        loop {
            let frame = tokio::select! {
                _ = shutdown.cancelled() => return Err(SessionEnd::Shutdown),
                f = timeout_at(deadline, self.reader.next()) => f,
            };
            match frame {
                Err(_) => return Err(retry("the edge did not answer the handshake in time")),
                Ok(None) => {
                    return Err(retry("the edge closed the connection during the handshake"));
                }
                Ok(Some(Err(e))) => {
                    return Err(certificate_refused(&self.addr, &e)
                        .unwrap_or_else(|| retry(format!("bad frame from the edge: {e}"))));
                }
                Ok(Some(Ok(envelope))) => match envelope.message {
                    Some(Message::Ping(p)) => {
                        self.outbound.try_send(pb::Pong { nonce: p.nonce });
                    }
                    Some(Message::Pong(_)) | None => {}
                    // The edge acknowledging its first permits, before its ready answer.
                    Some(Message::PermitReport(report)) => {
                        self.runtime.permits.report(self.conn.link, &report);
                    }
                    Some(message) => return Ok(message),
                },
            }
        }
    }

    async fn serve(&mut self, shutdown: &CancellationToken) -> SessionEnd {
        self.runtime.journal.link_up(self.conn.link_out());
        let mut heartbeat = Heartbeat::new();
        let mut health = self.runtime.watch_health();
        health.mark_unchanged();
        let mut reported = HealthReported::default();
        let mut retry_health = self.report_health(&mut reported);
        let mut recheck = tokio::time::interval(Duration::from_millis(crate::permits::RECHECK_MS));
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return SessionEnd::Shutdown,
                _ = recheck.tick() => self.runtime.permits.tick(),
                Ok(()) = health.changed() => retry_health = self.report_health(&mut reported),
                _ = tokio::time::sleep(HEALTH_RETRY), if retry_health => {
                    retry_health = self.report_health(&mut reported);
                }
                frame = heartbeat::next_frame(heartbeat.deadline(), &mut self.reader) => match frame {
                    None => return retry(heartbeat.timeout_reason("edge")),
                    Some(None) => return retry("the edge closed the connection"),
                    Some(Some(Err(e))) => return retry(format!("bad frame from the edge: {e}")),
                    Some(Some(Ok(envelope))) => {
                        heartbeat.seen();
                        if let Some(end) = self.dispatch(envelope) {
                            return end;
                        }
                    }
                },
                ping = heartbeat.ping() => {
                    self.conn.marks.pinged(ping.nonce);
                    self.outbound.try_send(ping);
                }
            }
        }
    }

    /// Tells the edge every provider health that differs from what this connection last
    /// reported (at first: from unknown). Returns whether the report could not be queued
    /// and must be tried again.
    fn report_health(&mut self, reported: &mut HealthReported) -> bool {
        let changed: Vec<pb::ProviderHealth> = self
            .runtime
            .health_reports()
            .into_iter()
            .filter(|h| reported.differs(h))
            .collect();
        if changed.is_empty() {
            return false;
        }
        let report = pb::ProviderHealthReport {
            providers: changed.clone(),
        };
        // Never wait here: a full queue is tried again after HEALTH_RETRY.
        if !self.outbound.try_send(report) {
            return true;
        }
        for h in changed {
            reported.0.insert(h.provider_id.clone(), h);
        }
        false
    }

    fn dispatch(&mut self, envelope: pb::Envelope) -> Option<SessionEnd> {
        let name = kind(&envelope);
        match envelope.message? {
            Message::Ping(p) => {
                self.outbound.try_send(pb::Pong { nonce: p.nonce });
            }
            Message::Pong(pong) => self.conn.marks.answered(pong.nonce),
            Message::RegisterResponse(response) if !response.accepted => {
                // The edge withdrew the registration (an admin revoked this node).
                return Some(refused(&self.addr, &response));
            }
            Message::RunRequest(request) => self.runtime.start_run(*request, &self.conn),
            Message::ProviderTunnelRequest(request) => {
                self.runtime.start_tunnel(*request, &self.conn)
            }
            Message::StreamsReceived(received) => {
                for id in &received.stream_ids {
                    self.runtime.journal.forget_ended(id);
                }
            }
            Message::StreamCredit(credit) => {
                self.runtime.journal.grant(&credit.stream_id, credit.frames)
            }
            Message::StreamResume(resume) => {
                let runtime = self.runtime.clone();
                let link = self.conn.link_out();
                self.conn.tasks.spawn(async move {
                    let resumed = runtime.journal.resume(&resume, link).await;
                    tracing::info!(stream_id = %resume.stream_id, received = resume.received, outcome = ?resumed, "an edge re-attached a stream after its link dropped");
                });
            }
            Message::CancelRequest(mut request) => {
                // A stream a client resumed elsewhere is no longer this edge's to cancel.
                let stream = match request.kind() {
                    pb::CancelKind::CancelRun => Some(&mut request.run_id),
                    pb::CancelKind::CancelTunnel => Some(&mut request.request_id),
                    _ => None,
                };
                if let Some(id) = stream {
                    match self.runtime.journal.cancel_target(id) {
                        Some(target) => *id = target,
                        None => return None,
                    }
                }
                let runtime = self.runtime.clone();
                let outbound = self.outbound.clone();
                self.conn.tasks.spawn(async move {
                    let response = runtime.cancel(&request).await;
                    if !request.command_id.is_empty() {
                        let _ = outbound.send(response).await;
                    }
                });
            }
            Message::NodeCommandRequest(request) => {
                let Ok(place) = self.conn.commands.clone().try_acquire_owned() else {
                    self.outbound.try_send(NodeRuntime::busy(&request));
                    return None;
                };
                let runtime = self.runtime.clone();
                let outbound = self.outbound.clone();
                self.conn.tasks.spawn(async move {
                    let response = runtime.command(&request).await;
                    drop(place);
                    let _ = outbound.send(response).await;
                });
            }
            Message::FleetUpdate(update) => self.runtime.fleet.listed(&update.edges),
            Message::PermitReport(report) => self.runtime.permits.report(self.conn.link, &report),
            Message::ConfigRefresh(refresh) => {
                if let Some(payload) = refresh.config
                    && let Err(e) = self.runtime.apply(&payload)
                {
                    tracing::error!(error = %e, "config refresh could not be applied; keeping the previous config");
                }
            }
            _ => tracing::warn!(kind = name, "unexpected frame from the edge ignored"),
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refusal(reason: pb::RegisterRejectReason) -> SessionEnd {
        refused(
            "edge:7700",
            &pb::RegisterResponse {
                accepted: false,
                reject_reason: reason as i32,
                reason: "the edge's reason".into(),
                ..Default::default()
            },
        )
    }

    #[test]
    fn a_throttled_registration_comes_back_when_the_edge_said() {
        let throttled = |ms| {
            refused(
                "edge:7700",
                &pb::RegisterResponse {
                    reject_reason: pb::RegisterRejectReason::Throttled as i32,
                    retry_after_ms: ms,
                    ..Default::default()
                },
            )
        };
        assert!(matches!(
            throttled(300),
            SessionEnd::Retry { next: NextAttempt::After(d), .. } if d == Duration::from_millis(300)
        ));
        // An edge that names no time: the interval.
        assert!(matches!(
            throttled(0),
            SessionEnd::Retry {
                next: NextAttempt::Interval,
                ..
            }
        ));
    }

    #[test]
    fn a_throttled_registration_is_retried_and_refused_credentials_are_fatal() {
        use pb::RegisterRejectReason as R;
        assert!(matches!(refusal(R::Throttled), SessionEnd::Retry { .. }));
        assert!(matches!(
            refusal(R::DuplicateConnection),
            SessionEnd::Retry { .. }
        ));
        for (reason, says) in [
            (R::Revoked, "revoked"),
            (R::JoinTokenExpired, "join token expired"),
            (R::JoinTokenUsedUp, "join token is used up"),
            (R::UnknownToken, "rejected this node's token"),
        ] {
            match refusal(reason) {
                SessionEnd::Fatal(message) => {
                    assert!(message.contains(says), "{reason:?}: {message}");
                    assert!(message.contains("the edge's reason"), "{message}");
                }
                other => panic!("{reason:?} should be fatal, got {other:?}"),
            }
        }
    }
}
