//! `meshgate uninstall` on the real API server: after `install --apply`, a node tainted and
//! marked by meshgate (and carrying another component's taint), a gate holding meshgate's
//! finalizer and a compiled native policy, uninstall removes the admission registrations first,
//! then the nodes' taints, annotations and resources meshgate owns, then everything else
//! `install` created, and with `--crds` the CRDs; another component's taint stays; a second run
//! succeeds and changes nothing.
//!
//! Run: `cargo test -p meshgate --test uninstall`.

mod common;

use std::collections::BTreeMap;

use common::*;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::ResourceExt;
use kube::api::{Api, ApiResource, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use meshgate_api::NodeGate;
use serde_json::json;

fn meshgate_cli(cp: &meshgate_testenv::ControlPlane, args: &[&str]) -> (bool, String) {
    let out = meshgate_on(cp, args);
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

fn resource(group: &str, version: &str, kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &kube::api::GroupVersionKind::gvk(group, version, kind),
        plural,
    )
}

/// The version of the admission-policy API this API server serves (`v1beta1` on 1.34 and
/// 1.35).
async fn policy_version(client: &kube::Client) -> &'static str {
    let api = meshgate::discovery::policy_api(client)
        .await
        .expect("the policy API is served");
    api.api_version()
        .rsplit('/')
        .next()
        .expect("a group/version")
}

/// Every object of meshgate's (by its label) in the kinds `install` writes, as `Kind/name`.
async fn meshgate_objects(client: &kube::Client, ns: &str) -> Vec<String> {
    let policy = policy_version(client).await;
    let kinds = [
        (
            "admissionregistration.k8s.io",
            "v1",
            "MutatingWebhookConfiguration",
            "mutatingwebhookconfigurations",
            false,
        ),
        (
            "admissionregistration.k8s.io",
            policy,
            "MutatingAdmissionPolicy",
            "mutatingadmissionpolicies",
            false,
        ),
        (
            "admissionregistration.k8s.io",
            policy,
            "MutatingAdmissionPolicyBinding",
            "mutatingadmissionpolicybindings",
            false,
        ),
        (
            "rbac.authorization.k8s.io",
            "v1",
            "ClusterRole",
            "clusterroles",
            false,
        ),
        (
            "rbac.authorization.k8s.io",
            "v1",
            "ClusterRoleBinding",
            "clusterrolebindings",
            false,
        ),
        ("apps", "v1", "Deployment", "deployments", true),
        ("", "v1", "Service", "services", true),
        ("", "v1", "ConfigMap", "configmaps", true),
        ("", "v1", "ServiceAccount", "serviceaccounts", true),
        (
            "policy",
            "v1",
            "PodDisruptionBudget",
            "poddisruptionbudgets",
            true,
        ),
        ("rbac.authorization.k8s.io", "v1", "Role", "roles", true),
        (
            "rbac.authorization.k8s.io",
            "v1",
            "RoleBinding",
            "rolebindings",
            true,
        ),
    ];
    let mut out = Vec::new();
    for (g, v, kind, plural, namespaced) in kinds {
        let ar = resource(g, v, kind, plural);
        let api: Api<DynamicObject> = if namespaced {
            Api::namespaced_with(client.clone(), ns, &ar)
        } else {
            Api::all_with(client.clone(), &ar)
        };
        let list = api
            .list(&ListParams::default().labels("app.kubernetes.io/managed-by=meshgate"))
            .await
            .expect("list");
        out.extend(
            list.items
                .iter()
                .map(|o| format!("{kind}/{}", o.name_any())),
        );
    }
    out
}

#[tokio::test]
async fn uninstall_removes_meshgate_and_leaves_no_node_tainted() {
    let cp = control_plane(false).await;
    let client = cp.client().await.expect("client");
    let ns = "meshgate-system";
    let (ok, log) = meshgate_cli(
        &cp,
        &[
            "install",
            "--profile",
            "istio-ambient",
            "--namespace",
            ns,
            "--apply",
        ],
    );
    assert!(ok, "install: {log}");
    let before = meshgate_objects(&client, ns).await;
    for kind in [
        "MutatingWebhookConfiguration/",
        "MutatingAdmissionPolicy/",
        "Deployment/meshgate-controller",
        "ClusterRole/meshgate-controller",
    ] {
        assert!(
            before.iter().any(|o| o.starts_with(kind)),
            "{kind} after install: {before:?}"
        );
    }

    // What the running system would have left: a gate with meshgate's finalizer, a node it
    // tainted, released once and gave the gate resource, another component's taint on it, and a
    // compiled native policy.
    let gates: Api<NodeGate> = Api::all(client.clone());
    let gate = gates
        .list(&ListParams::default())
        .await
        .expect("gates")
        .items
        .into_iter()
        .next()
        .expect("install made a NodeGate");
    let gate_key = gate.spec.taint.key.clone();
    gates
        .patch(
            &gate.name_any(),
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": ["meshgate.dev/node-gate"]}})),
        )
        .await
        .expect("finalizer");
    let nodes: Api<Node> = Api::all(client.clone());
    let node: Node = serde_json::from_value(json!({
        // meshgate records a key outside its own domain as its own when it adds the taint.
        "metadata": {"name": "uninstall-node", "annotations": {
            "meshgate.dev/agents-ready-since": "2026-11-30T00:00:00Z",
            "meshgate.dev/owned-taints": gate_key}},
        "spec": {"taints": [
            {"key": gate_key, "effect": "NoSchedule"},
            {"key": "example.com/other", "effect": "NoSchedule"},
        ]},
    }))
    .expect("node");
    nodes
        .create(&PostParams::default(), &node)
        .await
        .expect("node created");
    nodes
        .patch_status(
            "uninstall-node",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {
                "capacity": {"meshgate.dev/mesh-ready": "110", "pods": "110"},
                "allocatable": {"meshgate.dev/mesh-ready": "110", "pods": "110"}}})),
        )
        .await
        .expect("resource advertised");
    let policy = policy_version(&client).await;
    let maps: Api<DynamicObject> = Api::all_with(
        client.clone(),
        &resource(
            "admissionregistration.k8s.io",
            policy,
            "MutatingAdmissionPolicy",
            "mutatingadmissionpolicies",
        ),
    );
    let native: DynamicObject = serde_json::from_value(json!({
        "apiVersion": format!("admissionregistration.k8s.io/{policy}"), "kind": "MutatingAdmissionPolicy",
        "metadata": {"name": "meshgate-policy-example", "labels": {
            "app.kubernetes.io/managed-by": "meshgate", "meshgate.dev/mutation-policy": "example"}},
        "spec": {
            "matchConstraints": {"resourceRules": [{"apiGroups": [""], "apiVersions": ["v1"],
                "operations": ["CREATE"], "resources": ["configmaps"]}]},
            "failurePolicy": "Ignore",
            "reinvocationPolicy": "Never",
            "mutations": [{"patchType": "ApplyConfiguration", "applyConfiguration": {
                "expression": "Object{metadata: Object.metadata{labels: {\"a\": \"b\"}}}"}}],
        },
    }))
    .expect("policy");
    maps.create(&PostParams::default(), &native)
        .await
        .expect("native policy");

    // Uninstall, with the CRDs.
    let (ok, log) = meshgate_cli(
        &cp,
        &["uninstall", "--namespace", ns, "--crds", "--wait", "10s"],
    );
    assert!(ok, "uninstall: {log}");
    let position = |needle: &str| {
        log.find(needle)
            .unwrap_or_else(|| panic!("{needle:?} not in the uninstall log:\n{log}"))
    };
    // The order: registrations, then the nodes, then the rest.
    assert!(
        position("deleted MutatingWebhookConfiguration")
            < position("node uninstall-node: removed taints")
    );
    assert!(
        position("deleted MutatingAdmissionPolicy meshgate-policy-example")
            < position("node uninstall-node: removed taints")
    );
    assert!(
        position("deleted Deployment meshgate-controller")
            < position("node uninstall-node: removed taints")
    );
    assert!(
        position("node uninstall-node: removed taints")
            < position("deleted ClusterRole meshgate-controller")
    );

    let left = meshgate_objects(&client, ns).await;
    assert!(left.is_empty(), "left after uninstall: {left:?}");
    let node = nodes.get("uninstall-node").await.expect("node");
    let taints: Vec<String> = node
        .spec
        .and_then(|s| s.taints)
        .unwrap_or_default()
        .into_iter()
        .map(|t| t.key)
        .collect();
    // (The node lifecycle controller adds its own not-ready taint to this kubelet-less node.)
    assert!(
        !taints.contains(&gate_key),
        "meshgate's taint is gone: {taints:?}"
    );
    assert!(
        taints.iter().any(|t| t == "example.com/other"),
        "another component's taint stays: {taints:?}"
    );
    let annotations = node.metadata.annotations.unwrap_or_default();
    assert!(
        !annotations.keys().any(|k| k.starts_with("meshgate.dev/")),
        "{annotations:?}"
    );
    let capacity: BTreeMap<String, _> = node
        .status
        .and_then(|s| s.capacity)
        .unwrap_or_default()
        .into_iter()
        .collect();
    assert!(
        !capacity.contains_key("meshgate.dev/mesh-ready"),
        "{capacity:?}"
    );
    assert!(capacity.contains_key("pods"));
    let namespace = Api::<k8s_openapi::api::core::v1::Namespace>::all(client.clone())
        .get_opt(ns)
        .await
        .expect("namespace");
    assert!(
        namespace.is_none_or(|n| n.metadata.deletion_timestamp.is_some()),
        "the install namespace is deleted"
    );
    let crds: Vec<String> = Api::<CustomResourceDefinition>::all(client.clone())
        .list(&ListParams::default())
        .await
        .expect("crds")
        .items
        .into_iter()
        .filter(|c| c.spec.group == "meshgate.dev" && c.metadata.deletion_timestamp.is_none())
        .map(|c| c.name_any())
        .collect();
    assert!(crds.is_empty(), "{crds:?}");

    // Safe to re-run.
    let (ok, log) = meshgate_cli(
        &cp,
        &["uninstall", "--namespace", ns, "--crds", "--wait", "10s"],
    );
    assert!(ok, "second uninstall: {log}");
    assert!(
        !log.contains("deleted "),
        "the second run changes nothing: {log}"
    );
}
