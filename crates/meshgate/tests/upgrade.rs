//! The upgrade from the default install of `481bbe6` (the resource strategy, the gate keyed
//! `node.meshgate.dev/agent-not-ready`) to today's default (the taint strategy, keyed
//! `readiness.k8s.io/mesh-agents`), with a node tainted under the old key and a mesh pod held by
//! it, on the real API server and scheduler. The old install is rendered by today's binary with
//! the old defaults given as flags (`--strategy resource --taint-key
//! node.meshgate.dev/agent-not-ready`): the same NodeGate, configuration and admission policy as
//! `481bbe6` renders, and meshgate's Deployments tolerating the old key. The webhook and the
//! controller run out of the cluster as their installed ServiceAccounts; the Node and the
//! agents' pods are objects the test creates and whose status it sets (no kubelet).
//!
//! Asserted from a watch of the Node: from the upgrade on, the node never carries neither key
//! while its agents are not Ready; the gate's new key replaces the old one; the pod admitted
//! before the upgrade (it requests `meshgate.dev/mesh-ready`) and one admitted after (held by the
//! taint alone) stay unbound until the agents are Ready, then both are bound: no pod early, no
//! deadlock, the old key gone.
//!
//! Run: `cargo test -p meshgate --test upgrade`.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use meshgate_api::names::{DEFAULT_TAINT_KEY, STARTUP_TAINT_KEY};
use serde_json::json;

use common::{ControllerTask, Webhook};

const NS: &str = "meshgate-system";
const NODE: &str = "upgrade-node";

/// A state of the Node: its revision and taint keys.
type Seen = (u64, Vec<String>);

async fn cli(cp: &meshgate_testenv::ControlPlane, args: &[&str]) -> String {
    let kubeconfig = cp.kubeconfig_path.clone();
    let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(common::meshgate_bin())
            .args(&args)
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .output()
            .expect("meshgate runs")
    })
    .await
    .expect("cli");
    let said = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "meshgate: {said}");
    said
}

/// The webhook (registered by URL) and the controller of the installed configuration.
async fn components(
    cp: &meshgate_testenv::ControlPlane,
    client: &kube::Client,
) -> (Webhook, ControllerTask) {
    let text = Api::<k8s_openapi::api::core::v1::ConfigMap>::namespaced(client.clone(), NS)
        .get("meshgate-config")
        .await
        .expect("configuration")
        .data
        .and_then(|d| d.get("config.yaml").cloned())
        .expect("config.yaml");
    let config = meshgate_api::GateConfig::from_yaml("meshgate-config", &text).expect("config");
    let webhook = common::start_webhook_as(cp, config.clone(), Some(NS)).await;
    let _ = Api::<k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration>::all(
        client.clone(),
    )
    .delete("meshgate", &DeleteParams::default())
    .await;
    common::register(
        client,
        &webhook.registration("meshgate", &config, true, false),
    )
    .await;
    let controller = ControllerTask::start(
        cp,
        NS,
        meshgate::run::ControllerSettings {
            excluded_namespaces: Some(config.excluded_namespaces.clone()),
            ..Default::default()
        },
    );
    (webhook, controller)
}

fn keys(n: &Node) -> Vec<String> {
    n.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .map(|ts| ts.iter().map(|t| t.key.clone()).collect())
        .unwrap_or_default()
}

/// Sets an agent pod's readiness; returns the revision of the write.
async fn set_ready(client: &kube::Client, name: &str, ready: bool) -> u64 {
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let status = json!({"status": {"phase": "Running", "conditions": [
        {"type": "Ready", "status": if ready { "True" } else { "False" }, "lastTransitionTime": now},
    ]}});
    let pod = Api::<Pod>::namespaced(client.clone(), "istio-system")
        .patch_status(
            name,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&status),
        )
        .await
        .expect("agent status");
    revision(&pod.metadata)
}

fn revision(meta: &kube::api::ObjectMeta) -> u64 {
    meta.resource_version
        .as_deref()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

async fn node_of(pods: &Api<Pod>, name: &str) -> Option<String> {
    pods.get(name).await.ok()?.spec?.node_name
}

#[tokio::test]
async fn the_upgrade_to_the_taint_strategy_keeps_every_node_and_pod_held_and_lifts_the_old_key() {
    let cp = meshgate_testenv::ControlPlane::start(meshgate_testenv::Options {
        scheduler: true,
        ..Default::default()
    })
    .await
    .expect("control plane");
    let client = cp.client().await.expect("client");

    // The install of 481bbe6.
    cli(
        &cp,
        &[
            "install",
            "--profile",
            "istio-ambient",
            "--namespace",
            NS,
            "--strategy",
            "resource",
            "--taint-key",
            DEFAULT_TAINT_KEY,
            "--apply",
        ],
    )
    .await;
    let (old_webhook, old_controller) = components(&cp, &client).await;

    // A node registers (tainted at CREATE under the old key), its agents not Ready. The API
    // server's admission policies follow their objects asynchronously: a dry-run create first.
    let nodes: Api<Node> = Api::all(client.clone());
    common::wait_registration_taint(&client, DEFAULT_TAINT_KEY, true).await;
    let node: Node = serde_json::from_value(json!({"metadata": {"name": NODE}})).expect("node");
    let created = nodes
        .create(&PostParams::default(), &node)
        .await
        .expect("node");
    assert!(keys(&created).iter().any(|k| k == DEFAULT_TAINT_KEY));
    meshgate_testenv::make_node_ready(&client, NODE)
        .await
        .expect("node ready");
    let system: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    let _ = system
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "istio-system"}})).expect("ns"),
        )
        .await;
    for (name, label) in [
        ("istio-cni-node-a", ("k8s-app", "istio-cni-node")),
        ("ztunnel-a", ("app", "ztunnel")),
    ] {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": name, "labels": {label.0: label.1}},
            "spec": {"nodeName": NODE, "tolerations": [{"operator": "Exists"}],
                     "containers": [{"name": "agent", "image": "mesh/agent"}]},
        }))
        .expect("agent");
        Api::<Pod>::namespaced(client.clone(), "istio-system")
            .create(&PostParams::default(), &pod)
            .await
            .expect("agent pod");
        set_ready(&client, name, false).await;
    }

    // A mesh pod admitted before the upgrade: it requests the resource and waits.
    let ns = cp
        .namespace("mesh", &[("istio.io/dataplane-mode", "ambient")])
        .await
        .expect("namespace");
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let mesh_pod = |name: &str| -> Pod {
        serde_json::from_value(json!({"metadata": {"name": name},
            "spec": {"containers": [{"name": "app", "image": "app"}]}}))
        .expect("pod")
    };
    let before = pods
        .create(&PostParams::default(), &mesh_pod("before"))
        .await
        .expect("pod");
    let requests = before.spec.as_ref().and_then(|s| {
        s.containers[0]
            .resources
            .as_ref()
            .and_then(|r| r.requests.as_ref())
            .map(|r| r.contains_key(meshgate_api::names::DEFAULT_RESOURCE))
    });
    assert_eq!(
        requests,
        Some(true),
        "the old default: the pod requests the gate resource"
    );

    // Watch the node from here on: every taint list it is seen with.
    let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
    let (s, api) = (seen.clone(), nodes.clone());
    let watch = tokio::spawn(async move {
        let stream = watcher(
            api,
            watcher::Config::default().fields(&format!("metadata.name={NODE}")),
        )
        .applied_objects();
        futures::pin_mut!(stream);
        while let Some(Ok(n)) = stream.next().await {
            s.lock()
                .expect("seen")
                .push((revision(&n.metadata), keys(&n)));
        }
    });

    // The upgrade: today's install, its components in place of the old ones.
    old_controller.finish().await;
    drop(old_webhook);
    // The test's registration by URL (its webhook runs out of the cluster) gives way to the
    // installed one, which names the in-cluster Service.
    let _ = Api::<k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration>::all(
        client.clone(),
    )
    .delete("meshgate", &DeleteParams::default())
    .await;
    let said = cli(
        &cp,
        &[
            "install",
            "--profile",
            "istio-ambient",
            "--namespace",
            NS,
            "--apply",
        ],
    )
    .await;
    assert!(
        said.contains("gate taint: readiness.k8s.io/mesh-agents"),
        "{said}"
    );
    let (_webhook, controller) = components(&cp, &client).await;

    // The gate's new key replaces the old one on the node whose agents are not Ready.
    common::wait_for(
        "the new key on the node, the old one gone",
        Duration::from_secs(60),
        || async {
            nodes.get(NODE).await.is_ok_and(|n| {
                let k = keys(&n);
                k.iter().any(|k| k == STARTUP_TAINT_KEY)
                    && !k.iter().any(|k| k == DEFAULT_TAINT_KEY)
            })
        },
    )
    .await;
    let after = pods
        .create(&PostParams::default(), &mesh_pod("after"))
        .await
        .expect("pod");
    let verdict = after
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(meshgate_api::names::GATE_VERDICT))
        .cloned();
    assert_eq!(
        verdict.as_deref(),
        Some("gated: taint readiness.k8s.io/mesh-agents")
    );
    // The scheduler has seen both pods and the node's new taints: each is unschedulable.
    for name in ["before", "after"] {
        common::wait_for(
            &format!("the scheduler to report {name} unschedulable"),
            Duration::from_secs(30),
            || async {
                pods.get(name).await.is_ok_and(|p| {
                    p.status.and_then(|s| s.conditions).is_some_and(|cs| {
                        cs.iter().any(|c| {
                            c.type_ == "PodScheduled"
                                && c.status == "False"
                                && c.reason.as_deref() == Some("Unschedulable")
                        })
                    })
                })
            },
        )
        .await;
        assert_eq!(
            node_of(&pods, name).await,
            None,
            "{name} is not bound early"
        );
    }

    // The agents become Ready: the taint lifts, the resource is offered, both pods bind.
    set_ready(&client, "istio-cni-node-a", true).await;
    let agents_ready = set_ready(&client, "ztunnel-a", true).await;
    for name in ["before", "after"] {
        common::wait_for(
            &format!("{name} bound to the node (no deadlock)"),
            Duration::from_secs(60),
            || async { node_of(&pods, name).await.as_deref() == Some(NODE) },
        )
        .await;
    }
    watch.abort();
    let lists = seen.lock().expect("seen").clone();
    // Before the agents were Ready (the etcd revisions order the writes), the node carried one of
    // the two keys in every state it was seen in.
    let held = |k: &Vec<String>| {
        k.iter()
            .any(|k| k == STARTUP_TAINT_KEY || k == DEFAULT_TAINT_KEY)
    };
    let unheld: Vec<&(u64, Vec<String>)> = lists
        .iter()
        .filter(|(rv, k)| *rv < agents_ready && !held(k))
        .collect();
    assert!(
        unheld.is_empty(),
        "the node was free of both keys before its agents were Ready: {lists:?}"
    );
    assert!(
        lists.iter().any(|(rv, k)| *rv < agents_ready && held(k)),
        "{lists:?}"
    );
    let node = nodes.get(NODE).await.expect("node");
    assert!(
        !keys(&node)
            .iter()
            .any(|k| k == DEFAULT_TAINT_KEY || k == STARTUP_TAINT_KEY),
        "released, the old key gone: {:?}",
        keys(&node)
    );
    eprintln!("measured: the node's taint lists from the upgrade on: {lists:?}");
    controller.finish().await;
}
