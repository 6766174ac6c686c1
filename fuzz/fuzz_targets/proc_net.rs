//! Arbitrary bytes as `/proc/net/tcp{,6}` text through meshgate-wait's parser.
//!
//! Asserts: parsing never panics (the probe reads the file lossily as UTF-8, as here); every
//! socket a line yields survives a round trip through the canonical line format; `has_listener`
//! agrees with the parsed table.
#![no_main]

use std::net::IpAddr;

use libfuzzer_sys::fuzz_target;
use meshgate_wait::proc_net::{TCP_LISTEN, TcpSocket, has_listener, parse_line, parse_table};

/// The kernel's format of a socket's first fields (addresses as host-order hex words).
fn canonical(s: &TcpSocket) -> String {
    let addr: String = match s.local_addr {
        IpAddr::V4(a) => format!("{:08X}", u32::from_ne_bytes(a.octets())),
        IpAddr::V6(a) => a
            .octets()
            .chunks_exact(4)
            .map(|c| format!("{:08X}", u32::from_ne_bytes([c[0], c[1], c[2], c[3]])))
            .collect(),
    };
    format!(
        "   0: {addr}:{:04X} 00000000:0000 {:02X} 00000000:00000000 00:00000000 00000000     0        0 1 1",
        s.local_port, s.state
    )
}

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let sockets: Vec<TcpSocket> = parse_table(&text).collect();
    for s in &sockets {
        assert_eq!(parse_line(&canonical(s)), Some(*s), "round trip of {s:?}");
    }
    // Ports of the table and a few fixed ones.
    let mut ports: Vec<u16> = sockets.iter().map(|s| s.local_port).collect();
    ports.extend([0, 15008, 15001, u16::MAX]);
    for port in ports {
        let expected = sockets
            .iter()
            .any(|s| s.state == TCP_LISTEN && s.local_port == port);
        assert_eq!(has_listener(&text, port), expected, "port {port}");
    }
});
