//! Parsing of `/proc/net/route` (IPv4) and `/proc/net/ipv6_route` (IPv6): does this pod's
//! routing table cover an address?
//!
//! `/proc/net/route` (the main table; header first, tab separated):
//!
//! ```text
//! Iface   Destination Gateway  Flags RefCnt Use Metric Mask     MTU Window IRTT
//! eth0    00000000    0100F40A 0003  0      0   0      00000000 0   0      0
//! eth0    0000F40A    00000000 0001  0      0   0      00FFFFFF 0   0      0
//! ```
//!
//! Destination and Mask are hex words in host byte order (little-endian on x86_64), Flags is
//! hex. `/proc/net/ipv6_route` has no header; each line is
//!
//! ```text
//! DEST(32 hex) DEST_PLEN(2 hex) SRC(32 hex) SRC_PLEN NEXT_HOP(32 hex) METRIC REFCNT USE FLAGS IFACE
//! ```
//!
//! with addresses in network byte order. A route covers an address when `addr & mask ==
//! dest & mask`. The most specific covering route decides (as the kernel's lookup does, within
//! the main table): the address is routable when that route is up and not a reject
//! (`unreachable`, `prohibit`, `blackhole`) route. Routes on `lo` are ignored: they are local
//! delivery (and IPv6's catch-all reject `::/0 dev lo`), not a way out of the pod. Header,
//! blank and malformed lines are skipped.

use std::io::ErrorKind;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::Path;

/// `RTF_UP`: the route is usable.
pub const RTF_UP: u32 = 0x0001;
/// `RTF_REJECT`: an `unreachable`/`prohibit`/`blackhole` route.
pub const RTF_REJECT: u32 = 0x0200;

/// One route, reduced to what we use; `dest` is already masked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Route {
    pub dest: IpAddr,
    pub prefix_len: u8,
    pub flags: u32,
}

impl Route {
    /// Whether `addr` (same family) lies in this route's destination prefix.
    pub fn covers(&self, addr: IpAddr) -> bool {
        match (self.dest, addr) {
            (IpAddr::V4(dest), IpAddr::V4(addr)) => {
                let mask = prefix_mask_v4(self.prefix_len);
                u32::from(addr) & mask == u32::from(dest) & mask
            }
            (IpAddr::V6(dest), IpAddr::V6(addr)) => {
                let mask = prefix_mask_v6(self.prefix_len);
                u128::from(addr) & mask == u128::from(dest) & mask
            }
            _ => false,
        }
    }

    /// Whether packets can leave by this route (up and not a reject route).
    pub fn usable(&self) -> bool {
        self.flags & RTF_UP != 0 && self.flags & RTF_REJECT == 0
    }
}

fn prefix_mask_v4(len: u8) -> u32 {
    u32::MAX
        .checked_shl(32 - u32::from(len.min(32)))
        .unwrap_or(0)
}

fn prefix_mask_v6(len: u8) -> u128 {
    u128::MAX
        .checked_shl(128 - u32::from(len.min(128)))
        .unwrap_or(0)
}

fn hex_u32(text: &str) -> Option<u32> {
    if text.is_empty() || text.len() > 8 || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u32::from_str_radix(text, 16).ok()
}

/// Parses one line of `/proc/net/route`; `None` for the header, blank or malformed lines
/// and routes on `lo`.
pub fn parse_route_line(line: &str) -> Option<Route> {
    let fields: Vec<&str> = line.split_ascii_whitespace().collect();
    let [
        iface,
        dest,
        _gateway,
        flags,
        _refcnt,
        _use,
        _metric,
        mask,
        ..,
    ] = fields[..]
    else {
        return None;
    };
    if iface == "lo" || dest.len() != 8 || mask.len() != 8 {
        return None;
    }
    let dest = u32::from(Ipv4Addr::from(hex_u32(dest)?.to_ne_bytes()));
    let mask = u32::from(Ipv4Addr::from(hex_u32(mask)?.to_ne_bytes()));
    // Only contiguous masks (a prefix) are well-formed.
    let prefix_len = mask.leading_ones();
    if mask.checked_shl(prefix_len).unwrap_or(0) != 0 {
        return None;
    }
    Some(Route {
        dest: IpAddr::V4(Ipv4Addr::from(dest & mask)),
        prefix_len: u8::try_from(prefix_len).ok()?,
        flags: hex_u32(flags)?,
    })
}

/// Parses one line of `/proc/net/ipv6_route`; `None` for blank or malformed lines and
/// routes on `lo`.
pub fn parse_ipv6_route_line(line: &str) -> Option<Route> {
    let fields: Vec<&str> = line.split_ascii_whitespace().collect();
    let [
        dest,
        plen,
        src,
        src_plen,
        next_hop,
        metric,
        refcnt,
        use_,
        flags,
        iface,
    ] = fields[..]
    else {
        return None;
    };
    if iface == "lo" {
        return None;
    }
    let dest = hex_u128(dest)?;
    hex_u128(src)?;
    hex_u128(next_hop)?;
    for word in [metric, refcnt, use_, flags] {
        if word.len() != 8 {
            return None;
        }
        hex_u32(word)?;
    }
    let prefix_len = hex_byte(plen).filter(|&len| len <= 128)?;
    hex_byte(src_plen).filter(|&len| len <= 128)?;
    Some(Route {
        dest: IpAddr::V6(Ipv6Addr::from(dest & prefix_mask_v6(prefix_len))),
        prefix_len,
        flags: hex_u32(flags)?,
    })
}

/// 32 hex digits (network byte order).
fn hex_u128(text: &str) -> Option<u128> {
    if text.len() != 32 || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u128::from_str_radix(text, 16).ok()
}

/// 2 hex digits.
fn hex_byte(text: &str) -> Option<u8> {
    if text.len() != 2 || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u8::from_str_radix(text, 16).ok()
}

/// Every well-formed, non-`lo` route of a `/proc/net/route` text.
pub fn parse_route_table(text: &str) -> impl Iterator<Item = Route> + '_ {
    text.lines().filter_map(parse_route_line)
}

/// Every well-formed, non-`lo` route of a `/proc/net/ipv6_route` text.
pub fn parse_ipv6_route_table(text: &str) -> impl Iterator<Item = Route> + '_ {
    text.lines().filter_map(parse_ipv6_route_line)
}

/// Whether the most specific route covering `addr` is usable; `false` when none covers it.
/// Routes of the other family never cover it.
pub fn routable(routes: impl IntoIterator<Item = Route>, addr: IpAddr) -> bool {
    routes
        .into_iter()
        .filter(|route| route.covers(addr))
        // On equal prefixes the first one wins, like the first listed route.
        .fold(None::<Route>, |best, route| match best {
            Some(best) if best.prefix_len >= route.prefix_len => Some(best),
            _ => Some(route),
        })
        .is_some_and(|route| route.usable())
}

/// Loopback targets are always reachable: their routes live in the local table, which
/// `/proc/net/route` does not show.
pub fn always_routable(addr: IpAddr) -> bool {
    match addr {
        IpAddr::V4(addr) => addr.is_loopback(),
        IpAddr::V6(addr) => addr.is_loopback(),
    }
}

/// Reads the routes of `addr`'s family: `<proc_root>/net/route` for IPv4,
/// `<proc_root>/net/ipv6_route` for IPv6. A missing `ipv6_route` (IPv6 disabled) means no
/// IPv6 routes; any other read error is an error.
pub fn read_routes(proc_root: &Path, addr: IpAddr) -> Result<Vec<Route>, String> {
    let (name, parse): (&str, fn(&str) -> Option<Route>) = match addr {
        IpAddr::V4(_) => ("route", parse_route_line),
        IpAddr::V6(_) => ("ipv6_route", parse_ipv6_route_line),
    };
    let path = proc_root.join("net").join(name);
    match std::fs::read(&path) {
        Ok(bytes) => Ok(String::from_utf8_lossy(&bytes)
            .lines()
            .filter_map(parse)
            .collect()),
        Err(e) if e.kind() == ErrorKind::NotFound && addr.is_ipv6() => Ok(Vec::new()),
        Err(e) => Err(format!("cannot read {}: {e}", path.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // A pod's IPv4 table (x86_64, little-endian): default via 10.244.0.1, the pod subnet,
    // an unreachable route, a lo route and noise.
    const ROUTE: &str = "\
Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT
eth0\t00000000\t0100F40A\t0003\t0\t0\t0\t00000000\t0\t0\t0
eth0\t0000F40A\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0
*\t0033640A\t00000000\t0201\t0\t0\t0\t00FFFFFF\t0\t0\t0
lo\t0000000A\t00000000\t0001\t0\t0\t0\t000000FF\t0\t0\t0
garbage line
eth0\t0000F40\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0
eth0\t00000A0B\t00000000\t0001\t0\t0\t0\t00FF00FF\t0\t0\t0
eth0\t0000000C\t00000000\t0001\t0\t0\t0
eth0\t0000000D\t00000000\tZZ01\t0\t0\t0\t000000FF\t0\t0\t0

";

    // A pod's IPv6 table: the pod prefix and default on eth0, local and reject routes on lo,
    // multicast, and noise.
    const IPV6_ROUTE: &str = "\
fd000000000000000000000000000000 40 00000000000000000000000000000000 00 00000000000000000000000000000000 00000100 00000001 00000000 00000001     eth0
fe800000000000000000000000000000 40 00000000000000000000000000000000 00 00000000000000000000000000000000 00000100 00000001 00000000 00000001     eth0
00000000000000000000000000000001 80 00000000000000000000000000000000 00 00000000000000000000000000000000 00000000 00000002 00000000 80200001       lo
ff000000000000000000000000000000 08 00000000000000000000000000000000 00 00000000000000000000000000000000 00000100 00000003 00000000 00000001     eth0
00000000000000000000000000000000 00 00000000000000000000000000000000 00 00000000000000000000000000000000 ffffffff 00000001 00000000 00200200       lo
20010db8000000000000000000000000 20 00000000000000000000000000000000 00 00000000000000000000000000000000 00000400 00000001 00000000 00000201     eth0
20010db800000000000000000000000 20 00000000000000000000000000000000 00 00000000000000000000000000000000 00000400 00000001 00000000 00000001     eth0
fd010000000000000000000000000000 81 00000000000000000000000000000000 00 00000000000000000000000000000000 00000400 00000001 00000000 00000001     eth0
fd020000000000000000000000000000 40 00000000000000000000000000000000 00 00000000000000000000000000000000 00000400 00000001 00000000 00000001
";

    const IPV6_DEFAULT: &str = "\
00000000000000000000000000000000 00 00000000000000000000000000000000 00 fd000000000000000000000000000001 00000400 00000001 00000000 00000003     eth0
";

    fn v4(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    #[cfg(target_endian = "little")]
    #[test]
    fn parses_ipv4_routes() {
        let routes: Vec<_> = parse_route_table(ROUTE).collect();
        assert_eq!(
            routes,
            vec![
                Route {
                    dest: v4("0.0.0.0"),
                    prefix_len: 0,
                    flags: 0x3
                },
                Route {
                    dest: v4("10.244.0.0"),
                    prefix_len: 24,
                    flags: 0x1
                },
                Route {
                    dest: v4("10.100.51.0"),
                    prefix_len: 24,
                    flags: 0x201
                },
            ],
            "header, lo, short, non-prefix mask and bad flags lines are skipped"
        );
    }

    #[cfg(target_endian = "little")]
    #[test]
    fn ipv4_routability() {
        let routes = || parse_route_table(ROUTE);
        assert!(routable(routes(), v4("192.0.2.1")), "default route");
        assert!(routable(routes(), v4("10.244.0.7")));
        assert!(
            !routable(routes(), v4("10.100.51.9")),
            "the unreachable route is more specific than the default"
        );
        // Without the default route only the subnet is covered.
        let no_default = || routes().filter(|r| r.prefix_len > 0);
        assert!(!routable(no_default(), v4("192.0.2.1")));
        assert!(routable(no_default(), v4("10.244.0.200")));
        assert!(!routable(no_default(), v4("10.0.0.1")), "only on lo");
        assert!(!routable(routes(), "2001:db8::1".parse().unwrap()));
        assert!(!routable(parse_route_table(""), v4("192.0.2.1")));
    }

    #[test]
    fn parses_ipv6_routes() {
        let routes: Vec<_> = parse_ipv6_route_table(IPV6_ROUTE).collect();
        let dests: Vec<(String, u8)> = routes
            .iter()
            .map(|r| (r.dest.to_string(), r.prefix_len))
            .collect();
        assert_eq!(
            dests,
            [
                ("fd00::".to_string(), 64),
                ("fe80::".to_string(), 64),
                ("ff00::".to_string(), 8),
                ("2001:db8::".to_string(), 32),
            ],
            "lo, short address, prefix > 128 and iface-less lines are skipped"
        );
        assert_eq!(routes[3].flags, 0x201);
    }

    #[test]
    fn ipv6_routability() {
        let addr = |text: &str| -> IpAddr { text.parse().unwrap() };
        let routes = || parse_ipv6_route_table(IPV6_ROUTE);
        assert!(routable(routes(), addr("fd00::1234")));
        assert!(
            !routable(routes(), addr("2001:db8::1")),
            "reject route, and lo's ::/0 does not count"
        );
        assert!(!routable(routes(), addr("2001:db9::1")), "no default route");
        let with_default = || routes().chain(parse_ipv6_route_table(IPV6_DEFAULT));
        assert!(routable(with_default(), addr("2001:db9::1")));
        assert!(
            !routable(with_default(), addr("2001:db8::1")),
            "the more specific reject route still wins"
        );
        assert!(!routable(with_default(), addr("192.0.2.1")));
    }

    #[test]
    fn covers_by_prefix() {
        let route = Route {
            dest: v4("10.0.0.0"),
            prefix_len: 8,
            flags: RTF_UP,
        };
        assert!(route.covers(v4("10.255.255.255")));
        assert!(!route.covers(v4("11.0.0.0")));
        let host = Route {
            dest: v4("10.1.2.3"),
            prefix_len: 32,
            flags: RTF_UP,
        };
        assert!(host.covers(v4("10.1.2.3")));
        assert!(!host.covers(v4("10.1.2.4")));
        let v6 = Route {
            dest: "fd00::".parse().unwrap(),
            prefix_len: 128,
            flags: RTF_UP,
        };
        assert!(v6.covers("fd00::".parse().unwrap()));
        assert!(!v6.covers("fd00::1".parse().unwrap()));
    }

    #[test]
    fn loopback_is_always_routable() {
        assert!(always_routable(v4("127.0.0.1")));
        assert!(always_routable(v4("127.3.2.1")));
        assert!(always_routable("::1".parse().unwrap()));
        assert!(!always_routable(v4("192.0.2.1")));
        assert!(!always_routable("2001:db8::1".parse().unwrap()));
        assert!(!always_routable("::ffff:127.0.0.1".parse().unwrap()));
    }

    #[test]
    fn garbage_never_panics() {
        for text in [
            "",
            "\t\t\t",
            "Iface\tDestination",
            "eth0 00000000 00000000 0001 0 0 0 00000000",
            "eth0 \u{e9}\u{e9}\u{e9}\u{e9}\u{e9}\u{e9}\u{e9}\u{e9} 0 1 0 0 0 FFFFFFFF",
            "eth0 +0000000 00000000 0001 0 0 0 00000000",
            "eth0 00000000 00000000 +001 0 0 0 00000000",
            "eth0 00000000 00000000 0001 0 0 0 FFFFFFFF",
            "eth0 00000000 00000000 0001 0 0 0 F0FFFFFF",
            "x x x x x x x x x x",
            "0 0 0 0 0 0 0 0 0 eth0",
            "00000000000000000000000000000000 FF 00000000000000000000000000000000 00 00000000000000000000000000000000 00000000 00000000 00000000 00000001 eth0",
            "00000000000000000000000000000000 80 00000000000000000000000000000000 00 00000000000000000000000000000000 00000000 00000000 00000000 +0000001 eth0",
        ] {
            let _ = parse_route_table(text).count();
            let _ = parse_ipv6_route_table(text).count();
        }
        #[cfg(target_endian = "little")]
        assert_eq!(
            parse_route_line("eth0 00000000 00000000 0001 0 0 0 FFFFFFFF").map(|r| r.prefix_len),
            Some(32)
        );
        assert_eq!(
            parse_ipv6_route_line(
                "00000000000000000000000000000000 80 00000000000000000000000000000000 00 00000000000000000000000000000000 00000000 00000000 00000000 00000001 eth0"
            )
            .map(|r| r.prefix_len),
            Some(128)
        );
    }
}
