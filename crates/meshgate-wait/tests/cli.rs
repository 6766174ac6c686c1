//! Runs the real `meshgate-wait` binary. All traffic stays on 127.0.0.1.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::thread;
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_meshgate-wait");

fn run(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env_remove("MESHGATE_WAIT_PROC")
        .output()
        .expect("run meshgate-wait")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The single log line a wait prints.
fn log_line(out: &Output) -> String {
    let text = stderr(out);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 1, "exactly one stderr line, got {text:?}");
    assert!(out.stdout.is_empty(), "nothing on stdout");
    lines[0].to_string()
}

/// A port that was free a moment ago.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("bind 127.0.0.1:0")
        .local_addr()
        .expect("local address")
        .port()
}

/// A fresh empty directory for this test.
fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("meshgate-wait-cli-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create temp dir");
    dir
}

#[test]
fn help_and_version() {
    let out = run(&["--help"]);
    assert_eq!(out.status.code(), Some(0));
    let help = String::from_utf8(out.stdout).unwrap();
    for needle in [
        "--tcp-listening",
        "--redirect-check",
        "--redirect-target",
        "--unix-socket",
        "--file",
        "--http",
        "--timeout",
        "--interval",
        "[2001:db8::1]:80",
        "not checked",
        "Exit status",
        "0  ready",
        "1  timed out",
        "2  bad usage",
    ] {
        assert!(help.contains(needle), "help lacks {needle:?}");
    }
    let out = run(&["--version"]);
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(
        String::from_utf8(out.stdout).unwrap(),
        format!("meshgate-wait {}\n", env!("CARGO_PKG_VERSION"))
    );
}

#[test]
fn bad_usage_exits_2() {
    for (args, expect) in [
        (&[][..], "nothing to wait for"),
        (&["--frobnicate"][..], "unknown option '--frobnicate'"),
        (
            &["--tcp-listening", "99999"][..],
            "invalid value '99999' for --tcp-listening",
        ),
        (
            &["--http", "http://localhost:8080/"][..],
            "no DNS resolution",
        ),
        (
            &["--file", "/x", "--timeout", "forever"][..],
            "invalid value 'forever' for --timeout",
        ),
        (&["--file"][..], "--file needs a value"),
        (
            &[
                "--redirect-check",
                "15001",
                "--redirect-target",
                "192.0.2.1:80",
                "--redirect-target",
                "198.51.100.1:80",
            ][..],
            "a second IPv4 target",
        ),
    ] {
        let out = run(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        let err = stderr(&out);
        assert!(err.starts_with("meshgate-wait: error: "), "{err}");
        assert!(err.contains(expect), "{args:?}: {err}");
        assert!(err.contains("--help"), "hint missing: {err}");
    }
}

#[test]
fn tcp_listening_ready() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port().to_string();
    let out = run(&["--tcp-listening", &port, "--timeout", "10s"]);
    let line = log_line(&out);
    assert_eq!(out.status.code(), Some(0), "{line}");
    assert!(line.starts_with("meshgate-wait: ready after "), "{line}");
    assert!(line.ends_with(&format!(": tcp-listening {port}")), "{line}");
}

#[test]
fn tcp_listening_ipv6_ready() {
    // Skipped where IPv6 is disabled.
    let Ok(listener) = TcpListener::bind("[::1]:0") else {
        return;
    };
    let port = listener.local_addr().unwrap().port().to_string();
    let out = run(&["--tcp-listening", &port, "--timeout", "10s"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
}

#[test]
fn tcp_listening_times_out() {
    let port = free_port().to_string();
    let out = run(&["--tcp-listening", &port, "--timeout", "300ms"]);
    let line = log_line(&out);
    assert_eq!(out.status.code(), Some(1), "{line}");
    assert!(
        line.starts_with("meshgate-wait: timed out after "),
        "{line}"
    );
    assert!(
        line.ends_with(&format!(
            ": not ready: tcp-listening {port} (no socket listening)"
        )),
        "{line}"
    );
}

#[test]
fn tcp_listening_reads_proc_fixture() {
    let root = temp_dir("proc");
    std::fs::create_dir_all(root.join("net")).unwrap();
    std::fs::write(
        root.join("net/tcp"),
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
         \x20  0: 00000000:3AA0 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1337        0 81234 1 0000000000000000 100 0 0 10 0\n\
         garbage\n",
    )
    .unwrap();
    let run_with_root = |port: &str| {
        Command::new(BIN)
            .args(["--tcp-listening", port, "--timeout", "200ms"])
            .env("MESHGATE_WAIT_PROC", &root)
            .output()
            .unwrap()
    };
    let out = run_with_root("15008");
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let out = run_with_root("15009");
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn file_created_mid_wait() {
    let dir = temp_dir("file");
    let file = dir.join("ready");
    let child = Command::new(BIN)
        .args(["--file", file.to_str().unwrap(), "--timeout", "10s"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    thread::sleep(Duration::from_millis(200));
    let created = Instant::now();
    std::fs::write(&file, b"ok").unwrap();
    let out = child.wait_with_output().unwrap();
    let reaction = created.elapsed();
    let line = log_line(&out);
    assert_eq!(out.status.code(), Some(0), "{line}");
    assert!(
        line.ends_with(&format!(": file {}", file.display())),
        "{line}"
    );
    // Only a sanity bound; the real reaction is milliseconds.
    assert!(reaction < Duration::from_secs(9), "took {reaction:?}");
    eprintln!("file reaction: {reaction:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn file_in_missing_directory_times_out() {
    let out = run(&[
        "--file",
        "/nonexistent-meshgate-wait/dir/file",
        "--timeout",
        "200ms",
    ]);
    let line = log_line(&out);
    assert_eq!(out.status.code(), Some(1), "{line}");
    assert!(
        line.ends_with("not ready: file /nonexistent-meshgate-wait/dir/file (does not exist)"),
        "{line}"
    );
}

#[test]
fn unix_socket() {
    let dir = temp_dir("unix");
    let path = dir.join("agent.sock");
    let path_str = path.to_str().unwrap();

    let out = run(&["--unix-socket", path_str, "--timeout", "200ms"]);
    let line = log_line(&out);
    assert_eq!(out.status.code(), Some(1), "{line}");
    assert!(
        line.contains(&format!("unix-socket {path_str} (connect failed: ")),
        "{line}"
    );

    let _listener = UnixListener::bind(&path).unwrap();
    let out = run(&["--unix-socket", path_str, "--timeout", "10s"]);
    let line = log_line(&out);
    assert_eq!(out.status.code(), Some(0), "{line}");
    assert!(
        line.ends_with(&format!(": unix-socket {path_str}")),
        "{line}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A tiny HTTP server answering every request with `status`; returns its port.
fn http_server(status: &'static str) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind HTTP server");
    let port = listener.local_addr().expect("HTTP server address").port();
    thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { continue };
            let mut reader = BufReader::new(stream);
            let mut request_line = String::new();
            let _ = reader.read_line(&mut request_line);
            // Read the headers up to the blank line.
            loop {
                let mut line = String::new();
                match reader.read_line(&mut line) {
                    Ok(0) | Err(_) => break,
                    Ok(_) if line == "\r\n" => break,
                    Ok(_) => {}
                }
            }
            let mut stream: TcpStream = reader.into_inner();
            let body = if request_line.starts_with("GET /ready ") {
                "ok"
            } else {
                "wrong path"
            };
            let _ = write!(
                stream,
                "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    port
}

#[test]
fn http_ready_on_2xx() {
    let port = http_server("204 No Content");
    let url = format!("http://127.0.0.1:{port}/ready");
    let out = run(&["--http", &url, "--timeout", "10s"]);
    let line = log_line(&out);
    assert_eq!(out.status.code(), Some(0), "{line}");
    assert!(line.ends_with(&format!(": http {url}")), "{line}");
}

#[test]
fn http_not_ready_on_503() {
    let port = http_server("503 Service Unavailable");
    let url = format!("http://127.0.0.1:{port}/ready");
    let out = run(&["--http", &url, "--timeout", "300ms"]);
    let line = log_line(&out);
    assert_eq!(out.status.code(), Some(1), "{line}");
    assert!(
        line.ends_with(&format!("not ready: http {url} (status 503)")),
        "{line}"
    );
}

#[test]
fn http_not_ready_when_nothing_listens() {
    let url = format!("http://127.0.0.1:{}/ready", free_port());
    let out = run(&["--http", &url, "--timeout", "300ms"]);
    let line = log_line(&out);
    assert_eq!(out.status.code(), Some(1), "{line}");
    assert!(
        line.contains(&format!("http {url} (connect to 127.0.0.1:")),
        "{line}"
    );
}

#[test]
fn redirect_check_ready_on_loopback() {
    // No iptables here: connecting to our own listener's port stands in for a redirect.
    let port = free_port().to_string();
    let target = format!("127.0.0.1:{port}");
    let out = run(&[
        "--redirect-check",
        &port,
        "--redirect-target",
        &target,
        "--timeout",
        "10s",
    ]);
    let line = log_line(&out);
    assert_eq!(out.status.code(), Some(0), "{line}");
    assert!(
        line.ends_with(&format!(": redirect-check {port} via {target}")),
        "{line}"
    );
    // The listener is closed afterwards, so the proxy can bind the port.
    TcpListener::bind(("127.0.0.1", port.parse::<u16>().unwrap())).expect("port released");
}

#[test]
fn redirect_check_not_ready_on_loopback() {
    let port = free_port().to_string();
    let target = format!("127.0.0.1:{}", free_port());
    let out = run(&[
        "--redirect-check",
        &port,
        "--redirect-target",
        &target,
        "--timeout",
        "300ms",
    ]);
    let line = log_line(&out);
    assert_eq!(out.status.code(), Some(1), "{line}");
    assert!(
        line.contains(&format!(
            "not ready: redirect-check {port} via {target} (connect to {target} failed"
        )),
        "{line}"
    );
}

#[test]
fn combined_checks_name_each_not_ready_one() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let ready_port = listener.local_addr().unwrap().port().to_string();
    let missing_port = free_port().to_string();
    let out = run(&[
        "--tcp-listening",
        &ready_port,
        "--tcp-listening",
        &missing_port,
        "--file",
        "/nonexistent-meshgate-wait",
        "--timeout",
        "300ms",
        "--interval",
        "20ms",
    ]);
    let line = log_line(&out);
    assert_eq!(out.status.code(), Some(1), "{line}");
    assert!(
        line.ends_with(&format!(
            "not ready: tcp-listening {missing_port} (no socket listening); \
             file /nonexistent-meshgate-wait (does not exist)"
        )),
        "{line}"
    );
}

#[test]
fn combined_checks_ready() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port().to_string();
    let out = run(&["--tcp-listening", &port, "--file", "/", "--timeout", "10s"]);
    let line = log_line(&out);
    assert_eq!(out.status.code(), Some(0), "{line}");
    assert!(
        line.ends_with(&format!(": tcp-listening {port}, file /")),
        "{line}"
    );
}

/// Sockets on local `port` in TCP state `state` (hex, e.g. `06` = TIME_WAIT), from
/// `/proc/net/tcp` and `/proc/net/tcp6` of this network namespace.
fn sockets_in_state(port: u16, state: &str) -> Vec<String> {
    let port_hex = format!(":{port:04X}");
    let mut found = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.len() > 3 && fields[1].ends_with(&port_hex) && fields[3] == state {
                found.push(line.trim().to_string());
            }
        }
    }
    found
}

#[test]
fn redirect_check_leaves_no_time_wait_on_the_proxy_port() {
    // The proxy binds PORT right after the gate exits; a TIME_WAIT socket on local PORT
    // would be left by the gate closing the accepted connection first.
    for _ in 0..3 {
        let port = free_port();
        let target = format!("127.0.0.1:{port}");
        let out = run(&[
            "--redirect-check",
            &port.to_string(),
            "--redirect-target",
            &target,
            "--timeout",
            "10s",
        ]);
        let line = log_line(&out);
        assert_eq!(out.status.code(), Some(0), "{line}");
        let time_wait = sockets_in_state(port, "06");
        assert!(
            time_wait.is_empty(),
            "TIME_WAIT on local port {port} after the check: {time_wait:#?}"
        );
    }
}

#[test]
fn redirect_check_not_checked_without_routes() {
    // A procfs root whose route tables have no route out of the pod: nothing is bound or
    // connected, the check passes at once and says why.
    let root = temp_dir("noroutes");
    std::fs::create_dir_all(root.join("net")).unwrap();
    std::fs::write(
        root.join("net/route"),
        "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n",
    )
    .unwrap();
    std::fs::write(
        root.join("net/ipv6_route"),
        "00000000000000000000000000000000 00 00000000000000000000000000000000 00 \
         00000000000000000000000000000000 ffffffff 00000001 00000000 00200200       lo\n",
    )
    .unwrap();
    let port = free_port().to_string();
    let out = Command::new(BIN)
        .args(["--redirect-check", &port, "--timeout", "10s"])
        .env("MESHGATE_WAIT_PROC", &root)
        .output()
        .unwrap();
    let line = log_line(&out);
    assert_eq!(out.status.code(), Some(0), "{line}");
    assert!(
        line.ends_with(&format!(
            ": redirect-check {port} (not checked: no route to 192.0.2.1:80 or \
             [2001:db8::1]:80 in this pod)"
        )),
        "{line}"
    );
    // An unreadable table is retried until the timeout, and named.
    std::fs::remove_file(root.join("net/route")).unwrap();
    let out = Command::new(BIN)
        .args(["--redirect-check", &port, "--timeout", "200ms"])
        .env("MESHGATE_WAIT_PROC", &root)
        .output()
        .unwrap();
    let line = log_line(&out);
    assert_eq!(out.status.code(), Some(1), "{line}");
    assert!(
        line.contains(&format!(
            "not ready: redirect-check {port} via 192.0.2.1:80 or [2001:db8::1]:80 (cannot read "
        )),
        "{line}"
    );
    std::fs::remove_dir_all(&root).unwrap();
}
