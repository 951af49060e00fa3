//! `health` (edge-wide defaults) and `nodes[].providers[].health` (per provider): how nodes
//! probe their providers, and when the edge ejects a member after failed requests, with
//! their defaults and bounds.

use super::FieldError;
use std::time::Duration;

use serde::Deserialize;

use iop_proto::health_check as defaults;

pub const DEFAULT_INTERVAL_SEC: f64 = defaults::DEFAULT_INTERVAL.as_secs_f64();
pub const DEFAULT_TIMEOUT_SEC: f64 = defaults::DEFAULT_TIMEOUT.as_secs_f64();
pub const DEFAULT_UNHEALTHY_AFTER: u32 = defaults::DEFAULT_UNHEALTHY_AFTER;
pub const DEFAULT_HEALTHY_AFTER: u32 = defaults::DEFAULT_HEALTHY_AFTER;
pub const DEFAULT_EJECT_AFTER: u32 = 3;
pub const DEFAULT_EJECT_BASE_SEC: f64 = 30.0;
pub const DEFAULT_EJECT_MAX_SEC: f64 = 300.0;
pub const DEFAULT_MAX_EJECTED_PERCENT: u32 = 50;

const MIN_INTERVAL_SEC: f64 = 0.1;
const MAX_INTERVAL_SEC: f64 = 3600.0;
const MAX_TIMEOUT_SEC: f64 = 600.0;
const MAX_STREAK: u32 = 100;
const MAX_EJECT_SEC: f64 = 86_400.0;

/// Edge-wide health settings.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HealthConfig {
    /// Seconds between two probes of a provider (default for every provider).
    #[serde(default = "default_interval_sec")]
    pub interval_sec: f64,
    /// A probe that takes longer fails.
    #[serde(default = "default_timeout_sec")]
    pub timeout_sec: f64,
    /// Consecutive failed probes that make a provider unhealthy.
    #[serde(default = "default_unhealthy_after")]
    pub unhealthy_after: u32,
    /// Consecutive good probes that make it healthy again.
    #[serde(default = "default_healthy_after")]
    pub healthy_after: u32,
    /// Passive ejection after failed requests.
    #[serde(default)]
    pub ejection: EjectionConfig,
}

fn default_interval_sec() -> f64 {
    DEFAULT_INTERVAL_SEC
}
fn default_timeout_sec() -> f64 {
    DEFAULT_TIMEOUT_SEC
}
fn default_unhealthy_after() -> u32 {
    DEFAULT_UNHEALTHY_AFTER
}
fn default_healthy_after() -> u32 {
    DEFAULT_HEALTHY_AFTER
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self {
            interval_sec: DEFAULT_INTERVAL_SEC,
            timeout_sec: DEFAULT_TIMEOUT_SEC,
            unhealthy_after: DEFAULT_UNHEALTHY_AFTER,
            healthy_after: DEFAULT_HEALTHY_AFTER,
            ejection: EjectionConfig::default(),
        }
    }
}

/// When a member is taken out of rotation after failed requests.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EjectionConfig {
    /// Consecutive provider-side failures (connect errors, 5xx, broken streams) that eject
    /// a member; 0 never ejects.
    #[serde(default = "default_eject_after")]
    pub consecutive_failures: u32,
    /// The first ejection lasts this long; the n-th lasts n times as long...
    #[serde(default = "default_eject_base_sec")]
    pub base_sec: f64,
    /// ...up to this.
    #[serde(default = "default_eject_max_sec")]
    pub max_sec: f64,
    /// Distinct API keys whose requests must be among a streak of failures a request
    /// could cause (a 5xx answer, a timeout, a broken stream) before it ejects. Default: 2
    /// on an edge with two keys or more, else 1.
    #[serde(default)]
    pub distinct_keys: Option<u32>,
    /// The most of a model group's members ejected at once, in percent; one member
    /// always may be.
    #[serde(default = "default_max_ejected_percent")]
    pub max_ejected_percent: u32,
}

fn default_max_ejected_percent() -> u32 {
    DEFAULT_MAX_EJECTED_PERCENT
}

fn default_eject_after() -> u32 {
    DEFAULT_EJECT_AFTER
}
fn default_eject_base_sec() -> f64 {
    DEFAULT_EJECT_BASE_SEC
}
fn default_eject_max_sec() -> f64 {
    DEFAULT_EJECT_MAX_SEC
}

impl Default for EjectionConfig {
    fn default() -> Self {
        Self {
            consecutive_failures: DEFAULT_EJECT_AFTER,
            base_sec: DEFAULT_EJECT_BASE_SEC,
            max_sec: DEFAULT_EJECT_MAX_SEC,
            distinct_keys: None,
            max_ejected_percent: DEFAULT_MAX_EJECTED_PERCENT,
        }
    }
}

/// A provider's own probe settings; unset fields take the edge-wide ones.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProviderHealthConfig {
    #[serde(default)]
    pub interval_sec: Option<f64>,
    #[serde(default)]
    pub timeout_sec: Option<f64>,
}

/// The probe settings one provider gets: its own, else the edge-wide defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProbeSettings {
    pub interval: Duration,
    pub timeout: Duration,
    pub unhealthy_after: u32,
    pub healthy_after: u32,
}

impl HealthConfig {
    pub fn probe_settings(&self, provider: Option<&ProviderHealthConfig>) -> ProbeSettings {
        let own = provider.cloned().unwrap_or_default();
        ProbeSettings {
            interval: Duration::from_secs_f64(own.interval_sec.unwrap_or(self.interval_sec)),
            timeout: Duration::from_secs_f64(own.timeout_sec.unwrap_or(self.timeout_sec)),
            unhealthy_after: self.unhealthy_after,
            healthy_after: self.healthy_after,
        }
    }

    /// Checks the bounds; the error is `(field below health, message)`.
    pub fn validate(&self) -> Result<(), FieldError> {
        check_interval("interval_sec", self.interval_sec)?;
        check_timeout("timeout_sec", self.timeout_sec)?;
        for (field, value) in [
            ("unhealthy_after", self.unhealthy_after),
            ("healthy_after", self.healthy_after),
        ] {
            if !(1..=MAX_STREAK).contains(&value) {
                return Err(FieldError::new(
                    field.into(),
                    format!("must be between 1 and {MAX_STREAK}"),
                ));
            }
        }
        let e = &self.ejection;
        if e.consecutive_failures > MAX_STREAK {
            return Err(FieldError::new(
                "ejection.consecutive_failures".into(),
                format!("must be at most {MAX_STREAK} (0 turns ejection off)"),
            ));
        }
        if !(e.base_sec > 0.0 && e.base_sec <= MAX_EJECT_SEC) {
            return Err(FieldError::new(
                "ejection.base_sec".into(),
                format!("must be positive and at most {MAX_EJECT_SEC}"),
            ));
        }
        if e.distinct_keys.is_some_and(|n| !(1..=16).contains(&n)) {
            return Err(FieldError::new(
                "ejection.distinct_keys".into(),
                "must be between 1 and 16".into(),
            ));
        }
        if !(1..=100).contains(&e.max_ejected_percent) {
            return Err(FieldError::new(
                "ejection.max_ejected_percent".into(),
                "must be between 1 and 100".into(),
            ));
        }
        if !(e.max_sec >= e.base_sec && e.max_sec <= MAX_EJECT_SEC) {
            return Err(FieldError::new(
                "ejection.max_sec".into(),
                format!("must be at least base_sec and at most {MAX_EJECT_SEC}"),
            ));
        }
        Ok(())
    }
}

impl ProviderHealthConfig {
    /// Checks the bounds; the error is `(field below providers[].health, message)`.
    pub fn validate(&self) -> Result<(), FieldError> {
        if let Some(v) = self.interval_sec {
            check_interval("interval_sec", v)?;
        }
        if let Some(v) = self.timeout_sec {
            check_timeout("timeout_sec", v)?;
        }
        Ok(())
    }
}

fn check_interval(field: &str, v: f64) -> Result<(), FieldError> {
    if !(MIN_INTERVAL_SEC..=MAX_INTERVAL_SEC).contains(&v) {
        return Err(FieldError::new(
            field.into(),
            format!("must be between {MIN_INTERVAL_SEC} and {MAX_INTERVAL_SEC} seconds"),
        ));
    }
    Ok(())
}

fn check_timeout(field: &str, v: f64) -> Result<(), FieldError> {
    if !(v > 0.0 && v <= MAX_TIMEOUT_SEC) {
        return Err(FieldError::new(
            field.into(),
            format!("must be positive and at most {MAX_TIMEOUT_SEC} seconds"),
        ));
    }
    Ok(())
}
