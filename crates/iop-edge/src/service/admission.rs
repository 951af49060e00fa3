//! The async shell around [`Scheduler`]: requests wait here for a provider slot, and every
//! slot is held by a [`LeaseGuard`] that returns it exactly once, whichever of terminal,
//! send failure, client abort, node loss or queue timeout comes first.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::oneshot;

use iop_proto::ErrorCode;

use crate::lease::{Lane, LeaseId, ProviderKey};
use crate::queue::{Admission, Dispatch, Exclusion, Grant, Scheduler, WaiterId};
use crate::registry::Generation;

/// Suggested wait before retrying after a full queue (the `Retry-After` header).
pub const RETRY_AFTER_SECS: u64 = 1;
/// How long a request pinned to one provider (a native run) waits for a slot.
pub const DIRECT_TIMEOUT: Duration = Duration::from_secs(crate::config::DEFAULT_QUEUE_TIMEOUT_SEC);

/// What a request waits for: a slot on any member of a model group, or on one provider.
#[derive(Debug, Clone, Copy)]
pub enum Target<'a> {
    Group(&'a str),
    Provider(&'a ProviderKey),
}

impl Target<'_> {
    fn name(&self) -> String {
        match self {
            Target::Group(name) => name.to_string(),
            Target::Provider(key) => format!("{}/{}", key.node, key.provider),
        }
    }
}

/// Why a request got no slot.
#[derive(Debug, Clone, thiserror::Error)]
pub enum AdmitError {
    #[error("the model `{0}` does not exist")]
    UnknownGroup(String),
    #[error("no member of model `{group}` accepts {} requests", lane.as_str())]
    NoCapacityInLane { group: String, lane: Lane },
    #[error("model `{group}` has {max_waiting} requests waiting already; retry later")]
    QueueFull { group: String, max_waiting: usize },
    #[error("no capacity for model `{group}` became free within {}s", waited.as_secs())]
    Timeout { group: String, waited: Duration },
    #[error("model `{group}` is unavailable: {reason}")]
    Unavailable { group: String, reason: String },
    /// Every member that could serve the request already failed it.
    #[error("every member of model `{group}` failed this request")]
    Exhausted { group: String },
}

impl AdmitError {
    pub fn code(&self) -> ErrorCode {
        match self {
            AdmitError::UnknownGroup(_) => ErrorCode::ModelNotFound,
            AdmitError::NoCapacityInLane { .. } => ErrorCode::ContextLengthExceeded,
            AdmitError::QueueFull { .. } => ErrorCode::QueueFull,
            AdmitError::Timeout { .. } => ErrorCode::QueueTimeout,
            AdmitError::Unavailable { .. } | AdmitError::Exhausted { .. } => {
                ErrorCode::ModelUnavailable
            }
        }
    }
}

/// A held slot. Dropping it returns the slot (once; a slot already returned by a node
/// fence makes the drop a no-op).
#[derive(Debug)]
pub struct LeaseGuard {
    control: Arc<AdmissionControl>,
    lease: LeaseId,
    armed: bool,
}

impl LeaseGuard {
    pub fn lease(&self) -> LeaseId {
        self.lease
    }
}

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        if self.armed {
            self.armed = false;
            self.control.release(self.lease);
        }
    }
}

/// A granted request: where it goes and the guard of its slot.
#[derive(Debug)]
pub struct Admitted {
    pub grant: Grant,
    pub guard: LeaseGuard,
    pub waited: Duration,
}

type WaiterTx = oneshot::Sender<Result<Admitted, String>>;

/// Per-group settings the async shell needs.
#[derive(Debug, Clone)]
pub struct GroupPolicy {
    pub name: String,
    pub timeout: Duration,
    pub long_context_tokens: Option<u64>,
}

#[derive(Debug)]
pub struct AdmissionControl {
    scheduler: Mutex<Scheduler<(WaiterTx, Instant)>>,
    policies: parking_lot::RwLock<Vec<GroupPolicy>>,
}

/// Removes a waiter whose request went away before it got a slot.
struct QueuedWaiter<'a> {
    control: &'a AdmissionControl,
    id: WaiterId,
    active: bool,
}

impl Drop for QueuedWaiter<'_> {
    fn drop(&mut self) {
        if self.active {
            self.control.scheduler.lock().cancel_waiter(self.id);
        }
    }
}

impl AdmissionControl {
    pub fn new(scheduler: Scheduler<(WaiterTx, Instant)>, policies: Vec<GroupPolicy>) -> Arc<Self> {
        Arc::new(Self {
            scheduler: Mutex::new(scheduler),
            policies: parking_lot::RwLock::new(policies),
        })
    }

    /// Runs `f` with the scheduler locked (snapshots, metrics).
    pub fn inspect<R>(&self, f: impl FnOnce(&Scheduler<(WaiterTx, Instant)>) -> R) -> R {
        f(&self.scheduler.lock())
    }

    pub fn policy(&self, group: &str) -> Option<GroupPolicy> {
        self.policies
            .read()
            .iter()
            .find(|p| p.name == group)
            .cloned()
    }

    /// Applies a reloaded config: new capacities, groups and queue settings. Waiters of
    /// removed groups end with an error; waiters the new capacity lets through run now.
    pub fn reconfigure(
        self: &Arc<Self>,
        plan: crate::service::plan::AdmissionPlan,
        online: &std::collections::HashMap<String, Generation>,
    ) {
        let (orphaned, woken) =
            self.scheduler
                .lock()
                .reconfigure(plan.providers, plan.groups, online);
        *self.policies.write() = plan.policies;
        for (tx, _) in orphaned {
            let _ = tx.send(Err(
                "its model group was removed from the configuration".into()
            ));
        }
        let n = woken.len();
        self.wake_all(woken);
        if n > 0 {
            tracing::info!(dispatched = n, "config reload: queued requests dispatched");
        }
    }

    /// Waits for a slot of `lane` on `target`, up to its queue timeout (or `until`, for a
    /// retry that already spent part of it), never on a member `exclude` names (under that
    /// generation).
    pub async fn acquire(
        self: &Arc<Self>,
        target: Target<'_>,
        lane: Lane,
        exclude: &[Exclusion],
        until: Option<Instant>,
    ) -> Result<Admitted, AdmitError> {
        let group = target.name();
        let started = Instant::now();
        let timeout = match target {
            Target::Group(name) => match self.policy(name) {
                Some(policy) => policy.timeout,
                None => return Err(AdmitError::UnknownGroup(group)),
            },
            Target::Provider(_) => DIRECT_TIMEOUT,
        };
        let timeout = match until {
            Some(until) => until.saturating_duration_since(started).min(timeout),
            None => timeout,
        };
        let (tx, mut rx) = oneshot::channel();
        let admission = {
            let mut scheduler = self.scheduler.lock();
            match target {
                Target::Group(name) => {
                    scheduler.admit_excluding(name, lane, (tx, started), exclude)
                }
                Target::Provider(key) => scheduler.admit_direct(key, lane, (tx, started)),
            }
        };
        let id = match admission {
            Admission::Granted(grant) => {
                return Ok(Admitted {
                    guard: self.guard(grant.lease),
                    grant,
                    waited: Duration::ZERO,
                });
            }
            Admission::Queued(id) => id,
            Admission::QueueFull { max_waiting } => {
                return Err(AdmitError::QueueFull { group, max_waiting });
            }
            Admission::NoCapacityInLane => {
                return Err(AdmitError::NoCapacityInLane { group, lane });
            }
            Admission::Exhausted => return Err(AdmitError::Exhausted { group }),
            Admission::UnknownGroup => return Err(AdmitError::UnknownGroup(group)),
        };
        tracing::debug!(model_group = %group, lane = lane.as_str(), "request queued");
        let mut waiter = QueuedWaiter {
            control: self,
            id,
            active: true,
        };
        let outcome = match tokio::time::timeout(timeout, &mut rx).await {
            Ok(Ok(outcome)) => outcome,
            Ok(Err(_)) => Err("the edge dropped the request".to_string()),
            Err(_) => {
                waiter.active = false;
                if self.scheduler.lock().cancel_waiter(id).is_some() {
                    return Err(AdmitError::Timeout {
                        group,
                        waited: started.elapsed(),
                    });
                }
                // Dispatched (or failed) just as the timer fired: take what was sent.
                match rx.try_recv() {
                    Ok(outcome) => outcome,
                    Err(_) => Err("the edge dropped the request".to_string()),
                }
            }
        };
        waiter.active = false;
        outcome.map_err(|reason| AdmitError::Unavailable { group, reason })
    }

    fn guard(self: &Arc<Self>, lease: LeaseId) -> LeaseGuard {
        LeaseGuard {
            control: self.clone(),
            lease,
            armed: true,
        }
    }

    fn release(self: &Arc<Self>, lease: LeaseId) {
        let mut woken = Vec::new();
        self.scheduler.lock().release(lease, &mut woken);
        if !woken.is_empty() {
            self.wake_all(woken);
        }
    }

    /// Hands grants to their waiters; a waiter that is gone returns its slot at once, which
    /// may wake the next one.
    fn wake_all(self: &Arc<Self>, woken: Vec<Dispatch<(WaiterTx, Instant)>>) {
        let mut pending: VecDeque<_> = woken.into();
        while let Some(Dispatch {
            waiter: (tx, since),
            grant,
        }) = pending.pop_front()
        {
            let lease = grant.lease;
            let admitted = Admitted {
                guard: LeaseGuard {
                    control: self.clone(),
                    lease,
                    armed: true,
                },
                grant,
                waited: since.elapsed(),
            };
            if let Err(Ok(mut back)) = tx.send(Ok(admitted)) {
                back.guard.armed = false;
                let mut more = Vec::new();
                self.scheduler.lock().release(lease, &mut more);
                pending.extend(more);
            }
        }
    }

    /// The node's generation is dispatch-ready: serve the waiters it can.
    pub fn node_ready(self: &Arc<Self>, node: &str, generation: Generation) {
        let woken = self.scheduler.lock().node_ready(node, generation);
        let n = woken.len();
        self.wake_all(woken);
        if n > 0 {
            tracing::info!(
                node_id = node,
                dispatched = n,
                "node ready: queued requests dispatched"
            );
        }
    }

    /// The node's generation is gone: return its leases, end waiters left without a
    /// candidate. Returns how many leases were returned.
    pub fn node_lost(&self, node: &str, generation: Generation, reason: &str) -> usize {
        let lost = self.scheduler.lock().node_lost(node, generation);
        let n = lost.unavailable.len();
        for (tx, _) in lost.unavailable {
            let _ = tx.send(Err(format!(
                "node {node} disconnected ({reason}) and no other member can serve the request"
            )));
        }
        if n > 0 {
            tracing::warn!(
                node_id = node,
                waiters = n,
                "waiters ended unavailable: no live candidate left"
            );
        }
        lost.released.len()
    }
}
