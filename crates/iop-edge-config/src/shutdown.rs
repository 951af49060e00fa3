//! The `shutdown` section: how an edge stops on SIGTERM — it drains first: `/readyz`
//! answers 503 at once, new requests are still served for `accept_grace_sec` (the time a
//! load balancer takes to see `/readyz` and move traffic), then refused, and requests in
//! progress run to their end for at most `grace_sec`.

use std::time::Duration;

use serde::Deserialize;

use super::FieldError;

pub const DEFAULT_GRACE_SEC: u64 = 30;
/// Longest drain accepted (an hour).
pub const MAX_GRACE_SEC: u64 = 3_600;
/// Longest time new requests are still taken after SIGTERM.
pub const MAX_ACCEPT_GRACE_SEC: u64 = 300;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShutdownConfig {
    /// How long requests in progress may run on after SIGTERM (0: stop at once).
    #[serde(default = "default_grace_sec")]
    pub grace_sec: u64,
    /// How long new requests are still served after SIGTERM, while `/readyz` already
    /// answers 503 (0: refused at once). Behind a load balancer: at least the time its
    /// health checks take to mark the edge down.
    #[serde(default)]
    pub accept_grace_sec: u64,
}

fn default_grace_sec() -> u64 {
    DEFAULT_GRACE_SEC
}

impl Default for ShutdownConfig {
    fn default() -> Self {
        Self {
            grace_sec: DEFAULT_GRACE_SEC,
            accept_grace_sec: 0,
        }
    }
}

impl ShutdownConfig {
    pub fn grace(&self) -> Duration {
        Duration::from_secs(self.grace_sec)
    }

    pub fn accept_grace(&self) -> Duration {
        Duration::from_secs(self.accept_grace_sec)
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
        if self.accept_grace_sec > MAX_ACCEPT_GRACE_SEC {
            return Err(FieldError::new(
                "accept_grace_sec".into(),
                format!(
                    "{} is out of range: give 0 to {MAX_ACCEPT_GRACE_SEC} seconds",
                    self.accept_grace_sec
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_graces_have_bounds_and_taking_new_requests_is_off_by_default() {
        let default = ShutdownConfig::default();
        assert_eq!((default.grace_sec, default.accept_grace_sec), (30, 0));
        let config = |grace_sec, accept_grace_sec| ShutdownConfig {
            grace_sec,
            accept_grace_sec,
        };
        assert!(config(3_600, 300).validate().is_ok());
        let err = config(30, 301).validate().unwrap_err();
        assert_eq!(err.path, "accept_grace_sec");
        assert_eq!(config(3_601, 0).validate().unwrap_err().path, "grace_sec");
    }
}
