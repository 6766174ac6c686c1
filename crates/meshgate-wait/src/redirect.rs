//! `--redirect-check`: prove that outbound TCP from this pod is redirected to the proxy's
//! outbound port.
//!
//! We listen on the proxy's outbound port ourselves (the proxy is not running yet), connect to
//! an address that nothing answers on (TEST-NET-1 `192.0.2.1:80` by default), write a random
//! token and expect to accept that very connection on our listener and read the token back.
//! Without redirection the connect fails or times out (not ready yet); with it the kernel hands
//! the connection to our listener.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

/// How long one attempt waits for its connection, at most.
pub const CONNECT_TIMEOUT: Duration = Duration::from_millis(200);

/// The state of one `--redirect-check`: the listener stays bound between attempts and is
/// closed when the check has passed (dropped), so the proxy can bind the port.
#[derive(Debug)]
pub struct RedirectProbe {
    port: u16,
    target: SocketAddr,
    listener: Option<TcpListener>,
}

impl RedirectProbe {
    pub fn new(port: u16, target: SocketAddr) -> Self {
        Self {
            port,
            target,
            listener: None,
        }
    }

    /// One attempt, bounded by about `2 * timeout`.
    pub fn probe(&mut self, timeout: Duration) -> Result<(), String> {
        let listener = match self.listener.take() {
            Some(listener) => listener,
            None => self.listen()?,
        };
        let result = self.attempt(&listener, timeout);
        self.listener = Some(listener);
        result
    }

    /// Binds the wildcard address of the target's family (covers loopback, where a
    /// REDIRECT of locally generated traffic delivers it), falling back to loopback.
    fn listen(&self) -> Result<TcpListener, String> {
        let (any, loopback): (IpAddr, IpAddr) = if self.target.is_ipv6() {
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

    fn attempt(&self, listener: &TcpListener, timeout: Duration) -> Result<(), String> {
        // Drop anything left in the accept queue by earlier attempts.
        while listener.accept().is_ok() {}

        let token = token();
        let mut client = TcpStream::connect_timeout(&self.target, timeout).map_err(|e| {
            if e.kind() == ErrorKind::TimedOut || e.kind() == ErrorKind::WouldBlock {
                format!("connect to {} timed out", self.target)
            } else {
                format!("connect to {} failed: {e}", self.target)
            }
        })?;
        let client_addr = client
            .local_addr()
            .map_err(|e| format!("cannot get the local address: {e}"))?;
        client
            .set_write_timeout(Some(timeout))
            .and_then(|()| client.write_all(token.as_bytes()))
            .map_err(|e| format!("writing to {} failed: {e}", self.target))?;

        let deadline = Instant::now() + timeout;
        let result = loop {
            match listener.accept() {
                Ok((accepted, peer)) if peer == client_addr => {
                    break read_token(accepted, &token, timeout);
                }
                Ok(_) => {} // someone else's connection: not ours
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        break Err(format!(
                            "connected to {} but not through port {}: not redirected",
                            self.target, self.port
                        ));
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => break Err(format!("accept on port {} failed: {e}", self.port)),
            }
        };
        // The client closes first, so TIME_WAIT lands on its ephemeral port and not on the
        // port the proxy is about to bind.
        let _ = client.shutdown(Shutdown::Both);
        drop(client);
        result
    }
}

/// Reads the token back from the accepted connection and closes it.
fn read_token(mut accepted: TcpStream, token: &str, timeout: Duration) -> Result<(), String> {
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

    #[test]
    fn tokens_differ() {
        assert_ne!(token(), token());
        assert!(token().starts_with("meshgate-wait:"));
    }

    #[test]
    fn ready_when_connection_lands_on_our_port() {
        let port = free_port();
        let mut probe = RedirectProbe::new(port, SocketAddr::from((Ipv4Addr::LOCALHOST, port)));
        assert_eq!(probe.probe(Duration::from_secs(2)), Ok(()));
        // And again on the same listener.
        assert_eq!(probe.probe(Duration::from_secs(2)), Ok(()));
    }

    #[test]
    fn ready_on_ipv6_loopback() {
        // Skipped where IPv6 is disabled.
        let Ok(listener) = TcpListener::bind("[::1]:0") else {
            return;
        };
        let port = listener.local_addr().unwrap().port();
        drop(listener);
        let mut probe = RedirectProbe::new(port, SocketAddr::from((Ipv6Addr::LOCALHOST, port)));
        assert_eq!(probe.probe(Duration::from_secs(2)), Ok(()));
    }

    #[test]
    fn not_ready_when_connection_is_refused() {
        let port = free_port();
        let other = free_port();
        let mut probe = RedirectProbe::new(port, SocketAddr::from((Ipv4Addr::LOCALHOST, other)));
        let err = probe.probe(Duration::from_millis(200)).unwrap_err();
        assert!(err.contains("failed"), "{err}");
    }

    #[test]
    fn not_ready_when_connection_lands_elsewhere() {
        let port = free_port();
        let elsewhere = TcpListener::bind("127.0.0.1:0").unwrap();
        let target = elsewhere.local_addr().unwrap();
        let mut probe = RedirectProbe::new(port, target);
        let err = probe.probe(Duration::from_millis(100)).unwrap_err();
        assert!(err.contains("not redirected"), "{err}");
    }
}
