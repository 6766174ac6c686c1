//! `--redirect-check`: prove that outbound TCP from this pod is redirected to the proxy's
//! outbound port.
//!
//! We listen on the proxy's outbound port ourselves (the proxy is not running yet), connect to
//! an address that nothing answers on, write a random token and expect to accept that very
//! connection on our listener and read the token back. Without redirection the connect fails
//! or times out (not ready yet); with it the kernel hands the connection to our listener.
//!
//! **Targets.** At most one IPv4 and one IPv6 target ([`RedirectTargets`]); by default
//! TEST-NET-1 `192.0.2.1:80` (RFC 5737) and `[2001:db8::1]:80` (RFC 3849). The first probe
//! reads the pod's routing tables (`$MESHGATE_WAIT_PROC/net/route` and `.../net/ipv6_route`,
//! see [`crate::route`]) and picks the first target, IPv4 before IPv6, that a non-`lo` route
//! covers; loopback targets (`127.0.0.0/8`, `::1`) always qualify. The listener then binds the
//! wildcard address of that target's family (falling back to loopback). If no target is
//! routable (an IPv6-only pod given only an IPv4 target, a pod without routes) the check
//! passes at once and says so ("not checked"): a pod that cannot reach the target has nothing
//! to redirect there, and holding it would only time out. Until a target is chosen (a route
//! table could not be read) the tables are read again at every probe.
//!
//! **No `TIME_WAIT` on the proxy's port.** The side that closes a TCP connection first keeps
//! it in `TIME_WAIT` for a minute. Our client closes first, so that lands on its ephemeral
//! port, and every accepted connection is closed with `SO_LINGER` 0 (a reset), so none is
//! left on local `PORT`, which the proxy binds next. The listener is closed as soon as the
//! check passes.

use std::collections::hash_map::RandomState;
use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::io::{ErrorKind, Read, Write};
use std::net::{
    IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, SocketAddrV4, SocketAddrV6, TcpListener,
    TcpStream,
};
use std::path::Path;
use std::time::{Duration, Instant};

use crate::route;

/// How long one attempt waits for its connection, at most.
pub const CONNECT_TIMEOUT: Duration = Duration::from_millis(200);

/// Where the redirect check may connect: at most one target per IP family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RedirectTargets {
    pub v4: Option<SocketAddrV4>,
    pub v6: Option<SocketAddrV6>,
}

/// The targets without `--redirect-target`: TEST-NET-1 (RFC 5737) and the IPv6 documentation
/// prefix (RFC 3849), where nothing answers unless the pod's traffic is redirected.
pub const DEFAULT_TARGETS: RedirectTargets = RedirectTargets {
    v4: Some(SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 1), 80)),
    v6: Some(SocketAddrV6::new(
        Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1),
        80,
        0,
        0,
    )),
};

impl RedirectTargets {
    /// No target yet.
    pub const NONE: RedirectTargets = RedirectTargets { v4: None, v6: None };

    /// The targets in the order they are tried: IPv4, then IPv6.
    pub fn iter(&self) -> impl Iterator<Item = SocketAddr> + '_ {
        self.v4
            .map(SocketAddr::V4)
            .into_iter()
            .chain(self.v6.map(SocketAddr::V6))
    }

    /// Adds a target; an error if its family already has one.
    pub fn add(&mut self, target: SocketAddr) -> Result<(), String> {
        let (family, old) = match target {
            SocketAddr::V4(v4) => ("IPv4", self.v4.replace(v4).map(SocketAddr::V4)),
            SocketAddr::V6(v6) => ("IPv6", self.v6.replace(v6).map(SocketAddr::V6)),
        };
        match old {
            None => Ok(()),
            Some(old) => Err(format!(
                "a second {family} target ({old} and {target}): at most one IPv4 and one \
                 IPv6 target"
            )),
        }
    }
}

impl fmt::Display for RedirectTargets {
    /// `192.0.2.1:80 or [2001:db8::1]:80`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, target) in self.iter().enumerate() {
            if i > 0 {
                f.write_str(" or ")?;
            }
            write!(f, "{target}")?;
        }
        Ok(())
    }
}

/// Where the check stands on targets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Choice {
    /// The route tables have not been read successfully yet.
    Undecided,
    /// This target is routable; the check connects there.
    Target(SocketAddr),
    /// No target is routable: the check passed without connecting.
    NotChecked,
}

/// The state of one `--redirect-check`: the chosen target, and the listener that stays bound
/// between attempts and is closed when the check has passed (dropped), so the proxy can bind
/// the port.
#[derive(Debug)]
pub struct RedirectProbe {
    port: u16,
    targets: RedirectTargets,
    choice: Choice,
    listener: Option<TcpListener>,
}

impl RedirectProbe {
    pub fn new(port: u16, targets: RedirectTargets) -> Self {
        Self {
            port,
            targets,
            choice: Choice::Undecided,
            listener: None,
        }
    }

    /// The check as the log line names it: with the chosen target once there is one, or
    /// why it was not checked.
    pub fn describe(&self) -> String {
        match self.choice {
            Choice::Undecided => format!("redirect-check {} via {}", self.port, self.targets),
            Choice::Target(target) => format!("redirect-check {} via {target}", self.port),
            Choice::NotChecked => format!(
                "redirect-check {} (not checked: no route to {} in this pod)",
                self.port, self.targets
            ),
        }
    }

    /// One attempt, bounded by about `2 * timeout`. Chooses the target first (reading the
    /// route tables under `proc_root`) if that is not done yet.
    pub fn probe(&mut self, proc_root: &Path, timeout: Duration) -> Result<(), String> {
        let target = match self.choice {
            Choice::Target(target) => target,
            Choice::NotChecked => return Ok(()),
            Choice::Undecided => match choose_target(&self.targets, proc_root)? {
                Some(target) => {
                    self.choice = Choice::Target(target);
                    target
                }
                None => {
                    self.choice = Choice::NotChecked;
                    return Ok(());
                }
            },
        };
        let listener = match self.listener.take() {
            Some(listener) => listener,
            None => self.listen(target)?,
        };
        let result = self.attempt(&listener, target, timeout);
        self.listener = Some(listener);
        result
    }

    /// Binds the wildcard address of the target's family (covers loopback, where a
    /// REDIRECT of locally generated traffic delivers it), falling back to loopback.
    fn listen(&self, target: SocketAddr) -> Result<TcpListener, String> {
        let (any, loopback): (IpAddr, IpAddr) = if target.is_ipv6() {
            (Ipv6Addr::UNSPECIFIED.into(), Ipv6Addr::LOCALHOST.into())
        } else {
            (Ipv4Addr::UNSPECIFIED.into(), Ipv4Addr::LOCALHOST.into())
        };
        let listener = TcpListener::bind((any, self.port))
            .or_else(|_| TcpListener::bind((loopback, self.port)))
            .map_err(|e| format!("cannot listen on port {}: {e}", self.port))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| format!("cannot listen on port {}: {e}", self.port))?;
        Ok(listener)
    }

    fn attempt(
        &self,
        listener: &TcpListener,
        target: SocketAddr,
        timeout: Duration,
    ) -> Result<(), String> {
        // Drop anything left in the accept queue by earlier attempts.
        while let Ok((stale, _)) = listener.accept() {
            close_without_time_wait(stale);
        }

        let token = token();
        let mut client = TcpStream::connect_timeout(&target, timeout).map_err(|e| {
            if e.kind() == ErrorKind::TimedOut || e.kind() == ErrorKind::WouldBlock {
                format!("connect to {target} timed out")
            } else {
                format!("connect to {target} failed: {e}")
            }
        })?;
        let client_addr = client
            .local_addr()
            .map_err(|e| format!("cannot get the local address: {e}"))?;
        client
            .set_write_timeout(Some(timeout))
            .and_then(|()| client.write_all(token.as_bytes()))
            .map_err(|e| format!("writing to {target} failed: {e}"))?;

        let deadline = Instant::now() + timeout;
        let accepted = loop {
            match listener.accept() {
                Ok((accepted, peer)) if peer == client_addr => break Ok(accepted),
                // Someone else's connection: not ours.
                Ok((other, _)) => close_without_time_wait(other),
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        break Err(format!(
                            "connected to {target} but not through port {}: not redirected",
                            self.port
                        ));
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => break Err(format!("accept on port {} failed: {e}", self.port)),
            }
        };
        let result = match &accepted {
            Ok(accepted) => read_token(accepted, &token, timeout),
            Err(e) => Err(e.clone()),
        };
        // The client closes first, so its TIME_WAIT lands on its ephemeral port; the accepted
        // end is then reset, so nothing at all is left on the port the proxy is about to bind.
        let _ = client.shutdown(Shutdown::Both);
        drop(client);
        if let Ok(accepted) = accepted {
            close_without_time_wait(accepted);
        }
        result
    }
}

/// The first target, IPv4 before IPv6, that the pod's routing tables cover (loopback always
/// counts); `None` when none is routable. Each family's table is read at most once.
fn choose_target(
    targets: &RedirectTargets,
    proc_root: &Path,
) -> Result<Option<SocketAddr>, String> {
    for target in targets.iter() {
        let ip = target.ip();
        if route::always_routable(ip) || route::routable(route::read_routes(proc_root, ip)?, ip) {
            return Ok(Some(target));
        }
    }
    Ok(None)
}

/// Closes an accepted connection with `SO_LINGER` 0: the kernel sends a reset and frees the
/// socket at once instead of keeping it in `TIME_WAIT` on our local port.
fn close_without_time_wait(stream: TcpStream) {
    let _ = rustix::net::sockopt::set_socket_linger(&stream, Some(Duration::ZERO));
    drop(stream);
}

/// Reads the token back from the accepted connection (the caller closes it).
fn read_token(mut accepted: &TcpStream, token: &str, timeout: Duration) -> Result<(), String> {
    let mut got = vec![0u8; token.len()];
    let read = accepted
        .set_nonblocking(false)
        .and_then(|()| accepted.set_read_timeout(Some(timeout)))
        .and_then(|()| accepted.read_exact(&mut got));
    match read {
        Ok(()) if got == token.as_bytes() => Ok(()),
        Ok(()) => Err("accepted a connection but read the wrong token".to_string()),
        Err(e) => Err(format!("accepted a connection but read no token: {e}")),
    }
}

/// A token no other process can guess, from std's randomly keyed hasher.
fn token() -> String {
    let mut hasher = RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    hasher.write_u32(std::process::id());
    format!("meshgate-wait:{:016x}\n", hasher.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    fn only(target: SocketAddr) -> RedirectTargets {
        let mut targets = RedirectTargets::NONE;
        targets.add(target).unwrap();
        targets
    }

    /// A procfs root with these `net/route` and `net/ipv6_route` texts (`None`: missing).
    struct FakeProc(std::path::PathBuf);

    impl FakeProc {
        fn new(name: &str, route: Option<&str>, ipv6_route: Option<&str>) -> Self {
            let root = std::env::temp_dir().join(format!(
                "meshgate-wait-redirect-{}-{name}",
                std::process::id()
            ));
            let _ = std::fs::remove_dir_all(&root);
            std::fs::create_dir_all(root.join("net")).unwrap();
            if let Some(text) = route {
                std::fs::write(root.join("net/route"), text).unwrap();
            }
            if let Some(text) = ipv6_route {
                std::fs::write(root.join("net/ipv6_route"), text).unwrap();
            }
            FakeProc(root)
        }
    }

    impl Drop for FakeProc {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    const ROUTE_HEADER: &str =
        "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n";
    const ROUTE_DEFAULT: &str = "eth0\t00000000\t0100F40A\t0003\t0\t0\t0\t00000000\t0\t0\t0\n";
    const IPV6_DEFAULT: &str = "00000000000000000000000000000000 00 00000000000000000000000000000000 00 00000000000000000000000000000000 00000400 00000001 00000000 00000001     eth0\n";
    const IPV6_LO_ONLY: &str = "\
00000000000000000000000000000001 80 00000000000000000000000000000000 00 00000000000000000000000000000000 00000000 00000002 00000000 80200001       lo
00000000000000000000000000000000 00 00000000000000000000000000000000 00 00000000000000000000000000000000 ffffffff 00000001 00000000 00200200       lo
";

    #[test]
    fn tokens_differ() {
        assert_ne!(token(), token());
        assert!(token().starts_with("meshgate-wait:"));
    }

    #[test]
    fn targets_one_per_family() {
        assert_eq!(
            DEFAULT_TARGETS.to_string(),
            "192.0.2.1:80 or [2001:db8::1]:80"
        );
        let mut targets = RedirectTargets::NONE;
        assert_eq!(targets.iter().count(), 0);
        targets.add("[::1]:9".parse().unwrap()).unwrap();
        targets.add("10.0.0.1:8".parse().unwrap()).unwrap();
        assert_eq!(targets.to_string(), "10.0.0.1:8 or [::1]:9", "IPv4 first");
        let err = targets.add("10.0.0.2:8".parse().unwrap()).unwrap_err();
        assert!(
            err.contains("a second IPv4 target (10.0.0.1:8 and 10.0.0.2:8)"),
            "{err}"
        );
        let err = targets.add("[::2]:9".parse().unwrap()).unwrap_err();
        assert!(err.contains("a second IPv6 target"), "{err}");
    }

    #[cfg(target_endian = "little")]
    #[test]
    fn chooses_the_first_routable_target() {
        let dual = FakeProc::new(
            "dual",
            Some(&format!("{ROUTE_HEADER}{ROUTE_DEFAULT}")),
            Some(IPV6_DEFAULT),
        );
        let v4: SocketAddr = "192.0.2.1:80".parse().unwrap();
        let v6: SocketAddr = "[2001:db8::1]:80".parse().unwrap();
        assert_eq!(choose_target(&DEFAULT_TARGETS, &dual.0), Ok(Some(v4)));
        assert_eq!(choose_target(&only(v6), &dual.0), Ok(Some(v6)));

        let v6_only = FakeProc::new("v6only", Some(ROUTE_HEADER), Some(IPV6_DEFAULT));
        assert_eq!(choose_target(&DEFAULT_TARGETS, &v6_only.0), Ok(Some(v6)));
        assert_eq!(choose_target(&only(v4), &v6_only.0), Ok(None));

        // IPv6 disabled: no ipv6_route at all.
        let v4_only = FakeProc::new(
            "v4only",
            Some(&format!("{ROUTE_HEADER}{ROUTE_DEFAULT}")),
            None,
        );
        assert_eq!(choose_target(&DEFAULT_TARGETS, &v4_only.0), Ok(Some(v4)));
        assert_eq!(choose_target(&only(v6), &v4_only.0), Ok(None));

        let no_routes = FakeProc::new("none", Some(ROUTE_HEADER), Some(IPV6_LO_ONLY));
        assert_eq!(choose_target(&DEFAULT_TARGETS, &no_routes.0), Ok(None));
        // Loopback needs no route.
        let lo: SocketAddr = "127.0.0.1:9".parse().unwrap();
        assert_eq!(choose_target(&only(lo), &no_routes.0), Ok(Some(lo)));

        let unreadable = FakeProc::new("unreadable", None, Some(IPV6_DEFAULT));
        let err = choose_target(&DEFAULT_TARGETS, &unreadable.0).unwrap_err();
        assert!(
            err.contains("cannot read") && err.contains("net/route"),
            "{err}"
        );
    }

    #[test]
    fn not_checked_without_a_route() {
        let no_routes = FakeProc::new("notchecked", Some(ROUTE_HEADER), Some(IPV6_LO_ONLY));
        let mut probe = RedirectProbe::new(free_port(), DEFAULT_TARGETS);
        assert_eq!(
            probe.describe(),
            format!(
                "redirect-check {} via 192.0.2.1:80 or [2001:db8::1]:80",
                probe.port
            )
        );
        assert_eq!(
            probe.probe(&no_routes.0, Duration::from_millis(100)),
            Ok(())
        );
        assert_eq!(
            probe.describe(),
            format!(
                "redirect-check {} (not checked: no route to 192.0.2.1:80 or \
                 [2001:db8::1]:80 in this pod)",
                probe.port
            )
        );
        assert!(probe.listener.is_none(), "nothing was bound");
    }

    #[test]
    fn retries_until_the_routes_can_be_read() {
        let proc = FakeProc::new("retry", None, None);
        let port = free_port();
        let mut probe = RedirectProbe::new(port, only("192.0.2.1:80".parse().unwrap()));
        let err = probe
            .probe(&proc.0, Duration::from_millis(100))
            .unwrap_err();
        assert!(err.contains("cannot read"), "{err}");
        std::fs::write(proc.0.join("net/route"), ROUTE_HEADER).unwrap();
        assert_eq!(probe.probe(&proc.0, Duration::from_millis(100)), Ok(()));
        assert!(
            probe
                .describe()
                .contains("not checked: no route to 192.0.2.1:80 in")
        );
    }

    #[test]
    fn ready_when_connection_lands_on_our_port() {
        let port = free_port();
        let target = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        let mut probe = RedirectProbe::new(port, only(target));
        let proc = Path::new("/proc");
        assert_eq!(probe.probe(proc, Duration::from_secs(2)), Ok(()));
        assert_eq!(
            probe.describe(),
            format!("redirect-check {port} via {target}")
        );
        // And again on the same listener.
        assert_eq!(probe.probe(proc, Duration::from_secs(2)), Ok(()));
    }

    #[test]
    fn loopback_target_is_chosen_over_an_unrouted_one() {
        let port = free_port();
        let no_routes = FakeProc::new("lo", Some(ROUTE_HEADER), Some(IPV6_LO_ONLY));
        let mut targets = only("[2001:db8::1]:80".parse().unwrap());
        targets
            .add(SocketAddr::from((Ipv4Addr::LOCALHOST, port)))
            .unwrap();
        let mut probe = RedirectProbe::new(port, targets);
        assert_eq!(probe.probe(&no_routes.0, Duration::from_secs(2)), Ok(()));
        assert_eq!(
            probe.describe(),
            format!("redirect-check {port} via 127.0.0.1:{port}")
        );
    }

    #[test]
    fn ready_on_ipv6_loopback() {
        // Skipped where IPv6 is disabled.
        let Ok(listener) = TcpListener::bind("[::1]:0") else {
            return;
        };
        let port = listener.local_addr().unwrap().port();
        drop(listener);
        let mut probe =
            RedirectProbe::new(port, only(SocketAddr::from((Ipv6Addr::LOCALHOST, port))));
        assert_eq!(
            probe.probe(Path::new("/proc"), Duration::from_secs(2)),
            Ok(())
        );
    }

    #[test]
    fn not_ready_when_connection_is_refused() {
        let port = free_port();
        let other = free_port();
        let mut probe =
            RedirectProbe::new(port, only(SocketAddr::from((Ipv4Addr::LOCALHOST, other))));
        let err = probe
            .probe(Path::new("/proc"), Duration::from_millis(200))
            .unwrap_err();
        assert!(err.contains("failed"), "{err}");
    }

    #[test]
    fn not_ready_when_connection_lands_elsewhere() {
        let port = free_port();
        let elsewhere = TcpListener::bind("127.0.0.1:0").unwrap();
        let target = elsewhere.local_addr().unwrap();
        let mut probe = RedirectProbe::new(port, only(target));
        let err = probe
            .probe(Path::new("/proc"), Duration::from_millis(100))
            .unwrap_err();
        assert!(err.contains("not redirected"), "{err}");
    }
}
