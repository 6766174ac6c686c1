//! The stand-ins' HTTP answers (readiness and status ports): one request, one status line.

use std::io::{Read, Write};
use std::net::TcpStream;

/// Reads one request's head and answers `status` (`200 OK`, `503 Service Unavailable`) with an
/// empty body, then closes.
pub fn answer(mut stream: TcpStream, status: &str) {
    let _ = stream.set_read_timeout(Some(std::time::Duration::from_secs(5)));
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 64 * 1024 {
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    let _ = write!(
        stream,
        "HTTP/1.1 {status}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    );
}
