//! Faults on the real control plane: kube-apiserver and etcd restart while the node gate
//! controller runs. It converges afterwards, and no node whose agents are not all Ready is
//! untainted at any time.
//!
//! Each test has a private control plane (restarts would disturb shared ones).
//! Run: `cargo test --workspace --test faults`.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::*;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, Patch, PatchParams, PostParams};
use meshgate_api::NodeGate;
use meshgate_testenv::{ControlPlane, Options};
use serde_json::json;

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

/// A private control plane with the CRDs, a gate, the controller, and two nodes: `held` (one
/// agent never Ready) and `released` (becomes ready after the fault). A watcher records whether
/// `held` is ever seen without its taint.
struct Scene {
    cp: ControlPlane,
    client: kube::Client,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    wrongly_untainted: Arc<AtomicBool>,
    watcher: tokio::task::JoinHandle<()>,
}

async fn scene() -> Scene {
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
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
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
            Duration::from_secs(30),
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
        stop: Some(stop),
        wrongly_untainted,
        watcher,
    }
}

impl Scene {
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
        tokio::time::sleep(Duration::from_secs(1)).await;
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
    let mut scene = scene().await;
    scene.cp.restart_etcd().await.expect("etcd restarted");
    scene.converges().await;
}
