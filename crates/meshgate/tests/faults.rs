//! Faults on the real control plane. Each test has a private control plane (the faults would
//! disturb shared ones), and the tests run one at a time (the load of one would be the noise of
//! another on a small machine).
//!
//! * `kube_apiserver_restart`, `etcd_restart`: the node gate controller runs through a restart of
//!   kube-apiserver or etcd; it converges afterwards, and no node whose agents are not all Ready is
//!   untainted at any time.
//! * `leader_crash_failover`: two `meshgate controller` processes elect a leader on a Lease; the
//!   leader is killed with SIGKILL (a crash: the Lease is not released). The other replica takes
//!   the Lease once it has expired and does the work (a node whose agents become Ready is
//!   untainted); a node with an unready agent is never untainted meanwhile. Prints the failover
//!   time.
//! * `paused_leader_steps_down`: the leader of two replicas is paused (SIGSTOP) past its lease;
//!   the other takes the lease and does the work, then crashes with its lease still valid. The
//!   paused replica, resumed (SIGCONT), makes no write to the nodes or the gate (their
//!   resourceVersions, read before each read of the lease) until it holds the lease again; it
//!   logs that it stepped down, then does the work that waited. Prints the writes seen (0).
//! * `the_retaint_budget_holds_across_a_failover`: a Continuous gate with `maxRetainted: 1` over
//!   three nodes whose agents all fail: the leader re-taints one and defers two; it is killed,
//!   the other replica takes the lease and reconciles the nodes (its own `RetaintDeferred`
//!   Events, named by its `POD_NAME`), and the budget holds: never more than one node tainted.
//!   The budget is counted from the nodes as the cluster shows them, so it is every replica's.
//! * `webhook_sigterm_under_load`: the `meshgate webhook` process, registered with
//!   `failurePolicy: Fail`, gets SIGTERM while 48 tasks create pods through the API server. Every
//!   create that succeeded carries the gate. Every create that failed, failed to connect to the
//!   webhook (`connection refused`, or reset while queued on the closing listener): none by a
//!   reset, EOF, timeout or error answer on a connection, and none whose review the webhook
//!   answered (its debug log names each answered review). Some creates succeeded before the signal
//!   and some in flight at the signal succeeded after it; creates after the exit fail; the
//!   process exits 0 within its grace period. Prints the counts.
//! * `certificate_rotation_under_load`: while 16 tasks create pods, the webhook's certificate
//!   files are swapped for a new certificate from the same CA, like a Secret update (the caBundle
//!   does not change). No create fails, every pod carries the gate; a fresh TLS client trusting
//!   the CA gets the new certificate; the webhook counts one reload and no reload error. The API
//!   server keeps its HTTP/2 connection across the rotation, so the webhook is then registered at
//!   `localhost` and the API server, on a new connection (checked in `/proc/net/tcp`), goes on
//!   creating pods through the new certificate.
//!
//! The webhook and controllers run as child processes (`CARGO_BIN_EXE_meshgate`) started through
//! `setpriv --pdeathsig KILL`, so none outlives its test.
//!
//! Run: `cargo test -p meshgate --test faults -- --nocapture`.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime};

use common::*;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, Patch, PatchParams, PostParams};
use meshgate_api::config::FailurePolicy;
use meshgate_api::{GateConfig, NodeGate, Profile};
use meshgate_core::registration::{Registration, WebhookTarget, webhook_configuration};
use meshgate_pki::Ca;
use meshgate_testenv::{ControlPlane, Options, SecretDir};
use serde_json::json;

/// The tests here run one at a time (see the module doc).
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const TAINT: &str = "node.meshgate.dev/agent-not-ready";

async fn has_taint(nodes: &Api<Node>, name: &str) -> Option<bool> {
    let n = nodes.get(name).await.ok()?;
    Some(
        n.spec
            .and_then(|s| s.taints)
            .unwrap_or_default()
            .iter()
            .any(|t| t.key == TAINT),
    )
}

async fn agent(client: &kube::Client, name: &str, app: &str, node: &str, ready: bool) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {"app": app}},
        "spec": {"nodeName": node, "tolerations": [{"operator": "Exists"}],
                 "containers": [{"name": "a", "image": "registry.invalid/agent:1"}]},
    }))
    .expect("pod");
    if pods.get_opt(name).await.expect("get").is_none() {
        pods.create(&PostParams::default(), &pod)
            .await
            .expect("agent created");
    }
    set_ready(client, name, ready).await;
}

async fn set_ready(client: &kube::Client, name: &str, ready: bool) {
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let status = json!({"status": {"phase": "Running", "conditions": [
        {"type": "Ready", "status": if ready { "True" } else { "False" }, "lastTransitionTime": now}]}});
    Api::<Pod>::namespaced(client.clone(), "default")
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .expect("agent status");
}

/// Who runs the node gate controller in a [`Scene`].
enum Controllers {
    /// `meshgate_controller::nodegate::run` in this process, without leader election.
    InProcess,
    /// `meshgate controller` processes with these identities, leader-elected on a Lease.
    Replicas(&'static [&'static str]),
}

/// Seconds of the Lease of the replicas (`--lease-seconds`).
const LEASE_SECONDS: u64 = 4;

/// A `meshgate controller` child process.
struct Replica {
    identity: String,
    process: ChildProcess,
}

/// A private control plane with the CRDs, a gate, the controller, and two nodes: `held` (one
/// agent never Ready) and `released` (becomes ready after the fault). A watcher records whether
/// `held` is ever seen without its taint.
struct Scene {
    /// The replicas (with [`Controllers::Replicas`]; first, so that they stop before the control
    /// plane) and their Lease's namespace.
    replicas: Vec<Replica>,
    lease_namespace: String,
    cp: ControlPlane,
    client: kube::Client,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    wrongly_untainted: Arc<AtomicBool>,
    watcher: tokio::task::JoinHandle<()>,
}

async fn scene() -> Scene {
    scene_with(Controllers::InProcess).await
}

async fn scene_with(controllers: Controllers) -> Scene {
    let cp = ControlPlane::start(Options::default())
        .await
        .expect("control plane");
    let client = cp.client().await.expect("client");
    install_crds(&client).await;
    let gate: NodeGate = serde_json::from_value(json!({
        "apiVersion": "meshgate.dev/v1alpha1", "kind": "NodeGate",
        "metadata": {"name": "faults"},
        "spec": {"agents": [
            {"name": "cni", "namespace": "default", "selector": {"matchLabels": {"app": "cni"}}},
            {"name": "proxy", "namespace": "default", "selector": {"matchLabels": {"app": "proxy"}}},
        ]},
    }))
    .expect("gate");
    Api::<NodeGate>::all(client.clone())
        .create(&PostParams::default(), &gate)
        .await
        .expect("gate created");
    let mut stop = None;
    let mut lease_namespace = String::new();
    let mut replicas = Vec::new();
    match controllers {
        Controllers::InProcess => {
            let (stop_tx, stopped) = tokio::sync::oneshot::channel::<()>();
            stop = Some(stop_tx);
            let controller_client = client.clone();
            tokio::spawn(async move {
                meshgate_controller::nodegate::run(
                    controller_client,
                    meshgate_controller::leader::always(),
                    meshgate_controller::Metrics::new(),
                    Default::default(),
                    async move {
                        let _ = stopped.await;
                    },
                )
                .await;
            });
        }
        Controllers::Replicas(identities) => {
            lease_namespace = cp.namespace("lease", &[]).await.expect("lease namespace");
            for identity in identities {
                let health = format!(
                    "127.0.0.1:{}",
                    meshgate_testenv::free_port().expect("free port")
                );
                let args: Vec<String> = [
                    "controller",
                    "--lease-namespace",
                    &lease_namespace,
                    "--identity",
                    identity,
                    "--lease-seconds",
                    &LEASE_SECONDS.to_string(),
                    "--health-addr",
                    &health,
                ]
                .iter()
                .map(|a| (*a).to_owned())
                .collect();
                let mut env = child_env(&cp, "info");
                // As the chart's Downward API does: Events name the replica that wrote them.
                env.push(("POD_NAME", std::ffi::OsStr::new(*identity)));
                let process = ChildProcess::spawn(
                    &format!("meshgate controller {identity}"),
                    &meshgate_bin(),
                    &args,
                    &env,
                    &cp.dir().join(format!("controller-{identity}.log")),
                );
                replicas.push(Replica {
                    identity: (*identity).to_owned(),
                    process,
                });
            }
        }
    }
    let nodes: Api<Node> = Api::all(client.clone());
    for name in ["held", "released"] {
        let node: Node = serde_json::from_value(json!({"metadata": {"name": name}})).expect("node");
        nodes
            .create(&PostParams::default(), &node)
            .await
            .expect("node created");
        meshgate_testenv::make_node_ready(&client, name)
            .await
            .expect("ready");
    }
    // No webhook here: the controller taints nodes that registered without the taint.
    for name in ["held", "released"] {
        let nodes = nodes.clone();
        wait_for(
            &format!("{name} tainted by the controller"),
            Duration::from_secs(60),
            || {
                let nodes = nodes.clone();
                async move { has_taint(&nodes, name).await == Some(true) }
            },
        )
        .await;
    }
    agent(&client, "cni-held", "cni", "held", true).await;
    agent(&client, "proxy-held", "proxy", "held", false).await;
    agent(&client, "cni-released", "cni", "released", true).await;
    agent(&client, "proxy-released", "proxy", "released", false).await;

    // Watch `held` through everything that follows (errors during the outage are skipped).
    let wrongly_untainted = Arc::new(AtomicBool::new(false));
    let flag = wrongly_untainted.clone();
    let watch_nodes = nodes.clone();
    let watcher = tokio::spawn(async move {
        loop {
            if has_taint(&watch_nodes, "held").await == Some(false) {
                flag.store(true, Ordering::SeqCst);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    Scene {
        cp,
        client,
        stop,
        lease_namespace,
        replicas,
        wrongly_untainted,
        watcher,
    }
}

/// The environment of the child processes: the control plane's admin kubeconfig and the log
/// filter.
fn child_env<'a>(cp: &'a ControlPlane, log: &'a str) -> Vec<(&'static str, &'a std::ffi::OsStr)> {
    vec![
        ("KUBECONFIG", cp.kubeconfig_path.as_os_str()),
        ("RUST_LOG", std::ffi::OsStr::new(log)),
    ]
}

impl Scene {
    /// Waits until one of the two replicas holds the lease: (its index, the other's).
    async fn leader_and_other(&self) -> (usize, usize) {
        let (client, ns) = (&self.client, &self.lease_namespace);
        let identities: Vec<String> = self.replicas.iter().map(|r| r.identity.clone()).collect();
        wait_for(
            "a replica to hold the lease",
            Duration::from_secs(60),
            || async { holder(&lease(client, ns).await).is_some_and(|h| identities.contains(&h)) },
        )
        .await;
        let leader = holder(&lease(client, ns).await).expect("a holder");
        let leader_idx = self
            .replicas
            .iter()
            .position(|r| r.identity == leader)
            .expect("the holder is a replica");
        (leader_idx, 1 - leader_idx)
    }

    /// Waits until replica `identity` holds the lease (after a crash: once the old one expired).
    async fn wait_holder(&self, identity: &str) {
        let (client, ns) = (&self.client, &self.lease_namespace);
        wait_for(
            &format!("{identity} to take the lease"),
            Duration::from_secs(LEASE_SECONDS * 5 + 30),
            || async { holder(&lease(client, ns).await).as_deref() == Some(identity) },
        )
        .await;
    }

    async fn converges(mut self) {
        // After the fault: the released node's last agent becomes Ready.
        self.client = self.cp.client().await.expect("client");
        set_ready(&self.client, "proxy-released", true).await;
        let nodes: Api<Node> = Api::all(self.client.clone());
        wait_for(
            "the controller to converge after the fault",
            Duration::from_secs(60),
            || {
                let nodes = nodes.clone();
                async move { has_taint(&nodes, "released").await == Some(false) }
            },
        )
        .await;
        // The controller has processed the agents' states since the fault (it released
        // `released`): `held` must still be held.
        assert_eq!(
            has_taint(&nodes, "held").await,
            Some(true),
            "held is still held"
        );
        assert!(
            !self.wrongly_untainted.load(Ordering::SeqCst),
            "a node with an unready agent was untainted at some point"
        );
        self.watcher.abort();
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

#[tokio::test]
async fn kube_apiserver_restart() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let mut scene = scene().await;
    scene
        .cp
        .restart_apiserver()
        .await
        .expect("apiserver restarted");
    scene.converges().await;
}

#[tokio::test]
async fn etcd_restart() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let mut scene = scene().await;
    scene.cp.restart_etcd().await.expect("etcd restarted");
    scene.converges().await;
}

// ------------------------------------------------------------------------------------------
// Leader crash.

/// The Lease of the replicas.
async fn lease(client: &kube::Client, namespace: &str) -> Option<Lease> {
    Api::<Lease>::namespaced(client.clone(), namespace)
        .get_opt("meshgate-controller")
        .await
        .ok()
        .flatten()
}

fn holder(lease: &Option<Lease>) -> Option<String> {
    lease.as_ref()?.spec.as_ref()?.holder_identity.clone()
}

#[tokio::test]
async fn leader_crash_failover() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let mut scene = scene_with(Controllers::Replicas(&["replica-a", "replica-b"])).await;
    let client = scene.client.clone();
    let ns = scene.lease_namespace.clone();

    // The nodes were tainted, so a leader is at work.
    let (leader_idx, other_idx) = scene.leader_and_other().await;
    let leader = scene.replicas[leader_idx].identity.clone();
    let other = scene.replicas[other_idx].identity.clone();
    for r in &mut scene.replicas {
        r.process.assert_running();
    }

    // A crash: SIGKILL, so the lease is not released.
    let killed_at = Instant::now();
    let killed_wall = SystemTime::now();
    scene.replicas[leader_idx].process.signal("KILL");
    let status = scene.replicas[leader_idx]
        .process
        .wait_exit(Duration::from_secs(30))
        .await
        .expect("the killed leader exited");
    assert!(!status.success(), "killed: {status}");
    let left = lease(&client, &ns).await;
    assert_eq!(
        holder(&left).as_deref(),
        Some(leader.as_str()),
        "right after the crash the lease still names the dead leader"
    );
    let spec = left.and_then(|l| l.spec).expect("lease spec");
    let renewed: SystemTime = spec.renew_time.expect("renewTime").0.into();
    let expiry = renewed
        + Duration::from_secs(
            u64::try_from(spec.lease_duration_seconds.expect("leaseDurationSeconds"))
                .expect("positive duration"),
        );

    scene.wait_holder(&other).await;
    let failover = killed_at.elapsed();
    let taken = lease(&client, &ns)
        .await
        .and_then(|l| l.spec)
        .expect("lease spec");
    let acquired: SystemTime = taken.acquire_time.expect("acquireTime").0.into();
    assert!(
        acquired > expiry,
        "the lease was taken at {acquired:?}, before the dead leader's lease expired at {expiry:?}"
    );
    let ms = |a: SystemTime, b: SystemTime| {
        a.duration_since(b).map_or_else(
            |e| -(e.duration().as_millis() as i128),
            |d| d.as_millis() as i128,
        )
    };
    eprintln!(
        "measured: leader crash failover in {} ms (lease {LEASE_SECONDS} s): the lease expired \
         {} ms after the kill, the other replica acquired it {} ms after expiry; transitions {}",
        failover.as_millis(),
        ms(expiry, killed_wall),
        ms(acquired, expiry),
        taken.lease_transitions.unwrap_or(0),
    );
    scene.replicas[other_idx].process.assert_running();

    // Only the new leader is alive: it does the work, and `held` stays held.
    scene.converges().await;
}

/// The re-taint budget (`maxRetainted`) is counted from the nodes as the cluster shows them, not
/// from a replica's memory: after every agent of a gate's three nodes fails, the leader re-taints
/// one and defers two; it is killed, the other replica takes over, reconciles every node (its
/// own `RetaintDeferred` Event for the two) and still re-taints none of them. A poller records
/// the most nodes tainted at any moment.
#[tokio::test]
async fn the_retaint_budget_holds_across_a_failover() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let mut scene = scene_with(Controllers::Replicas(&["replica-a", "replica-b"])).await;
    let client = scene.client.clone();
    const KEY_BUDGET: &str = "example.com/budget-not-ready";
    let key = KEY_BUDGET;
    let gate: NodeGate = serde_json::from_value(json!({
        "apiVersion": "meshgate.dev/v1alpha1", "kind": "NodeGate",
        "metadata": {"name": "budget"},
        "spec": {
            "agents": [{"name": "cni", "namespace": "default", "selector": {"matchLabels": {"app": "budget-cni"}}}],
            "nodeSelector": {"matchLabels": {"pool": "budget"}},
            "taint": {"key": key}, "mode": "Continuous", "gracePeriodSeconds": 0, "maxRetainted": "1",
        },
    }))
    .expect("gate");
    Api::<NodeGate>::all(client.clone())
        .create(&PostParams::default(), &gate)
        .await
        .expect("gate created");
    let nodes: Api<Node> = Api::all(client.clone());
    let names: Vec<String> = (0..3).map(|i| format!("budget-{i}")).collect();
    for n in &names {
        let node: Node =
            serde_json::from_value(json!({"metadata": {"name": n, "labels": {"pool": "budget"}}}))
                .expect("node");
        nodes
            .create(&PostParams::default(), &node)
            .await
            .expect("node created");
        meshgate_testenv::make_node_ready(&client, n)
            .await
            .expect("ready");
        agent(&client, &format!("cni-{n}"), "budget-cni", n, true).await;
    }
    let tainted = |nodes: Api<Node>| async move {
        let mut out = 0;
        for n in ["budget-0", "budget-1", "budget-2"] {
            let node = nodes.get(n).await.expect("node");
            out += usize::from(
                node.spec
                    .and_then(|s| s.taints)
                    .unwrap_or_default()
                    .iter()
                    .any(|t| t.key == KEY_BUDGET),
            );
        }
        out
    };
    let released = |nodes: Api<Node>| async move {
        let mut all = true;
        for n in ["budget-0", "budget-1", "budget-2"] {
            let node = nodes.get(n).await.expect("node");
            let marked = node
                .metadata
                .annotations
                .unwrap_or_default()
                .contains_key(&meshgate_core::nodegate::ready_since_key("budget"));
            all &= marked;
        }
        all
    };
    wait_for("the three nodes released", Duration::from_secs(60), || {
        let nodes = nodes.clone();
        async move { released(nodes.clone()).await && tainted(nodes).await == 0 }
    })
    .await;
    let (leader_idx, other_idx) = scene.leader_and_other().await;
    let other = scene.replicas[other_idx].identity.clone();

    // The most nodes with the gate's taint at any moment from here on.
    let most = Arc::new(AtomicUsize::new(0));
    let poller = {
        let (most, nodes) = (most.clone(), nodes.clone());
        tokio::spawn(async move {
            loop {
                let now = tainted(nodes.clone()).await;
                most.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    for n in &names {
        set_ready(&client, &format!("cni-{n}"), false).await;
    }
    let gates: Api<NodeGate> = Api::all(client.clone());
    wait_for(
        "the leader to re-taint one node and defer two",
        Duration::from_secs(60),
        || {
            let gates = gates.clone();
            async move {
                gates
                    .get("budget")
                    .await
                    .ok()
                    .and_then(|g| g.status)
                    .is_some_and(|s| s.held_nodes == 1 && s.retaint_deferred == 2)
            }
        },
    )
    .await;

    scene.replicas[leader_idx].process.signal("KILL");
    scene.replicas[leader_idx]
        .process
        .wait_exit(Duration::from_secs(30))
        .await
        .expect("the killed leader exited");
    scene.wait_holder(&other).await;
    // The new leader reconciled the deferred nodes: its own Events say so.
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::all(client.clone());
    wait_for(
        "the new leader's RetaintDeferred Events for both deferred nodes",
        Duration::from_secs(60),
        || {
            let (events, other) = (events.clone(), other.clone());
            async move {
                let deferred: BTreeSet<String> = events
                    .list(&Default::default())
                    .await
                    .map(|l| l.items)
                    .unwrap_or_default()
                    .into_iter()
                    .filter(|e| {
                        e.reason.as_deref() == Some("RetaintDeferred")
                            && e.reporting_instance.as_deref() == Some(other.as_str())
                    })
                    .filter_map(|e| e.regarding.and_then(|r| r.name))
                    .collect();
                deferred.len() == 2
            }
        },
    )
    .await;
    poller.abort();
    let now = tainted(nodes.clone()).await;
    let most = most.load(Ordering::SeqCst);
    eprintln!(
        "measured: re-tainted across the failover: {now} now, {most} at most (maxRetainted 1)"
    );
    assert_eq!(now, 1, "one node re-tainted after the failover");
    assert_eq!(
        most, 1,
        "never more than maxRetainted nodes re-tainted, across the failover"
    );
    scene.replicas[other_idx].process.assert_running();
}

/// The resourceVersions of the nodes and the gate: any write changes one.
async fn versions(client: &kube::Client) -> Option<Vec<String>> {
    let nodes: Api<Node> = Api::all(client.clone());
    let mut out = Vec::new();
    for name in ["held", "released"] {
        out.push(nodes.get(name).await.ok()?.metadata.resource_version?);
    }
    let gate = Api::<NodeGate>::all(client.clone())
        .get("faults")
        .await
        .ok()?;
    out.push(gate.metadata.resource_version?);
    Some(out)
}

#[tokio::test]
async fn paused_leader_steps_down() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let mut scene = scene_with(Controllers::Replicas(&["replica-a", "replica-b"])).await;
    let client = scene.client.clone();
    let ns = scene.lease_namespace.clone();
    let (paused_idx, other_idx) = scene.leader_and_other().await;
    let paused = scene.replicas[paused_idx].identity.clone();
    let other = scene.replicas[other_idx].identity.clone();

    // The leader is paused past its lease; the other replica takes it and does the work.
    scene.replicas[paused_idx].process.signal("STOP");
    wait_for(
        "the other replica to take the lease from the paused one",
        Duration::from_secs(LEASE_SECONDS * 5 + 30),
        || {
            let (client, ns, other) = (client.clone(), ns.clone(), other.clone());
            async move { holder(&lease(&client, &ns).await).as_deref() == Some(other.as_str()) }
        },
    )
    .await;
    set_ready(&client, "proxy-released", true).await;
    let nodes: Api<Node> = Api::all(client.clone());
    wait_for(
        "the new leader to untaint the released node",
        Duration::from_secs(60),
        || {
            let nodes = nodes.clone();
            async move { has_taint(&nodes, "released").await == Some(false) }
        },
    )
    .await;
    // The gate's field managers name the component that wrote its status. (A Node lists its
    // managers only after a first server-side apply: the API server tracks no update to an
    // object never applied, `before-first-apply`, and kubelets create nodes with a POST.)
    let gates = Api::<NodeGate>::all(client.clone());
    let managers = || async {
        gates
            .get("faults")
            .await
            .expect("gate")
            .metadata
            .managed_fields
            .unwrap_or_default()
            .into_iter()
            .map(|m| {
                (
                    m.manager.unwrap_or_default(),
                    m.operation.unwrap_or_default(),
                    m.subresource.unwrap_or_default(),
                )
            })
            .collect::<Vec<_>>()
    };
    wait_for(
        "the new leader's status write, under its field manager",
        Duration::from_secs(30),
        || async {
            managers()
                .await
                .iter()
                .any(|(m, op, sub)| m == "meshgate-controller" && op == "Update" && sub == "status")
        },
    )
    .await;
    eprintln!(
        "measured: the gate's field managers: {:?}",
        managers().await
    );

    // The new leader crashes while its lease is valid, and work waits that only a leader may
    // do: the held node's last agent becomes Ready.
    scene.replicas[other_idx].process.signal("KILL");
    scene.replicas[other_idx]
        .process
        .wait_exit(Duration::from_secs(30))
        .await
        .expect("the killed replica exited");
    set_ready(&client, "proxy-held", true).await;
    let before = versions(&client).await.expect("nodes and gate read");

    // The paused replica resumes. Until it holds the lease again, nothing may change: each
    // round reads the nodes and the gate, then the lease (which names the dead replica until
    // the resumed one takes it).
    scene.replicas[paused_idx].process.signal("CONT");
    let resumed = Instant::now();
    let mut writes = Vec::new();
    let mut rounds = 0;
    loop {
        let now = versions(&client).await;
        let holder_now = holder(&lease(&client, &ns).await);
        if holder_now.as_deref() == Some(paused.as_str()) {
            break;
        }
        rounds += 1;
        if let Some(now) = now
            && now != before
            && writes.last() != Some(&now)
        {
            writes.push(now);
        }
        assert!(
            resumed.elapsed() < Duration::from_secs(LEASE_SECONDS * 5 + 30),
            "the resumed replica did not take the lease again; its log:\n{}",
            scene.replicas[paused_idx].process.log_tail(20)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let retaken = resumed.elapsed();
    eprintln!(
        "measured: the paused leader, resumed while the dead replica's lease was valid, made {} \
         write(s) to the nodes and the gate before it held the lease again ({} ms after it \
         resumed, {rounds} reads); resourceVersions before {before:?}, seen {writes:?}",
        writes.len(),
        retaken.as_millis()
    );
    assert!(
        writes.is_empty(),
        "the resumed replica wrote before it held the lease again"
    );
    let log = std::fs::read_to_string(&scene.replicas[paused_idx].process.log)
        .expect("the resumed replica's log");
    assert!(
        log.contains("stepping down"),
        "the resumed replica did not report that it stepped down; its log:\n{}",
        scene.replicas[paused_idx].process.log_tail(20)
    );

    // Holding the lease again, it does the work that waited.
    wait_for(
        "the resumed leader to untaint the held node",
        Duration::from_secs(60),
        || {
            let nodes = nodes.clone();
            async move { has_taint(&nodes, "held").await == Some(false) }
        },
    )
    .await;
    scene.replicas[paused_idx].process.assert_running();
    scene.watcher.abort();
}

// ------------------------------------------------------------------------------------------
// The webhook process under load.

const AMBIENT: (&str, &str) = ("istio.io/dataplane-mode", "ambient");
const VALIDITY: Duration = Duration::from_secs(3600);

/// `meshgate webhook` as a child process, registered for the pods of ambient namespaces with
/// `failurePolicy: Fail`.
struct WebhookProcess {
    process: ChildProcess,
    ca: Ca,
    config: GateConfig,
    certs: SecretDir,
    addr: SocketAddr,
    health: SocketAddr,
}

/// The shutdown grace of `meshgate webhook` (`crates/meshgate/src/main.rs`).
const WEBHOOK_GRACE: Duration = Duration::from_secs(20);

impl WebhookProcess {
    /// Starts the webhook; it watches meshgate's CRDs, which must be installed.
    async fn start(cp: &ControlPlane) -> Self {
        let ca = Ca::new("meshgate-faults-ca", VALIDITY).expect("CA");
        let serving = ca
            .issue_server(&["127.0.0.1", "localhost"], VALIDITY)
            .expect("serving certificate");
        let certs = SecretDir::new(serving.cert_pem.as_bytes(), serving.key_pem.as_bytes())
            .expect("certificate directory");
        let config = GateConfig {
            profiles: vec![Profile::IstioAmbient],
            failure_policy: FailurePolicy::Fail,
            // The API server's timeout for one call: long, so that a slow machine is no failure.
            timeout_seconds: 30,
            ..GateConfig::default()
        };
        let config_path = cp.dir().join("webhook-config.yaml");
        std::fs::write(
            &config_path,
            serde_saphyr::to_string(&config).expect("config YAML"),
        )
        .expect("config file");
        let port = |what: &str| {
            let port = meshgate_testenv::free_port().unwrap_or_else(|e| panic!("{what}: {e}"));
            SocketAddr::from(([127, 0, 0, 1], port))
        };
        let (addr, health) = (port("review port"), port("health port"));
        let args: Vec<String> = vec![
            "webhook".into(),
            "--config".into(),
            config_path.display().to_string(),
            "--cert".into(),
            certs.cert().display().to_string(),
            "--key".into(),
            certs.key().display().to_string(),
            "--addr".into(),
            addr.to_string(),
            "--health-addr".into(),
            health.to_string(),
            "--cert-poll-seconds".into(),
            "1".into(),
        ];
        let mut process = ChildProcess::spawn(
            "meshgate webhook",
            &meshgate_bin(),
            &args,
            // Debug: one line per answered review, with the pod's name.
            &child_env(cp, "info,meshgate_webhook=debug"),
            &cp.dir().join("meshgate-webhook.log"),
        );
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            process.assert_running();
            let ready = http_get(health, "/readyz").await;
            if let Some((200, _)) = ready {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "meshgate webhook not ready within 60 s (/readyz: {ready:?}); log:\n{}",
                process.log_tail(40)
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Self {
            process,
            ca,
            config,
            certs,
            addr,
            health,
        }
    }

    /// Registers the webhook at `https://{host}:{port}` and waits until pods created in `ns`
    /// get the gate.
    async fn register(&self, client: &kube::Client, host: &str, ns: &str) {
        let mwc = webhook_configuration(&Registration {
            name: "meshgate-faults",
            config: &self.config,
            target: WebhookTarget::Url(format!("https://{host}:{}", self.addr.port())),
            ca_bundle_pem: &self.ca.certificate().cert_pem,
            policies: false,
            node_taint: false,
            native_gate: None,
        });
        assert_eq!(mwc["webhooks"][0]["failurePolicy"], "Fail", "{mwc}");
        register(client, &mwc).await;
        let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
        probe_until(
            &pods,
            "the webhook to be active",
            Duration::from_secs(60),
            has_gate,
        )
        .await;
    }

    async fn metrics(&self) -> String {
        match http_get(self.health, "/metrics").await {
            Some((200, text)) => text,
            other => panic!("webhook /metrics: {other:?}"),
        }
    }
}

fn has_gate(p: &Pod) -> bool {
    p.spec
        .as_ref()
        .and_then(|s| s.init_containers.as_ref())
        .is_some_and(|cs| {
            cs.first()
                .is_some_and(|c| c.name == meshgate_api::names::GATE_CONTAINER)
        })
}

/// DER of the first certificate in `pem`.
fn der(pem: &str) -> Vec<u8> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    CertificateDer::from_pem_slice(pem.as_bytes())
        .expect("PEM certificate")
        .as_ref()
        .to_vec()
}

/// The certificate the server at `addr` presents in a fresh TLS handshake of a client that
/// trusts only `ca_pem` (the handshake verifies it for the IP address).
fn served_certificate(addr: SocketAddr, ca_pem: &str) -> Result<Vec<u8>, String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, ServerName};
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots
            .add(cert.map_err(|e| e.to_string())?)
            .map_err(|e| e.to_string())?;
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| e.to_string())?
    .with_root_certificates(roots)
    .with_no_client_auth();
    let mut tls = rustls::ClientConnection::new(Arc::new(config), ServerName::from(addr.ip()))
        .map_err(|e| e.to_string())?;
    let mut sock = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(10))
        .map_err(|e| format!("connect: {e}"))?;
    let io_limit = Some(Duration::from_secs(10));
    sock.set_read_timeout(io_limit).map_err(|e| e.to_string())?;
    sock.set_write_timeout(io_limit)
        .map_err(|e| e.to_string())?;
    for _ in 0..100 {
        if !tls.is_handshaking() {
            break;
        }
        tls.complete_io(&mut sock)
            .map_err(|e| format!("handshake: {e}"))?;
    }
    tls.peer_certificates()
        .and_then(|c| c.first())
        .map(|c| c.as_ref().to_vec())
        .ok_or_else(|| "no peer certificate".to_owned())
}

async fn served(addr: SocketAddr, ca_pem: &str) -> Result<Vec<u8>, String> {
    let ca_pem = ca_pem.to_owned();
    tokio::task::spawn_blocking(move || served_certificate(addr, &ca_pem))
        .await
        .map_err(|e| e.to_string())?
}

/// Client ports of the established TCP connections to 127.0.0.1:`port` (Linux `/proc`).
fn connections_to(port: u16) -> BTreeSet<u16> {
    let text = std::fs::read_to_string("/proc/net/tcp").expect("/proc/net/tcp");
    let local = format!("0100007F:{port:04X}");
    text.lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            // sl, local_address, rem_address, st (01: ESTABLISHED)
            (f.len() > 3 && f[1] == local && f[3] == "01")
                .then(|| f[2].split_once(':'))
                .flatten()
                .and_then(|(_, p)| u16::from_str_radix(p, 16).ok())
        })
        .collect()
}

/// What one pod create gave.
struct Outcome {
    name: String,
    started: Instant,
    ended: Instant,
    /// Ok(the stored pod carries the gate), or the error.
    result: Result<bool, String>,
}

/// Concurrent tasks creating pods through the API server until stopped (bounded in count and
/// time).
struct Load {
    stop: Arc<AtomicBool>,
    created: Arc<AtomicUsize>,
    tasks: Vec<tokio::task::JoinHandle<Vec<Outcome>>>,
}

const CREATES_PER_TASK: usize = 2000;
const LOAD_LIMIT: Duration = Duration::from_secs(300);

impl Load {
    /// Starts `tasks` tasks creating pods named `{prefix}-{task}-{n}` in `ns`.
    fn start(client: &kube::Client, ns: &str, prefix: &str, tasks: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let created = Arc::new(AtomicUsize::new(0));
        let deadline = Instant::now() + LOAD_LIMIT;
        let tasks = (0..tasks)
            .map(|t| {
                let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
                let (stop, created) = (stop.clone(), created.clone());
                let prefix = prefix.to_owned();
                tokio::spawn(async move {
                    let mut outcomes = Vec::new();
                    for i in 0..CREATES_PER_TASK {
                        if stop.load(Ordering::SeqCst) || Instant::now() > deadline {
                            break;
                        }
                        let name = format!("{prefix}-{t}-{i}");
                        let p: Pod = serde_json::from_value(pod(&name)).expect("pod");
                        let started = Instant::now();
                        let result = match tokio::time::timeout(
                            Duration::from_secs(90),
                            pods.create(&PostParams::default(), &p),
                        )
                        .await
                        {
                            Ok(Ok(stored)) => Ok(has_gate(&stored)),
                            Ok(Err(kube::Error::Api(s))) => {
                                Err(format!("{} {}: {}", s.code, s.reason, s.message))
                            }
                            Ok(Err(e)) => Err(format!("client: {e}")),
                            Err(_) => Err("client: no answer within 90 s".to_owned()),
                        };
                        let failed = result.is_err();
                        if !failed {
                            created.fetch_add(1, Ordering::SeqCst);
                        }
                        outcomes.push(Outcome {
                            name,
                            started,
                            ended: Instant::now(),
                            result,
                        });
                        if failed {
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                    }
                    outcomes
                })
            })
            .collect();
        Self {
            stop,
            created,
            tasks,
        }
    }

    fn created(&self) -> usize {
        self.created.load(Ordering::SeqCst)
    }

    /// Waits until `n` pods were created in all.
    async fn wait_created(&self, n: usize, what: &str) {
        wait_for(what, Duration::from_secs(120), || async {
            self.created() >= n
        })
        .await;
    }

    async fn finish(self) -> Vec<Outcome> {
        self.stop.store(true, Ordering::SeqCst);
        let mut all = Vec::new();
        for task in self.tasks {
            all.extend(task.await.expect("load task"));
        }
        all
    }
}

/// The cause of a failed create, from the API server's message. The webhook's URL carries
/// `?timeout=30s`, so only what follows it counts.
///
/// `refused` and `reset at connect` are failures to connect (`dial tcp …: connect: …`): no review
/// was sent. The second is a connection the kernel had queued on the listening socket when the
/// webhook closed it.
fn cause(message: &str) -> &'static str {
    let tail = message.rsplit_once("\": ").map_or(message, |(_, t)| t);
    let dial = tail.starts_with("dial tcp ");
    if dial && tail.contains("connect: connection refused") {
        "refused"
    } else if dial && tail.contains("connect: connection reset by peer") {
        "reset at connect"
    } else if tail.contains("connection reset") {
        "reset"
    } else if tail.contains("EOF") {
        "eof"
    } else if tail.contains("deadline exceeded") || tail.to_lowercase().contains("timeout") {
        "timeout"
    } else {
        "other"
    }
}

/// Causes of failed creates that mean the webhook no longer accepted connections.
const NOT_ACCEPTING: [&str; 2] = ["refused", "reset at connect"];

/// Failed creates by cause, with up to three messages of each.
fn failures(outcomes: &[Outcome]) -> BTreeMap<&'static str, (usize, Vec<String>)> {
    let mut by_cause: BTreeMap<&'static str, (usize, Vec<String>)> = BTreeMap::new();
    for o in outcomes {
        if let Err(m) = &o.result {
            let entry = by_cause.entry(cause(m)).or_default();
            entry.0 += 1;
            if entry.1.len() < 3 {
                entry.1.push(m.clone());
            }
        }
    }
    by_cause
}

/// Names of the objects whose review the webhook answered, from its debug log (`answered` lines
/// carry the review's fields, among them `name=`).
fn answered_reviews(log: &str) -> BTreeSet<String> {
    let mut plain = String::with_capacity(log.len());
    let mut escape = false;
    for c in log.chars() {
        match (escape, c) {
            (false, '\u{1b}') => escape = true,
            (true, 'm') => escape = false,
            (true, _) => {}
            (false, c) => plain.push(c),
        }
    }
    plain
        .lines()
        .filter(|l| l.contains(" answered"))
        .filter_map(|l| {
            l.split([' ', '{', '}', ','])
                .find_map(|field| field.strip_prefix("name="))
                .map(|n| n.trim_matches('"').to_owned())
        })
        .collect()
}

/// A private control plane, an ambient namespace named after `prefix`, and the webhook child
/// registered for it.
async fn webhook_scene(prefix: &str) -> (ControlPlane, kube::Client, String, WebhookProcess) {
    let cp = ControlPlane::start(Options::default())
        .await
        .expect("control plane");
    let client = cp.client().await.expect("client");
    install_crds(&client).await;
    let ns = cp.namespace(prefix, &[AMBIENT]).await.expect("namespace");
    let webhook = WebhookProcess::start(&cp).await;
    webhook.register(&client, "127.0.0.1", &ns).await;
    (cp, client, ns, webhook)
}

#[tokio::test]
async fn webhook_sigterm_under_load() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let (_cp, client, ns, mut webhook) = webhook_scene("load").await;

    // Many reviews in flight at the signal.
    const TASKS: usize = 48;
    let load = Load::start(&client, &ns, "term", TASKS);
    load.wait_created(100, "100 pods created before SIGTERM")
        .await;
    let term_at = Instant::now();
    webhook.process.signal("TERM");
    let status = webhook
        .process
        .wait_exit(WEBHOOK_GRACE + Duration::from_secs(30))
        .await;
    let exited_at = Instant::now();
    let status = status.unwrap_or_else(|| {
        panic!(
            "the webhook did not exit within its grace period (+30 s); log:\n{}",
            webhook.process.log_tail(40)
        )
    });
    // Creates go on against the stopped webhook for a moment.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let outcomes = load.finish().await;

    let ok = |o: &&Outcome| o.result.is_ok();
    let before = outcomes
        .iter()
        .filter(ok)
        .filter(|o| o.ended < term_at)
        .count();
    let during = outcomes
        .iter()
        .filter(ok)
        .filter(|o| o.ended >= term_at)
        .count();
    let in_flight_at_term = outcomes
        .iter()
        .filter(|o| o.started < term_at && o.ended >= term_at)
        .count();
    let ok_in_flight_at_term = outcomes
        .iter()
        .filter(ok)
        .filter(|o| o.started < term_at && o.ended >= term_at)
        .count();
    let started_after_exit_ok = outcomes
        .iter()
        .filter(ok)
        .filter(|o| o.started > exited_at)
        .count();
    let ungated = outcomes.iter().filter(|o| o.result == Ok(false)).count();
    let failed = failures(&outcomes);
    eprintln!(
        "measured: webhook SIGTERM under load ({TASKS} tasks): {} creates, {} ok ({before} \
         before SIGTERM, {during} after it: {ok_in_flight_at_term} of the {in_flight_at_term} in \
         flight at the signal), failed by cause {:?}; exited ({status}) {} ms after SIGTERM",
        outcomes.len(),
        before + during,
        failed
            .iter()
            .map(|(c, (n, _))| (*c, *n))
            .collect::<BTreeMap<_, _>>(),
        (exited_at - term_at).as_millis(),
    );

    assert!(
        status.success(),
        "the webhook exited with {status}; log:\n{}",
        webhook.process.log_tail(40)
    );
    assert_eq!(ungated, 0, "created pods without the gate");
    // A failed create whose review the webhook answered is a review dropped in flight.
    let answered =
        answered_reviews(&std::fs::read_to_string(&webhook.process.log).expect("webhook log"));
    eprintln!(
        "measured: the webhook answered {} reviews (its debug log)",
        answered.len()
    );
    let ms = |t: Instant| {
        if t >= term_at {
            (t - term_at).as_millis() as i128
        } else {
            -((term_at - t).as_millis() as i128)
        }
    };
    let unexpected: Vec<String> = outcomes
        .iter()
        .filter_map(|o| {
            let message = o.result.as_ref().err()?;
            let dropped = answered.contains(&o.name);
            (!NOT_ACCEPTING.contains(&cause(message)) || dropped).then(|| {
                format!(
                    "{}: started {} ms, ended {} ms after SIGTERM; the webhook answered its \
                     review: {dropped}; {message}",
                    o.name,
                    ms(o.started),
                    ms(o.ended),
                )
            })
        })
        .collect();
    assert!(
        unexpected.is_empty(),
        "creates failed other than by a failure to connect, or after the webhook answered \
         their review ({} answered in all):\n{}\nwebhook log:\n{}",
        answered.len(),
        unexpected.join("\n"),
        webhook.process.log_tail(8)
    );
    assert!(before > 0, "no create succeeded before SIGTERM");
    assert!(
        ok_in_flight_at_term > 0,
        "no create in flight at SIGTERM succeeded afterwards"
    );
    assert!(
        failed.get("refused").is_some_and(|(n, _)| *n > 0),
        "no create failed after the webhook stopped: failurePolicy Fail was not in effect"
    );
    assert_eq!(
        started_after_exit_ok, 0,
        "creates started after the webhook exited succeeded: failurePolicy Fail was not in effect"
    );
    assert!(
        std::fs::read_to_string(&webhook.process.log)
            .expect("webhook log")
            .contains("SIGTERM: draining"),
        "the webhook did not log its SIGTERM"
    );
}

#[tokio::test]
async fn certificate_rotation_under_load() {
    const RELOADS: &str = "meshgate_webhook_cert_reloads_total ";
    const RELOAD_ERRORS: &str = "meshgate_webhook_cert_reload_errors_total ";
    let _turn = ONE_AT_A_TIME.lock().await;
    let (_cp, client, ns, mut webhook) = webhook_scene("rotate").await;
    let ca_pem = webhook.ca.certificate().cert_pem.clone();
    let old = served(webhook.addr, &ca_pem).await.expect("served before");
    assert_eq!(
        old,
        der(&std::fs::read_to_string(webhook.certs.cert()).expect("cert file")),
        "the webhook serves the first certificate"
    );
    let m = webhook.metrics().await;
    assert_eq!(metric(&m, RELOADS), Some(0.0), "{m}");

    const TASKS: usize = 16;
    let load = Load::start(&client, &ns, "rotate", TASKS);
    load.wait_created(100, "100 pods created before the rotation")
        .await;
    let connections_before = connections_to(webhook.addr.port());
    // A new certificate from the same CA: the caBundle stays.
    let new_pair = webhook
        .ca
        .issue_server(&["127.0.0.1", "localhost"], VALIDITY)
        .expect("new serving certificate");
    let new = der(&new_pair.cert_pem);
    assert_ne!(new, old);
    let swapped_at = Instant::now();
    webhook
        .certs
        .swap(new_pair.cert_pem.as_bytes(), new_pair.key_pem.as_bytes())
        .expect("swap the certificate");
    let mut last = None;
    for _ in 0..300 {
        webhook.process.assert_running();
        match served(webhook.addr, &ca_pem).await {
            Ok(c) if c == new => {
                last = None;
                break;
            }
            r => last = Some(r.map(|c| c == old)),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        last.is_none(),
        "the webhook does not serve the new certificate (last probe, Ok(true) = old one): {last:?}"
    );
    let reloaded_in = swapped_at.elapsed();
    let at_reload = load.created();
    load.wait_created(at_reload + 100, "100 more pods after the rotation")
        .await;

    // The API server keeps its connections to the webhook open across the rotation (new
    // handshakes get the new certificate): registered at another host name, it needs a new one.
    webhook.register(&client, "localhost", &ns).await;
    let at_switch = load.created();
    load.wait_created(at_switch + 100, "100 more pods at the new address")
        .await;
    let connections_after = connections_to(webhook.addr.port());
    let outcomes = load.finish().await;
    let m = webhook.metrics().await;
    webhook.process.assert_running();

    let ok = outcomes.iter().filter(|o| o.result.is_ok()).count();
    let failed = failures(&outcomes);
    let new_connections: Vec<_> = connections_after.difference(&connections_before).collect();
    eprintln!(
        "measured: certificate rotation under load ({TASKS} tasks): {} creates, {ok} ok \
         ({at_reload} before the new certificate was served {} ms after the swap), failed {:?}; \
         API server connections to the webhook: {} before, {} after, {} new",
        outcomes.len(),
        reloaded_in.as_millis(),
        failed
            .iter()
            .map(|(c, (n, _))| (*c, *n))
            .collect::<BTreeMap<_, _>>(),
        connections_before.len(),
        connections_after.len(),
        new_connections.len(),
    );
    assert!(
        failed.is_empty(),
        "creates failed during the rotation: {failed:#?}\nwebhook log:\n{}",
        webhook.process.log_tail(40)
    );
    assert!(
        outcomes.iter().all(|o| o.result == Ok(true)),
        "created pods without the gate"
    );
    assert_eq!(metric(&m, RELOADS), Some(1.0), "one reload: {m}");
    assert_eq!(metric(&m, RELOAD_ERRORS), Some(0.0), "no reload error: {m}");
    assert!(
        !new_connections.is_empty(),
        "the API server opened no connection to the webhook after the rotation"
    );
    assert_eq!(
        served(webhook.addr, &ca_pem).await.expect("served after"),
        new,
        "the webhook still serves the new certificate"
    );
}
