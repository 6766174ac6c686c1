//! The init gate on a real node: kubelet, containerd and the CNI bridge on this host register
//! a Node with the test control plane (`meshgate_testenv::node`), meshgate's webhook injects the
//! gate into a pod of an ambient namespace, and the kubelet really runs the static
//! `meshgate-wait` from an image written by the test environment.
//!
//! * The gate holds the pod in Init while nothing listens on its port inside the pod, and lets
//!   the app start once a listener exists in the pod's network namespace (standing in for
//!   ambient's node proxy, which opens its listeners inside the pod).
//! * With a 3 s timeout and nothing listening, the gate fails the pod with exit code 1, naming
//!   the check.
//! * The teardown leaves the host as it was: processes, mounts, network namespaces, links,
//!   sysctls, iptables and nft state compared with the snapshot taken before the node started.
//! * The kubelet's own Node is tainted at CREATE by meshgate's admission policy; the node-proxy
//!   stand-in (`mesh-node-proxy`, a privileged DaemonSet from an image the test writes) becomes
//!   Ready after its delay, the controller (as its installed ServiceAccount) lifts the taint, and
//!   a gated ambient pod runs once the stand-in has opened its listener inside the pod; when the
//!   pod's sandbox dies (pause killed), the gate runs again in the new sandbox and holds until
//!   the stand-in has set that one up.
//! * Sidecar mode: a pod created before the CNI stand-in's agent has chained `mesh-cni` into the
//!   node's CNI configuration gets no redirect, and its gate times out (exit 1); a pod created
//!   after it is redirected, and its gate passes. A Deployment's pod whose gate timed out is
//!   deleted by the repair loop (running as the controller's ServiceAccount with the RBAC of
//!   `install --repair delete`) and replaced by a pod that runs.
//!
//! Needs root, the node binaries (`MESHGATE_NODE_BIN`, from tools/node/build.sh, which the test
//! runs when the variable is unset) and the packages of tools/node/packages.sh. Without them
//! the test FAILS saying what is missing, unless `MESHGATE_SKIP_REAL_NODE=1` is set, in which
//! case it prints why and passes.
//!
//! Run: `cargo test -p meshgate --test real_node -- --nocapture` (prints `measured:` lines).

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use k8s_openapi::api::core::v1::{ContainerStatus, Pod};
use kube::api::{Api, PostParams};
use meshgate_api::config::{GateCheck, InitGate};
use meshgate_api::{GateConfig, Profile};
use meshgate_testenv::host::{self, HostSnapshot};
use meshgate_testenv::image::{APP_IMAGE, GATE_IMAGE};
use meshgate_testenv::node::{NodeOptions, RealNode, STATE_DIR};
use serde_json::json;

const SKIP_ENV: &str = "MESHGATE_SKIP_REAL_NODE";
/// Set for the child process of the sweep test: the file to write the run directory to.
const CHILD_ENV: &str = "MESHGATE_REAL_NODE_CRASHING_CHILD";

/// One node per host: the tests of this binary take turns (the host lock would serialize the
/// nodes, but the sweep test's snapshot must also be taken while no node runs).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
const AMBIENT: (&str, &str) = ("istio.io/dataplane-mode", "ambient");

/// Whether the host can run a node; panics saying what is missing unless skipping is asked for.
fn can_run() -> bool {
    match meshgate_testenv::node::prerequisites() {
        Ok(_) => true,
        Err(e) if std::env::var_os(SKIP_ENV).is_some_and(|v| v == "1") => {
            eprintln!("skipping the real-node test: {e} ({SKIP_ENV}=1)");
            false
        }
        Err(e) => panic!("{e}. Set {SKIP_ENV}=1 to skip the real-node test"),
    }
}

/// meshgate's configuration: the ambient profile, its gate waiting for `port`, from the image
/// the node imported (never pulled).
fn gate_config(port: u16, timeout_seconds: u32) -> GateConfig {
    GateConfig {
        profiles: vec![Profile::IstioAmbient],
        init_gate: InitGate {
            image: GATE_IMAGE.into(),
            image_pull_policy: "Never".into(),
            command: "/meshgate-wait".into(),
            checks: vec![GateCheck::TcpListening { port }],
            timeout_seconds,
            ..InitGate::default()
        },
        ..GateConfig::default()
    }
}

/// Registers meshgate's webhook with `config` and waits until the API server's answers carry
/// its gate with `--timeout <timeout>s`.
async fn use_webhook(
    cp: &meshgate_testenv::ControlPlane,
    client: &kube::Client,
    pods: &Api<Pod>,
    config: GateConfig,
) -> Webhook {
    let timeout = format!("{}s", config.init_gate.timeout_seconds);
    let webhook = start_webhook(cp, config.clone()).await;
    register(
        client,
        &webhook.registration("meshgate", &config, false, false),
    )
    .await;
    probe_until(pods, "the webhook's gate", Duration::from_secs(30), |p| {
        gate(p).is_some_and(|g| {
            g.image.as_deref() == Some(GATE_IMAGE)
                && g.args.as_ref().is_some_and(|a| a.contains(&timeout))
        })
    })
    .await;
    webhook
}

fn gate(p: &Pod) -> Option<&k8s_openapi::api::core::v1::Container> {
    p.spec
        .as_ref()?
        .init_containers
        .as_ref()?
        .iter()
        .find(|c| c.name == "meshgate-wait")
}

fn app_pod(name: &str, node: &str, restart_policy: &str) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeName": node,
            "restartPolicy": restart_policy,
            "automountServiceAccountToken": false,
            "enableServiceLinks": false,
            "terminationGracePeriodSeconds": 5,
            "containers": [{"name": "app", "image": APP_IMAGE, "imagePullPolicy": "Never"}],
        },
    }))
    .expect("pod")
}

fn init_status<'a>(p: &'a Pod, name: &str) -> Option<&'a ContainerStatus> {
    p.status
        .as_ref()?
        .init_container_statuses
        .as_ref()?
        .iter()
        .find(|s| s.name == name)
}

fn app_status(p: &Pod) -> Option<&ContainerStatus> {
    p.status
        .as_ref()?
        .container_statuses
        .as_ref()?
        .iter()
        .find(|s| s.name == "app")
}

fn phase(p: &Pod) -> &str {
    p.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("")
}

/// Polls the pod until `done`; panics with its status and the kubelet's log after `limit`, or
/// at once when a container cannot be created (an image or runtime problem, not a wait).
async fn wait_pod(
    pods: &Api<Pod>,
    node: &RealNode,
    name: &str,
    what: &str,
    limit: Duration,
    done: impl Fn(&Pod) -> bool,
) -> Pod {
    let start = Instant::now();
    loop {
        let p = pods.get(name).await.expect("pod read");
        if done(&p) {
            return p;
        }
        let statuses = p.status.as_ref().map(|s| {
            s.init_container_statuses
                .iter()
                .chain(s.container_statuses.iter())
                .flatten()
                .cloned()
                .collect::<Vec<_>>()
        });
        let broken = statuses.iter().flatten().find_map(|s| {
            let w = s.state.as_ref()?.waiting.as_ref()?;
            let reason = w.reason.as_deref()?;
            (reason.contains("Err") || reason.contains("Error") || reason == "CrashLoopBackOff")
                .then(|| format!("{}: {reason}: {:?}", s.name, w.message))
        });
        if broken.is_some() || start.elapsed() > limit {
            panic!(
                "pod {name}: waiting for {what}: {}\nstatus: {}\nkubelet log:\n{}",
                broken.unwrap_or_else(|| format!("timed out after {limit:?}")),
                serde_json::to_string_pretty(&p.status).unwrap_or_default(),
                node.log_tail("kubelet", 30)
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `syscr` (read system calls so far) of a process, from `/proc/<pid>/io`.
fn read_syscalls(pid: u32) -> u64 {
    let io = std::fs::read_to_string(format!("/proc/{pid}/io")).expect("/proc/<gate>/io");
    io.lines()
        .find_map(|l| l.strip_prefix("syscr:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("syscr in /proc/<gate>/io")
}

/// A `meshgate-wait` duration (`812ms`, `3s`, `2.35s`).
fn parse_wait_duration(text: &str) -> Duration {
    if let Some(ms) = text.strip_suffix("ms") {
        return Duration::from_millis(ms.parse().expect("milliseconds"));
    }
    let secs: f64 = text
        .strip_suffix('s')
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("a duration: {text}"));
    Duration::from_secs_f64(secs)
}

/// The gate's line in its CRI log file (`TIME stderr F meshgate-wait: ...`).
fn gate_log_line(node: &RealNode, ns: &str, pod: &Pod) -> String {
    let uid = pod.metadata.uid.as_deref().expect("uid");
    let name = pod.metadata.name.as_deref().expect("name");
    let path = node.container_log(ns, name, uid, "meshgate-wait", 0);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("the gate's log {}: {e}", path.display()));
    text.lines()
        .find_map(|l| l.split_once(" meshgate-wait: ").map(|(_, m)| m.to_owned()))
        .unwrap_or_else(|| panic!("no meshgate-wait line in {}:\n{text}", path.display()))
}

fn rfc3339(t: &k8s_openapi::apimachinery::pkg::apis::meta::v1::Time) -> String {
    t.0.to_string()
}

/// Scenario 1: the gate holds the pod until a listener exists in the pod's network namespace.
async fn gate_holds_the_pod_until_the_listener_exists(
    node: &RealNode,
    pods: &Api<Pod>,
    ns: &str,
    port: u16,
) {
    let created = Instant::now();
    let stored = pods
        .create(
            &PostParams::default(),
            &app_pod("gated", node.name(), "Always"),
        )
        .await
        .expect("pod created");
    let inits: Vec<&str> = stored
        .spec
        .as_ref()
        .and_then(|s| s.init_containers.as_ref())
        .map(|cs| cs.iter().map(|c| c.name.as_str()).collect())
        .unwrap_or_default();
    assert_eq!(inits, ["meshgate-wait"], "stored with the gate first");
    let g = gate(&stored).expect("gate");
    assert_eq!(g.image.as_deref(), Some(GATE_IMAGE));
    assert_eq!(g.image_pull_policy.as_deref(), Some("Never"));
    assert_eq!(
        g.command.as_deref(),
        Some(&["/meshgate-wait".to_owned()][..])
    );
    let args = g.args.clone().unwrap_or_default();
    assert!(
        args.windows(2)
            .any(|w| w[0] == "--tcp-listening" && w[1] == port.to_string()),
        "{args:?}"
    );

    let running = wait_pod(
        pods,
        node,
        "gated",
        "the gate to run",
        Duration::from_secs(60),
        |p| {
            init_status(p, "meshgate-wait")
                .and_then(|s| s.state.as_ref())
                .is_some_and(|s| s.running.is_some())
        },
    )
    .await;
    eprintln!(
        "measured: pod create -> gate Running {:.2?}",
        created.elapsed()
    );

    // The gate process itself: the kubelet's container, probing (its read system calls grow:
    // it reads the pod's /proc/net/tcp{,6} every 50 ms and logs nothing until it ends).
    let id = init_status(&running, "meshgate-wait")
        .and_then(|s| s.container_id.clone())
        .expect("gate container id");
    let gate_pid = node
        .task_pid(&id)
        .expect("ctr tasks ls")
        .expect("the gate's task runs");
    let cmdline = host::cmdline(gate_pid);
    assert!(
        cmdline.starts_with("/meshgate-wait --tcp-listening"),
        "{cmdline}"
    );
    let watched = Instant::now();
    let reads_before = read_syscalls(gate_pid);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let reads = read_syscalls(gate_pid) - reads_before;
    assert!(
        reads >= 20,
        "the gate made {reads} read system calls in 1.5 s: not probing"
    );

    // Having seen it probe, and with nothing listening: the pod is held in Init.
    let held = pods.get("gated").await.expect("pod read");
    assert_eq!(phase(&held), "Pending", "{:?}", held.status);
    let app = app_status(&held).expect("app status");
    assert!(
        app.state.as_ref().is_some_and(|s| s.waiting.is_some()) && !app.started.unwrap_or(false),
        "the app must wait while the gate probes: {app:?}"
    );
    assert!(
        init_status(&held, "meshgate-wait")
            .and_then(|s| s.state.as_ref())
            .is_some_and(|s| s.running.is_some()),
        "the gate still runs"
    );
    let probing = watched.elapsed();
    eprintln!(
        "measured: gate probing {probing:.2?} with nothing listening: {reads} read syscalls, pod Pending, app Waiting"
    );

    // The node proxy's stand-in: a listener inside the pod's network namespace.
    let uid = held.metadata.uid.clone().expect("uid");
    let pause = node.sandbox_pid(&uid).expect("the pod's sandbox");
    assert_eq!(
        host::cmdline(pause),
        "/pause",
        "the sandbox's pause process"
    );
    let log_dir = tempfile::tempdir().expect("tempdir");
    let app_bin = node.images().expect("images").binaries.app();
    let listener_opened = Instant::now();
    let mut listener = ChildProcess::spawn(
        "listener",
        &node.tools().nsenter,
        &[
            format!("--net=/proc/{pause}/ns/net"),
            "--".into(),
            app_bin.display().to_string(),
            "listen".into(),
            port.to_string(),
        ],
        &[],
        &log_dir.path().join("listener.log"),
    );
    wait_for("the listener", Duration::from_secs(10), || {
        listener.assert_running();
        let up = listener.log_tail(5).contains("listening on");
        async move { up }
    })
    .await;

    let done = wait_pod(
        pods,
        node,
        "gated",
        "the app to run",
        Duration::from_secs(60),
        |p| {
            phase(p) == "Running"
                && app_status(p)
                    .and_then(|s| s.state.as_ref())
                    .is_some_and(|s| s.running.is_some())
        },
    )
    .await;
    eprintln!(
        "measured: listener -> pod Running {:.2?}",
        listener_opened.elapsed()
    );
    let gate_end = init_status(&done, "meshgate-wait")
        .and_then(|s| s.state.as_ref())
        .and_then(|s| s.terminated.clone())
        .expect("the gate terminated");
    assert_eq!(gate_end.exit_code, 0, "{gate_end:?}");
    assert_eq!(gate_end.reason.as_deref(), Some("Completed"));
    let app_start = app_status(&done)
        .and_then(|s| s.state.as_ref())
        .and_then(|s| s.running.as_ref())
        .and_then(|r| r.started_at.clone())
        .expect("app startedAt");
    let gate_finished = gate_end.finished_at.clone().expect("gate finishedAt");
    assert!(
        app_start.0 >= gate_finished.0,
        "the app started ({}) after the gate ended ({})",
        rfc3339(&app_start),
        rfc3339(&gate_finished)
    );

    // The gate's own account: what it waited for, and how long.
    let line = gate_log_line(node, ns, &done);
    let waited = line
        .strip_prefix("ready after ")
        .and_then(|rest| rest.split_once(": "))
        .unwrap_or_else(|| panic!("a ready line: {line}"));
    assert_eq!(waited.1, format!("tcp-listening {port}"), "{line}");
    let waited_for = parse_wait_duration(waited.0);
    assert!(
        waited_for >= probing,
        "the gate waited {waited_for:?}, at least the {probing:?} it was seen probing: {line}"
    );
    eprintln!("measured: gate log: meshgate-wait: {line}");

    let app_log = std::fs::read_to_string(node.container_log(ns, "gated", &uid, "app", 0))
        .expect("the app's log");
    assert!(app_log.contains("app: started"), "{app_log}");
    listener.signal("TERM");
}

/// Scenario 2: nothing listens; the gate times out after 3 s with exit code 1 and says why.
async fn gate_times_out_without_the_listener(
    node: &RealNode,
    pods: &Api<Pod>,
    ns: &str,
    port: u16,
) {
    let created = Instant::now();
    pods.create(
        &PostParams::default(),
        &app_pod("times-out", node.name(), "Never"),
    )
    .await
    .expect("pod created");
    let failed = wait_pod(
        pods,
        node,
        "times-out",
        "the gate to time out",
        Duration::from_secs(60),
        |p| {
            phase(p) == "Failed"
                && init_status(p, "meshgate-wait")
                    .and_then(|s| s.state.as_ref())
                    .is_some_and(|s| s.terminated.is_some())
        },
    )
    .await;
    eprintln!(
        "measured: pod create -> gate timed out, pod Failed {:.2?} (--timeout 3s)",
        created.elapsed()
    );
    let end = init_status(&failed, "meshgate-wait")
        .and_then(|s| s.state.as_ref())
        .and_then(|s| s.terminated.clone())
        .expect("terminated");
    assert_eq!(end.exit_code, 1, "{end:?}");
    // `timed out after 3.01s: not ready: tcp-listening PORT (no socket listening)`, in the
    // termination message (the gate's policy is FallbackToLogsOnError) and in its log.
    let check_line = |line: &str| {
        let (after, why) = line
            .strip_prefix("timed out after ")
            .and_then(|rest| rest.split_once(": not ready: "))
            .unwrap_or_else(|| panic!("a timed-out line: {line:?}"));
        let after = parse_wait_duration(after);
        assert!(
            after >= Duration::from_secs(3) && after < Duration::from_secs(5),
            "timed out after {after:?} with --timeout 3s: {line:?}"
        );
        assert_eq!(
            why.trim_end(),
            format!("tcp-listening {port} (no socket listening)"),
            "{line:?}"
        );
    };
    let message = end.message.clone().unwrap_or_default();
    check_line(
        message
            .strip_prefix("meshgate-wait: ")
            .unwrap_or_else(|| panic!("termination message: {message:?}")),
    );
    let app = app_status(&failed).expect("app status");
    assert!(
        !app.started.unwrap_or(false)
            && app.state.as_ref().is_none_or(|s| s.running.is_none())
            && app.last_state.as_ref().is_none_or(|s| s.running.is_none()),
        "the app never ran: {app:?}"
    );
    let line = gate_log_line(node, ns, &failed);
    check_line(&line);
    eprintln!("measured: gate log: meshgate-wait: {line}");
}

/// The host after the teardown: as in the snapshot taken before the node started, and nothing
/// of the node left.
fn assert_host_restored(before: &HostSnapshot, run_dir: &Path) {
    let now = HostSnapshot::take().expect("host snapshot");
    let differences = before.differences(&now);
    assert!(
        differences.is_empty(),
        "the host differs from before the node:\n{}",
        differences.join("\n")
    );
    for name in [
        "kubelet",
        "containerd",
        "containerd-shim",
        "kube-controller",
        "kube-proxy",
        "pause",
        "app",
        "meshgate-wait",
    ] {
        let left = host::pids_named(name);
        assert!(left.is_empty(), "{name} processes left: {left:?}");
    }
    let left = host::pids_with_cmdline(&run_dir.to_string_lossy());
    assert!(
        left.is_empty(),
        "processes of the run directory left: {left:?}"
    );
    let mounts: Vec<String> = host::mount_points()
        .into_iter()
        .filter(|m| {
            m.starts_with(&*run_dir.to_string_lossy())
                || host::FIXED_PATHS.iter().any(|p| m.starts_with(p))
        })
        .collect();
    assert!(mounts.is_empty(), "mounts left: {mounts:?}");
    let links: Vec<String> = std::fs::read_dir("/sys/class/net")
        .expect("/sys/class/net")
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n == "cni0" || n.starts_with("veth"))
        .collect();
    assert!(links.is_empty(), "links left: {links:?}");
    assert_eq!(
        now.netns, before.netns,
        "network namespaces as before the node"
    );
    assert_eq!(now.sysctls, before.sysctls, "sysctls as before");
    assert_eq!(now.iptables, before.iptables, "iptables as before");
    assert_eq!(now.nft, before.nft, "nft ruleset as before");
    assert!(!run_dir.exists(), "{} removed", run_dir.display());
    assert!(
        !Path::new(STATE_DIR).join("state.json").exists(),
        "no state left for a sweeper"
    );
}

#[tokio::test]
async fn gated_pods_run_on_a_real_node_and_the_host_is_restored() {
    if !can_run() {
        return;
    }
    let _serial = SERIAL.lock().await;
    let cp = control_plane(false).await;
    let client = cp.client().await.expect("client");
    let started = Instant::now();
    let node = RealNode::start(
        &cp,
        NodeOptions {
            proxy: true,
            ..NodeOptions::default()
        },
    )
    .await
    .expect("the real node starts");
    let t = &node.timings;
    eprintln!(
        "measured: node start {:.2?} (containerd serving {:.2?}, images imported {:.2?}); \
         node Ready {:.2?} after kubelet start; podCIDR after {:?}",
        started.elapsed(),
        t.containerd_serving,
        t.images_imported,
        t.ready_after_kubelet_start,
        t.pod_cidr_after_kubelet_start
    );
    if let Some(sweep) = node.sweep_at_start() {
        eprintln!(
            "swept a crashed earlier run at start:\n{}",
            sweep.log.join("\n")
        );
    }

    let ns = cp
        .namespace("real-node", &[AMBIENT])
        .await
        .expect("namespace");
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let port = meshgate_testenv::free_port().expect("port");

    let _webhook = use_webhook(&cp, &client, &pods, gate_config(port, 60)).await;
    gate_holds_the_pod_until_the_listener_exists(&node, &pods, &ns, port).await;

    let during = HostSnapshot::take().expect("host snapshot");
    let changed = node.snapshot_before().differences(&during);
    assert!(
        changed.iter().any(|d| d.starts_with("link cni0")),
        "the running node changed the host (cni0 at least): {changed:?}"
    );

    let _short = use_webhook(&cp, &client, &pods, gate_config(port, 3)).await;
    gate_times_out_without_the_listener(&node, &pods, &ns, port).await;

    for (name, pid) in node.pids() {
        let (_, rss) = meshgate_testenv::measure::memory(pid).expect("memory");
        eprintln!("measured: RSS {name} {} MiB", rss / (1024 * 1024));
    }

    let before = node.snapshot_before().clone();
    let run_dir = node.run_dir().to_owned();
    let stopping = Instant::now();
    let teardown = node.stop().await.expect("the teardown restores the host");
    eprintln!(
        "measured: teardown {:.2?} ({} actions)",
        stopping.elapsed(),
        teardown.log.len()
    );
    eprintln!("teardown:\n  {}", teardown.log.join("\n  "));
    assert_host_restored(&before, &run_dir);
}

/// A test process that dies (SIGKILL) with a node running takes its kubelet, containerd and
/// controllers with it, but leaves the shims, the containers, mounts, the pod's network
/// namespace, `cni0`, iptables rules and sysctls behind; the next start's sweeper (here
/// `node::sweep`) finds the state file and puts the host back as it was.
#[tokio::test]
async fn a_crashed_test_process_leaves_the_host_to_the_sweeper() {
    if !can_run() {
        return;
    }
    let _serial = SERIAL.lock().await;
    let before = HostSnapshot::take().expect("host snapshot");
    let dir = tempfile::tempdir().expect("tempdir");
    let marker = dir.path().join("run-dir");
    let exe = std::env::current_exe().expect("test executable");
    let mut child = ChildProcess::spawn(
        "crashing child",
        &exe,
        &[
            "--exact".into(),
            "crashing_child".into(),
            "--ignored".into(),
            "--nocapture".into(),
        ],
        &[(CHILD_ENV, marker.as_os_str())],
        &dir.path().join("child.log"),
    );
    wait_for("the child's node and pod", Duration::from_secs(300), || {
        child.assert_running();
        let ready = marker.exists();
        async move { ready }
    })
    .await;
    let run_dir = std::path::PathBuf::from(std::fs::read_to_string(&marker).expect("marker"));
    child.signal("KILL");
    assert!(
        child.wait_exit(Duration::from_secs(10)).await.is_some(),
        "the child died"
    );
    // The kernel kills the child's kubelet, containerd and controllers (parent-death signal).
    wait_for("the node's daemons to die", Duration::from_secs(10), || {
        let gone = ["kubelet", "containerd", "kube-controller", "kube-proxy"]
            .iter()
            .all(|n| host::pids_named(n).is_empty());
        async move { gone }
    })
    .await;

    // What the crash left.
    let dirty = HostSnapshot::take().expect("host snapshot");
    let left = before.differences(&dirty);
    eprintln!("after the crash, {} differences from before", left.len());
    for expected in ["link cni0: new", "netns cni-", "sysctl net/ipv4/ip_forward"] {
        assert!(
            left.iter().any(|d| d.starts_with(expected)),
            "the crash left {expected}…: {left:#?}"
        );
    }
    let shims = host::pids_with_cmdline("containerd-shim-runc-v2");
    assert!(!shims.is_empty(), "the shims outlive the crash");
    assert!(
        !host::pids_named("app").is_empty(),
        "the pod's container outlives the crash"
    );
    assert!(Path::new(STATE_DIR).join("state.json").exists());

    let sweeping = Instant::now();
    let sweep = meshgate_testenv::node::sweep()
        .expect("the sweep restores the host")
        .expect("there was a crashed node to sweep");
    eprintln!(
        "measured: sweep after a crash {:.2?} ({} actions)",
        sweeping.elapsed(),
        sweep.log.len()
    );
    eprintln!("sweep:\n  {}", sweep.log.join("\n  "));
    assert_host_restored(&before, &run_dir);
}

/// The child of the sweep test: starts a node with a running pod, says where its run
/// directory is, and waits to be killed.
#[tokio::test]
#[ignore = "run by a_crashed_test_process_leaves_the_host_to_the_sweeper in a child process"]
async fn crashing_child() {
    let Some(marker) = std::env::var_os(CHILD_ENV) else {
        eprintln!("crashing_child runs only as the sweep test's child ({CHILD_ENV} unset)");
        return;
    };
    let cp = control_plane(false).await;
    let node = RealNode::start(
        &cp,
        NodeOptions {
            proxy: true,
            ..NodeOptions::default()
        },
    )
    .await
    .expect("the real node starts");
    let ns = cp.namespace("crash", &[]).await.expect("namespace");
    let pods: Api<Pod> = Api::namespaced(cp.client().await.expect("client"), &ns);
    pods.create(
        &PostParams::default(),
        &app_pod("doomed", node.name(), "Always"),
    )
    .await
    .expect("pod created");
    wait_pod(
        &pods,
        &node,
        "doomed",
        "the pod to run",
        Duration::from_secs(60),
        |p| phase(p) == "Running",
    )
    .await;
    let tmp = std::path::PathBuf::from(&marker).with_extension("tmp");
    std::fs::write(&tmp, node.run_dir().as_os_str().as_encoded_bytes()).expect("marker");
    std::fs::rename(&tmp, &marker).expect("marker in place");
    std::future::pending::<()>().await;
}

/// The registration race, for real: the kubelet's own Node is tainted at CREATE by meshgate's
/// admission policy (no webhook on nodes), the node-proxy stand-in (`mesh-node-proxy`, a
/// DaemonSet from an image the test writes) starts on it and becomes Ready after a delay, the
/// controller (as its installed ServiceAccount) lifts the taint, and a gated pod of an ambient
/// namespace then runs once the stand-in has opened its listener inside the pod.
#[tokio::test]
async fn the_kubelets_node_is_tainted_at_create_and_released_by_its_real_agent() {
    use k8s_openapi::api::apps::v1::DaemonSet;
    use k8s_openapi::api::core::v1::Node;
    use meshgate_api::NodeGate;
    use meshgate_api::node_gate::NodeGateSpec;
    use meshgate_testenv::image::AGENTS_IMAGE;

    if !can_run() {
        return;
    }
    let _serial = SERIAL.lock().await;
    let cp = control_plane(true).await;
    let client = cp.client().await.expect("client");
    install_crds(&client).await;
    install_identities(&client, "istio-ambient", "meshgate-system").await;
    let node_name = NodeOptions::default().name;
    let agents_ns = cp.namespace("mesh-agents", &[]).await.expect("namespace");
    let spec: NodeGateSpec = serde_json::from_value(json!({
        "agents": [{"name": "node-proxy", "namespace": agents_ns,
                    "selector": {"matchLabels": {"app": "mesh-node-proxy"}}, "daemonSet": "mesh-node-proxy"}],
        "nodeSelector": {"matchLabels": {"kubernetes.io/hostname": node_name}},
    }))
    .expect("gate spec");
    // The admission policy that taints the node at registration, and its effect checked with
    // dry-run creates (policies take effect asynchronously).
    for doc in meshgate_core::registration::node_taint_policy(
        "real-agents",
        &spec,
        meshgate_core::registration::PolicyApi::V1,
    ) {
        meshgate::install::apply(&client, &[doc], false, |_| {})
            .await
            .expect("policy applied");
    }
    let nodes: Api<Node> = Api::all(client.clone());
    let mut n = 0;
    wait_for(
        "the admission policy to be active",
        Duration::from_secs(30),
        || {
            n += 1;
            let nodes = nodes.clone();
            let node_name = node_name.clone();
            async move {
                let probe: Node =
                    serde_json::from_value(json!({"metadata": {"name": format!("probe-{n}"),
                "labels": {"kubernetes.io/hostname": node_name}}}))
                    .expect("node");
                let dry = PostParams {
                    dry_run: true,
                    ..Default::default()
                };
                nodes.create(&dry, &probe).await.ok().is_some_and(|n| {
                    n.spec.and_then(|s| s.taints).is_some_and(|ts| {
                        ts.iter()
                            .any(|t| t.key == meshgate_api::names::DEFAULT_TAINT_KEY)
                    })
                })
            }
        },
    )
    .await;
    Api::<NodeGate>::all(client.clone())
        .create(&PostParams::default(), &NodeGate::new("real-agents", spec))
        .await
        .expect("gate");
    let mut controller = Replica::start(
        cp.kubeconfig_path.clone(),
        meshgate_controller::leader::LeaseSettings {
            namespace: "meshgate-system".into(),
            name: "meshgate-real-node".into(),
            identity: "real".into(),
            duration: 3,
            grace: 1,
        },
        Duration::from_millis(500),
        Some("meshgate-system"),
    )
    .await;
    // The node-proxy stand-in, as a mesh ships its node proxy: a privileged DaemonSet that
    // tolerates every taint (the gate's included) and is Ready after its start-up delay.
    let ds: DaemonSet = serde_json::from_value(json!({
        "metadata": {"name": "mesh-node-proxy"},
        "spec": {
            "selector": {"matchLabels": {"app": "mesh-node-proxy"}},
            "template": {
                "metadata": {"labels": {"app": "mesh-node-proxy"}},
                "spec": {
                    "hostPID": true,
                    "automountServiceAccountToken": false,
                    "enableServiceLinks": false,
                    "terminationGracePeriodSeconds": 1,
                    "tolerations": [{"operator": "Exists"}],
                    "containers": [{
                        "name": "node-proxy", "image": AGENTS_IMAGE, "imagePullPolicy": "Never",
                        "command": ["/mesh-node-proxy", "--ready-delay", "3", "--enrol-delay", "2", "--ready-file", "/tmp/ready"],
                        "securityContext": {"privileged": true},
                        "readinessProbe": {"exec": {"command": ["/mesh-node-proxy", "--check-ready", "/tmp/ready"]},
                                           "periodSeconds": 1},
                    }],
                },
            },
        },
    }))
    .expect("daemonset");
    Api::<DaemonSet>::namespaced(client.clone(), &agents_ns)
        .create(&PostParams::default(), &ds)
        .await
        .expect("daemonset created");

    // Watch the Node from before it exists: its first version shows whether it was tainted at
    // CREATE.
    let first_taints = std::sync::Arc::new(std::sync::Mutex::new(None::<Vec<String>>));
    let watch = {
        use futures::StreamExt;
        let (first, nodes, node_name) = (first_taints.clone(), nodes.clone(), node_name.clone());
        tokio::spawn(async move {
            let cfg = kube::runtime::watcher::Config::default()
                .fields(&format!("metadata.name={node_name}"));
            let mut stream = kube::runtime::watcher(nodes, cfg).boxed();
            while let Some(Ok(ev)) = stream.next().await {
                if let kube::runtime::watcher::Event::Apply(n)
                | kube::runtime::watcher::Event::InitApply(n) = ev
                {
                    let keys: Vec<String> = n
                        .spec
                        .and_then(|s| s.taints)
                        .unwrap_or_default()
                        .into_iter()
                        .map(|t| t.key)
                        .collect();
                    let mut f = first
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                    if f.is_none() {
                        *f = Some(keys);
                    }
                }
            }
        })
    };
    let node = RealNode::start(&cp, NodeOptions::default())
        .await
        .expect("the real node starts");
    let ready_at = Instant::now();
    let first = first_taints
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    watch.abort();
    assert!(
        first.as_ref().is_some_and(|k| k
            .iter()
            .any(|k| k == meshgate_api::names::DEFAULT_TAINT_KEY)),
        "the kubelet's Node was tainted at CREATE: first seen taints {first:?}"
    );
    let lifted = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            let n = nodes.get(&node_name).await.expect("node");
            let tainted = n
                .spec
                .and_then(|s| s.taints)
                .unwrap_or_default()
                .iter()
                .any(|t| t.key == meshgate_api::names::DEFAULT_TAINT_KEY);
            if !tainted {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    if lifted.is_err() {
        let agents = Api::<Pod>::namespaced(client.clone(), &agents_ns)
            .list(&Default::default())
            .await
            .expect("pods");
        let gate = Api::<NodeGate>::all(client.clone())
            .get("real-agents")
            .await
            .expect("gate");
        let n = nodes.get(&node_name).await.expect("node");
        panic!(
            "the taint was not lifted in 60 s\nagent pods: {}\ngate status: {}\nnode taints: {:?}\nnode conditions: {}\nkubelet:\n{}",
            serde_json::to_string_pretty(
                &agents
                    .items
                    .iter()
                    .map(|p| (&p.metadata.name, &p.status))
                    .collect::<Vec<_>>()
            )
            .unwrap_or_default(),
            serde_json::to_string_pretty(&gate.status).unwrap_or_default(),
            n.spec.as_ref().and_then(|s| s.taints.as_ref()),
            serde_json::to_string(&n.status.as_ref().and_then(|s| s.conditions.as_ref()))
                .unwrap_or_default(),
            node.log_tail("kubelet", 20)
        );
    }
    eprintln!(
        "measured: node Ready -> startup taint lifted {:.2?} (agent ready delay 3 s)",
        ready_at.elapsed()
    );
    assert!(
        ready_at.elapsed() >= Duration::from_secs(2),
        "not lifted before the agent was Ready"
    );
    let agent_pods = Api::<Pod>::namespaced(client.clone(), &agents_ns)
        .list(&Default::default())
        .await
        .expect("agent pods");
    assert!(
        agent_pods.items.iter().any(|p| p
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))),
        "the agent's pod is Ready"
    );

    // A gated ambient pod: its gate waits for the stand-in's in-pod listener (15008).
    let ns = cp
        .namespace("real-agents-app", &[AMBIENT])
        .await
        .expect("namespace");
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let _webhook = use_webhook(&cp, &client, &pods, gate_config(15008, 60)).await;
    let created = Instant::now();
    let pod = pods
        .create(
            &PostParams::default(),
            &app_pod("web", &node_name, "Always"),
        )
        .await
        .expect("pod");
    assert_eq!(gate(&pod).map(|g| g.name.as_str()), Some("meshgate-wait"));
    let running = wait_pod(
        &pods,
        &node,
        "web",
        "Running",
        Duration::from_secs(60),
        |p| phase(p) == "Running",
    )
    .await;
    eprintln!(
        "measured: gated pod create -> Running {:.2?} (node proxy stand-in enrolled it)",
        created.elapsed()
    );
    let line = gate_log_line(&node, &ns, &running);
    eprintln!("measured: gate log: meshgate-wait: {line}");
    assert!(
        line.starts_with("ready after ") && line.contains("tcp-listening 15008"),
        "{line}"
    );
    let waited = parse_wait_duration(
        line.trim_start_matches("ready after ")
            .split(':')
            .next()
            .unwrap_or_default(),
    );
    assert!(
        waited >= Duration::from_secs(1),
        "held until the stand-in enrolled the pod (2 s after its sandbox appeared): {line}"
    );

    // The pod's sandbox dies (its pause process killed): the kubelet makes a new one and runs
    // the gate again, which holds until the stand-in has set the new sandbox up.
    let uid = running.metadata.uid.clone().expect("uid");
    let old_sandbox = node.sandbox_pid(&uid).expect("sandbox pid");
    let status = std::process::Command::new("kill")
        .args(["-KILL", &old_sandbox.to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
    let killed = Instant::now();
    let again = wait_pod(
        &pods,
        &node,
        "web",
        "a new sandbox, the gate run again, the app running",
        Duration::from_secs(60),
        |p| {
            phase(p) == "Running"
                && init_status(p, "meshgate-wait").is_some_and(|s| s.restart_count >= 1)
                && app_status(p)
                    .is_some_and(|s| s.state.as_ref().is_some_and(|st| st.running.is_some()))
        },
    )
    .await;
    let new_sandbox = node.sandbox_pid(&uid).expect("new sandbox pid");
    assert_ne!(new_sandbox, old_sandbox, "a new sandbox");
    let attempt = init_status(&again, "meshgate-wait")
        .map_or(1, |s| u32::try_from(s.restart_count).unwrap_or(1));
    let path = node.container_log(&ns, "web", &uid, "meshgate-wait", attempt);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let line = text
        .lines()
        .find_map(|l| l.split_once(" meshgate-wait: ").map(|(_, m)| m.to_owned()))
        .unwrap_or_else(|| panic!("no meshgate-wait line in {}", path.display()));
    eprintln!(
        "measured: after the sandbox restart ({:.2?} to Running again), gate log: meshgate-wait: {line}",
        killed.elapsed()
    );
    let waited = parse_wait_duration(
        line.trim_start_matches("ready after ")
            .split(':')
            .next()
            .unwrap_or_default(),
    );
    assert!(
        line.starts_with("ready after ") && waited >= Duration::from_secs(1),
        "the gate held the new sandbox until the stand-in enrolled it: {line}"
    );

    // Leave the control plane as found: the gate (finalized by the controller) and the policy.
    Api::<NodeGate>::all(client.clone())
        .delete("real-agents", &Default::default())
        .await
        .expect("gate deleted");
    wait_for(
        "the gate to be finalized",
        Duration::from_secs(30),
        || async {
            Api::<NodeGate>::all(client.clone())
                .get_opt("real-agents")
                .await
                .ok()
                .flatten()
                .is_none()
        },
    )
    .await;
    {
        use k8s_openapi::api::admissionregistration::v1::{
            MutatingAdmissionPolicy, MutatingAdmissionPolicyBinding,
        };
        let name = "meshgate-node-taint-real-agents";
        Api::<MutatingAdmissionPolicyBinding>::all(client.clone())
            .delete(name, &Default::default())
            .await
            .expect("binding deleted");
        Api::<MutatingAdmissionPolicy>::all(client.clone())
            .delete(name, &Default::default())
            .await
            .expect("policy deleted");
    }
    controller.stop();
    let before = node.snapshot_before().clone();
    let run_dir = node.run_dir().to_owned();
    node.stop().await.expect("the teardown restores the host");
    assert_host_restored(&before, &run_dir);
}

/// Sidecar mode on a real node: the CNI stand-in's agent (`mesh-cni-agent`, a DaemonSet with
/// the node's CNI directories mounted) chains `mesh-cni` into the node's CNI configuration only
/// after its start-up delay, as a mesh's CNI agent does. A pod (shaped as Istio's injector
/// leaves it in CNI mode) whose sandbox was created before that gets no redirect: its gate
/// times out with exit code 1, naming the check. A pod created after it gets the redirect: its
/// gate passes and the app runs. The redirect target is the pod network's gateway, taken from
/// the pod's `includeOutboundIPRanges`: no probe ever leaves this machine.
#[tokio::test]
async fn sidecar_style_pods_are_gated_until_the_cni_agent_chains_its_plugin() {
    use k8s_openapi::api::apps::v1::DaemonSet;
    use meshgate_testenv::image::AGENTS_IMAGE;

    if !can_run() {
        return;
    }
    let _serial = SERIAL.lock().await;
    let cp = control_plane(true).await;
    let client = cp.client().await.expect("client");
    let node = RealNode::start(&cp, NodeOptions::default())
        .await
        .expect("the real node starts");
    let node_name = node.name().to_owned();
    let agents_ns = cp.namespace("cni-agents", &[]).await.expect("namespace");
    let ns = cp
        .namespace("sidecar-app", &[("istio-injection", "enabled")])
        .await
        .expect("namespace");
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let config = GateConfig {
        profiles: vec![Profile::IstioSidecar],
        init_gate: InitGate {
            image: GATE_IMAGE.into(),
            image_pull_policy: "Never".into(),
            command: "/meshgate-wait".into(),
            timeout_seconds: 3,
            ..InitGate::default()
        },
        ..GateConfig::default()
    };
    let webhook = start_webhook(&cp, config.clone()).await;
    register(
        &client,
        &webhook.registration("meshgate", &config, false, false),
    )
    .await;
    // A pod as Istio's injector leaves it in CNI mode: the proxy a container, the injection
    // status, and (the project's choice here) outbound capture of the pod network only.
    let injected = |name: &str| -> Pod {
        serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "annotations": {
                "sidecar.istio.io/status": "{\"initContainers\":[],\"containers\":[\"istio-proxy\"]}",
                "traffic.sidecar.istio.io/includeOutboundIPRanges": meshgate_testenv::node::POD_CIDR,
            }},
            "spec": {
                "nodeName": node_name,
                "restartPolicy": "Never",
                "automountServiceAccountToken": false,
                "enableServiceLinks": false,
                "terminationGracePeriodSeconds": 1,
                "containers": [
                    {"name": "app", "image": APP_IMAGE, "imagePullPolicy": "Never"},
                    {"name": "istio-proxy", "image": APP_IMAGE, "imagePullPolicy": "Never", "args": ["proxy", "sidecar"]},
                ],
            },
        }))
        .expect("pod")
    };
    let want = "gated: --redirect-check 15001 --redirect-target 10.244.0.1:80";
    let mut n = 0;
    wait_for(
        "the webhook to gate injected pods",
        Duration::from_secs(30),
        || {
            n += 1;
            let (pods, probe) = (pods.clone(), injected(&format!("probe-{n}")));
            async move {
                let dry = PostParams {
                    dry_run: true,
                    ..Default::default()
                };
                pods.create(&dry, &probe).await.ok().is_some_and(|p| {
                    p.metadata
                        .annotations
                        .unwrap_or_default()
                        .get("meshgate.dev/gate")
                        .map(String::as_str)
                        == Some(want)
                })
            }
        },
    )
    .await;

    // Before the CNI agent: no redirect, the gate times out (exit 1), the pod fails.
    pods.create(&PostParams::default(), &injected("early"))
        .await
        .expect("pod");
    let failed = wait_pod(
        &pods,
        &node,
        "early",
        "the gate to time out",
        Duration::from_secs(60),
        |p| phase(p) == "Failed",
    )
    .await;
    let terminated = init_status(&failed, "meshgate-wait")
        .and_then(|s| s.state.as_ref()?.terminated.clone())
        .expect("the gate terminated");
    assert_eq!(terminated.exit_code, 1, "{terminated:?}");
    let line = gate_log_line(&node, &ns, &failed);
    eprintln!("measured: early pod's gate: meshgate-wait: {line}");
    assert!(
        line.contains("timed out") && line.contains("redirect-check 15001"),
        "{line}"
    );

    // A Deployment's pod, created before the agent too: its gate keeps timing out (the kubelet
    // restarts it in the same sandbox, which never gets the redirect).
    let deployments: Api<k8s_openapi::api::apps::v1::Deployment> =
        Api::namespaced(client.clone(), &ns);
    let mut template = serde_json::to_value(injected("template")).expect("template");
    template["metadata"]["labels"] = json!({"app": "web"});
    template["metadata"]
        .as_object_mut()
        .expect("metadata")
        .remove("name");
    template["spec"]["restartPolicy"] = json!("Always");
    template["spec"]
        .as_object_mut()
        .expect("spec")
        .remove("nodeName");
    let deployment: k8s_openapi::api::apps::v1::Deployment = serde_json::from_value(json!({
        "metadata": {"name": "web"},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "web"}}, "template": template},
    }))
    .expect("deployment");
    deployments
        .create(&PostParams::default(), &deployment)
        .await
        .expect("deployment created");
    let gate_failed = |p: &Pod| {
        init_status(p, "meshgate-wait").is_some_and(|s| {
            let exit = |t: Option<&k8s_openapi::api::core::v1::ContainerStateTerminated>| {
                t.is_some_and(|t| t.exit_code == 1)
            };
            exit(s.state.as_ref().and_then(|st| st.terminated.as_ref()))
                || exit(s.last_state.as_ref().and_then(|st| st.terminated.as_ref()))
        })
    };
    let web_pods = |pods: Api<Pod>| async move {
        pods.list(&kube::api::ListParams::default().labels("app=web"))
            .await
            .map(|l| l.items)
            .unwrap_or_default()
    };
    wait_for(
        "the Deployment's gate to time out",
        Duration::from_secs(60),
        || {
            let pods = pods.clone();
            async move { web_pods(pods).await.iter().any(gate_failed) }
        },
    )
    .await;
    let early_uid = web_pods(pods.clone()).await[0]
        .metadata
        .uid
        .clone()
        .expect("uid");

    // The CNI agent: ready after its delay, with the plugin chained in.
    let entry = json!({"excludeNamespaces": ["kube-system", agents_ns]}).to_string();
    let ds: DaemonSet = serde_json::from_value(json!({
        "metadata": {"name": "mesh-cni-agent"},
        "spec": {
            "selector": {"matchLabels": {"app": "mesh-cni-agent"}},
            "template": {
                "metadata": {"labels": {"app": "mesh-cni-agent"}},
                "spec": {
                    "automountServiceAccountToken": false,
                    "enableServiceLinks": false,
                    "terminationGracePeriodSeconds": 1,
                    "tolerations": [{"operator": "Exists"}],
                    "containers": [{
                        "name": "cni-agent", "image": AGENTS_IMAGE, "imagePullPolicy": "Never",
                        "command": ["/mesh-cni-agent", "--cni-conf-dir", "/host/net.d", "--cni-bin-dir", "/host/bin",
                                    "--plugin", "/mesh-cni", "--ready-delay", "1", "--ready-file", "/tmp/ready",
                                    "--entry", entry],
                        "readinessProbe": {"exec": {"command": ["/mesh-cni-agent", "--check-ready", "/tmp/ready"]},
                                           "periodSeconds": 1},
                        "volumeMounts": [{"name": "net-d", "mountPath": "/host/net.d"}, {"name": "bin", "mountPath": "/host/bin"}],
                    }],
                    "volumes": [
                        {"name": "net-d", "hostPath": {"path": node.cni_conf_dir(), "type": "Directory"}},
                        {"name": "bin", "hostPath": {"path": node.cni_bin_dir(), "type": "Directory"}},
                    ],
                },
            },
        },
    }))
    .expect("daemonset");
    Api::<DaemonSet>::namespaced(client.clone(), &agents_ns)
        .create(&PostParams::default(), &ds)
        .await
        .expect("daemonset created");
    let agents: Api<Pod> = Api::namespaced(client.clone(), &agents_ns);
    wait_for(
        "the CNI agent to be Ready",
        Duration::from_secs(60),
        || async {
            agents
                .list(&Default::default())
                .await
                .ok()
                .is_some_and(|l| {
                    l.items.iter().any(|p| {
                        p.status
                            .as_ref()
                            .and_then(|s| s.conditions.as_ref())
                            .is_some_and(|cs| {
                                cs.iter().any(|c| c.type_ == "Ready" && c.status == "True")
                            })
                    })
                })
        },
    )
    .await;

    // After: the sandbox gets the redirect, the gate passes, the app runs.
    let created = Instant::now();
    pods.create(&PostParams::default(), &injected("late"))
        .await
        .expect("pod");
    let running = wait_pod(
        &pods,
        &node,
        "late",
        "Running",
        Duration::from_secs(60),
        |p| phase(p) == "Running",
    )
    .await;
    eprintln!(
        "measured: pod created after the CNI agent -> Running {:.2?}",
        created.elapsed()
    );
    let gate_done = init_status(&running, "meshgate-wait")
        .and_then(|s| s.state.as_ref()?.terminated.clone())
        .expect("the gate terminated");
    assert_eq!(gate_done.exit_code, 0);
    let line = gate_log_line(&node, &ns, &running);
    eprintln!("measured: late pod's gate: meshgate-wait: {line}");
    assert!(
        line.starts_with("ready after ") && line.contains("redirect-check 15001 via 10.244.0.1:80"),
        "{line}"
    );

    // The repair loop (as the controller's ServiceAccount with `install --repair delete`'s RBAC)
    // deletes the Deployment's timed-out pod; its ReplicaSet recreates it in a new sandbox, which
    // now gets the redirect: the gate passes and the pod runs.
    install_identities_with(
        &client,
        "istio-sidecar",
        "meshgate-system",
        Some(meshgate::install::RepairAction::Delete),
    )
    .await;
    let (stop_repair, stopped) = tokio::sync::oneshot::channel::<()>();
    let kubeconfig = cp.kubeconfig_path.clone();
    let repair_metrics = meshgate_controller::repair::RepairMetrics::new();
    let metrics = repair_metrics.clone();
    background().spawn(async move {
        let client =
            client_as_service_account(&kubeconfig, "meshgate-system", "meshgate-controller").await;
        let settings = meshgate_core::repair::RepairSettings {
            enabled: true,
            action: meshgate_core::repair::RepairAction::Delete,
            rate_per_second: 10.0,
            ..Default::default()
        };
        meshgate_controller::repair::run(
            client,
            meshgate_controller::leader::always(),
            settings,
            metrics,
            async move {
                let _ = stopped.await;
            },
        )
        .await;
    });
    let repaired = Instant::now();
    wait_for(
        "the repair loop to replace the timed-out pod with a running one",
        Duration::from_secs(90),
        || {
            let (pods, early_uid) = (pods.clone(), early_uid.clone());
            async move {
                let all = web_pods(pods).await;
                !all.iter()
                    .any(|p| p.metadata.uid.as_deref() == Some(early_uid.as_str()))
                    && all.iter().any(|p| phase(p) == "Running")
            }
        },
    )
    .await;
    let _ = stop_repair.send(());
    eprintln!(
        "measured: repair -> replacement pod Running {:.2?}",
        repaired.elapsed()
    );
    let replacement = web_pods(pods.clone())
        .await
        .into_iter()
        .find(|p| phase(p) == "Running")
        .expect("running replacement");
    let line = gate_log_line(&node, &ns, &replacement);
    assert!(
        line.starts_with("ready after ") && line.contains("redirect-check 15001"),
        "{line}"
    );

    drop(webhook);
    let before = node.snapshot_before().clone();
    let run_dir = node.run_dir().to_owned();
    node.stop().await.expect("the teardown restores the host");
    assert_host_restored(&before, &run_dir);
}
