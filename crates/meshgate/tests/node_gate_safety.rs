//! The node gate cannot harm a cluster: on the real API server and scheduler, with the
//! controller running as the ServiceAccount `meshgate install` creates (its RBAC, not
//! cluster-admin).
//!
//! * restarts and leader changes write no taint to released, healthy nodes (every Node update
//!   is watched through the restart; the negative assertion comes after the new leader reports
//!   it synced and reconciled every node);
//! * deleting a gate lifts its taints and resource from every node, and nothing meshgate does
//!   not own;
//! * the API server refuses gates keyed with reserved taints, and NoExecute without opt-in;
//! * a gate keyed `readiness.k8s.io/<name>` (Karpenter's known startup taints, the
//!   node-readiness-controller's prefix) taints and lifts its key, and leaves the key alone on a
//!   node where another controller set it;
//! * a gate whose agent DaemonSet does not exist goes Degraded and releases the node after
//!   `missingAgentTimeoutSeconds`;
//! * a mass agent failure re-taints at most `maxRetainted` nodes and reports the rest;
//! * `dryRun` writes nothing to nodes and reports what it would do;
//! * the generated MutatingAdmissionPolicy taints a Node at CREATE with no webhook registered;
//! * `meshgate status` and the controller agree on every node;
//! * a taint another controller writes between meshgate's read of a node and its write
//!   survives: every write of the gate's taint is conditional on what it read.
//!
//! Run: `cargo test -p meshgate --test node_gate_safety`.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::{Duration, Instant};

use common::*;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use meshgate_api::node_gate::NodeGateSpec;
use meshgate_api::{NodeGate, names};
use meshgate_controller::leader::LeaseSettings;
use serde_json::{Value, json};
use tokio::sync::OnceCell;

const SYSTEM_NS: &str = "meshgate-system";
const LEASE_SECONDS: u64 = 3;

async fn start_replica(kubeconfig: std::path::PathBuf, lease: &str, identity: &str) -> Replica {
    let lease = LeaseSettings {
        namespace: SYSTEM_NS.into(),
        name: lease.into(),
        identity: identity.into(),
        duration: LEASE_SECONDS,
        grace: 1,
    };
    // As meshgate's controller ServiceAccount: its installed RBAC, not cluster-admin.
    Replica::start(
        kubeconfig,
        lease,
        Duration::from_millis(300),
        Some(SYSTEM_NS),
    )
    .await
}

struct Env {
    cp: Arc<meshgate_testenv::ControlPlane>,
    /// The leading replica every test relies on (the restart test replaces it, on the same
    /// lease, as a restart and a leader change do).
    leader: tokio::sync::Mutex<Replica>,
}

const LEASE: &str = "meshgate-controller";

/// The shared environment and an admin client of this test's own (a client lives on the
/// runtime that made it, and each test has its own).
async fn setup() -> (&'static Env, kube::Client) {
    let env = shared_env().await;
    (env, env.cp.client().await.expect("client"))
}

async fn shared_env() -> &'static Env {
    static ENV: OnceCell<Env> = OnceCell::const_new();
    ENV.get_or_init(|| async {
        let cp = control_plane(true).await;
        let client = cp.client().await.expect("client");
        install_crds(&client).await;
        install_identities(&client, "istio-ambient", SYSTEM_NS).await;
        let shared = start_replica(cp.kubeconfig_path.clone(), LEASE, "first").await;
        wait_for(
            "the shared controller to sync and lead",
            Duration::from_secs(30),
            || {
                let m = shared.metrics.clone();
                async move { m.synced.get() == 1 && m.leader.get() == 1 }
            },
        )
        .await;
        Env {
            cp,
            leader: tokio::sync::Mutex::new(shared),
        }
    })
    .await
}

fn gate(pool: &str, agents_ns: &str, agents: &[&str], extra: Value) -> NodeGateSpec {
    let agents: Vec<Value> = agents
        .iter()
        .map(
            |a| json!({"name": a, "namespace": agents_ns, "selector": {"matchLabels": {"app": a}}}),
        )
        .collect();
    let mut spec = json!({"agents": agents, "nodeSelector": {"matchLabels": {"pool": pool}}});
    if let (Some(s), Some(e)) = (spec.as_object_mut(), extra.as_object()) {
        s.extend(e.clone());
    }
    serde_json::from_value(spec).expect("gate spec")
}

async fn create_gate(client: &kube::Client, name: &str, spec: NodeGateSpec) {
    Api::<NodeGate>::all(client.clone())
        .create(&PostParams::default(), &NodeGate::new(name, spec))
        .await
        .expect("gate created");
}

async fn create_node(client: &kube::Client, name: &str, pool: &str, taints: Value) -> Node {
    let node: Node = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {"pool": pool}},
        "spec": {"taints": taints},
    }))
    .expect("node");
    let created = Api::<Node>::all(client.clone())
        .create(&PostParams::default(), &node)
        .await
        .expect("node created");
    meshgate_testenv::make_node_ready(client, name)
        .await
        .expect("node ready");
    created
}

async fn agent(client: &kube::Client, ns: &str, name: &str, app: &str, node: &str, ready: bool) {
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": app}},
        "spec": {"nodeName": node, "containers": [{"name": "agent", "image": "registry.invalid/agent:1"}],
                 "tolerations": [{"operator": "Exists"}]},
    }))
    .expect("agent pod");
    Api::<Pod>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &pod)
        .await
        .expect("agent pod created");
    set_ready(client, ns, name, ready).await;
}

async fn set_ready(client: &kube::Client, ns: &str, name: &str, ready: bool) {
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let status = json!({"status": {"phase": "Running", "conditions": [
        {"type": "Ready", "status": if ready { "True" } else { "False" }, "lastTransitionTime": now},
    ]}});
    Api::<Pod>::namespaced(client.clone(), ns)
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .expect("agent status");
}

async fn get_node(client: &kube::Client, name: &str) -> Node {
    Api::<Node>::all(client.clone())
        .get(name)
        .await
        .expect("node")
}

async fn has_taint(client: &kube::Client, node: &str, key: &str) -> bool {
    taint_keys(&get_node(client, node).await)
        .iter()
        .any(|k| k == key)
}

async fn gate_status(client: &kube::Client, name: &str) -> Option<meshgate_api::NodeGateStatus> {
    Api::<NodeGate>::all(client.clone())
        .get_opt(name)
        .await
        .ok()
        .flatten()
        .and_then(|g| g.status)
}

fn condition<'s>(
    status: &'s meshgate_api::NodeGateStatus,
    type_: &str,
) -> Option<&'s k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition> {
    status.conditions.iter().find(|c| c.type_ == type_)
}

/// Every Node update seen for the watched nodes after the watch started: (node, taint keys,
/// whether the taints changed from the previous update).
#[derive(Clone, Default)]
struct NodeLog(Arc<StdMutex<Vec<NodeUpdate>>>);

/// One Node update: the node, its taint keys, whether they changed.
type NodeUpdate = (String, Vec<String>, bool);

impl NodeLog {
    /// Starts watching; returns once the watch has its initial list.
    async fn start(client: &kube::Client, nodes: &[String]) -> (Self, tokio::task::JoinHandle<()>) {
        let log = NodeLog::default();
        let watched: BTreeSet<String> = nodes.iter().cloned().collect();
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        let api = Api::<Node>::all(client.clone());
        let l = log.clone();
        let task = tokio::spawn(async move {
            let mut last: BTreeMap<String, Vec<String>> = BTreeMap::new();
            let mut ready = Some(ready_tx);
            let mut stream = watcher(api, watcher::Config::default()).boxed();
            while let Some(Ok(event)) = stream.next().await {
                match event {
                    watcher::Event::InitApply(n) => {
                        let name = n.metadata.name.clone().unwrap_or_default();
                        last.insert(name, taint_keys(&n));
                    }
                    watcher::Event::InitDone => {
                        if let Some(tx) = ready.take() {
                            let _ = tx.send(());
                        }
                    }
                    watcher::Event::Apply(n) => {
                        let name = n.metadata.name.clone().unwrap_or_default();
                        if !watched.contains(&name) {
                            continue;
                        }
                        let keys = taint_keys(&n);
                        let changed = last.get(&name) != Some(&keys);
                        last.insert(name.clone(), keys.clone());
                        l.0.lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner)
                            .push((name, keys, changed));
                    }
                    _ => {}
                }
            }
        });
        let _ = ready_rx.await;
        (log, task)
    }

    fn entries(&self) -> Vec<NodeUpdate> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

/// `meshgate status` and the controller agree on every node of the gate: tainted or not, and
/// ready or not (the controller's node condition `meshgate.dev/<gate>Ready`), and the gate's
/// counts. Waited for: the controller writes node conditions and the gate's status off the
/// reconcile's path, so each may trail the taint it describes by a write; a disagreement that
/// outlasts 30 s fails the test with what disagreed.
async fn assert_status_agrees(client: &kube::Client, gate_name: &str) {
    let began = Instant::now();
    loop {
        let Err(why) = status_agrees(client, gate_name).await else {
            return;
        };
        assert!(
            began.elapsed() < Duration::from_secs(30),
            "meshgate status and the controller disagree after 30 s: {why}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Whether `meshgate status` and the controller agree now; else what disagrees.
async fn status_agrees(client: &kube::Client, gate_name: &str) -> Result<(), String> {
    let gates = Api::<NodeGate>::all(client.clone())
        .list(&Default::default())
        .await
        .map_err(|e| format!("gates: {e}"))?;
    let gate: Vec<NodeGate> = gates
        .items
        .into_iter()
        .filter(|g| g.metadata.name.as_deref() == Some(gate_name))
        .collect();
    let Some(first) = gate.first() else {
        return Err(format!("no gate {gate_name}"));
    };
    let nodes = Api::<meshgate_api::GateNode>::all(client.clone())
        .list(&Default::default())
        .await
        .map_err(|e| format!("nodes: {e}"))?
        .items;
    let rows = meshgate::status::node_rows(client, &gate, &nodes, meshgate_controller::now())
        .await
        .map_err(|e| format!("status rows: {e}"))?;
    if rows.is_empty() {
        return Err("the gate selects no node".into());
    }
    let ctype = format!("meshgate.dev/{gate_name}Ready");
    for row in &rows {
        let node = nodes
            .iter()
            .find(|n| n.metadata.name.as_deref() == Some(row.node.as_str()))
            .ok_or_else(|| format!("{}: no such node", row.node))?;
        let cond = node
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .and_then(|cs| cs.iter().find(|c| c.type_ == ctype))
            .ok_or_else(|| format!("{}: no condition {ctype}", row.node))?;
        let status_ready = matches!(row.state.as_str(), "ready" | "released" | "releasing");
        if status_ready != (cond.status == "True") {
            return Err(format!(
                "{}: meshgate status says {}, the controller's condition says {} ({})",
                row.node,
                row.state,
                cond.status,
                cond.message.as_deref().unwrap_or_default()
            ));
        }
        let tainted = node.taints().iter().any(|t| t.key == first.spec.taint.key);
        if row.tainted != tainted {
            return Err(format!(
                "{}: meshgate status says tainted {}, the node {}",
                row.node, row.tainted, tainted
            ));
        }
    }
    let s = first.status.clone().unwrap_or_default();
    let counts = (
        s.nodes as usize,
        s.held_nodes as usize,
        s.ready_nodes as usize,
    );
    let from_rows = (
        rows.len(),
        rows.iter().filter(|r| r.tainted).count(),
        rows.iter()
            .filter(|r| matches!(r.state.as_str(), "ready" | "released" | "releasing"))
            .count(),
    );
    if counts != from_rows {
        return Err(format!(
            "the gate's status counts (nodes, held, ready) {counts:?}, meshgate status {from_rows:?}"
        ));
    }
    Ok(())
}

/// Waits until the gate's status matches the nodes (the status loop has seen the last change).
async fn wait_status(
    client: &kube::Client,
    gate: &str,
    what: &str,
    f: impl Fn(&meshgate_api::NodeGateStatus) -> bool,
) {
    let f = &f;
    let last = StdMutex::new(None);
    let last = &last;
    let done = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let s = gate_status(client, gate).await;
            if s.as_ref().is_some_and(f) {
                return;
            }
            *last
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = s;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(
        done.is_ok(),
        "timed out after 30s waiting for {what}; last status: {:#?}",
        last.lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    );
}

#[tokio::test]
async fn restarts_and_leader_changes_write_no_taint_to_released_nodes() {
    let (env, client) = setup().await;
    let client = &client;
    let agents_ns = env.cp.namespace("restart-agents", &[]).await.expect("ns");
    let pool = format!("restart-{agents_ns}");
    let key = "restart.meshgate.dev/not-ready";
    // Continuous, no grace: any agent counted unready is a re-taint at once.
    let spec = gate(
        &pool,
        &agents_ns,
        &["cni", "node-proxy"],
        json!({
            "taint": {"key": key}, "mode": "Continuous", "gracePeriodSeconds": 0,
        }),
    );
    create_gate(client, &pool, spec).await;
    let nodes: Vec<String> = (0..3).map(|i| format!("{pool}-{i}")).collect();
    for n in &nodes {
        create_node(client, n, &pool, json!([])).await;
        agent(client, &agents_ns, &format!("cni-{n}"), "cni", n, true).await;
        agent(
            client,
            &agents_ns,
            &format!("proxy-{n}"),
            "node-proxy",
            n,
            true,
        )
        .await;
    }
    wait_status(client, &pool, "every node released", |s| {
        s.nodes == 3 && s.ready_nodes == 3 && s.held_nodes == 0
    })
    .await;
    for n in &nodes {
        assert!(!has_taint(client, n, key).await, "{n} released");
    }

    // From here on, watch every update of these nodes.
    let (log, watch) = NodeLog::start(client, &nodes).await;
    let kubeconfig = env.cp.kubeconfig_path.clone();
    let mut leader = env.leader.lock().await;
    // Leader change: a starts as a follower (synced, writing nothing), the leader stops, a
    // takes the lease once it expires, then reconciles every node.
    let a = start_replica(kubeconfig.clone(), LEASE, "a").await;
    wait_for(
        "replica a to sync as a follower",
        Duration::from_secs(30),
        || {
            let m = a.metrics.clone();
            async move { m.synced.get() == 1 }
        },
    )
    .await;
    let mut old = std::mem::replace(&mut *leader, a);
    old.stop();
    let started = Instant::now();
    wait_for(
        "replica a to take over and reconcile every node",
        Duration::from_secs(30),
        || {
            let m = leader.metrics.clone();
            async move { m.leader.get() == 1 && m.initial_reconcile_done.get() == 1 }
        },
    )
    .await;
    eprintln!(
        "measured: leader change to every node reconciled in {} ms",
        started.elapsed().as_millis()
    );
    // Restart: a new process (b) replaces a; its caches start empty.
    let b = start_replica(kubeconfig, LEASE, "b").await;
    let mut old = std::mem::replace(&mut *leader, b);
    old.stop();
    wait_for(
        "replica b to lead, sync and reconcile every node",
        Duration::from_secs(30),
        || {
            let m = leader.metrics.clone();
            async move {
                m.leader.get() == 1 && m.synced.get() == 1 && m.initial_reconcile_done.get() == 1
            }
        },
    )
    .await;
    drop(leader);
    watch.abort();
    let entries = log.entries();
    let taint_writes: Vec<_> = entries.iter().filter(|(_, _, changed)| *changed).collect();
    assert!(
        taint_writes.is_empty(),
        "taint writes to healthy released nodes: {taint_writes:?}"
    );
    for n in &nodes {
        assert!(!has_taint(client, n, key).await, "{n} still released");
    }
    eprintln!(
        "measured: {} node updates during the restart and leader change, 0 taint writes",
        entries.len()
    );
    assert_status_agrees(client, &pool).await;
}

#[tokio::test]
async fn deleting_a_gate_lifts_its_taints_and_resource_and_nothing_else() {
    let (env, client) = setup().await;
    let client = &client;
    let agents_ns = env.cp.namespace("delete-agents", &[]).await.expect("ns");
    let pool = format!("delete-{agents_ns}");
    // A key outside meshgate's domain: ownership is recorded on the nodes it taints.
    let key = format!("example.com/mesh-{}", std::process::id());
    let resource = "example.com/mesh-ready";
    let spec = gate(
        &pool,
        &agents_ns,
        &["cni"],
        json!({
            "taint": {"key": key}, "resource": {"name": resource, "count": 10},
        }),
    );
    create_gate(client, &pool, spec).await;
    let same_prefix = json!({"key": "example.com/mesh", "value": "x", "effect": "NoSchedule"});
    // released: agents Ready, resource advertised.
    let released = format!("{pool}-released");
    create_node(client, &released, &pool, json!([same_prefix])).await;
    agent(client, &agents_ns, "cni-released", "cni", &released, true).await;
    // held: no agent, tainted by meshgate.
    let held = format!("{pool}-held");
    create_node(client, &held, &pool, json!([same_prefix])).await;
    // foreign: carries the gate's key, put there by someone else (no ownership record).
    let foreign = format!("{pool}-foreign");
    create_node(
        client,
        &foreign,
        &pool,
        json!([same_prefix, {"key": key, "effect": "NoSchedule"}]),
    )
    .await;

    wait_for(
        "held tainted by meshgate, released advertising",
        Duration::from_secs(30),
        || async {
            let h = get_node(client, &held).await;
            let r = get_node(client, &released).await;
            taint_keys(&h).contains(&key)
                && r.status
                    .and_then(|s| s.capacity)
                    .is_some_and(|c| c.contains_key(resource))
        },
    )
    .await;
    let h = get_node(client, &held).await;
    assert_eq!(
        h.metadata
            .annotations
            .unwrap_or_default()
            .get("meshgate.dev/owned-taints"),
        Some(&key),
        "meshgate recorded the key it added"
    );
    wait_status(client, &pool, "the gate's status to count 3 nodes", |s| {
        s.nodes == 3 && s.held_nodes == 2
    })
    .await;
    assert_status_agrees(client, &pool).await;
    let g = Api::<NodeGate>::all(client.clone())
        .get(&pool)
        .await
        .expect("gate");
    assert!(
        g.metadata
            .finalizers
            .unwrap_or_default()
            .contains(&"meshgate.dev/node-gate".to_owned())
    );

    Api::<NodeGate>::all(client.clone())
        .delete(&pool, &DeleteParams::default())
        .await
        .expect("delete");
    wait_for(
        "the gate to be finalized and gone",
        Duration::from_secs(30),
        || async {
            Api::<NodeGate>::all(client.clone())
                .get_opt(&pool)
                .await
                .ok()
                .flatten()
                .is_none()
        },
    )
    .await;
    let h = get_node(client, &held).await;
    assert!(
        !taint_keys(&h).contains(&key),
        "its taint is off: {:?}",
        taint_keys(&h)
    );
    assert!(
        !h.metadata
            .annotations
            .unwrap_or_default()
            .contains_key("meshgate.dev/owned-taints")
    );
    let r = get_node(client, &released).await;
    assert!(
        !r.status
            .and_then(|s| s.capacity)
            .is_some_and(|c| c.contains_key(resource)),
        "its resource is withdrawn"
    );
    let f = get_node(client, &foreign).await;
    assert!(
        taint_keys(&f).contains(&key),
        "a taint meshgate did not add is not meshgate's to remove"
    );
    for n in [&held, &released, &foreign] {
        assert!(
            taint_keys(&get_node(client, n).await).contains(&"example.com/mesh".to_owned()),
            "{n}: same-prefix taint untouched"
        );
    }
}

#[tokio::test]
async fn the_api_server_refuses_reserved_keys_unconfirmed_no_execute_and_own_resources() {
    let (_, client) = setup().await;
    let client = &client;
    let gates = Api::<NodeGate>::all(client.clone());
    // Each spec, and what the API server's refusal says.
    let reserved = "taint key belongs to";
    let own = "must be an extended resource";
    let refused = [
        (
            json!({"taint": {"key": "node.kubernetes.io/not-ready"}}),
            reserved,
        ),
        (
            json!({"taint": {"key": "node.cloudprovider.kubernetes.io/uninitialized"}}),
            reserved,
        ),
        (
            json!({"taint": {"key": "node-role.kubernetes.io/control-plane"}}),
            reserved,
        ),
        (
            json!({"taint": {"key": "karpenter.sh/disrupted"}}),
            reserved,
        ),
        (
            json!({"taint": {"key": "ToBeDeletedByClusterAutoscaler"}}),
            reserved,
        ),
        (json!({"taint": {"effect": "NoExecute"}}), "allowNoExecute"),
        // A gate resource must be an extended resource, never the node's own.
        (json!({"resource": {"name": "cpu"}}), own),
        (json!({"resource": {"name": "pods"}}), own),
        (json!({"resource": {"name": "kubernetes.io/mesh"}}), own),
        (json!({"resource": {"name": "requests.example.com/x"}}), own),
    ];
    for (i, (extra, says)) in refused.into_iter().enumerate() {
        let what = extra.to_string();
        let spec = gate("reserved", "agents", &["cni"], extra);
        let err = gates
            .create(
                &PostParams::default(),
                &NodeGate::new(&format!("refused-{i}"), spec),
            )
            .await
            .expect_err(&what);
        assert!(err.to_string().contains(says), "{what}: {err}");
    }
    // The cluster autoscaler's startup-taint prefix is allowed.
    let ok = gate(
        "reserved",
        "agents",
        &["cni"],
        json!({"taint": {"key": "startup-taint.cluster-autoscaler.kubernetes.io/mesh"}}),
    );
    gates
        .create(
            &PostParams::default(),
            &NodeGate::new("autoscaler-prefix", ok),
        )
        .await
        .expect("allowed prefix");
    gates
        .delete("autoscaler-prefix", &DeleteParams::default())
        .await
        .expect("delete");
}

/// The node condition the gate's controller writes once it reconciled the node with every agent
/// Ready (it writes it after any taint change of that reconcile).
async fn gate_condition_true(client: &kube::Client, node: &str, gate: &str) -> bool {
    let ctype = format!("meshgate.dev/{gate}Ready");
    get_node(client, node)
        .await
        .status
        .and_then(|s| s.conditions)
        .unwrap_or_default()
        .iter()
        .any(|c| c.type_ == ctype && c.status == "True")
}

#[tokio::test]
async fn a_readiness_prefix_key_is_lifted_where_meshgate_set_it_and_left_where_another_controller_did()
 {
    let (env, client) = setup().await;
    let client = &client;
    let agents_ns = env.cp.namespace("readiness-agents", &[]).await.expect("ns");
    let pool = format!("readiness-{agents_ns}");
    let key = "readiness.k8s.io/mesh";
    let spec = gate(&pool, &agents_ns, &["cni"], json!({"taint": {"key": key}}));
    assert_eq!(spec.problems(), Vec::<String>::new(), "a valid gate key");
    create_gate(client, &pool, spec).await;
    // ours: registers without the key; meshgate taints it and records the key as its own.
    let ours = format!("{pool}-ours");
    create_node(client, &ours, &pool, json!([])).await;
    // theirs: registers with the key already set by another controller (a node-readiness rule).
    let theirs = format!("{pool}-theirs");
    create_node(
        client,
        &theirs,
        &pool,
        json!([{"key": key, "effect": "NoSchedule"}]),
    )
    .await;
    wait_for(
        "meshgate to taint the node it gates",
        Duration::from_secs(30),
        || async { has_taint(client, &ours, key).await },
    )
    .await;
    let annotations = |n: Node| n.metadata.annotations.unwrap_or_default();
    assert_eq!(
        annotations(get_node(client, &ours).await)
            .get("meshgate.dev/owned-taints")
            .map(String::as_str),
        Some(key),
        "meshgate recorded the key it added"
    );
    assert!(
        !annotations(get_node(client, &theirs).await).contains_key("meshgate.dev/owned-taints"),
        "the key another controller set is not recorded as meshgate's"
    );

    agent(client, &agents_ns, "cni-ours", "cni", &ours, true).await;
    agent(client, &agents_ns, "cni-theirs", "cni", &theirs, true).await;
    wait_for(
        "meshgate to lift its key once the agent is Ready",
        Duration::from_secs(30),
        || async { !has_taint(client, &ours, key).await },
    )
    .await;
    // The controller reconciled `theirs` with its agent Ready (its condition comes after any taint
    // write of that pass): the key is still there.
    wait_for(
        "the controller to report theirs Ready",
        Duration::from_secs(30),
        || async { gate_condition_true(client, &theirs, &pool).await },
    )
    .await;
    assert!(
        has_taint(client, &theirs, key).await,
        "a readiness key another controller set is not meshgate's to remove: {:?}",
        taint_keys(&get_node(client, &theirs).await)
    );
}

#[tokio::test]
async fn a_missing_agent_daemonset_degrades_the_gate_and_never_holds_a_node_past_the_timeout() {
    let (env, client) = setup().await;
    let client = &client;
    let agents_ns = env.cp.namespace("missing-agents", &[]).await.expect("ns");
    let pool = format!("missing-{agents_ns}");
    let timeout = 4;
    let spec: NodeGateSpec = serde_json::from_value(json!({
        "agents": [{"name": "cni", "namespace": agents_ns, "selector": {"matchLabels": {"app": "cni"}}, "daemonSet": "cni-agent"}],
        "nodeSelector": {"matchLabels": {"pool": pool}},
        "missingAgentTimeoutSeconds": timeout,
    }))
    .expect("spec");
    create_gate(client, &pool, spec).await;
    let node = format!("{pool}-0");
    let created = create_node(client, &node, &pool, json!([])).await;
    let created_at = created.metadata.creation_timestamp.expect("created").0;
    wait_status(client, &pool, "the gate to be Degraded", |s| {
        condition(s, "Degraded").is_some_and(|c| {
            c.status == "True"
                && c.message.contains("DaemonSet")
                && c.message.contains("does not exist")
        })
    })
    .await;
    let mut held = false;
    let start = Instant::now();
    loop {
        let tainted = has_taint(client, &node, names::DEFAULT_TAINT_KEY).await;
        held |= tainted;
        if !tainted && held {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the node is still held"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let released_at = k8s_openapi::jiff::Timestamp::now();
    let held_for = released_at.duration_since(created_at).as_secs_f64();
    eprintln!(
        "measured: node held {held_for:.1}s by a missing agent (missingAgentTimeoutSeconds {timeout})"
    );
    assert!(
        held_for >= f64::from(timeout) - 1.0,
        "held until the timeout: {held_for}"
    );
    assert!(
        held_for < f64::from(timeout) + 10.0,
        "not held past the timeout: {held_for}"
    );
    wait_for_event(client, Some(&pool), "Degraded").await;
    wait_status(
        client,
        &pool,
        "the status to count the node released",
        |s| s.held_nodes == 0,
    )
    .await;
    assert_status_agrees(client, &pool).await;
}

#[tokio::test]
async fn a_mass_agent_failure_retaints_at_most_the_budget_and_reports_the_rest() {
    let (env, client) = setup().await;
    let client = &client;
    let agents_ns = env.cp.namespace("budget-agents", &[]).await.expect("ns");
    let pool = format!("budget-{agents_ns}");
    let key = "budget.meshgate.dev/not-ready";
    let spec = gate(
        &pool,
        &agents_ns,
        &["cni"],
        json!({
            "taint": {"key": key}, "mode": "Continuous", "gracePeriodSeconds": 0, "maxRetainted": "2",
        }),
    );
    create_gate(client, &pool, spec).await;
    let nodes: Vec<String> = (0..5).map(|i| format!("{pool}-{i}")).collect();
    for n in &nodes {
        create_node(client, n, &pool, json!([])).await;
        agent(client, &agents_ns, &format!("cni-{n}"), "cni", n, true).await;
    }
    wait_status(client, &pool, "every node released", |s| {
        s.nodes == 5 && s.held_nodes == 0 && s.ready_nodes == 5
    })
    .await;
    let (log, watch) = NodeLog::start(client, &nodes).await;
    for n in &nodes {
        set_ready(client, &agents_ns, &format!("cni-{n}"), false).await;
    }
    wait_status(client, &pool, "the budget to be reported exhausted", |s| {
        s.held_nodes == 2
            && s.retaint_deferred == 3
            && condition(s, "RetaintBudgetExhausted").is_some_and(|c| c.status == "True")
    })
    .await;
    watch.abort();
    // The most nodes tainted at any moment of the watch.
    let mut tainted: BTreeSet<String> = BTreeSet::new();
    let mut most = 0;
    for (node, keys, _) in log.entries() {
        if keys.iter().any(|k| k == key) {
            tainted.insert(node);
        } else {
            tainted.remove(&node);
        }
        most = most.max(tainted.len());
    }
    assert_eq!(most, 2, "never more than maxRetainted nodes re-tainted");
    let mut now_tainted = 0;
    for n in &nodes {
        now_tainted += usize::from(has_taint(client, n, key).await);
    }
    assert_eq!(now_tainted, 2);
    assert_status_agrees(client, &pool).await;
}

#[tokio::test]
async fn dry_run_writes_nothing_to_nodes_and_reports_what_it_would_do() {
    let (env, client) = setup().await;
    let client = &client;
    let agents_ns = env.cp.namespace("dryrun-agents", &[]).await.expect("ns");
    let pool = format!("dryrun-{agents_ns}");
    let nodes: Vec<String> = (0..2).map(|i| format!("{pool}-{i}")).collect();
    for n in &nodes {
        create_node(client, n, &pool, json!([])).await;
    }
    let (log, watch) = NodeLog::start(client, &nodes).await;
    let spec = gate(&pool, &agents_ns, &["cni"], json!({"dryRun": true}));
    create_gate(client, &pool, spec).await;
    wait_status(client, &pool, "the dry run to report", |s| {
        s.nodes == 2
            && s.would_taint == 2
            && condition(s, "DryRun").is_some_and(|c| c.message.contains("would taint 2"))
    })
    .await;
    watch.abort();
    let entries = log.entries();
    assert!(
        entries.is_empty(),
        "a dry-run gate wrote to its nodes: {entries:?}"
    );
    for n in &nodes {
        assert!(!has_taint(client, n, names::DEFAULT_TAINT_KEY).await);
        // An Event says what the gate would do.
        wait_for_event(client, Some(n), "DryRun").await;
    }
}

#[tokio::test]
async fn the_admission_policy_taints_nodes_at_create_without_any_webhook() {
    let (_, client) = setup().await;
    let client = &client;
    let admission =
        Api::<k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration>::all(
            client.clone(),
        );
    assert!(
        admission
            .list(&Default::default())
            .await
            .expect("webhooks")
            .items
            .is_empty(),
        "no webhook registered in this cluster"
    );
    let served = meshgate::discovery::policy_api(client).await;
    let chosen = meshgate::install::NodeTaint::choose("auto", served).expect("auto");
    let meshgate::install::NodeTaint::Policy(api) = chosen else {
        panic!("auto picks the admission policy on this API server, not {chosen:?}");
    };
    let pool = format!("policy-{}", std::process::id());
    let key = "startup-taint.cluster-autoscaler.kubernetes.io/mesh";
    let spec = gate(&pool, "agents", &["cni"], json!({"taint": {"key": key}}));
    for doc in meshgate_core::registration::node_taint_policy(&pool, &spec, api) {
        meshgate::install::apply(client, &[doc], false, |_| {})
            .await
            .expect("policy applied");
    }
    // The policy takes effect asynchronously: dry-run creates until a node comes back tainted.
    let mut n = 0;
    wait_for(
        "the admission policy to be active",
        Duration::from_secs(30),
        || {
            n += 1;
            let name = format!("{pool}-probe-{n}");
            let pool = pool.clone();
            async move {
                let node: Node = serde_json::from_value(
                    json!({"metadata": {"name": name, "labels": {"pool": pool}}}),
                )
                .expect("node");
                let dry = PostParams {
                    dry_run: true,
                    ..Default::default()
                };
                Api::<Node>::all(client.clone())
                    .create(&dry, &node)
                    .await
                    .ok()
                    .is_some_and(|n| taint_keys(&n).iter().any(|k| k == key))
            }
        },
    )
    .await;
    let created = create_node(
        client,
        &format!("{pool}-0"),
        &pool,
        json!([{"key": "example.com/dedicated", "effect": "NoSchedule"}]),
    )
    .await;
    // (The API server's own admission adds node.kubernetes.io/not-ready too.)
    let keys = taint_keys(&created);
    assert!(keys.iter().any(|k| k == key), "tainted at CREATE: {keys:?}");
    assert_eq!(
        keys[0], "example.com/dedicated",
        "the node's own taint kept: {keys:?}"
    );
    assert_eq!(
        created
            .metadata
            .annotations
            .unwrap_or_default()
            .get("meshgate.dev/owned-taints")
            .map(String::as_str),
        Some(key),
        "a key outside meshgate's domain is recorded as meshgate's"
    );
    let other = create_node(client, &format!("other-{pool}"), "elsewhere", json!([])).await;
    assert!(
        !taint_keys(&other).iter().any(|k| k == key),
        "a node the gate does not select is not tainted"
    );
}

/// Another controller's taint (here the node lifecycle controller's `unreachable`) lands on a
/// node between meshgate's read of it, with no taints, and its write of the gate's taint: the
/// write is refused (it tests the node's resourceVersion as read) and the taint survives; the
/// write computed again from the node as it is now keeps both. The same write without its
/// condition (as at `481bbe6`: `add /spec/taints` whenever the node read had none) replaced the
/// whole list and removed the other controller's taint, shown on a second node.
#[tokio::test]
async fn a_taint_written_between_read_and_write_survives() {
    use meshgate_core::nodegate::{taint_patch, taints_of};
    let cp = control_plane(false).await;
    let client = cp.client().await.expect("client");
    let nodes: Api<Node> = Api::all(client.clone());
    let gate_nodes: Api<meshgate_api::GateNode> = Api::all(client.clone());
    let spec: NodeGateSpec = serde_json::from_value(json!({
        "agents": [{"name": "cni", "namespace": "kube-system", "selector": {"matchLabels": {"app": "x"}}}],
        "taint": {"key": "readiness.k8s.io/race"},
    }))
    .expect("spec");
    let foreign = json!({"spec": {"taints": [{"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}]}});
    // meshgate's write of a taint patch, as the controller sends it.
    let write = |name: &'static str, patch: &meshgate_core::patch::JsonPatch| {
        let gate_nodes = gate_nodes.clone();
        let ops: json_patch::Patch =
            serde_json::from_value(Value::Array(patch.0.clone())).expect("patch");
        async move {
            gate_nodes
                .patch(name, &PatchParams::default(), &Patch::<()>::Json(ops))
                .await
        }
    };
    let keys = |n: &meshgate_api::GateNode| -> Vec<String> {
        taints_of(n).into_iter().map(|t| t.key).collect()
    };
    for (name, conditional) in [("race-conditional", true), ("race-unconditional", false)] {
        let node: Node = serde_json::from_value(json!({"metadata": {"name": name}})).expect("node");
        nodes
            .create(&PostParams::default(), &node)
            .await
            .expect("node");
        // The API server's TaintNodesByCondition taints every new Node not-ready; the node
        // lifecycle controller (not running here) would lift it: lifted by hand.
        nodes
            .patch(
                name,
                &PatchParams::default(),
                &Patch::Merge(&json!({"spec": {"taints": null}})),
            )
            .await
            .expect("no taints");
        // What meshgate read: no taints.
        let read = gate_nodes.get(name).await.expect("read");
        assert!(keys(&read).is_empty());
        let rv = read
            .metadata
            .resource_version
            .clone()
            .expect("resourceVersion");
        // Another controller's write lands.
        nodes
            .patch(name, &PatchParams::default(), &Patch::Merge(&foreign))
            .await
            .expect("the other controller's taint");
        let mut patch = taint_patch(&spec, &taints_of(&read), &rv, true).expect("a write");
        if !conditional {
            patch.0.retain(|op| op["op"] != "test");
        }
        let written = write(name, &patch).await;
        let after = keys(&gate_nodes.get(name).await.expect("node"));
        let survived = after.iter().any(|k| k == "node.kubernetes.io/unreachable");
        println!(
            "measured: {name}: meshgate's write {}; the other controller's taint present after the race: {survived} ({after:?})",
            if written.is_ok() {
                "applied"
            } else {
                "refused"
            }
        );
        if conditional {
            assert!(
                written.is_err(),
                "the write on a node changed since it was read was refused"
            );
            assert!(survived, "the other controller's taint survives: {after:?}");
            // Computed again from the node as it is now: both taints.
            let now = gate_nodes.get(name).await.expect("node");
            let rv = now
                .metadata
                .resource_version
                .clone()
                .expect("resourceVersion");
            let patch = taint_patch(&spec, &taints_of(&now), &rv, true).expect("a write");
            write(name, &patch)
                .await
                .expect("the write from the node as it is");
            let both = keys(&gate_nodes.get(name).await.expect("node"));
            assert!(
                both.iter().any(|k| k == "node.kubernetes.io/unreachable")
                    && both.iter().any(|k| k == "readiness.k8s.io/race"),
                "{both:?}"
            );
        } else {
            assert!(
                written.is_ok() && !survived,
                "without the condition the list is replaced: {after:?}"
            );
        }
        nodes
            .delete(name, &DeleteParams::default())
            .await
            .expect("delete");
    }
}

/// A lease too short to renew is refused with the flag's name, before anything starts (it
/// panicked inside the lease library at `481bbe6`).
#[test]
fn a_lease_too_short_to_renew_is_refused_at_start() {
    let out = std::process::Command::new(meshgate_bin())
        .args(["controller", "--lease-seconds", "1"])
        .output()
        .expect("meshgate runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--lease-seconds") && !err.contains("panicked"),
        "{err}"
    );
}
