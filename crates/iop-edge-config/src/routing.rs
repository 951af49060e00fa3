//! `routing:` of a model group: how a request picks its member (see `crate::routing`).

use serde::{Deserialize, Serialize};

/// How a model group picks among its members.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RoutingPolicy {
    /// The member with the fewest requests in flight (ties round-robin).
    LeastInFlight,
    /// Sticky by session key; least-in-flight without one.
    Session,
    /// Sticky by shared prompt prefix.
    Prefix,
    /// Session key when the request has one, else prompt prefix.
    #[default]
    SessionPrefix,
}

impl RoutingPolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            RoutingPolicy::LeastInFlight => "least_in_flight",
            RoutingPolicy::Session => "session",
            RoutingPolicy::Prefix => "prefix",
            RoutingPolicy::SessionPrefix => "session_prefix",
        }
    }

    pub fn uses_session(self) -> bool {
        matches!(self, RoutingPolicy::Session | RoutingPolicy::SessionPrefix)
    }

    pub fn uses_prefix(self) -> bool {
        matches!(self, RoutingPolicy::Prefix | RoutingPolicy::SessionPrefix)
    }
}
