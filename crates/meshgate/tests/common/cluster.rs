//! The real node with meshgate installed in the cluster, shared by the `real_node` and
//! `real_istio` tests: whether the host can run a node, a control plane that serves its pods,
//! the `meshgate` CLI, waiting for meshgate's Deployments and for the startup taint to lift,
//! the components' logs and RBAC, and a teardown that proves the host is as before.

use std::path::Path;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{ContainerStatus, Pod};
use kube::api::Api;
use meshgate_testenv::host::{self, HostSnapshot};
use meshgate_testenv::node::{RealNode, STATE_DIR};

/// Set to 1 to skip the real-node tests on a host that lacks what they need.
pub const SKIP_ENV: &str = "MESHGATE_SKIP_REAL_NODE";

/// Processes of a node's components and of the programs its pods run; none may outlive a
/// teardown.
pub const NODE_PROCESSES: [&str; 12] = [
    "kubelet",
    "containerd",
    "containerd-shim",
    "kube-controller",
    "kube-proxy",
    "pause",
    "app",
    "meshgate-wait",
    "pilot-discovery",
    "pilot-agent",
    "install-cni",
    "mesh-proxy",
];

/// The processes named `name` that are this node's: by name, except kube-controller-manager,
/// which tests beside the node run too (the Karpenter harness; `tools/test.sh` runs them side by
/// side): the node's own is the one started with the node's run directory in its command line.
pub fn node_pids(name: &str, run_dir: &Path) -> Vec<u32> {
    let pids = host::pids_named(name);
    if name != "kube-controller" {
        return pids;
    }
    let run_dir = run_dir.to_string_lossy();
    pids.into_iter()
        .filter(|p| host::cmdline(*p).contains(&*run_dir))
        .collect()
}

/// Whether the host can run a node; panics saying what is missing unless skipping is asked for.
pub fn can_run() -> bool {
    match meshgate_testenv::node::prerequisites() {
        Ok(_) => true,
        Err(e) if std::env::var_os(SKIP_ENV).is_some_and(|v| v == "1") => {
            eprintln!("skipping the real-node test: {e} ({SKIP_ENV}=1)");
            false
        }
        Err(e) => panic!("{e}. Set {SKIP_ENV}=1 to skip the real-node test"),
    }
}

/// The host after the teardown: as in the snapshot taken before the node started, and nothing
/// of the node left.
pub fn assert_host_restored(before: &HostSnapshot, run_dir: &Path) {
    let now = HostSnapshot::take().expect("host snapshot");
    let differences = before.differences(&now);
    assert!(
        differences.is_empty(),
        "the host differs from before the node:\n{}",
        differences.join("\n")
    );
    for name in NODE_PROCESSES {
        let left = node_pids(name, run_dir);
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

/// A control plane that serves the real node's pods, started after the images' static
/// binaries are built (cached), so that no clock or watch of the test includes a build.
pub async fn serving_control_plane() -> meshgate_testenv::ControlPlane {
    tokio::task::spawn_blocking(meshgate_testenv::image::static_binaries)
        .await
        .expect("build task")
        .expect("static binaries");
    let cp = meshgate_testenv::ControlPlane::start(meshgate_testenv::Options {
        scheduler: true,
        serve_pods: true,
        ..Default::default()
    })
    .await
    .expect("a control plane that serves pods");
    let link = cp.api_link().expect("the API server's link");
    assert!(
        Path::new("/sys/class/net").join(link).exists(),
        "the API server's link {link}"
    );
    cp
}

/// Runs the `meshgate` CLI with the admin's kubeconfig; panics with its output on failure.
pub fn meshgate_cli(cp: &meshgate_testenv::ControlPlane, args: &[&str]) -> String {
    let out = super::meshgate_on(cp, args);
    assert!(
        out.status.success(),
        "meshgate {}: {}\n{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Waits until meshgate's webhook and controller Deployments have a Ready replica; panics with
/// their pods' status and the kubelet's log otherwise.
pub async fn wait_meshgate_ready(client: &kube::Client, node: &RealNode) {
    use k8s_openapi::api::apps::v1::Deployment;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), "meshgate-system");
    let mut last = String::new();
    let ready = tokio::time::timeout(Duration::from_secs(120), async {
        loop {
            let mut all = true;
            last.clear();
            for d in ["meshgate-webhook", "meshgate-controller"] {
                let dep = deployments.get(d).await.expect("deployment");
                let ready = dep
                    .status
                    .as_ref()
                    .and_then(|s| s.ready_replicas)
                    .unwrap_or(0);
                last.push_str(&format!("{d}: {ready} ready; "));
                all &= ready >= 1;
            }
            if all {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await;
    if ready.is_err() {
        let mut logs = String::new();
        for c in ["controller", "webhook"] {
            let lines =
                component_logs(client, node, &format!("app.kubernetes.io/component={c}")).await;
            logs.push_str(&format!("{c} logs:\n{}\n", last_lines(&lines, 15)));
        }
        panic!(
            "meshgate's Deployments not Ready in 120 s ({last})\npods: {}\n{logs}kubelet:\n{}",
            pod_statuses(client, "meshgate-system").await,
            node.log_tail("kubelet", 30)
        );
    }
}

/// Waits until the node has lost meshgate's startup taint; panics with the NodeGate's status
/// and the controller's last log lines after `limit`.
pub async fn wait_taint_lifted(client: &kube::Client, node: &RealNode, limit: Duration) {
    use k8s_openapi::api::core::v1::Node;
    let nodes: Api<Node> = Api::all(client.clone());
    let lifted = tokio::time::timeout(limit, async {
        loop {
            let n = nodes.get(node.name()).await.expect("node");
            if !n
                .spec
                .and_then(|s| s.taints)
                .unwrap_or_default()
                .iter()
                .any(|t| t.key == meshgate_api::names::STARTUP_TAINT_KEY)
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    if lifted.is_err() {
        let gate = Api::<meshgate_api::NodeGate>::all(client.clone())
            .get("mesh-agents")
            .await
            .expect("gate");
        let logs = component_logs(client, node, "app.kubernetes.io/component=controller").await;
        panic!(
            "the startup taint was not lifted in {limit:?}\ngate status: {}\ncontroller logs:\n{}",
            serde_json::to_string_pretty(&gate.status).unwrap_or_default(),
            last_lines(&logs, 30)
        );
    }
}

/// The lines of every container log of meshgate's pods with `selector` (all restarts).
pub async fn component_logs(
    client: &kube::Client,
    node: &RealNode,
    selector: &str,
) -> Vec<(String, String)> {
    pod_logs(client, node, "meshgate-system", selector).await
}

/// The last `n` lines of [`pod_logs`], newest first, `container: line` each (for a failure
/// message).
pub fn last_lines(logs: &[(String, String)], n: usize) -> String {
    logs.iter()
        .rev()
        .take(n)
        .map(|(c, l)| format!("{c}: {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The pods of `namespace` with their status, as JSON (for a failure message).
pub async fn pod_statuses(client: &kube::Client, namespace: &str) -> String {
    let pods = Api::<Pod>::namespaced(client.clone(), namespace)
        .list(&Default::default())
        .await
        .expect("pods");
    serde_json::to_string_pretty(
        &pods
            .items
            .iter()
            .map(|p| (&p.metadata.name, &p.status))
            .collect::<Vec<_>>(),
    )
    .unwrap_or_default()
}

/// The lines of every container log (all restarts, init containers too) of the pods with
/// `selector` in `namespace`, each with `<pod>/<container>`.
pub async fn pod_logs(
    client: &kube::Client,
    node: &RealNode,
    namespace: &str,
    selector: &str,
) -> Vec<(String, String)> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let list = pods
        .list(&kube::api::ListParams::default().labels(selector))
        .await
        .expect("pods");
    let mut out = Vec::new();
    for p in list.items {
        let name = p.metadata.name.clone().unwrap_or_default();
        let uid = p.metadata.uid.clone().unwrap_or_default();
        for c in p
            .spec
            .iter()
            .flat_map(|s| s.init_containers.iter().flatten().chain(&s.containers))
        {
            let dir = node
                .container_log(namespace, &name, &uid, &c.name, 0)
                .parent()
                .map(Path::to_owned)
                .expect("log dir");
            for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
                let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
                out.extend(
                    text.lines()
                        .map(|l| (format!("{name}/{}", c.name), l.to_owned())),
                );
            }
        }
    }
    out
}

/// Every meshgate pod runs as its component's ServiceAccount, and no component's log shows a
/// request the API server refused (403).
pub async fn assert_no_refused_requests(client: &kube::Client, node: &RealNode) {
    let pods = Api::<Pod>::namespaced(client.clone(), "meshgate-system")
        .list(&Default::default())
        .await
        .expect("pods");
    for p in &pods.items {
        let component = p
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get("app.kubernetes.io/component"))
            .map_or("", String::as_str);
        assert_eq!(
            p.spec
                .as_ref()
                .and_then(|s| s.service_account_name.as_deref()),
            Some(format!("meshgate-{component}").as_str()),
            "{:?} runs as its component's ServiceAccount",
            p.metadata.name
        );
    }
    let logs = component_logs(client, node, "app.kubernetes.io/name=meshgate").await;
    assert!(!logs.is_empty(), "the components logged");
    let refused: Vec<_> = logs
        .iter()
        .filter(|(_, l)| {
            let l = l.to_ascii_lowercase();
            l.contains("forbidden") || l.contains("\"code\":403") || l.contains(" 403 ")
        })
        .collect();
    assert!(
        refused.is_empty(),
        "the components were refused requests under their installed RBAC:\n{refused:#?}"
    );
}

/// The level of a component's log line: JSON lines (`"level":"WARN"`, as installed) or text
/// (`… WARN target: …`), after the container runtime's prefix.
pub fn log_level(line: &str) -> Option<&'static str> {
    ["ERROR", "WARN"].into_iter().find(|level| {
        line.contains(&format!("\"level\":\"{level}\""))
            || line.split_whitespace().any(|w| w == *level)
    })
}

/// No meshgate component logged an ERROR or WARN line: a healthy run says nothing a reader
/// would take for a fault (a watch that reconnects is info; the API server not ready yet is
/// debug).
pub async fn assert_no_warnings_or_errors(client: &kube::Client, node: &RealNode) {
    let logs = component_logs(client, node, "app.kubernetes.io/name=meshgate").await;
    assert!(!logs.is_empty(), "the components logged");
    let bad: Vec<_> = logs
        .iter()
        .filter(|(_, l)| log_level(l).is_some())
        .collect();
    assert!(
        bad.is_empty(),
        "the components logged ERROR or WARN lines in a healthy run:\n{bad:#?}"
    );
}

/// Whether `system:serviceaccount:meshgate-system:<sa>` may `verb` core `resource`s (a
/// SubjectAccessReview, what `kubectl auth can-i --as` asks).
pub async fn service_account_may(
    client: &kube::Client,
    sa: &str,
    verb: &str,
    resource: &str,
) -> bool {
    use k8s_openapi::api::authorization::v1::{
        ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
    };
    // `pods/eviction`: a resource and its subresource.
    let (resource, subresource) = resource
        .split_once('/')
        .map_or((resource, None), |(r, s)| (r, Some(s)));
    let review = SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: Some(format!("system:serviceaccount:meshgate-system:{sa}")),
            groups: Some(vec![
                "system:serviceaccounts".into(),
                "system:serviceaccounts:meshgate-system".into(),
            ]),
            resource_attributes: Some(ResourceAttributes {
                verb: Some(verb.into()),
                resource: Some(resource.into()),
                subresource: subresource.map(Into::into),
                namespace: Some("any".into()),
                ..Default::default()
            }),
            ..Default::default()
        },
        ..Default::default()
    };
    Api::<SubjectAccessReview>::all(client.clone())
        .create(&Default::default(), &review)
        .await
        .expect("review")
        .status
        .is_some_and(|s| s.allowed)
}

/// Stops the node, checks the host is as before, stops the control plane and checks its link
/// is gone.
pub async fn tear_down(cp: meshgate_testenv::ControlPlane, node: RealNode) {
    let before = node.snapshot_before().clone();
    let run_dir = node.run_dir().to_owned();
    let teardown = node.stop().await.expect("the teardown restores the host");
    eprintln!("measured: node teardown {:.2?}", teardown.took);
    assert_host_restored(&before, &run_dir);
    let link = cp.api_link().map(str::to_owned).expect("link");
    drop(cp);
    assert!(
        !Path::new("/sys/class/net").join(&link).exists(),
        "the API server's link {link} is gone with the control plane"
    );
}

pub fn init_status<'a>(p: &'a Pod, name: &str) -> Option<&'a ContainerStatus> {
    p.status
        .as_ref()?
        .init_container_statuses
        .as_ref()?
        .iter()
        .find(|s| s.name == name)
}

pub fn app_status(p: &Pod) -> Option<&ContainerStatus> {
    p.status
        .as_ref()?
        .container_statuses
        .as_ref()?
        .iter()
        .find(|s| s.name == "app")
}

pub fn phase(p: &Pod) -> &str {
    p.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("")
}

/// Polls the pod until `done`; panics with its status and the kubelet's log after `limit`, or
/// at once when a container cannot be created (an image or runtime problem, not a wait).
pub async fn wait_pod(
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

/// The gate's line in its CRI log file (`TIME stderr F meshgate-wait: ...`) of the pod's first
/// run, after its `meshgate-wait: ` prefix.
pub fn gate_log_line(node: &RealNode, ns: &str, pod: &Pod) -> String {
    let uid = pod.metadata.uid.as_deref().expect("uid");
    let name = pod.metadata.name.as_deref().expect("name");
    let path = node.container_log(ns, name, uid, "meshgate-wait", 0);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("the gate's log {}: {e}", path.display()));
    text.lines()
        .find_map(|l| l.split_once(" meshgate-wait: ").map(|(_, m)| m.to_owned()))
        .unwrap_or_else(|| panic!("no meshgate-wait line in {}:\n{text}", path.display()))
}

/// Waits until a dry-run Node create comes back with the startup taint:
/// admission policies take effect asynchronously.
pub async fn wait_node_taint_policy(nodes: &Api<k8s_openapi::api::core::v1::Node>) {
    super::wait_registration_taint(
        &nodes.clone().into_client(),
        meshgate_api::names::STARTUP_TAINT_KEY,
        true,
    )
    .await;
}
