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
//!
//! In a fleet (edges sharing a store) the edge lists its fleet's live edges, and the
//! supervisor keeps one link to each ([`keep_fleet_links`]): dialled with jitter at the
//! address the fleet gives, redialled while the edge is listed, left to end once it is
//! not. The link from the config then rests after it ends, while any fleet link is up,
//! and dials the configured address again only when none has been for a whole interval.
//! A fatal refusal on any link (a revoked node) ends the node.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use tokio::sync::mpsc;
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

/// The longest a fleet link waits before its first dial (spread evenly below it), so the
/// nodes told of a new edge do not all arrive in the same instant.
pub const FLEET_DIAL_JITTER: Duration = Duration::from_millis(500);

/// Keeps the node connected until shutdown, a fatal error, or an exhausted budget.
pub async fn supervise(
    runtime: Arc<NodeRuntime>,
    target: EdgeTarget,
    policy: ReconnectConfig,
    shutdown: CancellationToken,
) -> Result<(), NodeExit> {
    let stop = shutdown.child_token();
    let (fatal, mut fatal_seen) = mpsc::unbounded_channel();
    let fleet = tokio::spawn(keep_fleet_links(
        runtime.clone(),
        target.clone(),
        policy,
        stop.clone(),
        fatal,
    ));
    let sweeper = tokio::spawn(sweep_journal(runtime.clone(), stop.clone()));
    let configured = configured_link(runtime.clone(), target, policy, stop.clone());
    tokio::pin!(configured);
    let result = tokio::select! {
        result = &mut configured => result,
        Some(message) = fatal_seen.recv() => {
            tracing::error!(%message, "fatal: not retrying");
            stop.cancel();
            let _ = configured.await;
            Err(NodeExit::Fatal(message))
        }
    };
    // Every link ends its session (the runs on it say so) before the node goes.
    stop.cancel();
    let _ = fleet.await;
    // Whatever still runs detached (waiting for an edge that will not come now) stops.
    runtime.journal.stop_all("the node is shutting down");
    let _ = sweeper.await;
    result
}

/// Once a second: stops the journal's detached streams no edge re-attached within the
/// wait, and forgets ended ones.
async fn sweep_journal(runtime: Arc<NodeRuntime>, stop: CancellationToken) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => runtime.journal.sweep(std::time::Instant::now()),
        }
    }
}

/// The link to the configured edge address(es).
async fn configured_link(
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
                if !runtime.fleet.state().edges.is_empty() {
                    tokio::select! {
                        _ = shutdown.cancelled() => return Ok(()),
                        _ = until_no_fleet_link(&runtime, interval) => {}
                    }
                    tracing::info!(edge = %target.link.edge_addr(), "no edge of the fleet linked for {}s: dialling the configured address", interval.as_secs_f64());
                    failures = 0;
                    continue;
                }
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

/// Resolves once no connection of this node has been linked to any edge of the fleet for
/// `interval` (the fleet links keep trying meanwhile).
async fn until_no_fleet_link(runtime: &NodeRuntime, interval: Duration) {
    let mut fleet = runtime.fleet.subscribe();
    loop {
        let linked = !fleet.borrow_and_update().linked.is_empty();
        if linked {
            if fleet.changed().await.is_err() {
                return;
            }
            continue;
        }
        tokio::select! {
            _ = tokio::time::sleep(interval) => return,
            changed = fleet.changed() => if changed.is_err() { return },
        }
    }
}

/// One link per edge the fleet lists and no other connection of this node holds, until
/// `stop`. A link whose edge leaves the list is not dialled again (its connection ends
/// when the edge closes it). Fatal refusals go to `fatal`.
async fn keep_fleet_links(
    runtime: Arc<NodeRuntime>,
    template: EdgeTarget,
    policy: ReconnectConfig,
    stop: CancellationToken,
    fatal: mpsc::UnboundedSender<String>,
) {
    struct FleetLink {
        retire: CancellationToken,
        task: tokio::task::JoinHandle<()>,
    }
    let mut fleet = runtime.fleet.subscribe();
    let mut links: HashMap<String, FleetLink> = HashMap::new();
    loop {
        let state = fleet.borrow_and_update().clone();
        links.retain(|_, link| !link.task.is_finished());
        for edge in &state.edges {
            if links.contains_key(&edge.id) || state.linked.contains_key(&edge.id) {
                continue;
            }
            let target = EdgeTarget {
                link: Arc::new(template.link.for_edge(edge.address.clone())),
                max_frame_bytes: template.max_frame_bytes,
                fleet_edge: Some(edge.id.clone()),
            };
            let retire = CancellationToken::new();
            let task = tokio::spawn(fleet_link(
                runtime.clone(),
                target,
                policy,
                retire.clone(),
                stop.clone(),
                fatal.clone(),
            ));
            links.insert(edge.id.clone(), FleetLink { retire, task });
        }
        for (id, link) in &links {
            if !state.edges.iter().any(|e| e.id == *id) {
                link.retire.cancel();
            }
        }
        tokio::select! {
            _ = stop.cancelled() => break,
            changed = fleet.changed() => if changed.is_err() { break },
        }
    }
    for link in links.into_values() {
        let _ = link.task.await;
    }
}

/// A link to one edge of the fleet: dialled after a jitter, again after each end under
/// the reconnect interval, until the edge leaves the list (`retire`) or `stop`.
async fn fleet_link(
    runtime: Arc<NodeRuntime>,
    target: EdgeTarget,
    policy: ReconnectConfig,
    retire: CancellationToken,
    stop: CancellationToken,
    fatal: mpsc::UnboundedSender<String>,
) {
    let edge_id = target.fleet_edge.clone().unwrap_or_default();
    let address = target.link.edge_addr().to_string();
    let jitter = FLEET_DIAL_JITTER.mul_f64(rand::random::<f64>());
    tokio::select! {
        _ = stop.cancelled() => return,
        _ = retire.cancelled() => return,
        _ = tokio::time::sleep(jitter) => {}
    }
    tracing::info!(edge_id, %address, "linking to an edge of the fleet");
    loop {
        match run_session(&runtime, &target, &stop).await {
            SessionEnd::Shutdown => return,
            SessionEnd::Fatal(message) => {
                let _ = fatal.send(message);
                return;
            }
            SessionEnd::Retry { error, next, .. } => {
                if retire.is_cancelled() {
                    tracing::info!(edge_id, %address, %error, "link to an edge that left the fleet ended");
                    return;
                }
                tracing::warn!(edge_id, %address, %error, "link to an edge of the fleet lost; dialling it again");
                let interval = policy.interval();
                let wait = match next {
                    NextAttempt::Interval => tokio::time::sleep(interval).boxed(),
                    NextAttempt::After(hint) => tokio::time::sleep(hint.min(interval)).boxed(),
                    NextAttempt::WhenReachable => {
                        edge_probe::until_reachable(address.clone(), interval).boxed()
                    }
                };
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = retire.cancelled() => {
                        tracing::info!(edge_id, %address, "an edge that left the fleet: not dialling it again");
                        return;
                    }
                    _ = wait => {}
                }
            }
        }
    }
}
