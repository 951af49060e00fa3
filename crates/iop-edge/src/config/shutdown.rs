//! The `shutdown` section: how an edge stops on SIGTERM — it drains first (`/readyz`
//! answers 503, new requests are refused, requests in progress run to their end) for at
//! most `grace_sec`.

use std::time::Duration;

use serde::Deserialize;

use super::FieldError;

pub const DEFAULT_GRACE_SEC: u64 = 30;
/// Longest drain accepted (an hour).
pub const MAX_GRACE_SEC: u64 = 3_600;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShutdownConfig {
    /// How long requests in progress may run on after SIGTERM (0: stop at once).
    #[serde(default = "default_grace_sec")]
    pub grace_sec: u64,
}

fn default_grace_sec() -> u64 {
    DEFAULT_GRACE_SEC
}

impl Default for ShutdownConfig {
    fn default() -> Self {
        Self {
            grace_sec: DEFAULT_GRACE_SEC,
        }
    }
}

impl ShutdownConfig {
    pub fn grace(&self) -> Duration {
        Duration::from_secs(self.grace_sec)
    }

    /// The bounds; the error names the field.
    pub fn validate(&self) -> Result<(), FieldError> {
        if self.grace_sec > MAX_GRACE_SEC {
            return Err(FieldError::new(
                "grace_sec".into(),
                format!(
                    "{} is out of range: give 0 to {MAX_GRACE_SEC} seconds",
                    self.grace_sec
                ),
            ));
        }
        Ok(())
    }
}
