//! `limits.http`: what one HTTP client may cost the edge — how long it may take to send a
//! request head and body, how long a keep-alive connection may sit idle, how long it may
//! stop reading a response, how many connections are open at once, and how large an
//! answer the edge assembles for a non-streamed response.

use super::FieldError;
use std::time::Duration;

use serde::Deserialize;

pub const DEFAULT_HEADER_TIMEOUT_SEC: u64 = 10;
pub const DEFAULT_BODY_TIMEOUT_SEC: u64 = 60;
pub const DEFAULT_IDLE_TIMEOUT_SEC: u64 = 60;
pub const DEFAULT_WRITE_TIMEOUT_SEC: u64 = 60;
pub const DEFAULT_STREAM_KEEPALIVE_SEC: u64 = 15;
/// Longest `stream_keepalive_sec`.
pub const MAX_STREAM_KEEPALIVE_SEC: u64 = 3600;
/// The connection cap when it is not configured and the open-files limit is unknown.
pub const DEFAULT_MAX_CONNECTIONS: usize = 4096;
pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 8 * 1024 * 1024;
pub const DEFAULT_MAX_CONNECTIONS_PER_ADDRESS: usize = 1024;
pub const DEFAULT_LARGE_BODY_BYTES: usize = 256 * 1024;
pub const DEFAULT_LARGE_BODY_WORKERS: usize = 2;
pub const DEFAULT_LARGE_BODIES_PER_KEY: usize = 8;
pub const DEFAULT_LARGE_BODIES_WAITING: usize = 64;

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpLimitsConfig {
    /// A request head must be complete this long after its first byte (for a new
    /// connection: after it was accepted).
    #[serde(default = "default_header_timeout")]
    pub header_timeout_sec: u64,
    /// A request body must be complete this long after its head.
    #[serde(default = "default_body_timeout")]
    pub body_timeout_sec: u64,
    /// A keep-alive connection with no request in progress is closed after this long.
    #[serde(default = "default_idle_timeout")]
    pub idle_timeout_sec: u64,
    /// A client that accepts no response bytes for this long is disconnected (its request
    /// is cancelled and its provider slot returned).
    #[serde(default = "default_write_timeout")]
    pub write_timeout_sec: u64,
    /// A streamed request (an OpenAI, Responses or Messages event stream) that has no
    /// answer yet after this long — it waits in the queue, or its provider is still reading
    /// a long prompt — is answered at once with the stream's head and an SSE comment, and a
    /// comment again at this interval until the answer begins, so reverse proxies and load
    /// balancers that cut silent connections do not cut it. A failure after that arrives as
    /// the API's own error event instead of an HTTP error status. 0: never.
    #[serde(default = "default_stream_keepalive")]
    pub stream_keepalive_sec: u64,
    /// Open HTTP connections at most; more are answered 503 and closed at once. Left
    /// out: derived from the open-files limit (see `http::server::effective_max_connections`).
    #[serde(default)]
    pub max_connections: Option<usize>,
    /// Open HTTP connections from one address (an IPv6 /64 counts as one) at most; more
    /// are answered 503 and closed at once. Trusted proxies are not capped.
    #[serde(default = "default_max_connections_per_address")]
    pub max_connections_per_address: usize,
    /// Load balancers and reverse proxies in front of the edge (addresses or CIDR
    /// ranges): their `X-Forwarded-For` names the client, and they are not capped per
    /// address. Nobody else's `X-Forwarded-For` is believed.
    #[serde(default)]
    pub trusted_proxies: Vec<String>,
    /// Largest answer the edge assembles into one non-streamed JSON response (a longer one
    /// ends the request with 502 and cancels it), or holds for a translated Responses
    /// stream (a longer one ends with `response.failed` and is cancelled).
    #[serde(default = "default_max_response_bytes")]
    pub max_response_bytes: usize,
    /// A request body at least this large is decoded (parsed, translated) on a worker
    /// thread instead of the event loop that serves every connection and node link.
    #[serde(default = "default_large_body_bytes")]
    pub large_body_bytes: usize,
    /// Large bodies decoded at once (worker threads busy with them).
    #[serde(default = "default_large_body_workers")]
    pub large_body_workers: usize,
    /// Large bodies one key may have decoding or waiting at once; more are answered 429.
    #[serde(default = "default_large_bodies_per_key")]
    pub large_bodies_per_key: usize,
    /// Large bodies waiting for a worker, shared fairly between keys (a key holds at most
    /// the list over the keys waiting; a key with none waiting always gets a place); more
    /// are answered 503.
    #[serde(default = "default_large_bodies_waiting")]
    pub large_bodies_waiting: usize,
    /// The network prefix (bits) IPv4 clients are grouped by when a full connection table
    /// shares itself out (`http::connection_table`).
    #[serde(default = "default_share_prefix_v4")]
    pub share_prefix_v4: u8,
    /// The same for IPv6 clients.
    #[serde(default = "default_share_prefix_v6")]
    pub share_prefix_v6: u8,
}

pub const DEFAULT_SHARE_PREFIX_V4: u8 = 24;
pub const DEFAULT_SHARE_PREFIX_V6: u8 = 48;

fn default_share_prefix_v4() -> u8 {
    DEFAULT_SHARE_PREFIX_V4
}
fn default_share_prefix_v6() -> u8 {
    DEFAULT_SHARE_PREFIX_V6
}

fn default_header_timeout() -> u64 {
    DEFAULT_HEADER_TIMEOUT_SEC
}
fn default_body_timeout() -> u64 {
    DEFAULT_BODY_TIMEOUT_SEC
}
fn default_idle_timeout() -> u64 {
    DEFAULT_IDLE_TIMEOUT_SEC
}
fn default_write_timeout() -> u64 {
    DEFAULT_WRITE_TIMEOUT_SEC
}
fn default_stream_keepalive() -> u64 {
    DEFAULT_STREAM_KEEPALIVE_SEC
}
fn default_max_connections_per_address() -> usize {
    DEFAULT_MAX_CONNECTIONS_PER_ADDRESS
}
fn default_max_response_bytes() -> usize {
    DEFAULT_MAX_RESPONSE_BYTES
}
fn default_large_body_bytes() -> usize {
    DEFAULT_LARGE_BODY_BYTES
}
fn default_large_body_workers() -> usize {
    DEFAULT_LARGE_BODY_WORKERS
}
fn default_large_bodies_per_key() -> usize {
    DEFAULT_LARGE_BODIES_PER_KEY
}
fn default_large_bodies_waiting() -> usize {
    DEFAULT_LARGE_BODIES_WAITING
}

impl Default for HttpLimitsConfig {
    fn default() -> Self {
        Self {
            header_timeout_sec: DEFAULT_HEADER_TIMEOUT_SEC,
            body_timeout_sec: DEFAULT_BODY_TIMEOUT_SEC,
            idle_timeout_sec: DEFAULT_IDLE_TIMEOUT_SEC,
            write_timeout_sec: DEFAULT_WRITE_TIMEOUT_SEC,
            stream_keepalive_sec: DEFAULT_STREAM_KEEPALIVE_SEC,
            max_connections: None,
            max_connections_per_address: DEFAULT_MAX_CONNECTIONS_PER_ADDRESS,
            trusted_proxies: Vec::new(),
            max_response_bytes: DEFAULT_MAX_RESPONSE_BYTES,
            large_body_bytes: DEFAULT_LARGE_BODY_BYTES,
            large_body_workers: DEFAULT_LARGE_BODY_WORKERS,
            large_bodies_per_key: DEFAULT_LARGE_BODIES_PER_KEY,
            large_bodies_waiting: DEFAULT_LARGE_BODIES_WAITING,
            share_prefix_v4: DEFAULT_SHARE_PREFIX_V4,
            share_prefix_v6: DEFAULT_SHARE_PREFIX_V6,
        }
    }
}

impl HttpLimitsConfig {
    pub fn header_timeout(&self) -> Duration {
        Duration::from_secs(self.header_timeout_sec)
    }
    pub fn body_timeout(&self) -> Duration {
        Duration::from_secs(self.body_timeout_sec)
    }
    pub fn idle_timeout(&self) -> Duration {
        Duration::from_secs(self.idle_timeout_sec)
    }
    pub fn write_timeout(&self) -> Duration {
        Duration::from_secs(self.write_timeout_sec)
    }
    /// How often a waiting stream gets a keepalive; `None`: never.
    pub fn stream_keepalive(&self) -> Option<Duration> {
        (self.stream_keepalive_sec > 0).then(|| Duration::from_secs(self.stream_keepalive_sec))
    }

    /// The bounds; the error names the field.
    pub fn validate(&self) -> Result<(), FieldError> {
        const DAY: u64 = 24 * 3600;
        for (field, value) in [
            ("header_timeout_sec", self.header_timeout_sec),
            ("body_timeout_sec", self.body_timeout_sec),
            ("idle_timeout_sec", self.idle_timeout_sec),
            ("write_timeout_sec", self.write_timeout_sec),
        ] {
            if value == 0 || value > DAY {
                return Err(FieldError::new(
                    field.into(),
                    format!("must be between 1 and {DAY} seconds"),
                ));
            }
        }
        if self.stream_keepalive_sec > MAX_STREAM_KEEPALIVE_SEC {
            return Err(FieldError::new(
                "stream_keepalive_sec".into(),
                format!("must be between 0 (never) and {MAX_STREAM_KEEPALIVE_SEC} seconds"),
            ));
        }
        if self.max_connections.is_some_and(|n| n == 0 || n > 1 << 20) {
            return Err(FieldError::new(
                "max_connections".into(),
                "must be between 1 and 1048576".into(),
            ));
        }
        for (field, value, max) in [
            ("large_body_workers", self.large_body_workers, 256),
            ("large_bodies_per_key", self.large_bodies_per_key, 1 << 16),
            ("large_bodies_waiting", self.large_bodies_waiting, 1 << 16),
        ] {
            if value == 0 || value > max {
                return Err(FieldError::new(
                    field.into(),
                    format!("must be between 1 and {max}"),
                ));
            }
        }
        if self.max_connections_per_address == 0 || self.max_connections_per_address > 1 << 20 {
            return Err(FieldError::new(
                "max_connections_per_address".into(),
                "must be between 1 and 1048576".into(),
            ));
        }
        if let Err(e) = parse_proxies(&self.trusted_proxies) {
            return Err(FieldError::new("trusted_proxies".into(), e));
        }
        if self.max_response_bytes < 1024 {
            return Err(FieldError::new(
                "max_response_bytes".into(),
                "must be at least 1024".into(),
            ));
        }
        for (field, value, max) in [
            ("share_prefix_v4", self.share_prefix_v4, 32),
            ("share_prefix_v6", self.share_prefix_v6, 128),
        ] {
            if value > max {
                return Err(FieldError::new(
                    field.into(),
                    format!("must be a prefix length from 0 to {max}"),
                ));
            }
        }
        Ok(())
    }

    /// Settings that only a restart applies (the listener reads them when it starts).
    pub fn needs_restart(&self, new: &Self) -> bool {
        Self {
            max_response_bytes: new.max_response_bytes,
            ..self.clone()
        } != *new
    }
}

/// `trusted_proxies` as address ranges: addresses and CIDR ranges (`10.0.0.0/8`,
/// `192.0.2.7`, `2001:db8::/32`).
pub fn parse_proxies(entries: &[String]) -> Result<Vec<ipnet::IpNet>, String> {
    entries
        .iter()
        .map(|e| {
            e.parse::<ipnet::IpNet>()
                .or_else(|_| e.parse::<std::net::IpAddr>().map(ipnet::IpNet::from))
                .map_err(|_| format!("{e:?} is not an IP address or CIDR range"))
        })
        .collect()
}
