//! A provider's health check as both daemons default it: the values a node uses for the
//! fields of a `HealthCheckSpec` the edge leaves at 0, and the edge config's defaults.

use std::time::Duration;

/// How often a provider is probed.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(5);
/// How long one probe may take.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(2);
/// Consecutive failed probes that make a provider unhealthy.
pub const DEFAULT_UNHEALTHY_AFTER: u32 = 3;
/// Consecutive good probes that make it healthy again.
pub const DEFAULT_HEALTHY_AFTER: u32 = 2;
