//! `mesh-node-proxy` for real: a pod-like network namespace (held by a process named like a
//! sandbox) gets its listeners once the proxy is ready, and meshgate's ambient gate
//! (`meshgate-wait --tcp-listening 15008`) inside that namespace passes; before, it times out.
//!
//! Needs root, `unshare`, `nsenter`, `setpriv`. Without them the test FAILS saying what is
//! missing, unless `MESHGATE_SKIP_NETNS=1` is set.

mod common;

use std::process::{Child, Command};

const PROXY: &str = env!("CARGO_BIN_EXE_mesh-node-proxy");

struct Kill(Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn skip() -> bool {
    let root = std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines()
            .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(2) == Some("0"))
    });
    let tools = ["unshare", "nsenter", "setpriv"].iter().all(|t| {
        ["/usr/sbin", "/usr/bin", "/sbin", "/bin"]
            .iter()
            .any(|d| std::path::Path::new(d).join(t).exists())
    });
    if root && tools {
        return false;
    }
    if std::env::var_os("MESHGATE_SKIP_NETNS").is_some_and(|v| v == "1") {
        eprintln!("skipping: needs root, unshare, nsenter and setpriv (MESHGATE_SKIP_NETNS=1)");
        return true;
    }
    panic!(
        "the network namespace test needs root, unshare, nsenter and setpriv; set MESHGATE_SKIP_NETNS=1 to skip it"
    );
}

/// Runs meshgate's ambient gate (`--tcp-listening 15008`) in the network namespace `netns` as a
/// non-root uid; its exit code and its line.
fn run_gate(gate: &std::path::Path, netns: &str, timeout: &str) -> (Option<i32>, String) {
    common::gate_in_netns(
        gate,
        netns,
        &["--tcp-listening", "15008", "--timeout", timeout],
    )
}

/// The network namespace of `pid` once it is no longer this process's (unshare has entered
/// its own).
fn netns_of(pid: u32) -> String {
    let netns = format!("/proc/{pid}/ns/net");
    let own = std::fs::read_link("/proc/self/ns/net").expect("own netns");
    for _ in 0..200 {
        if std::fs::read_link(&netns).is_ok_and(|n| n != own) {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    netns
}

fn meshgate_wait() -> std::path::PathBuf {
    meshgate_testenv::workspace_binary("meshgate-wait", "meshgate-wait")
}

#[test]
fn the_node_proxy_listens_inside_pods_once_ready() {
    if skip() {
        return;
    }
    let gate = meshgate_wait();
    // A sandbox-like process in a network namespace of its own, named uniquely.
    let comm = format!("sbx{}", std::process::id() % 100_000);
    let holder = std::env::temp_dir().join(&comm);
    std::fs::copy("/bin/sleep", &holder).expect("copy sleep");
    let sandbox = Kill(
        Command::new("unshare")
            .args(["--net", "--"])
            .arg(&holder)
            .arg("60")
            .spawn()
            .expect("unshare"),
    );
    let netns = netns_of(sandbox.0.id());
    let run_gate = |timeout: &str| run_gate(&gate, &netns, timeout);
    // No node proxy yet: nothing listens in the pod.
    let (code, line) = run_gate("1s");
    assert_eq!(code, Some(1), "{line}");
    assert!(line.contains("tcp-listening 15008"), "{line}");

    let ready = std::env::temp_dir().join(format!("mesh-node-proxy-ready-{}", std::process::id()));
    let _proxy = Kill(
        Command::new(PROXY)
            .args([
                "--ready-delay",
                "0.5",
                "--sandbox-comm",
                &comm,
                "--ready-file",
            ])
            .arg(&ready)
            .spawn()
            .expect("mesh-node-proxy"),
    );
    // The gate, started before the proxy is ready, holds until the listener exists.
    let (code, line) = run_gate("10s");
    assert_eq!(code, Some(0), "{line}");
    assert!(
        line.starts_with("meshgate-wait: ready after ") && line.contains("tcp-listening 15008"),
        "{line}"
    );
    assert!(
        Command::new(PROXY)
            .arg("--check-ready")
            .arg(&ready)
            .status()
            .expect("check")
            .success(),
        "ready file written"
    );
    let _ = std::fs::remove_file(&ready);
    let _ = std::fs::remove_file(&holder);
}

/// The test plays Istio's node agent on a ZDS socket (`meshgate_standins::zds`): the node proxy
/// connects and says hello; the pod handed over with its network namespace gets the listeners
/// (meshgate's gate passes inside it) and readiness follows the snapshot; after `del` is acked
/// they are closed (the gate times out again).
#[test]
fn fed_over_zds_the_node_proxy_listens_in_exactly_the_pods_handed_to_it() {
    use meshgate_standins::zds::{
        AddWorkload, DelWorkload, Request, Response, SnapshotSent, WorkloadInfo, WorkloadRequest,
        WorkloadResponse,
    };
    use prost::Message as _;
    use rustix::net::{
        AddressFamily, SendAncillaryBuffer, SendAncillaryMessage, SendFlags, SocketAddrUnix,
        SocketType,
    };
    use std::os::fd::AsFd;
    if skip() {
        return;
    }
    let gate = meshgate_wait();
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("ztunnel.sock");
    let server =
        rustix::net::socket(AddressFamily::UNIX, SocketType::SEQPACKET, None).expect("socket");
    rustix::net::bind(&server, &SocketAddrUnix::new(&path).expect("address")).expect("bind");
    rustix::net::listen(&server, 1).expect("listen");
    // The healthz port, in a network namespace of the proxy's own (a pod's, as in Istio).
    let proxy_ns = Kill(
        Command::new("unshare")
            .args(["--net", "--", "sleep", "60"])
            .spawn()
            .expect("unshare"),
    );
    let sandbox = Kill(
        Command::new("unshare")
            .args(["--net", "--", "sleep", "60"])
            .spawn()
            .expect("unshare"),
    );
    let proxy_netns = netns_of(proxy_ns.0.id());
    let netns = netns_of(sandbox.0.id());
    let _proxy = Kill(
        Command::new("nsenter")
            .arg(format!("--net={proxy_netns}"))
            .args(["ip", "link", "set", "lo", "up"])
            .status()
            .ok()
            .and_then(|_| {
                Command::new("nsenter")
                    .arg(format!("--net={proxy_netns}"))
                    .arg(PROXY)
                    .arg("--zds")
                    .arg(&path)
                    .args(["--healthz", "15021"])
                    .spawn()
                    .ok()
            })
            .expect("mesh-node-proxy"),
    );
    let healthz = || {
        Command::new("nsenter")
            .arg(format!("--net={proxy_netns}"))
            .args(["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/15021 && printf 'GET /healthz/ready HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n' >&3 && head -1 <&3"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
            .unwrap_or_default()
    };
    let run_gate = |timeout: &str| run_gate(&gate, &netns, timeout);

    let conn = rustix::net::accept(&server).expect("the node proxy connects");
    let mut buf = [0u8; 1024];
    let n = rustix::net::recv(&conn, &mut buf, rustix::net::RecvFlags::empty())
        .expect("hello")
        .0;
    assert_eq!(&buf[..n], [0x08, 0x01], "a bare ZdsHello{{version: V1}}");
    let mut exchange = |request: Request, fd: Option<&std::fs::File>| -> String {
        let bytes = WorkloadRequest {
            payload: Some(request),
        }
        .encode_to_vec();
        let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        let fds;
        if let Some(f) = fd {
            fds = [f.as_fd()];
            assert!(control.push(SendAncillaryMessage::ScmRights(&fds)));
        }
        rustix::net::sendmsg(
            &conn,
            &[std::io::IoSlice::new(&bytes)],
            &mut control,
            SendFlags::empty(),
        )
        .expect("send");
        let n = rustix::net::recv(&conn, &mut buf, rustix::net::RecvFlags::empty())
            .expect("an ack")
            .0;
        match WorkloadResponse::decode(&buf[..n])
            .expect("a response")
            .payload
        {
            Some(Response::Ack(a)) => a.error,
            None => panic!("no ack"),
        }
    };
    // Connected, snapshot not sent: not ready; nothing listens in the pod.
    assert!(healthz().contains("503"), "{}", healthz());
    assert_eq!(exchange(Request::SnapshotSent(SnapshotSent {}), None), "");
    assert!(
        healthz().contains("200"),
        "ready once the snapshot came: {}",
        healthz()
    );
    let (code, line) = run_gate("1s");
    assert_eq!(code, Some(1), "nothing handed over yet: {line}");

    let ns_file = std::fs::File::open(&netns).expect("the pod's netns");
    let add = Request::Add(AddWorkload {
        uid: "uid-1".into(),
        workload_info: Some(WorkloadInfo {
            name: "app".into(),
            namespace: "mesh".into(),
            service_account: "default".into(),
        }),
    });
    assert_eq!(
        exchange(add.clone(), None),
        "failure to read message : No control message"
    );
    assert_eq!(exchange(add, Some(&ns_file)), "", "acked");
    let (code, line) = run_gate("5s");
    assert_eq!(code, Some(0), "{line}");

    assert_eq!(
        exchange(
            Request::Del(DelWorkload {
                uid: "uid-1".into()
            }),
            None
        ),
        ""
    );
    // The ack of `del` comes after the listeners are closed.
    let (code, line) = run_gate("1s");
    assert_eq!(code, Some(1), "closed after del: {line}");
}
