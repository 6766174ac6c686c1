//! Parsing of `/proc/net/tcp` and `/proc/net/tcp6`.
//!
//! A line looks like this (header first, one socket per line after it):
//!
//! ```text
//!   sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
//!    0: 0100007F:3A98 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1234 1 ...
//! ```
//!
//! Addresses are hex words in host byte order, the port is big-endian hex, and `st` is the
//! kernel's TCP state (`0A` = `TCP_LISTEN`). Anything that does not look like that is skipped.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::Path;

/// The kernel's `TCP_LISTEN` state.
pub const TCP_LISTEN: u8 = 0x0A;

/// One socket line of `/proc/net/tcp{,6}`, reduced to what we use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpSocket {
    pub local_addr: IpAddr,
    pub local_port: u16,
    pub state: u8,
}

/// Parses one line; `None` for the header, blank or malformed lines.
pub fn parse_line(line: &str) -> Option<TcpSocket> {
    let mut fields = line.split_ascii_whitespace();
    let slot = fields.next()?.strip_suffix(':')?;
    if slot.is_empty() || !slot.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let (local_addr, local_port) = parse_endpoint(fields.next()?)?;
    parse_endpoint(fields.next()?)?;
    let state = fields.next()?;
    if state.len() != 2 {
        return None;
    }
    let state = u8::from_str_radix(state, 16).ok()?;
    Some(TcpSocket {
        local_addr,
        local_port,
        state,
    })
}

/// Parses `ADDR:PORT` with an 8 (IPv4) or 32 (IPv6) hex digit address and 4 hex digit port.
fn parse_endpoint(text: &str) -> Option<(IpAddr, u16)> {
    let (addr, port) = text.split_once(':')?;
    if port.len() != 4 || !port.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let port = u16::from_str_radix(port, 16).ok()?;
    if !addr.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let addr = match addr.len() {
        8 => IpAddr::V4(Ipv4Addr::from(hex_word(addr)?.to_ne_bytes())),
        32 => {
            let mut bytes = [0u8; 16];
            for (i, chunk) in bytes.chunks_exact_mut(4).enumerate() {
                let word = hex_word(addr.get(i * 8..i * 8 + 8)?)?;
                chunk.copy_from_slice(&word.to_ne_bytes());
            }
            IpAddr::V6(Ipv6Addr::from(bytes))
        }
        _ => return None,
    };
    Some((addr, port))
}

fn hex_word(text: &str) -> Option<u32> {
    u32::from_str_radix(text, 16).ok()
}

/// Every well-formed socket line of a table; other lines are skipped.
pub fn parse_table(text: &str) -> impl Iterator<Item = TcpSocket> + '_ {
    text.lines().filter_map(parse_line)
}

/// Whether the table has a socket in LISTEN state on local `port` (any local address).
pub fn has_listener(text: &str, port: u16) -> bool {
    parse_table(text).any(|s| s.state == TCP_LISTEN && s.local_port == port)
}

/// Checks `<proc_root>/net/tcp` and `<proc_root>/net/tcp6` for a listener on `port`.
/// A missing `tcp6` (IPv6 disabled) is fine; an error only if no table could be read.
pub fn probe_listening(proc_root: &Path, port: u16) -> Result<(), String> {
    let mut errors = Vec::new();
    let mut read_any = false;
    for name in ["tcp", "tcp6"] {
        let path = proc_root.join("net").join(name);
        match std::fs::read(&path) {
            Ok(bytes) => {
                read_any = true;
                if has_listener(&String::from_utf8_lossy(&bytes), port) {
                    return Ok(());
                }
            }
            Err(e) => errors.push(format!("cannot read {}: {e}", path.display())),
        }
    }
    if read_any {
        Err("no socket listening".to_string())
    } else {
        Err(errors.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Captured from a real pod network namespace (x86_64, little-endian), plus noise.
    const TCP: &str = "\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000:3AA0 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1337        0 81234 1 0000000000000000 100 0 0 10 0
   1: 0100007F:3AA8 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1337        0 81235 1 0000000000000000 100 0 0 10 0
   2: 0A00F40A:1F90 0B00F40A:C350 01 00000000:00000000 00:00000000 00000000     0        0 81290 1 0000000000000000 20 4 30 10 -1
   3: 0100007F:9C40 0100007F:3AA8 06 00000000:00000000 03:00000F3D 00000000     0        0 0 3 0000000000000000
this line is garbage
   4: 0100007F:ZZZZ 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1
   5: 0100007F:3A9 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1
   6: 0100007F:3A99
   x: 0100007F:3A9A 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1
   7: 0100007F:3A9B 00000000:0000 A 00000000:00000000 00:00000000 00000000     0        0 1 1

   8: 00007F:3A9C 00000000:0000 0A
";

    const TCP6: &str = "\
  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000000000000:3A98 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 91234 1 0000000000000000 100 0 0 10 0
   1: 00000000000000000000000001000000:1F91 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 91235 1 0000000000000000 100 0 0 10 0
   2: 0000000000000000FFFF00000100007F:1F92 0000000000000000FFFF00000100007F:D431 01 00000000:00000000 00:00000000 00000000     0        0 91240 1 0000000000000000 20 4 30 10 -1
   3: 0000000000000000000000000100000:1F93 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1
";

    // The fixtures were captured on a little-endian machine.
    #[cfg(target_endian = "little")]
    #[test]
    fn parses_ipv4_lines() {
        let sockets: Vec<_> = parse_table(TCP).collect();
        assert_eq!(
            sockets,
            vec![
                TcpSocket {
                    local_addr: IpAddr::V4(Ipv4Addr::UNSPECIFIED),
                    local_port: 15008,
                    state: TCP_LISTEN,
                },
                TcpSocket {
                    local_addr: IpAddr::V4(Ipv4Addr::LOCALHOST),
                    local_port: 15016,
                    state: TCP_LISTEN,
                },
                TcpSocket {
                    local_addr: IpAddr::V4(Ipv4Addr::new(10, 244, 0, 10)),
                    local_port: 8080,
                    state: 0x01,
                },
                TcpSocket {
                    local_addr: IpAddr::V4(Ipv4Addr::LOCALHOST),
                    local_port: 40000,
                    state: 0x06,
                },
            ]
        );
    }

    #[cfg(target_endian = "little")]
    #[test]
    fn parses_ipv6_lines() {
        let sockets: Vec<_> = parse_table(TCP6).collect();
        assert_eq!(sockets.len(), 3, "the short address line is skipped");
        assert_eq!(sockets[0].local_addr, IpAddr::V6(Ipv6Addr::UNSPECIFIED));
        assert_eq!(sockets[0].local_port, 15000);
        assert_eq!(sockets[1].local_addr, IpAddr::V6(Ipv6Addr::LOCALHOST));
        assert_eq!(sockets[1].local_port, 8081);
        assert_eq!(
            sockets[2].local_addr,
            IpAddr::V6(Ipv4Addr::LOCALHOST.to_ipv6_mapped())
        );
        assert_eq!(sockets[2].state, 0x01);
    }

    #[test]
    fn finds_only_listening_ports() {
        assert!(has_listener(TCP, 15008));
        assert!(has_listener(TCP, 15016));
        assert!(!has_listener(TCP, 8080), "ESTABLISHED is not LISTEN");
        assert!(!has_listener(TCP, 40000), "TIME_WAIT is not LISTEN");
        assert!(!has_listener(TCP, 0x3A99), "malformed line must not count");
        assert!(!has_listener(TCP, 0x3A9A), "malformed slot must not count");
        assert!(!has_listener(TCP, 15006));
        assert!(has_listener(TCP6, 15000));
        assert!(has_listener(TCP6, 8081));
        assert!(!has_listener(TCP6, 8082));
        assert!(!has_listener(TCP6, 8083));
    }

    #[test]
    fn header_and_garbage_never_panic() {
        for text in [
            "",
            "\n\n",
            "  sl  local_address rem_address   st",
            ":",
            "0:",
            "0: :",
            "0: 0100007F: 00000000:0000 0A",
            "0: 0100007F:3A98 00000000:0000 0A",
            "0: \u{e9}\u{e9}\u{e9}\u{e9}\u{e9}\u{e9}\u{e9}\u{e9}:3A98 00000000:0000 0A",
            "0: 0100007F:3A98 00000000:0000 0A0",
            "0: 0100007F:3A98 00000000:0000 \u{e9}",
            "0: 0100007F:+A98 00000000:0000 0A",
            "0: +100007F:3A98 00000000:0000 0A",
            "99999999999999999999999: 0100007F:3A98 00000000:0000 0A",
        ] {
            let _ = parse_table(text).count();
        }
        assert_eq!(
            parse_line("0: 0100007F:3A98 00000000:0000 0A").map(|s| s.local_port),
            Some(15000),
            "trailing fields are optional"
        );
        assert_eq!(parse_line("0: 0100007F:+A98 00000000:0000 0A"), None);
        assert_eq!(parse_line("0: +100007F:3A98 00000000:0000 0A"), None);
    }

    #[test]
    fn probe_reads_fixture_root() {
        let root = std::env::temp_dir().join(format!("meshgate-wait-proc-{}", std::process::id()));
        let net = root.join("net");
        std::fs::create_dir_all(&net).unwrap();
        assert!(
            probe_listening(&root, 15008)
                .unwrap_err()
                .contains("cannot read")
        );
        std::fs::write(net.join("tcp"), TCP).unwrap();
        assert_eq!(probe_listening(&root, 15008), Ok(()));
        assert_eq!(
            probe_listening(&root, 8081),
            Err("no socket listening".to_string()),
            "tcp6 missing is fine"
        );
        std::fs::write(net.join("tcp6"), TCP6).unwrap();
        assert_eq!(probe_listening(&root, 8081), Ok(()));
        std::fs::remove_dir_all(&root).unwrap();
    }
}
