//! `mesh-cni` for real: the runtime's call (`CNI_COMMAND=ADD`, `CNI_NETNS`, `CNI_ARGS`, the
//! network config on stdin) against a private network namespace, then meshgate's gate
//! (`meshgate-wait --redirect-check`) inside that namespace as a non-root uid: it passes where the
//! plugin installed its redirect, and times out (exit 1) in a namespace the plugin leaves alone.
//!
//! Needs root, `unshare`, `nsenter`, `setpriv`, `ip` and `iptables-restore`. Without them the test
//! FAILS saying what is missing, unless `MESHGATE_SKIP_NETNS=1` is set.

mod common;

use std::io::Write;
use std::process::{Child, Command, Stdio};

const PLUGIN: &str = env!("CARGO_BIN_EXE_mesh-cni");

/// A private network namespace held open by a sleeping process; killed on drop.
struct Netns(Child);

impl Netns {
    fn new() -> Self {
        let child = Command::new("unshare")
            .args(["--net", "--", "sleep", "60"])
            .spawn()
            .expect("unshare --net");
        // Wait until the child is in its own namespace.
        let own = std::fs::read_link("/proc/self/ns/net").expect("own netns");
        let path = format!("/proc/{}/ns/net", child.id());
        for _ in 0..200 {
            if std::fs::read_link(&path).is_ok_and(|ns| ns != own) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let ns = Netns(child);
        ns.run(
            "ip link set lo up && \
             { ip link add eth0 type dummy 2>/dev/null || \
               { ip link add eth0 type veth peer name eth0-peer && ip link set eth0-peer up; }; } && \
             ip addr add 10.250.0.2/24 dev eth0 && ip link set eth0 up && ip route add default dev eth0",
        );
        ns
    }

    fn path(&self) -> String {
        format!("/proc/{}/ns/net", self.0.id())
    }

    fn run(&self, script: &str) {
        let out = Command::new("nsenter")
            .arg(format!("--net={}", self.path()))
            .args(["sh", "-c", script])
            .output()
            .expect("nsenter");
        assert!(
            out.status.success(),
            "{script}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn prerequisites() -> Result<(), String> {
    let status = std::fs::read_to_string("/proc/self/status").map_err(|e| e.to_string())?;
    if !status
        .lines()
        .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(2) == Some("0"))
    {
        return Err("not running as root".into());
    }
    for tool in ["unshare", "nsenter", "setpriv", "ip", "iptables-restore"] {
        let found = ["/usr/sbin", "/usr/bin", "/sbin", "/bin"]
            .iter()
            .any(|d| std::path::Path::new(d).join(tool).exists());
        if !found {
            return Err(format!("{tool} is missing"));
        }
    }
    Ok(())
}

fn skip() -> bool {
    if let Err(why) = prerequisites() {
        if std::env::var_os("MESHGATE_SKIP_NETNS").is_some_and(|v| v == "1") {
            eprintln!("skipping: {why} (MESHGATE_SKIP_NETNS=1)");
            return true;
        }
        panic!(
            "cannot run the network namespace test: {why}; set MESHGATE_SKIP_NETNS=1 to skip it"
        );
    }
    false
}

/// Runs the plugin as a runtime does.
fn plugin(command: &str, netns: &str, namespace: &str, config: &str) -> (bool, serde_json::Value) {
    let mut child = Command::new(PLUGIN)
        .env("CNI_COMMAND", command)
        .env("CNI_CONTAINERID", "c0ffee")
        .env("CNI_NETNS", netns)
        .env("CNI_IFNAME", "eth0")
        .env(
            "CNI_ARGS",
            format!("IgnoreUnknown=1;K8S_POD_NAMESPACE={namespace};K8S_POD_NAME=p"),
        )
        .env("CNI_PATH", "/usr/lib/cni")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("mesh-cni");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(config.as_bytes())
        .expect("config written");
    let out = child.wait_with_output().expect("mesh-cni ran");
    let text = String::from_utf8_lossy(&out.stdout);
    let json = if text.trim().is_empty() {
        serde_json::Value::Null
    } else {
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text}: {e}"))
    };
    (out.status.success(), json)
}

/// meshgate's gate, built for this workspace (target/<profile>/meshgate-wait).
fn meshgate_wait() -> std::path::PathBuf {
    let bin = meshgate_testenv::workspace_binary("meshgate-wait", "meshgate-wait");
    // Readable by the gate's non-root uid.
    let copy = std::env::temp_dir().join(format!("mesh-cni-test-gate-{}", std::process::id()));
    std::fs::copy(&bin, &copy).expect("copy meshgate-wait");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o755)).expect("mode");
    copy
}

/// The gate in the namespace, as uid 65532: its exit code and its line.
fn gate(ns: &Netns, bin: &std::path::Path, timeout: &str) -> (Option<i32>, String) {
    common::gate_in_netns(
        bin,
        &ns.path(),
        &[
            "--redirect-check",
            "15001",
            "--redirect-target",
            "192.0.2.1:80",
            "--timeout",
            timeout,
        ],
    )
}

const CONFIG: &str = r#"{"cniVersion":"1.0.0","name":"node","type":"mesh-cni",
    "excludeNamespaces":["kube-system"],
    "prevResult":{"cniVersion":"1.0.0","interfaces":[{"name":"eth0"}],"ips":[{"address":"10.250.0.2/24","interface":0}]}}"#;

#[test]
fn the_plugin_redirects_new_pods_and_the_gate_sees_it() {
    if skip() {
        return;
    }
    let bin = meshgate_wait();
    let prev: serde_json::Value = serde_json::from_str(CONFIG).expect("config");

    // A mesh pod: the plugin passes the previous result on and installs the redirect.
    let pod = Netns::new();
    let (ok, out) = plugin("ADD", &pod.path(), "apps", CONFIG);
    assert!(ok, "{out}");
    assert_eq!(out, prev["prevResult"], "the previous result is passed on");
    let (code, line) = gate(&pod, &bin, "3s");
    assert_eq!(code, Some(0), "{line}");
    assert!(
        line.contains("redirect-check 15001 via 192.0.2.1:80"),
        "{line}"
    );

    // A pod in an excluded namespace: no redirect, the gate times out (exit 1).
    let excluded = Netns::new();
    let (ok, out) = plugin("ADD", &excluded.path(), "kube-system", CONFIG);
    assert!(ok, "{out}");
    let (code, line) = gate(&excluded, &bin, "1s");
    assert_eq!(code, Some(1), "{line}");
    assert!(line.contains("timed out"), "{line}");

    // DEL and CHECK succeed silently; VERSION names what it speaks; bad input is a CNI error.
    assert_eq!(
        plugin("DEL", &pod.path(), "apps", CONFIG),
        (true, serde_json::Value::Null)
    );
    let (ok, v) = plugin("VERSION", "", "", CONFIG);
    assert!(
        ok && v["supportedVersions"]
            .as_array()
            .is_some_and(|a| a.contains(&"1.0.0".into())),
        "{v}"
    );
    let (ok, e) = plugin("ADD", &pod.path(), "apps", "{not json");
    assert!(!ok);
    assert_eq!(e["code"], 6, "{e}");
    let _ = std::fs::remove_file(&bin);
}
