//! `meshgate status pod NS/NAME` on the real API server: a gated pod whose gate runs on a node
//! the profile's gate still holds says what its gate waits for, for how long, and which gate of
//! its node is not ready; a pod whose gate passed and a pod without a gate say so.
//!
//! Run: `cargo test -p meshgate --test status_pod`.

mod common;

use common::*;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use meshgate_api::NodeGate;
use serde_json::{Value, json};

fn status_pod(cp: &meshgate_testenv::ControlPlane, pod: &str) -> Value {
    let out = meshgate_on(cp, &["status", "pod", pod, "-o", "json"]);
    assert!(
        out.status.success(),
        "status pod {pod}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON report")
}

async fn pod_with_gate(client: &kube::Client, ns: &str, name: &str, state: Value) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name, "annotations": {"meshgate.dev/gate": "gated: tcp-listening 15008"}},
        "spec": {
            "nodeName": "status-node",
            "initContainers": [{"name": "meshgate-wait", "image": "meshgate/meshgate:1",
                                "args": ["tcp-listening", "15008"]}],
            "containers": [{"name": "app", "image": "registry.invalid/app:1"}],
        },
    }))
    .expect("pod");
    pods.create(&PostParams::default(), &pod)
        .await
        .expect("pod created");
    pods.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"phase": "Pending", "initContainerStatuses": [
            {"name": "meshgate-wait", "ready": false, "restartCount": 0, "image": "meshgate/meshgate:1",
             "imageID": "", "state": state}]}})),
    )
    .await
    .expect("status");
}

#[tokio::test]
async fn status_pod_says_why_a_pod_waits() {
    let cp = control_plane(false).await;
    let client = cp.client().await.expect("client");
    install_applied(&cp, "istio-ambient", "meshgate-system");
    let gate = Api::<NodeGate>::all(client.clone())
        .list(&ListParams::default())
        .await
        .expect("gates")
        .items
        .into_iter()
        .next()
        .expect("install made a gate");
    let node: Node = serde_json::from_value(json!({
        "metadata": {"name": "status-node"},
        "spec": {"taints": [{"key": gate.spec.taint.key, "effect": "NoSchedule"}]},
    }))
    .expect("node");
    Api::<Node>::all(client.clone())
        .create(&PostParams::default(), &node)
        .await
        .expect("node");
    let ns = cp.namespace("status", &[]).await.expect("namespace");

    pod_with_gate(
        &client,
        &ns,
        "waiting",
        json!({"running": {"startedAt": "2026-01-01T00:00:00Z"}}),
    )
    .await;
    let r = status_pod(&cp, &format!("{ns}/waiting"));
    assert_eq!(r["gated"], true, "{r:#}");
    assert_eq!(r["gate"], "waiting", "{r:#}");
    assert_eq!(r["waitsFor"], "tcp-listening 15008", "{r:#}");
    assert_eq!(r["verdict"], "gated: tcp-listening 15008", "{r:#}");
    assert!(r["waitingSeconds"].as_i64().is_some_and(|s| s > 0), "{r:#}");
    let gates = r["nodeGates"].as_array().expect("node gates");
    assert_eq!(gates.len(), 1, "{r:#}");
    assert_eq!(gates[0]["tainted"], true, "{r:#}");
    assert_eq!(gates[0]["agentsReady"], "0/2", "{r:#}");
    let summary = r["summary"].as_str().expect("summary");
    assert!(
        summary.contains("waiting")
            && summary.contains("tcp-listening 15008")
            && summary.contains(&format!(
                "gate {}",
                gate.metadata.name.clone().unwrap_or_default()
            )),
        "{summary}"
    );

    pod_with_gate(
        &client,
        &ns,
        "passed",
        json!({"terminated": {"exitCode": 0, "finishedAt": "2026-01-01T00:00:05Z"}}),
    )
    .await;
    let r = status_pod(&cp, &format!("{ns}/passed"));
    assert_eq!(r["gate"], "passed", "{r:#}");

    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let plain: Pod = serde_json::from_value(json!({
        "metadata": {"name": "plain"},
        "spec": {"containers": [{"name": "app", "image": "registry.invalid/app:1"}]},
    }))
    .expect("pod");
    pods.create(&PostParams::default(), &plain)
        .await
        .expect("pod");
    let r = status_pod(&cp, &format!("{ns}/plain"));
    assert_eq!(
        (r["gated"].clone(), r["gate"].clone()),
        (json!(false), json!("not-gated")),
        "{r:#}"
    );

    let out = meshgate_on(&cp, &["status", "pod", "no-slash"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("expected NAMESPACE/NAME"));
}
