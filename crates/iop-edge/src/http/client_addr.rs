//! Where an HTTP request comes from, and how many connections each source holds.
//!
//! The client's address is the TCP peer's, unless the peer is one of
//! `limits.http.trusted_proxies` (a load balancer or reverse proxy in front of the edge):
//! then it is the rightmost address of `X-Forwarded-For` that is not itself a trusted proxy
//! (the one the nearest untrusted hop connected from). A header from any other peer is
//! ignored, so a client cannot name an address it does not have. The bad-key throttle
//! counts by this address.
//!
//! [`ConnectionsPerAddress`] caps open connections per peer address group (an IPv4
//! address, an IPv6 /64) at `limits.http.max_connections_per_address`, so one address
//! cannot take the whole connection table; trusted proxies are not capped (they carry many
//! clients, and enforce their own limits).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;

use axum::http::HeaderMap;
use ipnet::IpNet;
use parking_lot::Mutex;

use crate::throttle::address_group;

/// The client address of a request (a request extension).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientAddr(pub IpAddr);

/// The proxies whose `X-Forwarded-For` is believed.
#[derive(Debug, Clone, Default)]
pub struct TrustedProxies(Vec<IpNet>);

impl TrustedProxies {
    /// Parses addresses and CIDR ranges (`10.0.0.0/8`, `192.0.2.7`, `2001:db8::/32`).
    pub fn parse(entries: &[String]) -> Result<Self, String> {
        crate::config::parse_proxies(entries).map(Self)
    }

    pub fn contains(&self, addr: IpAddr) -> bool {
        let addr = canonical(addr);
        self.0.iter().any(|net| net.contains(&addr))
    }

    /// The client address of a request from `peer` with `headers`.
    pub fn client_of(&self, peer: IpAddr, headers: &HeaderMap) -> IpAddr {
        if !self.contains(peer) {
            return peer;
        }
        let hops = headers
            .get_all("x-forwarded-for")
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .collect::<Vec<_>>();
        for hop in hops.iter().rev() {
            match hop_address(hop) {
                Ok(addr) if self.contains(addr) => continue,
                Ok(addr) => return canonical(addr),
                // A hop the edge cannot read: the chain before it cannot be trusted.
                Err(_) => return peer,
            }
        }
        peer
    }
}

/// The address of one `X-Forwarded-For` hop as proxies write it: `192.0.2.1`,
/// `192.0.2.1:4711`, `2001:db8::1`, `[2001:db8::1]` or `[2001:db8::1]:4711`.
fn hop_address(hop: &str) -> Result<IpAddr, std::net::AddrParseError> {
    if let Ok(addr) = hop.parse::<IpAddr>() {
        return Ok(addr);
    }
    if let Ok(socket) = hop.parse::<std::net::SocketAddr>() {
        return Ok(socket.ip());
    }
    hop.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(hop)
        .parse::<IpAddr>()
}

/// An IPv4-mapped IPv6 address as the IPv4 address it is.
fn canonical(addr: IpAddr) -> IpAddr {
    match addr {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(addr, IpAddr::V4),
        v4 => v4,
    }
}

/// Open connections per peer address group.
#[derive(Debug)]
pub struct ConnectionsPerAddress {
    max: usize,
    trusted: TrustedProxies,
    open: Mutex<HashMap<IpAddr, usize>>,
}

impl ConnectionsPerAddress {
    pub fn new(max: usize, trusted: TrustedProxies) -> Arc<Self> {
        Arc::new(Self {
            max,
            trusted,
            open: Mutex::new(HashMap::new()),
        })
    }

    /// One more connection from `peer`, or `None` when its address holds the most.
    pub fn open(self: &Arc<Self>, peer: IpAddr) -> Option<AddressSlot> {
        if self.trusted.contains(peer) {
            return Some(AddressSlot {
                caps: self.clone(),
                group: None,
            });
        }
        let group = address_group(peer);
        let mut open = self.open.lock();
        let here = open.entry(group).or_insert(0);
        if *here >= self.max {
            return None;
        }
        *here += 1;
        Some(AddressSlot {
            caps: self.clone(),
            group: Some(group),
        })
    }

    /// Address groups with an open connection.
    #[cfg(test)]
    fn addresses(&self) -> usize {
        self.open.lock().len()
    }
}

/// One open connection's place under its address's cap, freed when dropped.
#[derive(Debug)]
pub struct AddressSlot {
    caps: Arc<ConnectionsPerAddress>,
    group: Option<IpAddr>,
}

impl Drop for AddressSlot {
    fn drop(&mut self) {
        let Some(group) = self.group else { return };
        let mut open = self.caps.open.lock();
        if let Some(n) = open.get_mut(&group) {
            *n -= 1;
            if *n == 0 {
                open.remove(&group);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn proxies(list: &[&str]) -> TrustedProxies {
        TrustedProxies::parse(&list.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap()
    }

    fn forwarded(values: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append("x-forwarded-for", v.parse().unwrap());
        }
        h
    }

    #[test]
    fn forwarded_hops_with_ports_or_brackets_name_their_client() {
        let trusted = proxies(&["10.0.0.0/8"]);
        let proxy = ip("10.0.0.1");
        for (hop, client) in [
            ("203.0.113.9:4711", "203.0.113.9"),
            ("[2001:db8::7]", "2001:db8::7"),
            ("[2001:db8::7]:4711", "2001:db8::7"),
            ("2001:db8::7", "2001:db8::7"),
        ] {
            let h = forwarded(&[&format!("{hop}, 10.1.2.3:80")]);
            assert_eq!(trusted.client_of(proxy, &h), ip(client), "{hop}");
        }
        // What is no address at all still stops the chain at the proxy.
        assert_eq!(trusted.client_of(proxy, &forwarded(&["unknown"])), proxy);
    }

    #[test]
    fn forwarded_for_is_believed_only_from_a_trusted_proxy() {
        let trusted = proxies(&["10.0.0.0/8", "192.0.2.7"]);
        let h = forwarded(&["203.0.113.9, 10.1.2.3"]);
        // From the proxy: the rightmost hop that is not a proxy.
        assert_eq!(trusted.client_of(ip("10.0.0.1"), &h), ip("203.0.113.9"));
        assert_eq!(trusted.client_of(ip("192.0.2.7"), &h), ip("203.0.113.9"));
        // From anyone else: the header is theirs to forge.
        assert_eq!(
            trusted.client_of(ip("198.51.100.1"), &h),
            ip("198.51.100.1")
        );
        // A forged address to the left of the real client's changes nothing.
        let h = forwarded(&["1.1.1.1", "203.0.113.9"]);
        assert_eq!(trusted.client_of(ip("10.0.0.1"), &h), ip("203.0.113.9"));
        // No header, or an unreadable hop: the proxy itself.
        assert_eq!(
            trusted.client_of(ip("10.0.0.1"), &HeaderMap::new()),
            ip("10.0.0.1")
        );
        let h = forwarded(&["203.0.113.9, nonsense"]);
        assert_eq!(trusted.client_of(ip("10.0.0.1"), &h), ip("10.0.0.1"));
        // Mapped IPv6 is the IPv4 address.
        assert!(trusted.contains(ip("::ffff:10.0.0.1")));
        assert!(TrustedProxies::parse(&["10.0.0.0/33".into()]).is_err());
        assert!(TrustedProxies::parse(&["proxy.local".into()]).is_err());
    }

    #[test]
    fn one_address_holds_at_most_its_cap_and_proxies_are_not_capped() {
        let caps = ConnectionsPerAddress::new(2, proxies(&["10.0.0.1"]));
        let a = caps.open(ip("192.0.2.1")).unwrap();
        let _b = caps.open(ip("192.0.2.1")).unwrap();
        assert!(caps.open(ip("192.0.2.1")).is_none());
        // Another address, and the other hosts of an IPv6 /64 together.
        let _c = caps.open(ip("192.0.2.2")).unwrap();
        let _d = caps.open(ip("2001:db8::1")).unwrap();
        let _e = caps.open(ip("2001:db8::2")).unwrap();
        assert!(caps.open(ip("2001:db8::3")).is_none());
        let proxied: Vec<_> = (0..10)
            .map(|_| caps.open(ip("10.0.0.1")).unwrap())
            .collect();
        drop(a);
        assert!(caps.open(ip("192.0.2.1")).is_some());
        drop(proxied);
        assert_eq!(caps.addresses(), 3);
    }
}
