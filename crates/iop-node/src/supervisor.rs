//! The node's connectivity supervisor: one loop for the whole connection life. Initial
//! dial/register failures and drops of an established session go through the same policy:
//! wait `reconnect.interval_sec`, try again, give up after `reconnect.max_attempts`
//! consecutive failed attempts (0 = never). A session that reached ready resets the count.
//! Fatal errors (bad token, unappliable config) end at once; so does local shutdown.
//!
//! Within the interval the node does not sit idle when the edge is already back: after a
//! lost connection or an edge it could not reach, it checks cheaply whether the edge
//! accepts connections ([`crate::edge_probe`], not counted as an attempt) and attempts as
//! soon as it does; a registration the edge throttled is attempted again when the edge
//! said it would listen, not a whole interval later.

use std::sync::Arc;

use futures::FutureExt;

use tokio_util::sync::CancellationToken;

use crate::config::ReconnectConfig;
use crate::edge_probe;
use crate::runtime::NodeRuntime;
use crate::session::{EdgeTarget, NextAttempt, SessionEnd, run_session};

/// Why the supervisor stopped, other than local shutdown.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NodeExit {
    #[error("{0}")]
    Fatal(String),
    #[error(
        "giving up after {attempts} failed connection attempts (reconnect.max_attempts); last error: {last_error}"
    )]
    Exhausted { attempts: u32, last_error: String },
}

/// Keeps the node connected until shutdown, a fatal error, or an exhausted budget.
pub async fn supervise(
    runtime: Arc<NodeRuntime>,
    target: EdgeTarget,
    policy: ReconnectConfig,
    shutdown: CancellationToken,
) -> Result<(), NodeExit> {
    let mut failures: u32 = 0;
    loop {
        match run_session(&runtime, &target, &shutdown).await {
            SessionEnd::Shutdown => {
                tracing::info!("node shutting down");
                return Ok(());
            }
            SessionEnd::Fatal(message) => {
                tracing::error!(%message, "fatal: not retrying");
                return Err(NodeExit::Fatal(message));
            }
            SessionEnd::Retry {
                error,
                was_ready,
                next,
            } => {
                if was_ready {
                    failures = 0;
                    tracing::warn!(%error, "connection to the edge lost; reconnecting");
                } else {
                    failures += 1;
                    let budget = policy
                        .limit()
                        .map_or_else(|| "unlimited".to_string(), |n| n.to_string());
                    tracing::warn!(%error, attempt = failures, of = %budget, "connection attempt failed");
                    if policy.limit().is_some_and(|limit| failures >= limit) {
                        return Err(NodeExit::Exhausted {
                            attempts: failures,
                            last_error: error,
                        });
                    }
                }
                let interval = policy.interval();
                let edge = target.link.edge_addr().to_string();
                let wait = match next {
                    NextAttempt::Interval => {
                        tracing::info!(retry_in_sec = interval.as_secs_f64(), %edge, "waiting before the next attempt");
                        tokio::time::sleep(interval).boxed()
                    }
                    NextAttempt::After(hint) => {
                        let wait = hint.min(interval);
                        tracing::info!(retry_in_sec = wait.as_secs_f64(), %edge, "waiting as long as the edge asked before the next attempt");
                        tokio::time::sleep(wait).boxed()
                    }
                    NextAttempt::WhenReachable => {
                        tracing::info!(retry_in_sec = interval.as_secs_f64(), %edge, "next attempt as soon as the edge accepts connections, at the latest after the interval");
                        edge_probe::until_reachable(edge, interval).boxed()
                    }
                };
                tokio::select! {
                    _ = shutdown.cancelled() => return Ok(()),
                    _ = wait => {}
                }
            }
        }
    }
}
