//! The node listener's gate before authentication: caps on connections that have not
//! authenticated yet (in total and per source address, TLS handshakes included; a full
//! pool makes room for a newcomer by closing the oldest connection that has sent nothing,
//! else, for a newcomer from a lighter address, the oldest connection of the heaviest
//! one), the
//! bad-credential throttle, and the periodic summary that replaces a log line per refused
//! connection, failed handshake or guessed credential.
//!
//! [`UnauthenticatedCounts`] and [`Notices`] are pure state; [`NodeGate`] is their shared,
//! locked shell and hands out an [`UnauthenticatedSlot`] per admitted connection, released
//! when the connection registers or ends. The gate decides nothing about nodes: the
//! registry still authenticates.

use std::collections::{BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio_util::sync::CancellationToken;

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

/// How long a connection may stay silent before a full pool gives its place to the next
/// one waiting: a node speaks within a round trip of connecting.
pub const SILENT_GRACE: Duration = Duration::from_millis(250);

/// How often a full pool with nobody silent is asked again for room (a newcomer from a
/// lighter address may displace the heaviest one's oldest).
pub const FULL_RECHECK: Duration = Duration::from_millis(100);

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
    /// An unauthenticated connection closed to make room for a newer one.
    Evicted,
}

impl Notice {
    const ALL: [Notice; 11] = [
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
        Notice::Evicted,
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
            Notice::Evicted => "evicted",
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
            Notice::Evicted => format!(
                "{n} unauthenticated connection{s} closed to make room (silent ones first, else the oldest of the address holding the most)"
            ),
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

/// Connections admitted and not registered yet, in total and per address group, each
/// under an id in the order they were opened, and which of them have sent nothing yet.
///
/// Full, the pool makes room for a newcomer by closing the oldest connection that has not
/// sent a byte for [`SILENT_GRACE`] (a node sends its TLS ClientHello, or its
/// registration, as soon as it is connected: a silent connection holds a place and
/// nothing else), whatever its address; failing that, the oldest connection of the
/// address group that holds the most, as long as that group would still hold at least as
/// many as the newcomer's: anonymous connections from many addresses then only displace
/// each other, and a node gets in however many addresses hold one silent connection each.
/// The per-address cap binds only when the pool is full (a newcomer from an address
/// holding that many is refused rather than displacing anyone), so many nodes behind one
/// address (a NAT) all get in after an edge restart while the pool has room.
#[derive(Debug, Default)]
pub struct UnauthenticatedCounts {
    total: usize,
    next_id: u64,
    per_address: HashMap<IpAddr, BTreeSet<u64>>,
    /// The address group of each connection, and when it was opened.
    group_of: HashMap<u64, (IpAddr, Instant)>,
    /// Connections that have sent nothing yet, oldest first.
    silent: BTreeSet<u64>,
}

/// When a full pool can take a newcomer ([`UnauthenticatedCounts::room_at`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Room {
    /// When a silent connection will be past its grace (or sooner, when a place frees).
    When(Instant),
    /// Nobody is silent: take the next newcomer at this instant (or when a place frees)
    /// and let the heaviest-address rule decide.
    Recheck(Instant),
}

/// What [`UnauthenticatedCounts::try_open`] decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Opened {
    /// Admitted under this id.
    Admitted(u64),
    /// Admitted under this id, after closing the connection with the other id.
    Evicting { id: u64, evicted: u64 },
}

impl Opened {
    pub fn id(self) -> u64 {
        match self {
            Opened::Admitted(id) | Opened::Evicting { id, .. } => id,
        }
    }
}

impl UnauthenticatedCounts {
    /// Admits one more connection from `addr`, making room if the pool is full (see the
    /// type's doc), or says which cap refused it.
    pub fn try_open(
        &mut self,
        addr: IpAddr,
        max_total: usize,
        max_per_address: usize,
        now: Instant,
    ) -> Result<Opened, Notice> {
        let key = address_group(addr);
        let here = self.per_address.get(&key).map_or(0, BTreeSet::len);
        let mut evicted = None;
        if self.total >= max_total {
            if here >= max_per_address {
                return Err(Notice::OverAddressCap);
            }
            if let Some(oldest) = self.aged_silent(now) {
                self.remove(oldest);
                evicted = Some(oldest);
            }
        }
        if self.total >= max_total {
            let heaviest = self
                .per_address
                .iter()
                .max_by_key(|(_, ids)| ids.len())
                .map(|(group, ids)| (*group, ids.len()));
            match heaviest {
                Some((group, held)) if held >= here + 2 => {
                    let oldest = *self.per_address[&group].first().expect("not empty");
                    self.remove(oldest);
                    evicted = Some(oldest);
                }
                _ => return Err(Notice::OverTotalCap),
            }
        }
        let id = self.next_id;
        self.next_id += 1;
        self.per_address.entry(key).or_default().insert(id);
        self.group_of.insert(id, (key, now));
        self.silent.insert(id);
        self.total += 1;
        Ok(match evicted {
            Some(evicted) => Opened::Evicting { id, evicted },
            None => Opened::Admitted(id),
        })
    }

    /// The connection `id` registered or ended (nothing if it was evicted).
    pub fn close(&mut self, id: u64) {
        self.remove(id);
    }

    /// The connection `id` sent its first bytes: it is no longer the first to go.
    pub fn spoke(&mut self, id: u64) {
        self.silent.remove(&id);
    }

    /// The oldest connection silent for [`SILENT_GRACE`] at `now`.
    fn aged_silent(&self, now: Instant) -> Option<u64> {
        let oldest = *self.silent.first()?;
        let (_, opened) = self.group_of[&oldest];
        (now.saturating_duration_since(opened) >= SILENT_GRACE).then_some(oldest)
    }

    /// When a newcomer can next be taken in without refusing it for the pool's size: now
    /// (`None`) when there is room or a silent connection past its grace; else when the
    /// oldest silent one will be past it, or a place frees; with nobody silent, at
    /// `later` (the heaviest-address rule may make room for a newcomer then).
    pub fn room_at(&self, max_total: usize, now: Instant, later: Instant) -> Option<Room> {
        if self.total < max_total || self.aged_silent(now).is_some() {
            return None;
        }
        Some(match self.silent.first() {
            Some(oldest) => Room::When(self.group_of[oldest].1 + SILENT_GRACE),
            None => Room::Recheck(later),
        })
    }

    fn remove(&mut self, id: u64) {
        let Some((key, _)) = self.group_of.remove(&id) else {
            return;
        };
        self.silent.remove(&id);
        if let Some(ids) = self.per_address.get_mut(&key) {
            ids.remove(&id);
            if ids.is_empty() {
                self.per_address.remove(&key);
            }
        }
        self.total -= 1;
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
    /// Cancelled to close an admitted connection the pool evicts.
    evict: HashMap<u64, CancellationToken>,
    throttle: FailureThrottle,
    notices: Notices,
    window_started: Instant,
}

/// The gate shared by the listener and its connections.
#[derive(Debug)]
pub struct NodeGate {
    state: Mutex<GateState>,
    freed: tokio::sync::Notify,
}

impl NodeGate {
    pub fn new(now: Instant) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(GateState {
                counts: UnauthenticatedCounts::default(),
                evict: HashMap::new(),
                throttle: FailureThrottle::new(CREDENTIAL_THROTTLE),
                notices: Notices::default(),
                window_started: now,
            }),
            freed: tokio::sync::Notify::new(),
        })
    }

    /// Admits a new connection from `addr` under `limits` (closing an older one to make
    /// room, counted as [`Notice::Evicted`]), or says why not (counted).
    pub fn admit(
        self: &Arc<Self>,
        addr: IpAddr,
        limits: &NodeLimitsConfig,
        now: Instant,
    ) -> Result<UnauthenticatedSlot, (Notice, bool)> {
        let mut state = self.state.lock();
        match state.counts.try_open(
            addr,
            limits.max_unauthenticated,
            limits.max_unauthenticated_per_address,
            now,
        ) {
            Ok(opened) => {
                if let Opened::Evicting { evicted, .. } = opened {
                    if let Some(token) = state.evict.remove(&evicted) {
                        token.cancel();
                    }
                    state.notices.note(Notice::Evicted);
                }
                let evicted = CancellationToken::new();
                state.evict.insert(opened.id(), evicted.clone());
                Ok(UnauthenticatedSlot {
                    gate: self.clone(),
                    id: opened.id(),
                    evicted,
                    open: true,
                })
            }
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

    /// When the listener should take the next connection from its accept queue: now
    /// (`None`), or not before the instant given (or [`Self::freed`]).
    pub fn room_at(&self, limits: &NodeLimitsConfig, now: Instant) -> Option<Room> {
        self.state
            .lock()
            .counts
            .room_at(limits.max_unauthenticated, now, now + FULL_RECHECK)
    }

    /// Resolves when a place in the pool frees.
    pub async fn freed(&self) {
        self.freed.notified().await
    }

    /// Connections admitted and not registered yet.
    pub fn unauthenticated(&self) -> usize {
        self.state.lock().counts.total()
    }

    fn release(&self, id: u64) {
        let mut state = self.state.lock();
        state.counts.close(id);
        state.evict.remove(&id);
        drop(state);
        self.freed.notify_one();
    }

    fn spoke(&self, id: u64) {
        self.state.lock().counts.spoke(id);
    }
}

/// One admitted, not yet authenticated connection; dropping it (or authenticating) frees
/// its place under the caps.
#[derive(Debug)]
pub struct UnauthenticatedSlot {
    gate: Arc<NodeGate>,
    id: u64,
    evicted: CancellationToken,
    open: bool,
}

impl UnauthenticatedSlot {
    /// The connection proved who it is (a client certificate the handshake verified, or a
    /// registration): it no longer counts as unauthenticated.
    pub fn authenticated(&mut self) {
        self.release();
    }

    /// Resolves when the pool closes this connection to make room for a newer one (never,
    /// once it authenticated).
    pub async fn evicted(&self) {
        if self.open {
            self.evicted.cancelled().await;
        } else {
            std::future::pending().await
        }
    }

    /// The connection sent its first bytes (a node does at once).
    pub fn spoke(&self) {
        if self.open {
            self.gate.spoke(self.id);
        }
    }

    fn release(&mut self) {
        if std::mem::take(&mut self.open) {
            self.gate.release(self.id);
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

    /// One instant for tests where no connection outlives its grace.
    fn t0() -> Instant {
        static T0: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
        *T0.get_or_init(Instant::now)
    }

    fn limits(total: usize, per_address: usize) -> NodeLimitsConfig {
        NodeLimitsConfig {
            max_unauthenticated: total,
            max_unauthenticated_per_address: per_address,
            ..Default::default()
        }
    }

    #[test]
    fn the_address_cap_binds_only_when_the_pool_is_full() {
        let mut c = UnauthenticatedCounts::default();
        // Room in the pool: one address may pass its cap of 1.
        for _ in 0..3 {
            assert!(c.try_open(ip("10.0.0.1"), 4, 1, t0()).is_ok());
        }
        assert!(c.try_open(ip("10.0.0.2"), 4, 1, t0()).is_ok());
        // Full: an address at its cap is refused, another displaces the heaviest.
        assert_eq!(
            c.try_open(ip("10.0.0.2"), 4, 1, t0()),
            Err(Notice::OverAddressCap)
        );
        assert!(matches!(
            c.try_open(ip("10.0.0.3"), 4, 1, t0()),
            Ok(Opened::Evicting { .. })
        ));
        assert_eq!(c.total(), 4);
    }

    #[test]
    fn a_full_pool_evicts_the_oldest_of_the_heaviest_address_for_a_lighter_one() {
        let mut c = UnauthenticatedCounts::default();
        // Connections that spoke (in their TLS handshakes).
        let a: Vec<u64> = (0..3)
            .map(|_| c.try_open(ip("10.0.0.1"), 4, 4, t0()).unwrap().id())
            .collect();
        let b = c.try_open(ip("10.0.0.2"), 4, 4, t0()).unwrap().id();
        for id in a.iter().chain([&b]) {
            c.spoke(*id);
        }
        // Full. A newcomer from a third address displaces the oldest of 10.0.0.1.
        assert_eq!(
            c.try_open(ip("10.0.0.3"), 4, 4, t0()),
            Ok(Opened::Evicting {
                id: 4,
                evicted: a[0]
            })
        );
        c.spoke(4);
        // 10.0.0.1 (2) against 10.0.0.2 (1): 2 < 1 + 2, nobody is displaced.
        assert_eq!(
            c.try_open(ip("10.0.0.2"), 4, 4, t0()),
            Err(Notice::OverTotalCap)
        );
        // An address cannot displace its own connections.
        assert_eq!(
            c.try_open(ip("10.0.0.1"), 4, 4, t0()),
            Err(Notice::OverTotalCap)
        );
        // The evicted connection's own close changes nothing.
        c.close(a[0]);
        assert_eq!(c.total(), 4);
    }

    #[test]
    fn anonymous_churn_from_many_addresses_never_keeps_a_node_out() {
        // 20 addresses with 16 connections each want in, re-opening every one closed,
        // against a pool of 256: a node from another address is admitted whenever it
        // tries, and keeps its place while the others churn.
        let mut c = UnauthenticatedCounts::default();
        let mut live: Vec<(IpAddr, u64)> = Vec::new();
        let attackers: Vec<IpAddr> = (1..=20).map(|i| ip(&format!("10.1.0.{i}"))).collect();
        let node = ip("192.0.2.7");
        let mut node_id = None;
        for round in 0..2000 {
            let from = attackers[round % 20];
            match c.try_open(from, 256, 16, t0()) {
                Ok(Opened::Evicting { id, evicted }) => {
                    assert_ne!(Some(evicted), node_id, "the node was displaced");
                    live.retain(|(_, i)| *i != evicted);
                    live.push((from, id));
                }
                Ok(Opened::Admitted(id)) => live.push((from, id)),
                Err(_) => {}
            }
            if round == 1000 {
                let id = c
                    .try_open(node, 256, 16, t0())
                    .expect("the node gets in")
                    .id();
                c.spoke(id);
                node_id = Some(id);
            }
        }
        assert_eq!(c.total(), 256);
        c.close(node_id.unwrap());
        assert_eq!(c.total(), 255);
    }

    #[test]
    fn silent_connections_go_first_once_past_their_grace_and_never_keep_a_node_out() {
        // 256 addresses fill the pool with one connection each that never sends a byte.
        let t0 = Instant::now();
        let ms = Duration::from_millis(1);
        let mut c = UnauthenticatedCounts::default();
        let attacker = |i: usize| ip(&format!("10.2.{}.{}", i / 200, i % 200 + 1));
        for i in 0..256 {
            c.try_open(attacker(i), 256, 16, t0).unwrap();
        }
        // Within their grace, every newcomer waits (nobody holds more than another).
        assert_eq!(
            c.try_open(attacker(300), 256, 16, t0 + 100 * ms),
            Err(Notice::OverTotalCap)
        );
        assert_eq!(
            c.room_at(256, t0 + 100 * ms, t0 + 200 * ms),
            Some(Room::When(t0 + SILENT_GRACE))
        );
        assert_eq!(c.room_at(256, t0 + SILENT_GRACE, t0 + 900 * ms), None);
        // Past it, the next newcomer (a node, which speaks at once) takes the oldest's place.
        let node = c
            .try_open(ip("192.0.2.7"), 256, 16, t0 + SILENT_GRACE)
            .unwrap();
        assert!(matches!(node, Opened::Evicting { evicted: 0, .. }));
        c.spoke(node.id());
        // Silent newcomers churning for two seconds never displace it.
        for k in 0..2000u32 {
            let now = t0 + SILENT_GRACE + k * ms;
            match c.try_open(attacker(300 + k as usize % 400), 256, 16, now) {
                Ok(Opened::Evicting { evicted, .. }) => {
                    assert_ne!(evicted, node.id(), "the node that spoke was displaced")
                }
                Ok(Opened::Admitted(_)) => panic!("the pool is full"),
                Err(notice) => assert_eq!(notice, Notice::OverTotalCap),
            }
        }
        assert_eq!(c.total(), 256);
        // Connections that speak and stall are left to the other rules: a pool full of
        // them from one address still makes room for another address.
        let mut d = UnauthenticatedCounts::default();
        for _ in 0..4 {
            let id = d.try_open(ip("10.3.0.1"), 4, 8, t0).unwrap().id();
            d.spoke(id);
        }
        assert!(matches!(
            d.try_open(ip("10.3.0.2"), 4, 8, t0 + SILENT_GRACE),
            Ok(Opened::Evicting { evicted: 0, .. })
        ));
    }

    #[test]
    fn ipv6_hosts_of_one_64_share_a_cap() {
        let mut c = UnauthenticatedCounts::default();
        assert!(c.try_open(ip("2001:db8::1"), 1, 1, t0()).is_ok());
        assert_eq!(
            c.try_open(ip("2001:db8::2"), 1, 1, t0()),
            Err(Notice::OverAddressCap)
        );
        c.try_open(ip("2001:db8:0:1::1"), 2, 1, t0()).unwrap();
    }

    #[test]
    fn closing_frees_the_entry() {
        let mut c = UnauthenticatedCounts::default();
        let ids: Vec<u64> = (0..3)
            .map(|_| c.try_open(ip("10.0.0.1"), 10, 5, t0()).unwrap().id())
            .collect();
        for id in ids {
            c.close(id);
        }
        assert_eq!((c.total(), c.addresses()), (0, 0));
    }

    #[tokio::test]
    async fn slots_release_on_drop_and_on_authentication_and_eviction_closes_one() {
        let gate = NodeGate::new(Instant::now());
        let l = limits(2, 2);
        let a = gate.admit(ip("10.0.0.1"), &l, t0()).unwrap();
        let mut b = gate.admit(ip("10.0.0.1"), &l, t0()).unwrap();
        a.spoke();
        b.spoke();
        // Full: a newcomer from another address displaces the oldest (a).
        let c = gate.admit(ip("10.0.0.2"), &l, t0()).unwrap();
        c.spoke();
        tokio::time::timeout(Duration::from_secs(1), a.evicted())
            .await
            .expect("the oldest is told to close");
        let (notice, log) = gate.admit(ip("10.0.0.2"), &l, t0()).unwrap_err();
        assert_eq!((notice, log), (Notice::OverTotalCap, true));
        let (_, log) = gate.admit(ip("10.0.0.2"), &l, t0()).unwrap_err();
        assert!(!log, "only the first of a kind per window is logged");
        drop(a);
        b.authenticated();
        assert!(
            tokio::time::timeout(Duration::from_millis(10), b.evicted())
                .await
                .is_err(),
            "an authenticated connection is never evicted"
        );
        drop(c);
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
