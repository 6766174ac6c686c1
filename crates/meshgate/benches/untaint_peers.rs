//! meshgate's node gate against Istio's node untaint controller (istiod's
//! `PILOT_ENABLE_NODE_UNTAINT_CONTROLLERS`), the same work on one control plane in alternating
//! rounds: simulated nodes registered with Istio's `cni.istio.io/not-ready` taint, one CNI agent
//! pod per node (`k8s-app=istio-cni-node` in `istio-system`, bound by `nodeName`, its status
//! written by this benchmark), and each controller lifting a node's taint once its agent is
//! Ready. meshgate's gate waits for that one agent, as Istio's does (`taintOnCreate: false`: it
//! only lifts).
//!
//! Each peer runs as its own process: `meshgate controller` (its leader election on, as
//! installed) and `pilot-discovery discovery` out of the cluster (no CA, no injection or
//! validation webhooks, no leader election, no Istio configuration: what the untaint controller
//! needs and little else; istiod still runs its service registry and XDS server, which is part of
//! what a user pays for it).
//!
//! For each scale (`MESHGATE_BENCH_SCALES`, default `1 100 1000` nodes) and mode (`burst`: every
//! agent made Ready at once, 32 writes in flight; `steady`: one agent every 20 ms), rounds
//! alternate the peers (`MESHGATE_BENCH_ROUNDS` pairs, default 5), printing:
//! * `RATIO meshgate/istio-untaint-lift-p50-<mode>-<n>` (and `-p99-`): from the agent's Ready write
//!   answered to the taint seen gone by a watch, median of the per-pair ratios, with the spread;
//!   `VALUE` lines with each peer's own figures;
//! * `RATIO meshgate/istio-untaint-requests-<mode>-<n>`: the API server's mutating requests per node
//!   lifted (its `apiserver_request_total`, less this benchmark's own writes), from a quiet API
//!   server before the readies to a quiet one after the last lift (what a peer writes after
//!   its lifts is its round's);
//! * `RATIO meshgate/istio-untaint-rss-peak-<mode>-<n>`: each process's peak resident memory
//!   (`VmHWM`) at the round's end, MiB (a fresh process a round);
//! * `RATIO meshgate/istio-untaint-cpu-<mode>-<n>`: the controller process's CPU seconds for the
//!   round (`/proc/<pid>/stat`);
//! * of the last pair, where the cost is: `VALUE requests-by-kind-<mode>-<n>`,
//!   `VALUE meshgate-counters-per-node-<mode>-<n>` (meshgate's reconciles and writes by
//!   operation, from its `/metrics`) and `VALUE slowest-lifts-<mode>-<n>` (each peer's slowest
//!   lifts, with when in the round their agent turned Ready: a periodic stall shows as a
//!   period).
//!
//! The peers take turns going first in a pair. `MESHGATE_BENCH_APISERVER_PROFILE=DIR` writes the
//! API server's CPU profile over the readies of each peer's first steady round at each scale
//! (`DIR/steady-<n>-<peer>.pprof`; `go tool pprof -top`).
//!
//! The node-readiness-controller (kubernetes-sigs) cannot be built here (its module is refused by
//! the module proxy); BENCHMARKS.md compares with its published scale-test design instead.
//!
//! Run: `MESHGATE_CONTROLPLANE_BIN=... MESHGATE_ISTIO=... cargo bench -p meshgate --bench
//! untaint_peers` (BENCHMARKS.md).

use std::collections::{BTreeMap, HashMap};
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[path = "../tests/common/mod.rs"]
mod common;

use common::karpenter::percentile;
use common::*;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use meshgate_testenv::ControlPlane;
use serde_json::json;

const KEY: &str = "cni.istio.io/not-ready";
const NS: &str = "istio-system";
const LABEL: &str = "meshgate-bench=untaint";

#[derive(Clone, Copy, PartialEq)]
enum Peer {
    Meshgate,
    Istio,
}

impl Peer {
    fn name(self) -> &'static str {
        match self {
            Peer::Meshgate => "meshgate",
            Peer::Istio => "istio-untaint",
        }
    }
}

struct Round {
    lifts: Vec<Duration>,
    requests_per_node: f64,
    /// Per node, by resource and verb (this benchmark's own writes included).
    requests_by_kind: BTreeMap<String, f64>,
    cpu_seconds: f64,
    /// The process's peak resident memory (`VmHWM`, MiB) at the round's end: its start and
    /// the round (each round starts a fresh process).
    rss_peak_mib: f64,
    /// The slowest lifts: when the agent's Ready write was answered (from the round's first)
    /// and the lift, slowest first.
    slowest: Vec<(Duration, Duration)>,
    /// meshgate's own counters over the round (its `/metrics`), per node: reconciles run and
    /// writes by operation. Empty for Istio.
    own_counters: BTreeMap<String, f64>,
}

fn env_list(name: &str, default: &[usize]) -> Vec<usize> {
    std::env::var(name)
        .ok()
        .map(|v| {
            v.split_whitespace()
                .filter_map(|x| x.parse().ok())
                .collect()
        })
        .unwrap_or_else(|| default.to_vec())
}

/// CPU seconds (user + system) of a process so far.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command's closing parenthesis: utime and stime are the 12th and 13th.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<f64> = rest
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect();
    if f.len() < 13 {
        return 0.0;
    }
    (f[11] + f[12]) / 100.0
}

/// A process's peak resident memory so far (`VmHWM`), in MiB.
fn rss_peak_mib(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

/// The API server's mutating requests so far (`apiserver_request_total`), by resource (and
/// subresource) and verb.
async fn mutating_requests(client: &kube::Client) -> BTreeMap<String, f64> {
    let req = http::Request::get("/metrics")
        .body(Vec::new())
        .expect("request");
    let text = client.request_text(req).await.unwrap_or_default();
    let label = |l: &str, name: &str| -> String {
        l.split(&format!("{name}=\""))
            .nth(1)
            .and_then(|r| r.split('"').next())
            .unwrap_or_default()
            .to_owned()
    };
    let mut out = BTreeMap::new();
    for l in text
        .lines()
        .filter(|l| l.starts_with("apiserver_request_total{"))
    {
        let verb = label(l, "verb");
        if !["POST", "PUT", "PATCH", "DELETE", "APPLY"].contains(&verb.as_str()) {
            continue;
        }
        let sub = label(l, "subresource");
        let what = format!(
            "{}{}{} {verb}",
            label(l, "resource"),
            if sub.is_empty() { "" } else { "/" },
            sub
        );
        if let Some(v) = l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()) {
            *out.entry(what).or_insert(0.0) += v;
        }
    }
    out
}

/// meshgate's node-gate counters so far (its `/metrics`): reconciles run and writes by
/// operation.
async fn meshgate_counters(port: u16) -> BTreeMap<String, f64> {
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let Some((_, text)) = http_get(addr, "/metrics").await else {
        return BTreeMap::new();
    };
    let mut out = BTreeMap::new();
    for l in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((name, value)) = l.rsplit_once(' ') else {
            continue;
        };
        let Ok(v) = value.parse::<f64>() else {
            continue;
        };
        let key = if name == "meshgate_controller_reconciles_total" {
            "reconciles".to_owned()
        } else if let Some(labels) = name.strip_prefix("meshgate_controller_operations_total{") {
            format!("writes {}", labels.trim_end_matches('}'))
        } else {
            continue;
        };
        *out.entry(key).or_insert(0.0) += v;
    }
    out
}

/// Waits until the API server has seen no mutating request but lease renewals for 600 ms (at
/// most 60 s): what a peer writes after its lifts (meshgate's node conditions and Events come
/// after the release) is counted in its round, and nothing of the nodes' creation is.
async fn settled(client: &kube::Client) -> BTreeMap<String, f64> {
    let writes = |m: &BTreeMap<String, f64>| -> f64 {
        m.iter()
            .filter(|(k, _)| !k.starts_with("leases "))
            .map(|(_, v)| v)
            .sum()
    };
    let t = Instant::now();
    let mut last = mutating_requests(client).await;
    let mut quiet_since = Instant::now();
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = mutating_requests(client).await;
        if writes(&now) != writes(&last) {
            quiet_since = Instant::now();
        }
        last = now;
        if quiet_since.elapsed() >= Duration::from_millis(600)
            || t.elapsed() > Duration::from_secs(60)
        {
            return last;
        }
    }
}

fn start_meshgate(cp: &ControlPlane, port: u16) -> ChildProcess {
    let health = format!("127.0.0.1:{port}");
    let args: Vec<String> = [
        "controller",
        "--lease-namespace",
        NS,
        "--identity",
        "bench",
        "--health-addr",
        &health,
    ]
    .iter()
    .map(|a| (*a).to_owned())
    .collect();
    ChildProcess::spawn(
        "meshgate controller",
        &meshgate_bin(),
        &args,
        &[
            ("KUBECONFIG", cp.kubeconfig_path.as_os_str()),
            ("RUST_LOG", std::ffi::OsStr::new("warn")),
        ],
        &cp.dir().join("bench-meshgate.log"),
    )
}

fn start_istiod(
    cp: &ControlPlane,
    istio: &meshgate_testenv::istio::Istio,
    port: u16,
) -> ChildProcess {
    let work = cp.dir().join("istiod");
    let (cwd, config) = (work.join("cwd"), work.join("config"));
    std::fs::create_dir_all(&cwd).expect("istiod dir");
    std::fs::create_dir_all(&config).expect("istiod config dir");
    let mesh = work.join("mesh.yaml");
    std::fs::write(&mesh, "ingressControllerMode: \"OFF\"\n").expect("mesh config");
    let args: Vec<String> = vec![
        "discovery".into(),
        format!("--kubeconfig={}", cp.kubeconfig_path.display()),
        format!("--configDir={}", config.display()),
        format!("--meshConfig={}", mesh.display()),
        format!("--httpAddr=127.0.0.1:{port}"),
        "--grpcAddr=".into(),
        "--secureGRPCAddr=".into(),
        "--httpsAddr=".into(),
        "--monitoringAddr=".into(),
        "--ctrlz_port=0".into(),
        "--log_output_level=default:warn".into(),
    ];
    let env: Vec<(&str, &std::ffi::OsStr)> = [
        ("POD_NAMESPACE", NS),
        ("POD_NAME", "istiod-bench"),
        ("PILOT_ENABLE_NODE_UNTAINT_CONTROLLERS", "true"),
        ("ENABLE_LEADER_ELECTION", "false"),
        ("ENABLE_CA_SERVER", "false"),
        ("INJECT_ENABLED", "false"),
        ("VALIDATION_WEBHOOK_CONFIG_NAME", ""),
    ]
    .iter()
    .map(|(k, v)| (*k, std::ffi::OsStr::new(*v)))
    .collect();
    let mut cmd_env = env;
    cmd_env.push(("HOME", cwd.as_os_str()));
    ChildProcess::spawn(
        "pilot-discovery",
        &istio.bin("pilot-discovery"),
        &args,
        &cmd_env,
        &cp.dir().join("bench-istiod.log"),
    )
}

/// Creates `n` nodes with Istio's taint and, on each, an agent pod that is not Ready.
async fn create_nodes(client: &kube::Client, n: usize) -> Vec<String> {
    let nodes: Api<Node> = Api::all(client.clone());
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let names: Vec<String> = (0..n).map(|i| format!("sim-{i:04}")).collect();
    futures::stream::iter(names.clone())
        .map(|name| {
            let (nodes, pods) = (nodes.clone(), pods.clone());
            async move {
                let node: Node = serde_json::from_value(json!({
                    // The annotation every kubelet writes at registration (a real node is
                    // never without annotations).
                    "metadata": {"name": name, "labels": {"meshgate-bench": "untaint"},
                                 "annotations": {"volumes.kubernetes.io/controller-managed-attach-detach": "true"}},
                    "spec": {"taints": [{"key": KEY, "value": "true", "effect": "NoSchedule"}]},
                }))
                .expect("node");
                nodes
                    .create(&PostParams::default(), &node)
                    .await
                    .expect("node created");
                let pod: Pod = serde_json::from_value(json!({
                    "metadata": {"name": format!("cni-{name}"), "labels": {"k8s-app": "istio-cni-node", "meshgate-bench": "untaint"}},
                    "spec": {"nodeName": name, "tolerations": [{"operator": "Exists"}],
                             "containers": [{"name": "install-cni", "image": "registry.invalid/cni:1"}]},
                }))
                .expect("pod");
                pods.create(&PostParams::default(), &pod)
                    .await
                    .expect("pod created");
                set_ready(&pods, &format!("cni-{name}"), false).await;
            }
        })
        .buffer_unordered(32)
        .collect::<Vec<()>>()
        .await;
    names
}

async fn set_ready(pods: &Api<Pod>, name: &str, ready: bool) {
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let status = json!({"status": {"phase": "Running", "conditions": [
        {"type": "Ready", "status": if ready { "True" } else { "False" }, "lastTransitionTime": now}]}});
    pods.patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .expect("agent status");
}

async fn delete_nodes(client: &kube::Client) {
    let nodes: Api<Node> = Api::all(client.clone());
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let force = DeleteParams {
        grace_period_seconds: Some(0),
        ..Default::default()
    };
    let _ = pods
        .delete_collection(&force, &ListParams::default().labels(LABEL))
        .await;
    let _ = nodes
        .delete_collection(
            &DeleteParams::default(),
            &ListParams::default().labels(LABEL),
        )
        .await;
    loop {
        let left = nodes
            .list(&ListParams::default().labels(LABEL))
            .await
            .map(|l| l.items.len())
            .unwrap_or(1)
            + pods
                .list(&ListParams::default().labels(LABEL))
                .await
                .map(|l| l.items.len())
                .unwrap_or(1);
        if left == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// One round: `n` nodes, their agents made Ready (`burst` or steadily), until every taint is
/// gone; the lift times, the API writes per node and the peer's CPU.
async fn round(
    client: &kube::Client,
    peer: Peer,
    (pid, port): (u32, u16),
    n: usize,
    burst: bool,
    profile: Option<&std::path::Path>,
) -> Round {
    let names = create_nodes(client, n).await;
    let lifted: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let seen = lifted.clone();
    let nodes: Api<Node> = Api::all(client.clone());
    let watch = tokio::spawn(async move {
        let stream = watcher(nodes, watcher::Config::default().labels(LABEL)).applied_objects();
        futures::pin_mut!(stream);
        while let Some(Ok(node)) = stream.next().await {
            let held = taint_keys(&node).iter().any(|k| k == KEY);
            if !held && let Some(name) = node.metadata.name {
                seen.lock()
                    .expect("lifted")
                    .entry(name)
                    .or_insert_with(Instant::now);
            }
        }
    });
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let req0 = settled(client).await;
    let cpu0 = cpu_seconds(pid);
    let own0 = match peer {
        Peer::Meshgate => meshgate_counters(port).await,
        Peer::Istio => BTreeMap::new(),
    };
    let started = Instant::now();
    let ready_at: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let parallel = if burst { 32 } else { 1 };
    let profiled = async {
        if let Some(path) = profile {
            // The readies take 20 ms each in steady mode: the profile covers them.
            let seconds = (n / 50).max(1) + 1;
            let bytes = meshgate_testenv::measure::apiserver_cpu_profile(client, seconds)
                .await
                .expect("API server profile");
            std::fs::write(path, bytes).expect("profile written");
        }
    };
    let readies = futures::stream::iter(names.clone())
        .map(|name| {
            let (pods, ready_at) = (pods.clone(), ready_at.clone());
            async move {
                if !burst {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                set_ready(&pods, &format!("cni-{name}"), true).await;
                ready_at.lock().expect("ready").insert(name, Instant::now());
            }
        })
        .buffer_unordered(parallel)
        .collect::<Vec<()>>();
    futures::join!(readies, profiled);
    let t = Instant::now();
    while lifted.lock().expect("lifted").len() < n {
        assert!(
            t.elapsed() < Duration::from_secs(300),
            "only {} of {n} nodes lifted in 300 s",
            lifted.lock().expect("lifted").len()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let req1 = settled(client).await;
    let cpu1 = cpu_seconds(pid);
    let rss_peak = rss_peak_mib(pid);
    let own1 = match peer {
        Peer::Meshgate => meshgate_counters(port).await,
        Peer::Istio => BTreeMap::new(),
    };
    watch.abort();
    let lifted = lifted.lock().expect("lifted").clone();
    let ready_at = ready_at.lock().expect("ready").clone();
    let lifts: Vec<Duration> = names
        .iter()
        .map(|n| lifted[n].saturating_duration_since(ready_at[n]))
        .collect();
    let mut slowest: Vec<(Duration, Duration)> = names
        .iter()
        .zip(&lifts)
        .map(|(n, l)| (ready_at[n].saturating_duration_since(started), *l))
        .collect();
    slowest.sort_by_key(|(_, l)| std::cmp::Reverse(*l));
    slowest.truncate(8);
    let own_counters = own1
        .iter()
        .map(|(k, v)| {
            (
                k.clone(),
                (v - own0.get(k).copied().unwrap_or(0.0)) / n as f64,
            )
        })
        .filter(|(_, v)| *v > 0.0)
        .collect();
    delete_nodes(client).await;
    let requests_by_kind: BTreeMap<String, f64> = req1
        .iter()
        .map(|(k, v)| {
            (
                k.clone(),
                (v - req0.get(k).copied().unwrap_or(0.0)) / n as f64,
            )
        })
        .filter(|(_, v)| *v > 0.0)
        .collect();
    let total: f64 = requests_by_kind.values().sum::<f64>() * n as f64;
    Round {
        lifts,
        // Less this benchmark's own writes in the window: one Ready write per node.
        requests_per_node: (total - n as f64).max(0.0) / n as f64,
        requests_by_kind,
        cpu_seconds: cpu1 - cpu0,
        rss_peak_mib: rss_peak,
        slowest,
        own_counters,
    }
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs.get(xs.len() / 2).copied().unwrap_or(f64::NAN)
}

fn spread(xs: &[f64]) -> (f64, f64) {
    let lo = xs.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = xs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (lo, hi)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn report(label: &str, pairs: &[(Round, Round)]) {
    let figure = |name: &str, f: &dyn Fn(&Round) -> f64| {
        let ratios: Vec<f64> = pairs.iter().map(|(m, i)| f(m) / f(i)).collect();
        let (lo, hi) = spread(&ratios);
        println!(
            "RATIO meshgate/istio-untaint-{name}-{label}: {:.2} (spread {lo:.2}-{hi:.2}, {} rounds)",
            median(ratios.clone()),
            pairs.len()
        );
        let mine: Vec<f64> = pairs.iter().map(|(m, _)| f(m)).collect();
        let theirs: Vec<f64> = pairs.iter().map(|(_, i)| f(i)).collect();
        println!(
            "VALUE {name}-{label}: meshgate {:.3}, istio-untaint {:.3} (medians)",
            median(mine),
            median(theirs)
        );
    };
    figure("lift-p50", &|r| ms(percentile(&r.lifts, 50.0)).max(0.001));
    figure("lift-p99", &|r| ms(percentile(&r.lifts, 99.0)).max(0.001));
    figure("requests", &|r| r.requests_per_node.max(0.001));
    figure("cpu", &|r| r.cpu_seconds.max(0.001));
    figure("rss-peak", &|r| r.rss_peak_mib.max(0.001));
    // What the requests are, in the last pair (the agents' status writes are this benchmark's).
    if let Some((m, i)) = pairs.last() {
        let kinds = |r: &Round| {
            r.requests_by_kind
                .iter()
                .map(|(k, v)| format!("{k} {v:.2}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        println!(
            "VALUE requests-by-kind-{label}: meshgate [{}]; istio-untaint [{}]",
            kinds(m),
            kinds(i)
        );
        let own = m
            .own_counters
            .iter()
            .map(|(k, v)| format!("{k} {v:.2}"))
            .collect::<Vec<_>>()
            .join(", ");
        println!("VALUE meshgate-counters-per-node-{label}: [{own}]");
        // Where the tail is: each slowest lift with when its agent turned Ready in the round.
        let slowest = |r: &Round| {
            r.slowest
                .iter()
                .map(|(at, l)| format!("{:.0} ms at {:.2} s", ms(*l), at.as_secs_f64()))
                .collect::<Vec<_>>()
                .join(", ")
        };
        println!(
            "VALUE slowest-lifts-{label}: meshgate [{}]; istio-untaint [{}]",
            slowest(m),
            slowest(i)
        );
    }
}

async fn wait_ready(peer: Peer, process: &mut ChildProcess, port: u16) {
    let t = Instant::now();
    loop {
        process.assert_running();
        // Caches synced: istiod's `/ready`, the controller's `/readyz`.
        let path = match peer {
            Peer::Istio => "/ready",
            Peer::Meshgate => "/readyz",
        };
        let ready = http_get(format!("127.0.0.1:{port}").parse().expect("addr"), path)
            .await
            .is_some_and(|(code, _)| code == 200);
        if ready {
            return;
        }
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "{} not ready in 120 s:\n{}",
            peer.name(),
            process.log_tail(30)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    if !std::env::args().any(|a| a == "--bench") {
        return ExitCode::SUCCESS;
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    let rounds = env_list("MESHGATE_BENCH_ROUNDS", &[5])
        .first()
        .copied()
        .unwrap_or(5)
        .max(1);
    let scales = env_list("MESHGATE_BENCH_SCALES", &[1, 100, 1000]);
    let istio = match meshgate_testenv::istio::Istio::find() {
        Ok(i) => i,
        Err(e) => {
            eprintln!("untaint_peers: Istio: {e}");
            return ExitCode::FAILURE;
        }
    };
    // MESHGATE_BENCH_APISERVER_PROFILE=DIR: the API server's CPU profile over each peer's first
    // steady round at each scale, `steady-<n>-<peer>.pprof` in DIR (`go tool pprof -top`).
    let profile =
        std::env::var_os("MESHGATE_BENCH_APISERVER_PROFILE").map(std::path::PathBuf::from);
    let cp = ControlPlane::start(meshgate_testenv::Options::profiling(profile.is_some()))
        .await
        .expect("control plane");
    let client = cp.client().await.expect("client");
    install_crds(&client).await;
    let namespace: k8s_openapi::api::core::v1::Namespace =
        serde_json::from_value(json!({"metadata": {"name": NS}})).expect("namespace");
    Api::<k8s_openapi::api::core::v1::Namespace>::all(client.clone())
        .create(&PostParams::default(), &namespace)
        .await
        .expect("namespace created");
    let gate: meshgate_api::NodeGate = serde_json::from_value(json!({
        "apiVersion": "meshgate.dev/v1alpha1", "kind": "NodeGate",
        "metadata": {"name": "istio-cni"},
        "spec": {
            "agents": [{"name": "istio-cni-node", "namespace": NS,
                        "selector": {"matchLabels": {"k8s-app": "istio-cni-node"}}}],
            "taint": {"key": KEY}, "taintOnCreate": false,
        },
    }))
    .expect("gate");
    Api::<meshgate_api::NodeGate>::all(client.clone())
        .create(&PostParams::default(), &gate)
        .await
        .expect("gate created");
    println!(
        "VALUE istio: {} (pilot-discovery, out of cluster)",
        istio.version
    );
    for &n in &scales {
        for burst in [true, false] {
            let mode = if burst { "burst" } else { "steady" };
            let mut pairs = Vec::new();
            for r in 0..rounds {
                // Each peer goes first in every other pair: neither always meets the API server
                // fresh from the cleanup of the other's nodes.
                let order = if r % 2 == 0 {
                    [Peer::Meshgate, Peer::Istio]
                } else {
                    [Peer::Istio, Peer::Meshgate]
                };
                let mut results = HashMap::new();
                for peer in order {
                    let port = meshgate_testenv::free_port().expect("port");
                    let mut process = match peer {
                        Peer::Meshgate => start_meshgate(&cp, port),
                        Peer::Istio => start_istiod(&cp, &istio, port),
                    };
                    wait_ready(peer, &mut process, port).await;
                    // The API server's profile over the readies of each peer's first steady round.
                    let profile_to = match &profile {
                        Some(dir) if !burst && r == 0 => {
                            Some(dir.join(format!("{mode}-{n}-{}.pprof", peer.name())))
                        }
                        _ => None,
                    };
                    let result = round(
                        &client,
                        peer,
                        (process.pid(), port),
                        n,
                        burst,
                        profile_to.as_deref(),
                    )
                    .await;
                    process.assert_running();
                    drop(process);
                    results.insert(peer.name(), result);
                }
                let istio_round = results.remove(Peer::Istio.name()).expect("istio");
                let meshgate_round = results.remove(Peer::Meshgate.name()).expect("meshgate");
                pairs.push((meshgate_round, istio_round));
            }
            report(&format!("{mode}-{n}"), &pairs);
        }
    }
    ExitCode::SUCCESS
}
