//! What each way of holding mesh pods costs a pod's start, on the real node (kubelet,
//! containerd, runc and the CNI bridge of `meshgate_testenv::node`, the real kube-scheduler and
//! kube-controller-manager), and how fast each lets a held pod go once its node is ready.
//!
//! **Ready node** (`MESHGATE_BENCH_ROUNDS` rounds, default 12; each round creates one pod per
//! strategy, in an order shuffled anew every round, seeded by the round, so that no strategy
//! always follows the same one): the pod is created without a node (the scheduler places it)
//! and timed from the create call to the app container `Running`, and to the pod `Ready`, as a
//! watch on the pod sees it; then it is deleted and the next pod starts only once the kubelet
//! has torn it down (the object gone and its sandbox gone), on a quiet node. Every strategy's pod is the same app pod plus what the strategy adds to it:
//! * `none`: nothing.
//! * `taint`: nothing either: the startup taint is on the node, not the pod, and a ready node
//!   has none. Measured to show what two identical pods differ by.
//! * `resource`: a request of the gate resource, advertised in the node's status.
//! * `dra`: a request of the gate resource, offered through DRA: meshgate's `DeviceClass` and
//!   `ResourceSlice` (`meshgate_core::dra`) and the node plugin (`meshgate node`, on the host as
//!   the kubelet's DRA plugin), whose check passes (the CNI configuration chains its plugin).
//! * `pod-gate-file`: the init gate as meshgate's planner builds it (`meshgate-wait --file`, a
//!   file in its own image: it passes at once).
//! * `default-<profile>`: what `meshgate install --profile <profile>` gives a mesh pod by
//!   default: meshgate's planner, configured as the install configures the webhook, is run on
//!   the profile's pod shape (Istio ambient: a plain pod in an ambient namespace; Istio sidecar
//!   and Linkerd: the injected shape, proxy and validator included), and what meshgate added
//!   (its init container, its resource request) is put on the app pod. The mesh's own
//!   containers are not meshgate's cost and are left out.
//!
//! `RATIO <strategy>/none` is the median over rounds of the round's ratio (each strategy's pod
//! against the `none` pod of the same round); medians and spread of the times are printed too.
//!
//! **Held, then released** (`MESHGATE_BENCH_RELEASE_ROUNDS`, default 10): for each layer the
//! node is first made "not ready" for it, a pod is created and the bench waits until the layer
//! is seen holding it; then the node is made ready and the time from that write to the app
//! `Running` is taken (`VALUE release-<layer>-p50-ms` and `-max-ms`):
//! * `taint`: the gate's taint on the node (the scheduler reports the pod unschedulable); ready:
//!   the taint removed.
//! * `resource`: the resource not advertised (unschedulable); ready: advertised.
//! * `dra-slice`: no slice (unschedulable); ready: the slice published.
//! * `dra-prepare`: the slice published but the node plugin's check failing (its plugin is not
//!   in the CNI configuration): the pod is bound and the kubelet's `NodePrepareResources` waits
//!   in the plugin (no sandbox exists); ready: the CNI configuration chains the plugin.
//!
//! The bench's "mesh" CNI plugin is `tuning` from the host's CNI plugins, which changes nothing
//! without arguments; it is chained into the node's configuration for the ready-node rounds.
//!
//! Needs root, the node binaries and the control plane (as `tools/test.sh` builds them:
//! `MESHGATE_NODE_BIN`, `MESHGATE_CONTROLPLANE_BIN`). Run:
//! `cargo bench -p meshgate --bench pod_startup`. Without `--bench` (as `cargo test --benches`
//! runs it) it does nothing.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use meshgate_api::config::{GateCheck, GateConfig, InitGate};
use meshgate_core::gate::{Planner, PodPlan, PodRequest};
use meshgate_core::select::Meta;
use meshgate_testenv::image::{APP_IMAGE, GATE_IMAGE};
use meshgate_testenv::node::{NodeOptions, RealNode};
use serde_json::{Value, json};

mod pod_start;
use pod_start::*;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The bench's gate for DRA, and the name of its resource and of the other provider's.
const GATE: &str = "bench";
/// The "mesh" CNI plugin the node plugin requires (a host plugin that changes nothing).
const MESH_PLUGIN: &str = "tuning";

#[tokio::main]
async fn main() -> ExitCode {
    if !std::env::args().any(|a| a == "--bench") {
        return ExitCode::SUCCESS;
    }
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pod_startup: {e}");
            ExitCode::FAILURE
        }
    }
}

/// What a strategy adds to the app pod.
#[derive(Clone, Debug)]
struct Strategy {
    name: String,
    /// The meshgate-wait init container, where the strategy has one.
    init: Option<Value>,
    /// Extended resources the app container requests (name → count).
    requests: BTreeMap<String, String>,
}

async fn run() -> Result<(), Error> {
    let rounds = env_count("MESHGATE_BENCH_ROUNDS", 12).max(1);
    let release_rounds = env_count("MESHGATE_BENCH_RELEASE_ROUNDS", 10).max(1);
    // The default strategy's resource is served by the default strategy's provider; the other
    // provider serves the same request under another name.
    let default_strategy = meshgate::install::Strategy::default();
    let default_resource = meshgate_api::names::DEFAULT_RESOURCE.to_owned();
    let other_resource = format!("{default_resource}-other");
    let (dra_resource, status_resource) = match default_strategy {
        meshgate::install::Strategy::Dra => (default_resource.clone(), other_resource.clone()),
        _ => (other_resource.clone(), default_resource.clone()),
    };

    eprintln!("pod_startup: starting the control plane and the real node");
    let cp = meshgate_testenv::ControlPlane::start(meshgate_testenv::Options {
        scheduler: true,
        ..Default::default()
    })
    .await?;
    let client = cp.client().await?;
    let node = RealNode::start(&cp, NodeOptions::default()).await?;
    let outcome = bench(
        &cp,
        &client,
        &node,
        rounds,
        release_rounds,
        &dra_resource,
        &status_resource,
    )
    .await;
    let teardown = node.stop().await;
    outcome?;
    teardown?;
    Ok(())
}

#[allow(clippy::too_many_arguments)]
async fn bench(
    cp: &meshgate_testenv::ControlPlane,
    client: &kube::Client,
    node: &RealNode,
    rounds: usize,
    release_rounds: usize,
    dra_resource: &str,
    status_resource: &str,
) -> Result<(), Error> {
    let ns = cp.namespace("bench", &[]).await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let nodes: Api<Node> = Api::all(client.clone());

    // The resource in the node status, the DRA objects, the mesh plugin chained, the node
    // plugin registered.
    advertise(&nodes, node.name(), status_resource, true).await?;
    set_mesh_plugin(node, true)?;
    apply_value(client, meshgate_core::dra::device_class(GATE, dra_resource)).await?;
    let slice = publish_slice(client, node.name(), true).await?;
    let mut plugin = NodePlugin::start(node).await?;
    eprintln!(
        "pod_startup: node {} ready; slice {slice}; node plugin registered",
        node.name()
    );

    let strategies = strategies(dra_resource, status_resource)?;
    eprintln!(
        "pod_startup: {} strategies x {rounds} rounds (ready node)",
        strategies.len()
    );
    let mut times = Rounds::default();
    let mut n = 0usize;
    for round in 0..rounds {
        times.new_round();
        for i in shuffled(strategies.len(), round as u64) {
            let s = &strategies[i];
            n += 1;
            let name = format!("{}-{n}", s.name);
            let started = start_pod(&pods, &pod_of(&name, s), &name).await?;
            times.record(&s.name, &started);
            remove_pod(&pods, node, &started).await?;
        }
        eprintln!("pod_startup: round {}: {}", round + 1, times.last());
    }
    println!("\n== pod start on a ready node (create -> app Running; -> Ready), {rounds} rounds");
    let names: Vec<&str> = strategies.iter().map(|s| s.name.as_str()).collect();
    times.print_values(&names);
    for s in strategies.iter().filter(|s| s.name != "none") {
        times.print_ratio(&s.name, "none");
    }

    // Held, then released.
    println!("\n== held on a node that is not ready, then released ({release_rounds} rounds)");
    let base = &strategies[0];
    let with_resource = |name: &str| Strategy {
        name: name.into(),
        init: None,
        requests: [(name.to_owned(), "1".to_owned())].into(),
    };
    let layers: [(&str, Strategy); 4] = [
        ("taint", base.clone()),
        ("resource", with_resource(status_resource)),
        ("dra-slice", with_resource(dra_resource)),
        ("dra-prepare", with_resource(dra_resource)),
    ];
    for (layer, strategy) in &layers {
        let mut released = Vec::new();
        let mut placed_early = 0usize;
        for _ in 0..release_rounds {
            n += 1;
            let name = format!("held-{layer}-{n}");
            // Not ready.
            match *layer {
                "taint" => taint(&nodes, node.name(), true).await?,
                "resource" => advertise(&nodes, node.name(), status_resource, false).await?,
                "dra-slice" => {
                    publish_slice(client, node.name(), false).await?;
                }
                _ => set_mesh_plugin(node, false)?,
            }
            // A pod the scheduler placed before it saw the node become not ready is not held:
            // counted, removed, and another created (at most twice).
            let mut name = name;
            for attempt in 1.. {
                pods.create(
                    &PostParams::default(),
                    &serde_json::from_value(pod_of(&name, strategy))?,
                )
                .await?;
                if *layer == "dra-prepare" {
                    break;
                }
                match scheduler_verdict(&pods, &name).await? {
                    Verdict::Held => break,
                    Verdict::Placed(node) if attempt < 3 => {
                        eprintln!(
                            "pod_startup: {name} bound to {node} before the scheduler saw the node not ready; again"
                        );
                        placed_early += 1;
                        delete_pod(&pods, &name).await?;
                        name = format!("{name}-again");
                    }
                    Verdict::Placed(node) => {
                        return Err(format!(
                            "{name}: bound to {node} on {attempt} attempts: not held"
                        )
                        .into());
                    }
                }
            }
            // Seen holding.
            if *layer == "dra-prepare" {
                plugin
                    .wait_for_log("the pod's sandbox is held", POD_LIMIT)
                    .await?;
                let p = pods.get(&name).await?;
                let bound = p
                    .spec
                    .as_ref()
                    .and_then(|s| s.node_name.as_deref())
                    .is_some();
                let sandbox = node.sandbox_pid(p.metadata.uid.as_deref().unwrap_or_default());
                if !bound || sandbox.is_ok() {
                    return Err(format!(
                        "{name}: held in prepare, but bound={bound} and a sandbox {}",
                        if sandbox.is_ok() {
                            "exists"
                        } else {
                            "does not exist"
                        }
                    )
                    .into());
                }
            }
            // Ready.
            let t = Instant::now();
            match *layer {
                "taint" => taint(&nodes, node.name(), false).await?,
                "resource" => advertise(&nodes, node.name(), status_resource, true).await?,
                "dra-slice" => {
                    publish_slice(client, node.name(), true).await?;
                }
                _ => set_mesh_plugin(node, true)?,
            }
            wait_running(&pods, &name).await?;
            released.push(t.elapsed());
            delete_pod(&pods, &name).await?;
        }
        released.sort();
        println!(
            "VALUE release-{layer}-p50-ms: {} (max {}, {} rounds; {placed_early} pod(s) bound before the scheduler saw the node not ready, created again)",
            meshgate_testenv::measure::quantile(&released, 0.5).as_millis(),
            released.last().copied().unwrap_or_default().as_millis(),
            released.len()
        );
    }
    plugin.stop();
    Ok(())
}

/// Every strategy's additions to the app pod, `none` first.
fn strategies(dra_resource: &str, status_resource: &str) -> Result<Vec<Strategy>, Error> {
    let plain = |name: &str| Strategy {
        name: name.into(),
        init: None,
        requests: BTreeMap::new(),
    };
    let request = |name: &str, resource: &str| Strategy {
        name: name.into(),
        init: None,
        requests: [(resource.to_owned(), "1".to_owned())].into(),
    };
    let mut out = vec![
        plain("none"),
        plain("taint"),
        request("resource", status_resource),
        request("dra", dra_resource),
    ];
    // The init gate as the planner builds it, with a check that passes at once.
    let file_gate = GateConfig {
        selectors: vec![meshgate_api::config::SelectorClause {
            name: "bench".into(),
            ..Default::default()
        }],
        init_gate: InitGate {
            image: GATE_IMAGE.into(),
            image_pull_policy: "Never".into(),
            checks: vec![GateCheck::File {
                path: "/meshgate-wait".into(),
            }],
            ..InitGate::default()
        },
        ..GateConfig::default()
    };
    out.push(added(
        "pod-gate-file",
        &file_gate,
        &app_pod_value("x"),
        &Meta::default(),
    )?);
    for profile in ["istio-ambient", "istio-sidecar", "linkerd"] {
        let mut config = meshgate::install::gate_config(profile, "meshgate-system", GATE_IMAGE)?;
        config.init_gate.image_pull_policy = "Never".into();
        let (pod, ns_meta) = profile_pod(profile);
        out.push(added(
            &format!("default-{profile}"),
            &config,
            &pod,
            &ns_meta,
        )?);
    }
    Ok(out)
}

/// What the planner adds to `pod` under `config`: its init container and resource requests.
fn added(name: &str, config: &GateConfig, pod: &Value, ns_meta: &Meta) -> Result<Strategy, Error> {
    let planner = Planner::new(config);
    let plan = planner.plan(&PodRequest {
        operation: "CREATE",
        namespace: "bench",
        pod,
        namespace_meta: ns_meta,
        limit_ranges: &[],
    });
    let PodPlan::Mutate { patch, verdict, .. } = plan else {
        return Err(format!("{name}: the planner does not select the pod: {plan:?}").into());
    };
    if verdict.is_err() {
        return Err(format!("{name}: the planner does not gate the pod: {verdict:?}").into());
    }
    let mutated = patch.apply(pod)?;
    let init = mutated["spec"]["initContainers"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["name"] == meshgate_api::names::GATE_CONTAINER)
        .cloned();
    let mut requests = BTreeMap::new();
    for c in mutated["spec"]["containers"]
        .as_array()
        .into_iter()
        .flatten()
    {
        for (k, v) in c["resources"]["requests"].as_object().into_iter().flatten() {
            if meshgate_api::node_gate::is_extended_resource(k) {
                requests.insert(k.clone(), v.as_str().unwrap_or("1").to_owned());
            }
        }
    }
    Ok(Strategy {
        name: name.into(),
        init,
        requests,
    })
}

/// A pod of the profile's shape, as the mesh's injector leaves it, and its namespace.
fn profile_pod(profile: &str) -> (Value, Meta) {
    let mut pod = app_pod_value("x");
    let mut ns = Meta::default();
    match profile {
        "istio-ambient" => {
            ns.labels
                .insert("istio.io/dataplane-mode".into(), "ambient".into());
        }
        "istio-sidecar" => {
            ns.labels.insert("istio-injection".into(), "enabled".into());
            pod["metadata"]["annotations"] = json!({"sidecar.istio.io/status": "{\"initContainers\":[\"istio-validation\"],\"containers\":[\"istio-proxy\"]}"});
            pod["spec"]["initContainers"] = json!([{"name": "istio-validation", "image": "proxy", "args": ["istio-iptables", "--run-validation"], "securityContext": {"runAsUser": 1337, "runAsGroup": 1337}}]);
            if let Some(c) = pod["spec"]["containers"].as_array_mut() {
                c.push(json!({"name": "istio-proxy", "image": "proxy", "args": ["proxy", "sidecar"], "securityContext": {"runAsUser": 1337, "runAsGroup": 1337}}));
            }
        }
        _ => {
            pod["metadata"]["annotations"] = json!({"linkerd.io/inject": "enabled"});
            pod["spec"]["initContainers"] = json!([{"name": "linkerd-network-validator", "image": "proxy", "args": ["--connect-addr", "1.1.1.1:20001"]}]);
            if let Some(c) = pod["spec"]["containers"].as_array_mut() {
                c.insert(0, json!({"name": "linkerd-proxy", "image": "proxy", "securityContext": {"runAsUser": 2102}}));
            }
        }
    }
    (pod, ns)
}

fn app_pod_value(name: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Always",
            "automountServiceAccountToken": false,
            "enableServiceLinks": false,
            "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "app", "image": APP_IMAGE, "imagePullPolicy": "Never"}],
        },
    })
}

fn pod_of(name: &str, s: &Strategy) -> Value {
    let mut pod = app_pod_value(name);
    if let Some(init) = &s.init {
        pod["spec"]["initContainers"] = json!([init]);
    }
    if !s.requests.is_empty() {
        pod["spec"]["containers"][0]["resources"] =
            json!({"requests": s.requests, "limits": s.requests});
    }
    pod
}

async fn wait_running(pods: &Api<Pod>, name: &str) -> Result<(), Error> {
    let t = Instant::now();
    while t.elapsed() < POD_LIMIT {
        if app_running(&pods.get(name).await?) {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Err(format!("{name}: not running after {POD_LIMIT:?}").into())
}

/// Where the scheduler put a pod created on a node that is not ready.
enum Verdict {
    /// `PodScheduled` `False`, `Unschedulable`: held.
    Held,
    /// Bound to this node: the scheduler placed it before it saw the node become not ready
    /// (its caches follow the API server by a watch; the bench writes and creates at once).
    Placed(String),
}

/// Waits until the scheduler either reports the pod unschedulable or binds it. After
/// [`POD_LIMIT`] the error says what the pod showed last (its `PodScheduled` condition).
async fn scheduler_verdict(pods: &Api<Pod>, name: &str) -> Result<Verdict, Error> {
    let t = Instant::now();
    let mut last = String::from("no PodScheduled condition");
    while t.elapsed() < POD_LIMIT {
        let p = pods.get(name).await?;
        if let Some(node) = p.spec.as_ref().and_then(|s| s.node_name.clone()) {
            return Ok(Verdict::Placed(node));
        }
        if let Some(c) = p
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .into_iter()
            .flatten()
            .find(|c| c.type_ == "PodScheduled")
        {
            if c.status == "False" && c.reason.as_deref() == Some("Unschedulable") {
                return Ok(Verdict::Held);
            }
            last = format!(
                "PodScheduled {} {}: {}",
                c.status,
                c.reason.as_deref().unwrap_or_default(),
                c.message.as_deref().unwrap_or_default()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Err(format!("{name}: neither held nor bound after {POD_LIMIT:?}; last seen: {last}").into())
}

async fn advertise(nodes: &Api<Node>, node: &str, resource: &str, on: bool) -> Result<(), Error> {
    let patch = meshgate_core::nodegate::resource_patch(resource, 110, on);
    nodes
        .patch_status(node, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    Ok(())
}

async fn taint(nodes: &Api<Node>, node: &str, on: bool) -> Result<(), Error> {
    let n = nodes.get(node).await?;
    let mut taints: Vec<Value> = n
        .spec
        .and_then(|s| s.taints)
        .unwrap_or_default()
        .into_iter()
        .filter(|t| t.key != meshgate_api::names::DEFAULT_TAINT_KEY)
        .map(|t| serde_json::to_value(t).unwrap_or_default())
        .collect();
    if on {
        taints.push(json!({"key": meshgate_api::names::DEFAULT_TAINT_KEY, "effect": "NoSchedule"}));
    }
    nodes
        .patch(
            node,
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"taints": taints}})),
        )
        .await?;
    Ok(())
}

async fn apply_value(client: &kube::Client, doc: Value) -> Result<(), Error> {
    meshgate::install::apply(client, &[doc], false, |_| {}).await?;
    Ok(())
}

/// Publishes (or deletes) the bench gate's slice for the node; its name.
async fn publish_slice(client: &kube::Client, node: &str, on: bool) -> Result<String, Error> {
    let api: Api<k8s_openapi::api::resource::v1::ResourceSlice> = Api::all(client.clone());
    let name = meshgate_core::dra::slice_name(GATE, node);
    if on {
        let slice =
            meshgate_core::dra::resource_slice(GATE, node, meshgate_core::dra::Devices::Shared);
        api.create(&PostParams::default(), &serde_json::from_value(slice)?)
            .await?;
    } else {
        api.delete(&name, &DeleteParams::default()).await?;
        let t = Instant::now();
        while api.get_opt(&name).await?.is_some() {
            if t.elapsed() > POD_LIMIT {
                return Err(format!("slice {name} not gone").into());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    Ok(name)
}

/// Chains (or unchains) the bench's mesh plugin in the node's CNI configuration, replacing the
/// file at once, as mesh CNI agents do.
fn set_mesh_plugin(node: &RealNode, on: bool) -> Result<(), Error> {
    let path = node.cni_conf_dir().join("10-meshgate.conflist");
    let mut conf: Value = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
    let plugins = conf["plugins"]
        .as_array_mut()
        .ok_or("the node's conflist has no plugins")?;
    plugins.retain(|p| p["type"] != MESH_PLUGIN);
    if on {
        plugins.push(json!({"type": MESH_PLUGIN}));
    }
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, serde_json::to_vec_pretty(&conf)?)?;
    std::fs::rename(&tmp, &path)?;
    Ok(())
}

/// `meshgate node` on the host, as the node's DRA kubelet plugin.
struct NodePlugin {
    child: std::process::Child,
    log: PathBuf,
}

impl NodePlugin {
    async fn start(node: &RealNode) -> Result<Self, Error> {
        let port = meshgate_testenv::free_port()?;
        let log = node.run_dir().join("logs/meshgate-node.log");
        let file = std::fs::File::create(&log)?;
        let child =
            std::process::Command::new(meshgate_testenv::workspace_binary("meshgate", "meshgate"))
                .args([
                    "node",
                    "--kubelet-root",
                    &node.run_dir().join("kubelet/root").display().to_string(),
                    "--cni-conf-dir",
                    &node.cni_conf_dir().display().to_string(),
                    "--cni-plugin",
                    MESH_PLUGIN,
                    "--health-addr",
                    &format!("127.0.0.1:{port}"),
                ])
                .env("RUST_LOG", "info")
                .stdout(file.try_clone()?)
                .stderr(file)
                .spawn()?;
        let plugin = Self { child, log };
        let t = Instant::now();
        loop {
            if let Ok((200, _)) = http_get(port, "/readyz").await {
                return Ok(plugin);
            }
            if t.elapsed() > POD_LIMIT {
                return Err(format!(
                    "the node plugin did not register with the kubelet: {}",
                    std::fs::read_to_string(&plugin.log).unwrap_or_default()
                )
                .into());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until the plugin's log has a new line containing `what`.
    async fn wait_for_log(&mut self, what: &str, limit: Duration) -> Result<(), Error> {
        let seen = count_lines(&self.log, what);
        let t = Instant::now();
        while t.elapsed() < limit {
            if count_lines(&self.log, what) > seen {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Err(format!("the node plugin never logged {what:?}").into())
    }

    fn stop(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn count_lines(path: &Path, what: &str) -> usize {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(what))
        .count()
}

async fn http_get(port: u16, path: &str) -> Result<(u16, String), Error> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes())
        .await?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).await?;
    let code = buf
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    Ok((code, buf))
}
