//! The HTTP connection table: every open connection with its network prefix and its
//! phase, so that a full table makes room instead of only refusing.
//!
//! A table of `limits.http.max_connections` places. While it has room, a connection takes
//! one. When it is full, a newcomer gets the place of an open connection that is not in
//! the middle of a request, chosen in this order:
//!
//! 1. a connection that has never completed a request head and is older than
//!    [`HEADLESS_GRACE`] — from the prefix holding the most connections first, oldest
//!    first: sockets opened to hold a place go first;
//! 2. otherwise, when the newcomer's prefix holds fewer connections than the prefix
//!    holding the most (by two or more), that prefix's oldest connection between requests
//!    (idle keep-alive, or waiting for its head): no prefix keeps more than its share of a
//!    full table against a prefix with less;
//! 3. otherwise the newcomer is refused (503).
//!
//! Prefixes are IPv4 /24 and IPv6 /48 unless configured (`limits.http.share_prefix_v4`,
//! `share_prefix_v6`); a trusted proxy's connections are never taken by rule 2 (its
//! clients all share its address). A connection in the middle of a request is never
//! taken: a request's body and answer are bounded by their own deadlines. The evicted
//! connection is closed at once (no answer is written on it: it has no request).
//!
//! The choice is pure (it takes `now`); the connection's task watches its
//! [`CancellationToken`] and closes when it is taken.

use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio_util::sync::CancellationToken;

use super::client_addr::TrustedProxies;
use super::deadlines::Activity;

/// How long a new connection may go without a complete request head before a full table
/// may give its place to a newcomer.
pub const HEADLESS_GRACE: Duration = Duration::from_secs(1);

/// Entries looked at, at most, for one newcomer at a full table.
const MAX_SCAN: usize = 8192;

/// The network prefix `addr` is counted under (an IPv4-mapped IPv6 address as IPv4).
pub fn prefix_of(addr: IpAddr, v4_bits: u8, v6_bits: u8) -> IpAddr {
    let mask = |bits: u8, width: u32| -> u128 {
        let bits = u32::from(bits).min(width);
        if bits == 0 {
            0
        } else {
            (!0u128) << (128 - bits)
        }
    };
    match addr {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => prefix_of(IpAddr::V4(v4), v4_bits, v6_bits),
            None => IpAddr::V6(Ipv6Addr::from(u128::from(v6) & mask(v6_bits, 128))),
        },
        IpAddr::V4(v4) => {
            let m = (mask(v4_bits, 32) >> 96) as u32;
            IpAddr::V4(Ipv4Addr::from(u32::from(v4) & m))
        }
    }
}

struct Entry {
    prefix: IpAddr,
    opened: Instant,
    trusted: bool,
    activity: Arc<Activity>,
    evict: CancellationToken,
}

#[derive(Default)]
struct Inner {
    next_id: u64,
    entries: HashMap<u64, Entry>,
    /// Each prefix's connections, oldest first.
    by_prefix: HashMap<IpAddr, VecDeque<u64>>,
}

impl Inner {
    fn remove(&mut self, id: u64) -> Option<Entry> {
        let entry = self.entries.remove(&id)?;
        if let Some(ids) = self.by_prefix.get_mut(&entry.prefix) {
            ids.retain(|i| *i != id);
            if ids.is_empty() {
                self.by_prefix.remove(&entry.prefix);
            }
        }
        Some(entry)
    }

    fn count(&self, prefix: &IpAddr) -> usize {
        self.by_prefix.get(prefix).map_or(0, VecDeque::len)
    }

    /// The connection a newcomer from `prefix` takes the place of at `now`, if any.
    fn victim(&self, prefix: IpAddr, now: Instant) -> Option<u64> {
        let mut prefixes: Vec<(&IpAddr, &VecDeque<u64>)> = self.by_prefix.iter().collect();
        // The most connections first; between equals, the one holding the oldest.
        prefixes.sort_by_key(|(_, ids)| (std::cmp::Reverse(ids.len()), ids.front().copied()));
        let mut scanned = 0;
        // 1. Never completed a head, past the grace.
        for (_, ids) in &prefixes {
            for id in ids.iter() {
                scanned += 1;
                if scanned > MAX_SCAN {
                    break;
                }
                let entry = &self.entries[id];
                if !entry.activity.has_served()
                    && !entry.activity.is_busy()
                    && now.saturating_duration_since(entry.opened) >= HEADLESS_GRACE
                {
                    return Some(*id);
                }
            }
        }
        // 2. The largest prefix, over the newcomer's by two or more, between requests.
        let mine = self.count(&prefix);
        let (_, ids) = prefixes.first()?;
        if ids.len() < mine + 2 {
            return None;
        }
        ids.iter().take(MAX_SCAN).copied().find(|id| {
            let entry = &self.entries[id];
            !entry.trusted && !entry.activity.is_busy()
        })
    }
}

/// The open HTTP connections.
pub struct ConnectionTable {
    cap: usize,
    v4_bits: u8,
    v6_bits: u8,
    trusted: TrustedProxies,
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for ConnectionTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectionTable")
            .field("cap", &self.cap)
            .finish_non_exhaustive()
    }
}

/// Why a newcomer was let in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Entered {
    /// The table had room.
    Room,
    /// It took the place of a connection that never sent a complete head.
    Headless,
    /// It took the place of a connection of a prefix holding more than its share.
    OverShare,
}

/// One open connection's place in the table, given back when dropped.
pub struct TableSlot {
    table: Arc<ConnectionTable>,
    id: u64,
}

impl Drop for TableSlot {
    fn drop(&mut self) {
        self.table.inner.lock().remove(self.id);
    }
}

impl ConnectionTable {
    pub fn new(cap: usize, v4_bits: u8, v6_bits: u8, trusted: TrustedProxies) -> Arc<Self> {
        Arc::new(Self {
            cap: cap.max(1),
            v4_bits,
            v6_bits,
            trusted,
            inner: Mutex::default(),
        })
    }

    /// A place for a new connection from `peer` (its phase in `activity`, closed when
    /// `evict` is cancelled), taking one from another connection when the table is full;
    /// `None` when it is refused.
    pub fn admit(
        self: &Arc<Self>,
        peer: IpAddr,
        activity: Arc<Activity>,
        evict: CancellationToken,
        now: Instant,
    ) -> Option<(TableSlot, Entered)> {
        let prefix = prefix_of(peer, self.v4_bits, self.v6_bits);
        let mut inner = self.inner.lock();
        let mut entered = Entered::Room;
        if inner.entries.len() >= self.cap {
            let victim = inner.victim(prefix, now)?;
            let gone = inner.remove(victim).expect("a victim is in the table");
            entered = if gone.activity.has_served() {
                Entered::OverShare
            } else {
                Entered::Headless
            };
            gone.evict.cancel();
        }
        let id = inner.next_id;
        inner.next_id += 1;
        inner.entries.insert(
            id,
            Entry {
                prefix,
                opened: now,
                trusted: self.trusted.contains(peer),
                activity,
                evict,
            },
        );
        inner.by_prefix.entry(prefix).or_default().push_back(id);
        Some((
            TableSlot {
                table: self.clone(),
                id,
            },
            entered,
        ))
    }

    /// Open connections.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.inner.lock().entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn fresh() -> Arc<Activity> {
        Activity::new(Duration::from_secs(10), Duration::from_secs(60))
    }

    fn table(cap: usize) -> Arc<ConnectionTable> {
        ConnectionTable::new(cap, 24, 48, TrustedProxies::parse(&[]).unwrap())
    }

    #[test]
    fn prefixes_are_slash_24_and_slash_48() {
        assert_eq!(prefix_of(ip("192.0.2.77"), 24, 48), ip("192.0.2.0"));
        assert_eq!(prefix_of(ip("::ffff:192.0.2.77"), 24, 48), ip("192.0.2.0"));
        assert_eq!(
            prefix_of(ip("2001:db8:1:2:3::9"), 24, 48),
            ip("2001:db8:1::")
        );
        assert_eq!(prefix_of(ip("192.0.2.77"), 32, 128), ip("192.0.2.77"));
    }

    #[test]
    fn a_full_table_gives_a_headless_connection_s_place_to_a_newcomer() {
        let t = table(3);
        let start = Instant::now();
        let mut held = Vec::new();
        for i in 0..3 {
            let token = CancellationToken::new();
            let addr = ip(&format!("2001:db8:{i}::1"));
            held.push((t.admit(addr, fresh(), token.clone(), start).unwrap(), token));
        }
        // Within the grace, and from a prefix holding no more than the newcomer's: refused.
        assert!(
            t.admit(ip("198.51.100.1"), fresh(), CancellationToken::new(), start)
                .is_none()
        );
        // After it, the oldest headless connection goes.
        let later = start + HEADLESS_GRACE;
        let (_slot, why) = t
            .admit(ip("198.51.100.1"), fresh(), CancellationToken::new(), later)
            .unwrap();
        assert_eq!(why, Entered::Headless);
        assert!(held[0].1.is_cancelled());
        assert!(!held[1].1.is_cancelled());
        assert_eq!(t.len(), 3);
    }

    #[test]
    fn connections_in_a_request_are_never_taken_and_a_big_prefix_gives_way() {
        let t = table(4);
        let now = Instant::now() + HEADLESS_GRACE * 10;
        let busy = fresh();
        let _guard = busy.request_started();
        let served = fresh();
        drop(served.request_started());
        let mut slots = Vec::new();
        let tokens: Vec<CancellationToken> = (0..4).map(|_| CancellationToken::new()).collect();
        slots.push(
            t.admit(ip("192.0.2.1"), busy, tokens[0].clone(), now)
                .unwrap(),
        );
        slots.push(
            t.admit(ip("192.0.2.2"), served, tokens[1].clone(), now)
                .unwrap(),
        );
        for (i, token) in tokens[2..].iter().enumerate() {
            let activity = fresh();
            drop(activity.request_started());
            let addr = ip(&format!("192.0.2.{}", 3 + i));
            slots.push(t.admit(addr, activity, token.clone(), now).unwrap());
        }
        // One prefix holds all four; a newcomer from another takes the oldest between
        // requests, never the busy one.
        let (_slot, why) = t
            .admit(ip("203.0.113.5"), fresh(), CancellationToken::new(), now)
            .unwrap();
        assert_eq!(why, Entered::OverShare);
        assert!(!tokens[0].is_cancelled());
        assert!(tokens[1].is_cancelled());
        // 3 against 1: one more gives way; at 2 against 2 the newcomer is refused.
        let second = t.admit(ip("203.0.113.6"), fresh(), CancellationToken::new(), now);
        assert!(second.is_some());
        assert!(tokens[2].is_cancelled());
        assert!(
            t.admit(ip("203.0.113.7"), fresh(), CancellationToken::new(), now)
                .is_none()
        );
    }

    #[test]
    fn a_slot_gives_its_place_back() {
        let t = table(1);
        let now = Instant::now();
        let slot = t.admit(ip("192.0.2.1"), fresh(), CancellationToken::new(), now);
        assert!(
            t.admit(ip("192.0.2.1"), fresh(), CancellationToken::new(), now)
                .is_none()
        );
        drop(slot);
        assert!(
            t.admit(ip("192.0.2.1"), fresh(), CancellationToken::new(), now)
                .is_some()
        );
    }
}
