//! `dispatch`: how the edge sends a model-group request to a member and what it does when
//! that fails before the provider accepted it — attempts, the retry budget, and how long a
//! node may take to acknowledge a dispatch. Reloadable.

use super::FieldError;
use std::time::Duration;

use serde::Deserialize;

pub const DEFAULT_MAX_ATTEMPTS: u32 = 3;
pub const DEFAULT_ACK_TIMEOUT_SEC: f64 = 10.0;
pub const DEFAULT_RETRY_BUDGET_PERCENT: u32 = 20;
pub const DEFAULT_RETRY_BUDGET_MIN: u32 = 10;
pub const DEFAULT_REATTACH_WAIT_SEC: u32 = 15;

const MAX_ATTEMPTS: u32 = 10;
const MAX_ACK_TIMEOUT_SEC: f64 = 300.0;
const MAX_RETRY_BUDGET_MIN: u32 = 100_000;
const MAX_REATTACH_WAIT_SEC: u32 = 600;
/// How long a streamed answer stays resumable by its client after its end, by default.
pub const DEFAULT_RESUME_KEEP_SEC: u32 = 300;
const MAX_RESUME_KEEP_SEC: u32 = 3600;
/// How long an answer whose client left goes on for a resume, by default.
pub const DEFAULT_RESUME_GRACE_SEC: u32 = 0;
const MAX_RESUME_GRACE_SEC: u32 = 600;

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DispatchConfig {
    /// Attempts per request, the first included: a request that fails before its provider
    /// accepted it (node gate full, node link lost, provider unreachable, provider 429 or
    /// 503 with nothing streamed) is tried on another member up to this many times.
    #[serde(default = "default_max_attempts")]
    pub max_attempts: u32,
    /// A node must acknowledge a dispatch (run or tunnel) within this many seconds, or
    /// the attempt fails with `node_timeout` (and may go to another member).
    #[serde(default = "default_ack_timeout_sec")]
    pub ack_timeout_sec: f64,
    /// Retries are at most this percentage of the requests of the last 10 s (plus
    /// `retry_budget_min`), so a failing fleet does not multiply its own load.
    #[serde(default = "default_retry_budget_percent")]
    pub retry_budget_percent: u32,
    /// Retries always allowed per 10 s, whatever the percentage says.
    #[serde(default = "default_retry_budget_min")]
    pub retry_budget_min: u32,
    /// When a node's link drops while requests run on it, the edge waits this many seconds
    /// for the node to come back and re-attaches them (the node keeps them running and
    /// sends again what was lost): nothing runs twice. A request the node never received
    /// goes to another member; one whose node does not come back in time fails saying it
    /// may have run. 0: requests on a dropped link fail at once, and one the node had not
    /// acknowledged yet is tried on another member (it may then run twice).
    #[serde(default = "default_reattach_wait_sec")]
    pub reattach_wait_sec: u32,
    /// How long a streamed answer (an event stream relayed as the provider sent it) stays
    /// resumable by its client after its end, in seconds: its events carry ids, and a
    /// client that lost its connection sends the request again with `Last-Event-ID` to
    /// any edge of the fleet and gets the rest. The node keeps the answer (bounded per
    /// answer and in all). 0: no ids, nothing kept for clients.
    #[serde(default = "default_resume_keep_sec")]
    pub resume_keep_sec: u32,
    /// When the client of a resumable answer goes away mid-stream (a dropped connection
    /// looks the same as a client that stopped reading), the answer goes on this many
    /// seconds for the client to resume it, then is cancelled; one that ends meanwhile is
    /// kept for `resume_keep_sec`. The price: a client that closes a stream to stop it
    /// keeps its provider busy up to this long. 0 (the default): cancel at once, as a
    /// client that stops reading expects; a dropped client then resumes only what was
    /// sent before (an edge that died never cancels: its streams wait for a resume).
    #[serde(default = "default_resume_grace_sec")]
    pub resume_grace_sec: u32,
}

fn default_max_attempts() -> u32 {
    DEFAULT_MAX_ATTEMPTS
}
fn default_ack_timeout_sec() -> f64 {
    DEFAULT_ACK_TIMEOUT_SEC
}
fn default_retry_budget_percent() -> u32 {
    DEFAULT_RETRY_BUDGET_PERCENT
}
fn default_retry_budget_min() -> u32 {
    DEFAULT_RETRY_BUDGET_MIN
}
fn default_reattach_wait_sec() -> u32 {
    DEFAULT_REATTACH_WAIT_SEC
}
fn default_resume_keep_sec() -> u32 {
    DEFAULT_RESUME_KEEP_SEC
}
fn default_resume_grace_sec() -> u32 {
    DEFAULT_RESUME_GRACE_SEC
}

impl Default for DispatchConfig {
    fn default() -> Self {
        Self {
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            ack_timeout_sec: DEFAULT_ACK_TIMEOUT_SEC,
            retry_budget_percent: DEFAULT_RETRY_BUDGET_PERCENT,
            retry_budget_min: DEFAULT_RETRY_BUDGET_MIN,
            reattach_wait_sec: DEFAULT_REATTACH_WAIT_SEC,
            resume_keep_sec: DEFAULT_RESUME_KEEP_SEC,
            resume_grace_sec: DEFAULT_RESUME_GRACE_SEC,
        }
    }
}

impl DispatchConfig {
    pub fn ack_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.ack_timeout_sec)
    }

    pub fn reattach_wait(&self) -> Duration {
        Duration::from_secs(self.reattach_wait_sec.into())
    }

    pub fn resume_keep(&self) -> Duration {
        Duration::from_secs(self.resume_keep_sec.into())
    }

    pub fn resume_grace(&self) -> Duration {
        Duration::from_secs(self.resume_grace_sec.into())
    }

    /// The bounds; the error names the field.
    pub fn validate(&self) -> Result<(), FieldError> {
        if !(1..=MAX_ATTEMPTS).contains(&self.max_attempts) {
            return Err(FieldError::new(
                "max_attempts".into(),
                format!(
                    "{} is out of range: give 1 (no retries) to {MAX_ATTEMPTS}",
                    self.max_attempts
                ),
            ));
        }
        if !(self.ack_timeout_sec > 0.0 && self.ack_timeout_sec <= MAX_ACK_TIMEOUT_SEC) {
            return Err(FieldError::new(
                "ack_timeout_sec".into(),
                format!("must be above 0 and at most {MAX_ACK_TIMEOUT_SEC} seconds"),
            ));
        }
        if self.retry_budget_percent > 100 {
            return Err(FieldError::new(
                "retry_budget_percent".into(),
                "must be at most 100".into(),
            ));
        }
        if self.reattach_wait_sec > MAX_REATTACH_WAIT_SEC {
            return Err(FieldError::new(
                "reattach_wait_sec".into(),
                format!(
                    "must be at most {MAX_REATTACH_WAIT_SEC} seconds (0 turns re-attaching off)"
                ),
            ));
        }
        if self.resume_keep_sec > MAX_RESUME_KEEP_SEC {
            return Err(FieldError::new(
                "resume_keep_sec".into(),
                format!("must be at most {MAX_RESUME_KEEP_SEC} seconds (0 turns resuming off)"),
            ));
        }
        if self.resume_grace_sec > MAX_RESUME_GRACE_SEC {
            return Err(FieldError::new(
                "resume_grace_sec".into(),
                format!("must be at most {MAX_RESUME_GRACE_SEC} seconds (0 cancels at once)"),
            ));
        }
        if self.retry_budget_min > MAX_RETRY_BUDGET_MIN {
            return Err(FieldError::new(
                "retry_budget_min".into(),
                format!("must be at most {MAX_RETRY_BUDGET_MIN}"),
            ));
        }
        Ok(())
    }
}

/// How long a provider's stream may go silent after its response began, unless the
/// provider says (`providers[].idle_timeout_sec`).
pub const DEFAULT_IDLE_TIMEOUT_SEC: u32 = 300;
/// Largest `idle_timeout_sec`.
pub const MAX_IDLE_TIMEOUT_SEC: u32 = 24 * 3600;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_are_checked() {
        assert!(DispatchConfig::default().validate().is_ok());
        let bad = [
            DispatchConfig {
                max_attempts: 0,
                ..Default::default()
            },
            DispatchConfig {
                max_attempts: 11,
                ..Default::default()
            },
            DispatchConfig {
                ack_timeout_sec: 0.0,
                ..Default::default()
            },
            DispatchConfig {
                reattach_wait_sec: 601,
                ..Default::default()
            },
            DispatchConfig {
                ack_timeout_sec: f64::NAN,
                ..Default::default()
            },
            DispatchConfig {
                retry_budget_percent: 101,
                ..Default::default()
            },
        ];
        for config in bad {
            assert!(config.validate().is_err(), "{config:?}");
        }
    }
}
