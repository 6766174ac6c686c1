//! Which outbound TCP connections a sidecar mesh redirects to its proxy, and an address the
//! gate's redirect check can connect to that is redirected.
//!
//! A redirect check proves redirection only if its connection is one the mesh redirects. The
//! mesh's rules (docs/design.md, "What the meshes do") are read into an [`Outbound`]; then
//! [`Outbound::target`] picks a destination of each IP family that they send to the proxy:
//! a documentation address (TEST-NET, `2001:db8::/32`) where possible, so that nothing
//! answers without redirection, else another address the rules capture; `None` when the rules
//! capture no address of that family, and then the pod gets no redirect gate.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use meshgate_api::config::IpFamily;

/// A set of addresses of one family, as sorted, disjoint, inclusive intervals (IPv4 addresses
/// are held in the low 32 bits).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Ranges(Vec<(u128, u128)>);

fn family_max(family: IpFamily) -> u128 {
    match family {
        IpFamily::IPv4 => u128::from(u32::MAX),
        IpFamily::IPv6 => u128::MAX,
    }
}

fn family_of(ip: &IpAddr) -> IpFamily {
    match ip {
        IpAddr::V4(_) => IpFamily::IPv4,
        IpAddr::V6(_) => IpFamily::IPv6,
    }
}

fn bits(ip: &IpAddr) -> u128 {
    match ip {
        IpAddr::V4(a) => u128::from(u32::from(*a)),
        IpAddr::V6(a) => u128::from(*a),
    }
}

fn addr(family: IpFamily, v: u128) -> IpAddr {
    match family {
        IpFamily::IPv4 => IpAddr::V4(Ipv4Addr::from(v as u32)),
        IpFamily::IPv6 => IpAddr::V6(Ipv6Addr::from(v)),
    }
}

impl Ranges {
    pub fn all(family: IpFamily) -> Self {
        Ranges(vec![(0, family_max(family))])
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn add(&mut self, lo: u128, hi: u128) {
        self.0.push((lo, hi));
        self.0.sort_unstable();
        let mut out: Vec<(u128, u128)> = Vec::with_capacity(self.0.len());
        for &(l, h) in &self.0 {
            match out.last_mut() {
                Some(last) if l <= last.1.saturating_add(1) => last.1 = last.1.max(h),
                _ => out.push((l, h)),
            }
        }
        self.0 = out;
    }

    /// The addresses of `family` in a list of CIDRs (others are skipped).
    pub fn of_cidrs(cidrs: &[Cidr], family: IpFamily) -> Self {
        let mut r = Ranges::default();
        for c in cidrs.iter().filter(|c| family_of(&c.addr) == family) {
            let (lo, hi) = c.bounds();
            r.add(lo, hi);
        }
        r
    }

    /// `self` without `other`.
    pub fn minus(&self, other: &Ranges) -> Self {
        let mut out = Vec::new();
        for &(mut lo, hi) in &self.0 {
            let mut alive = true;
            for &(olo, ohi) in &other.0 {
                if ohi < lo || olo > hi {
                    continue;
                }
                if olo > lo {
                    out.push((lo, olo - 1));
                }
                if ohi >= hi {
                    alive = false;
                    break;
                }
                lo = ohi + 1;
            }
            if alive {
                out.push((lo, hi));
            }
        }
        Ranges(out)
    }

    pub fn contains(&self, v: u128) -> bool {
        self.0.iter().any(|&(lo, hi)| lo <= v && v <= hi)
    }
}

/// A CIDR (`10.0.0.0/8`, `fd00::/8`); a bare address is a single-address CIDR.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cidr {
    pub addr: IpAddr,
    pub prefix: u8,
}

impl Cidr {
    pub fn parse(s: &str) -> Option<Self> {
        let s = s.trim();
        let (a, p) = s.split_once('/').unwrap_or((s, ""));
        let addr: IpAddr = a.parse().ok()?;
        let width = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = if p.is_empty() { width } else { p.parse().ok()? };
        (prefix <= width).then_some(Cidr { addr, prefix })
    }

    fn bounds(&self) -> (u128, u128) {
        let width = if self.addr.is_ipv4() { 32 } else { 128 };
        let host_bits = u32::from(width - self.prefix);
        let mask: u128 = if host_bits >= 128 {
            u128::MAX
        } else {
            (1u128 << host_bits) - 1
        };
        let lo = bits(&self.addr) & !mask;
        (lo, lo | mask)
    }
}

/// A comma-separated CIDR list; `Err` names the entry that is not one.
pub fn parse_cidrs(list: &str) -> Result<Vec<Cidr>, String> {
    list.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| Cidr::parse(s).ok_or_else(|| format!("{s:?} is not a CIDR")))
        .collect()
}

/// A set of TCP ports, from a comma-separated list of ports and `a-b` ranges; `*` is every port.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Ports(Vec<(u16, u16)>);

impl Ports {
    pub fn parse(list: &str) -> Result<Self, String> {
        let mut out = Vec::new();
        for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            if item == "*" {
                out.push((0, u16::MAX));
                continue;
            }
            let (a, b) = item.split_once('-').unwrap_or((item, item));
            let port = |s: &str| {
                s.trim()
                    .parse::<u16>()
                    .map_err(|_| format!("{item:?} is not a port or a port range"))
            };
            let (a, b) = (port(a)?, port(b)?);
            if a > b {
                return Err(format!("{item:?} is not a port range"));
            }
            out.push((a, b));
        }
        Ok(Ports(out))
    }

    pub fn contains(&self, p: u16) -> bool {
        self.0.iter().any(|&(a, b)| a <= p && p <= b)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn first(&self) -> Option<u16> {
        self.0.iter().map(|&(a, _)| a).find(|&p| p != 0)
    }
}

/// What a mesh redirects of one pod's outbound TCP, for one IP family: a connection to
/// `addr:port` is redirected when `port` is not in `exclude_ports`, `addr` is not in
/// `exclude`, and `addr` is in `include` or `port` is in `include_ports`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outbound {
    pub family: IpFamily,
    pub include: Ranges,
    pub exclude: Ranges,
    pub include_ports: Ports,
    pub exclude_ports: Ports,
}

/// Addresses a check never connects to: they are not routed out of the pod (loopback and
/// unspecified, which the meshes never redirect for an application's uid) or not unicast.
fn never(family: IpFamily) -> Ranges {
    let list = match family {
        IpFamily::IPv4 => "0.0.0.0/8,127.0.0.0/8,169.254.0.0/16,224.0.0.0/3",
        IpFamily::IPv6 => "::/127,::ffff:0:0/96,fe80::/10,ff00::/8",
    };
    // The literal list above is valid.
    Ranges::of_cidrs(&parse_cidrs(list).unwrap_or_default(), family)
}

/// Addresses reserved for documentation (RFC 5737, RFC 3849), where nothing answers: the
/// preferred targets.
fn documentation(family: IpFamily) -> &'static [&'static str] {
    match family {
        IpFamily::IPv4 => &["192.0.2.1", "198.51.100.1", "203.0.113.1"],
        IpFamily::IPv6 => &["2001:db8::1"],
    }
}

/// Ports tried for the target, in order.
const PORTS: [u16; 4] = [80, 8080, 443, 9];

impl Outbound {
    /// A destination this pod's outbound TCP is redirected for, if there is one.
    pub fn target(&self) -> Option<SocketAddr> {
        let family = self.family;
        let everywhere = Ranges::all(family).minus(&never(family));
        let ports = PORTS.iter().copied().chain(self.include_ports.first());
        for port in ports.filter(|p| !self.exclude_ports.contains(*p)) {
            let base = if self.include_ports.contains(port) {
                everywhere.clone()
            } else {
                self.include.minus(&never(family))
            };
            let candidates = base.minus(&self.exclude);
            if candidates.is_empty() {
                continue;
            }
            let preferred = documentation(family)
                .iter()
                .filter_map(|a| a.parse::<IpAddr>().ok())
                .find(|a| candidates.contains(bits(a)));
            let ip = preferred.unwrap_or_else(|| {
                // The first address of the first interval, past a network address.
                let (lo, hi) = candidates.0[0];
                addr(family, if hi > lo { lo + 1 } else { lo })
            });
            return Some(SocketAddr::new(ip, port));
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn out(family: IpFamily, include: &str, exclude: &str, inc_p: &str, exc_p: &str) -> Outbound {
        let r = |l: &str| {
            if l == "*" {
                Ranges::all(family)
            } else {
                Ranges::of_cidrs(&parse_cidrs(l).unwrap(), family)
            }
        };
        Outbound {
            family,
            include: r(include),
            exclude: r(exclude),
            include_ports: Ports::parse(inc_p).unwrap(),
            exclude_ports: Ports::parse(exc_p).unwrap(),
        }
    }

    fn t(o: &Outbound) -> Option<String> {
        o.target().map(|a| a.to_string())
    }

    #[test]
    fn documentation_addresses_first() {
        let v4 = IpFamily::IPv4;
        assert_eq!(
            t(&out(v4, "*", "", "", "")).as_deref(),
            Some("192.0.2.1:80")
        );
        assert_eq!(
            t(&out(v4, "*", "192.0.2.0/24", "", "")).as_deref(),
            Some("198.51.100.1:80")
        );
        assert_eq!(
            t(&out(IpFamily::IPv6, "*", "", "", "")).as_deref(),
            Some("[2001:db8::1]:80")
        );
    }

    #[test]
    fn follows_include_and_exclude() {
        let v4 = IpFamily::IPv4;
        // Only the cluster's ranges are redirected: the target is inside them.
        let o = out(v4, "10.96.0.0/12,10.244.0.0/16", "", "", "");
        assert_eq!(t(&o).as_deref(), Some("10.96.0.1:80"));
        // Everything excluded: nothing to prove.
        assert_eq!(t(&out(v4, "*", "0.0.0.0/0", "", "")), None);
        assert_eq!(t(&out(v4, "", "", "", "")), None);
        // An included port is redirected to any address.
        assert_eq!(
            t(&out(v4, "", "", "3306", "")).as_deref(),
            Some("192.0.2.1:3306")
        );
        // Excluded ports are avoided.
        assert_eq!(
            t(&out(v4, "*", "", "", "80,8080")).as_deref(),
            Some("192.0.2.1:443")
        );
        assert_eq!(t(&out(v4, "*", "", "", "1-65535")), None);
        // Loopback is never a target, even when included.
        assert_eq!(t(&out(v4, "127.0.0.0/8", "", "", "")), None);
    }

    #[test]
    fn parses_lists() {
        assert!(parse_cidrs("10.0.0.0/8, fd00::/8,1.2.3.4").is_ok());
        assert!(parse_cidrs("10.0.0.0/33").is_err());
        assert!(parse_cidrs("ten").is_err());
        assert!(Ports::parse("80,9000-9100").unwrap().contains(9050));
        assert!(Ports::parse("90-80").is_err());
        assert!(Ports::parse("http").is_err());
    }

    #[test]
    fn range_subtraction() {
        let v4 = IpFamily::IPv4;
        let all = Ranges::all(v4);
        let ten = Ranges::of_cidrs(&parse_cidrs("10.0.0.0/8").unwrap(), v4);
        let rest = all.minus(&ten);
        assert!(!rest.contains(bits(&"10.1.2.3".parse().unwrap())));
        assert!(rest.contains(bits(&"11.0.0.0".parse().unwrap())));
        assert!(rest.contains(bits(&"9.255.255.255".parse().unwrap())));
        assert!(ten.minus(&all).is_empty());
    }
}
