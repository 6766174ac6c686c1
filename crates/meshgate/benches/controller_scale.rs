//! The node gate controller at scale, against the real control plane (etcd + kube-apiserver
//! from `MESHGATE_CONTROLPLANE_BIN`, see `tools/controlplane`).
//!
//! For each size N (`MESHGATE_BENCH_NODES`, default `1000,5000`):
//! 1. N Nodes labelled `pool=scale<N>`, each registered with the gate's startup taint (as the
//!    webhook puts it at creation), and 2 agent pods per node (`cni`, `node-proxy`) bound to it,
//!    not Ready; a NodeGate for the pool, continuous mode with no grace period and a re-taint
//!    budget of 100% (agents made unready put the taint back on every node at once, so that
//!    every round starts from N tainted nodes).
//! 2. The controller (`meshgate_controller::nodegate::run`, leader from the start) runs in a
//!    child process (this binary re-executed with `MESHGATE_BENCH_ROLE=controller`), so that its
//!    RSS is its own, with the default settings; the bench waits until the gate's status counts
//!    N held nodes.
//! 3. Rounds (`MESHGATE_BENCH_ROUNDS`, 5, for N <= 1000; one round above), each two
//!    measurements in alternating order:
//!    * **burst**: every agent pod is marked Ready (status patches, 64 in flight). A node's
//!      "ready" time is when the patch of its second agent returned; its "untaint" time is when
//!      a watch on the pool's nodes (started before) first shows it without the taint; the
//!      release time is from the first patch to the last node seen released. Then the agents
//!      are made unready and the bench waits until every node is tainted again.
//!    * **bare patches**, the physical limit: a minimal client adds a taint the controller does
//!      not own to every node (not timed), then removes it from every node with one JSON patch
//!      each (test the key, remove it; 64 in flight), timed. Then the same removals again, sent
//!      together with the 2N agent status patches a burst consists of (agents stay Ready: the
//!      controller changes nothing), timed: the physical limit of the whole burst, of which the
//!      agents' own patches are most.
//!
//!    The ratios release / bare and release / (agents + bare) are per round; the median and
//!    spread are reported.
//! 4. **Steady arrivals**: with every node tainted again, `MESHGATE_BENCH_STEADY` (200) nodes
//!    become ready one at a time, 10 per second (both agents of a node patched together); the
//!    latency from each node's last agent patch to its taint gone (p50, p99, max).
//!
//! Reported: per-node ready->untaint latency of the last burst (p50, p99, max), the burst's
//! length, the time until the last node is released, untaints and reconciles per second (the
//! controller's `reconciles` counter over the burst), the controller's `VmRSS`/`VmHWM` after
//! the rounds, the release/bare ratios and the steady-arrival latencies. Every wait is bounded;
//! the nodes and pods are deleted after each size.
//!
//! Run: `MESHGATE_CONTROLPLANE_BIN=... cargo bench -p meshgate --bench controller_scale`.
//! Without `--bench` (as `cargo test --benches` runs it) it does nothing.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use meshgate_api::NodeGate;
use meshgate_api::node_gate::NodeGateSpec;
use meshgate_testenv::measure::{self, quantile};
use serde_json::json;

/// The allocator of the `meshgate` binary, so that the controller child's RSS is the binary's
/// (the system allocator with `--features bench-system-allocator`, for a heap profiler).
#[cfg(not(feature = "bench-system-allocator"))]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const ROLE_ENV: &str = "MESHGATE_BENCH_ROLE";
/// A command (words split on spaces) the controller child is run under, e.g. `heaptrack -o F`.
const WRAPPER_ENV: &str = "MESHGATE_BENCH_CONTROLLER_WRAPPER";
/// Set: the controller child exits at once when the bench is done with it, without dropping
/// what it holds, so that a heap profiler reports the controller's memory at that moment as
/// not freed at exit.
const EXIT_AT_ONCE_ENV: &str = "MESHGATE_BENCH_CONTROLLER_EXIT_AT_ONCE";
/// The controller's `Settings::concurrency` (default: `meshgate controller`'s).
const CONTROLLER_CONCURRENCY_ENV: &str = "MESHGATE_BENCH_CONTROLLER_CONCURRENCY";
const KUBECONFIG_ENV: &str = "MESHGATE_BENCH_KUBECONFIG";
const TAINT: &str = "node.meshgate.dev/agent-not-ready";
/// The baseline's taint: a key the controller does not own.
const BARE_TAINT: &str = "bench.meshgate.dev/bare";
/// Requests in flight while creating and patching.
const CONCURRENCY: usize = 64;
/// Upper bound for each phase (create, sync, release).
const PHASE_LIMIT: Duration = Duration::from_secs(600);
/// The controller child ends by itself after this long.
const CHILD_LIFETIME: Duration = Duration::from_secs(1800);
const MIB: f64 = 1024.0 * 1024.0;

fn main() -> ExitCode {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    if std::env::var(ROLE_ENV).as_deref() == Ok("controller") {
        return runtime.block_on(controller());
    }
    if !std::env::args().any(|a| a == "--bench") {
        eprintln!("controller_scale: run with `cargo bench` (needs the control plane)");
        return ExitCode::SUCCESS;
    }
    match runtime.block_on(run()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("controller_scale: {e}");
            ExitCode::FAILURE
        }
    }
}

// ------------------------------------------------------------------------------------------
// The controller child: runs until stdin closes; on a `metrics` line prints its metrics
// followed by `END`.

async fn client_from(path: &std::path::Path) -> Result<kube::Client, String> {
    let kubeconfig = kube::config::Kubeconfig::read_from(path).map_err(|e| e.to_string())?;
    let mut config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .map_err(|e| e.to_string())?;
    config.read_timeout = Some(Duration::from_secs(120));
    kube::Client::try_from(config).map_err(|e| e.to_string())
}

async fn controller() -> ExitCode {
    std::thread::spawn(|| {
        std::thread::sleep(CHILD_LIFETIME);
        eprintln!("controller child: lifetime over, exiting");
        std::process::exit(2);
    });
    let path = std::env::var_os(KUBECONFIG_ENV).expect(KUBECONFIG_ENV);
    let client = client_from(std::path::Path::new(&path))
        .await
        .expect("kube client");
    let metrics = meshgate_controller::Metrics::new();
    let (_leader_tx, leader) = meshgate_controller::leader::manual(true);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    // The defaults of `meshgate controller` (gate status every 5 s, resync every 300 s, 16
    // nodes at once), the concurrency from `MESHGATE_BENCH_CONTROLLER_CONCURRENCY` if set.
    let mut settings = meshgate_controller::nodegate::Settings::default();
    if let Some(n) = std::env::var(CONTROLLER_CONCURRENCY_ENV)
        .ok()
        .and_then(|v| v.trim().parse().ok())
    {
        settings.concurrency = n;
    }
    let task = tokio::spawn(meshgate_controller::nodegate::run(
        client,
        leader,
        metrics.clone(),
        settings,
        async move {
            let _ = stop_rx.await;
        },
    ));
    println!("started {}", std::process::id());
    std::io::stdout().flush().expect("stdout");
    let m = metrics.clone();
    tokio::task::spawn_blocking(move || {
        let stdin = std::io::stdin();
        for line in stdin.lock().lines() {
            let Ok(line) = line else { break };
            if line.trim() == "metrics" {
                let mut out = std::io::stdout().lock();
                let _ = writeln!(out, "{}\nEND", m.encode());
                let _ = out.flush();
            }
        }
    })
    .await
    .expect("stdin reader");
    if std::env::var_os(EXIT_AT_ONCE_ENV).is_some() {
        std::process::exit(0);
    }
    let _ = stop_tx.send(());
    let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
    ExitCode::SUCCESS
}

struct ControllerChild {
    child: Child,
    /// The controller's process (not a wrapper's).
    pid: u32,
    lines: std::sync::mpsc::Receiver<String>,
}

impl ControllerChild {
    fn spawn(kubeconfig: &std::path::Path) -> Result<Self, String> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let wrapper = std::env::var(WRAPPER_ENV).unwrap_or_default();
        let mut words = wrapper.split_whitespace();
        let mut command = match words.next() {
            Some(program) => {
                let mut c = Command::new(program);
                c.args(words).arg(&exe);
                c
            }
            None => Command::new(&exe),
        };
        let mut child = command
            .env(ROLE_ENV, "controller")
            .env(KUBECONFIG_ENV, kubeconfig)
            .env_remove("RUST_LOG")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("starting the controller: {e}"))?;
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut c = ControllerChild {
            pid: child.id(),
            child,
            lines,
        };
        // A wrapper may print lines of its own first.
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            match c
                .lines
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            {
                Ok(l) if l.starts_with("started ") => {
                    c.pid = l["started ".len()..].trim().parse().unwrap_or(c.pid);
                    return Ok(c);
                }
                Ok(l) if !wrapper.is_empty() => eprintln!("{wrapper}: {l}"),
                other => return Err(format!("the controller did not start: {other:?}")),
            }
        }
    }

    /// The controller's `reconciles` counter.
    fn reconciles(&mut self) -> Result<u64, String> {
        let stdin = self.child.stdin.as_mut().ok_or("no stdin")?;
        writeln!(stdin, "metrics").map_err(|e| e.to_string())?;
        stdin.flush().map_err(|e| e.to_string())?;
        let mut value = None;
        loop {
            let line = self
                .lines
                .recv_timeout(Duration::from_secs(30))
                .map_err(|_| "no metrics from the controller".to_owned())?;
            if line == "END" {
                break;
            }
            if let Some(v) = line.strip_prefix("meshgate_controller_reconciles_total ") {
                value = v.trim().parse().ok();
            }
        }
        value.ok_or_else(|| "no reconciles counter".to_owned())
    }

    /// `VmHWM` and `VmRSS`, bytes.
    fn memory(&self) -> Result<(u64, u64), String> {
        measure::memory(self.pid)
    }

    fn stop(mut self) {
        drop(self.child.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for ControllerChild {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

// ------------------------------------------------------------------------------------------
// The measurement.

fn ms(d: Duration) -> String {
    format!("{:.0} ms", d.as_secs_f64() * 1e3)
}

/// Runs `f` over `items` with [`CONCURRENCY`] in flight; fails on the first error.
async fn each<T, F, Fut>(items: Vec<T>, f: F) -> Result<(), String>
where
    F: Fn(T) -> Fut,
    Fut: Future<Output = Result<(), String>>,
{
    let run = futures::stream::iter(items.into_iter().map(f))
        .buffer_unordered(CONCURRENCY)
        .try_collect::<Vec<()>>();
    tokio::time::timeout(PHASE_LIMIT, run)
        .await
        .map_err(|_| "phase timed out".to_owned())?
        .map(|_| ())
}

fn tainted(node: &Node) -> bool {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|ts| ts.iter().any(|t| t.key == TAINT))
}

async fn run() -> Result<(), String> {
    let sizes: Vec<usize> = std::env::var("MESHGATE_BENCH_NODES")
        .unwrap_or_else(|_| "1000,5000".to_owned())
        .split(',')
        .map(|s| {
            s.trim()
                .parse()
                .map_err(|e| format!("MESHGATE_BENCH_NODES: {e}"))
        })
        .collect::<Result<_, _>>()?;
    let started = Instant::now();
    let cp = meshgate_testenv::ControlPlane::start(meshgate_testenv::Options::default())
        .await
        .map_err(|e| format!("control plane: {e}"))?;
    let client = cp.client().await.map_err(|e| e.to_string())?;
    let crds = meshgate::install::crd_documents().map_err(|e| e.to_string())?;
    meshgate::install::apply(&client, &crds, false, |_| {})
        .await
        .map_err(|e| format!("CRDs: {e}"))?;
    let agents_ns = cp
        .namespace("agents", &[])
        .await
        .map_err(|e| e.to_string())?;
    println!(
        "control plane up in {:.1} s; agents in namespace {agents_ns}; the controller reconciles \
         {} nodes at once",
        started.elapsed().as_secs_f64(),
        std::env::var(CONTROLLER_CONCURRENCY_ENV)
            .unwrap_or_else(|_| meshgate_controller::nodegate::DEFAULT_CONCURRENCY.to_string()),
    );
    println!(
        "{:>6} {:>9} {:>9} {:>9} {:>9} {:>10} {:>11} {:>11} {:>12} {:>10} {:>10}",
        "nodes",
        "p50",
        "p99",
        "max",
        "burst",
        "last out",
        "untaint/s",
        "reconcile/s",
        "reconciles",
        "RSS",
        "VmHWM"
    );
    let mut headlines = Vec::new();
    for n in sizes {
        let figures = scale(&cp, &client, &agents_ns, n).await?;
        headlines.push((n, figures));
    }
    // Headline figures, one per line, for tools (issue #17's format).
    for (n, f) in headlines {
        println!("RATIO burst-release/bare-patches-{n}: {:.2}", f.ratio);
        println!(
            "RATIO burst-release/agent-and-bare-patches-{n}: {:.2}",
            f.ratio_with_agents
        );
        println!("VALUE controller-rss-{n}-mib: {:.1}", f.rss_mib);
        println!("VALUE untaint-burst-p99-{n}-ms: {:.0}", f.p99_ms);
        println!("VALUE untaint-steady-p99-{n}-ms: {:.0}", f.steady_p99_ms);
    }
    Ok(())
}

/// One size's headline figures.
struct Headline {
    rss_mib: f64,
    /// Median over rounds of the burst's per-node p99.
    p99_ms: f64,
    /// Median over rounds of release time / bare patch time.
    ratio: f64,
    /// Median over rounds of release time / the time of the bare patches sent together with
    /// the burst's agent status patches.
    ratio_with_agents: f64,
    steady_p99_ms: f64,
}

async fn scale(
    cp: &meshgate_testenv::ControlPlane,
    client: &kube::Client,
    agents_ns: &str,
    n: usize,
) -> Result<Headline, String> {
    let pool = format!("scale{n}");
    let nodes: Api<Node> = Api::all(client.clone());
    let pods: Api<Pod> = Api::namespaced(client.clone(), agents_ns);
    let names: Vec<String> = (0..n).map(|i| format!("{pool}-{i:05}")).collect();

    let t = Instant::now();
    each(names.clone(), |name| {
        let (nodes, pool) = (nodes.clone(), pool.clone());
        async move {
            let node: Node = serde_json::from_value(json!({
                "apiVersion": "v1", "kind": "Node",
                "metadata": {"name": name, "labels": {"pool": pool}},
                "spec": {"taints": [{"key": TAINT, "effect": "NoSchedule"}]},
            }))
            .map_err(|e| e.to_string())?;
            nodes
                .create(&PostParams::default(), &node)
                .await
                .map(|_| ())
                .map_err(|e| format!("node {name}: {e}"))
        }
    })
    .await?;
    let agents: Vec<(String, &str, String)> = names
        .iter()
        .flat_map(|node| {
            ["cni", "node-proxy"].map(|app| (format!("{app}-{node}"), app, node.clone()))
        })
        .collect();
    each(agents.clone(), |(name, app, node)| {
        let (pods, pool) = (pods.clone(), pool.clone());
        async move {
            let pod: Pod = serde_json::from_value(json!({
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "labels": {"app": app, "pool": pool}},
                "spec": {"nodeName": node,
                         "containers": [{"name": "agent", "image": "agent.invalid/agent:1"}],
                         "tolerations": [{"operator": "Exists"}]},
            }))
            .map_err(|e| e.to_string())?;
            pods.create(&PostParams::default(), &pod)
                .await
                .map(|_| ())
                .map_err(|e| format!("pod {name}: {e}"))
        }
    })
    .await?;
    let created = t.elapsed();

    let spec: NodeGateSpec = serde_json::from_value(json!({
        "agents": [
            {"name": "cni", "namespace": agents_ns,
             "selector": {"matchLabels": {"app": "cni", "pool": pool}}},
            {"name": "node-proxy", "namespace": agents_ns,
             "selector": {"matchLabels": {"app": "node-proxy", "pool": pool}}},
        ],
        "nodeSelector": {"matchLabels": {"pool": pool}},
        // Continuous, no grace: agents made unready put the taint back at once, so that the
        // release can be measured again in the next round.
        // Every node may be re-tainted at once (the default budget is 10%).
        "mode": "Continuous",
        "gracePeriodSeconds": 0,
        "maxRetainted": "100%",
    }))
    .map_err(|e| e.to_string())?;
    let gates: Api<NodeGate> = Api::all(client.clone());
    gates
        .create(&PostParams::default(), &NodeGate::new(&pool, spec))
        .await
        .map_err(|e| format!("gate: {e}"))?;

    let mut controller = ControllerChild::spawn(&cp.kubeconfig_path)?;
    // Synced: the gate's status counts every node, all held.
    let t_sync = Instant::now();
    loop {
        let status = gates
            .get(&pool)
            .await
            .map_err(|e| e.to_string())?
            .status
            .unwrap_or_default();
        if status.nodes as usize == n && status.held_nodes as usize == n {
            break;
        }
        if t_sync.elapsed() > PHASE_LIMIT {
            return Err(format!(
                "gate status never counted {n} held nodes: {status:?}"
            ));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let synced = t_sync.elapsed();

    // Watch the pool's nodes: whether each carries the gate's taint, and (per measurement) the
    // first time each is seen without it.
    let state: Arc<Mutex<Seen>> = Arc::default();
    let (watch_ready_tx, watch_ready_rx) = tokio::sync::oneshot::channel::<()>();
    let watch = {
        let state = state.clone();
        let config = watcher::Config::default().labels(&format!("pool={pool}"));
        let stream = watcher(nodes.clone(), config);
        tokio::spawn(async move {
            let mut ready_tx = Some(watch_ready_tx);
            let mut stream = std::pin::pin!(stream);
            while let Some(event) = stream.next().await {
                let now = Instant::now();
                match event {
                    Ok(watcher::Event::InitDone) => {
                        if let Some(tx) = ready_tx.take() {
                            let _ = tx.send(());
                        }
                    }
                    Ok(watcher::Event::Apply(node) | watcher::Event::InitApply(node)) => {
                        let name = node.metadata.name.clone().unwrap_or_default();
                        let mut seen = state.lock().expect("lock");
                        if tainted(&node) {
                            seen.tainted.insert(name);
                        } else {
                            seen.tainted.remove(&name);
                            seen.released.entry(name).or_insert(now);
                        }
                    }
                    _ => {}
                }
            }
        })
    };
    tokio::time::timeout(Duration::from_secs(120), watch_ready_rx)
        .await
        .map_err(|_| "node watch did not sync".to_owned())?
        .map_err(|_| "node watch ended".to_owned())?;

    // Rounds, alternating which goes first: the controller releases every node after a burst
    // of agent readiness; a minimal client removes a bare taint (a key the controller does not
    // own) from every node, as fast as the API server takes it (the physical limit).
    let rounds = if n <= 1000 { settings_rounds() } else { 1 };
    let mut release = Vec::new();
    let mut bare = Vec::new();
    let mut bare_with_agents = Vec::new();
    let mut burst_p99 = Vec::new();
    let mut last: Option<(Vec<Duration>, Duration, Duration, u64)> = None;
    for r in 0..rounds {
        for step in 0..2 {
            if (r + step) % 2 == 0 {
                eprintln!("{n} nodes, round {}: burst", r + 1);
                if r > 0 || step > 0 {
                    // Agents unready: the controller taints every node again.
                    set_ready(&pods, &agents, false).await?;
                    wait_until(&state, PHASE_LIMIT, |s| s.tainted.len() == n, "re-tainted").await?;
                }
                let reconciles_before = controller.reconciles()?;
                state.lock().expect("lock").released.clear();
                let burst_start = Instant::now();
                let ready_at = set_ready(&pods, &agents, true).await?;
                let burst = burst_start.elapsed();
                wait_until(&state, PHASE_LIMIT, |s| s.released.len() == n, "released").await?;
                let last_out = burst_start.elapsed();
                let reconciles = controller.reconciles()?.saturating_sub(reconciles_before);
                let released = state.lock().expect("lock").released.clone();
                let mut latencies: Vec<Duration> = names
                    .iter()
                    .filter_map(|node| {
                        let (count, ready) = ready_at.get(node)?;
                        let out = released.get(node)?;
                        (*count == 2).then(|| out.saturating_duration_since(*ready))
                    })
                    .collect();
                latencies.sort_unstable();
                if latencies.len() != n {
                    return Err(format!("{} of {n} nodes have both times", latencies.len()));
                }
                release.push(last_out.as_secs_f64());
                burst_p99.push(quantile(&latencies, 0.99).as_secs_f64() * 1e3);
                last = Some((latencies, burst, last_out, reconciles));
            } else {
                eprintln!("{n} nodes, round {}: bare patches", r + 1);
                let (alone, with_agents) = bare_patches(&nodes, &names, &pods, &agents).await?;
                bare.push(alone.as_secs_f64());
                bare_with_agents.push(with_agents.as_secs_f64());
            }
        }
    }
    let (latencies, burst, last_out, reconciles) = last.ok_or("no round")?;
    let (hwm, rss) = controller.memory()?;

    // Steady arrivals: nodes become ready one at a time at a fixed rate (their agents unready
    // first, the taint back on every node); the latency from each node's last agent Ready to its
    // taint gone.
    let steady_n = settings_steady().min(n);
    set_ready(&pods, &agents, false).await?;
    wait_until(&state, PHASE_LIMIT, |s| s.tainted.len() == n, "re-tainted").await?;
    state.lock().expect("lock").released.clear();
    let interval = Duration::from_secs_f64(1.0 / STEADY_RATE);
    let mut ticker = tokio::time::interval(interval);
    let mut steady_ready: HashMap<String, Instant> = HashMap::new();
    for node in names.iter().take(steady_n) {
        ticker.tick().await;
        let mine: Vec<(String, &str, String)> =
            agents.iter().filter(|a| &a.2 == node).cloned().collect();
        let at = set_ready(&pods, &mine, true).await?;
        if let Some((2, t)) = at.get(node) {
            steady_ready.insert(node.clone(), *t);
        }
    }
    wait_until(
        &state,
        PHASE_LIMIT,
        |s| {
            names
                .iter()
                .take(steady_n)
                .all(|node| s.released.contains_key(node))
        },
        "steady nodes released",
    )
    .await?;
    let released = state.lock().expect("lock").released.clone();
    let mut steady: Vec<Duration> = steady_ready
        .iter()
        .filter_map(|(node, ready)| Some(released.get(node)?.saturating_duration_since(*ready)))
        .collect();
    steady.sort_unstable();
    watch.abort();
    controller.stop();

    let ratios = |base: &[f64]| -> (f64, (f64, f64)) {
        let ratios: Vec<f64> = release.iter().zip(base).map(|(a, b)| a / b).collect();
        let spread = (
            ratios.iter().copied().fold(f64::INFINITY, f64::min),
            ratios.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        );
        (measure::median(ratios), spread)
    };
    let (ratio, spread) = ratios(&bare);
    let (ratio_with_agents, spread_with_agents) = ratios(&bare_with_agents);
    println!(
        "{:>6} {:>9} {:>9} {:>9} {:>9} {:>10} {:>11.0} {:>11.0} {:>12} {:>6.1} MiB {:>6.1} MiB",
        n,
        ms(quantile(&latencies, 0.5)),
        ms(quantile(&latencies, 0.99)),
        ms(quantile(&latencies, 1.0)),
        ms(burst),
        ms(last_out),
        n as f64 / last_out.as_secs_f64(),
        reconciles as f64 / last_out.as_secs_f64(),
        reconciles,
        rss as f64 / MIB,
        hwm as f64 / MIB,
    );
    println!(
        "       (setup: {n} nodes and {} agent pods created in {:.1} s; controller synced in \
         {:.1} s; the row is the last of {rounds} rounds)",
        2 * n,
        created.as_secs_f64(),
        synced.as_secs_f64(),
    );
    println!(
        "       release of all {n} after the burst: {} s per round; {n} bare taint patches: {} s per round; \
         ratio release/bare median {ratio:.2} (spread {:.2}-{:.2}, {rounds} rounds)",
        release
            .iter()
            .map(|v| format!("{v:.2}"))
            .collect::<Vec<_>>()
            .join(" "),
        bare.iter()
            .map(|v| format!("{v:.2}"))
            .collect::<Vec<_>>()
            .join(" "),
        spread.0,
        spread.1,
    );
    println!(
        "       the same {n} bare patches sent together with the {} agent status patches of a burst: {} s per round; \
         ratio release/(agents+bare) median {ratio_with_agents:.2} (spread {:.2}-{:.2})",
        2 * n,
        bare_with_agents
            .iter()
            .map(|v| format!("{v:.2}"))
            .collect::<Vec<_>>()
            .join(" "),
        spread_with_agents.0,
        spread_with_agents.1,
    );
    println!(
        "       steady arrivals: {} nodes ready at {STEADY_RATE} per s: ready -> untaint p50 {}, p99 {}, max {}",
        steady.len(),
        ms(quantile(&steady, 0.5)),
        ms(quantile(&steady, 0.99)),
        ms(quantile(&steady, 1.0)),
    );

    // Clean up (bounded): the next size starts from the same cluster.
    let _ = gates.delete(&pool, &DeleteParams::default()).await;
    let selector = ListParams::default().labels(&format!("pool={pool}"));
    let _ = tokio::time::timeout(
        Duration::from_secs(120),
        pods.delete_collection(&DeleteParams::default().grace_period(0), &selector),
    )
    .await;
    let _ = tokio::time::timeout(
        Duration::from_secs(120),
        nodes.delete_collection(&DeleteParams::default(), &selector),
    )
    .await;
    Ok(Headline {
        rss_mib: rss as f64 / MIB,
        p99_ms: measure::median(burst_p99),
        ratio,
        ratio_with_agents,
        steady_p99_ms: quantile(&steady, 0.99).as_secs_f64() * 1e3,
    })
}

/// What the node watch has seen.
#[derive(Default)]
struct Seen {
    /// Nodes that carry the gate's taint now.
    tainted: std::collections::HashSet<String>,
    /// The first time each node was seen without it, since the last clear.
    released: HashMap<String, Instant>,
}

/// Nodes made ready per second in the steady phase.
const STEADY_RATE: f64 = 10.0;

fn settings_rounds() -> usize {
    std::env::var("MESHGATE_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(5)
        .max(1)
}

fn settings_steady() -> usize {
    std::env::var("MESHGATE_BENCH_STEADY")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(200)
}

async fn wait_until(
    state: &Arc<Mutex<Seen>>,
    limit: Duration,
    done: impl Fn(&Seen) -> bool,
    what: &str,
) -> Result<(), String> {
    let deadline = Instant::now() + limit;
    loop {
        if done(&state.lock().expect("lock")) {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("not {what} within {limit:?}"));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Marks the agent pods Ready (or not): status patches, 64 in flight. Returns, per node, how
/// many of its agents were patched and when the last patch returned.
async fn set_ready(
    pods: &Api<Pod>,
    agents: &[(String, &str, String)],
    ready: bool,
) -> Result<HashMap<String, (u8, Instant)>, String> {
    let ready_at: Arc<Mutex<HashMap<String, (u8, Instant)>>> = Arc::default();
    each(agents.to_vec(), |(name, _, node)| {
        let (pods, ready_at) = (pods.clone(), ready_at.clone());
        async move {
            let now = k8s_openapi::jiff::Timestamp::now().to_string();
            let status = json!({"status": {"phase": "Running", "conditions": [
                {"type": "Ready", "status": if ready { "True" } else { "False" }, "lastTransitionTime": now},
            ]}});
            pods.patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
                .await
                .map_err(|e| format!("pod {name} status: {e}"))?;
            let done = Instant::now();
            let mut map = ready_at.lock().expect("lock");
            let entry = map.entry(node).or_insert((0, done));
            entry.0 += 1;
            entry.1 = entry.1.max(done);
            Ok(())
        }
    })
    .await?;
    let map = ready_at.lock().expect("lock").clone();
    Ok(map)
}

/// The baselines. A bare taint (a key the controller does not own) is added to every node (not
/// timed), then removed from every node by a minimal client, 64 JSON patches in flight (test
/// the key, remove it), as the controller's own untaint patch does: the time of the removals.
/// Then the same again, the removals sent together with what the burst sends besides the
/// controller's writes, every agent pod's status patch (Ready again, a new transition time; 64
/// in flight each): the time of both, the physical limit of the whole burst. Agents are Ready
/// during this phase (it always follows a burst), so the controller changes nothing.
async fn bare_patches(
    nodes: &Api<Node>,
    names: &[String],
    pods: &Api<Pod>,
    agents: &[(String, &str, String)],
) -> Result<(Duration, Duration), String> {
    add_bare_taints(nodes, names).await?;
    let start = Instant::now();
    remove_bare_taints(nodes, names).await?;
    let bare = start.elapsed();
    add_bare_taints(nodes, names).await?;
    let start = Instant::now();
    let (agents, removed) = futures::join!(
        set_ready(pods, agents, true),
        remove_bare_taints(nodes, names)
    );
    agents?;
    removed?;
    Ok((bare, start.elapsed()))
}

async fn add_bare_taints(nodes: &Api<Node>, names: &[String]) -> Result<(), String> {
    each(names.to_vec(), |name| {
        let nodes = nodes.clone();
        async move {
            let patch: json_patch::Patch = serde_json::from_value(json!([
                {"op": "add", "path": "/spec/taints", "value": [{"key": BARE_TAINT, "effect": "NoSchedule"}]},
            ]))
            .map_err(|e| e.to_string())?;
            nodes
                .patch(&name, &PatchParams::default(), &Patch::<()>::Json(patch))
                .await
                .map(|_| ())
                .map_err(|e| format!("bare taint on {name}: {e}"))
        }
    })
    .await
}

async fn remove_bare_taints(nodes: &Api<Node>, names: &[String]) -> Result<(), String> {
    each(names.to_vec(), |name| {
        let nodes = nodes.clone();
        async move {
            let patch: json_patch::Patch = serde_json::from_value(json!([
                {"op": "test", "path": "/spec/taints/0/key", "value": BARE_TAINT},
                {"op": "remove", "path": "/spec/taints/0"},
            ]))
            .map_err(|e| e.to_string())?;
            nodes
                .patch(&name, &PatchParams::default(), &Patch::<()>::Json(patch))
                .await
                .map(|_| ())
                .map_err(|e| format!("bare untaint of {name}: {e}"))
        }
    })
    .await
}
