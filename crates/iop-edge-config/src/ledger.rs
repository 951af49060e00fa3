//! The `ledger` section: the durable usage ledger (`<state_dir>/usage.db`) and how long
//! it keeps records.

use super::FieldError;
use serde::Deserialize;

pub const DEFAULT_RETENTION_DAYS: u32 = 90;
/// Longest retention accepted (ten years).
pub const MAX_RETENTION_DAYS: u32 = 3_650;

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LedgerConfig {
    /// Record every model-API request in `<state_dir>/usage.db` (on by default).
    #[serde(default = "default_enabled")]
    pub enabled: bool,
    /// Records older than this many days are deleted (checked hourly).
    #[serde(default = "default_retention_days")]
    pub retention_days: u32,
}

fn default_enabled() -> bool {
    true
}

fn default_retention_days() -> u32 {
    DEFAULT_RETENTION_DAYS
}

impl Default for LedgerConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            retention_days: DEFAULT_RETENTION_DAYS,
        }
    }
}

impl LedgerConfig {
    /// The bounds; the error names the field.
    pub fn validate(&self) -> Result<(), FieldError> {
        if !(1..=MAX_RETENTION_DAYS).contains(&self.retention_days) {
            return Err(FieldError::new(
                "retention_days".into(),
                format!(
                    "{} is out of range: give 1 to {MAX_RETENTION_DAYS} days",
                    self.retention_days
                ),
            ));
        }
        Ok(())
    }
}
