//! The node gate end to end: the real API server and kube-scheduler, meshgate's webhook and two
//! leader-elected controller replicas. Nodes and agent pods are objects the tests create and
//! whose status they set; no kubelet runs.
//!
//! Run: `cargo test --workspace --test node_gate`.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod, Taint};
use kube::api::{Api, Patch, PatchParams, PostParams};
use meshgate_api::node_gate::NodeGateSpec;
use meshgate_api::{GateConfig, NodeGate, Profile};
use meshgate_controller::leader::LeaseSettings;
use serde_json::{Value, json};
use tokio::sync::{Mutex, OnceCell};

const TAINT: &str = "node.meshgate.dev/agent-not-ready";
const RESOURCE: &str = "meshgate.dev/mesh-ready";
const LEASE_NS: &str = "default";
const LEASE: &str = "meshgate-node-gate-test";
const LEASE_SECONDS: u64 = 4;

struct Shared {
    replicas: Mutex<Vec<Replica>>,
}

async fn start_replica(kubeconfig: std::path::PathBuf, identity: &str) -> Replica {
    let lease = LeaseSettings {
        namespace: LEASE_NS.into(),
        name: LEASE.into(),
        identity: identity.into(),
        duration: LEASE_SECONDS,
        grace: 1,
    };
    Replica::start(kubeconfig, lease, Duration::from_secs(1), None).await
}

/// Control plane with scheduler, CRDs, meshgate's webhook (node taint path, resource gate for
/// ambient namespaces), and two controller replicas sharing a lease.
async fn setup() -> (
    kube::Client,
    Arc<meshgate_testenv::ControlPlane>,
    &'static Shared,
) {
    static SHARED: OnceCell<Shared> = OnceCell::const_new();
    let cp = control_plane(true).await;
    let client = cp.client().await.expect("client");
    let shared = SHARED
        .get_or_init(|| async {
            install_crds(&client).await;
            let config = GateConfig {
                profiles: vec![Profile::IstioAmbient],
                init_gate: meshgate_api::config::InitGate {
                    enabled: false,
                    ..Default::default()
                },
                resource_gate: meshgate_api::config::ResourceGate {
                    enabled: true,
                    resource: RESOURCE.into(),
                },
                ..GateConfig::default()
            };
            let webhook = start_webhook(&cp, config.clone()).await;
            register(
                &client,
                &webhook.registration("meshgate", &config, false, true),
            )
            .await;
            std::mem::forget(webhook);
            let replicas = vec![
                start_replica(cp.kubeconfig_path.clone(), "replica-a").await,
                start_replica(cp.kubeconfig_path.clone(), "replica-b").await,
            ];
            Shared {
                replicas: Mutex::new(replicas),
            }
        })
        .await;
    (client, cp, shared)
}

/// A gate for the nodes labelled `pool=<pool>`, waiting for agents `cni` and `node-proxy` in
/// `agents_ns`.
fn gate_spec(pool: &str, agents_ns: &str, extra: Value) -> NodeGateSpec {
    let mut spec = json!({
        "agents": [
            {"name": "cni", "namespace": agents_ns, "selector": {"matchLabels": {"app": "cni"}}},
            {"name": "node-proxy", "namespace": agents_ns, "selector": {"matchLabels": {"app": "node-proxy"}}},
        ],
        "nodeSelector": {"matchLabels": {"pool": pool}},
    });
    if let (Some(s), Some(e)) = (spec.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            s.insert(k.clone(), v.clone());
        }
    }
    serde_json::from_value(spec).expect("gate spec")
}

async fn create_gate(client: &kube::Client, name: &str, spec: NodeGateSpec) {
    Api::<NodeGate>::all(client.clone())
        .create(&PostParams::default(), &NodeGate::new(name, spec))
        .await
        .expect("gate created");
}

fn foreign_taint() -> Value {
    json!({"key": "example.com/dedicated", "value": "mesh", "effect": "PreferNoSchedule"})
}

/// Registers a node as kubelet would (with a foreign taint of the user's), then makes it Ready.
async fn create_node(
    client: &kube::Client,
    name: &str,
    pool: &str,
    extra_labels: &[(&str, &str)],
) -> Node {
    let mut labels = json!({"pool": pool});
    for (k, v) in extra_labels {
        labels[*k] = json!(v);
    }
    let node: Node = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": labels},
        "spec": {"taints": [foreign_taint()]},
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

/// Waits until `probe`, created through `api` as a dry run, comes back as `done` says: the
/// webhook has no side effects, so a dry run reaches it and stores nothing. How a test knows
/// the webhook's cache holds a gate it just created.
async fn wait_webhook<K>(what: &str, api: Api<K>, probe: K, done: impl Fn(K) -> bool)
where
    K: kube::Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let dry_run = PostParams {
        dry_run: true,
        ..Default::default()
    };
    let (api, probe, done) = (&api, &probe, &done);
    wait_for(what, Duration::from_secs(30), || async {
        api.create(&dry_run, probe).await.is_ok_and(done)
    })
    .await;
}

/// Waits until the webhook's cache holds the gate of `pool`: a node of the pool comes back
/// tainted.
async fn wait_webhook_taints(client: &kube::Client, pool: &str) {
    let probe: Node = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": format!("{pool}-probe"), "labels": {"pool": pool}},
    }))
    .expect("node");
    wait_webhook(
        "the webhook to know the gate",
        Api::all(client.clone()),
        probe,
        |n| taint_keys(&n).contains(&TAINT.to_owned()),
    )
    .await;
}

/// Waits until the webhook's cache holds the resource gate of `pool`: a mesh pod for the pool,
/// in `ns`, comes back requesting the resource.
async fn wait_webhook_requests(client: &kube::Client, ns: &str, pool: &str) {
    let api = Api::<Pod>::namespaced(client.clone(), ns);
    wait_webhook(
        "the webhook to know the resource gate",
        api,
        mesh_pod("probe", pool),
        |p| {
            p.spec.is_some_and(|s| {
                s.containers.iter().any(|c| {
                    c.resources
                        .as_ref()
                        .and_then(|r| r.requests.as_ref())
                        .is_some_and(|r| r.contains_key(RESOURCE))
                })
            })
        },
    )
    .await;
}

async fn node_has_taint(client: &kube::Client, name: &str) -> bool {
    let node = Api::<Node>::all(client.clone())
        .get(name)
        .await
        .expect("node");
    assert!(
        taint_keys(&node).contains(&"example.com/dedicated".to_owned()),
        "the foreign taint survives every operation: {:?}",
        node.spec.and_then(|s| s.taints)
    );
    taint_keys(&node).contains(&TAINT.to_owned())
}

/// An agent pod bound to `node`; `ready` sets its Ready condition.
async fn agent(client: &kube::Client, ns: &str, name: &str, app: &str, node: &str) {
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

/// A DRA gate `pool` (no taint at creation, [`RESOURCE`] x40) for the scenes where it may fall
/// back to the node status.
async fn status_dra_gate(client: &kube::Client, pool: &str, agents_ns: &str) {
    create_gate(
        client,
        pool,
        gate_spec(
            pool,
            agents_ns,
            json!({"taintOnCreate": false, "resource": {"name": RESOURCE, "provider": "DRA", "count": 40}}),
        ),
    )
    .await;
}

/// A node of `pool` (as [`create_node`]) with the agents `cni` and `node-proxy` of `agents_ns`
/// on it, both Ready; `plugin`: meshgate's node plugin pod there too, Ready or not.
async fn node_with_ready_agents(
    client: &kube::Client,
    agents_ns: &str,
    node: &str,
    pool: &str,
    plugin: Option<bool>,
) {
    create_node(client, node, pool, &[]).await;
    if let Some(ready) = plugin {
        node_plugin_pod(client, node, ready).await;
    }
    agent(client, agents_ns, "cni", "cni", node).await;
    agent(client, agents_ns, "proxy", "node-proxy", node).await;
    set_ready(client, agents_ns, "cni", true).await;
    set_ready(client, agents_ns, "proxy", true).await;
}

/// Waits until the controller has published, on `node`, a condition of gate `gate` whose message
/// satisfies `f`: the controller's own report that it processed the latest agent change, after
/// which a negative assertion is safe.
async fn wait_condition(
    client: &kube::Client,
    node: &str,
    gate: &str,
    what: &str,
    f: impl Fn(&str, &str) -> bool,
) {
    let ctype = format!("meshgate.dev/{gate}Ready");
    let f = &f;
    let ctype = &ctype;
    wait_for(what, Duration::from_secs(30), || async move {
        Api::<Node>::all(client.clone())
            .get(node)
            .await
            .ok()
            .and_then(|n| n.status?.conditions)
            .is_some_and(|cs| {
                cs.iter().any(|c| {
                    &c.type_ == ctype && f(&c.status, c.message.as_deref().unwrap_or_default())
                })
            })
    })
    .await;
}

fn mesh_pod(name: &str, pool: &str) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"nodeSelector": {"pool": pool},
                 "containers": [{"name": "app", "image": "registry.invalid/app:1"}]},
    }))
    .expect("pod")
}

async fn node_of(client: &kube::Client, ns: &str, pod: &str) -> Option<String> {
    Api::<Pod>::namespaced(client.clone(), ns)
        .get(pod)
        .await
        .ok()
        .and_then(|p| p.spec?.node_name)
}

async fn unschedulable_because(client: &kube::Client, ns: &str, pod: &str, why: &str) -> bool {
    Api::<Pod>::namespaced(client.clone(), ns)
        .get(pod)
        .await
        .ok()
        .and_then(|p| p.status?.conditions)
        .is_some_and(|cs| {
            cs.iter().any(|c| {
                c.type_ == "PodScheduled"
                    && c.status == "False"
                    && c.message.as_deref().is_some_and(|m| m.contains(why))
            })
        })
}

#[tokio::test]
async fn new_node_is_tainted_until_its_agents_are_ready_then_the_pod_binds() {
    let (client, cp, _) = setup().await;
    let agents_ns = cp.namespace("agents", &[]).await.unwrap();
    let apps_ns = cp.namespace("apps", &[]).await.unwrap();
    let pool = format!("untaint-{agents_ns}");
    create_gate(&client, &pool, gate_spec(&pool, &agents_ns, json!({}))).await;
    // The gate must be in the webhook's cache before the node registers.
    wait_webhook_taints(&client, &pool).await;

    let node = format!("{pool}-node");
    let created = create_node(&client, &node, &pool, &[]).await;
    assert!(
        taint_keys(&created).contains(&TAINT.to_owned()),
        "tainted at creation by the webhook"
    );

    Api::<Pod>::namespaced(client.clone(), &apps_ns)
        .create(&PostParams::default(), &mesh_pod("web", &pool))
        .await
        .unwrap();
    wait_for(
        "the pod to be held back by the taint",
        Duration::from_secs(30),
        || unschedulable_because(&client, &apps_ns, "web", "untolerated taint"),
    )
    .await;
    assert_eq!(node_of(&client, &apps_ns, "web").await, None);

    agent(&client, &agents_ns, "cni-1", "cni", &node).await;
    agent(&client, &agents_ns, "proxy-1", "node-proxy", &node).await;
    set_ready(&client, &agents_ns, "cni-1", true).await;
    // One agent Ready is not enough: once the controller reports it saw the cni agent Ready
    // (its node condition names only the node proxy), the node is still held.
    wait_condition(
        &client,
        &node,
        &pool,
        "the controller to see the cni agent Ready",
        |status, message| {
            status == "False" && message.contains("node-proxy") && !message.contains("cni (")
        },
    )
    .await;
    assert!(
        node_has_taint(&client, &node).await,
        "still held with one agent unready"
    );

    set_ready(&client, &agents_ns, "proxy-1", true).await;
    let ready_at = Instant::now();
    let nodes: Api<Node> = Api::all(client.clone());
    loop {
        let n = nodes.get(&node).await.unwrap();
        if !taint_keys(&n).contains(&TAINT.to_owned()) {
            break;
        }
        assert!(
            ready_at.elapsed() < Duration::from_secs(30),
            "taint not removed"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    eprintln!(
        "measured: agents Ready -> taint removed in {} ms (observed by polling every 10 ms)",
        ready_at.elapsed().as_millis()
    );
    assert!(!node_has_taint(&client, &node).await);
    wait_for(
        "the scheduler to bind the pod",
        Duration::from_secs(30),
        || async { node_of(&client, &apps_ns, "web").await.as_deref() == Some(node.as_str()) },
    )
    .await;
    let n = nodes.get(&node).await.unwrap();
    assert!(
        n.metadata
            .annotations
            .unwrap_or_default()
            .contains_key("meshgate.dev/agents-ready-since"),
        "bootstrap completion recorded on the node"
    );
}

#[tokio::test]
async fn admission_policy_taints_new_nodes_without_the_webhook() {
    let (client, cp, _) = setup().await;
    let api = meshgate::discovery::policy_api(&client)
        .await
        .expect("the API server serves MutatingAdmissionPolicy");
    // v1 from 1.36; before, the beta the test environment turns on.
    assert_eq!(
        api == meshgate_core::registration::PolicyApi::V1,
        cp.minor >= meshgate_testenv::POLICY_API_GA_MINOR,
        "{api:?} on Kubernetes 1.{}",
        cp.minor
    );
    let agents_ns = cp.namespace("agents-map", &[]).await.unwrap();
    let pool = format!("map-{agents_ns}");
    // The webhook does not taint these nodes: only the admission policy does.
    let spec = gate_spec(
        &pool,
        &agents_ns,
        json!({"taintOnCreate": false, "taint": {"key": "map.meshgate.dev/not-ready"}}),
    );
    create_gate(&client, &pool, spec.clone()).await;
    for doc in meshgate_core::registration::node_taint_policy(&pool, &spec, api) {
        let ar = kube::core::ApiResource::from_gvk(&kube::core::GroupVersionKind::gvk(
            "admissionregistration.k8s.io",
            api.api_version().rsplit('/').next().unwrap(),
            doc["kind"].as_str().unwrap(),
        ));
        let obj: kube::core::DynamicObject = serde_json::from_value(doc).unwrap();
        Api::<kube::core::DynamicObject>::all_with(client.clone(), &ar)
            .create(&PostParams::default(), &obj)
            .await
            .unwrap();
    }
    // The policy takes effect asynchronously: dry-run node creations until it does.
    let nodes: Api<Node> = Api::all(client.clone());
    let node = format!("{pool}-node");
    let probe: Node = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": node, "labels": {"pool": pool}},
        "spec": {"taints": [foreign_taint()]},
    }))
    .unwrap();
    wait_for(
        "the admission policy to be active",
        Duration::from_secs(30),
        || async {
            let dry = PostParams {
                dry_run: true,
                ..Default::default()
            };
            nodes
                .create(&dry, &probe)
                .await
                .ok()
                .is_some_and(|n| taint_keys(&n).contains(&"map.meshgate.dev/not-ready".to_owned()))
        },
    )
    .await;
    let created = nodes.create(&PostParams::default(), &probe).await.unwrap();
    let keys = taint_keys(&created);
    assert!(
        keys.contains(&"map.meshgate.dev/not-ready".to_owned()),
        "{keys:?}"
    );
    assert!(
        keys.contains(&"example.com/dedicated".to_owned()),
        "{keys:?}"
    );
    assert!(
        !keys.contains(&TAINT.to_owned()),
        "the webhook did not add its taint: {keys:?}"
    );
    // Another pool's node is not touched by this policy.
    let other: Node = serde_json::from_value(json!({"apiVersion": "v1", "kind": "Node",
        "metadata": {"name": format!("{pool}-other"), "labels": {"pool": "elsewhere"}}}))
    .unwrap();
    let other = nodes
        .create(
            &PostParams {
                dry_run: true,
                ..Default::default()
            },
            &other,
        )
        .await
        .unwrap();
    assert!(!taint_keys(&other).contains(&"map.meshgate.dev/not-ready".to_owned()));
}

#[tokio::test]
async fn continuous_mode_puts_the_taint_back_and_bootstrap_mode_does_not() {
    let (client, cp, _) = setup().await;
    let agents_ns = cp.namespace("agents-modes", &[]).await.unwrap();
    let grace = 2;
    let mut nodes = Vec::new();
    for mode in ["Continuous", "Bootstrap"] {
        let pool = format!("{}-{agents_ns}", mode.to_lowercase());
        create_gate(
            &client,
            &pool,
            gate_spec(
                &pool,
                &agents_ns,
                json!({"mode": mode, "gracePeriodSeconds": grace}),
            ),
        )
        .await;
        wait_webhook_taints(&client, &pool).await;
        let node = format!("{pool}-node");
        create_node(&client, &node, &pool, &[]).await;
        let (cni, proxy) = (format!("{pool}-cni"), format!("{pool}-proxy"));
        agent(&client, &agents_ns, &cni, "cni", &node).await;
        agent(&client, &agents_ns, &proxy, "node-proxy", &node).await;
        set_ready(&client, &agents_ns, &cni, true).await;
        set_ready(&client, &agents_ns, &proxy, true).await;
        wait_for("untaint", Duration::from_secs(30), || async {
            !node_has_taint(&client, &node).await
        })
        .await;
        nodes.push((mode, node, cni));
    }
    for (_, _, cni) in &nodes {
        set_ready(&client, &agents_ns, cni, false).await;
    }
    let (_, continuous, _) = &nodes[0];
    let unready_at = Instant::now();
    wait_for(
        "the continuous gate to re-taint",
        Duration::from_secs(30),
        || async { node_has_taint(&client, continuous).await },
    )
    .await;
    assert!(
        unready_at.elapsed() >= Duration::from_secs(grace - 1),
        "not before the grace period: {:?}",
        unready_at.elapsed()
    );
    // Once the controller reports that it saw the bootstrap node's agent unready (its decision
    // does not depend on time: released once, never held again), that node is still free.
    let (_, bootstrap, _) = &nodes[1];
    let bootstrap_gate = format!("bootstrap-{agents_ns}");
    wait_condition(
        &client,
        bootstrap,
        &bootstrap_gate,
        "the controller to see the bootstrap node's agent unready",
        |status, message| {
            status == "True" && message.contains("cni (") && message.contains("not ready")
        },
    )
    .await;
    assert!(
        !node_has_taint(&client, bootstrap).await,
        "bootstrap mode never re-taints"
    );
}

/// Two gates on one node, each with its own bootstrap mark (#42 4c): the first gate's agents
/// become Ready and it releases the node (its mark `agents-ready-since.meshgate.dev/<gate>`);
/// a second gate created afterwards, whose agent on the node is not Ready, still holds the node
/// with its own taint. With one mark shared by all gates the second counted the node as
/// released and left it untainted.
#[tokio::test]
async fn a_second_gate_holds_a_node_the_first_released() {
    let (client, cp, _) = setup().await;
    let agents_ns = cp.namespace("agents-two-gates", &[]).await.unwrap();
    let pool = format!("two-{agents_ns}");
    let first = format!("first-{agents_ns}");
    create_gate(
        &client,
        &first,
        gate_spec(&pool, &agents_ns, json!({"mode": "Bootstrap"})),
    )
    .await;
    let node = format!("{pool}-node");
    create_node(&client, &node, &pool, &[]).await;
    let (cni, proxy) = (format!("{pool}-cni"), format!("{pool}-proxy"));
    agent(&client, &agents_ns, &cni, "cni", &node).await;
    agent(&client, &agents_ns, &proxy, "node-proxy", &node).await;
    set_ready(&client, &agents_ns, &cni, true).await;
    set_ready(&client, &agents_ns, &proxy, true).await;
    let nodes: Api<Node> = Api::all(client.clone());
    let annotations = |n: Node| n.metadata.annotations.unwrap_or_default();
    let first_mark = meshgate_core::nodegate::ready_since_key(&first);
    wait_for(
        "the first gate to release the node and mark it",
        Duration::from_secs(30),
        || async {
            !node_has_taint(&client, &node).await
                && annotations(nodes.get(&node).await.expect("node")).contains_key(&first_mark)
        },
    )
    .await;

    // The second gate: its own agent (not Ready on the node) and its own key.
    let key = "second.meshgate.dev/agent-not-ready";
    let second = format!("second-{agents_ns}");
    let mesh_b = format!("{pool}-mesh-b");
    agent(&client, &agents_ns, &mesh_b, "mesh-b", &node).await;
    set_ready(&client, &agents_ns, &mesh_b, false).await;
    let spec: NodeGateSpec = serde_json::from_value(json!({
        "agents": [{"name": "mesh-b", "namespace": agents_ns,
                    "selector": {"matchLabels": {"app": "mesh-b"}}}],
        "nodeSelector": {"matchLabels": {"pool": pool}},
        "taint": {"key": key},
        "mode": "Bootstrap",
    }))
    .expect("second gate spec");
    create_gate(&client, &second, spec).await;
    wait_for(
        "the second gate to hold the node with its own taint",
        Duration::from_secs(30),
        || async { taint_keys(&nodes.get(&node).await.expect("node")).contains(&key.to_owned()) },
    )
    .await;
    let marks = annotations(nodes.get(&node).await.expect("node"));
    assert!(marks.contains_key(&first_mark), "{marks:?}");
    assert!(
        !marks.contains_key(&meshgate_core::nodegate::ready_since_key(&second)),
        "the second gate has not released the node: {marks:?}"
    );
    assert!(
        !node_has_taint(&client, &node).await,
        "the first gate's taint stays off"
    );
}

#[tokio::test]
async fn resource_gate_holds_pods_until_the_node_advertises_the_resource() {
    let (client, cp, _) = setup().await;
    let agents_ns = cp.namespace("agents-res", &[]).await.unwrap();
    let mesh_ns = cp
        .namespace("mesh-res", &[("istio.io/dataplane-mode", "ambient")])
        .await
        .unwrap();
    let pool = format!("res-{agents_ns}");
    create_gate(
        &client,
        &pool,
        gate_spec(
            &pool,
            &agents_ns,
            json!({"taintOnCreate": false, "resource": {"name": RESOURCE, "count": 50}}),
        ),
    )
    .await;
    wait_webhook_requests(&client, &mesh_ns, &pool).await;
    let node = format!("{pool}-node");
    create_node(&client, &node, &pool, &[]).await;
    // The webhook's resource gate gives mesh pods a request for the resource.
    let created = Api::<Pod>::namespaced(client.clone(), &mesh_ns)
        .create(&PostParams::default(), &mesh_pod("app", &pool))
        .await
        .unwrap();
    let requests = created.spec.unwrap().containers[0]
        .resources
        .clone()
        .unwrap()
        .requests
        .unwrap();
    assert_eq!(requests.get(RESOURCE).map(|q| q.0.as_str()), Some("1"));
    // The scheduler reports the pod unschedulable; its message names the resource once the
    // scheduler's cache has the node without the kubelet's not-ready taint.
    wait_for(
        "the pod to be unschedulable",
        Duration::from_secs(60),
        || unschedulable_because(&client, &mesh_ns, "app", ""),
    )
    .await;
    assert!(
        !node_has_taint(&client, &node).await,
        "no taint in this gate: the resource alone holds the pod"
    );
    let node_now = Api::<Node>::all(client.clone()).get(&node).await.unwrap();
    let blocking: Vec<String> = node_now
        .spec
        .and_then(|s| s.taints)
        .unwrap_or_default()
        .into_iter()
        .filter(|t| t.effect != "PreferNoSchedule")
        .map(|t| t.key)
        .collect();
    assert!(
        blocking.is_empty(),
        "only the missing resource holds the pod: {blocking:?}"
    );
    // The scheduler reported the pod unschedulable above: it is not bound.
    assert_eq!(
        node_of(&client, &mesh_ns, "app").await,
        None,
        "held while the resource is missing"
    );

    agent(&client, &agents_ns, "cni", "cni", &node).await;
    agent(&client, &agents_ns, "proxy", "node-proxy", &node).await;
    set_ready(&client, &agents_ns, "cni", true).await;
    set_ready(&client, &agents_ns, "proxy", true).await;
    wait_for(
        "the resource to be advertised",
        Duration::from_secs(30),
        || async {
            Api::<Node>::all(client.clone())
                .get(&node)
                .await
                .ok()
                .and_then(|n| n.status?.capacity)
                .is_some_and(|c| c.get(RESOURCE).map(|q| q.0.as_str()) == Some("50"))
        },
    )
    .await;
    wait_for("the pod to bind", Duration::from_secs(30), || async {
        node_of(&client, &mesh_ns, "app").await.as_deref() == Some(node.as_str())
    })
    .await;
}

#[tokio::test]
async fn a_node_the_agent_daemonset_cannot_target_is_not_held() {
    let (client, cp, _) = setup().await;
    let agents_ns = cp.namespace("agents-ds", &[]).await.unwrap();
    let pool = format!("ds-{agents_ns}");
    let ds = json!({
        "apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": {"name": "cni-agent"},
        "spec": {
            "selector": {"matchLabels": {"app": "cni"}},
            "template": {
                "metadata": {"labels": {"app": "cni"}},
                "spec": {"nodeSelector": {"kubernetes.io/os": "linux"},
                         "containers": [{"name": "cni", "image": "registry.invalid/cni:1"}]},
            },
        },
    });
    Api::<k8s_openapi::api::apps::v1::DaemonSet>::namespaced(client.clone(), &agents_ns)
        .create(&PostParams::default(), &serde_json::from_value(ds).unwrap())
        .await
        .unwrap();
    let spec: NodeGateSpec = serde_json::from_value(json!({
        "agents": [{"name": "cni", "namespace": agents_ns, "selector": {"matchLabels": {"app": "cni"}}, "daemonSet": "cni-agent"}],
        "nodeSelector": {"matchLabels": {"pool": pool}},
    }))
    .unwrap();
    create_gate(&client, &pool, spec).await;
    wait_webhook_taints(&client, &pool).await;
    // A Windows node: the Linux-only agent will never run there.
    let windows = format!("{pool}-windows");
    let created = create_node(&client, &windows, &pool, &[("kubernetes.io/os", "windows")]).await;
    assert!(
        taint_keys(&created).contains(&TAINT.to_owned()),
        "tainted at registration"
    );
    wait_for(
        "the untargeted node to be released",
        Duration::from_secs(30),
        || async { !node_has_taint(&client, &windows).await },
    )
    .await;
    // A Linux node of the same pool waits for its agent.
    let linux = format!("{pool}-linux");
    create_node(&client, &linux, &pool, &[("kubernetes.io/os", "linux")]).await;
    wait_condition(
        &client,
        &linux,
        &pool,
        "the controller to report the linux node waiting",
        |status, message| status == "False" && message.contains("missing"),
    )
    .await;
    assert!(
        node_has_taint(&client, &linux).await,
        "a node the agent targets keeps waiting"
    );
}

async fn lease_holder(client: &kube::Client) -> Option<String> {
    Api::<Lease>::namespaced(client.clone(), LEASE_NS)
        .get(LEASE)
        .await
        .ok()
        .and_then(|l| l.spec?.holder_identity)
}

fn writes(m: &meshgate_controller::Metrics) -> u64 {
    let text = m.encode();
    text.lines()
        .filter(|l| l.starts_with("meshgate_controller_operations_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

#[tokio::test]
async fn only_the_leader_writes_and_the_other_replica_takes_over() {
    let (client, cp, shared) = setup().await;
    // Work for the controllers: one node to release.
    let agents_ns = cp.namespace("agents-lease", &[]).await.unwrap();
    let pool = format!("lease-{agents_ns}");
    create_gate(&client, &pool, gate_spec(&pool, &agents_ns, json!({}))).await;
    wait_webhook_taints(&client, &pool).await;
    let node = format!("{pool}-node");
    node_with_ready_agents(&client, &agents_ns, &node, &pool, None).await;
    wait_for("untaint", Duration::from_secs(30), || async {
        !node_has_taint(&client, &node).await
    })
    .await;

    let mut replicas = shared.replicas.lock().await;
    let holder = lease_holder(&client).await.expect("a lease holder");
    let leader_idx = replicas
        .iter()
        .position(|r| r.identity == holder)
        .expect("holder is a replica");
    let other_idx = 1 - leader_idx;
    assert!(
        writes(&replicas[leader_idx].metrics) > 0,
        "the leader wrote"
    );
    assert_eq!(
        writes(&replicas[other_idx].metrics),
        0,
        "the follower wrote nothing"
    );

    // Stop the leader; the other replica takes the lease within the lease time (plus renew slack).
    let stopped_at = Instant::now();
    if let Some(stop) = replicas[leader_idx].stop.take() {
        let _ = stop.send(());
    }
    let new_holder = replicas[other_idx].identity.clone();
    wait_for(
        "the other replica to take the lease",
        Duration::from_secs(LEASE_SECONDS * 3),
        || async { lease_holder(&client).await.as_deref() == Some(new_holder.as_str()) },
    )
    .await;
    eprintln!(
        "measured: leader failover in {} ms (lease {LEASE_SECONDS}s)",
        stopped_at.elapsed().as_millis()
    );

    // The new leader does the work: a new node of the pool is released.
    let node2 = format!("{pool}-node2");
    create_node(&client, &node2, &pool, &[]).await;
    agent(&client, &agents_ns, "cni-2", "cni", &node2).await;
    agent(&client, &agents_ns, "proxy-2", "node-proxy", &node2).await;
    set_ready(&client, &agents_ns, "cni-2", true).await;
    set_ready(&client, &agents_ns, "proxy-2", true).await;
    wait_for(
        "untaint by the new leader",
        Duration::from_secs(30),
        || async { !node_has_taint(&client, &node2).await },
    )
    .await;
    assert!(
        writes(&replicas[other_idx].metrics) > 0,
        "the new leader wrote"
    );

    // The gate's status reports its nodes.
    let api: Api<NodeGate> = Api::all(client.clone());
    wait_for("gate status", Duration::from_secs(15), || async {
        api.get(&pool)
            .await
            .ok()
            .and_then(|g| g.status)
            .is_some_and(|s| s.nodes == 2 && s.ready_nodes == 2 && s.held_nodes == 0)
    })
    .await;
    // Keep a second replica for the tests that may still run.
    let kubeconfig = cp.kubeconfig_path.clone();
    replicas[leader_idx] = start_replica(kubeconfig, "replica-c").await;
    let _ = BTreeMap::<String, String>::new();
    let _ = Taint::default();
}

/// meshgate's node plugin on `node`, as the controller finds it: a pod of the `meshgate-node`
/// DaemonSet in `meshgate-system` (objects only; no kubelet runs here).
async fn node_plugin_pod(client: &kube::Client, node: &str, ready: bool) {
    use k8s_openapi::api::apps::v1::DaemonSet;
    use k8s_openapi::api::core::v1::Namespace;
    let ns = "meshgate-system";
    let _ = Api::<Namespace>::all(client.clone())
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": ns}})).expect("namespace"),
        )
        .await;
    let labels =
        json!({"app.kubernetes.io/name": "meshgate", "app.kubernetes.io/component": "node"});
    let _ = Api::<DaemonSet>::namespaced(client.clone(), ns)
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": "meshgate-node"},
                "spec": {"selector": {"matchLabels": labels}, "template": {"metadata": {"labels": labels},
                    "spec": {"tolerations": [{"operator": "Exists"}], "containers": [{"name": "node", "image": "registry.invalid/meshgate:1"}]}}},
            }))
            .expect("daemonset"),
        )
        .await;
    let name = format!("meshgate-node-{node}");
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {"nodeName": node, "containers": [{"name": "node", "image": "registry.invalid/meshgate:1"}],
                 "tolerations": [{"operator": "Exists"}]},
    }))
    .expect("pod");
    let _ = Api::<Pod>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &pod)
        .await;
    set_ready(client, ns, &name, ready).await;
}

async fn slice_of(
    client: &kube::Client,
    gate: &str,
    node: &str,
) -> Option<k8s_openapi::api::resource::v1::ResourceSlice> {
    Api::<k8s_openapi::api::resource::v1::ResourceSlice>::all(client.clone())
        .get_opt(&meshgate_core::dra::slice_name(gate, node))
        .await
        .expect("slice")
}

async fn gate_condition(
    client: &kube::Client,
    gate: &str,
    ctype: &str,
) -> Option<(String, String, String)> {
    Api::<NodeGate>::all(client.clone())
        .get(gate)
        .await
        .ok()?
        .status?
        .conditions
        .into_iter()
        .find(|c| c.type_ == ctype)
        .map(|c| (c.status, c.reason, c.message))
}

/// Creates a Continuous gate (no grace, lifting only) with `extra` (its DRA resource) over
/// `pool`'s nodes and `agents_ns`'s agents, and returns its DeviceClass once the controller wrote
/// it.
async fn dra_gate(
    client: &kube::Client,
    pool: &str,
    agents_ns: &str,
    extra: Value,
) -> k8s_openapi::api::resource::v1::DeviceClass {
    let mut spec = json!({"taintOnCreate": false, "mode": "Continuous", "gracePeriodSeconds": 0});
    if let (Some(s), Some(e)) = (spec.as_object_mut(), extra.as_object()) {
        s.extend(e.clone());
    }
    create_gate(client, pool, gate_spec(pool, agents_ns, spec)).await;
    let classes: Api<k8s_openapi::api::resource::v1::DeviceClass> = Api::all(client.clone());
    let class_name = meshgate_core::dra::device_class_name(pool);
    wait_for(
        "the gate's DeviceClass",
        Duration::from_secs(30),
        || async { classes.get_opt(&class_name).await.ok().flatten().is_some() },
    )
    .await;
    classes.get(&class_name).await.expect("class")
}

/// A DRA gate: its DeviceClass maps the resource to its devices; a node's slice is published
/// only while its agents and the node plugin are Ready, the scheduler then satisfies a pod's
/// request with a claim on it, the slice comes back when somebody deletes it (the kubelet does
/// at its start), goes when an agent fails, and the gate's deletion removes slices and class.
#[tokio::test]
async fn dra_gate_publishes_a_slice_only_where_the_mesh_and_the_node_plugin_are_ready() {
    use k8s_openapi::api::resource::v1::DeviceClass;
    let (client, cp, _) = setup().await;
    let agents_ns = cp.namespace("agents-dra", &[]).await.unwrap();
    let apps_ns = cp.namespace("apps-dra", &[]).await.unwrap();
    let pool = format!("dra-{agents_ns}");
    let resource = "dra.example.com/mesh-ready";
    let class = dra_gate(
        &client,
        &pool,
        &agents_ns,
        json!({"resource": {"name": resource, "provider": "DRA"}}),
    )
    .await;
    let classes: Api<DeviceClass> = Api::all(client.clone());
    let class_name = meshgate_core::dra::device_class_name(&pool);
    if class.spec.extended_resource_name.is_none() && cp.minor < 36 {
        // DRA extended resources are alpha and off before 1.36: the API server dropped the
        // field, and the gate falls back to the node status
        // (a_dra_gate_falls_back_to_the_node_status_where_dra_extended_resources_are_off).
        eprintln!(
            "skipped: Kubernetes 1.{} dropped extendedResourceName (DRAExtendedResource off)",
            cp.minor
        );
        return;
    }
    assert_eq!(
        class.spec.extended_resource_name.as_deref(),
        Some(resource),
        "the API server kept extendedResourceName"
    );
    assert_eq!(
        class
            .metadata
            .owner_references
            .unwrap_or_default()
            .first()
            .map(|o| o.kind.clone()),
        Some("NodeGate".to_owned())
    );
    wait_for(
        "the gate to report DRA",
        Duration::from_secs(30),
        || async {
            gate_condition(&client, &pool, "ResourceProvider")
                .await
                .is_some_and(|(s, r, _)| s == "True" && r == "DRA")
        },
    )
    .await;

    let node = format!("{pool}-node");
    node_with_ready_agents(&client, &agents_ns, &node, &pool, Some(false)).await;
    // The agents are Ready, the node plugin is not: the controller reports the node ready (the
    // condition is written after the reconcile's resource decision) and publishes nothing; a
    // slice is published only for a plugin it has seen Ready.
    wait_condition(&client, &node, &pool, "the node ready", |s, _| s == "True").await;
    assert!(
        slice_of(&client, &pool, &node).await.is_none(),
        "no slice while the node plugin is not Ready"
    );
    set_ready(
        &client,
        "meshgate-system",
        &format!("meshgate-node-{node}"),
        true,
    )
    .await;
    wait_for("the node's slice", Duration::from_secs(30), || async {
        slice_of(&client, &pool, &node).await.is_some()
    })
    .await;
    let slice = slice_of(&client, &pool, &node).await.unwrap();
    assert_eq!(slice.spec.node_name.as_deref(), Some(node.as_str()));
    assert_eq!(slice.spec.driver, meshgate_api::names::DRA_DRIVER);
    assert_eq!(
        slice
            .metadata
            .owner_references
            .clone()
            .unwrap_or_default()
            .first()
            .map(|o| (o.kind.clone(), o.name.clone())),
        Some(("Node".to_owned(), node.clone()))
    );
    let devices = slice.spec.devices.clone().unwrap_or_default();
    assert_eq!(devices.len(), 1);
    assert_eq!(devices[0].allow_multiple_allocations, Some(true));
    // The node status never carries the resource: the scheduler would serve it natively.
    let n = Api::<Node>::all(client.clone()).get(&node).await.unwrap();
    assert!(
        !n.status
            .and_then(|s| s.capacity)
            .unwrap_or_default()
            .contains_key(resource)
    );

    // Two pods requesting the resource bind to the node, each with the scheduler's claim on the
    // one shared device.
    for name in ["dra-a", "dra-b"] {
        let mut pod = mesh_pod(name, &pool);
        pod.spec.as_mut().unwrap().containers[0].resources = Some(
            serde_json::from_value(json!({"requests": {resource: "1"}, "limits": {resource: "1"}}))
                .unwrap(),
        );
        Api::<Pod>::namespaced(client.clone(), &apps_ns)
            .create(&PostParams::default(), &pod)
            .await
            .unwrap();
    }
    for name in ["dra-a", "dra-b"] {
        wait_for("the pod to bind", Duration::from_secs(30), || async {
            node_of(&client, &apps_ns, name).await.as_deref() == Some(node.as_str())
        })
        .await;
        let p = Api::<Pod>::namespaced(client.clone(), &apps_ns)
            .get(name)
            .await
            .unwrap();
        assert!(
            p.status
                .and_then(|s| s.extended_resource_claim_status)
                .is_some(),
            "{name}: satisfied by a DRA claim"
        );
    }

    // Deleted by somebody else (the kubelet deletes its node's slices when it starts): back.
    let uid = slice.metadata.uid.clone();
    Api::<k8s_openapi::api::resource::v1::ResourceSlice>::all(client.clone())
        .delete(&slice.metadata.name.clone().unwrap(), &Default::default())
        .await
        .unwrap();
    wait_for(
        "the slice published again",
        Duration::from_secs(30),
        || async {
            slice_of(&client, &pool, &node)
                .await
                .is_some_and(|s| s.metadata.uid != uid)
        },
    )
    .await;

    // An agent fails (Continuous, no grace): withdrawn.
    set_ready(&client, &agents_ns, "proxy", false).await;
    wait_for("the slice withdrawn", Duration::from_secs(30), || async {
        slice_of(&client, &pool, &node).await.is_none()
    })
    .await;
    set_ready(&client, &agents_ns, "proxy", true).await;
    wait_for("the slice back", Duration::from_secs(30), || async {
        slice_of(&client, &pool, &node).await.is_some()
    })
    .await;

    // The gate goes: its slices and its class go first.
    Api::<NodeGate>::all(client.clone())
        .delete(&pool, &Default::default())
        .await
        .unwrap();
    wait_for("the gate gone", Duration::from_secs(30), || async {
        Api::<NodeGate>::all(client.clone())
            .get_opt(&pool)
            .await
            .ok()
            .flatten()
            .is_none()
    })
    .await;
    assert!(slice_of(&client, &pool, &node).await.is_none());
    assert!(classes.get_opt(&class_name).await.unwrap().is_none());
}

/// A pod that requests a DRA gate's resource while the gate has withdrawn the node's slice is
/// held, every time: round after round an agent fails, the slice is withdrawn (seen gone), a
/// pod is created, and the scheduler reports it `Unschedulable` (its message is printed) and
/// binds it only after the agent is Ready again and the slice is back. A pod the scheduler
/// bound on a slice it had not yet seen go is counted and fails the test, with where it went.
#[tokio::test]
async fn a_pod_on_a_withdrawn_slice_is_held_round_after_round() {
    let (client, cp, _) = setup().await;
    let agents_ns = cp.namespace("agents-held", &[]).await.unwrap();
    let apps_ns = cp.namespace("apps-held", &[]).await.unwrap();
    let pool = format!("held-{agents_ns}");
    let resource = "held.example.com/mesh-ready";
    let class = dra_gate(
        &client,
        &pool,
        &agents_ns,
        json!({"resource": {"name": resource, "provider": "DRA"}}),
    )
    .await;
    if class.spec.extended_resource_name.is_none() {
        eprintln!(
            "skipped: Kubernetes 1.{} dropped extendedResourceName (DRAExtendedResource off)",
            cp.minor
        );
        return;
    }
    let node = format!("{pool}-node");
    node_with_ready_agents(&client, &agents_ns, &node, &pool, Some(true)).await;
    wait_for("the node's slice", Duration::from_secs(30), || async {
        slice_of(&client, &pool, &node).await.is_some()
    })
    .await;

    let pods = Api::<Pod>::namespaced(client.clone(), &apps_ns);
    const ROUNDS: usize = 20;
    let mut messages = BTreeMap::<String, usize>::new();
    let mut placed = Vec::new();
    for round in 0..ROUNDS {
        set_ready(&client, &agents_ns, "proxy", false).await;
        wait_for("the slice withdrawn", Duration::from_secs(30), || async {
            slice_of(&client, &pool, &node).await.is_none()
        })
        .await;
        let name = format!("held-{round}");
        let mut pod = mesh_pod(&name, &pool);
        // It tolerates the gate's taint (the node is re-tainted too): only the slice holds it.
        pod.spec.as_mut().unwrap().tolerations = Some(vec![
            serde_json::from_value(json!({"key": TAINT, "operator": "Exists"})).unwrap(),
        ]);
        pod.spec.as_mut().unwrap().containers[0].resources = Some(
            serde_json::from_value(json!({"requests": {resource: "1"}, "limits": {resource: "1"}}))
                .unwrap(),
        );
        pods.create(&PostParams::default(), &pod).await.unwrap();
        // The scheduler's verdict: bound somewhere, or PodScheduled False.
        let deadline = Instant::now() + Duration::from_secs(30);
        let verdict = loop {
            if let Some(v) = scheduler_verdict(&pods, &name).await {
                break v;
            }
            assert!(
                Instant::now() < deadline,
                "{name}: no verdict of the scheduler in 30 s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        match verdict {
            Ok(message) => *messages.entry(message).or_default() += 1,
            Err(bound_to) => placed.push(format!("{name} bound to {bound_to}")),
        }
        set_ready(&client, &agents_ns, "proxy", true).await;
        wait_for("the held pod to bind", Duration::from_secs(30), || async {
            node_of(&client, &apps_ns, &name).await.as_deref() == Some(node.as_str())
        })
        .await;
        pods.delete(
            &name,
            &kube::api::DeleteParams {
                grace_period_seconds: Some(0),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    }
    eprintln!(
        "measured: {ROUNDS} pods created on a withdrawn slice: {} held ({messages:?}), {} bound ({placed:?})",
        ROUNDS - placed.len(),
        placed.len()
    );
    assert!(
        placed.is_empty(),
        "pods bound while the node's slice was withdrawn: {placed:?}"
    );
    assert!(
        messages.keys().all(|m| m.starts_with("Unschedulable: ")),
        "the scheduler reported every held pod Unschedulable: {messages:?}"
    );
}

/// The scheduler's verdict on a pod: `Err(node)` bound, `Ok("reason: message")` of a
/// `PodScheduled` `False` condition, `None` not yet.
async fn scheduler_verdict(pods: &Api<Pod>, name: &str) -> Option<Result<String, String>> {
    let p = pods.get(name).await.ok()?;
    if let Some(n) = p.spec.as_ref().and_then(|s| s.node_name.clone()) {
        return Some(Err(n));
    }
    let c = p
        .status?
        .conditions?
        .into_iter()
        .find(|c| c.type_ == "PodScheduled" && c.status == "False")?;
    Some(Ok(format!(
        "{}: {}",
        c.reason.unwrap_or_default(),
        c.message.unwrap_or_default()
    )))
}

/// Where the API server drops `DeviceClass.spec.extendedResourceName` (DRA extended resources
/// off), a DRA gate falls back to the node status and says so: condition `ResourceProvider`
/// `False` (`NodeStatusFallback`), Event `DRAUnavailable`, the resource advertised on ready
/// nodes as a status gate does.
#[tokio::test]
async fn a_dra_gate_falls_back_to_the_node_status_where_dra_extended_resources_are_off() {
    let cp = match meshgate_testenv::ControlPlane::start(meshgate_testenv::Options {
        apiserver_flags: vec!["--feature-gates=DRAExtendedResource=false".into()],
        ..Default::default()
    })
    .await
    {
        // From 1.37 the API server refuses to turn DRA extended resources off (GA, locked on):
        // no cluster of that version can need the fallback.
        Err(e)
            if e.to_string()
                .contains("DRAExtendedResource to false, feature is locked") =>
        {
            eprintln!("skipped: this API server has DRA extended resources locked on: {e}");
            return;
        }
        other => other.expect("control plane"),
    };
    let client = cp.client().await.unwrap();
    install_crds(&client).await;
    let lease = |identity: &str| LeaseSettings {
        namespace: LEASE_NS.into(),
        name: LEASE.into(),
        identity: identity.into(),
        duration: LEASE_SECONDS,
        grace: 1,
    };
    let replica = Replica::start(
        cp.kubeconfig_path.clone(),
        lease("fallback"),
        Duration::from_secs(1),
        None,
    )
    .await;
    let agents_ns = cp.namespace("agents", &[]).await.unwrap();
    let pool = "fallback";
    status_dra_gate(&client, pool, &agents_ns).await;
    wait_for(
        "the fallback condition",
        Duration::from_secs(30),
        || async {
            gate_condition(&client, pool, "ResourceProvider")
                .await
                .is_some_and(|(s, r, m)| {
                    s == "False" && r == "NodeStatusFallback" && m.contains("extendedResourceName")
                })
        },
    )
    .await;
    wait_for_event(&client, Some(pool), "DRAUnavailable").await;
    let node = "fallback-node";
    node_with_ready_agents(&client, &agents_ns, node, pool, None).await;
    wait_for(
        "the resource in the node status",
        Duration::from_secs(30),
        || async {
            Api::<Node>::all(client.clone())
                .get(node)
                .await
                .ok()
                .and_then(|n| n.status?.capacity)
                .is_some_and(|c| c.get(RESOURCE).map(|q| q.0.as_str()) == Some("40"))
        },
    )
    .await;
    assert!(slice_of(&client, pool, node).await.is_none(), "no slice");

    // The controller restarts. Until the new replica knows the class falls back it decides
    // nothing as a DRA gate: the node keeps its status resource throughout (a watch from
    // before the restart until the new replica has reconciled every node).
    let withdrawn = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = withdrawn.clone();
    let watch = tokio::spawn({
        use futures::StreamExt;
        use kube::runtime::{WatchStreamExt, watcher};
        let nodes = Api::<Node>::all(client.clone());
        async move {
            let config = watcher::Config::default().fields(&format!("metadata.name={node}"));
            let stream = watcher(nodes, config).applied_objects();
            futures::pin_mut!(stream);
            while let Some(Ok(n)) = stream.next().await {
                // The fence: every event before it has been seen.
                if n.metadata
                    .labels
                    .as_ref()
                    .is_some_and(|l| l.contains_key("test.meshgate.dev/fence"))
                {
                    return;
                }
                let has = n
                    .status
                    .and_then(|s| s.capacity)
                    .is_some_and(|c| c.contains_key(RESOURCE));
                if !has {
                    seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                }
            }
        }
    });
    drop(replica);
    let restarted = Replica::start(
        cp.kubeconfig_path.clone(),
        lease("fallback-restarted"),
        Duration::from_secs(1),
        None,
    )
    .await;
    let metrics = restarted.metrics.clone();
    wait_for(
        "the restarted replica to lead and reconcile every node",
        Duration::from_secs(60),
        || {
            let m = metrics.clone();
            async move { m.leader.get() == 1 && m.initial_reconcile_done.get() == 1 }
        },
    )
    .await;
    Api::<Node>::all(client.clone())
        .patch(
            node,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"test.meshgate.dev/fence": "1"}}})),
        )
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(30), watch)
        .await
        .expect("the watch saw the fence")
        .unwrap();
    assert_eq!(
        withdrawn.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "the node's status resource was withdrawn across the restart"
    );
    assert!(slice_of(&client, pool, node).await.is_none(), "no slice");
}

/// The API server starts serving DRA while the controller runs (a control-plane upgrade, a
/// `--runtime-config` change), then stops: the controller asks again on its interval and
/// follows, without a restart. A DRA gate first advertises its resource in the node status
/// (`NodeStatusFallback`), then offers it through a slice (`DRA`, the status resource gone,
/// Event `DRAServed`), then falls back again (Event `DRAUnavailable`).
#[tokio::test]
async fn a_dra_gate_follows_the_api_server_into_and_out_of_dra() {
    let dra_off = vec!["--runtime-config=resource.k8s.io/v1=false".to_owned()];
    let mut cp = meshgate_testenv::ControlPlane::start(meshgate_testenv::Options {
        apiserver_flags: dra_off.clone(),
        ..Default::default()
    })
    .await
    .expect("control plane");
    let client = cp.client().await.unwrap();
    install_crds(&client).await;
    let _replica = Replica::start_with(
        cp.kubeconfig_path.clone(),
        LeaseSettings {
            namespace: LEASE_NS.into(),
            name: LEASE.into(),
            identity: "follows-dra".into(),
            duration: LEASE_SECONDS,
            grace: 1,
        },
        meshgate_controller::nodegate::Settings {
            status_interval: Duration::from_secs(1),
            dra_discovery: Duration::from_secs(1),
            ..Default::default()
        },
        None,
    )
    .await;
    let agents_ns = cp.namespace("agents", &[]).await.unwrap();
    let pool = "follows";
    status_dra_gate(&client, pool, &agents_ns).await;
    let node = "follows-node";
    node_with_ready_agents(&client, &agents_ns, node, pool, Some(true)).await;

    // The condition's reason, and a word of its message (why it falls back).
    let provider_saying = |reason: &'static str, says: &'static str| {
        let client = client.clone();
        async move {
            wait_for(
                &format!("the gate's provider {reason} ({says})"),
                Duration::from_secs(30),
                || async {
                    gate_condition(&client, pool, "ResourceProvider")
                        .await
                        .is_some_and(|(_, r, m)| r == reason && m.contains(says))
                },
            )
            .await;
        }
    };
    let provider = |reason: &'static str| provider_saying(reason, "");
    let status_resource = |client: kube::Client| async move {
        Api::<Node>::all(client)
            .get(node)
            .await
            .ok()
            .and_then(|n| n.status?.capacity)
            .and_then(|c| c.get(RESOURCE).map(|q| q.0.clone()))
    };
    let event = |reason: &'static str| {
        let client = client.clone();
        async move {
            wait_for_event(&client, None, reason).await;
        }
    };

    // Not served: the node status.
    provider("NodeStatusFallback").await;
    wait_for(
        "the resource in the node status",
        Duration::from_secs(30),
        || async { status_resource(client.clone()).await.as_deref() == Some("40") },
    )
    .await;

    // Served from now on: a slice, the status resource gone. Before 1.36 the API server drops
    // the class's extendedResourceName (DRA extended resources are off there): the gate checks
    // the class it can write now and stays on the node status, for that reason.
    cp.restart_apiserver_with(&[])
        .await
        .expect("API server restarted");
    if cp.minor < 36 {
        provider_saying("NodeStatusFallback", "extendedResourceName").await;
        assert_eq!(status_resource(client.clone()).await.as_deref(), Some("40"));
        assert!(slice_of(&client, pool, node).await.is_none(), "no slice");
        eprintln!(
            "measured: Kubernetes 1.{} serving DRA without DRA extended resources: the gate stays on the node status",
            cp.minor
        );
        return;
    }
    let t = Instant::now();
    provider("DRA").await;
    wait_for("the node's slice", Duration::from_secs(30), || async {
        slice_of(&client, pool, node).await.is_some()
    })
    .await;
    let followed = t.elapsed();
    wait_for(
        "the resource gone from the node status",
        Duration::from_secs(30),
        || async { status_resource(client.clone()).await.is_none() },
    )
    .await;
    event("DRAServed").await;

    // Not served again: back to the node status.
    cp.restart_apiserver_with(&dra_off)
        .await
        .expect("API server restarted");
    provider("NodeStatusFallback").await;
    wait_for(
        "the resource in the node status again",
        Duration::from_secs(30),
        || async { status_resource(client.clone()).await.as_deref() == Some("40") },
    )
    .await;
    event("DRAUnavailable").await;
    eprintln!(
        "measured: the API server restarted serving DRA; the gate offered a slice {} ms after it was ready (discovery every 1 s)",
        followed.as_millis()
    );
}

/// A DRA gate on a node whose kubelet is older than 1.36 (it would admit the pod without
/// preparing the scheduler's claim, so nothing would check the mesh): the resource is advertised
/// in that node's status instead, with no slice, said in an Event on the node and in the gate's
/// condition; the pod is served natively. When the kubelet is upgraded, the node gets a slice and
/// loses the status resource.
#[tokio::test]
async fn a_dra_gate_serves_an_older_kubelet_through_the_node_status() {
    let (client, cp, _) = setup().await;
    let agents_ns = cp.namespace("agents-oldkubelet", &[]).await.unwrap();
    let apps_ns = cp.namespace("apps-oldkubelet", &[]).await.unwrap();
    let pool = format!("old-{agents_ns}");
    let resource = "old.example.com/mesh-ready";
    let class = dra_gate(
        &client,
        &pool,
        &agents_ns,
        json!({"resource": {"name": resource, "provider": "DRA", "count": 40}}),
    )
    .await;
    if class.spec.extended_resource_name.is_none() {
        eprintln!(
            "skipped: Kubernetes 1.{} dropped extendedResourceName (the whole gate falls back)",
            cp.minor
        );
        return;
    }
    let node = format!("{pool}-node");
    create_node(&client, &node, &pool, &[]).await;
    let nodes = Api::<Node>::all(client.clone());
    let kubelet = |v: &str| json!({"status": {"nodeInfo": {"kubeletVersion": v}}});
    nodes
        .patch_status(
            &node,
            &PatchParams::default(),
            &Patch::Merge(kubelet("v1.35.4")),
        )
        .await
        .unwrap();
    node_plugin_pod(&client, &node, true).await;
    agent(&client, &agents_ns, "cni", "cni", &node).await;
    agent(&client, &agents_ns, "proxy", "node-proxy", &node).await;
    set_ready(&client, &agents_ns, "cni", true).await;
    set_ready(&client, &agents_ns, "proxy", true).await;
    let capacity = |n: Node| {
        n.status
            .and_then(|s| s.capacity)
            .unwrap_or_default()
            .get(resource)
            .map(|q| q.0.clone())
    };
    wait_for(
        "the resource in the node status",
        Duration::from_secs(30),
        || async { capacity(nodes.get(&node).await.unwrap()).as_deref() == Some("40") },
    )
    .await;
    assert!(
        slice_of(&client, &pool, &node).await.is_none(),
        "no slice for a kubelet that would not prepare its claim"
    );
    wait_for(
        "the gate to count the node",
        Duration::from_secs(30),
        || async {
            gate_condition(&client, &pool, "ResourceProvider")
                .await
                .is_some_and(|(s, r, m)| {
                    s == "True"
                        && r == "DRA"
                        && m.contains("1 node(s) whose kubelet is older than 1.36")
                })
        },
    )
    .await;
    // An Event on the node names its kubelet (Events are recorded off the reconcile's path).
    let said = || async {
        Api::<k8s_openapi::api::events::v1::Event>::all(client.clone())
            .list(&Default::default())
            .await
            .map(|l| l.items)
            .unwrap_or_default()
            .into_iter()
            .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(node.as_str()))
            .filter_map(|e| e.note)
            .find(|n| n.contains("in the node status"))
    };
    wait_for("an Event on the node", Duration::from_secs(30), || async {
        said().await.is_some()
    })
    .await;
    let said = said().await;
    assert!(
        said.as_deref().is_some_and(|n| n.contains("v1.35.4")),
        "an Event on the node names its kubelet: {said:?}"
    );
    // A pod requesting the resource binds there, served natively (no claim).
    let mut pod = mesh_pod("old-kubelet", &pool);
    pod.spec.as_mut().unwrap().containers[0].resources = Some(
        serde_json::from_value(json!({"requests": {resource: "1"}, "limits": {resource: "1"}}))
            .unwrap(),
    );
    Api::<Pod>::namespaced(client.clone(), &apps_ns)
        .create(&PostParams::default(), &pod)
        .await
        .unwrap();
    wait_for("the pod to bind", Duration::from_secs(30), || async {
        node_of(&client, &apps_ns, "old-kubelet").await.as_deref() == Some(node.as_str())
    })
    .await;
    let p = Api::<Pod>::namespaced(client.clone(), &apps_ns)
        .get("old-kubelet")
        .await
        .unwrap();
    assert!(
        p.status
            .and_then(|s| s.extended_resource_claim_status)
            .is_none(),
        "served by the node status, not a claim"
    );
    // The kubelet is upgraded: a slice, and the status resource withdrawn.
    nodes
        .patch_status(
            &node,
            &PatchParams::default(),
            &Patch::Merge(kubelet("v1.36.3")),
        )
        .await
        .unwrap();
    wait_for("the node's slice", Duration::from_secs(30), || async {
        slice_of(&client, &pool, &node).await.is_some()
    })
    .await;
    wait_for(
        "the status resource withdrawn",
        Duration::from_secs(30),
        || async { capacity(nodes.get(&node).await.unwrap()).is_none() },
    )
    .await;
}
