//! `limits.nodes`: what the node listener allows before a connection has authenticated
//! (TLS handshake deadline, first frame size, register and ready deadlines, connection
//! caps) and after (bytes buffered per stream), with their defaults and bounds.

use super::FieldError;
use std::time::Duration;

use serde::Deserialize;

pub const DEFAULT_FIRST_FRAME_BYTES: usize = 64 * 1024;
pub const DEFAULT_TLS_HANDSHAKE_TIMEOUT_SEC: f64 = 10.0;
pub const DEFAULT_REGISTER_TIMEOUT_SEC: f64 = 5.0;
pub const DEFAULT_READY_TIMEOUT_SEC: f64 = 30.0;
pub const DEFAULT_MAX_UNAUTHENTICATED: usize = 256;
pub const DEFAULT_MAX_UNAUTHENTICATED_PER_ADDRESS: usize = 16;
pub const DEFAULT_STREAM_BUFFER_BYTES: usize = 8 * 1024 * 1024;
pub const DEFAULT_SUMMARY_INTERVAL_SEC: f64 = 30.0;

/// Bounds checked by [`NodeLimitsConfig::validate`].
const MIN_FIRST_FRAME_BYTES: usize = 1024;
const MAX_TLS_HANDSHAKE_TIMEOUT_SEC: f64 = 300.0;
const MAX_REGISTER_TIMEOUT_SEC: f64 = 300.0;
const MAX_READY_TIMEOUT_SEC: f64 = 3600.0;
const MAX_CONNECTIONS: usize = 65_536;
const MIN_STREAM_BUFFER_BYTES: usize = 64 * 1024;
const MAX_STREAM_BUFFER_BYTES: usize = 1024 * 1024 * 1024;
const MAX_SUMMARY_INTERVAL_SEC: f64 = 3600.0;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeLimitsConfig {
    /// Largest frame a connection may send before it has registered (its RegisterRequest).
    #[serde(default = "default_first_frame_bytes")]
    pub first_frame_bytes: usize,
    /// A new connection must finish its TLS handshake within this many seconds (the
    /// connection counts against the caps below meanwhile).
    #[serde(default = "default_tls_handshake_timeout_sec")]
    pub tls_handshake_timeout_sec: f64,
    /// A new connection must register within this many seconds (after its TLS handshake).
    #[serde(default = "default_register_timeout_sec")]
    pub register_timeout_sec: f64,
    /// A registered connection must send ready within this many seconds, or it is closed
    /// and its claim on the node id released.
    #[serde(default = "default_ready_timeout_sec")]
    pub ready_timeout_sec: f64,
    /// Connections not registered yet (TLS handshakes included), in total; more are closed
    /// at once.
    #[serde(default = "default_max_unauthenticated")]
    pub max_unauthenticated: usize,
    /// Connections not registered yet from one address (IPv6: one /64).
    #[serde(default = "default_max_unauthenticated_per_address")]
    pub max_unauthenticated_per_address: usize,
    /// Bytes one stream (run or tunnel) may hold waiting for its client; a node that
    /// sends more has that stream cut.
    #[serde(default = "default_stream_buffer_bytes")]
    pub stream_buffer_bytes: usize,
    /// Refused connections, failed TLS handshakes and bad credentials are logged as one
    /// summary line per interval.
    #[serde(default = "default_summary_interval_sec")]
    pub summary_interval_sec: f64,
}

fn default_first_frame_bytes() -> usize {
    DEFAULT_FIRST_FRAME_BYTES
}
fn default_tls_handshake_timeout_sec() -> f64 {
    DEFAULT_TLS_HANDSHAKE_TIMEOUT_SEC
}
fn default_register_timeout_sec() -> f64 {
    DEFAULT_REGISTER_TIMEOUT_SEC
}
fn default_ready_timeout_sec() -> f64 {
    DEFAULT_READY_TIMEOUT_SEC
}
fn default_max_unauthenticated() -> usize {
    DEFAULT_MAX_UNAUTHENTICATED
}
fn default_max_unauthenticated_per_address() -> usize {
    DEFAULT_MAX_UNAUTHENTICATED_PER_ADDRESS
}
fn default_stream_buffer_bytes() -> usize {
    DEFAULT_STREAM_BUFFER_BYTES
}
fn default_summary_interval_sec() -> f64 {
    DEFAULT_SUMMARY_INTERVAL_SEC
}

impl Default for NodeLimitsConfig {
    fn default() -> Self {
        Self {
            first_frame_bytes: DEFAULT_FIRST_FRAME_BYTES,
            tls_handshake_timeout_sec: DEFAULT_TLS_HANDSHAKE_TIMEOUT_SEC,
            register_timeout_sec: DEFAULT_REGISTER_TIMEOUT_SEC,
            ready_timeout_sec: DEFAULT_READY_TIMEOUT_SEC,
            max_unauthenticated: DEFAULT_MAX_UNAUTHENTICATED,
            max_unauthenticated_per_address: DEFAULT_MAX_UNAUTHENTICATED_PER_ADDRESS,
            stream_buffer_bytes: DEFAULT_STREAM_BUFFER_BYTES,
            summary_interval_sec: DEFAULT_SUMMARY_INTERVAL_SEC,
        }
    }
}

impl NodeLimitsConfig {
    pub fn tls_handshake_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.tls_handshake_timeout_sec)
    }

    pub fn register_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.register_timeout_sec)
    }

    pub fn ready_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.ready_timeout_sec)
    }

    pub fn summary_interval(&self) -> Duration {
        Duration::from_secs_f64(self.summary_interval_sec)
    }

    /// Checks the bounds; the error is `(field under limits.nodes, message)`.
    pub fn validate(&self, max_frame_bytes: usize) -> Result<(), FieldError> {
        let err = |field: &str, message: String| Err(FieldError::new(field.to_string(), message));
        if !(MIN_FIRST_FRAME_BYTES..=max_frame_bytes).contains(&self.first_frame_bytes) {
            return err(
                "first_frame_bytes",
                format!(
                    "must be between {MIN_FIRST_FRAME_BYTES} and max_frame_bytes ({max_frame_bytes})"
                ),
            );
        }
        for (field, value, max) in [
            (
                "tls_handshake_timeout_sec",
                self.tls_handshake_timeout_sec,
                MAX_TLS_HANDSHAKE_TIMEOUT_SEC,
            ),
            (
                "register_timeout_sec",
                self.register_timeout_sec,
                MAX_REGISTER_TIMEOUT_SEC,
            ),
            (
                "ready_timeout_sec",
                self.ready_timeout_sec,
                MAX_READY_TIMEOUT_SEC,
            ),
            (
                "summary_interval_sec",
                self.summary_interval_sec,
                MAX_SUMMARY_INTERVAL_SEC,
            ),
        ] {
            if !(value > 0.0 && value <= max) {
                return err(field, format!("must be more than 0 and at most {max}"));
            }
        }
        if !(1..=MAX_CONNECTIONS).contains(&self.max_unauthenticated) {
            return err(
                "max_unauthenticated",
                format!("must be between 1 and {MAX_CONNECTIONS}"),
            );
        }
        if !(1..=self.max_unauthenticated).contains(&self.max_unauthenticated_per_address) {
            return err(
                "max_unauthenticated_per_address",
                format!(
                    "must be between 1 and max_unauthenticated ({})",
                    self.max_unauthenticated
                ),
            );
        }
        if !(MIN_STREAM_BUFFER_BYTES..=MAX_STREAM_BUFFER_BYTES).contains(&self.stream_buffer_bytes)
        {
            return err(
                "stream_buffer_bytes",
                format!(
                    "must be between {MIN_STREAM_BUFFER_BYTES} (64 KiB) and {MAX_STREAM_BUFFER_BYTES} (1 GiB)"
                ),
            );
        }
        Ok(())
    }
}
