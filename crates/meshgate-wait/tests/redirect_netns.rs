//! `--redirect-check` under real iptables, in private network namespaces.
//!
//! Each case runs `unshare --net -- sh -c SCRIPT` as root: a fresh, unnamed network namespace
//! (gone when the shell exits, so nothing is left behind) with `lo` up, an `eth0` (a dummy
//! interface, or one end of a veth pair where the kernel has no dummy driver) carrying the
//! pod's addresses and default routes, and mesh-style `nat` rules modelled on Istio's sidecar
//! rules. The built binary then runs in it as a non-root uid (`setpriv`), as the gate does in a
//! pod. Every gate run is bounded: `--timeout` of at most 3s, and an outer `timeout`.
//!
//! Needs root, `unshare`, `setpriv`, `ip`, `iptables` and `ip6tables`. Without them every case
//! FAILS with a message saying what is missing, unless `MESHGATE_SKIP_NETNS=1` is set, in
//! which case it prints why and passes.

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::Duration;

use meshgate_wait::duration::parse_duration;

const BIN: &str = env!("CARGO_BIN_EXE_meshgate-wait");
/// The proxy's outbound port the rules redirect to.
const PROXY_PORT: u16 = 15001;
/// The proxy's uid, whose traffic the rules exclude.
const PROXY_UID: u32 = 1337;
/// The gate's uid in the image.
const GATE_UID: u32 = 65532;
const SKIP_ENV: &str = "MESHGATE_SKIP_NETNS";
const TOOLS: [&str; 6] = [
    "unshare",
    "setpriv",
    "ip",
    "iptables",
    "ip6tables",
    "timeout",
];
/// Exit code of the script when setting up the namespace failed.
const SETUP_FAILED: i32 = 99;

/// Where the binary is copied for the non-root uid (the target directory may be under a
/// directory only root can enter); removed on drop.
struct Netns {
    dir: PathBuf,
    bin: PathBuf,
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The environment for one case, or `None` when it cannot run and `MESHGATE_SKIP_NETNS=1`
/// says to skip. Panics with the reason otherwise.
fn netns(case: &str) -> Option<Netns> {
    if let Err(why) = prerequisites() {
        if std::env::var_os(SKIP_ENV).is_some_and(|v| v == "1") {
            eprintln!("skipping the network namespace test {case}: {why} ({SKIP_ENV}=1)");
            return None;
        }
        panic!(
            "cannot run the network namespace test {case}: {why}. It needs root and {}; \
             set {SKIP_ENV}=1 to skip it",
            TOOLS.join(", ")
        );
    }
    let dir =
        std::env::temp_dir().join(format!("meshgate-wait-netns-{}-{case}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create the binary's directory");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755))
        .expect("make the binary's directory readable");
    let bin = dir.join("meshgate-wait");
    std::fs::copy(BIN, &bin).expect("copy meshgate-wait");
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755))
        .expect("make meshgate-wait executable");
    Some(Netns { dir, bin })
}

fn prerequisites() -> Result<(), String> {
    let status = std::fs::read_to_string("/proc/self/status")
        .map_err(|e| format!("cannot read /proc/self/status: {e}"))?;
    let euid = status
        .lines()
        .find_map(|line| line.strip_prefix("Uid:"))
        .and_then(|ids| ids.split_whitespace().nth(1))
        .ok_or("no Uid line in /proc/self/status")?;
    if euid != "0" {
        return Err(format!("not running as root (euid {euid})"));
    }
    let missing: Vec<&str> = TOOLS.iter().copied().filter(|t| !on_path(t)).collect();
    if !missing.is_empty() {
        return Err(format!("missing {}", missing.join(", ")));
    }
    // Namespaces may be forbidden (e.g. in an unprivileged container), and iptables must work
    // inside one (nf_tables or legacy backend, whichever is installed).
    let out = Command::new("unshare")
        .args(["--net", "--", "sh", "-c", "iptables -V && ip6tables -V"])
        .env("PATH", search_path())
        .output()
        .map_err(|e| format!("cannot run unshare: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "'unshare --net -- iptables -V' failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(())
}

/// `PATH` plus the sbin directories, where `ip` and `iptables` live.
fn search_path() -> std::ffi::OsString {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let dirs = std::env::split_paths(&path).chain(["/usr/sbin", "/sbin"].map(PathBuf::from));
    std::env::join_paths(dirs).unwrap_or(path)
}

fn on_path(tool: &str) -> bool {
    std::env::split_paths(&search_path()).any(|dir| dir.join(tool).is_file())
}

/// The pod's network.
#[derive(Clone, Copy)]
struct Net {
    ipv4: bool,
    ipv6: bool,
    default_routes: bool,
}

const IPV4: Net = Net {
    ipv4: true,
    ipv6: false,
    default_routes: true,
};
const IPV6_ONLY: Net = Net {
    ipv4: false,
    ipv6: true,
    default_routes: true,
};
const DUAL: Net = Net {
    ipv4: true,
    ipv6: true,
    default_routes: true,
};

/// Commands that set the namespace's network up.
fn network(net: Net) -> Vec<String> {
    let mut commands = vec![
        "ip link set lo up".to_string(),
        // No dummy driver on some kernels: a veth pair with both ends here works the same
        // (the peer has no address, so nothing answers).
        "{ ip link add eth0 type dummy 2>/dev/null || \
           { ip link add eth0 type veth peer name eth0-peer && ip link set eth0-peer up; }; }"
            .to_string(),
        "ip link set eth0 up".to_string(),
    ];
    if net.ipv4 {
        commands.push("ip addr add 10.250.0.2/24 dev eth0".to_string());
        if net.default_routes {
            commands.push("ip route add default dev eth0".to_string());
        }
    }
    if net.ipv6 {
        commands.push("ip -6 addr add fd00::2/64 dev eth0 nodad".to_string());
        if net.default_routes {
            commands.push("ip -6 route add default dev eth0".to_string());
        }
    }
    commands
}

/// Mesh-style outbound capture, modelled on Istio's sidecar rules: every TCP connection
/// leaving the pod is redirected to the proxy's outbound port, except the proxy's own
/// (uid/gid 1337), loopback traffic, and `exclude` (like Istio's
/// `excludeOutboundIPRanges`), which comes before the redirect.
fn mesh_rules(iptables: &str, exclude: Option<&str>) -> Vec<String> {
    let localhost = if iptables == "ip6tables" {
        "::1/128"
    } else {
        "127.0.0.1/32"
    };
    let nat = format!("{iptables} -t nat");
    let mut rules = vec![
        format!("{iptables} -V"),
        format!("{nat} -N MESH_OUTPUT"),
        format!("{nat} -N MESH_REDIRECT"),
        format!("{nat} -A MESH_REDIRECT -p tcp -j REDIRECT --to-ports {PROXY_PORT}"),
        format!("{nat} -A OUTPUT -p tcp -j MESH_OUTPUT"),
        // Loopback traffic to other local addresses stays local.
        format!("{nat} -A MESH_OUTPUT -o lo ! -d {localhost} -j RETURN"),
        // The proxy's own traffic leaves the pod (else it would loop back to itself).
        format!("{nat} -A MESH_OUTPUT -m owner --uid-owner {PROXY_UID} -j RETURN"),
        format!("{nat} -A MESH_OUTPUT -m owner --gid-owner {PROXY_UID} -j RETURN"),
        format!("{nat} -A MESH_OUTPUT -d {localhost} -j RETURN"),
    ];
    if let Some(range) = exclude {
        rules.push(format!("{nat} -A MESH_OUTPUT -d {range} -j RETURN"));
    }
    rules.push(format!("{nat} -A MESH_OUTPUT -j MESH_REDIRECT"));
    rules
}

/// Marks the end of the setup output on stdout; the namespace's TCP tables follow.
const TABLES_MARK: &str = "--- tcp tables after the gate ---";

/// Runs the gate as `uid` in a new network namespace set up by `setup`, with
/// `--redirect-check 15001` and `args`; then prints the namespace's TCP tables.
fn run_gate(env: &Netns, setup: &[String], uid: u32, args: &[&str]) -> Output {
    // Setup output goes to stdout, so stderr holds only the gate's line; the gate's path and
    // arguments are passed as positional parameters, never spliced into the script.
    let script = format!(
        "{{ {}; }} 2>&1 || {{ echo 'setting up the namespace failed' >&2; exit {SETUP_FAILED}; }}\n\
         bin=$1; shift\n\
         timeout -k 1 10 setpriv --reuid {uid} --regid {uid} --clear-groups \"$bin\" \"$@\"\n\
         rc=$?\n\
         echo '{TABLES_MARK}'; cat /proc/net/tcp /proc/net/tcp6 2>/dev/null\n\
         exit $rc",
        setup.join(" && ")
    );
    let port = PROXY_PORT.to_string();
    let out = Command::new("unshare")
        .args(["--net", "--", "sh", "-c", &script, "sh"])
        .arg(&env.bin)
        .args(["--redirect-check", &port])
        .args(args)
        .env_remove("MESHGATE_WAIT_PROC")
        .env("PATH", search_path())
        .output()
        .expect("run unshare");
    assert_ne!(
        out.status.code(),
        Some(SETUP_FAILED),
        "namespace setup failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The gate's single stderr line.
fn gate_line(out: &Output) -> String {
    let text = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        lines.len(),
        1,
        "exactly one stderr line, got {text:?} (setup: {})",
        String::from_utf8_lossy(&out.stdout)
    );
    eprintln!("{}", lines[0]);
    lines[0].to_string()
}

/// Sockets of the namespace in `TIME_WAIT` (state `06`) on local port 15001 after the gate
/// exited: the proxy binds that port next.
fn time_wait_on_proxy_port(out: &Output) -> Vec<String> {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let Some((_, tables)) = stdout.split_once(TABLES_MARK) else {
        panic!("no TCP tables after the gate: {stdout}");
    };
    let port = format!(":{PROXY_PORT:04X}");
    tables
        .lines()
        .filter(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            fields.len() > 3 && fields[1].ends_with(&port) && fields[3] == "06"
        })
        .map(|line| line.trim().to_string())
        .collect()
}

/// Asserts a ready line ending with `checks`, reached in under a second, and no
/// `TIME_WAIT` left on the proxy's port.
fn assert_ready(out: &Output, checks: &str) {
    let line = gate_line(out);
    assert_eq!(out.status.code(), Some(0), "{line}");
    let elapsed = line
        .strip_prefix("meshgate-wait: ready after ")
        .and_then(|rest| rest.split_once(": "))
        .filter(|(_, rest)| *rest == checks)
        .and_then(|(elapsed, _)| parse_duration(elapsed).ok());
    match elapsed {
        Some(elapsed) => assert!(elapsed < Duration::from_secs(1), "slow: {line}"),
        None => panic!("want 'ready after ...: {checks}', got {line:?}"),
    }
    let time_wait = time_wait_on_proxy_port(out);
    assert!(
        time_wait.is_empty(),
        "TIME_WAIT on port {PROXY_PORT} after the gate: {time_wait:#?}"
    );
}

/// Asserts a timed-out line naming the redirect check via `target` and `why`.
fn assert_timed_out(out: &Output, target: &str, why: &str) {
    let line = gate_line(out);
    assert_eq!(out.status.code(), Some(1), "{line}");
    assert!(
        line.starts_with("meshgate-wait: timed out after "),
        "{line}"
    );
    let check = format!("not ready: redirect-check {PROXY_PORT} via {target} (");
    assert!(line.contains(&check), "want {check:?} in {line:?}");
    assert!(line.contains(why), "want {why:?} in {line:?}");
}

fn with(mut a: Vec<String>, b: Vec<String>) -> Vec<String> {
    a.extend(b);
    a
}

#[test]
fn a_ipv4_redirected_is_ready() {
    let Some(env) = netns("a") else { return };
    let setup = with(network(IPV4), mesh_rules("iptables", None));
    let out = run_gate(&env, &setup, GATE_UID, &["--timeout", "3s"]);
    assert_ready(
        &out,
        &format!("redirect-check {PROXY_PORT} via 192.0.2.1:80"),
    );
}

#[test]
fn a_dual_stack_prefers_ipv4() {
    let Some(env) = netns("a-dual") else { return };
    let setup = with(
        with(network(DUAL), mesh_rules("iptables", None)),
        mesh_rules("ip6tables", None),
    );
    let out = run_gate(&env, &setup, GATE_UID, &["--timeout", "3s"]);
    assert_ready(
        &out,
        &format!("redirect-check {PROXY_PORT} via 192.0.2.1:80"),
    );
}

#[test]
fn b_no_rules_times_out() {
    let Some(env) = netns("b") else { return };
    let out = run_gate(&env, &network(IPV4), GATE_UID, &["--timeout", "1s"]);
    assert_timed_out(&out, "192.0.2.1:80", "connect to 192.0.2.1:80");
}

#[test]
fn c_excluded_range_is_not_redirected() {
    let Some(env) = netns("c") else { return };
    let setup = with(network(IPV4), mesh_rules("iptables", Some("192.0.2.0/24")));
    let out = run_gate(
        &env,
        &setup,
        GATE_UID,
        &["--redirect-target", "192.0.2.1:80", "--timeout", "1s"],
    );
    assert_timed_out(&out, "192.0.2.1:80", "connect to 192.0.2.1:80");
    let out = run_gate(
        &env,
        &setup,
        GATE_UID,
        &["--redirect-target", "198.51.100.1:80", "--timeout", "3s"],
    );
    assert_ready(
        &out,
        &format!("redirect-check {PROXY_PORT} via 198.51.100.1:80"),
    );
}

#[test]
fn d_ipv6_only_uses_the_ipv6_target() {
    let Some(env) = netns("d") else { return };
    let setup = with(network(IPV6_ONLY), mesh_rules("ip6tables", None));
    let out = run_gate(&env, &setup, GATE_UID, &["--timeout", "3s"]);
    assert_ready(
        &out,
        &format!("redirect-check {PROXY_PORT} via [2001:db8::1]:80"),
    );
}

#[test]
fn e_gate_as_the_proxy_uid_is_never_redirected() {
    // The rules let the proxy's own traffic out: a gate running as that uid can never see a
    // redirect, whatever the node's state. The gate must not run as the proxy's uid.
    let Some(env) = netns("e") else { return };
    let setup = with(network(IPV4), mesh_rules("iptables", None));
    let out = run_gate(&env, &setup, PROXY_UID, &["--timeout", "1s"]);
    assert_timed_out(&out, "192.0.2.1:80", "connect to 192.0.2.1:80");
}

#[test]
fn f_no_default_route_is_not_checked() {
    let Some(env) = netns("f") else { return };
    let net = Net {
        default_routes: false,
        ..DUAL
    };
    let setup = with(network(net), mesh_rules("iptables", None));
    let out = run_gate(&env, &setup, GATE_UID, &["--timeout", "3s"]);
    assert_ready(
        &out,
        &format!(
            "redirect-check {PROXY_PORT} (not checked: no route to 192.0.2.1:80 or \
             [2001:db8::1]:80 in this pod)"
        ),
    );
}

#[test]
fn f_ipv6_only_pod_with_only_an_ipv4_target_is_not_checked() {
    let Some(env) = netns("f-v6") else { return };
    let setup = with(network(IPV6_ONLY), mesh_rules("ip6tables", None));
    let out = run_gate(
        &env,
        &setup,
        GATE_UID,
        &["--redirect-target", "192.0.2.1:80", "--timeout", "3s"],
    );
    assert_ready(
        &out,
        &format!("redirect-check {PROXY_PORT} (not checked: no route to 192.0.2.1:80 in this pod)"),
    );
}

/// The gate the webhook plans for an Istio sidecar pod in CNI mode with these pod annotations
/// and an application init container ahead of `istio-validation` (with the validator first,
/// meshgate puts no gate in front of it): its `meshgate-wait` arguments after
/// `--redirect-check PORT`, or `None` for no gate.
fn planned_gate(annotations: serde_json::Value) -> Option<Vec<String>> {
    use meshgate_api::{GateConfig, Profile};
    use meshgate_core::gate::{PodPlan, PodRequest, plan_pod};
    let mut annotations = annotations;
    annotations["sidecar.istio.io/status"] = serde_json::json!(
        r#"{"initContainers":["istio-validation"],"containers":["istio-proxy"]}"#
    );
    let pod = serde_json::json!({
        "metadata": {"name": "p", "annotations": annotations},
        "spec": {
            "initContainers": [{"name": "migrate", "image": "app"},
                               {"name": "istio-validation", "image": "proxy",
                                "securityContext": {"runAsUser": 1337}}],
            "containers": [{"name": "app", "image": "app"},
                           {"name": "istio-proxy", "image": "proxy", "args": ["proxy", "sidecar"]}],
        },
    });
    let ns = meshgate_core::select::Meta {
        labels: [("istio-injection".to_owned(), "enabled".to_owned())].into(),
        ..Default::default()
    };
    let config = GateConfig {
        profiles: vec![Profile::IstioSidecar],
        ..GateConfig::default()
    };
    let plan = plan_pod(
        &config,
        &PodRequest {
            operation: "CREATE",
            namespace: "apps",
            pod: &pod,
            namespace_meta: &ns,
            limit_ranges: &[],
        },
    );
    let PodPlan::Mutate { patch, verdict, .. } = plan else {
        panic!("the pod is selected: {plan:?}");
    };
    verdict.ok()?;
    let gated = patch.apply(&pod).expect("the patch applies");
    let gate = &gated["spec"]["initContainers"][0];
    assert_eq!(gate["name"], "meshgate-wait");
    let args: Vec<String> = gate["args"]
        .as_array()
        .expect("args")
        .iter()
        .map(|a| a.as_str().expect("a string").to_owned())
        .collect();
    assert_eq!(args[..2], ["--redirect-check", "15001"]);
    Some(args[2..].to_vec())
}

#[test]
fn g_the_webhooks_gate_follows_the_pods_exclusion_annotation() {
    // The pod excludes TEST-NET-1 from redirection, and so do its rules: the gate the webhook
    // plans for it connects elsewhere and passes.
    let Some(env) = netns("g") else { return };
    let args = planned_gate(serde_json::json!({
        "traffic.sidecar.istio.io/excludeOutboundIPRanges": "192.0.2.0/24",
    }))
    .expect("a gate");
    let setup = with(network(DUAL), mesh_rules("iptables", Some("192.0.2.0/24")));
    let mut args: Vec<&str> = args.iter().map(String::as_str).collect();
    // The webhook's 120s timeout would only slow a failure down here.
    let t = args
        .iter()
        .position(|a| *a == "--timeout")
        .expect("--timeout");
    args[t + 1] = "3s";
    let out = run_gate(&env, &setup, GATE_UID, &args);
    assert_ready(
        &out,
        &format!("redirect-check {PROXY_PORT} via 198.51.100.1:80"),
    );
    // Everything of IPv4 excluded (the last-resort fix for init containers): the webhook plans
    // no gate at all, so nothing can wait for a redirect that never comes.
    assert_eq!(
        planned_gate(serde_json::json!({
            "traffic.sidecar.istio.io/excludeOutboundIPRanges": "0.0.0.0/0",
        })),
        None
    );
}
