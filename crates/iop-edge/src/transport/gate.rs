//! The node listener's gate before authentication: caps on connections that have not
//! registered yet (in total and per source address, TLS handshakes included), the
//! bad-credential throttle, and the periodic summary that replaces a log line per refused
//! connection, failed handshake or guessed credential.
//!
//! [`UnauthenticatedCounts`] and [`Notices`] are pure state; [`NodeGate`] is their shared,
//! locked shell and hands out an [`UnauthenticatedSlot`] per admitted connection, released
//! when the connection registers or ends. The gate decides nothing about nodes: the
//! registry still authenticates.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::config::NodeLimitsConfig;
use crate::throttle::{FailureSummary, FailureThrottle, ThrottlePolicy, address_group};

/// How bad node credentials (static tokens, join tokens, client certificates) are
/// throttled per source address.
pub const CREDENTIAL_THROTTLE: ThrottlePolicy = ThrottlePolicy {
    base_delay: Duration::from_millis(250),
    max_delay: Duration::from_secs(30),
    forgive_after: Duration::from_secs(600),
    max_tracked: 4096,
};

/// Something the gate refused or closed, counted per summary window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Notice {
    /// A connection over `max_unauthenticated`.
    OverTotalCap,
    /// A connection over `max_unauthenticated_per_address`.
    OverAddressCap,
    /// No completed TLS handshake within `tls_handshake_timeout_sec`.
    TlsHandshakeTimeout,
    /// A TLS handshake that failed (not TLS, a protocol error...).
    TlsHandshakeFailed,
    /// No frame within `register_timeout_sec`.
    RegisterTimeout,
    /// A first frame announced over `first_frame_bytes`.
    OversizedFirstFrame,
    /// A first frame that did not decode.
    UndecodableFirstFrame,
    /// A first frame that was not a RegisterRequest.
    NotRegister,
    /// A credential refused: a token no node has, an unknown join token, a client
    /// certificate the listener does not trust, a revoked node...
    BadCredential,
    /// A registration refused because its address is throttled.
    Throttled,
}

impl Notice {
    const ALL: [Notice; 10] = [
        Notice::BadCredential,
        Notice::Throttled,
        Notice::OverTotalCap,
        Notice::OverAddressCap,
        Notice::TlsHandshakeTimeout,
        Notice::TlsHandshakeFailed,
        Notice::RegisterTimeout,
        Notice::OversizedFirstFrame,
        Notice::UndecodableFirstFrame,
        Notice::NotRegister,
    ];

    fn index(self) -> usize {
        Self::ALL.iter().position(|n| *n == self).expect("listed")
    }

    /// The metric label of this refusal.
    pub fn label(self) -> &'static str {
        match self {
            Notice::OverTotalCap => "unauthenticated_cap",
            Notice::OverAddressCap => "address_cap",
            Notice::TlsHandshakeTimeout => "tls_handshake_timeout",
            Notice::TlsHandshakeFailed => "tls_handshake_failed",
            Notice::RegisterTimeout => "register_timeout",
            Notice::OversizedFirstFrame => "oversized_first_frame",
            Notice::UndecodableFirstFrame => "undecodable_first_frame",
            Notice::NotRegister => "not_register",
            Notice::BadCredential => "bad_credential",
            Notice::Throttled => "throttled",
        }
    }

    /// How the summary line names `n` of them.
    fn describe(self, n: u64) -> String {
        let s = if n == 1 { "" } else { "s" };
        match self {
            Notice::BadCredential => format!("{n} bad node credential{s}"),
            Notice::Throttled => format!("{n} registration{s} refused while throttled"),
            Notice::OverTotalCap => {
                format!("{n} connection{s} closed over limits.nodes.max_unauthenticated")
            }
            Notice::OverAddressCap => format!(
                "{n} connection{s} closed over limits.nodes.max_unauthenticated_per_address"
            ),
            Notice::TlsHandshakeTimeout => format!("{n} TLS handshake timeout{s}"),
            Notice::TlsHandshakeFailed => format!("{n} failed TLS handshake{s}"),
            Notice::RegisterTimeout => format!("{n} register timeout{s}"),
            Notice::OversizedFirstFrame => format!("{n} oversized first frame{s}"),
            Notice::UndecodableFirstFrame => format!("{n} undecodable first frame{s}"),
            Notice::NotRegister => format!("{n} first frame{s} other than register"),
        }
    }
}

/// Counts of notices in the current summary window, and whether the first of each kind
/// was logged on its own already (one line per kind per window, the rest summarized).
#[derive(Debug, Default)]
pub struct Notices {
    counts: [u64; Notice::ALL.len()],
}

impl Notices {
    /// Counts one notice; true when it is the first of its kind in this window (log it).
    pub fn note(&mut self, notice: Notice) -> bool {
        let count = &mut self.counts[notice.index()];
        *count = count.saturating_add(1);
        *count == 1
    }

    /// The summary of this window (None when nothing happened), and a fresh window.
    pub fn take(&mut self, window: Duration, bad_credentials: FailureSummary) -> Option<String> {
        let counts = std::mem::take(&mut self.counts);
        if counts.iter().all(|n| *n == 0) && bad_credentials.failures == 0 {
            return None;
        }
        let mut parts = Vec::new();
        for notice in Notice::ALL {
            let n = if notice == Notice::BadCredential {
                bad_credentials.failures
            } else {
                counts[notice.index()]
            };
            if n == 0 {
                continue;
            }
            let mut part = notice.describe(n);
            if notice == Notice::BadCredential {
                let addresses = bad_credentials.addresses;
                let s = if addresses == 1 { "" } else { "es" };
                part.push_str(&format!(" from {addresses} address{s}"));
                if let Some((top, count)) = bad_credentials.top {
                    part.push_str(&format!(", most from {top} ({count})"));
                }
            }
            parts.push(part);
        }
        Some(format!(
            "node listener, last {}s: {}",
            window.as_secs_f64().round(),
            parts.join("; ")
        ))
    }
}

/// Connections admitted and not registered yet, in total and per address group.
#[derive(Debug, Default)]
pub struct UnauthenticatedCounts {
    total: usize,
    per_address: HashMap<IpAddr, usize>,
}

impl UnauthenticatedCounts {
    /// Admits one more connection from `addr` unless that would pass a cap.
    pub fn try_open(
        &mut self,
        addr: IpAddr,
        max_total: usize,
        max_per_address: usize,
    ) -> Result<(), Notice> {
        if self.total >= max_total {
            return Err(Notice::OverTotalCap);
        }
        let key = address_group(addr);
        let here = self.per_address.entry(key).or_insert(0);
        if *here >= max_per_address {
            return Err(Notice::OverAddressCap);
        }
        *here += 1;
        self.total += 1;
        Ok(())
    }

    /// One admitted connection from `addr` registered or ended.
    pub fn close(&mut self, addr: IpAddr) {
        let key = address_group(addr);
        if let Some(here) = self.per_address.get_mut(&key) {
            *here -= 1;
            if *here == 0 {
                self.per_address.remove(&key);
            }
            self.total -= 1;
        }
    }

    pub fn total(&self) -> usize {
        self.total
    }

    /// Per-address entries held (every one has a live connection).
    #[cfg(test)]
    pub fn addresses(&self) -> usize {
        self.per_address.len()
    }
}

#[derive(Debug)]
struct GateState {
    counts: UnauthenticatedCounts,
    throttle: FailureThrottle,
    notices: Notices,
    window_started: Instant,
}

/// The gate shared by the listener and its connections.
#[derive(Debug)]
pub struct NodeGate {
    state: Mutex<GateState>,
}

impl NodeGate {
    pub fn new(now: Instant) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(GateState {
                counts: UnauthenticatedCounts::default(),
                throttle: FailureThrottle::new(CREDENTIAL_THROTTLE),
                notices: Notices::default(),
                window_started: now,
            }),
        })
    }

    /// Admits a new connection from `addr` under `limits`, or says why not (counted).
    pub fn admit(
        self: &Arc<Self>,
        addr: IpAddr,
        limits: &NodeLimitsConfig,
    ) -> Result<UnauthenticatedSlot, (Notice, bool)> {
        let mut state = self.state.lock();
        match state.counts.try_open(
            addr,
            limits.max_unauthenticated,
            limits.max_unauthenticated_per_address,
        ) {
            Ok(()) => Ok(UnauthenticatedSlot {
                gate: self.clone(),
                addr,
                open: true,
            }),
            Err(notice) => Err((notice, state.notices.note(notice))),
        }
    }

    /// Counts a notice; true when it is the first of its kind in this window (log it).
    pub fn note(&self, notice: Notice) -> bool {
        self.state.lock().notices.note(notice)
    }

    /// Ok if a registration from `addr` may be checked now; Err(wait) if it is throttled
    /// (counted as [`Notice::Throttled`], with whether to log it).
    pub fn check_credential_attempt(
        &self,
        addr: IpAddr,
        now: Instant,
    ) -> Result<(), (Duration, bool)> {
        let mut state = self.state.lock();
        state
            .throttle
            .check(addr, now)
            .map_err(|wait| (wait, state.notices.note(Notice::Throttled)))
    }

    /// A refused credential from `addr`; true when it is the first in this window (log it).
    pub fn bad_credential(&self, addr: IpAddr, now: Instant) -> bool {
        let mut state = self.state.lock();
        state.throttle.failure(addr, now);
        state.notices.note(Notice::BadCredential)
    }

    /// A credential that belongs to a node came from `addr`.
    pub fn good_credential(&self, addr: IpAddr) {
        self.state.lock().throttle.success(addr);
    }

    /// The summary line of the window that ends `now`, if anything happened in it.
    pub fn take_summary(&self, now: Instant) -> Option<String> {
        let mut state = self.state.lock();
        let window = now.saturating_duration_since(state.window_started);
        state.window_started = now;
        let bad_credentials = state.throttle.take_summary();
        state.notices.take(window, bad_credentials)
    }

    /// Connections admitted and not registered yet.
    pub fn unauthenticated(&self) -> usize {
        self.state.lock().counts.total()
    }

    fn release(&self, addr: IpAddr) {
        self.state.lock().counts.close(addr);
    }
}

/// One admitted, not yet registered connection; dropping it (or registering) frees its
/// place under the caps.
#[derive(Debug)]
pub struct UnauthenticatedSlot {
    gate: Arc<NodeGate>,
    addr: IpAddr,
    open: bool,
}

impl UnauthenticatedSlot {
    /// The connection registered: it no longer counts as unauthenticated.
    pub fn authenticated(mut self) {
        self.release();
    }

    fn release(&mut self) {
        if std::mem::take(&mut self.open) {
            self.gate.release(self.addr);
        }
    }
}

impl Drop for UnauthenticatedSlot {
    fn drop(&mut self) {
        self.release();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn limits(total: usize, per_address: usize) -> NodeLimitsConfig {
        NodeLimitsConfig {
            max_unauthenticated: total,
            max_unauthenticated_per_address: per_address,
            ..Default::default()
        }
    }

    #[test]
    fn caps_hold_per_address_and_in_total() {
        let mut c = UnauthenticatedCounts::default();
        assert!(c.try_open(ip("10.0.0.1"), 3, 2).is_ok());
        assert!(c.try_open(ip("10.0.0.1"), 3, 2).is_ok());
        assert_eq!(
            c.try_open(ip("10.0.0.1"), 3, 2),
            Err(Notice::OverAddressCap)
        );
        assert!(c.try_open(ip("10.0.0.2"), 3, 2).is_ok());
        assert_eq!(c.try_open(ip("10.0.0.3"), 3, 2), Err(Notice::OverTotalCap));
        c.close(ip("10.0.0.1"));
        assert!(c.try_open(ip("10.0.0.3"), 3, 2).is_ok());
        assert_eq!(c.total(), 3);
    }

    #[test]
    fn ipv6_hosts_of_one_64_share_a_cap() {
        let mut c = UnauthenticatedCounts::default();
        assert!(c.try_open(ip("2001:db8::1"), 10, 1).is_ok());
        assert_eq!(
            c.try_open(ip("2001:db8::2"), 10, 1),
            Err(Notice::OverAddressCap)
        );
        assert!(c.try_open(ip("2001:db8:0:1::1"), 10, 1).is_ok());
    }

    #[test]
    fn closing_frees_the_entry() {
        let mut c = UnauthenticatedCounts::default();
        for _ in 0..3 {
            c.try_open(ip("10.0.0.1"), 10, 5).unwrap();
        }
        for _ in 0..3 {
            c.close(ip("10.0.0.1"));
        }
        assert_eq!((c.total(), c.addresses()), (0, 0));
    }

    #[test]
    fn slots_release_on_drop_and_on_authentication() {
        let gate = NodeGate::new(Instant::now());
        let l = limits(2, 2);
        let a = gate.admit(ip("10.0.0.1"), &l).unwrap();
        let b = gate.admit(ip("10.0.0.1"), &l).unwrap();
        let (notice, log) = gate.admit(ip("10.0.0.2"), &l).unwrap_err();
        assert_eq!((notice, log), (Notice::OverTotalCap, true));
        let (_, log) = gate.admit(ip("10.0.0.2"), &l).unwrap_err();
        assert!(!log, "only the first of a kind per window is logged");
        drop(a);
        b.authenticated();
        assert_eq!(gate.unauthenticated(), 0);
    }

    #[test]
    fn the_first_of_each_kind_per_window_is_logged_and_all_are_summarized() {
        let start = Instant::now();
        let gate = NodeGate::new(start);
        assert!(gate.bad_credential(ip("10.0.0.1"), start));
        for _ in 0..999 {
            assert!(!gate.bad_credential(ip("10.0.0.1"), start));
        }
        assert!(!gate.bad_credential(ip("10.0.0.2"), start));
        let (wait, log) = gate
            .check_credential_attempt(ip("10.0.0.1"), start)
            .unwrap_err();
        assert!(log && wait > Duration::ZERO);
        assert!(gate.note(Notice::RegisterTimeout));
        let line = gate.take_summary(start + Duration::from_secs(30)).unwrap();
        assert_eq!(
            line,
            "node listener, last 30s: 1001 bad node credentials from 2 addresses, most from \
             10.0.0.1 (1000); 1 registration refused while throttled; 1 register timeout"
        );
        assert_eq!(gate.take_summary(start + Duration::from_secs(60)), None);
        assert!(
            gate.note(Notice::RegisterTimeout),
            "a new window logs again"
        );
    }

    #[test]
    fn a_good_credential_clears_the_throttle() {
        let now = Instant::now();
        let gate = NodeGate::new(now);
        gate.bad_credential(ip("10.0.0.1"), now);
        assert!(gate.check_credential_attempt(ip("10.0.0.1"), now).is_err());
        gate.good_credential(ip("10.0.0.1"));
        assert!(gate.check_credential_attempt(ip("10.0.0.1"), now).is_ok());
    }
}
