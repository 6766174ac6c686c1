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
//! * meshgate installed in the cluster as users install it (`meshgate install --profile P
//!   --image <meshgate's image>`): the webhook and the controller run as Deployments from the
//!   image, under the ServiceAccounts and RBAC `install` renders, against a control plane that
//!   serves pods (`Options::serve_pods`), with kube-controller-manager and kube-proxy.
//!   - Ambient: the kubelet's own Node is tainted at CREATE by the installed admission policy;
//!     the mesh-like CNI agent and node proxy (DaemonSets named as the profile's agents) become
//!     Ready and the in-cluster controller lifts the taint; a gated ambient pod runs once the
//!     node proxy has opened its listener inside the pod, and again after its sandbox died;
//!     policy backfill of a Deployment, a StatefulSet and a DaemonSet succeeds under the
//!     controller's RBAC, which has no pod writes without repair.
//!   - Sidecar, with `--repair delete`: pods created before the CNI agent has chained
//!     `mesh-cni` into the node's CNI configuration get no redirect and their gates time out
//!     (exit 1); the in-cluster controller deletes the Deployment's; once the agent is Ready
//!     the taint lifts, new pods are redirected and their gates pass, and the Deployment's
//!     replacement runs.
//!   - No component's log shows a refused request; in the ambient install (a healthy run)
//!     none logs an ERROR or WARN line.
//! * meshgate installed with the real Helm (the chart, from meshgate's image), a node held by
//!   its taint: `helm uninstall` runs the chart's pre-delete hook (`meshgate uninstall` in a Job
//!   on that node) and leaves no taint, NodeGate or grant behind.
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

use common::cluster::*;
use common::*;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, Patch, PatchParams, PostParams};
use meshgate_api::config::{GateCheck, InitGate};
use meshgate_api::{GateConfig, Profile};
use meshgate_testenv::host::{self, HostSnapshot};
use meshgate_testenv::image::{APP_IMAGE, GATE_IMAGE};
use meshgate_testenv::node::{NodeOptions, RealNode, STATE_DIR};
use serde_json::json;

/// Set for the child process of the sweep test: the file to write the run directory to.
const CHILD_ENV: &str = "MESHGATE_REAL_NODE_CRASHING_CHILD";

/// One node per host: the tests of this binary take turns (the host lock would serialize the
/// nodes, but the sweep test's snapshot must also be taken while no node runs).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
const AMBIENT: (&str, &str) = ("istio.io/dataplane-mode", "ambient");
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
    // The child builds the static binaries before it starts its node. Built here first (the
    // child inherits this environment, so its build is a no-op): the wait below is for the
    // node, not for a cold build, which takes minutes on 2 cores (found on a fresh machine).
    tokio::task::spawn_blocking(meshgate_testenv::image::static_binaries)
        .await
        .expect("build task")
        .expect("static binaries");
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
            .all(|n| node_pids(n, &run_dir).is_empty());
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
/// The taint keys of a Node's first version seen, once seen.
type FirstTaints = std::sync::Arc<std::sync::Mutex<Option<Vec<String>>>>;

/// Records the taint keys of the first version of Node `name` seen by a watch started now,
/// before the Node exists: whether it was tainted at CREATE. The client must not time out
/// while the node starts (build the images first: `meshgate_testenv::image::static_binaries`).
fn watch_first_taints(
    nodes: &Api<k8s_openapi::api::core::v1::Node>,
    name: &str,
) -> (tokio::task::JoinHandle<()>, FirstTaints) {
    use futures::StreamExt;
    let first = std::sync::Arc::new(std::sync::Mutex::new(None::<Vec<String>>));
    let (seen, nodes, name) = (first.clone(), nodes.clone(), name.to_owned());
    let task = tokio::spawn(async move {
        let cfg =
            kube::runtime::watcher::Config::default().fields(&format!("metadata.name={name}"));
        let mut stream = kube::runtime::watcher(nodes, cfg).boxed();
        while let Some(ev) = stream.next().await {
            if let Ok(
                kube::runtime::watcher::Event::Apply(n)
                | kube::runtime::watcher::Event::InitApply(n),
            ) = ev
            {
                let keys: Vec<String> = n
                    .spec
                    .and_then(|s| s.taints)
                    .unwrap_or_default()
                    .into_iter()
                    .map(|t| t.key)
                    .collect();
                let mut f = seen
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                if f.is_none() {
                    *f = Some(keys);
                }
            }
        }
    });
    (task, first)
}

// meshgate in the cluster, as users install it: `meshgate install --profile P --image
// <meshgate's image>` against a control plane that serves pods (`Options::serve_pods`:
// ServiceAccount tokens, the `kubernetes` Service through kube-proxy). The webhook and the
// controller run as Deployments from the image the test environment writes (both static
// binaries), under the ServiceAccounts and RBAC `install` rendered; the API server calls the
// webhook through its Service.

/// Sum of `VmRSS` of these processes, in MiB (processes gone meanwhile count zero).
fn rss_mib(pids: impl IntoIterator<Item = u32>) -> f64 {
    let bytes: u64 = pids
        .into_iter()
        .filter_map(|p| meshgate_testenv::measure::memory(p).ok())
        .map(|(_, rss)| rss)
        .sum();
    bytes as f64 / (1024.0 * 1024.0)
}

/// The memory of the whole local cluster: control plane, node, shims, pods.
fn cluster_memory(cp: &meshgate_testenv::ControlPlane, node: &RealNode) -> String {
    let mut pids: Vec<u32> = cp.pids();
    pids.extend(node.pids().into_iter().map(|(_, p)| p));
    pids.extend(host::pod_processes(node.snapshot_before()));
    pids.extend(host::pids_named("containerd-shim"));
    pids.sort_unstable();
    pids.dedup();
    let mut by_name = std::collections::BTreeMap::<String, Vec<u32>>::new();
    for p in &pids {
        let comm = std::fs::read_to_string(format!("/proc/{p}/comm")).unwrap_or_default();
        by_name.entry(comm.trim().to_owned()).or_default().push(*p);
    }
    let parts: Vec<String> = by_name
        .iter()
        .map(|(name, ps)| format!("{name} {:.0}", rss_mib(ps.iter().copied())))
        .collect();
    format!(
        "{:.0} MiB RSS in {} processes ({})",
        rss_mib(pids.iter().copied()),
        pids.len(),
        parts.join(", ")
    )
}

/// Creates the profile's agents as the mesh-like stand-ins, under the names its NodeGate
/// selects (namespace, DaemonSet, label): the CNI agent (Ready `cni_delay` s after its start,
/// once it has chained its plugin into the node's CNI configuration; `meshgate-system` and the
/// agents' namespace excluded from the redirect) and the node proxy (Ready after 3 s; it
/// enrols each pod 2 s after its sandbox appears, opening the in-pod listener).
async fn create_agents(client: &kube::Client, node: &RealNode, profile: Profile, cni_delay: u32) {
    use k8s_openapi::api::apps::v1::DaemonSet;
    use k8s_openapi::api::core::v1::Namespace;
    use meshgate_testenv::image::AGENTS_IMAGE;
    let record = profile.record();
    let mut namespaces: Vec<&str> = record.agents.iter().map(|a| a.namespace).collect();
    namespaces.dedup();
    for ns in &namespaces {
        Api::<Namespace>::all(client.clone())
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({"metadata": {"name": ns}})).expect("namespace"),
            )
            .await
            .expect("agents' namespace");
    }
    let mut excluded = vec!["kube-system", "meshgate-system"];
    excluded.extend(&namespaces);
    let entry = json!({ "excludeNamespaces": excluded }).to_string();
    for agent in record.agents {
        let (command, privileged, volumes, mounts) = if agent.name == "cni" {
            (
                json!([
                    "/mesh-cni-agent",
                    "--cni-conf-dir",
                    "/host/net.d",
                    "--cni-bin-dir",
                    "/host/bin",
                    "--plugin",
                    "/mesh-cni",
                    "--ready-delay",
                    cni_delay.to_string(),
                    "--ready-file",
                    "/tmp/ready",
                    "--entry",
                    entry
                ]),
                false,
                json!([{"name": "net-d", "hostPath": {"path": node.cni_conf_dir(), "type": "Directory"}},
                       {"name": "bin", "hostPath": {"path": node.cni_bin_dir(), "type": "Directory"}}]),
                json!([{"name": "net-d", "mountPath": "/host/net.d"}, {"name": "bin", "mountPath": "/host/bin"}]),
            )
        } else {
            (
                json!([
                    "/mesh-node-proxy",
                    "--ready-delay",
                    "3",
                    "--enrol-delay",
                    "2",
                    "--ready-file",
                    "/tmp/ready"
                ]),
                true,
                json!([]),
                json!([]),
            )
        };
        let binary = command[0].as_str().unwrap_or_default().to_owned();
        let (k, v) = agent.label;
        let ds: DaemonSet = serde_json::from_value(json!({
            "metadata": {"name": agent.daemon_set},
            "spec": {
                "selector": {"matchLabels": {k: v}},
                "template": {
                    "metadata": {"labels": {k: v}},
                    "spec": {
                        "hostPID": privileged,
                        "automountServiceAccountToken": false,
                        "enableServiceLinks": false,
                        "terminationGracePeriodSeconds": 1,
                        "tolerations": [{"operator": "Exists"}],
                        "containers": [{
                            "name": "agent", "image": AGENTS_IMAGE, "imagePullPolicy": "Never",
                            "command": command,
                            "securityContext": {"privileged": privileged},
                            "readinessProbe": {"exec": {"command": [binary, "--check-ready", "/tmp/ready"]},
                                               "periodSeconds": 1},
                            "volumeMounts": mounts,
                        }],
                        "volumes": volumes,
                    },
                },
            },
        }))
        .expect("daemonset");
        Api::<DaemonSet>::namespaced(client.clone(), agent.namespace)
            .create(&PostParams::default(), &ds)
            .await
            .expect("agent daemonset");
    }
}

/// The ambient profile in the cluster:
/// * the kubelet's Node is tainted at CREATE by the installed admission policy; the mesh-like
///   CNI agent and node proxy (DaemonSets named as the profile's agents) become Ready, and the
///   in-cluster controller lifts the taint;
/// * a pod of an ambient namespace, gated by the in-cluster webhook and placed by the
///   scheduler, stays in Init until the node-proxy stand-in opens its in-pod listener, then
///   runs; its gate's log names what it waited for and how long; when its sandbox dies (pause
///   killed), the gate runs again in the new sandbox and holds until the stand-in has set that
///   one up;
/// * policy backfill by the in-cluster controller patches a Deployment's, a StatefulSet's and a
///   DaemonSet's pod templates under its installed RBAC; without repair neither component may
///   write pods (SubjectAccessReviews), and no component's log shows a refused request;
/// * the teardown restores the host and removes the API server's link.
#[tokio::test]
async fn ambient_meshgate_installed_from_its_image_gates_the_real_node() {
    use k8s_openapi::api::apps::v1::{DaemonSet, Deployment, StatefulSet};
    use k8s_openapi::api::core::v1::Node;
    use meshgate_api::MutationPolicy;
    use meshgate_testenv::image::MESHGATE_IMAGE;

    if !can_run() {
        return;
    }
    let _serial = SERIAL.lock().await;
    let cp = serving_control_plane().await;
    let setup = Instant::now();
    let client = cp.client().await.expect("client");
    meshgate_cli(
        &cp,
        &[
            "install",
            "--profile",
            "istio-ambient",
            "--strategy",
            "pod",
            "--image",
            MESHGATE_IMAGE,
            "--apply",
        ],
    );
    let nodes: Api<Node> = Api::all(client.clone());
    wait_node_taint_policy(&nodes).await;
    let node_name = NodeOptions::default().name;
    // The Node's first version, watched from before it exists: tainted at CREATE?
    let (watch, first_taints) = watch_first_taints(&nodes, &node_name);
    let node = RealNode::start(
        &cp,
        NodeOptions {
            proxy: true,
            ..NodeOptions::default()
        },
    )
    .await
    .expect("the real node starts");
    let node_ready = Instant::now();
    watch.abort();
    let first = first_taints
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    assert!(
        first.as_ref().is_some_and(|k| k
            .iter()
            .any(|k| k == meshgate_api::names::STARTUP_TAINT_KEY)),
        "the kubelet's Node was tainted at CREATE by the installed policy: first seen taints {first:?}"
    );
    create_agents(&client, &node, Profile::IstioAmbient, 1).await;
    wait_meshgate_ready(&client, &node).await;
    eprintln!(
        "measured: node Ready -> meshgate's webhook and controller Ready in the cluster {:.2?}",
        node_ready.elapsed()
    );
    wait_taint_lifted(&client, &node, Duration::from_secs(90)).await;
    eprintln!(
        "measured: node Ready -> startup taint lifted by the in-cluster controller {:.2?} (agents Ready after 1 s and 3 s)",
        node_ready.elapsed()
    );
    assert!(
        node_ready.elapsed() >= Duration::from_secs(3),
        "not lifted before the node proxy was Ready"
    );
    let setup_took = setup.elapsed();

    // The certificates are the controller's, made in the cluster; installing again (as an
    // upgrade does) keeps the CA and the caBundle.
    let ca_of = || async {
        let secret = Api::<k8s_openapi::api::core::v1::Secret>::namespaced(
            client.clone(),
            "meshgate-system",
        )
        .get("meshgate-ca")
        .await
        .expect("the controller created the CA Secret");
        let mwc =
            Api::<k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration>::all(
                client.clone(),
            )
            .get("meshgate")
            .await
            .expect("configuration");
        let bundles: Vec<Vec<u8>> = mwc
            .webhooks
            .unwrap_or_default()
            .into_iter()
            .map(|h| h.client_config.ca_bundle.map(|b| b.0).unwrap_or_default())
            .collect();
        (
            secret.data.unwrap_or_default().get("ca.crt").cloned(),
            bundles,
        )
    };
    let (ca_before, bundles_before) = ca_of().await;
    assert!(ca_before.is_some() && bundles_before.iter().all(|b| !b.is_empty()));
    meshgate_cli(
        &cp,
        &[
            "install",
            "--profile",
            "istio-ambient",
            "--strategy",
            "pod",
            "--image",
            MESHGATE_IMAGE,
            "--apply",
        ],
    );
    assert_eq!(
        ca_of().await,
        (ca_before, bundles_before),
        "install again kept the CA and caBundle"
    );
    // A healthy install passes every check (components, certificate against the caBundle,
    // agents, RBAC, gates); `meshgate_cli` requires exit 0.
    let report = meshgate_cli(&cp, &["check"]);
    assert!(report.contains("checks passed"), "{report}");
    assert!(!report.contains("[FAIL]"), "{report}");

    // A pod of an ambient namespace: the in-cluster webhook gates it; the scheduler places it;
    // the gate holds it until the node-proxy stand-in opens the in-pod listener.
    let ns = cp
        .namespace("in-cluster-app", &[AMBIENT])
        .await
        .expect("namespace");
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    wait_webhook_mutates(&pods, "the in-cluster webhook to gate pods", |p| {
        gate(p).is_some()
    })
    .await;
    let created = Instant::now();
    let pod = pods
        .create(&PostParams::default(), &scheduled_pod("web"))
        .await
        .expect("pod");
    let g = gate(&pod).expect("the in-cluster webhook injected meshgate-wait");
    assert_eq!(
        g.image.as_deref(),
        Some(MESHGATE_IMAGE),
        "the gate runs from meshgate's image"
    );
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
        "measured: in-cluster gated pod create -> Running {:.2?}",
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

    // Policy backfill by the in-cluster controller, under its installed RBAC: the pod templates
    // of a Deployment, a StatefulSet and a DaemonSet that exist before the policy.
    let apps = cp.namespace("backfill", &[]).await.expect("namespace");
    let template = json!({
        "metadata": {"labels": {"app": "w"}},
        "spec": {"containers": [{"name": "app", "image": APP_IMAGE, "imagePullPolicy": "Never"}],
                 "nodeSelector": {"meshgate.dev/no-such-node": "true"}},
    });
    let spec = json!({"selector": {"matchLabels": {"app": "w"}}, "template": template});
    let mut dspec = spec.clone();
    dspec["replicas"] = json!(0);
    Api::<Deployment>::namespaced(client.clone(), &apps)
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "w"}, "spec": dspec}))
                .expect("deployment"),
        )
        .await
        .expect("deployment");
    let mut sspec = dspec.clone();
    sspec["serviceName"] = json!("w");
    Api::<StatefulSet>::namespaced(client.clone(), &apps)
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "w"}, "spec": sspec}))
                .expect("statefulset"),
        )
        .await
        .expect("statefulset");
    Api::<DaemonSet>::namespaced(client.clone(), &apps)
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "w"}, "spec": spec}))
                .expect("daemonset"),
        )
        .await
        .expect("daemonset");
    let policy: MutationPolicy = serde_json::from_value(json!({
        "apiVersion": "meshgate.dev/v1alpha1", "kind": "MutationPolicy",
        "metadata": {"name": "in-cluster-backfill"},
        "spec": {
            "match": {"kinds": ["Pod"], "namespaces": [apps]},
            "podTemplates": true,
            "existing": {"enabled": true, "ratePerSecond": 100},
            "mutations": [{"annotations": {"values": {"meshgate.test/backfilled": "yes"}}}],
        },
    }))
    .expect("policy");
    Api::<MutationPolicy>::all(client.clone())
        .create(&PostParams::default(), &policy)
        .await
        .expect("policy");
    let annotated = |meta: Option<&k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta>| {
        meta.and_then(|m| m.annotations.as_ref())
            .and_then(|a| a.get("meshgate.test/backfilled"))
            .is_some_and(|v| v == "yes")
    };
    let policy_created = Instant::now();
    let backfilled = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            let d = Api::<Deployment>::namespaced(client.clone(), &apps)
                .get("w")
                .await;
            let s = Api::<StatefulSet>::namespaced(client.clone(), &apps)
                .get("w")
                .await;
            let ds = Api::<DaemonSet>::namespaced(client.clone(), &apps)
                .get("w")
                .await;
            let done = [
                d.ok()
                    .and_then(|d| d.spec)
                    .map(|s| annotated(s.template.metadata.as_ref())),
                s.ok()
                    .and_then(|s| s.spec)
                    .map(|s| annotated(s.template.metadata.as_ref())),
                ds.ok()
                    .and_then(|d| d.spec)
                    .map(|s| annotated(s.template.metadata.as_ref())),
            ];
            if done.iter().all(|d| *d == Some(true)) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await;
    let status = Api::<MutationPolicy>::all(client.clone())
        .get("in-cluster-backfill")
        .await
        .expect("policy")
        .status;
    eprintln!(
        "measured: policy created -> three workloads backfilled by the in-cluster controller {:.2?}",
        policy_created.elapsed()
    );
    assert!(
        backfilled.is_ok(),
        "the in-cluster controller backfilled the Deployment, StatefulSet and DaemonSet: policy status {}",
        serde_json::to_string_pretty(&status).unwrap_or_default()
    );

    // A rolling restart of the webhook (as `kubectl rollout restart` does) while mesh pods are
    // created without pause (dry run: through admission like any create): every one carries its
    // gate and none fails. Each old webhook pod serves through its preStop sleep while its
    // endpoint leaves the Service (kube-proxy on this node), then drains and exits.
    let (created, ungated, errors, took) = restart_webhook_under_load(&client, &pods).await;
    eprintln!(
        "measured: rolling restart of the webhook (2 replicas) under load: {created} mesh pods created during it, {} without their gate, {} failed ({took:.2?})",
        ungated.len(),
        errors.len()
    );
    assert!(created > 0, "pods were created during the restart");
    // Why the API server admitted a pod ungated: its log says what the call to the webhook met.
    let failing_open: Vec<String> = std::fs::read_to_string(cp.dir().join("kube-apiserver.log"))
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("failed calling webhook") || l.contains("failing open"))
        .map(str::to_owned)
        .collect();
    assert!(
        ungated.is_empty(),
        "admitted without their gate: {ungated:?}; the API server's log: {:?}",
        &failing_open[failing_open.len().saturating_sub(5)..]
    );
    assert!(errors.is_empty(), "creates failed: {errors:?}");

    // What the installed identities hold without repair: no pod writes (the matrix per feature
    // is tests/install.rs).
    for (sa, verb, resource) in [
        ("meshgate-controller", "patch", "pods"),
        ("meshgate-controller", "delete", "pods"),
        ("meshgate-controller", "list", "secrets"),
        ("meshgate-webhook", "patch", "pods"),
        ("meshgate-webhook", "get", "secrets"),
    ] {
        assert!(
            !service_account_may(&client, sa, verb, resource).await,
            "{sa} may {verb} {resource}"
        );
    }
    assert!(
        service_account_may(&client, "meshgate-controller", "patch", "nodes").await,
        "the controller may patch nodes"
    );
    assert_no_refused_requests(&client, &node).await;
    assert_no_warnings_or_errors(&client, &node).await;
    eprintln!(
        "measured: in-cluster set-up {setup_took:.2?} (install, node, meshgate Ready, taint lifted); whole local cluster: {}",
        cluster_memory(&cp, &node)
    );
    drop(client);
    tear_down(cp, node).await;
}

/// Restarts the installed webhook's Deployment (a new pod template) and creates mesh pods in
/// `pods`' namespace (dry run) until the rollout has finished and the old pods are gone: how
/// many were created, the ones without the gate, the failed creates, and how long it took.
async fn restart_webhook_under_load(
    client: &kube::Client,
    pods: &Api<Pod>,
) -> (usize, Vec<String>, Vec<String>, Duration) {
    use k8s_openapi::api::apps::v1::Deployment;
    let deployments = Api::<Deployment>::namespaced(client.clone(), "meshgate-system");
    let webhook_pods = Api::<Pod>::namespaced(client.clone(), "meshgate-system");
    let selector = "app.kubernetes.io/name=meshgate,app.kubernetes.io/component=webhook";
    let old: Vec<String> = webhook_pods
        .list(&kube::api::ListParams::default().labels(selector))
        .await
        .expect("webhook pods")
        .items
        .into_iter()
        .filter_map(|p| p.metadata.name)
        .collect();
    let stamp = k8s_openapi::jiff::Timestamp::now().to_string();
    deployments
        .patch(
            "meshgate-webhook",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"template": {"metadata": {"annotations": {
                "meshgate.test/restarted-at": stamp}}}}})),
        )
        .await
        .expect("rollout restart");
    let started = Instant::now();
    let dry = PostParams {
        dry_run: true,
        ..Default::default()
    };
    let (mut created, mut ungated, mut errors) = (0, Vec::new(), Vec::new());
    loop {
        let name = format!("during-restart-{created}");
        match pods.create(&dry, &scheduled_pod(&name)).await {
            Ok(p) if gate(&p).is_some() => {}
            Ok(_) => ungated.push(name),
            Err(e) => errors.push(format!("{name}: {e}")),
        }
        created += 1;
        if created % 20 == 0 {
            let now: Vec<Pod> = webhook_pods
                .list(&kube::api::ListParams::default().labels(selector))
                .await
                .expect("webhook pods")
                .items;
            let old_gone = now
                .iter()
                .all(|p| !old.contains(p.metadata.name.as_ref().expect("name")));
            let ready = now
                .iter()
                .filter(|p| {
                    p.status
                        .as_ref()
                        .and_then(|s| s.conditions.as_ref())
                        .is_some_and(|cs| {
                            cs.iter().any(|c| c.type_ == "Ready" && c.status == "True")
                        })
                })
                .count();
            if old_gone && ready == 2 {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(180),
                "the webhook's rollout did not finish in 180 s"
            );
        }
    }
    (created, ungated, errors, started.elapsed())
}

/// The sidecar profile in the cluster, with the repair loop (`install --repair delete`) and a
/// 3 s gate timeout (the rendered ConfigMap edited before applying, as users edit manifests):
/// * pods whose sandboxes are created before the CNI stand-in's agent has chained `mesh-cni`
///   into the node's CNI configuration get no redirect: a bare pod's gate times out with exit
///   code 1, naming its check; a Deployment's pods time out too, and the in-cluster controller
///   deletes them (Events `MeshRepairDeleted`) under its installed RBAC;
/// * once the agent is Ready, the in-cluster controller lifts the startup taint, a pod created
///   then is redirected and its gate passes, and the Deployment's replacement pod runs;
/// * the controller may patch and delete pods (repair), and no component's log shows a
///   refused request; the teardown restores the host.
#[tokio::test]
async fn sidecar_meshgate_installed_from_its_image_repairs_pods_that_started_before_the_cni_agent()
{
    use k8s_openapi::api::apps::v1::Deployment;
    use meshgate_testenv::image::MESHGATE_IMAGE;

    if !can_run() {
        return;
    }
    let _serial = SERIAL.lock().await;
    let cp = serving_control_plane().await;
    let client = cp.client().await.expect("client");
    let rendered = meshgate_cli(
        &cp,
        &[
            "install",
            "--profile",
            "istio-sidecar",
            "--strategy",
            "pod",
            "--image",
            MESHGATE_IMAGE,
            "--repair",
            "delete",
        ],
    );
    let mut docs =
        meshgate::render::parse_documents("install output", &rendered).expect("manifests");
    let config = docs
        .iter_mut()
        .find(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"] == "meshgate-config")
        .expect("the gate ConfigMap");
    let mut gate_config: GateConfig =
        serde_saphyr::from_str(config["data"]["config.yaml"].as_str().expect("config.yaml"))
            .expect("gate config");
    gate_config.init_gate.timeout_seconds = 3;
    config["data"]["config.yaml"] =
        json!(serde_saphyr::to_string(&gate_config).expect("config yaml"));
    meshgate::install::apply(&client, &docs, false, |_| {})
        .await
        .expect("manifests applied");
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    wait_node_taint_policy(&nodes).await;
    let node = RealNode::start(
        &cp,
        NodeOptions {
            proxy: true,
            ..NodeOptions::default()
        },
    )
    .await
    .expect("the real node starts");
    let node_name = node.name().to_owned();
    wait_meshgate_ready(&client, &node).await;

    // A second gate over the same CNI agent, keyed with the prefix Karpenter treats as a known
    // startup taint and the node-readiness-controller keys its rules with: the node registered
    // before it existed, so the in-cluster controller (as its installed ServiceAccount) puts its
    // key on the real node while the agent is not Ready, and lifts it with the agent.
    const READINESS_KEY: &str = "readiness.k8s.io/mesh";
    let cni = Profile::IstioSidecar.record().agents[0];
    let readiness_gate: meshgate_api::NodeGate = serde_json::from_value(json!({
        "apiVersion": "meshgate.dev/v1alpha1", "kind": "NodeGate",
        "metadata": {"name": "readiness"},
        "spec": {
            "taint": {"key": READINESS_KEY},
            "agents": [{"name": cni.name, "namespace": cni.namespace, "daemonSet": cni.daemon_set,
                        "selector": {"matchLabels": {cni.label.0: cni.label.1}}}],
        },
    }))
    .expect("gate");
    Api::<meshgate_api::NodeGate>::all(client.clone())
        .create(&PostParams::default(), &readiness_gate)
        .await
        .expect("the readiness.k8s.io gate");
    let node_taints = |nodes: Api<k8s_openapi::api::core::v1::Node>, name: String| async move {
        nodes
            .get(&name)
            .await
            .ok()
            .and_then(|n| n.spec?.taints)
            .unwrap_or_default()
            .into_iter()
            .map(|t| t.key)
            .collect::<Vec<_>>()
    };
    meshgate_testenv::wait_for(
        "the controller to put readiness.k8s.io/mesh on the real node",
        Duration::from_secs(60),
        || {
            let f = node_taints(nodes.clone(), node_name.clone());
            async move { f.await.iter().any(|k| k == READINESS_KEY) }
        },
    )
    .await;

    let ns = cp
        .namespace("sidecar-app", &[("istio-injection", "enabled")])
        .await
        .expect("namespace");
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    // A pod as Istio's injector leaves it in CNI mode: the proxy a container, the injection
    // status, and (the project's choice here) outbound capture of the pod network only, so no
    // probe ever leaves this machine. Bound to the node (`nodeName`): the node is still
    // tainted, as after an agent's restart on a running node.
    let injected = |name: &str, bound: bool| -> Pod {
        let mut p: Pod = serde_json::from_value(json!({
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
        .expect("pod");
        if !bound && let Some(spec) = p.spec.as_mut() {
            spec.node_name = None;
        }
        p
    };
    let want = "gated: --redirect-check 15001 --redirect-target 10.244.0.1:80";
    let mut n = 0;
    wait_for(
        "the in-cluster webhook to gate injected pods",
        Duration::from_secs(60),
        || {
            n += 1;
            let (pods, probe) = (pods.clone(), injected(&format!("probe-{n}"), true));
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
    pods.create(&PostParams::default(), &injected("early", true))
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

    // A Deployment's pods, created before the agent too: their gates time out, and the
    // in-cluster controller deletes them; each replacement is early as well, until the agent
    // has chained its plugin.
    let mut template = serde_json::to_value(injected("template", true)).expect("template");
    template["metadata"] =
        json!({"labels": {"app": "web"}, "annotations": template["metadata"]["annotations"]});
    template["spec"]["restartPolicy"] = json!("Always");
    let deployment: Deployment = serde_json::from_value(json!({
        "metadata": {"name": "web"},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "web"}}, "template": template},
    }))
    .expect("deployment");
    Api::<Deployment>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &deployment)
        .await
        .expect("deployment created");
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client.clone(), &ns);
    let repaired = |events: Api<k8s_openapi::api::events::v1::Event>| async move {
        events
            .list(&Default::default())
            .await
            .map(|l| l.items)
            .unwrap_or_default()
            .into_iter()
            .filter(|e| {
                e.reason.as_deref() == Some(meshgate_controller::repair::EVENT_DELETED)
                    && e.regarding
                        .as_ref()
                        .and_then(|r| r.name.as_deref())
                        .is_some_and(|n| n.starts_with("web-"))
            })
            .collect::<Vec<_>>()
    };
    wait_for(
        "the in-cluster controller to delete a Deployment pod whose gate timed out",
        Duration::from_secs(60),
        || {
            let events = events.clone();
            async move { !repaired(events).await.is_empty() }
        },
    )
    .await;
    let deleted = repaired(events.clone()).await;
    eprintln!(
        "measured: repair Event: {:?} by {:?}",
        deleted[0].note, deleted[0].reporting_controller
    );

    // The CNI agent: Ready after 1 s, with the plugin chained in; the controller lifts the taint.
    let agent_started = Instant::now();
    create_agents(&client, &node, Profile::IstioSidecar, 1).await;
    wait_taint_lifted(&client, &node, Duration::from_secs(60)).await;
    eprintln!(
        "measured: CNI agent created -> startup taint lifted by the in-cluster controller {:.2?}",
        agent_started.elapsed()
    );
    meshgate_testenv::wait_for(
        "the controller to lift readiness.k8s.io/mesh with the agent Ready",
        Duration::from_secs(60),
        || {
            let f = node_taints(nodes.clone(), node_name.clone());
            async move { !f.await.iter().any(|k| k == READINESS_KEY) }
        },
    )
    .await;

    // After: a pod placed by the scheduler is redirected, its gate passes, the app runs.
    let created = Instant::now();
    pods.create(&PostParams::default(), &injected("late", false))
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

    // The Deployment's pod runs in the end: a replacement whose sandbox got the redirect.
    wait_for("a Deployment pod to run", Duration::from_secs(90), || {
        let pods = pods.clone();
        async move {
            pods.list(&kube::api::ListParams::default().labels("app=web"))
                .await
                .is_ok_and(|l| l.items.iter().any(|p| phase(p) == "Running"))
        }
    })
    .await;
    let replacement = pods
        .list(&kube::api::ListParams::default().labels("app=web"))
        .await
        .expect("pods")
        .items
        .into_iter()
        .find(|p| phase(p) == "Running")
        .expect("running replacement");
    let deleted_uids: Vec<_> = deleted
        .iter()
        .filter_map(|e| e.regarding.as_ref()?.uid.clone())
        .collect();
    assert!(
        !deleted_uids.contains(replacement.metadata.uid.as_ref().expect("uid")),
        "the running pod is a replacement"
    );
    let line = gate_log_line(&node, &ns, &replacement);
    assert!(
        line.starts_with("ready after ") && line.contains("redirect-check 15001"),
        "{line}"
    );

    assert!(
        service_account_may(&client, "meshgate-controller", "create", "pods/eviction").await,
        "with --repair delete the controller may evict pods"
    );
    assert!(
        !service_account_may(&client, "meshgate-controller", "delete", "pods").await,
        "the controller evicts, it never deletes pods outright"
    );
    assert!(
        !service_account_may(&client, "meshgate-webhook", "delete", "pods").await,
        "the webhook may not delete pods"
    );
    assert_no_refused_requests(&client, &node).await;
    drop(client);
    tear_down(cp, node).await;
}

/// The node's active CNI configuration (`10-meshgate.conflist`) with the mesh stand-in's plugin
/// entry taken out (returned) or put back, replaced at once as mesh CNI agents write it. Taking
/// it out is what Istio's (sidecar) and Linkerd's CNI agents do when they stop.
fn mesh_plugin_entry(node: &RealNode, put_back: Option<&serde_json::Value>) -> serde_json::Value {
    let path = node.cni_conf_dir().join("10-meshgate.conflist");
    let mut conf: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("conflist")).expect("json");
    let plugins = conf["plugins"].as_array_mut().expect("plugins");
    let taken = plugins
        .iter()
        .position(|p| p["type"] == "mesh-cni")
        .map(|i| plugins.remove(i));
    if let Some(entry) = put_back {
        plugins.push(entry.clone());
    }
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, serde_json::to_vec(&conf).expect("json")).expect("write");
    std::fs::rename(&tmp, &path).expect("rename");
    taken.unwrap_or(serde_json::Value::Null)
}

/// Lines of the node plugin's log (every meshgate-node container, all restarts).
async fn node_plugin_log(client: &kube::Client, node: &RealNode) -> Vec<String> {
    component_logs(client, node, "app.kubernetes.io/component=node")
        .await
        .into_iter()
        .map(|(_, l)| l)
        .collect()
}

/// Waits until a pod of the node plugin's DaemonSet is Ready (registered with the kubelet).
async fn wait_node_plugin_ready(client: &kube::Client, node: &RealNode) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), "meshgate-system");
    let ready = tokio::time::timeout(Duration::from_secs(120), async {
        loop {
            let list = pods
                .list(&kube::api::ListParams::default().labels("app.kubernetes.io/component=node"))
                .await
                .expect("pods");
            if list.items.iter().any(|p| {
                p.status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
            }) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await;
    assert!(
        ready.is_ok(),
        "the node plugin did not register with the kubelet\nplugin log:\n{}\nkubelet:\n{}",
        node_plugin_log(client, node).await.join("\n"),
        node.log_tail("kubelet", 30)
    );
}

/// The app pod without a node: the scheduler places it.
fn scheduled_pod(name: &str) -> Pod {
    let mut p = app_pod(name, "", "Always");
    if let Some(spec) = p.spec.as_mut() {
        spec.node_name = None;
    }
    p
}

/// Waits until a dry-run create of a scheduled pod comes back as `done` says: the in-cluster
/// webhook is registered and serving.
async fn wait_webhook_mutates(pods: &Api<Pod>, what: &str, done: impl Fn(&Pod) -> bool) {
    let mut n = 0;
    let done = &done;
    wait_for(what, Duration::from_secs(60), || {
        n += 1;
        let (pods, probe) = (pods.clone(), scheduled_pod(&format!("probe-{n}")));
        async move {
            let dry = PostParams {
                dry_run: true,
                ..Default::default()
            };
            pods.create(&dry, &probe)
                .await
                .ok()
                .is_some_and(|p| done(&p))
        }
    })
    .await;
}

/// Whether the scheduler has reported the pod unschedulable.
fn unschedulable(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| {
            cs.iter().any(|c| {
                c.type_ == "PodScheduled"
                    && c.status == "False"
                    && c.reason.as_deref() == Some("Unschedulable")
            })
        })
}

/// The DRA gate on the real node, meshgate installed in the cluster with `--strategy dra` (the
/// node plugin a DaemonSet from meshgate's image, under its ServiceAccount, without an API
/// token), each race caught by the layer named:
/// * **a new node whose agents are not Ready:** a mesh pod gets the gate resource's request
///   from the webhook (verdict `gated: resource ...`, no init container) and the scheduler
///   holds it (no slice, the taint); once the agents and the node plugin are Ready the
///   controller publishes the node's slice and the pod runs, its claim made by the scheduler
///   (DRA, not the node status);
/// * **the mesh's plugin gone from the CNI configuration on a ready node** (what the meshes'
///   CNI agents do when they stop): a pod is bound, and the node plugin holds the kubelet's
///   `NodePrepareResources`: no sandbox, no container; once the plugin is chained again it
///   runs (the time from the write to `Running` is measured; it is the waiting call that lets
///   it go, not the kubelet's next sync a minute later);
/// * **an agent that fails on a ready node:** after the grace period the controller withdraws
///   the slice (and taints): a new pod waits in the scheduler, the running pods are untouched;
/// * **the kubelet restarted:** it deletes its node's slices; the controller publishes the slice
///   again, the plugin registers again, and a new pod runs;
/// * no component's log shows a refused request, the node plugin logs no WARN or ERROR, and the
///   teardown restores the host.
#[tokio::test]
async fn dra_gate_holds_pods_before_their_sandbox_and_lets_them_go_when_the_node_is_ready() {
    use k8s_openapi::api::apps::v1::DaemonSet;
    use k8s_openapi::api::core::v1::Node;
    use k8s_openapi::api::resource::v1::ResourceSlice;

    if !can_run() {
        return;
    }
    let _serial = SERIAL.lock().await;
    let cp = serving_control_plane().await;
    let client = cp.client().await.expect("client");
    let mut node = dra_installed(&cp, &client).await;
    let nodes: Api<Node> = Api::all(client.clone());
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let slice_name = meshgate_core::dra::slice_name("mesh-agents", node.name());
    let resource = meshgate_api::names::DEFAULT_RESOURCE;

    // A new node whose agents are not Ready: the pod gets the request, the scheduler holds it.
    let ns = cp
        .namespace("dra-app", &[AMBIENT])
        .await
        .expect("namespace");
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let requests = |p: &Pod| {
        p.spec.as_ref().and_then(|s| {
            s.containers[0]
                .resources
                .as_ref()
                .and_then(|r| r.requests.as_ref())
                .and_then(|r| r.get(resource).map(|q| q.0.clone()))
        })
    };
    wait_webhook_mutates(
        &pods,
        "the in-cluster webhook to give pods the gate resource",
        |p| requests(p).is_some(),
    )
    .await;
    let early = pods
        .create(&PostParams::default(), &scheduled_pod("early"))
        .await
        .expect("pod");
    assert_eq!(requests(&early).as_deref(), Some("1"), "{early:?}");
    assert!(gate(&early).is_none(), "no meshgate-wait with the DRA gate");
    assert_eq!(
        early
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(meshgate_api::names::GATE_VERDICT))
            .map(String::as_str),
        Some(format!("gated: resource {resource}").as_str())
    );
    wait_pod(
        &pods,
        &node,
        "early",
        "the scheduler to hold it",
        Duration::from_secs(60),
        unschedulable,
    )
    .await;
    assert!(
        slices.get_opt(&slice_name).await.expect("slice").is_none(),
        "no slice before the agents are Ready"
    );
    // A DaemonSet's pod that tolerates every taint: the taint does not hold it, the missing
    // device does.
    let tolerant: k8s_openapi::api::apps::v1::DaemonSet = serde_json::from_value(json!({
        "metadata": {"name": "tolerant"},
        "spec": {
            "selector": {"matchLabels": {"app": "tolerant"}},
            "template": {
                "metadata": {"labels": {"app": "tolerant"}},
                "spec": {
                    "tolerations": [{"operator": "Exists"}],
                    "automountServiceAccountToken": false,
                    "enableServiceLinks": false,
                    "terminationGracePeriodSeconds": 0,
                    "containers": [{"name": "app", "image": meshgate_testenv::image::APP_IMAGE, "imagePullPolicy": "Never"}],
                },
            },
        },
    }))
    .expect("daemonset");
    Api::<DaemonSet>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &tolerant)
        .await
        .expect("daemonset");
    let tolerant_pod = || async {
        pods.list(&kube::api::ListParams::default().labels("app=tolerant"))
            .await
            .expect("pods")
            .items
            .into_iter()
            .next()
    };
    wait_for(
        "the DaemonSet's pod held by the scheduler",
        Duration::from_secs(60),
        || async { tolerant_pod().await.is_some_and(|p| unschedulable(&p)) },
    )
    .await;
    // A pod created bound to the node never meets the scheduler: the init gate guards it (and
    // it gets no request, which the kubelet could only reject it for).
    let bound = pods
        .create(
            &PostParams::default(),
            &app_pod("bound", node.name(), "Always"),
        )
        .await
        .expect("pod");
    assert!(gate(&bound).is_some(), "meshgate-wait in a node-bound pod");
    assert!(requests(&bound).is_none(), "no request in a node-bound pod");
    create_agents(&client, &node, Profile::IstioAmbient, 2).await;
    let published = wait_slice(&slices, &slice_name, None).await;
    let t = Instant::now();
    let running = wait_pod(
        &pods,
        &node,
        "early",
        "Running",
        Duration::from_secs(60),
        |p| phase(p) == "Running",
    )
    .await;
    eprintln!(
        "measured: DRA gate, new node: slice published -> held pod Running {:.2?}",
        t.elapsed()
    );
    let claim = running
        .status
        .as_ref()
        .and_then(|s| s.extended_resource_claim_status.as_ref())
        .map(|c| c.resource_claim_name.clone());
    assert!(
        claim.is_some(),
        "the scheduler satisfied the request with a DRA claim: {:?}",
        running.status
    );
    let n_status = nodes.get(node.name()).await.expect("node");
    assert!(
        !n_status
            .status
            .and_then(|s| s.capacity)
            .unwrap_or_default()
            .contains_key(resource),
        "a DRA gate does not advertise the resource in the node status"
    );
    let early_container = app_status(&running)
        .and_then(|s| s.container_id.clone())
        .expect("container id");
    wait_for(
        "the DaemonSet's pod to run once the slice is published",
        Duration::from_secs(60),
        || async { tolerant_pod().await.is_some_and(|p| phase(&p) == "Running") },
    )
    .await;
    let bound = wait_pod(
        &pods,
        &node,
        "bound",
        "Running",
        Duration::from_secs(90),
        |p| phase(p) == "Running",
    )
    .await;
    let line = gate_log_line(&node, &ns, &bound);
    assert!(
        line.starts_with("ready after ") && line.contains("tcp-listening 15008"),
        "the node-bound pod's gate waited for the node proxy: {line}"
    );

    // The mesh's plugin gone from the CNI configuration: held in the kubelet's prepare.
    let mut released = Vec::new();
    for i in 0..10 {
        let entry = mesh_plugin_entry(&node, None);
        assert!(entry.is_object(), "the agent had chained mesh-cni");
        let held_before = node_plugin_log(&client, &node)
            .await
            .iter()
            .filter(|l| l.contains("the pod's sandbox is held"))
            .count();
        let name = format!("held-{i}");
        pods.create(&PostParams::default(), &scheduled_pod(&name))
            .await
            .expect("pod");
        wait_for(
            "the node plugin to hold the pod's prepare",
            Duration::from_secs(60),
            || {
                let (client, node) = (client.clone(), &node);
                async move {
                    node_plugin_log(&client, node)
                        .await
                        .iter()
                        .filter(|l| l.contains("the pod's sandbox is held"))
                        .count()
                        > held_before
                }
            },
        )
        .await;
        let p = pods.get(&name).await.expect("pod");
        assert_eq!(
            p.spec.as_ref().and_then(|s| s.node_name.as_deref()),
            Some(node.name()),
            "bound"
        );
        let uid = p.metadata.uid.clone().unwrap_or_default();
        assert!(
            node.sandbox_pid(&uid).is_err(),
            "no sandbox while the prepare is held"
        );
        assert!(
            app_status(&p).is_none_or(|s| s.state.as_ref().is_none_or(|st| st.running.is_none()))
        );
        let t = Instant::now();
        mesh_plugin_entry(&node, Some(&entry));
        wait_pod(
            &pods,
            &node,
            &name,
            "Running",
            Duration::from_secs(60),
            |p| phase(p) == "Running",
        )
        .await;
        released.push(t.elapsed());
        pods.delete(&name, &Default::default())
            .await
            .expect("delete");
    }
    released.sort();
    eprintln!(
        "measured: DRA gate, held in prepare: mesh plugin chained again -> Running p50 {:.2?}, max {:.2?} ({} pods)",
        released[released.len() / 2],
        released[released.len() - 1],
        released.len()
    );
    assert!(
        released[released.len() - 1] < Duration::from_secs(30),
        "released by the waiting prepare (within its 30 s), not by the kubelet's next sync: {released:?}"
    );

    // An agent fails on a ready node: the slice is withdrawn after the grace period; new pods
    // wait in the scheduler, running pods are untouched.
    let proxies: Api<DaemonSet> = Api::namespaced(client.clone(), "istio-system");
    let probe_patch = |file: &str| {
        json!({"spec": {"template": {"spec": {"containers": [{"name": "agent",
            "readinessProbe": {"exec": {"command": ["/mesh-node-proxy", "--check-ready", file]}, "periodSeconds": 1}}]}}}})
    };
    proxies
        .patch(
            "ztunnel",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Strategic(&probe_patch("/tmp/never")),
        )
        .await
        .expect("node proxy made unready");
    wait_for(
        "the controller to withdraw the slice",
        Duration::from_secs(90),
        || {
            let slices = slices.clone();
            let name = slice_name.clone();
            async move { slices.get_opt(&name).await.expect("slice").is_none() }
        },
    )
    .await;
    pods.create(&PostParams::default(), &scheduled_pod("late"))
        .await
        .expect("pod");
    wait_pod(
        &pods,
        &node,
        "late",
        "the scheduler to hold it",
        Duration::from_secs(60),
        unschedulable,
    )
    .await;
    let still = pods.get("early").await.expect("early");
    assert_eq!(phase(&still), "Running", "running pods untouched");
    assert_eq!(
        app_status(&still).and_then(|s| s.container_id.clone()),
        Some(early_container.clone())
    );
    assert_eq!(app_status(&still).map(|s| s.restart_count), Some(0));
    proxies
        .patch(
            "ztunnel",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Strategic(&probe_patch("/tmp/ready")),
        )
        .await
        .expect("node proxy Ready again");
    wait_slice(&slices, &slice_name, None).await;
    wait_pod(
        &pods,
        &node,
        "late",
        "Running",
        Duration::from_secs(90),
        |p| phase(p) == "Running",
    )
    .await;

    // The kubelet restarted: its node's slices are deleted; the controller publishes the slice
    // again and the plugin registers again.
    let before = wait_slice(&slices, &slice_name, None).await;
    node.restart_kubelet().await.expect("kubelet restarted");
    let again = wait_slice(&slices, &slice_name, before.metadata.uid.as_deref()).await;
    assert_ne!(again.metadata.uid, before.metadata.uid);
    assert_ne!(published.metadata.uid, again.metadata.uid);
    pods.create(&PostParams::default(), &scheduled_pod("after-restart"))
        .await
        .expect("pod");
    wait_pod(
        &pods,
        &node,
        "after-restart",
        "Running",
        Duration::from_secs(120),
        |p| phase(p) == "Running",
    )
    .await;
    let still = pods.get("early").await.expect("early");
    assert_eq!(app_status(&still).map(|s| s.restart_count), Some(0));

    assert_no_refused_requests(&client, &node).await;
    let noisy: Vec<String> = node_plugin_log(&client, &node)
        .await
        .into_iter()
        .filter(|l| l.contains("\"WARN\"") || l.contains("\"ERROR\""))
        .collect();
    assert!(noisy.is_empty(), "the node plugin logged: {noisy:#?}");
    tear_down(cp, node).await;
}

/// The DRA gate on the real node whose kubelet may be older than its API server (the version
/// skew cells of `tools/test.sh`: `MESHGATE_KUBELET_BIN`, e.g. a 1.34 kubelet under a 1.37 API
/// server): a mesh pod created before the agents are Ready is held by the scheduler and runs once
/// they are, through the layer the node's kubelet supports — a `ResourceSlice` and the
/// scheduler's claim where the kubelet prepares it (1.36+), the node status elsewhere (no slice,
/// no claim) — and `meshgate status` says which.
#[tokio::test]
async fn dra_gate_guards_pods_by_the_layer_the_nodes_kubelet_supports() {
    use k8s_openapi::api::core::v1::Node;
    use k8s_openapi::api::resource::v1::ResourceSlice;

    if !can_run() {
        return;
    }
    let _serial = SERIAL.lock().await;
    let cp = serving_control_plane().await;
    let client = cp.client().await.expect("client");
    let node = dra_installed(&cp, &client).await;
    let nodes: Api<Node> = Api::all(client.clone());
    let kubelet = nodes
        .get(node.name())
        .await
        .expect("node")
        .status
        .and_then(|s| s.node_info)
        .map(|i| i.kubelet_version)
        .unwrap_or_default();
    let server = client
        .apiserver_version()
        .await
        .expect("version")
        .git_version;
    let fallback = meshgate_core::dra::kubelet_falls_back(Some(&kubelet));
    eprintln!("measured: kubelet {kubelet} under API server {server}: {fallback:?}");
    // Read from the version, not from the rule under test: DRAExtendedResource is on in the
    // kubelet from 1.36.
    let minor: u32 = kubelet
        .split('.')
        .nth(1)
        .and_then(|m| m.parse().ok())
        .expect("the kubelet's minor");
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let slice_name = meshgate_core::dra::slice_name("mesh-agents", node.name());
    let resource = meshgate_api::names::DEFAULT_RESOURCE;
    let advertised = || async {
        nodes
            .get(node.name())
            .await
            .expect("node")
            .status
            .and_then(|s| s.capacity)
            .unwrap_or_default()
            .contains_key(resource)
    };

    let ns = cp
        .namespace("skew-app", &[AMBIENT])
        .await
        .expect("namespace");
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    wait_webhook_mutates(&pods, "the webhook to give pods the gate resource", |p| {
        p.spec.as_ref().is_some_and(|s| {
            s.containers[0]
                .resources
                .as_ref()
                .and_then(|r| r.requests.as_ref())
                .is_some_and(|r| r.contains_key(resource))
        })
    })
    .await;
    pods.create(&PostParams::default(), &scheduled_pod("early"))
        .await
        .expect("pod");
    wait_pod(
        &pods,
        &node,
        "early",
        "the scheduler to hold it",
        Duration::from_secs(60),
        unschedulable,
    )
    .await;
    assert!(slices.get_opt(&slice_name).await.expect("slice").is_none());
    assert!(
        !advertised().await,
        "no resource before the agents are Ready"
    );

    create_agents(&client, &node, Profile::IstioAmbient, 2).await;
    let running = wait_pod(
        &pods,
        &node,
        "early",
        "Running",
        Duration::from_secs(90),
        |p| phase(p) == "Running",
    )
    .await;
    let claim = running
        .status
        .as_ref()
        .and_then(|s| s.extended_resource_claim_status.as_ref());
    let status = meshgate_cli(&cp, &["status"]);
    if minor < 36 {
        assert!(
            advertised().await,
            "the node status carries the resource: {fallback:?}"
        );
        assert!(
            slices.get_opt(&slice_name).await.expect("slice").is_none(),
            "no slice"
        );
        assert!(
            claim.is_none(),
            "served by the node status, not a claim: {claim:?}"
        );
        assert!(
            status.contains(&format!("(node status: kubelet {kubelet})")),
            "meshgate status says the layer:\n{status}"
        );
    } else {
        assert!(slices.get_opt(&slice_name).await.expect("slice").is_some());
        assert!(!advertised().await, "no resource in the node status");
        assert!(
            claim.is_some(),
            "the scheduler's claim: {:?}",
            running.status
        );
        assert!(
            status.contains("ResourceSlice"),
            "meshgate status says the layer:\n{status}"
        );
    }
    assert_eq!(
        fallback.is_some(),
        minor < 36,
        "kubelet {kubelet}: {fallback:?}"
    );
    eprintln!(
        "measured: layer on kubelet {kubelet}: {}",
        if fallback.is_some() {
            "node status"
        } else {
            "DRA"
        }
    );
    // The node plugin's `:authority` rewrite on its registration socket: what this kubelet
    // does without it, and with it.
    let plain = kubelet_reaches_registration(&node, false).await;
    eprintln!("measured: kubelet {kubelet}, a registration socket without the rewrite: {plain:?}");
    assert!(
        plain
            .as_ref()
            .is_err_and(|l| l.contains("PROTOCOL_ERROR") || l.contains("authority")),
        "kubelet {kubelet} reached a plain registration socket: the rewrite is not needed ({plain:?})"
    );
    let rewritten = kubelet_reaches_registration(&node, true).await;
    assert_eq!(rewritten, Ok(()), "kubelet {kubelet} through the rewrite");
    assert_no_refused_requests(&client, &node).await;
    tear_down(cp, node).await;
}

/// A registration socket of the test's own in the kubelet's `plugins_registry`: whether the
/// node's kubelet reaches its `GetInfo` when the socket is served plainly by tonic, or through
/// the node plugin's `:authority` rewrite (`rewrite`). `Ok` when the call arrived, `Err` with
/// the kubelet's log line when it gave up on the socket first.
async fn kubelet_reaches_registration(node: &RealNode, rewrite: bool) -> Result<(), String> {
    use meshgate_node::proto::pluginregistration::registration_server::{
        Registration, RegistrationServer,
    };
    use meshgate_node::proto::pluginregistration::{
        InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
    };
    use tokio_stream::StreamExt;
    struct Probe(tokio::sync::mpsc::Sender<()>);
    #[tonic::async_trait]
    impl Registration for Probe {
        async fn get_info(
            &self,
            _: tonic::Request<InfoRequest>,
        ) -> Result<tonic::Response<PluginInfo>, tonic::Status> {
            let _ = self.0.try_send(());
            Err(tonic::Status::unavailable(
                "a probe of meshgate's tests, not a plugin",
            ))
        }
        async fn notify_registration_status(
            &self,
            _: tonic::Request<RegistrationStatus>,
        ) -> Result<tonic::Response<RegistrationStatusResponse>, tonic::Status> {
            Ok(tonic::Response::new(RegistrationStatusResponse {}))
        }
    }
    let name = format!(
        "meshgate-probe-{}-reg.sock",
        if rewrite { "rewrite" } else { "plain" }
    );
    let path = node.kubelet_root().join("plugins_registry").join(&name);
    let _ = std::fs::remove_file(&path);
    let listener = tokio::net::UnixListener::bind(&path).expect("probe socket");
    let (tx, mut rx) = tokio::sync::mpsc::channel(1);
    let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
    let server =
        tonic::transport::Server::builder().add_service(RegistrationServer::new(Probe(tx)));
    let serving = if rewrite {
        tokio::spawn(server.serve_with_incoming(
            incoming.map(|c| c.map(meshgate_node::authority::AuthorityRewrite::new)),
        ))
    } else {
        tokio::spawn(server.serve_with_incoming(incoming))
    };
    let t = Instant::now();
    let outcome = loop {
        if rx.try_recv().is_ok() {
            break Ok(());
        }
        let log = node.log_tail("kubelet", 400);
        if let Some(line) = log
            .lines()
            .find(|l| l.contains(&name) && l.contains("RegisterPlugin error"))
        {
            break Err(line.to_owned());
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the kubelet neither called {name} nor gave up on it in 60 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    serving.abort();
    let _ = std::fs::remove_file(&path);
    outcome
}

/// A real node (with kube-proxy) and meshgate installed in the cluster for the ambient profile
/// with `--strategy dra` from its image: its components and the node plugin Ready.
async fn dra_installed(cp: &meshgate_testenv::ControlPlane, client: &kube::Client) -> RealNode {
    let node = RealNode::start(
        cp,
        NodeOptions {
            proxy: true,
            ..NodeOptions::default()
        },
    )
    .await
    .expect("the real node starts");
    let root = node.kubelet_root().display().to_string();
    let conf = node.cni_conf_dir().display().to_string();
    meshgate_cli(
        cp,
        &[
            "install",
            "--profile",
            "istio-ambient",
            "--strategy",
            "dra",
            "--image",
            meshgate_testenv::image::MESHGATE_IMAGE,
            "--kubelet-root",
            &root,
            "--cni-conf-dir",
            &conf,
            "--cni-plugin",
            "mesh-cni",
            "--apply",
        ],
    );
    wait_meshgate_ready(client, &node).await;
    wait_node_plugin_ready(client, &node).await;
    node
}

/// Waits until the slice exists with a uid other than `not` (a slice written again); returns it.
async fn wait_slice(
    slices: &Api<k8s_openapi::api::resource::v1::ResourceSlice>,
    name: &str,
    not: Option<&str>,
) -> k8s_openapi::api::resource::v1::ResourceSlice {
    let t = Instant::now();
    loop {
        if let Some(s) = slices.get_opt(name).await.expect("slice")
            && s.metadata.uid.as_deref() != not
        {
            return s;
        }
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "slice {name} not published (again) in 120 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Runs the real Helm against the control plane; panics with its output on failure.
fn helm_on(cp: &meshgate_testenv::ControlPlane, args: &[&str]) -> String {
    match helm_try(cp, args) {
        Ok(text) => text,
        Err(text) => panic!("helm {}: {text}", args.join(" ")),
    }
}

/// Runs the real Helm against the control plane: its output, as an error when it failed.
fn helm_try(cp: &meshgate_testenv::ControlPlane, args: &[&str]) -> Result<String, String> {
    let helm = meshgate_testenv::helm().expect("helm (MESHGATE_HELM, else tools/helm/build.sh)");
    let kubeconfig = cp.kubeconfig_path.display().to_string();
    let out = std::process::Command::new(&helm)
        .args(args)
        .args(["--kubeconfig", kubeconfig.as_str()])
        .output()
        .expect("helm runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if out.status.success() {
        Ok(text)
    } else {
        Err(text)
    }
}

/// `helm uninstall` of a release whose gate holds a node: the chart's pre-delete hook runs
/// `meshgate uninstall` in a Job on that node (it tolerates meshgate's taint) under the hook's
/// own ServiceAccount and RBAC, before Helm deletes the controller. Afterwards no NodeGate is
/// left (none stuck Terminating on its finalizer), the node carries no taint or annotation of
/// meshgate's, and nothing of the release (hook included) is left.
#[tokio::test]
async fn helm_uninstall_takes_the_gate_off_the_nodes_before_it_deletes_the_controller() {
    use k8s_openapi::api::apps::v1::Deployment;
    use k8s_openapi::api::core::v1::{Node, ServiceAccount};
    use k8s_openapi::api::rbac::v1::ClusterRole;
    use kube::api::ListParams;
    use meshgate_testenv::image::MESHGATE_IMAGE;

    if !can_run() {
        return;
    }
    let _serial = SERIAL.lock().await;
    let cp = serving_control_plane().await;
    let client = cp.client().await.expect("client");
    let chart = meshgate_testenv::workspace_dir().join("deploy/helm/meshgate");
    let (registry, rest) = MESHGATE_IMAGE
        .split_once('/')
        .expect("registry/repository:tag");
    let (repository, tag) = rest.split_once(':').expect("repository:tag");
    let sets = [
        format!("image.registry={registry}"),
        format!("image.repository={repository}"),
        format!("image.tag={tag}"),
        "image.pullPolicy=Never".to_owned(),
    ];
    let mut args = vec![
        "install",
        "meshgate",
        chart.to_str().expect("chart path"),
        "--namespace",
        "meshgate-system",
        "--create-namespace",
    ];
    for s in &sets {
        args.extend(["--set-string", s.as_str()]);
    }
    args.extend([
        "--set",
        "webhook.replicas=1",
        "--set",
        "controller.replicas=1",
    ]);
    helm_on(&cp, &args);
    let nodes: Api<Node> = Api::all(client.clone());
    wait_node_taint_policy(&nodes).await;
    // kube-proxy: the hook's pod reaches the API server through the `kubernetes` Service.
    let node = RealNode::start(
        &cp,
        NodeOptions {
            proxy: true,
            ..NodeOptions::default()
        },
    )
    .await
    .expect("the real node starts");
    wait_meshgate_ready(&client, &node).await;
    // No mesh agent runs: the gate holds the node.
    let held = taint_keys(&nodes.get(node.name()).await.expect("node"));
    assert!(
        held.iter()
            .any(|k| k == meshgate_api::names::STARTUP_TAINT_KEY),
        "the node is held by meshgate's taint: {held:?}"
    );

    let started = Instant::now();
    let said = match helm_try(
        &cp,
        &[
            "uninstall",
            "meshgate",
            "--namespace",
            "meshgate-system",
            "--wait",
            "--timeout",
            "4m",
        ],
    ) {
        Ok(said) => said,
        Err(said) => panic!(
            "helm uninstall: {said}\nthe hook's Job: {:?}\nReplicaSets: {:?}\npods: {}\nthe hook's log:\n{}\nkubelet:\n{}",
            Api::<k8s_openapi::api::batch::v1::Job>::namespaced(client.clone(), "meshgate-system")
                .get_opt("meshgate-uninstall")
                .await
                .ok()
                .flatten()
                .and_then(|j| j.status),
            Api::<k8s_openapi::api::apps::v1::ReplicaSet>::namespaced(
                client.clone(),
                "meshgate-system"
            )
            .list_metadata(&ListParams::default())
            .await
            .map(|l| l
                .items
                .into_iter()
                .map(|r| (
                    r.metadata.name,
                    r.metadata.deletion_timestamp,
                    r.metadata.owner_references
                ))
                .collect::<Vec<_>>()),
            pod_statuses(&client, "meshgate-system").await,
            last_lines(
                &component_logs(&client, &node, "app.kubernetes.io/component=uninstall").await,
                200
            ),
            node.log_tail("kubelet", 20)
        ),
    };
    let took = started.elapsed();

    let gates = Api::<meshgate_api::NodeGate>::all(client.clone())
        .list(&ListParams::default())
        .await
        .expect("gates")
        .items;
    let left: Vec<String> = gates
        .iter()
        .map(|g| {
            format!(
                "{} (deleting: {})",
                g.metadata.name.as_deref().unwrap_or_default(),
                g.metadata.deletion_timestamp.is_some()
            )
        })
        .collect();
    assert!(
        left.is_empty(),
        "NodeGates left after helm uninstall: {left:?}\nhelm: {said}"
    );
    let after = nodes.get(node.name()).await.expect("node");
    let taints = taint_keys(&after);
    assert!(
        !taints
            .iter()
            .any(|k| k == meshgate_api::names::STARTUP_TAINT_KEY),
        "meshgate's taint left on the node: {taints:?}\nhelm: {said}"
    );
    let annotations: Vec<&String> = after
        .metadata
        .annotations
        .iter()
        .flatten()
        .map(|(k, _)| k)
        .filter(|k| k.starts_with("meshgate.dev/"))
        .collect();
    assert!(
        annotations.is_empty(),
        "meshgate's annotations left on the node: {annotations:?}"
    );
    let ours = ListParams::default().labels("app.kubernetes.io/name=meshgate");
    let roles = Api::<ClusterRole>::all(client.clone())
        .list_metadata(&ours)
        .await
        .expect("cluster roles")
        .items;
    assert!(
        roles.is_empty(),
        "ClusterRoles left: {:?}",
        roles
            .iter()
            .map(|r| r.metadata.name.clone())
            .collect::<Vec<_>>()
    );
    for (what, empty) in [
        (
            "Deployments",
            Api::<Deployment>::namespaced(client.clone(), "meshgate-system")
                .list_metadata(&ours)
                .await
                .expect("deployments")
                .items
                .is_empty(),
        ),
        (
            "ServiceAccounts (the hook's included)",
            Api::<ServiceAccount>::namespaced(client.clone(), "meshgate-system")
                .list_metadata(&ours)
                .await
                .expect("service accounts")
                .items
                .is_empty(),
        ),
    ] {
        assert!(empty, "{what} of meshgate's left in meshgate-system");
    }
    eprintln!(
        "measured: helm uninstall with the node held by the gate took {took:.2?}; the node's taints after: {taints:?}"
    );
    drop(client);
    tear_down(cp, node).await;
}
