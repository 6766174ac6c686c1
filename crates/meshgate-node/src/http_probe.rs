//! The readiness URLs: plain `http://IP[:PORT][/path]`, no DNS, one `GET` with
//! `Connection: close`, bounded by [`crate::PROBE_TIMEOUT`]; only the status line is read.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The most read while looking for the status line.
const MAX_STATUS_LINE: usize = 8 * 1024;

/// A parsed `http://IP[:PORT][/path]` URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpUrl {
    /// Where to connect.
    pub addr: SocketAddr,
    /// The `Host` header: the URL's authority as given.
    pub host: String,
    /// The request target: path and query, at least `/`.
    pub path: String,
}

impl fmt::Display for HttpUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "http://{}{}", self.host, self.path)
    }
}

/// Parses `http://IP[:PORT][/path][?query]`: an IPv4 literal or a bracketed IPv6 literal, the
/// port 80 by default; a `#fragment` is dropped.
pub fn parse_url(text: &str) -> Result<HttpUrl, String> {
    let Some((scheme, rest)) = text.split_once("://") else {
        return Err("expected a URL of the form http://IP:PORT/path".to_string());
    };
    if scheme.eq_ignore_ascii_case("https") {
        return Err("https is not supported (plain http://IP:PORT/path only)".to_string());
    }
    if !scheme.eq_ignore_ascii_case("http") {
        return Err("expected a URL of the form http://IP:PORT/path".to_string());
    }
    let rest = rest.split_once('#').map_or(rest, |(before, _)| before);
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, path) = rest.split_at(authority_end);
    if authority.contains('@') {
        return Err("user info (user@) is not supported in the URL".to_string());
    }
    let (ip, port) = if let Some(bracketed) = authority.strip_prefix('[') {
        let (inside, after) = bracketed
            .split_once(']')
            .ok_or("missing ']' after the IPv6 address")?;
        let ip: Ipv6Addr = inside
            .parse()
            .map_err(|_| format!("'{inside}' is not an IPv6 address"))?;
        let port = match after {
            "" => None,
            _ => Some(
                after
                    .strip_prefix(':')
                    .ok_or_else(|| format!("unexpected '{after}' after the IPv6 address"))?,
            ),
        };
        (IpAddr::V6(ip), port)
    } else {
        let (host, port) = match authority.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (authority, None),
        };
        if host.is_empty() {
            return Err("missing host (expected http://IP:PORT/path)".to_string());
        }
        let ip: Ipv4Addr = host.parse().map_err(|_| {
            format!(
                "host '{host}' is not an IP address; there is no DNS resolution \
                 (use e.g. http://127.0.0.1:8000/readyz or http://[::1]:8080/)"
            )
        })?;
        (IpAddr::V4(ip), port)
    };
    let port = match port {
        None => 80,
        Some(p) => match p.parse::<u16>() {
            Ok(p) if p != 0 => p,
            _ => return Err(format!("invalid port '{p}' (expected 1-65535)")),
        },
    };
    let path = if path.is_empty() {
        "/".to_string()
    } else if path.starts_with('?') {
        format!("/{path}")
    } else {
        path.to_string()
    };
    if path
        .bytes()
        .any(|b| b.is_ascii_whitespace() || b.is_ascii_control())
    {
        return Err("the path must not contain spaces or control characters".to_string());
    }
    Ok(HttpUrl {
        addr: SocketAddr::new(ip, port),
        host: authority.to_string(),
        path,
    })
}

/// The status code of a status line (`HTTP/1.1 200 OK`).
fn parse_status_line(line: &[u8]) -> Option<u16> {
    let line = std::str::from_utf8(line).ok()?;
    let line = line.trim_end_matches(['\r', '\n']);
    let (version, rest) = line.split_once(' ')?;
    let digits = version.strip_prefix("HTTP/")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return None;
    }
    let code = rest.get(..3)?;
    if !code.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    if !matches!(rest.as_bytes().get(3), None | Some(b' ')) {
        return None;
    }
    let code: u16 = code.parse().ok()?;
    (100..=999).contains(&code).then_some(code)
}

fn request(url: &HttpUrl) -> String {
    format!(
        "GET {} HTTP/1.1\r\nHost: {}\r\nUser-Agent: meshgate-node/{}\r\nAccept: */*\r\n\
         Connection: close\r\n\r\n",
        url.path,
        url.host,
        env!("CARGO_PKG_VERSION")
    )
}

/// One `GET`: the status code, or why there was none. The whole exchange is bounded by
/// `timeout`; dropping the future closes the connection.
pub async fn get_status(url: &HttpUrl, timeout: Duration) -> Result<u16, String> {
    match tokio::time::timeout(timeout, exchange(url)).await {
        Ok(result) => result,
        Err(_) => Err(format!("no answer within {timeout:?}")),
    }
}

async fn exchange(url: &HttpUrl) -> Result<u16, String> {
    let mut stream = TcpStream::connect(url.addr)
        .await
        .map_err(|e| format!("connect to {} failed: {e}", url.addr))?;
    let _ = stream.set_nodelay(true);
    stream
        .write_all(request(url).as_bytes())
        .await
        .map_err(|e| format!("sending the request failed: {e}"))?;
    let mut buf = Vec::with_capacity(512);
    let mut chunk = [0u8; 512];
    loop {
        if let Some(end) = buf.iter().position(|&b| b == b'\n') {
            return parse_status_line(&buf[..=end])
                .ok_or_else(|| "invalid HTTP status line".to_string());
        }
        if buf.len() >= MAX_STATUS_LINE {
            return Err("invalid HTTP status line".to_string());
        }
        match stream.read(&mut chunk).await {
            Ok(0) if buf.is_empty() => {
                return Err("connection closed without a response".to_string());
            }
            Ok(0) => return parse_status_line(&buf).ok_or("invalid HTTP status line".into()),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) => return Err(format!("no response: {e}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[allow(clippy::unwrap_used)]
    fn url(text: &str) -> HttpUrl {
        parse_url(text).unwrap()
    }

    #[test]
    fn parses_ip_urls() {
        let u = url("http://127.0.0.1:8000/readyz");
        assert_eq!(u.addr, SocketAddr::from(([127, 0, 0, 1], 8000)));
        assert_eq!(u.path, "/readyz");
        assert_eq!(u.to_string(), "http://127.0.0.1:8000/readyz");
        let u = url("HTTP://10.0.0.1?x=1#f");
        assert_eq!(u.addr.port(), 80);
        assert_eq!(u.path, "/?x=1");
        let u = url("http://[::1]:8080/ready");
        assert_eq!(u.host, "[::1]:8080");
        assert_eq!(u.addr.port(), 8080);
    }

    #[test]
    fn rejects_other_urls() {
        for (bad, expect) in [
            ("https://127.0.0.1/", "https is not supported"),
            ("127.0.0.1:80/", "expected a URL"),
            ("ftp://127.0.0.1/", "expected a URL"),
            ("http://localhost:8000/", "no DNS resolution"),
            ("http://:80/", "missing host"),
            ("http://127.0.0.1:0/", "invalid port"),
            ("http://[::1/", "missing ']'"),
            ("http://[::1]x/", "unexpected"),
            ("http://u@127.0.0.1/", "user info"),
            ("http://127.0.0.1/a b", "spaces"),
        ] {
            let err = parse_url(bad).expect_err(bad);
            assert!(err.contains(expect), "{bad}: {err}");
        }
    }

    #[test]
    fn reads_status_lines() {
        assert_eq!(parse_status_line(b"HTTP/1.1 200 OK\r\n"), Some(200));
        assert_eq!(parse_status_line(b"HTTP/1.0 503\r\n"), Some(503));
        for bad in [
            &b""[..],
            b"HTTP/1.1 20 OK",
            b"HTTP/1.1 2000",
            b"SSH-2.0-x",
            b"HTTP/x 200",
        ] {
            assert_eq!(parse_status_line(bad), None, "{bad:?}");
        }
        let req = request(&url("http://[::1]:8080/r?x"));
        assert!(req.starts_with("GET /r?x HTTP/1.1\r\nHost: [::1]:8080\r\n"));
        assert!(req.ends_with("Connection: close\r\n\r\n"));
    }

    #[tokio::test]
    async fn a_closed_port_is_an_error_not_a_hang() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        drop(listener);
        let u = url(&format!("http://{addr}/"));
        let err = get_status(&u, Duration::from_secs(1))
            .await
            .expect_err("refused");
        assert!(err.contains("connect to"), "{err}");
    }
}
