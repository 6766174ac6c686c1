//! A minimal HTTP/1.1 client for `--http`: IP literals only (no DNS), plain `http://`,
//! one `GET` with `Connection: close`, ready on a 2xx status.

use std::fmt;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
use std::time::Duration;

/// The most we read while looking for the status line.
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

/// Parses `http://IP[:PORT][/path][?query]`. The host must be an IPv4 literal or a
/// bracketed IPv6 literal; the port defaults to 80; a `#fragment` is dropped.
pub fn parse_url(text: &str) -> Result<HttpUrl, String> {
    let scheme_end = text.find("://").unwrap_or(0);
    let (scheme, rest) = text.split_at(scheme_end);
    if scheme.eq_ignore_ascii_case("https") {
        return Err("https is not supported (plain http://IP:PORT/path only)".to_string());
    }
    if !scheme.eq_ignore_ascii_case("http") {
        return Err("expected a URL of the form http://IP:PORT/path".to_string());
    }
    let rest = &rest[3..];
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
                "host '{host}' is not an IP address; meshgate-wait does no DNS resolution \
                 (use e.g. http://127.0.0.1:15021/healthz/ready or http://[::1]:8080/)"
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

/// Parses a status line (`HTTP/1.1 200 OK`) into its status code.
pub fn parse_status_line(line: &str) -> Option<u16> {
    let line = line.strip_suffix('\n').unwrap_or(line);
    let line = line.strip_suffix('\r').unwrap_or(line);
    let (version, rest) = line.split_once(' ')?;
    let digits = version.strip_prefix("HTTP/")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return None;
    }
    let code = rest.get(..3)?;
    if !code.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    match rest.as_bytes().get(3) {
        None | Some(b' ') => {}
        Some(_) => return None,
    }
    let code: u16 = code.parse().ok()?;
    (100..=999).contains(&code).then_some(code)
}

/// The request we send.
pub fn request(url: &HttpUrl) -> String {
    format!(
        "GET {} HTTP/1.1\r\nHost: {}\r\nUser-Agent: meshgate-wait/{}\r\nAccept: */*\r\n\
         Connection: close\r\n\r\n",
        url.path,
        url.host,
        env!("CARGO_PKG_VERSION")
    )
}

/// One GET; `Ok` on a 2xx status, else why not. Each step (connect, write, read) is bounded
/// by `timeout`.
pub fn probe(url: &HttpUrl, timeout: Duration) -> Result<(), String> {
    let mut stream = TcpStream::connect_timeout(&url.addr, timeout)
        .map_err(|e| format!("connect to {} failed: {e}", url.addr))?;
    stream
        .set_read_timeout(Some(timeout))
        .and_then(|()| stream.set_write_timeout(Some(timeout)))
        .and_then(|()| stream.set_nodelay(true))
        .map_err(|e| format!("socket setup failed: {e}"))?;
    stream
        .write_all(request(url).as_bytes())
        .map_err(|e| format!("sending the request failed: {e}"))?;
    let mut buf = Vec::with_capacity(512);
    let mut chunk = [0u8; 512];
    loop {
        if let Some(end) = buf.iter().position(|&b| b == b'\n') {
            let line = String::from_utf8_lossy(&buf[..=end]);
            return match parse_status_line(&line) {
                Some(code) if (200..300).contains(&code) => Ok(()),
                Some(code) => Err(format!("status {code}")),
                None => Err("invalid HTTP status line".to_string()),
            };
        }
        if buf.len() >= MAX_STATUS_LINE {
            return Err("invalid HTTP status line".to_string());
        }
        match stream.read(&mut chunk) {
            Ok(0) if buf.is_empty() => return Err("connection closed without a response".into()),
            Ok(0) => return Err("invalid HTTP status line".to_string()),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(format!("no response: {e}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn url(text: &str) -> HttpUrl {
        parse_url(text).unwrap()
    }

    #[test]
    fn parses_ipv4_urls() {
        let u = url("http://127.0.0.1:15021/healthz/ready");
        assert_eq!(u.addr, "127.0.0.1:15021".parse().unwrap());
        assert_eq!(u.host, "127.0.0.1:15021");
        assert_eq!(u.path, "/healthz/ready");
        assert_eq!(u.to_string(), "http://127.0.0.1:15021/healthz/ready");

        let u = url("HTTP://10.0.0.1");
        assert_eq!(u.addr, "10.0.0.1:80".parse().unwrap());
        assert_eq!(u.path, "/");

        let u = url("http://10.0.0.1:8080?x=1#frag");
        assert_eq!(u.path, "/?x=1");
        assert_eq!(u.host, "10.0.0.1:8080");

        let u = url("http://10.0.0.1:8080/a/b?c=d&e#f");
        assert_eq!(u.path, "/a/b?c=d&e");
    }

    #[test]
    fn parses_ipv6_urls() {
        let u = url("http://[::1]:8080/ready");
        assert_eq!(u.addr, "[::1]:8080".parse().unwrap());
        assert_eq!(u.host, "[::1]:8080");
        assert_eq!(u.path, "/ready");
        let u = url("http://[fd00::5]/");
        assert_eq!(u.addr, "[fd00::5]:80".parse().unwrap());
    }

    #[test]
    fn rejects_bad_urls() {
        for (bad, expect) in [
            ("https://127.0.0.1/", "https is not supported"),
            ("ftp://127.0.0.1/", "expected a URL"),
            ("127.0.0.1:80/", "expected a URL"),
            ("http://localhost:8080/", "no DNS resolution"),
            ("http://example.com/", "no DNS resolution"),
            ("http://1.2.3/", "no DNS resolution"),
            ("http://:80/", "missing host"),
            ("http:///x", "missing host"),
            ("http://127.0.0.1:0/", "invalid port"),
            ("http://127.0.0.1:65536/", "invalid port"),
            ("http://127.0.0.1:/", "invalid port"),
            ("http://127.0.0.1:x/", "invalid port"),
            ("http://[::1/", "missing ']'"),
            ("http://[::1]x/", "unexpected"),
            ("http://[nope]:80/", "not an IPv6 address"),
            ("http://[fe80::1%eth0]:80/", "not an IPv6 address"),
            ("http://::1:80/", "no DNS resolution"),
            ("http://u:p@127.0.0.1/", "user info"),
            ("http://127.0.0.1/a b", "spaces"),
            ("http://127.0.0.1/a\r\nX: y", "spaces"),
        ] {
            let err = parse_url(bad).expect_err(bad);
            assert!(err.contains(expect), "{bad}: {err}");
        }
    }

    #[test]
    fn parses_status_lines() {
        assert_eq!(parse_status_line("HTTP/1.1 200 OK\r\n"), Some(200));
        assert_eq!(parse_status_line("HTTP/1.0 204 No Content"), Some(204));
        assert_eq!(
            parse_status_line("HTTP/1.1 503 Service Unavailable\n"),
            Some(503)
        );
        assert_eq!(parse_status_line("HTTP/1.1 200\r\n"), Some(200));
        assert_eq!(parse_status_line("HTTP/2 301 Moved"), Some(301));
        assert_eq!(parse_status_line("HTTP/1.1 404 "), Some(404));
    }

    #[test]
    fn rejects_bad_status_lines() {
        for bad in [
            "",
            "\r\n",
            "HTTP/1.1",
            "HTTP/1.1 ",
            "HTTP/1.1 20",
            "HTTP/1.1 2000 OK",
            "HTTP/1.1 abc OK",
            "HTTP/1.1 099 X",
            "HTTP/ 200 OK",
            "HTTP/1.x 200 OK",
            "http/1.1 200 OK",
            "SSH-2.0-OpenSSH_9.6",
            "HTTP/1.1 2\u{e9}0 OK",
            "HTTP/1.1 20\u{e9} OK",
        ] {
            assert_eq!(parse_status_line(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn builds_request() {
        let req = request(&url("http://[::1]:8080/ready?x=1"));
        assert!(req.starts_with("GET /ready?x=1 HTTP/1.1\r\nHost: [::1]:8080\r\n"));
        assert!(req.contains("\r\nConnection: close\r\n"));
        assert!(req.ends_with("\r\n\r\n"));
    }
}
