//! The CLI adapter's session table: which (target, session id) has a live process, which
//! of them is busy with a turn, who owns it, when each was last used — and the limits on
//! them: at most `max_sessions` live processes, at most `max_per_owner` sessions of one
//! owner (an API key; unowned runs are not counted per owner), and none idle for longer
//! than `idle`.
//!
//! Pure state: no processes, no clock. The adapter checks a process out for a turn and
//! checks it back in after; the reaper asks for the expired ones. A session taken out of
//! the table still counts against the cap until its process has been waited for
//! ([`SessionTable::ended`]), so the cap bounds live processes, not table rows. A session over the cap
//! is refused rather than evicting an idle one: eviction would silently throw away another
//! conversation's state, while a refusal tells the client what happened and what to do.

use std::collections::HashMap;
use std::time::Duration;

use tokio::time::Instant;

/// (target, session id).
pub type SessionKey = (String, String);

/// The limits of one adapter's sessions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionLimits {
    pub max_sessions: usize,
    /// Sessions one owner keeps at most.
    pub max_per_owner: usize,
    pub idle: Duration,
}

/// Why a turn could not get its session's process.
#[derive(Debug, PartialEq, Eq)]
pub enum CheckoutError<E> {
    /// Another run is in this session right now.
    Busy,
    /// Starting a new session would exceed `max_sessions`.
    Full { max_sessions: usize },
    /// Starting a new session would exceed what its owner may keep.
    OwnerFull { max_per_owner: usize },
    /// The process could not be started.
    Spawn(E),
}

/// A process checked out for one turn; `id` names the slot it belongs to.
#[derive(Debug)]
pub struct CheckedOut<P> {
    pub id: u64,
    pub process: P,
    /// Whether the process was started for this turn.
    pub fresh: bool,
}

/// A session taken out of the table; `process` is `None` when a turn holds it.
#[derive(Debug)]
pub struct Removed<P> {
    pub key: SessionKey,
    pub pid: u32,
    pub idle_for: Duration,
    pub process: Option<P>,
}

/// One live session, as listed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionView {
    pub key: SessionKey,
    pub pid: u32,
    pub age: Duration,
    /// `None` while a turn runs.
    pub idle: Option<Duration>,
}

#[derive(Debug)]
struct Slot<P> {
    id: u64,
    pid: u32,
    owner: String,
    started: Instant,
    last_used: Instant,
    /// `None` while checked out.
    process: Option<P>,
}

#[derive(Debug)]
pub struct SessionTable<P> {
    limits: SessionLimits,
    slots: HashMap<SessionKey, Slot<P>>,
    /// Sessions taken out whose process is not yet waited for.
    ending: usize,
    next_id: u64,
}

impl<P> SessionTable<P> {
    pub fn new(limits: SessionLimits) -> Self {
        Self {
            limits,
            slots: HashMap::new(),
            ending: 0,
            next_id: 0,
        }
    }

    pub fn limits(&self) -> SessionLimits {
        self.limits
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Processes counted against the cap: the sessions, and those still ending.
    pub fn live(&self) -> usize {
        self.slots.len() + self.ending
    }

    /// A process of a session taken out (reaped, removed, discarded, drained) has been
    /// waited for: its place under the cap is free.
    pub fn ended(&mut self) {
        self.ending = self.ending.saturating_sub(1);
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Sessions `owner` keeps.
    pub fn owned_by(&self, owner: &str) -> usize {
        self.slots.values().filter(|s| s.owner == owner).count()
    }

    /// The session's process for one turn: the idle one, or — for a new session of
    /// `owner` — a new one from `spawn` (which returns the pid and the process) if the
    /// caps allow.
    pub fn checkout<E>(
        &mut self,
        key: &SessionKey,
        owner: &str,
        now: Instant,
        spawn: impl FnOnce() -> Result<(u32, P), E>,
    ) -> Result<CheckedOut<P>, CheckoutError<E>> {
        if let Some(slot) = self.slots.get_mut(key) {
            let process = slot.process.take().ok_or(CheckoutError::Busy)?;
            slot.last_used = now;
            return Ok(CheckedOut {
                id: slot.id,
                process,
                fresh: false,
            });
        }
        if self.live() >= self.limits.max_sessions {
            return Err(CheckoutError::Full {
                max_sessions: self.limits.max_sessions,
            });
        }
        if !owner.is_empty() && self.owned_by(owner) >= self.limits.max_per_owner {
            return Err(CheckoutError::OwnerFull {
                max_per_owner: self.limits.max_per_owner,
            });
        }
        let (pid, process) = spawn().map_err(CheckoutError::Spawn)?;
        self.next_id += 1;
        let id = self.next_id;
        self.slots.insert(
            key.clone(),
            Slot {
                id,
                pid,
                owner: owner.to_string(),
                started: now,
                last_used: now,
                process: None,
            },
        );
        Ok(CheckedOut {
            id,
            process,
            fresh: true,
        })
    }

    /// Puts a process back after a completed turn. `Err` gives it back when its slot is
    /// gone (the session was terminated meanwhile): the caller ends it.
    pub fn check_in(
        &mut self,
        key: &SessionKey,
        id: u64,
        process: P,
        now: Instant,
    ) -> Result<(), P> {
        match self.slots.get_mut(key) {
            Some(slot) if slot.id == id && slot.process.is_none() => {
                slot.process = Some(process);
                slot.last_used = now;
                Ok(())
            }
            _ => Err(process),
        }
    }

    /// Forgets the slot of a turn that did not complete (its process is ended by the
    /// caller, who then calls [`ended`](Self::ended)). A slot that was replaced or removed
    /// meanwhile is left alone (its removal already counted the process as ending).
    pub fn discard(&mut self, key: &SessionKey, id: u64) {
        if self.slots.get(key).is_some_and(|s| s.id == id) {
            self.slots.remove(key);
            self.ending += 1;
        }
    }

    /// Takes a session out (terminate); its process counts as ending until
    /// [`ended`](Self::ended).
    pub fn remove(&mut self, key: &SessionKey, now: Instant) -> Option<Removed<P>> {
        let slot = self.slots.remove(key)?;
        self.ending += 1;
        Some(Removed {
            key: key.clone(),
            pid: slot.pid,
            idle_for: now.saturating_duration_since(slot.last_used),
            process: slot.process,
        })
    }

    /// Takes out every idle session whose idle time reached the limit.
    pub fn reap(&mut self, now: Instant) -> Vec<Removed<P>> {
        let idle = self.limits.idle;
        let expired: Vec<SessionKey> = self
            .slots
            .iter()
            .filter(|(_, s)| {
                s.process.is_some() && now.saturating_duration_since(s.last_used) >= idle
            })
            .map(|(k, _)| k.clone())
            .collect();
        expired
            .iter()
            .filter_map(|key| self.remove(key, now))
            .collect()
    }

    /// Takes out every session (the adapter is going away).
    pub fn drain(&mut self, now: Instant) -> Vec<Removed<P>> {
        let keys: Vec<SessionKey> = self.slots.keys().cloned().collect();
        keys.iter().filter_map(|k| self.remove(k, now)).collect()
    }

    /// When the next idle session expires, if any is idle.
    pub fn next_expiry(&self) -> Option<Instant> {
        self.slots
            .values()
            .filter(|s| s.process.is_some())
            .map(|s| s.last_used + self.limits.idle)
            .min()
    }

    pub fn list(&self, now: Instant) -> Vec<SessionView> {
        let mut all: Vec<SessionView> = self
            .slots
            .iter()
            .map(|(key, s)| SessionView {
                key: key.clone(),
                pid: s.pid,
                age: now.saturating_duration_since(s.started),
                idle: s
                    .process
                    .as_ref()
                    .map(|_| now.saturating_duration_since(s.last_used)),
            })
            .collect();
        all.sort_by(|a, b| a.key.cmp(&b.key));
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(s: &str) -> SessionKey {
        ("t".into(), s.into())
    }

    fn table(max: usize, idle_sec: u64) -> SessionTable<&'static str> {
        SessionTable::new(SessionLimits {
            max_sessions: max,
            max_per_owner: max,
            idle: Duration::from_secs(idle_sec),
        })
    }

    fn spawn(p: &'static str) -> impl FnOnce() -> Result<(u32, &'static str), String> {
        move || Ok((7, p))
    }

    #[test]
    fn one_owner_cannot_take_every_session_from_the_others() {
        let mut t = SessionTable::new(SessionLimits {
            max_sessions: 4,
            max_per_owner: 2,
            idle: Duration::from_secs(60),
        });
        let now = Instant::now();
        for s in ["a1", "a2"] {
            t.checkout(&key(s), "alice", now, spawn("p")).unwrap();
        }
        assert_eq!(
            t.checkout(&key("a3"), "alice", now, spawn("p"))
                .unwrap_err(),
            CheckoutError::OwnerFull { max_per_owner: 2 }
        );
        // Another key still gets its sessions; unowned runs count only against the cap.
        t.checkout(&key("b1"), "bob", now, spawn("p")).unwrap();
        t.checkout(&key("x"), "", now, spawn("p")).unwrap();
        assert_eq!(
            t.checkout(&key("b2"), "bob", now, spawn("p")).unwrap_err(),
            CheckoutError::Full { max_sessions: 4 }
        );
        assert_eq!((t.owned_by("alice"), t.owned_by("bob")), (2, 1));
    }

    #[test]
    fn a_session_is_busy_while_checked_out_and_reused_after() {
        let mut t = table(4, 60);
        let now = Instant::now();
        let a = t.checkout(&key("a"), "", now, spawn("pa")).unwrap();
        assert!(a.fresh);
        assert_eq!(
            t.checkout(&key("a"), "", now, spawn("other")).unwrap_err(),
            CheckoutError::Busy
        );
        t.check_in(&key("a"), a.id, a.process, now).unwrap();
        let again = t.checkout(&key("a"), "", now, spawn("other")).unwrap();
        assert_eq!((again.process, again.fresh, again.id), ("pa", false, a.id));
    }

    #[test]
    fn over_the_cap_a_new_session_is_refused_and_nothing_is_spawned() {
        let mut t = table(2, 60);
        let now = Instant::now();
        for s in ["a", "b"] {
            let c = t.checkout(&key(s), "", now, spawn("p")).unwrap();
            t.check_in(&key(s), c.id, c.process, now).unwrap();
        }
        let refused = t.checkout(&key("c"), "", now, || -> Result<(u32, &str), String> {
            panic!("no process may start over the cap")
        });
        assert_eq!(
            refused.unwrap_err(),
            CheckoutError::Full { max_sessions: 2 }
        );
        // Existing sessions still work; a freed slot admits a new one once the removed
        // session's process has ended.
        assert!(t.checkout(&key("a"), "", now, spawn("x")).is_ok());
        assert!(t.remove(&key("b"), now).is_some());
        assert_eq!(
            t.checkout(&key("c"), "", now, spawn("pc")).unwrap_err(),
            CheckoutError::Full { max_sessions: 2 }
        );
        t.ended();
        assert!(t.checkout(&key("c"), "", now, spawn("pc")).unwrap().fresh);
    }

    #[tokio::test(start_paused = true)]
    async fn reaped_sessions_hold_their_place_until_their_process_is_waited_for() {
        let mut t = table(2, 10);
        for s in ["a", "b"] {
            let c = t.checkout(&key(s), "", Instant::now(), spawn("p")).unwrap();
            t.check_in(&key(s), c.id, c.process, Instant::now())
                .unwrap();
        }
        tokio::time::advance(Duration::from_secs(10)).await;
        assert_eq!(t.reap(Instant::now()).len(), 2);
        assert_eq!((t.len(), t.live()), (0, 2));
        let full = t.checkout(&key("c"), "", Instant::now(), spawn("pc"));
        assert_eq!(full.unwrap_err(), CheckoutError::Full { max_sessions: 2 });
        t.ended();
        assert!(
            t.checkout(&key("c"), "", Instant::now(), spawn("pc"))
                .is_ok()
        );
        assert!(
            t.checkout(&key("d"), "", Instant::now(), spawn("pd"))
                .is_err()
        );
        t.ended();
        t.ended();
        assert_eq!(t.live(), 1, "ending never goes below zero");
    }

    #[test]
    fn a_failed_spawn_takes_no_slot() {
        let mut t = table(1, 60);
        let now = Instant::now();
        let e = t.checkout(&key("a"), "", now, || {
            Err::<(u32, &str), _>("nope".to_string())
        });
        assert_eq!(e.unwrap_err(), CheckoutError::Spawn("nope".into()));
        assert!(t.is_empty());
        assert!(t.checkout(&key("a"), "", now, spawn("p")).is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn idle_sessions_expire_and_busy_ones_never_do() {
        let mut t = table(4, 10);
        let start = Instant::now();
        let a = t.checkout(&key("a"), "", start, spawn("pa")).unwrap();
        let b = t.checkout(&key("b"), "", start, spawn("pb")).unwrap();
        t.check_in(&key("a"), a.id, a.process, start).unwrap();
        assert_eq!(t.next_expiry(), Some(start + Duration::from_secs(10)));
        tokio::time::advance(Duration::from_secs(9)).await;
        assert!(t.reap(Instant::now()).is_empty());
        tokio::time::advance(Duration::from_secs(1)).await;
        let reaped = t.reap(Instant::now());
        assert_eq!(reaped.len(), 1);
        assert_eq!(
            (reaped[0].key.1.as_str(), reaped[0].process),
            ("a", Some("pa"))
        );
        assert_eq!(reaped[0].idle_for, Duration::from_secs(10));
        // b is in a turn for an hour: never reaped while busy.
        tokio::time::advance(Duration::from_secs(3600)).await;
        assert!(t.reap(Instant::now()).is_empty());
        assert_eq!(t.next_expiry(), None);
        // Its idle time counts from the end of the turn.
        let done = Instant::now();
        t.check_in(&key("b"), b.id, b.process, done).unwrap();
        assert_eq!(t.next_expiry(), Some(done + Duration::from_secs(10)));
        tokio::time::advance(Duration::from_secs(10)).await;
        assert_eq!(t.reap(Instant::now()).len(), 1);
        assert!(t.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_turn_resets_the_idle_clock() {
        let mut t = table(4, 10);
        let c = t
            .checkout(&key("a"), "", Instant::now(), spawn("p"))
            .unwrap();
        t.check_in(&key("a"), c.id, c.process, Instant::now())
            .unwrap();
        for _ in 0..5 {
            tokio::time::advance(Duration::from_secs(8)).await;
            assert!(t.reap(Instant::now()).is_empty());
            let c = t
                .checkout(&key("a"), "", Instant::now(), spawn("new"))
                .unwrap();
            assert!(!c.fresh);
            t.check_in(&key("a"), c.id, c.process, Instant::now())
                .unwrap();
        }
        let idle = t.list(Instant::now())[0].idle;
        assert_eq!(idle, Some(Duration::ZERO));
    }

    #[test]
    fn a_terminated_session_does_not_take_back_its_old_process() {
        let mut t = table(4, 60);
        let now = Instant::now();
        let old = t.checkout(&key("a"), "", now, spawn("old")).unwrap();
        let removed = t.remove(&key("a"), now).unwrap();
        assert_eq!((removed.pid, removed.process), (7, None));
        let new = t.checkout(&key("a"), "", now, spawn("new")).unwrap();
        // The old turn finishing late neither replaces nor discards the new session.
        assert_eq!(t.check_in(&key("a"), old.id, old.process, now), Err("old"));
        t.discard(&key("a"), old.id);
        assert_eq!((t.len(), t.live()), (1, 2), "the old process counts once");
        t.check_in(&key("a"), new.id, new.process, now).unwrap();
        assert_eq!(
            t.checkout(&key("a"), "", now, spawn("x")).unwrap().process,
            "new"
        );
    }

    #[test]
    fn a_failed_turn_frees_its_slot() {
        let mut t = table(1, 60);
        let now = Instant::now();
        let c = t.checkout(&key("a"), "", now, spawn("p")).unwrap();
        t.discard(&key("a"), c.id);
        assert!(t.is_empty());
        assert!(
            t.checkout(&key("b"), "", now, spawn("q")).is_err(),
            "still ending"
        );
        t.ended();
        assert!(t.checkout(&key("b"), "", now, spawn("q")).is_ok());
    }

    #[test]
    fn drain_takes_everything_busy_or_not() {
        let mut t = table(4, 60);
        let now = Instant::now();
        let a = t.checkout(&key("a"), "", now, spawn("pa")).unwrap();
        t.check_in(&key("a"), a.id, a.process, now).unwrap();
        let _b = t.checkout(&key("b"), "", now, spawn("pb")).unwrap();
        let mut drained: Vec<_> = t.drain(now).into_iter().map(|r| r.process).collect();
        drained.sort();
        assert_eq!(drained, [None, Some("pa")]);
        assert!(t.is_empty());
    }
}
