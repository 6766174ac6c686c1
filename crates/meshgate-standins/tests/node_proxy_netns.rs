//! `mesh-node-proxy` for real: a pod-like network namespace (held by a process named like a
//! sandbox) gets its listeners once the proxy is ready, and meshgate's ambient gate
//! (`meshgate-wait --tcp-listening 15008`) inside that namespace passes; before, it times out.
//!
//! Needs root, `unshare`, `nsenter`, `setpriv`. Without them the test FAILS saying what is
//! missing, unless `MESHGATE_SKIP_NETNS=1` is set.

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
    let netns = format!("/proc/{}/ns/net", sandbox.0.id());
    let own = std::fs::read_link("/proc/self/ns/net").expect("own netns");
    for _ in 0..200 {
        if std::fs::read_link(&netns).is_ok_and(|n| n != own) {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let run_gate = |timeout: &str| {
        let out = Command::new("nsenter")
            .arg(format!("--net={netns}"))
            .args([
                "setpriv",
                "--reuid",
                "65532",
                "--regid",
                "65532",
                "--clear-groups",
            ])
            .arg(&gate)
            .args(["--tcp-listening", "15008", "--timeout", timeout])
            .output()
            .expect("gate ran");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        )
    };
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
