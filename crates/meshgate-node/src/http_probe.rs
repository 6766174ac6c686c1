//! The readiness URLs: plain `http://IP[:PORT][/path]`, no DNS, one `GET` with
//! `Connection: close`, bounded by [`crate::PROBE_TIMEOUT`]; only the status line is read.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The most read while looking for the status line.
const MAX_STATUS_LINE: usize = 8 * 1024;

/// The URLs and status lines are `meshgate-wait`'s (`--http`): one parser for both.
pub use meshgate_wait::http::{HttpUrl, parse_url};

/// The status code of a status line (`HTTP/1.1 200 OK`).
fn parse_status_line(line: &[u8]) -> Option<u16> {
    meshgate_wait::http::parse_status_line(std::str::from_utf8(line).ok()?)
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
