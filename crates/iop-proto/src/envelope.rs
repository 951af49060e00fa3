//! Conveniences on the generated envelope: `From` for every message it can carry and a
//! short name per message kind for logs.

use crate::pb::{self, Envelope, envelope::Message};

macro_rules! into_envelope {
    ($($ty:ident => $variant:ident),* $(,)?) => {
        $(impl From<pb::$ty> for Envelope {
            fn from(m: pb::$ty) -> Self {
                Envelope { message: Some(Message::$variant(m.into())) }
            }
        })*
    };
}

into_envelope! {
    RegisterRequest => RegisterRequest,
    RegisterResponse => RegisterResponse,
    NodeReadyRequest => NodeReadyRequest,
    NodeReadyResponse => NodeReadyResponse,
    RunRequest => RunRequest,
    RunEvent => RunEvent,
    CancelRequest => CancelRequest,
    CancelResponse => CancelResponse,
    NodeCommandRequest => NodeCommandRequest,
    NodeCommandResponse => NodeCommandResponse,
    ProviderTunnelRequest => ProviderTunnelRequest,
    ProviderTunnelFrame => ProviderTunnelFrame,
    ConfigRefresh => ConfigRefresh,
    Ping => Ping,
    Pong => Pong,
    EdgeNodeEvent => EdgeNodeEvent,
    StreamCredit => StreamCredit,
    ProviderHealthReport => ProviderHealthReport,
    FleetUpdate => FleetUpdate,
    PermitGrant => PermitGrant,
    PermitReport => PermitReport,
    StreamResume => StreamResume,
    StreamsReceived => StreamsReceived,
    OrphanUsage => OrphanUsage,
}

/// A short name of the envelope's message kind, for logs.
pub fn kind(envelope: &Envelope) -> &'static str {
    match &envelope.message {
        None => "empty",
        Some(Message::RegisterRequest(_)) => "register_request",
        Some(Message::RegisterResponse(_)) => "register_response",
        Some(Message::NodeReadyRequest(_)) => "node_ready_request",
        Some(Message::NodeReadyResponse(_)) => "node_ready_response",
        Some(Message::RunRequest(_)) => "run_request",
        Some(Message::RunEvent(_)) => "run_event",
        Some(Message::CancelRequest(_)) => "cancel_request",
        Some(Message::CancelResponse(_)) => "cancel_response",
        Some(Message::NodeCommandRequest(_)) => "node_command_request",
        Some(Message::NodeCommandResponse(_)) => "node_command_response",
        Some(Message::ProviderTunnelRequest(_)) => "provider_tunnel_request",
        Some(Message::ProviderTunnelFrame(_)) => "provider_tunnel_frame",
        Some(Message::ConfigRefresh(_)) => "config_refresh",
        Some(Message::Ping(_)) => "ping",
        Some(Message::Pong(_)) => "pong",
        Some(Message::EdgeNodeEvent(_)) => "edge_node_event",
        Some(Message::StreamCredit(_)) => "stream_credit",
        Some(Message::ProviderHealthReport(_)) => "provider_health_report",
        Some(Message::FleetUpdate(_)) => "fleet_update",
        Some(Message::PermitGrant(_)) => "permit_grant",
        Some(Message::PermitReport(_)) => "permit_report",
        Some(Message::StreamResume(_)) => "stream_resume",
        Some(Message::StreamsReceived(_)) => "streams_received",
        Some(Message::OrphanUsage(_)) => "orphan_usage",
    }
}

impl pb::RunEvent {
    /// Whether this event ends its run (complete, error or cancelled).
    pub fn is_terminal(&self) -> bool {
        matches!(
            self.kind(),
            pb::RunEventKind::Complete | pb::RunEventKind::Error | pb::RunEventKind::Cancelled
        )
    }
}

impl pb::CancelRequest {
    /// Cancel one run.
    pub fn run(run_id: &str, reason: &str) -> Self {
        Self {
            kind: pb::CancelKind::CancelRun as i32,
            run_id: run_id.to_string(),
            reason: reason.to_string(),
            ..Default::default()
        }
    }

    /// Cancel one provider tunnel.
    pub fn tunnel(request_id: &str, reason: &str) -> Self {
        Self {
            kind: pb::CancelKind::CancelTunnel as i32,
            request_id: request_id.to_string(),
            reason: reason.to_string(),
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The relay moves every frame in an envelope several times on its way; a message
    /// added to the envelope bigger than a tunnel frame must be boxed (`build.rs`), or
    /// every frame pays for its size.
    #[test]
    fn an_envelope_is_no_bigger_than_a_tunnel_frame() {
        let frame = std::mem::size_of::<pb::ProviderTunnelFrame>();
        let envelope = std::mem::size_of::<Envelope>();
        assert!(
            envelope <= frame + 8,
            "Envelope is {envelope} bytes, a tunnel frame {frame}: box the new big message in build.rs"
        );
    }
}
