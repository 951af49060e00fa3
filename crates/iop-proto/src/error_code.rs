//! The typed reason of every error that reaches a client: [`ErrorCode`] (generated from
//! `runtime.proto`, so the node sends the same values it produces) with the one table that
//! says, per reason, who is at fault, which HTTP status a client gets, and whether the
//! edge may retry the request on another member.
//!
//! "Retryable" only ever applies before the provider accepted the request and before any
//! byte reached the client: the dispatcher checks that phase itself. A reason is
//! retryable when the failed attempt cannot have done work another member would repeat
//! (nothing was sent, the node refused it, the provider refused it outright).

use crate::pb::{self, ErrorCode};

/// Who caused a failure (pingora's shape: downstream, internal, upstream — with the
/// upstream split into the node and the provider behind it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fault {
    /// The client: a bad request, a missing permission, a client that went away.
    Client,
    /// The edge itself: its queue, its limits, a bug.
    Edge,
    /// The node: its link, its capacity gate, its config.
    Node,
    /// The provider behind the node: unreachable, slow, failing, refusing.
    Provider,
}

impl Fault {
    pub fn as_str(self) -> &'static str {
        match self {
            Fault::Client => "client",
            Fault::Edge => "edge",
            Fault::Node => "node",
            Fault::Provider => "provider",
        }
    }
}

/// One row of the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Disposition {
    /// The snake_case name: OpenAI's `code`, the `x-iop-error` header, the metrics outcome.
    pub name: &'static str,
    /// The HTTP status a client gets when this ends its request before the response began.
    pub status: u16,
    pub fault: Fault,
    /// Whether the edge may send the request to another member (before anything reached
    /// the client and before the provider accepted it).
    pub retryable: bool,
}

const fn row(name: &'static str, status: u16, fault: Fault, retryable: bool) -> Disposition {
    Disposition {
        name,
        status,
        fault,
        retryable,
    }
}

impl ErrorCode {
    /// The table.
    pub const fn disposition(self) -> Disposition {
        use Fault::*;
        match self {
            // An older node sent only a string it did not map: count it as the provider's.
            ErrorCode::Unspecified => row("provider_error", 502, Provider, false),
            ErrorCode::BadRequest => row("bad_request", 400, Client, false),
            ErrorCode::InvalidApiKey => row("invalid_api_key", 401, Client, false),
            ErrorCode::InsufficientPermissions => {
                row("insufficient_permissions", 403, Client, false)
            }
            ErrorCode::NotFound => row("not_found", 404, Client, false),
            ErrorCode::ModelNotFound => row("model_not_found", 404, Client, false),
            ErrorCode::UnknownTarget => row("unknown_target", 404, Client, false),
            ErrorCode::NotSupported => row("not_supported", 400, Client, false),
            ErrorCode::ContextLengthExceeded => row("context_length_exceeded", 400, Client, false),
            ErrorCode::RequestTooLarge => row("request_too_large", 413, Client, false),
            ErrorCode::RequestTimeout => row("request_timeout", 408, Client, false),
            ErrorCode::UnsupportedMediaType => row("unsupported_media_type", 415, Client, false),
            ErrorCode::TooManyFailedAttempts => row("too_many_failed_attempts", 429, Client, false),
            ErrorCode::ClientAbort => row("client_abort", 499, Client, false),
            ErrorCode::Cancelled => row("cancelled", 499, Client, false),
            ErrorCode::SessionBusy => row("session_busy", 409, Client, false),
            ErrorCode::RequestsPerMinuteExceeded => {
                row("requests_per_minute_exceeded", 429, Client, false)
            }
            ErrorCode::TokensPerDayExceeded => row("tokens_per_day_exceeded", 429, Client, false),
            ErrorCode::MaxConcurrentExceeded => row("max_concurrent_exceeded", 429, Client, false),
            ErrorCode::Conflict => row("conflict", 409, Client, false),
            ErrorCode::QueueFull => row("queue_full", 429, Edge, false),
            ErrorCode::QueueTimeout => row("queue_timeout", 503, Edge, false),
            ErrorCode::ModelUnavailable => row("model_unavailable", 503, Edge, false),
            ErrorCode::ResponseTooLarge => row("response_too_large", 502, Edge, false),
            ErrorCode::Internal => row("internal", 500, Edge, false),
            ErrorCode::NotImplemented => row("not_implemented", 501, Edge, false),
            ErrorCode::Unavailable => row("unavailable", 503, Edge, false),
            ErrorCode::NodeUnavailable => row("node_unavailable", 503, Node, false),
            ErrorCode::NodeDisconnected => row("node_disconnected", 503, Node, true),
            ErrorCode::NodeCapacity => row("node_capacity", 503, Node, true),
            ErrorCode::NodeTimeout => row("node_timeout", 504, Node, true),
            ErrorCode::UnknownAdapter => row("unknown_adapter", 502, Node, true),
            ErrorCode::NodeProtocol => row("node_protocol", 502, Node, false),
            ErrorCode::SessionLimit => row("session_limit", 503, Node, false),
            ErrorCode::ProviderUnreachable => row("provider_unreachable", 502, Provider, true),
            ErrorCode::ProviderTimeout => row("provider_timeout", 504, Provider, false),
            ErrorCode::ProviderIdleTimeout => row("provider_idle_timeout", 504, Provider, false),
            ErrorCode::ProviderRateLimited => row("provider_rate_limited", 429, Provider, true),
            ErrorCode::ProviderOverloaded => row("provider_overloaded", 503, Provider, true),
            ErrorCode::ProviderError => row("provider_error", 502, Provider, false),
            ErrorCode::ProviderAuth => row("provider_auth", 502, Provider, false),
            ErrorCode::BrokenStream => row("broken_stream", 502, Provider, false),
            ErrorCode::BadUpstreamResponse => row("bad_upstream_response", 502, Provider, false),
            ErrorCode::CliSpawn => row("cli_spawn", 502, Provider, true),
            ErrorCode::CliExit => row("cli_exit", 502, Provider, false),
            ErrorCode::CliOutput => row("cli_output", 502, Provider, false),
        }
    }

    /// The snake_case name (OpenAI's `code`, `x-iop-error`, the metrics outcome).
    pub const fn as_str(self) -> &'static str {
        self.disposition().name
    }

    pub const fn status(self) -> u16 {
        self.disposition().status
    }

    pub const fn fault(self) -> Fault {
        self.disposition().fault
    }

    pub const fn retryable(self) -> bool {
        self.disposition().retryable
    }

    /// Whether a failure with this reason proves the provider did no work on the request
    /// (nothing reached it, or it refused outright). After the node accepted a request,
    /// only these are retried: any other failure (the node's link dropped, it went
    /// silent) may have left the provider generating, and a second member would run the
    /// request twice.
    pub const fn refused_before_work(self) -> bool {
        matches!(
            self,
            ErrorCode::ProviderUnreachable
                | ErrorCode::ProviderRateLimited
                | ErrorCode::ProviderOverloaded
                | ErrorCode::NodeCapacity
                | ErrorCode::UnknownAdapter
                | ErrorCode::CliSpawn
        )
    }

    /// The reason a snake_case name stands for, including the names older nodes sent.
    pub fn from_name(name: &str) -> Option<Self> {
        let legacy = match name {
            "capacity" => Some(ErrorCode::NodeCapacity),
            "provider_stream_error" | "stream_closed" => Some(ErrorCode::BrokenStream),
            "upstream_error" => Some(ErrorCode::ProviderError),
            _ => None,
        };
        legacy.or_else(|| {
            ALL.iter()
                .copied()
                .find(|c| *c != ErrorCode::Unspecified && c.as_str() == name)
        })
    }

    /// The reason of a wire error: the enum, or for an older node its string.
    pub fn from_wire(reason: i32, code: &str) -> Self {
        match ErrorCode::try_from(reason) {
            Ok(ErrorCode::Unspecified) | Err(_) => {
                Self::from_name(code).unwrap_or(ErrorCode::Unspecified)
            }
            Ok(known) => known,
        }
    }

    /// The reason a provider's HTTP status stands for; `None` for a success (and for
    /// informational statuses, which are never final).
    pub fn from_provider_status(status: u16) -> Option<Self> {
        Some(match status {
            0..=399 => return None,
            400 | 422 => ErrorCode::BadRequest,
            401 | 403 => ErrorCode::ProviderAuth,
            404 => ErrorCode::UnknownTarget,
            413 => ErrorCode::RequestTooLarge,
            429 => ErrorCode::ProviderRateLimited,
            503 => ErrorCode::ProviderOverloaded,
            400..=499 => ErrorCode::BadRequest,
            _ => ErrorCode::ProviderError,
        })
    }
}

/// Every reason, in wire order.
pub const ALL: &[ErrorCode] = &[
    ErrorCode::Unspecified,
    ErrorCode::BadRequest,
    ErrorCode::InvalidApiKey,
    ErrorCode::InsufficientPermissions,
    ErrorCode::NotFound,
    ErrorCode::ModelNotFound,
    ErrorCode::UnknownTarget,
    ErrorCode::NotSupported,
    ErrorCode::ContextLengthExceeded,
    ErrorCode::RequestTooLarge,
    ErrorCode::RequestTimeout,
    ErrorCode::UnsupportedMediaType,
    ErrorCode::TooManyFailedAttempts,
    ErrorCode::ClientAbort,
    ErrorCode::Cancelled,
    ErrorCode::SessionBusy,
    ErrorCode::RequestsPerMinuteExceeded,
    ErrorCode::TokensPerDayExceeded,
    ErrorCode::MaxConcurrentExceeded,
    ErrorCode::Conflict,
    ErrorCode::QueueFull,
    ErrorCode::QueueTimeout,
    ErrorCode::ModelUnavailable,
    ErrorCode::ResponseTooLarge,
    ErrorCode::Internal,
    ErrorCode::NotImplemented,
    ErrorCode::Unavailable,
    ErrorCode::NodeUnavailable,
    ErrorCode::NodeDisconnected,
    ErrorCode::NodeCapacity,
    ErrorCode::NodeTimeout,
    ErrorCode::UnknownAdapter,
    ErrorCode::NodeProtocol,
    ErrorCode::SessionLimit,
    ErrorCode::ProviderUnreachable,
    ErrorCode::ProviderTimeout,
    ErrorCode::ProviderIdleTimeout,
    ErrorCode::ProviderRateLimited,
    ErrorCode::ProviderOverloaded,
    ErrorCode::ProviderError,
    ErrorCode::ProviderAuth,
    ErrorCode::BrokenStream,
    ErrorCode::BadUpstreamResponse,
    ErrorCode::CliSpawn,
    ErrorCode::CliExit,
    ErrorCode::CliOutput,
];

impl pb::RunError {
    /// An error with its reason (and the reason's name as the string code, for older edges).
    pub fn new(reason: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code: reason.as_str().to_string(),
            message: message.into(),
            reason: reason as i32,
        }
    }

    /// The typed reason (read from the string when an older node sent only that).
    pub fn error_code(&self) -> ErrorCode {
        ErrorCode::from_wire(self.reason, &self.code)
    }
}

impl pb::TunnelError {
    pub fn new(reason: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code: reason.as_str().to_string(),
            message: message.into(),
            reason: reason as i32,
        }
    }

    pub fn error_code(&self) -> ErrorCode {
        ErrorCode::from_wire(self.reason, &self.code)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Fault::*;

    /// The whole table, written out: a change to any status, fault or retry decision
    /// must change this test too.
    #[test]
    fn the_table_is_pinned() {
        let expected: &[(ErrorCode, &str, u16, Fault, bool)] = &[
            (
                ErrorCode::Unspecified,
                "provider_error",
                502,
                Provider,
                false,
            ),
            (ErrorCode::BadRequest, "bad_request", 400, Client, false),
            (
                ErrorCode::InvalidApiKey,
                "invalid_api_key",
                401,
                Client,
                false,
            ),
            (
                ErrorCode::InsufficientPermissions,
                "insufficient_permissions",
                403,
                Client,
                false,
            ),
            (ErrorCode::NotFound, "not_found", 404, Client, false),
            (
                ErrorCode::ModelNotFound,
                "model_not_found",
                404,
                Client,
                false,
            ),
            (
                ErrorCode::UnknownTarget,
                "unknown_target",
                404,
                Client,
                false,
            ),
            (ErrorCode::NotSupported, "not_supported", 400, Client, false),
            (
                ErrorCode::ContextLengthExceeded,
                "context_length_exceeded",
                400,
                Client,
                false,
            ),
            (
                ErrorCode::RequestTooLarge,
                "request_too_large",
                413,
                Client,
                false,
            ),
            (
                ErrorCode::RequestTimeout,
                "request_timeout",
                408,
                Client,
                false,
            ),
            (
                ErrorCode::UnsupportedMediaType,
                "unsupported_media_type",
                415,
                Client,
                false,
            ),
            (
                ErrorCode::TooManyFailedAttempts,
                "too_many_failed_attempts",
                429,
                Client,
                false,
            ),
            (ErrorCode::ClientAbort, "client_abort", 499, Client, false),
            (ErrorCode::Cancelled, "cancelled", 499, Client, false),
            (ErrorCode::SessionBusy, "session_busy", 409, Client, false),
            (
                ErrorCode::RequestsPerMinuteExceeded,
                "requests_per_minute_exceeded",
                429,
                Client,
                false,
            ),
            (
                ErrorCode::TokensPerDayExceeded,
                "tokens_per_day_exceeded",
                429,
                Client,
                false,
            ),
            (
                ErrorCode::MaxConcurrentExceeded,
                "max_concurrent_exceeded",
                429,
                Client,
                false,
            ),
            (ErrorCode::Conflict, "conflict", 409, Client, false),
            (ErrorCode::QueueFull, "queue_full", 429, Edge, false),
            (ErrorCode::QueueTimeout, "queue_timeout", 503, Edge, false),
            (
                ErrorCode::ModelUnavailable,
                "model_unavailable",
                503,
                Edge,
                false,
            ),
            (
                ErrorCode::ResponseTooLarge,
                "response_too_large",
                502,
                Edge,
                false,
            ),
            (ErrorCode::Internal, "internal", 500, Edge, false),
            (
                ErrorCode::NotImplemented,
                "not_implemented",
                501,
                Edge,
                false,
            ),
            (ErrorCode::Unavailable, "unavailable", 503, Edge, false),
            (
                ErrorCode::NodeUnavailable,
                "node_unavailable",
                503,
                Node,
                false,
            ),
            (
                ErrorCode::NodeDisconnected,
                "node_disconnected",
                503,
                Node,
                true,
            ),
            (ErrorCode::NodeCapacity, "node_capacity", 503, Node, true),
            (ErrorCode::NodeTimeout, "node_timeout", 504, Node, true),
            (
                ErrorCode::UnknownAdapter,
                "unknown_adapter",
                502,
                Node,
                true,
            ),
            (ErrorCode::NodeProtocol, "node_protocol", 502, Node, false),
            (ErrorCode::SessionLimit, "session_limit", 503, Node, false),
            (
                ErrorCode::ProviderUnreachable,
                "provider_unreachable",
                502,
                Provider,
                true,
            ),
            (
                ErrorCode::ProviderTimeout,
                "provider_timeout",
                504,
                Provider,
                false,
            ),
            (
                ErrorCode::ProviderIdleTimeout,
                "provider_idle_timeout",
                504,
                Provider,
                false,
            ),
            (
                ErrorCode::ProviderRateLimited,
                "provider_rate_limited",
                429,
                Provider,
                true,
            ),
            (
                ErrorCode::ProviderOverloaded,
                "provider_overloaded",
                503,
                Provider,
                true,
            ),
            (
                ErrorCode::ProviderError,
                "provider_error",
                502,
                Provider,
                false,
            ),
            (
                ErrorCode::ProviderAuth,
                "provider_auth",
                502,
                Provider,
                false,
            ),
            (
                ErrorCode::BrokenStream,
                "broken_stream",
                502,
                Provider,
                false,
            ),
            (
                ErrorCode::BadUpstreamResponse,
                "bad_upstream_response",
                502,
                Provider,
                false,
            ),
            (ErrorCode::CliSpawn, "cli_spawn", 502, Provider, true),
            (ErrorCode::CliExit, "cli_exit", 502, Provider, false),
            (ErrorCode::CliOutput, "cli_output", 502, Provider, false),
        ];
        assert_eq!(expected.len(), ALL.len(), "every reason has a row");
        for (code, name, status, fault, retryable) in expected.iter().copied() {
            let d = code.disposition();
            assert_eq!(
                (d.name, d.status, d.fault, d.retryable),
                (name, status, fault, retryable),
                "{code:?}"
            );
        }
    }

    #[test]
    fn every_wire_value_is_listed_and_named_as_in_the_proto() {
        for (i, code) in ALL.iter().enumerate() {
            assert!(ALL[..i].iter().all(|c| c != code), "{code:?} listed twice");
            if *code == ErrorCode::Unspecified {
                continue;
            }
            let proto = code
                .as_str_name()
                .strip_prefix("ERROR_CODE_")
                .unwrap()
                .to_ascii_lowercase();
            assert_eq!(code.as_str(), proto, "{code:?}");
            assert_eq!(ErrorCode::from_name(code.as_str()), Some(*code));
            assert_eq!(ErrorCode::from_wire(*code as i32, ""), *code);
        }
        // Every value the proto defines is in ALL.
        for n in 0..100 {
            if let Ok(code) = ErrorCode::try_from(n) {
                assert!(ALL.contains(&code), "{code:?} missing from ALL");
            }
        }
    }

    #[test]
    fn older_nodes_are_understood_by_their_strings() {
        assert_eq!(ErrorCode::from_wire(0, "capacity"), ErrorCode::NodeCapacity);
        assert_eq!(
            ErrorCode::from_wire(0, "provider_stream_error"),
            ErrorCode::BrokenStream
        );
        assert_eq!(
            ErrorCode::from_wire(0, "provider_unreachable"),
            ErrorCode::ProviderUnreachable
        );
        assert_eq!(ErrorCode::from_wire(0, "who-knows"), ErrorCode::Unspecified);
        assert_eq!(ErrorCode::from_wire(9999, "cli_exit"), ErrorCode::CliExit);
        let e = pb::TunnelError::new(ErrorCode::ProviderOverloaded, "busy");
        assert_eq!(
            (e.code.as_str(), e.error_code()),
            ("provider_overloaded", ErrorCode::ProviderOverloaded)
        );
    }

    #[test]
    fn provider_statuses_map_to_reasons() {
        assert_eq!(ErrorCode::from_provider_status(200), None);
        assert_eq!(
            ErrorCode::from_provider_status(429),
            Some(ErrorCode::ProviderRateLimited)
        );
        assert_eq!(
            ErrorCode::from_provider_status(503),
            Some(ErrorCode::ProviderOverloaded)
        );
        assert_eq!(
            ErrorCode::from_provider_status(500),
            Some(ErrorCode::ProviderError)
        );
        assert_eq!(
            ErrorCode::from_provider_status(401),
            Some(ErrorCode::ProviderAuth)
        );
        assert_eq!(
            ErrorCode::from_provider_status(404),
            Some(ErrorCode::UnknownTarget)
        );
        assert_eq!(
            ErrorCode::from_provider_status(418),
            Some(ErrorCode::BadRequest)
        );
    }
}
