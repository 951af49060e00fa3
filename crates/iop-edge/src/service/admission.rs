//! The async shell around [`Scheduler`]: requests wait here for a provider slot, and every
//! slot is held by a [`LeaseGuard`] that returns it exactly once, whichever of terminal,
//! send failure, client abort, node loss or queue timeout comes first. A request to a
//! group with no member online fails at once, or waits up to the group's
//! `wait_for_reconnect` for one to come back.
//!
//! It is also where request outcomes and probe reports reach the scheduler's health state
//! ([`AdmissionControl::report_outcome`], [`AdmissionControl::probe_health`]). Time is
//! tokio's clock (so tests can pause it), handed to the scheduler as `now`.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use iop_proto::{ErrorCode, pb};
use parking_lot::Mutex;
use tokio::sync::{Notify, oneshot};

pub use super::plan::{GroupPolicies, GroupPolicy};
use crate::ejection::{ProviderOutcome, Verdict};
use crate::health::ProbeChange;
use crate::lease::{Lane, LeaseId, ProviderKey};
use crate::queue::{Admission, Dispatch, Exclusion, Grant, Scheduler, WaiterId};
use crate::registry::Generation;
use crate::routing::Affinity;

/// The scheduler's clock: tokio's, so a paused test clock drives it.
pub fn clock() -> Instant {
    tokio::time::Instant::now().into_std()
}

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
    /// No member of the group is connected (and none reconnected within `waited`).
    #[error(
        "model `{group}` is unavailable: {}; offline: {}",
        match waited {
            Some(w) => format!("no member reconnected within {}s", w.as_secs()),
            None => "none of its members is connected".to_string(),
        },
        members.join(", ")
    )]
    Offline {
        group: String,
        members: Vec<String>,
        waited: Option<Duration>,
    },
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
            AdmitError::Unavailable { .. }
            | AdmitError::Offline { .. }
            | AdmitError::Exhausted { .. } => ErrorCode::ModelUnavailable,
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
    /// The request holding this slot is on its way to the node.
    pub fn sent(&self) {
        if self.armed {
            self.control.scheduler.lock().mark_sent(self.lease);
        }
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

#[derive(Debug)]
pub struct AdmissionControl {
    scheduler: Mutex<Scheduler<(WaiterTx, Instant)>>,
    policies: parking_lot::RwLock<GroupPolicies>,
    /// Woken when waiters may have become stranded (no member online any more): they
    /// look up when to give up.
    stranding: Notify,
    /// Woken when what waits may have changed: the nodes granting this edge permits are
    /// told ([`super::permits`]).
    pub(crate) demand_changed: Notify,
}

/// Removes a waiter whose request went away before it got a slot.
struct QueuedWaiter<'a> {
    control: &'a AdmissionControl,
    id: WaiterId,
    active: bool,
}

impl<'a> QueuedWaiter<'a> {
    /// A request just queued: what waits changed.
    fn new(control: &'a AdmissionControl, id: WaiterId) -> Self {
        control.demand_changed.notify_one();
        Self {
            control,
            id,
            active: true,
        }
    }
}

impl Drop for QueuedWaiter<'_> {
    /// Removes the waiter if it is still queued; either way, what waits changed.
    fn drop(&mut self) {
        if self.active {
            self.control.scheduler.lock().cancel_waiter(self.id);
        }
        self.control.demand_changed.notify_one();
    }
}

impl AdmissionControl {
    pub fn new(scheduler: Scheduler<(WaiterTx, Instant)>, policies: GroupPolicies) -> Arc<Self> {
        Arc::new(Self {
            scheduler: Mutex::new(scheduler),
            policies: parking_lot::RwLock::new(policies),
            stranding: Notify::new(),
            demand_changed: Notify::new(),
        })
    }

    /// Runs `f` with the scheduler locked (snapshots, metrics).
    pub fn inspect<R>(&self, f: impl FnOnce(&Scheduler<(WaiterTx, Instant)>) -> R) -> R {
        f(&self.scheduler.lock())
    }

    pub fn policy(&self, group: &str) -> Option<GroupPolicy> {
        self.policies.read().get(group).copied()
    }

    /// Applies a reloaded config: new capacities, groups and queue settings. Waiters of
    /// removed groups end with an error; waiters the new capacity lets through run now.
    pub fn reconfigure(
        self: &Arc<Self>,
        plan: super::plan::AdmissionPlan,
        online: &std::collections::HashMap<String, Generation>,
    ) {
        let (orphaned, woken) = {
            let mut scheduler = self.scheduler.lock();
            scheduler.set_ejection_policy(plan.ejection);
            scheduler.reconfigure(plan.providers, plan.groups, online, clock())
        };
        *self.policies.write() = plan.policies;
        self.stranding.notify_waiters();
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
    /// retry that already spent part of it; and, while no member is online, up to the
    /// group's `wait_for_reconnect`), never on a member `exclude` names (under that
    /// generation). `until` is on the scheduler's [`clock`].
    pub async fn acquire(
        self: &Arc<Self>,
        target: Target<'_>,
        lane: Lane,
        exclude: &[Exclusion],
        affinity: &Affinity,
        until: Option<Instant>,
    ) -> Result<Admitted, AdmitError> {
        let group = target.name();
        let started = clock();
        let (timeout, wait_for_reconnect) = match target {
            Target::Group(name) => match self.policy(name) {
                Some(policy) => (policy.timeout, policy.wait_for_reconnect),
                None => return Err(AdmitError::UnknownGroup(group)),
            },
            Target::Provider(_) => (DIRECT_TIMEOUT, Duration::ZERO),
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
                    scheduler.admit_steered(name, lane, (tx, started), exclude, affinity, started)
                }
                Target::Provider(key) => scheduler.admit_direct(key, lane, (tx, started), started),
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
            Admission::Offline { members } => {
                return Err(AdmitError::Offline {
                    group,
                    members,
                    waited: None,
                });
            }
            Admission::Exhausted => return Err(AdmitError::Exhausted { group }),
            Admission::UnknownGroup => return Err(AdmitError::UnknownGroup(group)),
        };
        tracing::debug!(model_group = %group, lane = lane.as_str(), "request queued");
        let mut waiter = QueuedWaiter::new(self, id);
        let deadline = tokio::time::Instant::from_std(started) + timeout;
        let dropped = || Err("the edge dropped the request".to_string());
        let outcome = loop {
            // Registered before the stranding is read, so a loss in between still wakes us.
            let restranded = self.stranding.notified();
            tokio::pin!(restranded);
            restranded.as_mut().enable();
            let stranded = self.scheduler.lock().stranded_deadline(id);
            tokio::select! {
                outcome = &mut rx => break outcome.unwrap_or_else(|_| dropped()),
                _ = tokio::time::sleep_until(deadline) => {
                    waiter.active = false;
                    if self.scheduler.lock().cancel_waiter(id).is_some() {
                        return Err(AdmitError::Timeout {
                            group,
                            waited: clock().saturating_duration_since(started),
                        });
                    }
                    // Dispatched (or failed) just as the timer fired: take what was sent.
                    break rx.try_recv().unwrap_or_else(|_| dropped());
                }
                _ = tokio::time::sleep_until(stranded.map_or(deadline, tokio::time::Instant::from_std)),
                    if stranded.is_some() => {
                    let expired = self.scheduler.lock().expire_stranded(id, clock());
                    if let Some((_, members)) = expired {
                        waiter.active = false;
                        return Err(AdmitError::Offline {
                            group,
                            members,
                            waited: Some(wait_for_reconnect),
                        });
                    }
                }
                _ = &mut restranded => {}
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
        self.scheduler.lock().release(lease, &mut woken, clock());
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
                waited: clock().saturating_duration_since(since),
            };
            if let Err(Ok(mut back)) = tx.send(Ok(admitted)) {
                back.guard.armed = false;
                let mut more = Vec::new();
                self.scheduler.lock().release(lease, &mut more, clock());
                pending.extend(more);
            }
        }
    }

    /// The node's permits for this edge, granted over its connection `generation`: serve
    /// the waiters they let through.
    pub fn set_permits(
        self: &Arc<Self>,
        node: &str,
        generation: Generation,
        permits: &[(&str, u32)],
    ) {
        let mut woken = Vec::new();
        self.scheduler
            .lock()
            .set_permits(node, generation, permits, &mut woken, clock());
        self.wake_all(woken);
    }

    /// What this edge holds and wants of `node`'s providers that grant it permits.
    pub fn permit_demand(&self, node: &str) -> Vec<crate::queue::PermitDemand> {
        self.scheduler.lock().permit_demand(node, clock())
    }

    /// The node's generation is dispatch-ready: serve the waiters it can.
    pub fn node_ready(self: &Arc<Self>, node: &str, generation: Generation) {
        let woken = self.scheduler.lock().node_ready(node, generation, clock());
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
        let lost = self.scheduler.lock().node_lost(node, generation, clock());
        if lost.stranded > 0 {
            self.stranding.notify_waiters();
            tracing::info!(
                node_id = node,
                waiters = lost.stranded,
                "no member online: waiters wait for a reconnect"
            );
        }
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

impl AdmissionControl {
    /// Records how one request to `node`/`provider` went, for passive ejection; logs an
    /// ejection (and a member kept because it is its group's last usable one).
    pub fn report_outcome(
        &self,
        node: &str,
        provider: &str,
        outcome: &ProviderOutcome,
        now: Instant,
    ) -> Option<Verdict> {
        let key = ProviderKey::new(node, provider);
        let (verdict, threshold) = {
            let mut scheduler = self.scheduler.lock();
            let threshold = scheduler.ejection_policy().consecutive_failures;
            (scheduler.report_outcome(&key, outcome, now)?, threshold)
        };
        match &verdict {
            Verdict::Ejected {
                duration,
                times,
                reason,
                ..
            } => tracing::warn!(
                node_id = node,
                provider,
                for_sec = duration.as_secs_f64(),
                times,
                %reason,
                "provider ejected: no new requests until the time is up or a probe finds it healthy"
            ),
            // Said once per streak: a failing last member would otherwise log every request.
            Verdict::Kept { failures } if *failures == threshold => tracing::warn!(
                node_id = node,
                provider,
                failures,
                "provider keeps failing but is not ejected: it is the last usable member of a model group, or as many of a group as health.ejection.max_ejected_percent allows are out"
            ),
            Verdict::OneCaller { failures } if *failures == threshold => tracing::warn!(
                node_id = node,
                provider,
                failures,
                "provider keeps failing, but only for one key's requests: not ejected (it may be what that key sends)"
            ),
            Verdict::Kept { .. } | Verdict::OneCaller { .. } => {}
            Verdict::Unchanged => {}
        }
        Some(verdict)
    }

    /// `key` answered 429: it cools down for `wait` from `now`.
    pub fn cool_down(&self, key: &ProviderKey, wait: Duration, now: Instant) {
        tracing::info!(node_id = %key.node, provider = %key.provider, for_sec = wait.as_secs_f64(), "provider answered 429: cooling down");
        self.scheduler.lock().cool_down(key, now + wait);
    }

    /// Whether a member of `group` serves `api` itself (a request whose translation was
    /// refused can still go there).
    pub fn group_serves_natively(&self, group: &str, api: crate::canonical::NativeApi) -> bool {
        self.scheduler.lock().any_member_traits(group, |traits| {
            crate::service::route::serves_natively(traits, api)
        })
    }

    /// Takes one provider's probe report from `node`'s connection `generation`; a provider
    /// healthy again serves the waiters it can at once.
    pub fn probe_health(
        self: &Arc<Self>,
        node: &str,
        generation: Generation,
        report: &pb::ProviderHealth,
        now: Instant,
    ) -> Option<ProbeChange> {
        let mut woken = Vec::new();
        let change = self
            .scheduler
            .lock()
            .set_probe_health(node, generation, report, now, &mut woken);
        self.wake_all(woken);
        change
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lease::LaneCounts;
    use crate::queue::{GroupSpec, MemberSpec};

    fn control(wait_for_reconnect: Duration) -> Arc<AdmissionControl> {
        let scheduler = Scheduler::new(
            [],
            [GroupSpec {
                name: "g".into(),
                members: vec![MemberSpec {
                    key: ProviderKey::new("n", "p"),
                    upstream_model: "m".into(),
                    capacity: LaneCounts { normal: 1, long: 0 },
                    enabled: true,
                    traits: Default::default(),
                }],
                max_waiting: 8,
                wait_for_reconnect,
                routing: Default::default(),
            }],
        );
        AdmissionControl::new(
            scheduler,
            GroupPolicies::from_iter([(
                "g".to_string(),
                GroupPolicy {
                    timeout: Duration::from_secs(30),
                    long_context_tokens: None,
                    wait_for_reconnect,
                    routing: Default::default(),
                },
            )]),
        )
    }

    /// A request for group `g` on the normal lane, excluding and steered by nothing,
    /// waiting as long as the group lets it.
    async fn acquire_g(c: &Arc<AdmissionControl>) -> Result<Admitted, AdmitError> {
        c.acquire(
            Target::Group("g"),
            Lane::Normal,
            &[],
            &Affinity::none(),
            None,
        )
        .await
    }

    #[tokio::test(start_paused = true)]
    async fn with_no_member_online_a_request_fails_at_once_naming_it() {
        let c = control(Duration::ZERO);
        let started = tokio::time::Instant::now();
        let err = acquire_g(&c).await.unwrap_err();
        assert_eq!(started.elapsed(), Duration::ZERO);
        assert_eq!(
            err.to_string(),
            "model `g` is unavailable: none of its members is connected; offline: n/p"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_group_that_waits_for_reconnects_gives_up_after_its_wait() {
        let c = control(Duration::from_secs(5));
        let started = tokio::time::Instant::now();
        let err = acquire_g(&c).await.unwrap_err();
        assert_eq!(started.elapsed(), Duration::from_secs(5));
        assert!(
            matches!(err, AdmitError::Offline { waited: Some(w), .. } if w == Duration::from_secs(5))
        );
        assert!(
            err.to_string().contains("no member reconnected within 5s"),
            "{err}"
        );
        c.inspect(|s| assert_eq!(s.waiting(0), LaneCounts::default()));
    }

    #[tokio::test(start_paused = true)]
    async fn a_reconnect_within_the_wait_serves_the_request() {
        let c = control(Duration::from_secs(5));
        let waiter = tokio::spawn({
            let c = c.clone();
            async move { acquire_g(&c).await.map(|a| a.grant.generation) }
        });
        tokio::time::sleep(Duration::from_secs(3)).await;
        c.node_ready("n", Generation(4));
        assert_eq!(waiter.await.unwrap().unwrap(), Generation(4));
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_stranded_by_a_loss_waits_from_the_loss_on() {
        let c = control(Duration::from_secs(5));
        c.node_ready("n", Generation(1));
        let running = acquire_g(&c).await.unwrap();
        let waiter = tokio::spawn({
            let c = c.clone();
            async move { acquire_g(&c).await.map(|_| ()) }
        });
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert!(!waiter.is_finished(), "waiting for capacity, not stranded");
        let lost_at = tokio::time::Instant::now();
        c.node_lost("n", Generation(1), "test");
        let err = waiter.await.unwrap().unwrap_err();
        assert_eq!(lost_at.elapsed(), Duration::from_secs(5));
        assert!(matches!(err, AdmitError::Offline { .. }), "{err}");
        drop(running);
    }
}
